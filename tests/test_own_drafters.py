"""The project's own drafter modules (models/drafter_heads.py: MTP head, block drafter) on the
tiny M-RoPE target (models/tiny.py qwen2_vl), float32, random module weights.

- forced acceptance with 0, 1, 2 and 4 images, a prompt that ends with an image, and a second
  turn after an image turn: the real drafter runs and only its token choice is forced to the
  true greedy continuation with tokens corrupted every few positions; each round accepts
  exactly the draft's prefix up to the corruption, the answer stays the plain one, and every
  round's drafter logits equal a from-scratch reference (one uncached target forward, then the
  module without a cache, at positions from the model's own `get_rope_index` over the whole
  sequence), whatever was accepted before;
- unforced speculation equals plain decoding;
- a session without context (the target kept no hidden states) is refused by name
  (DrafterUnavailable) and the request decodes plainly;
- loading refuses a module made for another target, and weights that do not match;
- on the fast path (engine/fast_heads.py) each drafter proposes what its module's own forward
  proposes (every round's logits within 1e-5); a Qwen3.5 head says why it keeps its module's;
- a reduced output vocabulary (`draft_vocab_size`, the module's `draft_ids`): logits equal the
  whole head's at those ids and are -inf elsewhere, speculation still equals plain decoding,
  and ids outside the target's vocabulary are refused at load.
"""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from engine.drafters.base import DrafterUnavailable
from engine.drafters.registry import load_drafter
from engine.engine import Engine
from engine.loop import DecodeSettings, Done
from engine.runner import NO_READS
from engine.static_cache import StaticKVCache
from measure.profile_drafts import module_twin
from models import drafter_heads
from models.loading import LoadError
from models import tiny
from tests.conftest import MODEL_OPTIONS as FLOAT32
from tests.mocks import ForcedDrafter, assert_tree_nodes_are_top_choices, corrupt, expected_accepts
from tests.oracles import uncached_forward

MAX_NEW = 24
FAMILY = "qwen2_vl"

pytestmark = pytest.mark.usefixtures("one_thread")


def user(text, images=(), image_last=False):
    parts = [{"type": "image", "image": image} for image in images]
    text_part = [{"type": "text", "text": text}] if text else []
    return {"role": "user", "content": text_part + parts if image_last else parts + text_part}


def conversation(case: str):
    """0, 1, 2, 4 images then text; "image_last": text then an image and nothing after it;
    "second_turn": a turn with two images, an answer, then a text-only turn."""
    if case == "image_last":
        return [user("", tiny.tiny_images(1, seed=5), image_last=True)]
    if case == "second_turn":
        return [user("What is in these pictures?", tiny.tiny_images(2, seed=2)),
                {"role": "assistant", "content": [{"type": "text", "text": "A red square and a blue circle."}]},
                user("And which one is larger?")]
    return [user("Describe what you see, then say more.", tiny.tiny_images(int(case), seed=int(case)))]


CASES = ("0", "1", "2", "4", "image_last", "second_turn")


@pytest.fixture(scope="module")
def heads(zoo, tmp_path_factory):
    """Folders of a random MTP head (1 layer) and block drafter (2 layers, block of 4) for the tiny target."""
    target = zoo.target(FAMILY)
    root = tmp_path_factory.mktemp("own-drafters")
    torch.manual_seed(0)
    mtp = drafter_heads.MtpHead(drafter_heads.MtpHeadConfig.for_target(target.model.config, num_hidden_layers=1))
    block = drafter_heads.BlockDrafter(drafter_heads.BlockDrafterConfig.for_target(
        target.model.config, num_hidden_layers=2, target_hidden_layers=(1, 2), block_size=4))
    for module in (mtp, block):
        with torch.no_grad():
            for parameter in module.parameters():  # larger than the default init: outputs that vary
                parameter.add_(torch.randn_like(parameter) * 0.2)
    drafter_heads.save(mtp, str(root / "mtp"))
    drafter_heads.save(block, str(root / "block"))
    return {"mtp": str(root / "mtp"), "block": str(root / "block")}


