"""Drafters with linear-attention layers (a small Qwen3.5) on a tiny Qwen3.5 target (float32).

The drafters, built here:
    text_lm  a Qwen3_5ForCausalLM holding the target's language weights (models/tiny.py
             `build_text_drafter`): layers [linear_attention, full_attention], the target's
             slow decay, so a recurrent state that keeps a rejected token changes the logits.
    vlm      the target's own folder loaded as a VLM drafter (same family, same weights).
Both get a HybridRunner: `propose` checkpoints the cache once it holds the committed answer and a
rejection returns there (engine/linear_attention_rollback.py). What is checked:
- forced acceptance (the real drafter runs, its token choices forced to the true answer with
  tokens corrupted at fixed positions, so every acceptance length happens): the answer is the
  plain one, and every round the drafter's logits equal a from-scratch reference, one uncached
  forward of the drafter's model over its prompt, the committed answer and the forced drafts;
- the power check: with a rollback that does not rewind the recurrent state the same rounds
  give other logits and other greedy proposals;
- unforced: speculative greedy == plain greedy with 0, 1 and 2 images, rejections included;
- the command line on the two folders, plain and speculative, and a draft tree asked for;
- recurrent layer kinds that the rollback has not been checked with are refused at load.
"""

from __future__ import annotations

import json
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch
from transformers import PretrainedConfig

from engine.__main__ import main
from engine.drafters.registry import load_drafter
from engine.engine import Engine
from engine.linear_attention_rollback import HybridRunner
from engine.loop import DecodeSettings
from engine.prompt import encode_text, encode_vlm
from engine.runner import Runner
from models.loading import LoadError, LoadOptions
from models import tiny
from tests import tiny_next
from tests.oracles import uncached_forward
from tests.mocks import ForcedDrafter, assert_forced_acceptance, corrupt
from tests.tiny_next import IMAGE_COUNTS, answer, messages

OPTIONS = LoadOptions(dtype="float32", device="cpu")
DRAFTERS = ("text_lm", "vlm")

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("hybrid-drafter")
    target = tiny_next.build_target("qwen3_5", root / "qwen3_5")
    return SimpleNamespace(target=target, text_lm=tiny.build_text_drafter(target, root / "qwen3_5-text"), vlm=target)


@pytest.fixture(scope="module")
def target(folders):
    return tiny_next.load(folders.target)


@pytest.fixture(scope="module")
def drafters(folders, target):
    return {kind: load_drafter(str(getattr(folders, kind)), target, OPTIONS) for kind in DRAFTERS}


def reference_logits(drafter, prompt, tokens: list[int], num_rows: int) -> torch.Tensor:
    """(num_rows, V): the drafter's logits at the last num_rows of one uncached forward of its
    model over its own view of the prompt + `tokens`, image placeholders masked as `propose` does."""
    model = drafter.runner.model
    if drafter.kind == "vlm":
        inputs = encode_vlm(drafter.encoder, drafter.runner.family, prompt.messages, prompt.max_image_tokens)
        logits = uncached_forward(SimpleNamespace(model=model), replace(prompt, target_inputs=inputs), tokens).logits
    else:
        ids = torch.cat([encode_text(drafter.encoder, prompt.messages)["input_ids"], torch.tensor([tokens])], 1)
        with torch.inference_mode():
            logits = model(input_ids=ids).logits
    blocked = torch.tensor(sorted(prompt.placeholder_ids), dtype=torch.long)
    return logits[0, -num_rows:].float().index_fill(-1, blocked, float("-inf"))


def forced_rounds(target, drafter, num_images: int, k: int = 4):
    """The forced run of `drafter` and, per round, (its logits (k, V), the reference's (k, V))."""
    truth = answer(target, num_images).token_ids
    forced = ForcedDrafter(drafter, corrupt(truth))
    done = answer(target, num_images, forced, k=k)
    prompt = Engine(target).prepare(messages(num_images))
    rounds = []
    for num_generated, logits in forced.rounds:
        drafted = forced.continuation[num_generated:num_generated + len(logits) - 1]
        reference = reference_logits(drafter, prompt, done.token_ids[:num_generated] + drafted, len(logits))
        rounds.append((torch.stack(logits), reference))
    return truth, forced, done, rounds


