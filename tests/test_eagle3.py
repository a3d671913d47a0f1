"""EAGLE-3 checkpoints as SpecForge and vLLM's `speculators` write them (engine/drafters/eagle3.py,
models/eagle3.py), on tiny 6-layer targets of every family that has published EAGLE-3 drafters:
Qwen2.5-VL (M-RoPE), Qwen3-VL (interleaved M-RoPE, deepstack) and SmolVLM (Llama text, 1-axis).

The checkpoints are written here key by key, at shrunken shapes of the published configs
(SpecForge `configs/qwen2-5-vl-7b-eagle3.json`, a speculators `Eagle3Speculator` config), with
random weights and a draft vocabulary smaller than the target's (d2t), saved as the publishers
save them (config.json + model.safetensors) and loaded through `load_drafter`, the path a hub id
takes. Greedy speculative answers must equal plain ones (float32, 0-2 images); forced drafts
check every round's logits against a from-scratch reference (an uncached target forward, then
the EAGLE-3 layer over all entries without a cache).
"""

from __future__ import annotations

import copy
import json
import os

import pytest
import torch
from safetensors.torch import save_file

from engine import fast_heads, fast_native
from engine.drafters.registry import load_drafter
from engine.engine import Engine
from engine.rows_kernel import RowsKernelLinear
from models import eagle3 as eagle3_checkpoint, tiny
from engine.target import load_target
from models.loading import LoadError
from tests.conftest import MODEL_OPTIONS
from tests.mocks import (ForcedDrafter, ForcedSampler, ScriptedTreeDrafter, assert_forced_acceptance,
                         assert_tree_nodes_are_top_choices, corrupt)
from tests.oracles import uncached_forward, uncached_inputs
from tests.tiny_next import IMAGE_COUNTS, answer, assert_samples_without_falling_back, messages

pytestmark = pytest.mark.usefixtures("one_thread")

FAMILIES = ("qwen2_5_vl", "qwen3_vl", "smolvlm")
TARGET_LAYERS = 6  # vLLM's default layers (2, 3, 3) as hidden_states indices
INTERMEDIATE = 96
STD = 0.3


class Eagle3Zoo:
    def __init__(self, root):
        self.root, self.targets, self.drafters = root, {}, {}

    def target(self, family: str):
        if family not in self.targets:
            folder = tiny.build_target(family, self.root / family, num_hidden_layers=TARGET_LAYERS)
            self.targets[family] = load_target(str(folder), MODEL_OPTIONS)
        return self.targets[family]

    def folder(self, family: str, fmt: str, **changes) -> str:
        out = self.root / f"{family}-{fmt}-{'-'.join(f'{k}{v}' for k, v in changes.items())}"
        if not out.exists():
            writer = write_specforge if fmt == "specforge" else write_speculators
            writer(out, self.target(family), **changes)
        return str(out)

    def drafter(self, family: str, fmt: str):
        if (family, fmt) not in self.drafters:
            self.drafters[family, fmt] = load_drafter(self.folder(family, fmt), self.target(family))
        return self.drafters[family, fmt]


@pytest.fixture(scope="module")
def zoo(tmp_path_factory):
    return Eagle3Zoo(tmp_path_factory.mktemp("eagle3"))


# Checkpoints, written key by key


def _text(target):
    return target.model.config.get_text_config()


def _head_dim(text) -> int:
    return getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads


def _layer_sizes(target, hidden: int | None = None) -> dict:
    text = _text(target)
    return dict(hidden_size=hidden or text.hidden_size, intermediate_size=INTERMEDIATE,
                num_attention_heads=text.num_attention_heads, num_key_value_heads=text.num_key_value_heads,
                head_dim=_head_dim(text), rms_norm_eps=1e-6, hidden_act="silu", max_position_embeddings=2048)


def _rope(target) -> dict:
    """SpecForge's rope fields for the target: `rope_scaling` mrope for Qwen-VL, none for Llama."""
    rope = getattr(_text(target), "rope_parameters", None) or {}
    fields = {"rope_theta": rope.get("rope_theta", 10000.0)}
    if rope.get("mrope_section"):
        fields["rope_scaling"] = {"type": "mrope", "mrope_section": list(rope["mrope_section"]),
                                  **({"mrope_interleaved": True} if rope.get("mrope_interleaved") else {})}
    return fields