@pytest.fixture(scope="module")
def drafters(zoo, heads):
    return {name: load_drafter(folder, zoo.target(FAMILY), FLOAT32) for name, folder in heads.items()}


def answer(target, messages, drafter=None, k=4, adaptive=False, draft_tree=0) -> Done:
    engine = Engine(target, {"drafter": drafter} if drafter else {})
    decode = DecodeSettings(max_new_tokens=MAX_NEW, draft_tokens=k, adaptive=adaptive, draft_tree=draft_tree,
                            stop_token_ids=frozenset({-1}))
    done = list(engine.stream(messages, drafter="drafter" if drafter else None, decode=decode))[-1]
    assert isinstance(done, Done)
    return done


def rope_positions(target, prompt, answer_ids: list[int]) -> torch.Tensor:
    """(3, 1, S + n) the model's own M-RoPE positions over prompt + answer_ids (text after the prompt)."""
    inputs = prompt.target_inputs
    ids = torch.tensor([prompt.input_ids + answer_ids])
    types = torch.cat([inputs["mm_token_type_ids"], torch.zeros(1, len(answer_ids), dtype=inputs["mm_token_type_ids"].dtype)], 1)
    positions, _ = target.model.model.get_rope_index(ids, types, inputs.get("image_grid_thw"))
    return positions


def target_rows(target, prompt, answer_ids: list[int], layers) -> dict[int, torch.Tensor]:
    """{layer: (S + n, H)} hidden states of ONE uncached target forward over prompt + answer_ids."""
    states = uncached_forward(target, prompt, answer_ids, output_hidden_states=True).hidden_states
    return {layer: states[layer][0] for layer in layers}


def full_mask(n: int) -> torch.Tensor:
    return drafter_heads.causal_mask(n, 0)


def mtp_reference_logits(target, drafter, prompt, tokens: list[int], draft: list[int]) -> torch.Tensor:
    """Steps 1 .. len(draft) + 1 drafting after `tokens` (x_0 .. x_T; step i embeds draft[i - 2]),
    each one causal forward over all its entries without a cache: entries 0 .. T-1 embed x_{j+1}
    (the target's merged embedding) and read h_j, draft entries read the output before them."""
    module, head, num_prompt = drafter.module, drafter.head, len(prompt.input_ids)
    newest = len(tokens) - 1
    rows = target_rows(target, prompt, tokens[num_prompt:], (0, -1))
    positions = rope_positions(target, prompt, tokens[num_prompt:] + draft)
    embeds, hidden = rows[0][1:newest + 1], rows[-1][:newest]  # entries 0 .. T-1
    logits = []
    with torch.inference_mode():
        for step in range(len(draft) + 1):
            n = len(embeds)
            out = module(embeds[None], hidden[None], positions[..., 1:n + 1], full_mask(n))[0]
            logits.append(head.logits(out[-1:])[0])
            if step < len(draft):
                embeds = torch.cat([embeds, head.embed([draft[step]])])
                hidden = torch.cat([hidden, out[-1:]])
    return torch.stack(logits)


def block_reference_logits(target, drafter, prompt, tokens: list[int], draft: list[int]) -> torch.Tensor:
    """The block after `tokens`: context rows of tokens 0 .. T-1 from one uncached target forward,
    then the block [x_T, mask, ...] in one forward without a cache."""
    module, head, num_prompt = drafter.block.module, drafter.block.head, len(prompt.input_ids)
    newest, size = len(tokens) - 1, drafter.block_size
    rows = target_rows(target, prompt, tokens[num_prompt:newest], drafter.layers)
    context = torch.cat([rows[layer] for layer in drafter.layers], dim=-1)
    positions = rope_positions(target, prompt, tokens[num_prompt:] + [0] * (size - 1))
    mask = full_mask(newest + size).clone()
    mask[..., newest:, :] = True
    with torch.inference_mode():
        block = module.block_embeds(head.embed([tokens[-1]])[None])
        out = module(context[None], block, positions, mask)[0, newest + 1:]
        return head.logits(out)


