"""`--quantization 8bit|4bit` (bitsandbytes, which runs on a CPU too): a tiny target loads
quantized through the same builder as every command and answers, plainly and speculatively.
As in bfloat16, a quantized verify pass over several tokens can round differently from a
one-token pass (measured here: the answers part after a few tokens), so only the prefill's
first token is the same in both."""

from __future__ import annotations

import pytest

from app_ui.setup import read_config
from engine.build import EngineSpec, build_engine
from engine.loop import DecodeSettings
from models.loading import LoadOptions
from models import tiny


@pytest.mark.usefixtures("one_thread")
# 4-bit on a CPU packs weights in blocks of 64 inputs; the tiny vision tower is 32 wide, so the
# 4-bit case asks about text only (real vision towers are hundreds wide).
@pytest.mark.parametrize("bits, layer, num_images", [("8bit", "Linear8bitLt", 1), ("4bit", "Linear4bit", 0)])
def test_a_quantized_target_answers_plainly_and_speculatively(zoo, bits, layer, num_images):
    options = LoadOptions(dtype="float32", device="cpu", quantization=bits)
    engine = build_engine(EngineSpec(str(zoo.dir("qwen2_vl")), ("ngram",), options))
    assert any(type(module).__name__ == layer for module in engine.target.model.modules())
    content = [{"type": "image", "image": image} for image in tiny.tiny_images(num_images)]
    messages = [{"role": "user", "content": content + [{"type": "text", "text": "Describe it, then again."}]}]
    decode = DecodeSettings(max_new_tokens=12, stop_token_ids=frozenset({-1}))
    plain = list(engine.stream(messages, decode=decode))[-1]
    speculative = list(engine.stream(messages, drafter="ngram", decode=decode))[-1]
    assert len(plain.token_ids) == len(speculative.token_ids) == 12
    assert speculative.token_ids[0] == plain.token_ids[0]
    assert speculative.stats.fallback_reason is None and speculative.stats.mode == "speculative"


def test_the_app_reads_quantization_from_its_flag_or_variable():
    assert read_config(["--quantization", "8bit"], {}).spec.options.quantization == "8bit"
    assert read_config([], {"VLM_QUANTIZATION": "4bit"}).spec.options.quantization == "4bit"
    assert read_config([], {}).spec.options.quantization is None