def _draft_vocabulary(vocab_size: int, seed: int) -> torch.Tensor:
    """A sorted subset of the target's ids: every third id dropped, but the first 40."""
    ids = [i for i in range(vocab_size) if i < 40 or i % 3]
    return torch.tensor(ids)


def _weights(target, hidden: int, draft_ids: torch.Tensor, layer_prefix: str, embed: bool, seed: int) -> dict:
    """Random tensors under the published names and shapes (H: the drafter's hidden size)."""
    text = _text(target)
    generator = torch.Generator().manual_seed(seed)
    heads, kv_heads, head_dim, target_hidden = (text.num_attention_heads, text.num_key_value_heads, _head_dim(text),
                                                text.hidden_size)
    shapes = {
        "fc.weight": (hidden, 3 * target_hidden),
        "self_attn.q_proj.weight": (heads * head_dim, 2 * hidden),
        "self_attn.k_proj.weight": (kv_heads * head_dim, 2 * hidden),
        "self_attn.v_proj.weight": (kv_heads * head_dim, 2 * hidden),
        "self_attn.o_proj.weight": (hidden, heads * head_dim),
        "mlp.gate_proj.weight": (INTERMEDIATE, hidden),
        "mlp.up_proj.weight": (INTERMEDIATE, hidden),
        "mlp.down_proj.weight": (hidden, INTERMEDIATE),
        "lm_head.weight": (len(draft_ids), hidden),
    }
    if embed:
        shapes["embed_tokens.weight"] = (text.vocab_size, hidden)
    weights = {}
    for key, shape in shapes.items():
        name = key if key in ("fc.weight", "lm_head.weight", "embed_tokens.weight") else layer_prefix + key
        weights[name] = torch.randn(shape, generator=generator) * STD
    for norm in ("input_layernorm", "hidden_norm", "post_attention_layernorm"):
        weights[f"{layer_prefix}{norm}.weight"] = 1 + 0.1 * torch.randn(hidden, generator=generator)
    weights["norm.weight"] = 1 + 0.1 * torch.randn(hidden, generator=generator)
    weights["d2t"] = draft_ids - torch.arange(len(draft_ids))  # int64: target id = draft id + d2t
    t2d = torch.zeros(text.vocab_size, dtype=torch.bool)
    t2d[draft_ids] = True
    weights["t2d"] = t2d
    return weights


def _save(out, config: dict, weights: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    save_file({k: v.contiguous() for k, v in weights.items()}, str(out / "model.safetensors"))


def write_specforge(out, target, hidden: int | None = None, vocab: int | None = None, layers=None, seed: int = 1):
    """SpecForge's Qwen2.5-VL-7B config shrunk: `LlamaForCausalLMEagle3`, one layer, `midlayer.*`."""
    text = _text(target)
    draft_ids = _draft_vocabulary(text.vocab_size, seed)
    config = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama",
              "target_model_type": target.model.config.model_type, "num_hidden_layers": 1,
              "attention_bias": False, "tie_word_embeddings": False, "pretraining_tp": 1, "torch_dtype": "float32",
              **_layer_sizes(target), **_rope(target), "vocab_size": vocab or text.vocab_size,
              "draft_vocab_size": len(draft_ids)}
    if hidden:  # a drafter made for a target of another width
        config["target_hidden_size"] = hidden
    if layers:
        config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": layers}
    weights = _weights(target, text.hidden_size, draft_ids, "midlayer.", embed=True, seed=seed)
    if hidden:
        weights["fc.weight"] = torch.randn(text.hidden_size, 3 * hidden) * STD
    _save(out, config, weights)


def write_speculators(out, target, layers=(1, 3, 5), seed: int = 2, vocab: int | None = None):
    """A speculators `Eagle3Speculator`: `speculators_config`, a Llama `transformer_layer_config`,
    `layers.0.*`, no `embed_tokens` (the target's table is used), explicit layer ids."""
    text = _text(target)
    draft_ids = _draft_vocabulary(text.vocab_size, seed)
    layer = {"model_type": "llama", "num_hidden_layers": 1, "attention_bias": False, "mlp_bias": False,
             "vocab_size": vocab or text.vocab_size, **_layer_sizes(target), **_rope(target)}
    config = {"architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3", "speculators_version": "0.3.0",
              "speculators_config": {"algorithm": "eagle3", "default_proposal_method": "greedy",
                                     "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 3}],
                                     "verifier": {"name_or_path": "tiny", "architectures": ["Tiny"]}},
              "transformer_layer_config": layer, "draft_vocab_size": len(draft_ids), "norm_before_residual": True,
              "target_hidden_size": text.hidden_size, "eagle_aux_hidden_state_layer_ids": list(layers)}
    _save(out, config, _weights(target, text.hidden_size, draft_ids, "layers.0.", embed=False, seed=seed))