REFERENCES = {"mtp": mtp_reference_logits, "block": block_reference_logits}


def assert_forced_drafts_exact(target, inner, messages, reference, k, adaptive=False) -> list[tuple[int, int]]:
    """Forced drafts through the real drafter: the plain answer, each round accepting exactly
    up to the corruption, and every round's logits equal to `reference`; returns the rounds'
    (draft length, accepted)."""
    truth = answer(target, messages).token_ids
    proposed = corrupt(truth)
    drafter = ForcedDrafter(inner, proposed)
    done = answer(target, messages, drafter, k=k, adaptive=adaptive)
    assert done.token_ids == truth
    assert done.stats.fallback_reason is None
    assert drafter.accepted == expected_accepts(truth, proposed, done.stats.draft_lengths)
    prompt = Engine(target).prepare(messages)
    for answer_len, logits in drafter.rounds:
        tokens = prompt.input_ids + truth[:answer_len]
        draft = proposed[answer_len:answer_len + len(logits) - 1]
        expected = reference(target, inner, prompt, tokens, draft)
        torch.testing.assert_close(torch.stack(logits), expected[:len(logits)], atol=1e-4, rtol=1e-4)
    return list(zip(done.stats.draft_lengths, drafter.accepted))


@pytest.mark.parametrize("name", ["mtp", "block"])
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("k, adaptive", [(4, False), (1, True)])
def test_forced_acceptance_stays_exact(zoo, drafters, name, case, k, adaptive):
    rounds = assert_forced_drafts_exact(zoo.target(FAMILY), drafters[name], conversation(case), REFERENCES[name],
                                        k, adaptive)
    assert any(a == 0 < d for d, a in rounds) and any(0 < a < d for d, a in rounds), rounds
    assert any(a == d > 1 for d, a in rounds), rounds


@pytest.mark.parametrize("name, longest, draft_tree", [("mtp", 4, 0), ("block", 3, 0), ("mtp", 6, 6), ("block", 3, 6)],
                         ids=("mtp-chain", "block-chain", "mtp-tree", "block-tree"))
@pytest.mark.parametrize("case", CASES)
def test_speculation_equals_plain(zoo, drafters, name, longest, draft_tree, case):
    """Chains; and a tree request: trees of up to 6 nodes for the MTP head (its entries chain, so it
    branches as EAGLE-3 does), chains with the named reason for the block drafter (a block has no
    per-node entries to branch from)."""
    target = zoo.target(FAMILY)
    plain = answer(target, conversation(case))
    speculative = answer(target, conversation(case), drafters[name], draft_tree=draft_tree)
    assert speculative.token_ids == plain.token_ids
    assert speculative.stats.fallback_reason is None
    assert max(speculative.stats.draft_lengths) == longest  # MTP: k steps or tree nodes; block: block size - 1
    if draft_tree:
        assert speculative.stats.draft_shape == ("tree" if name == "mtp" else "chain")
        assert name == "mtp" or "dflash drafter drafts chains only" in speculative.stats.tree_fallback


@pytest.mark.parametrize("case", ["0", "2"])
def test_mtp_head_tree_nodes_are_the_top_choices_along_each_path(zoo, drafters, case):
    target = zoo.target(FAMILY)
    assert_tree_nodes_are_top_choices(target, drafters["mtp"], Engine(target).prepare(conversation(case)),
                                      mtp_reference_logits)


