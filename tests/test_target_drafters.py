"""Drafters that read the target, and hybrid targets, on tiny random-weight models (float32).

Families (tests/tiny_next.py) and what drafts for them:
    qwen3_5       hybrid target (recurrent layers + M-RoPE): n-gram and scripted drafters
    step3p7       MTP layers of its own checkpoint (`--drafter mtp`)
    muse_glimmer  DFlash block assistant (`--drafter DIR`)
    gemma4        shared-cache assistant (`--drafter DIR`)
With 0, 1 and 2 images:
- exactness: speculative greedy == plain greedy, token for token;
- forced acceptance: random drafters accept almost nothing, so a drafter is made to propose
  the true greedy continuation with tokens corrupted at fixed positions; each round must
  accept exactly the draft's prefix up to the corruption, round after round, and the answer
  must stay the plain one. For drafters with their own state (MTP, DFlash, assistants) the
  real drafter runs and only its token choice is forced (`ForcedSampler`), so its caches and
  positions go through every acceptance length; every round its logits must also equal a
  from-scratch reference (an uncached target forward, then the drafter without a cache).
"""

from __future__ import annotations

import pytest
import torch

from engine.engine import Engine
from engine.loop import DecodeSettings
from engine.runner import Runner
from engine.drafters.registry import load_drafter
from tests import tiny_next
from tests.tiny_next import IMAGE_COUNTS, MAX_NEW, answer, assert_samples_without_falling_back, messages
from tests.mocks import ForcedDrafter, ScriptedDrafter, assert_forced_acceptance, corrupt
from tests.oracles import uncached_forward



pytestmark = pytest.mark.usefixtures("one_thread")


class Zoo:
    def __init__(self, root):
        self.root, self.targets, self.drafters = root, {}, {}

    def target(self, family: str):
        if family not in self.targets:
            folder = tiny_next.build_target(family, self.root / family)
            self.targets[family] = tiny_next.load(folder)
        return self.targets[family]

    def drafter(self, family: str, name: str):
        """name: "mtp", or "assistant" (the family's assistant checkpoint, built here)."""
        if (family, name) not in self.drafters:
            folder = name
            if name == "assistant":
                folder = str(tiny_next.build_assistant(family, self.root / f"{family}-assistant"))
            self.drafters[family, name] = load_drafter(folder, self.target(family))
        return self.drafters[family, name]


@pytest.fixture(scope="module")
def zoo(tmp_path_factory):
    return Zoo(tmp_path_factory.mktemp("tiny-next"))


def uncached_target_hidden(target, prompt, answer_ids: list[int], layers: tuple[int, ...]):
    """{layer: (S + n, H)} hidden states of `uncached_forward`."""
    states = uncached_forward(target, prompt, answer_ids, output_hidden_states=list(layers)).hidden_states
    return {layer: states[layer][0] for layer in layers}


# Hybrid target (Qwen3.5): rollback of the recurrent state, with drafters that do not read the target.


@pytest.mark.parametrize("num_images", IMAGE_COUNTS)
def test_hybrid_plain_greedy_equals_one_uncached_forward(zoo, num_images):
    target = zoo.target("qwen3_5")
    ids = answer(target, num_images).token_ids
    prompt = Engine(target).prepare(messages(num_images))
    logits = uncached_forward(target, prompt, ids[:-1]).logits[0]
    start = prompt.target_inputs["input_ids"].shape[1] - 1
    assert logits[start:].argmax(-1).tolist() == ids


@pytest.mark.parametrize("num_images", IMAGE_COUNTS)
def test_hybrid_ngram_speculation_equals_plain(zoo, num_images):
    from engine.drafters.ngram import NgramDrafter

    target = zoo.target("qwen3_5")
    plain = answer(target, num_images)
    speculative = answer(target, num_images, NgramDrafter(), adaptive=True)
    assert speculative.token_ids == plain.token_ids
    assert speculative.stats.fallback_reason is None


