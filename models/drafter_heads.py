"""Drafter modules of our own, built from the target family's decoder layers (Qwen2-VL's, or
Qwen3.5's for a Qwen3.5 checkpoint's MTP weights, with their M-RoPE rotary embedding), that run
at the target's own positions:

- `MtpHead`: multi-token prediction as Qwen3.5 / DeepSeek-V3 MTP layers do it. Entry j reads
  the embedding of token j + 1 and a hidden state for token j (the target's last hidden state,
  or the head's own output of the step before), and predicts token j + 2:
      x = fc([enorm(embedding), hnorm(hidden)]);  x = layers(x);  out = norm(x)
  `out` goes through the target's output head and, drafting further, is the next step's
  hidden state. At prompt positions the embedding is the target's merged input embedding
  (image features at image positions).
- `BlockDrafter`: a DFlash-style block drafter. Its sequence is one *context* row per
  committed token (the target's hidden states at `target_hidden_layers`, concatenated, normed,
  projected) followed by one *block*: the embedding of the newest committed token (the anchor)
  and block_size - 1 copies of a learned mask embedding. Context rows attend causally; block
  rows attend to every context row and to the whole block. The block's outputs after the
  anchor, through the target's output head, are block_size - 1 draft tokens from one pass.

Both share the target's embedding table and output head (neither holds a copy in its weights):
all of the head's rows, or with `draft_vocab_size` N > 0 the rows of N target token ids that the
module keeps in its buffer `draft_ids` (a reduced output vocabulary, as EAGLE-3's d2t: a draft
step reads N rows of the head instead of the vocabulary's). Both take position ids (3, B, n):
the target's M-RoPE rows, or a 1-axis position repeated on three rows (M-RoPE with equal rows is
plain RoPE). A folder holds `config.json` (model_type `mtp_head` or `block_drafter`, registered
with AutoConfig below) and `model.safetensors`.
"""

from __future__ import annotations

import json
import os

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import AutoConfig, PreTrainedConfig
from transformers.models.qwen2_vl.configuration_qwen2_vl import Qwen2VLTextConfig
from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VLDecoderLayer, Qwen2VLRMSNorm, Qwen2VLRotaryEmbedding
from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig
from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5DecoderLayer, Qwen3_5RMSNorm, Qwen3_5TextRotaryEmbedding


class HeadConfig(PreTrainedConfig):
    """Sizes of a drafter module's decoder layers, and what it was made for (the target's
    hidden size and vocabulary, which it shares)."""

    hidden_size: int = 192
    intermediate_size: int = 576
    num_hidden_layers: int = 1
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    mrope_section: list[int] | tuple[int, ...] = (6, 9, 9)
    vocab_size: int = 640
    draft_vocab_size: int = 0  # 0: logits over the whole vocabulary; N: over the N target ids of `draft_ids`
    max_position_embeddings: int = 2048
    target_model_type: str = "qwen2_vl"
    # Whose decoder layers: "qwen2_vl" (built from the sizes above) or "qwen3_5" (Qwen3.5's
    # full-attention layer with its gated attention, q/k norms, (1 + w) RMSNorm and interleaved
    # partial M-RoPE, built from `layer_config`, the Qwen3.5 text config as a dict).
    layers_from: str = "qwen2_vl"
    layer_config: dict | None = None

    def decoder_config(self) -> PreTrainedConfig:
        """The config the decoder layers are built from."""
        if self.layers_from == "qwen3_5":
            config = Qwen3_5TextConfig(**self.layer_config)
        else:
            config = Qwen2VLTextConfig(
                vocab_size=self.vocab_size, hidden_size=self.hidden_size, intermediate_size=self.intermediate_size,
                num_hidden_layers=self.num_hidden_layers, num_attention_heads=self.num_attention_heads,
                num_key_value_heads=self.num_key_value_heads, rms_norm_eps=self.rms_norm_eps,
                max_position_embeddings=self.max_position_embeddings,
                rope_parameters={"rope_type": "default", "rope_theta": self.rope_theta, "mrope_section": self.mrope_section},
                bos_token_id=None, eos_token_id=None, pad_token_id=None)
        config._attn_implementation = "sdpa"
        return config

    @classmethod
    def for_target(cls, target_config, **sizes) -> HeadConfig:
        """A config that fits `target_config` (a VLM's): its hidden size, vocabulary, heads and
        rotary sections; `sizes` override (e.g. num_hidden_layers)."""
        text = target_config.get_text_config()
        rope = getattr(text, "rope_parameters", None) or {}
        head_dim = text.hidden_size // text.num_attention_heads
        section = rope.get("mrope_section") or _mrope_section(head_dim)
        fields = dict(hidden_size=text.hidden_size, intermediate_size=text.intermediate_size,
                      num_attention_heads=text.num_attention_heads, num_key_value_heads=text.num_key_value_heads,
                      rms_norm_eps=text.rms_norm_eps, rope_theta=rope.get("rope_theta", 10000.0),
                      mrope_section=section, vocab_size=text.vocab_size,
                      max_position_embeddings=text.max_position_embeddings, target_model_type=target_config.model_type)
        return cls(**(fields | sizes))