@pytest.mark.parametrize("num_images", IMAGE_COUNTS)
@pytest.mark.parametrize("kind", DRAFTERS)
def test_forced_acceptance_keeps_the_drafter_cache_exact(target, drafters, kind, num_images):
    drafter = drafters[kind]
    assert isinstance(drafter.runner, HybridRunner) and drafter.kind == kind
    truth, forced, done, rounds = forced_rounds(target, drafter, num_images)
    assert_forced_acceptance(done, truth, forced.continuation, forced.accepted)  # partial acceptances included
    assert done.stats.drafted > 0 and done.stats.accepted > 0 and done.stats.rejected_rounds > 0
    for logits, reference in rounds:
        torch.testing.assert_close(logits, reference, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("broken", ["crop_only", "no_restore"])
def test_a_rollback_that_keeps_the_recurrent_state_changes_the_proposals(target, drafters, monkeypatch, broken):
    """Power check of the test above: crop_only = a plain Runner (attention layers cropped, the
    recurrent state keeps the rejected drafts); no_restore = the checkpoint copies nothing."""
    drafter = drafters["text_lm"]
    if broken == "crop_only":
        monkeypatch.setattr(drafter, "runner", Runner(drafter.runner.model, drafter.runner.family, target.vocab_size))
    else:
        monkeypatch.setattr(drafter.runner, "_linear_states", lambda state: {})
    _, _, done, rounds = forced_rounds(target, drafter, 1)
    assert done.stats.fallback_reason is None and done.stats.rejected_rounds > 0
    largest = max((logits - reference).nan_to_num(posinf=0.0, neginf=0.0).abs().max().item()
                  for logits, reference in rounds)
    assert largest > 1e-2
    assert any(not torch.equal(logits.argmax(-1), reference.argmax(-1)) for logits, reference in rounds)


@pytest.mark.parametrize("num_images", IMAGE_COUNTS)
def test_speculative_equals_plain(target, drafters, num_images):
    plain = answer(target, num_images)
    speculative = answer(target, num_images, drafters["text_lm"])
    stats = speculative.stats
    assert speculative.token_ids == plain.token_ids
    assert stats.fallback_reason is None and stats.drafted > 0 and stats.accepted > 0
    if num_images:  # the text drafter cannot see the images: some drafts are rejected
        assert stats.rejected_rounds > 0
    else:  # on text it holds the target's language weights: every draft is accepted
        assert stats.acceptance == 1.0


def test_tree_asked_drafts_chains_and_says_why(zoo, folders):
    """On an attention-only target (Qwen3-VL, same tokenizer) the drafter's own cache is the
    reason: a tree pass would mix the branches in its recurrent state."""
    qwen3_vl = zoo.target("qwen3_vl")
    drafter = load_drafter(str(folders.text_lm), qwen3_vl, OPTIONS)
    engine = Engine(qwen3_vl, {"drafter": drafter})
    decode = DecodeSettings(max_new_tokens=16, draft_tokens=3, draft_tree=5, stop_token_ids=frozenset({-1}))
    plain = list(engine.stream(messages(1), drafter=None, decode=decode))[-1]
    done = list(engine.stream(messages(1), drafter="drafter", decode=decode))[-1]
    assert done.token_ids == plain.token_ids and done.stats.drafted > 0
    assert done.stats.draft_shape == "chain" and "linear-attention" in done.stats.tree_fallback


def test_recurrent_layers_other_than_linear_attention_are_refused_at_load(target):
    from engine.drafters import language_model

    config = PretrainedConfig(layer_types=["conv", "full_attention"])  # as LFM2-style models name theirs
    with pytest.raises(LoadError, match="has conv layers, a state whose rollback this engine has not been"):
        language_model.load("a-conv-model", config, target, OPTIONS)


@pytest.fixture(scope="module")
def image_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("images") / "picture.png"
    tiny.tiny_images(1)[0].save(path)
    return str(path)


def cli_json(capsys, argv):
    assert main(argv + ["--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_command_line_speculative_equals_plain(folders, image_file, capsys):
    common = ["--model", str(folders.target), "--dtype", "float32", "--device", "cpu", "--image", image_file,
              "--max-new-tokens", "24", "Describe what you see, then say more."]
    plain = cli_json(capsys, common + ["--mode", "plain"])
    drafter = ["--drafter", str(folders.text_lm)]
    speculative = cli_json(capsys, common + drafter)  # k chosen from measured cost, as a user runs it
    fixed = cli_json(capsys, common + drafter + ["--draft-tokens", "4", "--draft-tree", "5"])
    assert len(plain["token_ids"]) == 24 and plain["stats"]["mode"] == "plain"
    for run in (speculative, fixed):
        assert (run["token_ids"], run["text"]) == (plain["token_ids"], plain["text"])
        assert run["stats"]["drafter_kind"] == "text_lm" and run["stats"]["fallback_reason"] is None
    stats = fixed["stats"]
    assert stats["drafted"] > 0 and stats["accepted"] > 0 and stats["rejected_rounds"] > 0
    assert stats["draft_shape"] == "chain" and "linear-attention" in stats["tree_fallback"]