@pytest.mark.parametrize("name", ["mtp", "block"])
@pytest.mark.parametrize("case", ["0", "2", "second_turn"])
def test_fast_path_drafts_equal_the_module_forward(zoo, drafters, name, case):
    """Forced drafts through the drafter on the fast path and through its module's forward:
    the same rounds, every round's float32 logits within 5e-5, float rounding (the compiled stack
    sums in another order; images: entries at M-RoPE positions whose rows differ)."""
    target, fast = zoo.target(FAMILY), drafters[name]
    assert fast.fast_fallback is None
    messages = conversation(case)
    truth = answer(target, messages).token_ids
    proposed = corrupt(truth)
    runs = []
    for drafter, cache_type in ((fast, StaticKVCache), (module_twin(fast), DynamicCache)):
        forced = ForcedDrafter(drafter, proposed)
        assert answer(target, messages, forced).token_ids == truth
        assert type(forced.session.cache) is cache_type
        runs.append(forced.rounds)
    assert [length for length, _ in runs[0]] == [length for length, _ in runs[1]]
    for (_, fast_logits), (_, module_logits) in zip(*runs):
        torch.testing.assert_close(torch.stack(fast_logits), torch.stack(module_logits), atol=5e-5, rtol=0)


@pytest.mark.parametrize("name", ["mtp", "block"])
def test_no_context_is_refused_by_name_and_decodes_plainly(zoo, drafters, name):
    """A target pass that kept no hidden states leaves the drafter nothing to read: begin raises
    DrafterUnavailable naming the drafter (never a draft from zero context), and through the
    engine the request completes plainly with that reason."""
    target, drafter = zoo.target(FAMILY), drafters[name]
    prompt = Engine(target).prepare(conversation("1"))
    _, state = target.runner.prefill(prompt.target_inputs, NO_READS)
    with pytest.raises(DrafterUnavailable, match=f"drafter {drafter.name} has no context"):
        drafter.begin(prompt, state)

    class ReadsNothing:  # the same drafter, but the target is asked for nothing
        name, kind, reads = drafter.name, drafter.kind, NO_READS
        begin = drafter.begin

    plain = answer(target, conversation("1"))
    done = answer(target, conversation("1"), ReadsNothing())
    assert done.token_ids == plain.token_ids
    assert done.stats.drafted == 0
    assert "has no context" in done.stats.fallback_reason


def test_loading_checks_the_fit(zoo, heads, tmp_path):
    target = zoo.target(FAMILY)
    config = drafter_heads.MtpHeadConfig.for_target(target.model.config, hidden_size=32, num_attention_heads=2,
                                                     num_key_value_heads=1, intermediate_size=64, mrope_section=[2, 3, 3])
    drafter_heads.save(drafter_heads.MtpHead(config), str(tmp_path / "narrow"))
    with pytest.raises(LoadError, match="hidden size is 32"):
        load_drafter(str(tmp_path / "narrow"), target, FLOAT32)
    config = drafter_heads.BlockDrafterConfig.for_target(target.model.config, target_hidden_layers=(1, 9))
    drafter_heads.save(drafter_heads.BlockDrafter(config), str(tmp_path / "deep"))
    with pytest.raises(LoadError, match=r"reads target hidden states \[1, 9\]"):
        load_drafter(str(tmp_path / "deep"), target, FLOAT32)
    from safetensors.torch import load_file, save_file

    weights = load_file(f"{heads['mtp']}/model.safetensors")
    weights.pop("fc.weight")
    (tmp_path / "partial").mkdir()
    drafter_heads.MtpHeadConfig.for_target(target.model.config).save_pretrained(tmp_path / "partial")
    save_file(weights, str(tmp_path / "partial" / "model.safetensors"))
    with pytest.raises(LoadError, match="fc.weight"):
        load_drafter(str(tmp_path / "partial"), target, FLOAT32)


@pytest.fixture(scope="module")
def reduced(zoo, heads, tmp_path_factory):
    """The fixture's two modules again, with the same weights and an output vocabulary of every
    third target id (draft_ids): {name: (full folder, reduced folder, draft ids)}."""
    target = zoo.target(FAMILY)
    root = tmp_path_factory.mktemp("reduced-vocabulary")
    ids = torch.arange(0, target.vocab_size, 3)
    folders = {}
    for name, folder in heads.items():
        full = drafter_heads.load(folder)
        config = type(full.config).from_dict(full.config.to_dict() | {"draft_vocab_size": len(ids)})
        module = drafter_heads.build(config)
        module.load_state_dict(full.state_dict(), strict=False)
        module.draft_ids.copy_(ids)
        drafter_heads.save(module, str(root / name))
        folders[name] = (folder, str(root / name), ids)
    return folders