@pytest.mark.parametrize("num_images", IMAGE_COUNTS)
@pytest.mark.parametrize("k, adaptive", [(4, False), (3, True)])
def test_hybrid_forced_acceptance(zoo, num_images, k, adaptive):
    target = zoo.target("qwen3_5")
    truth = answer(target, num_images).token_ids
    proposed = corrupt(truth)
    drafter = ScriptedDrafter(proposed)
    done = answer(target, num_images, drafter, k=k, adaptive=adaptive)
    assert_forced_acceptance(done, truth, proposed, drafter.accepted)


def test_hybrid_rollback_is_needed(zoo):
    """Power check: the same forced drafts with a plain Runner (crop only, the recurrent state
    keeps the rejected tokens) change the answer."""
    target = zoo.target("qwen3_5")
    truth = answer(target, 1).token_ids
    hybrid_runner, target.runner = target.runner, Runner(target.model, target.family)
    try:
        done = answer(target, 1, ScriptedDrafter(corrupt(truth)))
    finally:
        target.runner = hybrid_runner
    assert done.token_ids != truth


def test_target_positions_follow_mrope_after_images(zoo):
    """What MTP and DFlash drafters are given: the target's own M-RoPE positions, three rows,
    sliced on the sequence axis, the answer at i + rope_delta; equal to the model's rope index
    over prompt + answer."""
    from engine.drafters.target_positions import TargetPositions

    target = zoo.target("qwen3_5")
    prompt = Engine(target).prepare(messages(2))
    _, state = target.runner.prefill(prompt.target_inputs)
    positions = TargetPositions(target.family, state)
    num_prompt, answer_len = len(prompt.input_ids), 6
    ids = torch.tensor([prompt.input_ids + [5] * answer_len])
    types = torch.cat([prompt.target_inputs["mm_token_type_ids"], torch.zeros(1, answer_len, dtype=torch.int)], 1)
    truth, _ = target.model.model.get_rope_index(ids, types, prompt.target_inputs["image_grid_thw"])
    assert positions.rope_delta < 0
    for first, stop in [(0, num_prompt), (num_prompt - 20, num_prompt + 3), (num_prompt + 2, num_prompt + 6)]:
        assert torch.equal(positions(first, stop), truth[..., first:stop])


# Drafters that read the target: the MTP layers of Step3p7's checkpoint, MuseGlimmer's DFlash
# assistant. Each has a from-scratch reference for its logits, given the committed tokens and
# (MTP) the forced draft tokens its upper layers embed: (n, V) for the first n draft tokens.


def mtp_reference_logits(target, drafter, prompt, tokens: list[int], draft: list[int]) -> torch.Tensor:
    """Layers 0 .. len(draft) drafting after `tokens` (layer i embeds draft[i - 1]): one uncached
    target forward for h and the merged input embeddings (image features included), then each
    MTP layer over all entries without a cache. 1-D RoPE: token i sits at position i."""
    mtp, num_prompt = drafter.mtp, len(prompt.input_ids)
    hidden = uncached_target_hidden(target, prompt, tokens[num_prompt:], (0, -1))
    with torch.inference_mode():
        embeds = torch.cat([hidden[0], mtp.embed_tokens(torch.tensor(draft, dtype=torch.long))])
        last = len(tokens) - 1  # entries 0 .. last - 1
        below, logits = hidden[-1][:last], []
        for level in range(len(draft) + 1):
            positions = torch.arange(level + 1, last + level + 1)[None]
            out = mtp.forward_layer(level, below[None], positions, None,
                                    inputs_embeds=embeds[level + 1:last + level + 1][None])[0]
            logits.append(mtp._project_to_logits(out[-1:][None])[0, 0].float())
            below = out
    return torch.stack(logits)