CASES = [pytest.param(family, fmt, id=f"{family}-{fmt}") for family in FAMILIES for fmt in ("specforge", "speculators")]


# Exactness


@pytest.mark.parametrize("family, fmt", CASES)
@pytest.mark.parametrize("num_images", IMAGE_COUNTS)
@pytest.mark.parametrize("draft_tree", [0, 6], ids=("chain", "tree"))
def test_eagle3_speculation_equals_plain(zoo, family, fmt, num_images, draft_tree):
    """Chains of 4, and trees of up to 6 nodes 4 deep (2 children a node): the plain answer. The
    Qwen2.5-VL and SmolVLM targets verify on the fast path (the compiled stack where it builds),
    whose tree passes keep the rows EAGLE-3 reads; Qwen3-VL's on transformers' forward."""
    target, drafter = zoo.target(family), zoo.drafter(family, fmt)
    assert (target.runner.fast_fallback is None) == (family != "qwen3_vl")
    plain = answer(target, num_images)
    speculative = answer(target, num_images, drafter, draft_tree=draft_tree)
    assert speculative.token_ids == plain.token_ids
    assert speculative.stats.fallback_reason is None and speculative.stats.tree_fallback is None
    assert speculative.stats.drafter_kind == "eagle3"
    assert speculative.stats.draft_shape == ("tree" if draft_tree else "chain")
    assert max(speculative.stats.draft_lengths) == (draft_tree or 4)


def reference_logits(target, drafter, prompt, tokens: list[int], draft: list[int]) -> torch.Tensor:
    """(len(draft) + 1, V): step i drafting after `tokens` with draft[:i] fed, from scratch. One
    uncached target forward over tokens[:-1] gives every entry's g and the merged embeddings
    (image placeholders' rows); positions from the family's own prefill positions of the whole
    sequence; then the layer over all entries, causal, no cache, once per step."""
    module, num_prompt = drafter.module, len(prompt.input_ids)
    layers = drafter.layers
    states = uncached_forward(target, prompt, tokens[num_prompt:-1], output_hidden_states=True).hidden_states
    inputs = uncached_inputs(prompt, tokens[num_prompt:-1])
    positions, _ = target.family.prefill_positions(target.model, inputs)  # (1, T) or (3, 1, T)
    image_id = getattr(target.model.config, "image_token_id", None)
    with torch.inference_mode():
        g = module.project(torch.cat([states[layer][0] for layer in layers], dim=-1))  # (T, H)
        ids = torch.tensor(tokens[1:])
        embeds = drafter.embed(ids)
        image = torch.tensor(tokens[1:num_prompt] + [-1] * (len(tokens) - num_prompt)) == image_id
        embeds[image] = states[0][0][1:][image[:-1]]  # x_T is never an image token
        hidden, logits = g, []
        for step in range(len(draft) + 1):
            step_positions = torch.cat([positions, positions[..., -1:] + torch.arange(1, step + 1)], dim=-1)
            step_embeds = torch.cat([embeds, drafter.embed(torch.tensor(draft[:step], dtype=torch.long))])
            h = module(step_embeds[None], hidden[None], step_positions)[0]
            logits.append(drafter.logits(h[-1:])[0])
            hidden = torch.cat([g, module.feedback(h[len(g) - 1:])])
    return torch.stack(logits)