@pytest.mark.parametrize("name", ["mtp", "block"])
def test_reduced_vocabulary_logits_are_the_heads_rows_at_its_ids(zoo, reduced, name):
    target = zoo.target(FAMILY)
    full_folder, folder, ids = reduced[name]
    full, small = (load_drafter(f, target, FLOAT32) for f in (full_folder, folder))
    head = (lambda d: d.head) if name == "mtp" else (lambda d: d.block.head)
    assert torch.equal(head(small).draft_ids, ids)
    rows = torch.randn(5, target.model.config.get_text_config().hidden_size)
    whole, part = head(full).logits(rows), head(small).logits(rows)
    assert part.shape == whole.shape == (5, target.vocab_size)
    torch.testing.assert_close(part[:, ids], whole[:, ids], atol=1e-5, rtol=0)
    outside = torch.ones(target.vocab_size, dtype=torch.bool)
    outside[ids] = False
    assert torch.isneginf(part[:, outside]).all()


@pytest.mark.parametrize("name", ["mtp", "block"])
@pytest.mark.parametrize("case", ["0", "2", "second_turn"])
def test_reduced_vocabulary_speculation_equals_plain(zoo, reduced, name, case):
    target = zoo.target(FAMILY)
    plain = answer(target, conversation(case))
    done = answer(target, conversation(case), load_drafter(reduced[name][1], target, FLOAT32))
    assert done.token_ids == plain.token_ids
    assert done.stats.drafted > 0 and done.stats.fallback_reason is None


def test_auto_dtype_counts_the_head_rows_a_module_reads(zoo, heads, reduced, monkeypatch):
    """--drafter-dtype auto weighs a module by what a step reads: its parameters and the output
    head's rows (the whole vocabulary, or its draft_ids), so with the threshold between the two
    counts the module with the whole head runs in bfloat16 and the reduced one in float32."""
    from engine.drafters import target_head

    target = zoo.target(FAMILY)
    hidden = target.model.config.get_text_config().hidden_size
    module = drafter_heads.load(heads["mtp"])
    parameters = sum(p.numel() for p in module.parameters())
    whole = parameters + target.vocab_size * hidden
    assert target_head.weights_read(module, target) == whole
    assert target_head.weights_read(drafter_heads.load(reduced["mtp"][1]), target) == \
        parameters + len(reduced["mtp"][2]) * hidden
    monkeypatch.setattr(target_head, "cpu_computes_bfloat16", lambda: True)
    monkeypatch.setattr(target_head, "SMALL_DRAFTER_PARAMETERS", whole)
    dtype = lambda folder: next(load_drafter(folder, target).module.parameters()).dtype  # noqa: E731
    assert dtype(heads["mtp"]) == torch.bfloat16 and dtype(reduced["mtp"][1]) == torch.float32


def test_reduced_vocabulary_outside_the_target_is_refused(zoo, reduced, tmp_path):
    from safetensors.torch import load_file, save_file

    target = zoo.target(FAMILY)
    folder = reduced["mtp"][1]
    weights = load_file(f"{folder}/model.safetensors")
    weights["draft_ids"][-1] = target.vocab_size
    (tmp_path / "outside").mkdir()
    drafter_heads.load(folder).config.save_pretrained(tmp_path / "outside")
    save_file(weights, str(tmp_path / "outside" / "model.safetensors"))
    with pytest.raises(LoadError, match=f"outside the target's vocabulary of {target.vocab_size}"):
        load_drafter(str(tmp_path / "outside"), target, FLOAT32)


# Qwen3.5 / 3.6: the MTP head built from a checkpoint's mtp.* weights, on the tiny hybrid target.