def dflash_reference_logits(target, drafter, prompt, tokens: list[int], draft: list[int]) -> torch.Tensor:
    """The block after `tokens` (the draft does not feed back): one uncached target forward for
    the context rows, then the assistant with all context in one fresh cache."""
    from transformers.cache_utils import DFlashCache

    num_prompt, anchor = len(prompt.input_ids), len(tokens) - 1
    hidden = uncached_target_hidden(target, prompt, tokens[num_prompt:anchor], drafter.layers)
    context = torch.cat([hidden[layer] for layer in drafter.layers], dim=-1)
    assistant = drafter.block  # dflash.AssistantBlock
    cache = DFlashCache(config=assistant.assistant.config)
    cache.set_previous_accepted_tokens(anchor)
    block = torch.tensor([tokens[-1]] + [assistant.mask_token_id] * (drafter.block_size - 1))
    with torch.inference_mode():
        out = assistant.assistant(noise_embeds=assistant.embed(block)[None], context_hidden_states=context[None],
                                position_ids=torch.arange(anchor + drafter.block_size)[None], cache=cache)
        return target.model.get_output_embeddings()(out.last_hidden_state[0, 1:]).float()


def shared_cache_reference_logits(target, drafter, prompt, tokens: list[int], draft: list[int]) -> torch.Tensor:
    """Steps 0 .. len(draft) drafting after `tokens` (step i feeds draft[i - 1]): one uncached target
    forward over tokens[:-1] gives the K/V of every position (sliding layers too, none rejected)
    and the last hidden state; the assistant attends to them all, at the position of tokens[-1]."""
    out = uncached_forward(target, prompt, tokens[len(prompt.input_ids):-1], output_hidden_states=[-1],
                           return_shared_kv_states=True)
    kv = dict(out.shared_kv_states)
    hidden, position = out.hidden_states[-1][0, -1], torch.tensor([[len(tokens) - 1]])
    embedding, logits = target.model.get_input_embeddings(), []
    with torch.inference_mode():
        for token in [tokens[-1]] + draft:
            inputs_embeds = torch.cat([embedding(torch.tensor([token]))[0], hidden])[None, None]
            step = drafter.assistant(inputs_embeds=inputs_embeds, position_ids=position, shared_kv_states=kv)
            logits.append(step.logits[0, -1, :target.vocab_size].float())
            hidden = step.last_hidden_state[0, -1]
    return torch.stack(logits)


# (family, drafter, kind, longest draft, reference)
READERS = [
    pytest.param("step3p7", "mtp", "mtp", tiny_next.STEP3P7_MTP_LAYERS, mtp_reference_logits, id="mtp"),
    pytest.param("muse_glimmer", "assistant", "dflash", 3, dflash_reference_logits, id="dflash"),
    pytest.param("gemma4", "assistant", "shared_cache", 4, shared_cache_reference_logits, id="shared_cache"),
]


@pytest.mark.parametrize("family, name, kind, longest, reference", READERS)
@pytest.mark.parametrize("num_images", IMAGE_COUNTS)
def test_reading_drafter_speculation_equals_plain(zoo, family, name, kind, longest, reference, num_images):
    target, drafter = zoo.target(family), zoo.drafter(family, name)
    plain = answer(target, num_images)
    speculative = answer(target, num_images, drafter)
    assert speculative.token_ids == plain.token_ids
    assert speculative.stats.fallback_reason is None
    assert speculative.stats.drafter_kind == kind
    assert max(speculative.stats.draft_lengths) == longest  # MTP: one per layer; DFlash: one block; else k