@pytest.mark.parametrize("family, fmt", CASES)
@pytest.mark.parametrize("num_images", IMAGE_COUNTS)
def test_eagle3_forced_acceptance_matches_reference(zoo, family, fmt, num_images):
    """Forced drafts through the real drafter: accepted exactly up to each corruption, and every
    round's logits equal the from-scratch reference, whatever was accepted before."""
    target, inner = zoo.target(family), zoo.drafter(family, fmt)
    truth = answer(target, num_images).token_ids
    proposed = corrupt(truth)
    drafter = ForcedDrafter(inner, proposed)
    done = answer(target, num_images, drafter, k=4)
    assert_forced_acceptance(done, truth, proposed, drafter.accepted)
    prompt = Engine(target).prepare(messages(num_images))
    for answer_len, logits in drafter.rounds[:6]:
        tokens = prompt.input_ids + truth[:answer_len]
        draft = proposed[answer_len:answer_len + len(logits) - 1]
        expected = reference_logits(target, inner, prompt, tokens, draft)
        got = torch.stack(logits)
        assert torch.equal(torch.isinf(got), torch.isinf(expected))  # the same draft vocabulary (d2t)
        finite = ~torch.isinf(expected)
        # float32 noise of the target's cached passes, grown by chained steps (the pre-norm h is fed back)
        scale = float(expected[finite].abs().max())
        torch.testing.assert_close(got[finite], expected[finite], atol=2e-4 * max(1.0, scale), rtol=1e-3)