@pytest.fixture(scope="module")
def qwen3_5(tmp_path_factory):
    """(target, its checkpoint's mtp.* weights, the head folder converted from them). The tiny
    Qwen3.5 target's checkpoint holds random MTP weights under the published names next to the
    main model's weights, which the converter must ignore."""
    from safetensors.torch import load_file

    from tests import tiny_next

    root = tmp_path_factory.mktemp("qwen3_5-mtp")
    target_dir = tiny_next.build_target("qwen3_5", root / "target")
    drafter_heads.main([str(target_dir), str(root / "head")])
    weights = {name: w for name, w in load_file(target_dir / "model.safetensors").items() if name.startswith("mtp.")}
    return tiny_next.load(target_dir), weights, str(root / "head")


def test_qwen3_5_checkpoint_mtp_weights_become_the_head(qwen3_5):
    target, weights, head = qwen3_5
    drafter = load_drafter(head, target, FLOAT32)
    module = drafter.module
    assert drafter.kind == "mtp" and module.config.layers_from == "qwen3_5"
    assert torch.equal(module.fc.weight, weights["mtp.fc.weight"])
    assert torch.equal(module.enorm.weight, weights["mtp.pre_fc_norm_embedding.weight"])
    assert torch.equal(module.hnorm.weight, weights["mtp.pre_fc_norm_hidden.weight"])
    assert torch.equal(module.stack.norm.weight, weights["mtp.norm.weight"])
    assert torch.equal(module.stack.layers[0].self_attn.q_proj.weight, weights["mtp.layers.0.self_attn.q_proj.weight"])
    assert type(module.stack.norm).__name__ == "Qwen3_5RMSNorm"  # scales by 1 + w
    assert drafter.fast is None and "qwen3_5 layers" in drafter.fast_fallback
    from_target = load_drafter("mtp", target, FLOAT32).module  # --drafter mtp: the head built in memory
    assert from_target.state_dict().keys() == module.state_dict().keys()
    assert all(torch.equal(w, module.state_dict()[name]) for name, w in from_target.state_dict().items())


@pytest.mark.parametrize("case", ["0", "1", "2", "second_turn"])
def test_qwen3_5_mtp_head_forced_acceptance_on_the_hybrid_target(qwen3_5, case):
    target, _, head = qwen3_5
    assert_forced_drafts_exact(target, load_drafter(head, target, FLOAT32), conversation(case), mtp_reference_logits, 3)


@pytest.mark.parametrize("vocabulary", [[], ["--draft-vocab", "64"]], ids=["whole", "reduced"])
def test_train_drafters_writes_folders_that_load_for_the_bundled_target(tmp_path, vocabulary):
    """Two steps of `python -m models.demo.train_drafters` on two conversations: both folders
    load through the registry for the bundled target, and the losses are finite; with
    --draft-vocab, both keep the same 64 ascending ids, the end of turn among them and no image
    placeholder."""
    import json
    import math

    from engine.target import load_target
    from models.demo import train_drafters

    train_drafters.main(["--out", str(tmp_path), "--steps", "2", "--batch-size", "2", "--anchors", "4", "--threads", "1",
                         *vocabulary])
    log = json.loads((tmp_path / "drafters_training.json").read_text())["log"]
    assert log[-1]["step"] == 2 and all(math.isfinite(v) for k, v in log[-1].items() if k.startswith(("mtp", "block")))
    target = load_target(train_drafters.DEFAULT_TARGET, FLOAT32)
    drafters = {name: load_drafter(str(tmp_path / name), target, FLOAT32) for name in ("mtp_drafter", "block_drafter")}
    assert {d.kind for d in drafters.values()} == {"mtp", "dflash"}
    ids = [drafters["mtp_drafter"].head.draft_ids, drafters["block_drafter"].block.head.draft_ids]
    if not vocabulary:
        assert ids == [None, None]
        return
    assert torch.equal(ids[0], ids[1]) and len(ids[0]) == 64 and bool((ids[0].diff() > 0).all())
    tokenizer = target.processor.tokenizer
    assert tokenizer.convert_tokens_to_ids("<|im_end|>") in ids[0].tolist()
    assert tokenizer.convert_tokens_to_ids("<|image_pad|>") not in ids[0].tolist()