def _mrope_section(head_dim: int) -> list[int]:
    t = head_dim // 2 // 4
    return [t, (head_dim // 2 - t) // 2, head_dim // 2 - t - (head_dim // 2 - t) // 2]


class MtpHeadConfig(HeadConfig):
    model_type = "mtp_head"


class BlockDrafterConfig(HeadConfig):
    """target_hidden_layers: indices as `output_hidden_states` numbers them (0 = input
    embeddings, i = after layer i; the last is the target's normed output)."""

    model_type = "block_drafter"
    target_hidden_layers: list[int] | tuple[int, ...] = (2, 4, 6)
    block_size: int = 5


AutoConfig.register(MtpHeadConfig.model_type, MtpHeadConfig)
AutoConfig.register(BlockDrafterConfig.model_type, BlockDrafterConfig)


# (decoder layer, RMSNorm, rotary embedding) of each family the modules can be built from
LAYER_CLASSES = {
    "qwen2_vl": (Qwen2VLDecoderLayer, Qwen2VLRMSNorm, Qwen2VLRotaryEmbedding),
    "qwen3_5": (Qwen3_5DecoderLayer, Qwen3_5RMSNorm, Qwen3_5TextRotaryEmbedding),
}


def rms_norm(config: HeadConfig, width: int | None = None) -> nn.Module:
    """The family's RMSNorm (Qwen3.5's scales by 1 + w)."""
    return LAYER_CLASSES[config.layers_from][1](width or config.hidden_size, eps=config.rms_norm_eps)


class DecoderStack(nn.Module):
    """The target family's decoder layers with their M-RoPE rotary embedding, and a final norm."""

    def __init__(self, config: HeadConfig):
        super().__init__()
        layer_class, _, rotary_class = LAYER_CLASSES[config.layers_from]
        decoder_config = config.decoder_config()
        self.layers = nn.ModuleList(layer_class(decoder_config, i) for i in range(config.num_hidden_layers))
        self.rotary = rotary_class(decoder_config)
        self.norm = rms_norm(config)

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor, mask: torch.Tensor | None, cache=None) -> torch.Tensor:
        """x (B, n, H), position_ids (3, B, n), mask (B, 1, n, cached + n) bool (True = attend)
        or None (every row attends to everything); new K/V are appended to `cache`. Returns the
        normed outputs (B, n, H)."""
        position_embeddings = self.rotary(x, position_ids.expand(3, x.shape[0], -1))
        for layer in self.layers:
            x = layer(x, attention_mask=mask, cache=cache, use_cache=cache is not None,
                      position_embeddings=position_embeddings)
        return self.norm(x)


def add_draft_ids(module: nn.Module, config: HeadConfig) -> None:
    """The buffer `draft_ids` (draft_vocab_size,) int64, ascending target token ids whose rows of
    the target's output head give the module's logits; none for the whole vocabulary."""
    if config.draft_vocab_size:
        module.register_buffer("draft_ids", torch.zeros(config.draft_vocab_size, dtype=torch.long))


class MtpHead(nn.Module):
    def __init__(self, config: MtpHeadConfig):
        super().__init__()
        self.config = config
        self.enorm = rms_norm(config)
        self.hnorm = rms_norm(config)
        self.fc = nn.Linear(2 * config.hidden_size, config.hidden_size, bias=False)
        self.stack = DecoderStack(config)
        add_draft_ids(self, config)

    def forward(self, embeds: torch.Tensor, hidden: torch.Tensor, position_ids: torch.Tensor,
                mask: torch.Tensor | None = None, cache=None) -> torch.Tensor:
        """embeds, hidden (B, n, H): embedding of token j + 1 and hidden state of token j for
        entries j; position_ids (3, B, n): positions of tokens j + 1. Returns (B, n, H)."""
        x = self.fc(torch.cat([self.enorm(embeds), self.hnorm(hidden)], dim=-1))
        return self.stack(x, position_ids, mask, cache)


class BlockDrafter(nn.Module):
    def __init__(self, config: BlockDrafterConfig):
        super().__init__()
        self.config = config
        width = len(config.target_hidden_layers) * config.hidden_size
        self.context_norm = rms_norm(config, width)
        self.context_fc = nn.Linear(width, config.hidden_size, bias=False)
        self.mask_embedding = nn.Parameter(torch.zeros(config.hidden_size))
        self.stack = DecoderStack(config)
        add_draft_ids(self, config)

    def block_embeds(self, anchor_embeds: torch.Tensor) -> torch.Tensor:
        """(B, block_size, H): the anchor's embedding (B, 1, H), then the mask embedding."""
        masks = self.mask_embedding.to(anchor_embeds.dtype).expand(anchor_embeds.shape[0], self.config.block_size - 1, -1)
        return torch.cat([anchor_embeds, masks], dim=1)

    def forward(self, context: torch.Tensor, block: torch.Tensor, position_ids: torch.Tensor,
                mask: torch.Tensor | None, cache=None) -> torch.Tensor:
        """context (B, m, L * H): target hidden rows (m may be 0); block (B, b, H) from
        `block_embeds`; position_ids (3, B, m + b). Returns the outputs of every row (B, m + b, H)."""
        rows = self.context_fc(self.context_norm(context)).to(block.dtype)
        return self.stack(torch.cat([rows, block], dim=1), position_ids, mask, cache)


MODULES = {MtpHeadConfig.model_type: MtpHead, BlockDrafterConfig.model_type: BlockDrafter}


def build(config: HeadConfig) -> nn.Module:
    return MODULES[config.model_type](config)


def save(module: nn.Module, folder: str) -> None:
    """config.json + model.safetensors (weights float32, `draft_ids` int64)."""
    os.makedirs(folder, exist_ok=True)
    module.config.save_pretrained(folder)
    save_file({name: (t.float() if t.is_floating_point() else t).detach().contiguous()
               for name, t in module.state_dict().items()},
              os.path.join(folder, "model.safetensors"))


def load(folder: str, config: HeadConfig | None = None, dtype=torch.float32, device="cpu") -> nn.Module:
    """The module a folder written by `save` holds."""
    config = config or AutoConfig.from_pretrained(folder)
    return load_weights(config, os.path.join(folder, "model.safetensors"), dtype, device)


def load_weights(config: HeadConfig, path: str, dtype=torch.float32, device="cpu") -> nn.Module:
    """`config`'s module with the weights of a safetensors file (strict: all present, none extra)."""
    module = build(config)
    module.load_state_dict(load_file(path), strict=True)
    return module.to(device=device, dtype=dtype).eval()


def causal_mask(num_new: int, num_cached: int, device="cpu") -> torch.Tensor:
    """(1, 1, num_new, num_cached + num_new) bool: new row i sees every cached row and new rows <= i."""
    rows = torch.arange(num_new, device=device)[:, None]
    cols = torch.arange(num_cached + num_new, device=device)[None, :]
    return (cols <= rows + num_cached)[None, None]



# ---------------------------------------------------------------- Qwen3.5 / 3.6 MTP weights

# Published Qwen3.5 checkpoints keep their MTP layers beside the model (transformers builds no
# module for them): mtp.fc (H x 2H, over [embedding, hidden], as vLLM's qwen3_5_mtp.py and
# DeepSeek-V3's eh_proj concatenate), mtp.pre_fc_norm_embedding, mtp.pre_fc_norm_hidden,
# mtp.layers.<i>.* (full-attention decoder layers, named as the model's own layers) and mtp.norm.
QWEN3_5_MTP_NAMES = {"fc.": "fc.", "pre_fc_norm_embedding.": "enorm.", "pre_fc_norm_hidden.": "hnorm.",
                     "layers.": "stack.layers.", "norm.": "stack.norm."}


def mtp_head_from_qwen3_5(checkpoint: str, out: str | None = None) -> MtpHead:
    """An MtpHead from a Qwen3.5 / 3.6 checkpoint folder's `mtp.*` weights, written to folder
    `out` (config.json + model.safetensors) if given; strict: every weight of the head must be
    found. Dense models only (a MoE checkpoint's experts are named otherwise)."""
    config = AutoConfig.from_pretrained(checkpoint)
    text = config.get_text_config()
    num_layers = getattr(text, "mtp_num_hidden_layers", 0) or 0
    if num_layers < 1:
        raise ValueError(f"{checkpoint}: the config declares no MTP layers (mtp_num_hidden_layers)")
    layer_config = text.to_dict() | {"num_hidden_layers": num_layers, "layer_types": ["full_attention"] * num_layers}
    rope = getattr(text, "rope_parameters", None) or {}
    head_config = MtpHeadConfig(
        hidden_size=text.hidden_size, intermediate_size=text.intermediate_size, num_hidden_layers=num_layers,
        num_attention_heads=text.num_attention_heads, num_key_value_heads=text.num_key_value_heads,
        rms_norm_eps=text.rms_norm_eps, rope_theta=rope.get("rope_theta", 10000.0),
        mrope_section=rope.get("mrope_section") or [], vocab_size=text.vocab_size,
        max_position_embeddings=text.max_position_embeddings, target_model_type=config.model_type,
        layers_from="qwen3_5", layer_config={k: v for k, v in layer_config.items() if not k.startswith("_")})
    weights = {}
    for path in _safetensors_files(checkpoint):
        with safe_open(path, framework="pt") as shard:  # reads the mtp.* tensors only, not the model's
            for name in shard.keys():
                rest = name.removeprefix("model.")  # "mtp.*" at the top level (or under "model.")
                if rest.startswith("mtp."):
                    rest = rest.removeprefix("mtp.")
                    prefix = next((p for p in QWEN3_5_MTP_NAMES if rest.startswith(p)), None)
                    if prefix is None:
                        raise ValueError(f"{checkpoint}: unknown MTP weight {name!r}")
                    weights[QWEN3_5_MTP_NAMES[prefix] + rest[len(prefix):]] = shard.get_tensor(name)
    head = MtpHead(head_config)
    head.load_state_dict(weights, strict=True)
    if out is not None:
        save(head, out)
    return head


def _safetensors_files(folder: str) -> list[str]:
    index = os.path.join(folder, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as file:
            return sorted({os.path.join(folder, f) for f in json.load(file)["weight_map"].values()})
    return [os.path.join(folder, "model.safetensors")]


def main(argv=None) -> None:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m models.drafter_heads",
                                     description="Write an MTP head folder from a Qwen3.5 / 3.6 checkpoint's mtp.* weights")
    parser.add_argument("checkpoint", help="a local Qwen3.5 / 3.6 checkpoint folder (config.json + safetensors)")
    parser.add_argument("out", help="the folder to write (then: --drafter OUT)")
    args = parser.parse_args(argv)
    head = mtp_head_from_qwen3_5(args.checkpoint, args.out)
    print(f"wrote {args.out}: {head.config.num_hidden_layers} MTP layer(s), "
          f"{sum(p.numel() for p in head.parameters()):,} parameters")


if __name__ == "__main__":
    main()
