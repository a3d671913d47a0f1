"""EAGLE-3 drafter checkpoints as their publishers write them: SpecForge's and vLLM's `speculators`.

Both hold one decoder layer that reads three of the target's hidden layers and the embedding of
the next token (Li et al. 2025, EAGLE-3; the arithmetic below is vLLM's `llama_eagle3.py` and
SpecForge's `llama3_eagle.py`, which agree):

    g   = fc(concat(a_1, a_2, a_3))                  (3 * H_target -> H) the target's rows of token j
    x   = concat(input_layernorm(embed(x_{j+1})), hidden_norm(g))         (2H: q/k/v take 2H)
    h   = r + o_proj(attention(x))                   r = g, or hidden_norm(g) (`norm_before_residual`)
    h   = h + mlp(post_attention_layernorm(h))
    logits = lm_head(norm(h))                        (H -> draft vocabulary), draft id d is target
                                                     id d + d2t[d]

Entry j sits at the target's rotary position of token j and predicts token j + 2; a further
draft step feeds the drafted token and the step's pre-norm h (not g) at the next position.

Formats (checked against SpecForge `configs/qwen2-5-vl-7b-eagle3.json` and
`specforge/modeling/draft/llama3_eagle.py`; speculators `models/eagle3/{config,core,
model_definitions}.py` and `convert/eagle/eagle3_converter.py`; vLLM `llama_eagle3.py`):

- SpecForge: a Llama config with `architectures: ["LlamaForCausalLMEagle3"]`, one layer,
  `draft_vocab_size`, `rope_scaling` `{"type": "mrope", "mrope_section": [...]}` for Qwen-VL
  targets, optionally `target_hidden_size` and `eagle_config.eagle_aux_hidden_state_layer_ids`
  (numbered as SGLang numbers them: the *output* of layer i, so hidden_states index i + 1;
  default [1, N/2 - 1, N - 4]). Weights `embed_tokens.weight`, `fc.weight` (H x 3H),
  `midlayer.{self_attn.{q,k,v,o}_proj, input_layernorm, hidden_norm, post_attention_layernorm,
  mlp.{gate,up,down}_proj}.weight`, `norm.weight`, `lm_head.weight` (draft vocab x H), buffers
  `d2t` (int64, draft vocab) and `t2d` (bool, target vocab). Residual: g (never normed).
- speculators: `speculators_model_type: "eagle3"`, `speculators_config` (`algorithm: eagle3`,
  `proposal_methods`, `default_proposal_method`, `verifier: {name_or_path, architectures}`),
  `transformer_layer_config` (a Llama or Qwen3 config: sizes, vocab_size = the target's),
  `draft_vocab_size`, `norm_before_residual` (default False in speculators, True where vLLM reads
  a config without it), `target_hidden_size`, `eagle_aux_hidden_state_layer_ids` (numbered as
  vLLM numbers them: *before* layer i, the hidden_states index itself; default
  [2, N/2, N - 3]). Weights as SpecForge's with `layers.0.` for `midlayer.`; `embed_tokens`
  may be absent (then the target's table is used, as vLLM does); `verifier_*` weights are
  training-only and skipped.

vLLM's and SpecForge's default layers are the same tensors ([1, N/2-1, N-4] as outputs are
[2, N/2, N-3] as inputs); here they are hidden_states indices (0 = embeddings, i = after layer i).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn
from transformers.models.llama.modeling_llama import LlamaRMSNorm, rotate_half

SPECFORGE_ARCHITECTURES = ("LlamaForCausalLMEagle3",)
SPECULATORS_ARCHITECTURES = ("Eagle3Speculator",)
IGNORED_WEIGHTS = ("verifier_lm_head.weight", "verifier_norm.weight")  # speculators' training-only copies


class FormatError(ValueError):
    """The checkpoint is EAGLE-3 but not one this file can run (the message says why)."""


@dataclass
class Eagle3Config:
    format: str  # "specforge" or "speculators"
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int  # the target's vocabulary it was made for
    draft_vocab_size: int
    target_hidden_size: int
    rms_norm_eps: float = 1e-6
    rope: dict = field(default_factory=lambda: {"rope_type": "default", "rope_theta": 10000.0})
    mrope_section: list[int] | None = None  # None: 1-axis RoPE
    mrope_interleaved: bool = False  # Qwen3-VL's layout of the three rows over the frequencies
    aux_layers: list[int] | None = None  # hidden_states indices; None: the default for the target's depth
    norm_before_residual: bool = False
    norm_before_fc: bool = False  # one RMSNorm over the concatenated rows before fc (speculators)
    fc_norm: bool = False  # one RMSNorm per target row before fc (SpecForge / speculators)
    feed_normed: bool = False  # speculators' `norm_output` (EAGLE 3.1): feed norm(h) to the next step
    norm_logits: bool = True  # SpecForge's `norm_output` (default True): logits from norm(h)
    qk_norm: bool = False  # a Qwen3 layer config: RMSNorm over each head of q and k
    hidden_act: str = "silu"
    attention_bias: bool = False
    verifier: str | None = None  # speculators' verifier name_or_path
    raw: dict = field(default_factory=dict, repr=False)

    def target_layers(self, num_target_layers: int) -> tuple[int, ...]:
        """The hidden_states indices it reads: its own, or vLLM's default (2, N/2, N-3)."""
        if self.aux_layers:
            return tuple(self.aux_layers)
        return (2, num_target_layers // 2, num_target_layers - 3)


def read_config(name: str) -> Eagle3Config | None:
    """The EAGLE-3 config of folder (or hub id) `name`, None when it is not an EAGLE-3 checkpoint;
    FormatError when it is one that cannot run here."""
    from transformers.utils import cached_file

    try:
        path = cached_file(name, "config.json")
    except (OSError, ValueError):
        return None  # not a checkpoint at all: the caller's own loading says why
    with open(path) as file:
        return read_config_dict(json.load(file))


def read_config_dict(raw: dict) -> Eagle3Config | None:
    """read_config of a config.json's contents."""
    if raw.get("speculators_model_type") == "eagle3" or (raw.get("speculators_config") or {}).get("algorithm") == "eagle3":
        return _speculators_config(raw)
    if set(raw.get("architectures") or ()) & set(SPECFORGE_ARCHITECTURES):
        return _specforge_config(raw)
    return None


def _rope(layer: dict) -> tuple[dict, list[int] | None, bool]:
    """(rope parameters, mrope_section, interleaved) of a Llama-style config dict (v4 or v5 keys)."""
    params = dict(layer.get("rope_parameters") or layer.get("rope_scaling") or {})
    params.setdefault("rope_theta", layer.get("rope_theta", params.get("rope_theta", 10000.0)))
    kind = params.get("rope_type", params.get("type", "default"))
    section = params.get("mrope_section")
    params["rope_type"] = "default" if kind in ("mrope", "default", None) else kind
    return params, (list(section) if section else None), bool(params.get("mrope_interleaved", False))


def _sizes(layer: dict) -> dict:
    heads = layer["num_attention_heads"]
    rope, section, interleaved = _rope(layer)
    return dict(hidden_size=layer["hidden_size"], intermediate_size=layer["intermediate_size"],
                num_attention_heads=heads, num_key_value_heads=layer.get("num_key_value_heads", heads),
                head_dim=layer.get("head_dim") or layer["hidden_size"] // heads,
                rms_norm_eps=layer.get("rms_norm_eps", 1e-6), rope=rope, mrope_section=section,
                mrope_interleaved=interleaved, hidden_act=layer.get("hidden_act", "silu"),
                attention_bias=bool(layer.get("attention_bias", False)))


def _one_layer(layers: int, where: str) -> None:
    if layers != 1:
        raise FormatError(f"it has {layers} decoder layers ({where}); only the published one-layer EAGLE-3 runs here")


def _specforge_config(raw: dict) -> Eagle3Config:
    _one_layer(raw.get("num_hidden_layers", 1), "num_hidden_layers")
    ids = (raw.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    return Eagle3Config(
        format="specforge", **_sizes(raw), vocab_size=raw["vocab_size"],
        draft_vocab_size=raw.get("draft_vocab_size") or raw["vocab_size"],
        target_hidden_size=raw.get("target_hidden_size") or raw["hidden_size"],
        aux_layers=[i + 1 for i in ids] if ids else None,  # SGLang: output of layer i = before layer i + 1
        fc_norm=bool(raw.get("fc_norm", False)), norm_logits=bool(raw.get("norm_output", True)), raw=raw)


def _speculators_config(raw: dict) -> Eagle3Config:
    layer = raw.get("transformer_layer_config") or {}
    if not layer:
        raise FormatError("its speculators config has no transformer_layer_config")
    _one_layer(layer.get("num_hidden_layers", 1), "transformer_layer_config.num_hidden_layers")
    if layer.get("model_type", "qwen3") not in ("llama", "qwen3"):
        raise FormatError(f"its decoder layer is {layer.get('model_type')!r}; llama and qwen3 layers run here")
    verifier = ((raw.get("speculators_config") or {}).get("verifier") or {}).get("name_or_path")
    return Eagle3Config(
        format="speculators", **_sizes(layer), vocab_size=layer["vocab_size"],
        draft_vocab_size=raw.get("draft_vocab_size") or layer["vocab_size"],
        target_hidden_size=raw.get("target_hidden_size") or layer["hidden_size"],
        aux_layers=list(raw["eagle_aux_hidden_state_layer_ids"]) if raw.get("eagle_aux_hidden_state_layer_ids") else None,
        norm_before_residual=bool(raw.get("norm_before_residual", False)),
        norm_before_fc=bool(raw.get("norm_before_fc", False)), fc_norm=bool(raw.get("fc_norm", False)),
        feed_normed=bool(raw.get("norm_output", False)), qk_norm=layer.get("model_type", "qwen3") == "qwen3",
        verifier=verifier, raw=raw)


# The module: parameter names are SpecForge's (speculators' `layers.0.` is renamed on load).


class Attention(nn.Module):
    def __init__(self, config: Eagle3Config, linear: type[nn.Linear] = nn.Linear):
        super().__init__()
        heads, kv_heads, head_dim, width = (config.num_attention_heads, config.num_key_value_heads, config.head_dim,
                                            2 * config.hidden_size)
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.q_proj = linear(width, heads * head_dim, bias=config.attention_bias)
        self.k_proj = linear(width, kv_heads * head_dim, bias=config.attention_bias)
        self.v_proj = linear(width, kv_heads * head_dim, bias=config.attention_bias)
        self.o_proj = linear(heads * head_dim, config.hidden_size, bias=False)
        if config.qk_norm:
            self.q_norm = LlamaRMSNorm(head_dim, config.rms_norm_eps)
            self.k_norm = LlamaRMSNorm(head_dim, config.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: KVCache | None,
                mask: torch.Tensor | None) -> torch.Tensor:
        """x (B, n, 2H); cos, sin (B, n, head_dim); mask (B, 1, n, cached + n) bool or None (causal,
        nothing cached). New K/V are appended to `cache`."""
        bsz, n, _ = x.shape
        q = self.q_proj(x).view(bsz, n, self.heads, self.head_dim)
        k = self.k_proj(x).view(bsz, n, self.kv_heads, self.head_dim)
        v = self.v_proj(x).view(bsz, n, self.kv_heads, self.head_dim).transpose(1, 2)
        if hasattr(self, "q_norm"):
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = (apply_rotary(t.transpose(1, 2), cos[:, None], sin[:, None]) for t in (q, k))
        if cache is not None:
            k, v = cache.append(k, v)
        groups = self.heads // self.kv_heads
        k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None and n > 1)
        return self.o_proj(out.transpose(1, 2).reshape(bsz, n, -1))


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x rotated as transformers' `apply_rotary_pos_emb` rotates q and k (its rotate_half)."""
    return x * cos + rotate_half(x) * sin


class MLP(nn.Module):
    def __init__(self, config: Eagle3Config, linear: type[nn.Linear] = nn.Linear):
        super().__init__()
        from transformers.activations import ACT2FN

        self.gate_proj = linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = linear(config.intermediate_size, config.hidden_size, bias=False)
        self.act = ACT2FN[config.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class MidLayer(nn.Module):
    def __init__(self, config: Eagle3Config, linear: type[nn.Linear] = nn.Linear):
        super().__init__()
        self.self_attn = Attention(config, linear)
        self.mlp = MLP(config, linear)
        self.input_layernorm = LlamaRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.hidden_norm = LlamaRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = LlamaRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.norm_before_residual = config.norm_before_residual


class Eagle3(nn.Module):
    """The EAGLE-3 layer. `linear`: the class of its products (nn.Linear, or a subclass with the
    same parameters whose forward computes the same product elsewhere: the engine passes
    engine/rows_kernel.py's RowsKernelLinear)."""

    def __init__(self, config: Eagle3Config, own_embedding: bool = True, linear: type[nn.Linear] = nn.Linear):
        super().__init__()
        self.config = config
        width = 3 * config.target_hidden_size
        if own_embedding:
            self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        if config.norm_before_fc:
            self.input_norm = LlamaRMSNorm(width, config.rms_norm_eps)
        if config.fc_norm:
            self.fc_norm = nn.ModuleList(LlamaRMSNorm(config.target_hidden_size, config.rms_norm_eps) for _ in range(3))
        self.fc = linear(width, config.hidden_size, bias=False)
        self.midlayer = MidLayer(config, linear)
        self.norm = LlamaRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = linear(config.hidden_size, config.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.ones(config.vocab_size, dtype=torch.bool))
        self.register_buffer("inv_freq", inverse_frequencies(config), persistent=False)

    def project(self, rows: torch.Tensor) -> torch.Tensor:
        """g (.., H) from the target's rows (.., 3 * H_target), the three layers concatenated."""
        if hasattr(self, "input_norm"):
            rows = self.input_norm(rows)
        if hasattr(self, "fc_norm"):
            rows = torch.cat([norm(part) for norm, part in zip(self.fc_norm, rows.chunk(3, dim=-1))], dim=-1)
        return self.fc(rows)

    def forward(self, embeds: torch.Tensor, hidden: torch.Tensor, position_ids: torch.Tensor,
                cache: KVCache | None = None, mask: torch.Tensor | None = None) -> torch.Tensor:
        """embeds (B, n, H): embeddings of tokens j + 1; hidden (B, n, H): g of token j or the
        previous step's output; position_ids (B, n) or (3, B, n). Returns the pre-norm h (B, n, H)."""
        layer = self.midlayer
        normed = layer.hidden_norm(hidden)
        residual = normed if layer.norm_before_residual else hidden
        x = torch.cat([layer.input_layernorm(embeds), normed], dim=-1)
        cos, sin = self.rotary(position_ids, x.dtype)
        h = residual + layer.self_attn(x, cos, sin, cache, mask)
        return h + layer.mlp(layer.post_attention_layernorm(h))

    def feedback(self, h: torch.Tensor) -> torch.Tensor:
        """What the next draft step reads as its hidden state: h, or norm(h) (speculators' norm_output)."""
        return self.norm(h) if self.config.feed_normed else h

    def draft_logits(self, h: torch.Tensor) -> torch.Tensor:
        """(.., draft vocab) logits of pre-norm rows h."""
        return self.lm_head(self.norm(h) if self.config.norm_logits else h)

    def target_ids(self) -> torch.Tensor:
        """(draft vocab,) the target id of each draft id."""
        return torch.arange(len(self.d2t), device=self.d2t.device) + self.d2t

    def rotary(self, position_ids: torch.Tensor, dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin (B, n, head_dim) of position_ids (B, n), or (3, B, n) three M-RoPE rows."""
        section = self.config.mrope_section
        if section is None:
            if position_ids.dim() == 3:
                raise ValueError("a 1-axis EAGLE-3 layer was given three M-RoPE rows")
            freqs = position_ids[..., None].float() * self.inv_freq  # (B, n, hd/2)
        else:
            rows = position_ids if position_ids.dim() == 3 else position_ids[None].expand(3, -1, -1)
            freqs = rows[..., None].float() * self.inv_freq  # (3, B, n, hd/2)
            freqs = mrope_merge(freqs, section, self.config.mrope_interleaved)
        emb = torch.cat([freqs, freqs], dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)


def mrope_merge(freqs: torch.Tensor, section: list[int], interleaved: bool) -> torch.Tensor:
    """(B, n, hd/2) frequencies from the three rows' (3, B, n, hd/2): Qwen2-VL's contiguous
    sections (time, height, width), or Qwen3-VL's interleaved layout (t h w t h w ... t)."""
    if interleaved:
        merged = freqs[0].clone()
        for row in (1, 2):
            index = slice(row, section[row] * 3, 3)
            merged[..., index] = freqs[row][..., index]
        return merged
    return torch.cat([part[i % 3] for i, part in enumerate(freqs.split(section, dim=-1))], dim=-1)


def inverse_frequencies(config: Eagle3Config) -> torch.Tensor:
    """(head_dim / 2,) rotary inverse frequencies: default, or a scaling transformers knows (llama3, ...)."""
    rope = config.rope
    if rope.get("rope_type", "default") == "default":
        dims = torch.arange(0, config.head_dim, 2, dtype=torch.float32) / config.head_dim
        return 1.0 / (float(rope.get("rope_theta", 10000.0)) ** dims)
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    if rope["rope_type"] not in ROPE_INIT_FUNCTIONS:
        raise FormatError(f"its rope type {rope['rope_type']!r} is unknown to transformers")
    llama = LlamaConfig(hidden_size=config.hidden_size, num_attention_heads=config.num_attention_heads,
                        head_dim=config.head_dim, rope_parameters=rope,
                        max_position_embeddings=config.raw.get("max_position_embeddings", 8192))
    return ROPE_INIT_FUNCTIONS[rope["rope_type"]](llama)[0].float()


class KVCache:
    """The layer's keys and values, (B, kv_heads, n, head_dim) each; `crop(n)` keeps the first n."""

    def __init__(self):
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None

    def __len__(self) -> int:
        return 0 if self.keys is None else self.keys.shape[2]

    def append(self, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.keys is not None:
            keys, values = torch.cat([self.keys, keys], dim=2), torch.cat([self.values, values], dim=2)
        self.keys, self.values = keys, values
        return keys, values

    def crop(self, length: int) -> None:
        if self.keys is not None:
            self.keys, self.values = self.keys[:, :, :length], self.values[:, :, :length]


# Files


def weight_files(name: str) -> list[str]:
    """The safetensors files of folder or hub id `name` (FormatError for pickle-only checkpoints)."""
    from transformers.utils import cached_file

    for index_name in ("model.safetensors.index.json",):
        index = cached_file(name, index_name, _raise_exceptions_for_missing_entries=False)
        if index:
            with open(index) as file:
                shards = sorted(set(json.load(file)["weight_map"].values()))
            return [cached_file(name, shard) for shard in shards]
    path = cached_file(name, "model.safetensors", _raise_exceptions_for_missing_entries=False)
    if path is None:
        raise FormatError("it has no model.safetensors (weights load from safetensors only; a "
                          "pytorch_model.bin can be converted with safetensors' convert script)")
    return [path]


def read_weights(name: str, config: Eagle3Config) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors under this module's (SpecForge's) names."""
    weights = {}
    for path in weight_files(name):
        weights.update(load_file(path))
    renamed = {}
    for key, tensor in weights.items():
        key = key.removeprefix("model.")
        if key in IGNORED_WEIGHTS:
            continue
        renamed["midlayer." + key[len("layers.0."):] if key.startswith("layers.0.") else key] = tensor
    return renamed


def load(name: str, config: Eagle3Config, dtype=torch.float32, device="cpu",
         linear: type[nn.Linear] = nn.Linear) -> Eagle3:
    """The module of checkpoint `name` (its products of class `linear`: Eagle3); FormatError naming
    missing, unexpected or mis-shaped weights."""
    weights = read_weights(name, config)
    module = Eagle3(config, own_embedding="embed_tokens.weight" in weights, linear=linear)
    expected = module.state_dict()
    weights.setdefault("d2t", expected["d2t"])  # no mapping: the draft vocabulary is the target's
    weights.setdefault("t2d", expected["t2d"])
    missing = sorted(set(expected) - set(weights))
    unexpected = sorted(set(weights) - set(expected))
    shapes = [f"{key} {tuple(weights[key].shape)} (expected {tuple(expected[key].shape)})"
              for key in expected if key in weights and weights[key].shape != expected[key].shape]
    problems = ([f"missing {missing}"] if missing else []) + ([f"unexpected {unexpected}"] if unexpected else []) + \
        ([f"mis-shaped {', '.join(shapes)}"] if shapes else [])
    if problems:
        raise FormatError(f"its {config.format} weights do not match its config: " + "; ".join(problems))
    module.load_state_dict(weights, strict=True)
    module = module.to(device=device, dtype=dtype)
    return module.eval()


def save_specforge(module: Eagle3, folder: str, config: dict, shared_embedding: bool = False) -> None:
    """config.json (the SpecForge config dict) and model.safetensors, as SpecForge writes them;
    `shared_embedding`: without `embed_tokens.weight` (a frozen copy of the target's table, which
    the loader then takes from the target, as for speculators checkpoints)."""
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "config.json"), "w") as file:
        json.dump(config, file, indent=2)
    state = {key: tensor.detach().contiguous() for key, tensor in module.state_dict().items()
             if not (shared_embedding and key == "embed_tokens.weight")}
    save_file({key: t.float() if t.is_floating_point() else t for key, t in state.items()},
              os.path.join(folder, "model.safetensors"))


def speculators_config(specforge: dict, verifier: str, verifier_architectures: list[str]) -> dict:
    """The speculators config.json of a SpecForge config (what speculators' Eagle3Converter writes:
    the layer's sizes in a Llama `transformer_layer_config`, the EAGLE-3 fields at the top)."""
    layer_keys = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                  "rms_norm_eps", "hidden_act", "max_position_embeddings", "rope_theta", "rope_scaling",
                  "attention_bias", "vocab_size", "bos_token_id", "eos_token_id", "torch_dtype")
    layer = {key: specforge[key] for key in layer_keys if key in specforge}
    ids = (specforge.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    config = {
        "architectures": list(SPECULATORS_ARCHITECTURES),
        "speculators_model_type": "eagle3",
        "speculators_config": {
            "algorithm": "eagle3",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 3}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": verifier, "architectures": verifier_architectures},
        },
        "transformer_layer_config": {"model_type": "llama", "num_hidden_layers": 1, "tie_word_embeddings": False,
                                     "mlp_bias": False, **layer},
        "draft_vocab_size": specforge.get("draft_vocab_size", specforge["vocab_size"]),
        "norm_before_residual": False,  # SpecForge's residual is the un-normed g
        "target_hidden_size": specforge.get("target_hidden_size", specforge["hidden_size"]),
    }
    if ids:
        config["eagle_aux_hidden_state_layer_ids"] = [i + 1 for i in ids]  # vLLM numbers layer inputs
    if specforge.get("fc_norm"):
        config["fc_norm"] = True
    return config


def export_speculators(specforge_folder: str, out: str, verifier: str | None = None) -> dict:
    """Write `out` (config.json + model.safetensors) in speculators' format from a SpecForge
    folder: the config restructured, `midlayer.*` renamed `layers.0.*`, tensors unchanged."""
    with open(os.path.join(specforge_folder, "config.json")) as file:
        specforge = json.load(file)
    verifier = verifier or specforge.get("target_name_or_path") or "unknown"
    verifier_architectures = specforge.get("target_architectures") or []
    config = speculators_config(specforge, verifier, verifier_architectures)
    weights = load_file(os.path.join(specforge_folder, "model.safetensors"))
    os.makedirs(out, exist_ok=True)
    save_file({("layers.0." + key[len("midlayer."):] if key.startswith("midlayer.") else key): tensor
               for key, tensor in weights.items()}, os.path.join(out, "model.safetensors"))
    with open(os.path.join(out, "config.json"), "w") as file:
        json.dump(config, file, indent=2)
    return config


def main(argv=None) -> None:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m models.eagle3",
                                     description="Export a SpecForge EAGLE-3 folder to vLLM speculators' format")
    parser.add_argument("specforge", help="a SpecForge EAGLE-3 folder (config.json + model.safetensors)")
    parser.add_argument("--to-speculators", metavar="OUT", required=True, help="the folder to write")
    parser.add_argument("--verifier", help="the target's hub id or path (speculators_config.verifier.name_or_path)")
    args = parser.parse_args(argv)
    config = export_speculators(args.specforge, args.to_speculators, args.verifier)
    verifier = config["speculators_config"]["verifier"]["name_or_path"]
    print(f"wrote {args.to_speculators}: speculators eagle3, verifier {verifier}, "
          f"draft vocabulary {config['draft_vocab_size']}")


if __name__ == "__main__":
    main()