@pytest.mark.skipif(fast_native.layer() is None, reason="no compiled module on this machine")
def test_eagle3_products_run_in_the_rows_kernel_with_the_modules_results(zoo):
    """On a CPU with the compiled module, every Linear of a loaded EAGLE-3 checkpoint computes its
    products of up to the rows kernel's most rows there (ATen's one-row 16-bit products read the
    weight slowly): the same values as nn.Linear's within float rounding. The layer's own run in
    one compiled call where it is covered (below); Qwen3-VL's interleaved M-RoPE keeps the module's
    forward, and the drafter says why."""
    drafter = zoo.drafter("qwen3_vl", "specforge")
    assert "interleaved M-RoPE" in drafter.fast_fallback and drafter.layer is drafter.module
    linears = [m for m in drafter.module.modules() if isinstance(m, torch.nn.Linear)]
    assert len(linears) == 9 and all(type(m) is RowsKernelLinear for m in linears)  # fc, q k v o, 3 MLP, lm_head
    generator = torch.Generator().manual_seed(0)
    for linear in linears:
        for rows in (1, 5, fast_native.layer().rows_kernel_max + 1):
            x = torch.randn(1, rows, linear.in_features, generator=generator)
            torch.testing.assert_close(linear(x), torch.nn.functional.linear(x, linear.weight, linear.bias),
                                       rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(fast_native.layer() is None, reason="no compiled module on this machine")
@pytest.mark.parametrize("family, fmt", [c for c in CASES if c.values[0] != "qwen3_vl"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=("float32", "bfloat16"))
def test_compiled_eagle3_layer_is_the_modules_forward(zoo, family, fmt, dtype):
    """fast_heads.FastEagle3 (the layer in one compiled call over a StaticKVCache layer) against the
    module's forward over its KVCache: 5 causal entries, then 3 under a tree-like mask, then the
    cache cropped to 6 and 2 more; h and the draft logits equal within float rounding (in bfloat16,
    the module's attention accumulates in SDPA's order, the compiled one in float32 in its own)."""
    loaded = zoo.drafter(family, fmt)
    assert loaded.fast_fallback is None and isinstance(loaded.layer, fast_heads.FastEagle3)
    module = copy.deepcopy(loaded.module).to(dtype)
    fast = fast_heads.FastEagle3(module)
    expected_cache, cache = eagle3_checkpoint.KVCache(), fast.new_cache(8)
    width, mrope = module.config.hidden_size, module.config.mrope_section is not None
    generator = torch.Generator().manual_seed(0)
    relative = 1e-5 if dtype == torch.float32 else 2e-2  # of the values' norm: 16-bit rounding of each step
    tree_mask = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)
    for first, n, keep in ((0, 5, None), (5, 3, None), (6, 2, 6)):
        if keep is not None:
            expected_cache.crop(keep), cache.crop(keep)
        embeds, hidden = (torch.randn(1, n, width, generator=generator).to(dtype) for _ in range(2))
        positions = torch.arange(first, first + n)[None]
        if mrope:  # three rows that differ, as after an image
            positions = torch.stack([positions, positions + 2, positions // 2])
        mask = None
        if first == 5:
            mask = torch.cat([torch.ones(n, first, dtype=torch.bool), tree_mask], dim=1)[None, None]
        elif first:
            mask = torch.ones(n, first + n, dtype=torch.bool).tril(first)[None, None]
        with torch.inference_mode():
            expected = module(embeds, hidden, positions, expected_cache, mask)
            got = fast(embeds, hidden, positions, cache, mask)
            for fast_rows, module_rows in ((got, expected), (fast.draft_logits(got[0]), module.draft_logits(got[0]))):
                error = (fast_rows.float() - module_rows.float()).norm() / module_rows.float().norm()
                assert error < relative, (first, float(error))
        assert len(cache) == len(expected_cache) == first + n


def test_d2t_places_draft_ids_at_target_ids(zoo):
    """Logits are -inf exactly at the target ids outside the draft vocabulary, and each draft
    row d lands at target id d + d2t[d]."""
    drafter = zoo.drafter("qwen2_5_vl", "specforge")
    h = torch.randn(2, drafter.module.config.hidden_size)
    with torch.inference_mode():
        full, draft = drafter.logits(h), drafter.module.draft_logits(h)
    kept = _draft_vocabulary(_text(zoo.target("qwen2_5_vl")).vocab_size, 1)
    assert torch.isinf(full).sum(-1).tolist() == [full.shape[1] - len(kept)] * 2
    assert torch.equal(full[:, kept], draft)
    assert not torch.equal(kept, torch.arange(len(kept)))  # the mapping is not the identity


def test_eagle3_samples_without_falling_back(zoo):
    """Sampling (rejection sampling against the drafter's distributions, -inf outside the draft
    vocabulary) runs through; equal seeds give equal answers."""
    assert_samples_without_falling_back(zoo.target("qwen3_vl"), zoo.drafter("qwen3_vl", "specforge"))


class TreesAroundTheAnswer(ScriptedTreeDrafter):
    """Trees around the true answer (a decoy beside every true node, often as the first child, so
    the accepted path's rows are not the pass's first rows) for the target to verify, while the
    real EAGLE-3 session follows each accepted path (`accept(num_accepted, path)`); every round
    the session also drafts a forced chain of the answer's next tokens, whose logits are kept."""

    def __init__(self, inner, truth: list[int], placeholder_ids):
        super().__init__(truth, placeholder_ids)
        self.inner, self.name, self.kind, self.reads = inner, inner.name, inner.kind, inner.reads
        self.logits: list[tuple[int, list[torch.Tensor]]] = []  # (answer length, the chain's logits)

    def begin(self, prompt, target_state):
        self.session = self.inner.begin(prompt, target_state)
        return self

    def propose_tree(self, generated, depth, budget, branching, sampler):
        forced = ForcedSampler(sampler.settings, self.continuation, len(generated))
        self.session.propose(generated, min(2, len(self.continuation) - len(generated)), forced)
        self.logits.append((len(generated), forced.logits))
        return super().propose_tree(generated, depth, budget, branching, sampler)

    def accept(self, num_accepted, path=None):
        super().accept(num_accepted, path)
        self.session.accept(num_accepted, path)


@pytest.mark.parametrize("family, num_images", [("qwen2_5_vl", 2), ("smolvlm", 1)])
def test_eagle3_continues_from_the_target_rows_of_the_accepted_path(zoo, family, num_images):
    """After each tree round the session's next logits equal the from-scratch reference's: the
    tree pass handed back the target's rows of the accepted path (branches that are not the
    first child included), in order."""
    target, inner = zoo.target(family), zoo.drafter(family, "specforge")
    truth = answer(target, num_images).token_ids
    drafter = TreesAroundTheAnswer(inner, truth, target.placeholder_ids)
    done = answer(target, num_images, drafter, draft_tree=1)
    assert done.token_ids == truth and done.stats.draft_shape == "tree"
    assert drafter.second_child_accepted >= 3 and max(map(len, drafter.paths)) >= 3
    prompt = Engine(target).prepare(messages(num_images))
    for answer_len, logits in [(n, rows) for n, rows in drafter.logits if rows][:8]:
        tokens = prompt.input_ids + truth[:answer_len]
        expected = reference_logits(target, inner, prompt, tokens, truth[answer_len:answer_len + len(logits) - 1])
        finite = ~torch.isinf(expected)
        scale = float(expected[finite].abs().max())
        torch.testing.assert_close(torch.stack(logits)[finite], expected[finite], atol=2e-4 * max(1.0, scale),
                                   rtol=1e-3)


def test_eagle3_tree_nodes_are_the_top_choices_along_each_path(zoo):
    target, drafter = zoo.target("qwen2_5_vl"), zoo.drafter("qwen2_5_vl", "specforge")
    assert_tree_nodes_are_top_choices(target, drafter, Engine(target).prepare(messages(1)), reference_logits)


def test_eagle3_without_context_decodes_plainly(zoo):
    """A target pass that kept no hidden states: the named fallback, the plain answer."""
    target, drafter = zoo.target("smolvlm"), zoo.drafter("smolvlm", "specforge")

    class Blind:
        name, kind, reads = drafter.name, drafter.kind, drafter.reads

        def begin(self, prompt, state):
            state.hidden = {}
            return drafter.begin(prompt, state)

    plain = answer(target, 1)
    done = answer(target, 1, Blind())
    assert done.token_ids == plain.token_ids
    assert "has no context" in done.stats.fallback_reason and done.stats.drafted == 0


# Refusals at load


@pytest.mark.parametrize("fmt, changes, reason", [
    ("specforge", {"hidden": 48}, "reads target hidden states of size 48, the target's are 64"),
    ("specforge", {"vocab": 1000}, "made for a vocabulary of 1000"),
    ("specforge", {"layers": [1, 2, 9]}, r"reads target layers \[2, 3, 10\], the target has 6"),
    ("speculators", {"layers": (1, 3, 6)}, r"reads target layers \[1, 3, 6\], the target has 6"),
    ("speculators", {"vocab": 1000}, "made for a vocabulary of 1000"),
])
def test_mismatched_checkpoint_is_refused_at_load(zoo, fmt, changes, reason):
    folder = zoo.folder("qwen2_5_vl", fmt, **changes)
    with pytest.raises(LoadError, match=reason) as error:
        load_drafter(folder, zoo.target("qwen2_5_vl"))
    assert "\n" not in str(error.value) and "does not fit the target" in str(error.value)


def test_one_axis_checkpoint_is_refused_for_an_mrope_target(zoo):
    folder = zoo.folder("smolvlm", "specforge")  # written for SmolVLM: no rope_scaling
    with pytest.raises(LoadError, match="1-axis, the target .* M-RoPE rows"):
        load_drafter(folder, zoo.target("qwen2_5_vl"))


def test_missing_weight_is_named(zoo, tmp_path):
    import shutil

    from safetensors.torch import load_file

    folder = tmp_path / "broken"
    shutil.copytree(zoo.folder("qwen2_5_vl", "specforge"), folder)
    weights = load_file(str(folder / "model.safetensors"))
    del weights["midlayer.hidden_norm.weight"]
    save_file(weights, str(folder / "model.safetensors"))
    with pytest.raises(LoadError, match=r"missing \['midlayer.hidden_norm.weight'\]"):
        load_drafter(str(folder), zoo.target("qwen2_5_vl"))


# The demo's trained drafter: its command, its folder, the export


def test_train_eagle3_writes_a_specforge_folder_that_loads_and_exports(tmp_path):
    """Two steps of `python -m models.demo.train_eagle3` on the target's own answers to two
    conversations (one batch, generated and run once, kept for step 2): a SpecForge folder that loads for the
    bundled target, and its speculators export, which loads too and drafts the same logits."""
    from models import eagle3
    from models.demo import train_eagle3

    out = tmp_path / "specforge"
    train_eagle3.main(["--out", str(out), "--steps", "2", "--batch-size", "2", "--threads", "1", "--ttt-steps", "2",
                       "--conversations", "2", "--target-answers", "--max-answer-tokens", "8"])  # step 2: the kept pass
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["draft_vocab_size"] < config["vocab_size"]
    exported = eagle3.export_speculators(str(out), str(tmp_path / "speculators"), "assets/demo/target")
    assert exported["speculators_config"]["algorithm"] == "eagle3"
    assert exported["eagle_aux_hidden_state_layer_ids"] == [i + 1 for i in train_eagle3.layers_as_outputs(6)]
    target = load_target(train_eagle3.DEFAULT_TARGET, MODEL_OPTIONS)
    drafters = [load_drafter(str(folder), target) for folder in (out, tmp_path / "speculators")]
    assert drafters[0].layers == drafters[1].layers == (2, 4, 5)
    h = torch.randn(3, config["hidden_size"])
    with torch.inference_mode():
        torch.testing.assert_close(drafters[0].logits(h), drafters[1].logits(h))
    done = answer(target, 1, drafters[1])
    assert done.token_ids == answer(target, 1).token_ids and done.stats.fallback_reason is None


def test_train_eagle3_init_continues_from_a_checkpoint_with_its_draft_vocabulary(tmp_path):
    """`--init DIR`: the drafter starts from DIR's weights and keeps its draft vocabulary (d2t),
    so a step at learning rate 0 writes DIR's weights back."""
    from safetensors.torch import load_file

    from models.demo import train_eagle3

    start = os.path.join(os.path.dirname(__file__), "..", "assets", "demo", "eagle3_drafter")
    out = tmp_path / "continued"
    train_eagle3.main(["--out", str(out), "--init", start, "--steps", "1", "--batch-size", "2", "--threads", "1",
                       "--ttt-steps", "2", "--lr", "0", "--draft-vocab", "64"])
    before, after = load_file(os.path.join(start, "model.safetensors")), load_file(str(out / "model.safetensors"))
    assert set(after) == set(before)
    for key in before:
        torch.testing.assert_close(after[key], before[key], rtol=0, atol=0, msg=key)


def test_auto_dtype_runs_a_large_module_in_bfloat16_where_the_cpu_has_it(monkeypatch):
    """--drafter-dtype auto on a CPU: a module of under SMALL_DRAFTER_PARAMETERS in float32; a
    larger one in bfloat16 where the CPU computes in bfloat16, else float32; greedy answers equal
    plain decoding either way (the target verifies every token)."""
    from engine.drafters import target_head
    from models.demo.drafter_data import DEFAULT_TARGET

    target = load_target(DEFAULT_TARGET, MODEL_OPTIONS)
    folder = os.path.join(os.path.dirname(__file__), "..", "assets", "demo", "eagle3_drafter")
    dtype = lambda: next(load_drafter(folder, target).module.parameters()).dtype  # noqa: E731
    assert dtype() == torch.float32  # 0.85 M parameters
    monkeypatch.setattr(target_head, "SMALL_DRAFTER_PARAMETERS", 1000)  # as if it were large
    monkeypatch.setattr(target_head, "cpu_computes_bfloat16", lambda: False)
    assert dtype() == torch.float32
    monkeypatch.setattr(target_head, "cpu_computes_bfloat16", lambda: True)
    drafter = load_drafter(folder, target)
    assert next(drafter.module.parameters()).dtype == torch.bfloat16
    assert answer(target, 1, drafter).token_ids == answer(target, 1).token_ids


def test_train_eagle3_mixed_batches_mix_lengths_and_keep_each_batch_every_epoch():
    """`--mixed-batches`: the same conversations cut into seeded random batches instead of batches
    of similar length; either way every epoch shows each conversation once and a batch's key
    names the same conversations every epoch (its kept target pass stays its own)."""
    import itertools

    from models.demo import world
    from models.demo.train_eagle3 import batches

    examples = [world.Example([], [world.assistant_turn("x" * (10 * i + 1))], "test") for i in range(12)]
    length = {id(e): i for i, e in enumerate(examples)}  # examples are numbered by length
    for mixed in (False, True):
        stream = batches(examples, 3, seed=0, mixed=mixed)
        epochs = [list(itertools.islice(stream, 4)) for _ in range(3)]
        groups = [{key: sorted(length[id(e)] for e in batch) for key, batch in epoch} for epoch in epochs]
        assert groups[0] == groups[1] == groups[2]
        assert sorted(i for group in groups[0].values() for i in group) == list(range(12))
        assert [key for key, _ in epochs[0]] != [key for key, _ in epochs[1]]  # batches reshuffled each epoch
        spans = [group[-1] - group[0] for group in groups[0].values()]
        assert (spans == [2, 2, 2, 2]) == (not mixed)  # by length: neighbours together; mixed: not
    again = batches(examples, 3, seed=0, mixed=True)
    assert [[length[id(e)] for e in b] for _, b in itertools.islice(again, 4)] == \
        [[length[id(e)] for e in b] for _, b in itertools.islice(batches(examples, 3, seed=0, mixed=True), 4)]


def test_train_eagle3_feature_loss_is_the_fed_back_rows_distance_from_g():
    """`--feature-weight`: step s's row of chain c, which step s + 1 reads where step 1 reads g,
    is scored against g of token c + s. With the layer's attention and MLP outputs zeroed every
    row is its residual, g_c, so the loss of step s is |g_c - g_{c+s}|^2 / |g_{c+s}|^2 summed over
    the chains whose token c + s is an answer token."""
    from models import eagle3
    from models.demo import world
    from models.demo.drafter_data import TargetPass
    from models.demo.train_eagle3 import DEFAULT_TARGET, draft_vocabulary, eagle3_losses, specforge_config
    from models.processors import load_processor
    from transformers import AutoModelForImageTextToText

    target = AutoModelForImageTextToText.from_pretrained(DEFAULT_TARGET, dtype=torch.float32).eval()
    processor = load_processor(DEFAULT_TARGET)
    examples = list(world.train_examples(0, 2))
    vocabulary = draft_vocabulary(processor, 512, examples)
    module = eagle3.Eagle3(eagle3.read_config_dict(specforge_config(target.config, len(vocabulary), "t")))
    with torch.no_grad():
        module.midlayer.self_attn.o_proj.weight.zero_()
        module.midlayer.mlp.down_proj.weight.zero_()
    layers = [2, 4, 5]
    batch = TargetPass(target, processor, examples, (0, *layers))
    draft_of = torch.full((module.config.vocab_size,), -1, dtype=torch.long)
    draft_of[vocabulary] = torch.arange(len(vocabulary))
    aligned = []
    with torch.no_grad():
        losses, _ = eagle3_losses(module, batch, layers, 3, draft_of, aligned)
        g = module.project(torch.cat([batch.hidden[layer] for layer in layers], dim=-1))  # (B, S, H)
    assert len(losses) == 3 and len(aligned) == 2
    n = g.shape[1] - 1
    for s, got in enumerate(aligned, start=1):
        num = den = 0.0
        for row in range(len(examples)):
            for c in range(n - s):
                if batch.answer[row, c + 1] and batch.answer[row, c + s]:  # a chain, and its token c + s answers
                    num += float((g[row, c] - g[row, c + s]).pow(2).sum())
                    den += float(g[row, c + s].pow(2).sum())
        assert den > 0
        torch.testing.assert_close(float(got), num / den, rtol=1e-4, atol=1e-6)


def test_train_eagle3_soft_labels_are_the_targets_distribution_over_the_draft_vocabulary():
    """`--soft-labels K`: with K = 1 the loss is the greedy label's cross-entropy, at every unrolled
    step; with K = the whole vocabulary it is -sum p log q with p the target's softmax over the
    draft vocabulary alone (the top-K ids outside it dropped), here computed from the target's
    logits at the draft vocabulary's ids, in their order."""
    from models import eagle3
    from models.demo import world
    from models.demo.drafter_data import TargetPass
    from models.demo.train_eagle3 import DEFAULT_TARGET, draft_vocabulary, eagle3_losses, specforge_config
    from models.processors import load_processor
    from transformers import AutoModelForImageTextToText

    torch.manual_seed(0)
    target = AutoModelForImageTextToText.from_pretrained(DEFAULT_TARGET, dtype=torch.float32).eval()
    processor = load_processor(DEFAULT_TARGET)
    examples = list(world.train_examples(0, 2))
    vocabulary = draft_vocabulary(processor, 256, examples)
    module = eagle3.Eagle3(eagle3.read_config_dict(specforge_config(target.config, len(vocabulary), "t")))
    layers = [2, 4, 5]
    draft_of = torch.full((module.config.vocab_size,), -1, dtype=torch.long)
    draft_of[vocabulary] = torch.arange(len(vocabulary))
    vocab_size = target.config.get_text_config().vocab_size
    assert len(vocabulary) < vocab_size  # some of the top-K ids fall outside the draft vocabulary

    def losses(batch):
        with torch.no_grad():
            return torch.stack(eagle3_losses(module, batch, layers, 3, draft_of)[0])

    hard = losses(TargetPass(target, processor, examples, (0, *layers)))
    torch.testing.assert_close(losses(TargetPass(target, processor, examples, (0, *layers), top_k=1)), hard)
    soft = TargetPass(target, processor, examples, (0, *layers), top_k=vocab_size)
    got = losses(soft)
    full = torch.zeros(*soft.top_ids.shape[:2], vocab_size).scatter_(2, soft.top_ids, soft.top_logits)
    soft.top_logits, soft.top_ids = full[..., vocabulary], vocabulary.expand(*full.shape[:2], -1)
    torch.testing.assert_close(got, losses(soft))
