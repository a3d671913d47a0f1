"""`--quantization 8bit|4bit` (bitsandbytes, which runs on a CPU too): a tiny target loads
quantized through the same builder as every command and answers, plainly and speculatively.
As in bfloat16, a quantized verify pass over several tokens can round differently from a
one-token pass (measured here: the answers part after a few tokens), so only the prefill's
first token is the same in both.

`--quantization int8` (the fast decode path's int8 weights): the logits of decode and verify
passes stay close to the unquantized ones (tolerance below); the option is refused, in one
line, where the fast path does not cover the model."""

from __future__ import annotations

import pytest
import torch

from app_ui.setup import read_config
from engine.build import EngineSpec, build_engine
from engine.engine import Engine
from engine.quantized import QUANTIZED, Int8Weight
from engine.loop import DecodeSettings
from engine.target import load_target
from models.loading import LoadError, LoadOptions
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


# int8 against the same weights unquantized. Per-row int8 moves a tiny model's weights by 0.6 %
# (relative norm); through its random layers (weights of std 0.2) that is 2-8 % of its logits
# (measured: worst entry 0.21-0.44 of logits up to 5.6-6.6; greedy tokens equal in 17-20 of 20
# steps). A real model's logits move far less; these bounds catch a wrong scale or layout, which
# moves them by about 100 %. w8a8 (int8 activations too, engine/quantized.py) adds the activations'
# rounding (a step of 1/127 of each row's largest value). q4_0 (llama.cpp's 4-bit blocks of 32, a step of
# 1/8 of each block's largest |w|) moves the weights by about 8 %, ~13x int8's, and the logits alike
# (measured: relative RMS 0.32-0.40, worst entry 0.55-0.61 of the largest; greedy tokens equal in 5-7 of 12).
BOUNDS = {"int8": (0.05, 0.12), "w8a8": (0.08, 0.2), "q4_0": (0.55, 0.8)}  # relative RMS, worst entry / largest


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("quantization", ("int8", "w8a8", "q4_0"))
@pytest.mark.parametrize("family, dtype", [("qwen2_vl", "bfloat16"), ("smolvlm", "float32")])
def test_int8_weights_give_logits_close_to_the_unquantized_ones(zoo, family, dtype, quantization):
    plain, int8 = (load_target(str(zoo.dir(family)), LoadOptions(dtype=dtype, device="cpu", quantization=q))
                   for q in (None, quantization))
    kind = QUANTIZED[quantization]
    assert type(int8.runner.fast.stack.layers[0].qkv_weight) is kind and type(int8.runner.fast.head_weight) is kind
    content = [{"type": "image", "image": tiny.tiny_images(1, seed=3)[0]}, {"type": "text", "text": "Say more."}]
    inputs = Engine(plain).prepare([{"role": "user", "content": content}]).target_inputs
    (logits, plain_state), (_, int8_state) = plain.runner.prefill(inputs), int8.runner.prefill(inputs)
    token, passes, agree = int(logits.argmax()), [], 0
    for _ in range(12):  # decode passes on the unquantized model's greedy tokens
        passes.append((plain.runner.extend(plain_state, [token]), int8.runner.extend(int8_state, [token])))
        agree += int(passes[-1][0].argmax() == passes[-1][1].argmax())
        token = int(passes[-1][0].argmax())
    passes.append(tuple(runner.extend(state, [token, 5, 6, 7])  # a verify pass of 4 tokens
                        for runner, state in ((plain.runner, plain_state), (int8.runner, int8_state))))
    expected, got = torch.cat([p[0] for p in passes]), torch.cat([p[1] for p in passes])
    print(f"{quantization} {family} {dtype}: greedy tokens equal in {agree} of 12 decode passes; relative RMS "
          f"{(got - expected).norm() / expected.norm():.3f}, worst / largest "
          f"{(got - expected).abs().max() / expected.abs().max():.3f}")
    relative_rms, worst_of_largest = BOUNDS[quantization]
    assert (got - expected).norm() <= relative_rms * expected.norm()
    assert (got - expected).abs().max() <= worst_of_largest * expected.abs().max()


def test_int8_is_refused_in_one_line_where_the_fast_path_does_not_reach(zoo):
    with pytest.raises(LoadError, match="--quantization int8 needs the fast decode path") as error:
        load_target(str(zoo.dir("qwen3_vl")), LoadOptions(dtype="float32", device="cpu", quantization="int8"))
    assert "\n" not in str(error.value) and "text model type" in str(error.value)


def test_bfloat16_int8_weights_of_a_width_the_kernel_misreads_are_refused():
    with pytest.raises(ValueError, match="multiple of 16"):  # torch's kernel would crash or misread
        Int8Weight.quantize(torch.randn(19, 8, dtype=torch.bfloat16))  # (in, out)
    assert Int8Weight.quantize(torch.randn(19, 8)).values.shape == (8, 19)  # float32 reads any width


def test_quantizing_in_blocks_of_rows_gives_the_same_weights(monkeypatch):
    """Int8Weight.quantize works a block of rows at a time (memory); the blocks change nothing."""
    from engine import quantized

    weight = torch.randn(64, 37, dtype=torch.bfloat16)  # (in, out): 37 output rows
    whole = Int8Weight.quantize(weight)
    monkeypatch.setattr(quantized, "QUANTIZE_ROWS", 5)  # 8 blocks, the last of 2 rows
    blocks = Int8Weight.quantize(weight)
    assert torch.equal(blocks.values, whole.values) and torch.equal(blocks.scales, whole.scales)
    assert blocks.values.shape == (37, 64) and blocks.values.is_contiguous()
    expected = (weight.t().float() / whole.scales.float()[:, None]).round().clamp(-127, 127)
    assert torch.equal(whole.values.float(), expected)