@pytest.mark.parametrize("family, name, kind, longest, reference", READERS)
@pytest.mark.parametrize("num_images", IMAGE_COUNTS)
@pytest.mark.parametrize("k, adaptive", [(4, False), (1, True)])  # adaptive: drafts of 1-3 (MTP's upper layers lag)
def test_reading_drafter_forced_acceptance_stays_exact(zoo, family, name, kind, longest, reference,
                                                       num_images, k, adaptive):
    """Forced drafts through the real drafter: accepted exactly up to each corruption, and every
    round's drafter logits equal its from-scratch reference, whatever was accepted before."""
    target, inner = zoo.target(family), zoo.drafter(family, name)
    truth = answer(target, num_images).token_ids
    proposed = corrupt(truth)
    drafter = ForcedDrafter(inner, proposed)
    done = answer(target, num_images, drafter, k=k, adaptive=adaptive)
    assert_forced_acceptance(done, truth, proposed, drafter.accepted)
    prompt = Engine(target).prepare(messages(num_images))
    for answer_len, logits in drafter.rounds:
        tokens = prompt.input_ids + truth[:answer_len]
        draft = proposed[answer_len:answer_len + len(logits) - 1]
        expected = reference(target, inner, prompt, tokens, draft)
        torch.testing.assert_close(torch.stack(logits), expected[:len(logits)], atol=1e-4, rtol=1e-4)


def test_loading_refuses_drafters_that_do_not_fit_the_target(zoo):
    from models.loading import LoadError

    qwen3_5 = zoo.target("qwen3_5")
    with pytest.raises(LoadError, match="declares no MTP layers"):
        load_drafter("mtp", zoo.target("gemma4"))
    dflash_folder = str(tiny_next.build_assistant("muse_glimmer", zoo.root / "refused-assistant"))
    with pytest.raises(LoadError, match="reads target layers .* M-RoPE rows"):
        load_drafter(dflash_folder, qwen3_5)
    gemma4_assistant = str(tiny_next.build_assistant("gemma4", zoo.root / "refused-gemma4-assistant"))
    with pytest.raises(LoadError, match="shares no K/V"):
        load_drafter(gemma4_assistant, zoo.target("muse_glimmer"))


@pytest.mark.parametrize("family, name, kind, longest, reference", READERS)
def test_reading_drafter_samples_without_falling_back(zoo, family, name, kind, longest, reference):
    """Sampling (rejection sampling against the drafter's own distributions) runs through every
    reading drafter; equal seeds give equal answers."""
    assert_samples_without_falling_back(zoo.target(family), zoo.drafter(family, name))


def test_unavailable_reading_drafter_decodes_plainly(zoo):
    from engine.drafters.base import DrafterUnavailable

    class Unavailable(ForcedDrafter):
        def begin(self, prompt, target_state):
            raise DrafterUnavailable("no MTP context for this request")

    target = zoo.target("step3p7")
    plain = answer(target, 1)
    done = answer(target, 1, Unavailable(zoo.drafter("step3p7", "mtp"), plain.token_ids))
    assert done.token_ids == plain.token_ids
    assert done.stats.fallback_reason == "no MTP context for this request"
    assert done.stats.drafted == 0


@pytest.mark.parametrize("family, name, reason", [
    ("qwen3_5", "ngram", "linear-attention"),  # hybrid target: a recurrent state mixes branches
    ("step3p7", "mtp", "mtp drafter drafts chains only (it reads the target's pass"),
    ("muse_glimmer", "assistant", "dflash drafter drafts chains only (it reads the target's pass"),
    ("gemma4", "assistant", "shared_cache drafter drafts chains only (it reads the target's pass"),
])
def test_tree_falls_back_to_chains_with_a_reason(zoo, family, name, reason):
    """A tree asked where it cannot be kept: chains, the same answer as plain, and the reason."""
    target = zoo.target(family)
    drafter = load_drafter("ngram", target) if name == "ngram" else zoo.drafter(family, name)
    plain = answer(target, 1)
    engine = Engine(target, {"drafter": drafter})
    decode = DecodeSettings(max_new_tokens=MAX_NEW, draft_tree=6, stop_token_ids=frozenset({-1}))
    done = list(engine.stream(messages(1), drafter="drafter", decode=decode))[-1]
    assert done.token_ids == plain.token_ids
    assert done.stats.draft_shape == "chain" and reason in done.stats.tree_fallback
    assert done.stats.fallback_reason is None and done.stats.drafted > 0
