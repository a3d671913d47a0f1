"""A hand-written forward of a llama-style text stack for decode and verify passes.

At one token per pass a small model's time goes to per-operation cost (dispatch, Python, the
wrapper's mask and cache bookkeeping), not to arithmetic: docs/performance.md. This forward does
the same arithmetic as transformers' (RMSNorm in float32, rotary embedding, SDPA, SiLU MLP) in
fewer operations, over a StaticKVCache (engine/static_cache.py):
- q, k, v are one matrix product (and gate, up another) on weights concatenated at load;
- in bfloat16 / float16 on a CPU every product's weight is stored input-major, (in, out) contiguous: a
  one-row product then streams it about 1.4-2.9x faster on this CPU than the (out, in) layout
  (docs/performance.md). The model's own Linear weights become views of these buffers (same
  values, no second copy), so transformers' forward (prefill) reads the same memory;
- rotary cos / sin come from a table indexed by position, applied to q and k in one go, with
  rotate_half(x) * sin written as flip(halves of x) * signed_sin (the same products, exactly);
- RMSNorm is torch's fused `rms_norm` (bitwise equal to transformers' float32 arithmetic; for
  16-bit weights the scale is applied after the cast back, as transformers does);
- a pass writes its K/V into the cache's slots; attention reads slots 0 .. length - 1;
- with `--quantization int8` (`quantize_int8`), the products and the output layer read int8
  weights with per-row scales (`Int8Weight`, torch's `_weight_int8pack_mm`): half the bytes.

Covered: text stacks of full-attention layers with default RoPE, SiLU MLP and plain float
Linear weights: Qwen2-VL / Qwen2.5-VL (text tokens move all three M-RoPE rows together, which
is 1-D RoPE), Idefics3 / SmolVLM's Llama, and text-only Llama / Qwen2 drafters. Anything else
(Qwen3-VL's q/k norms, sliding windows, quantized weights, ...) keeps transformers' forward;
`unsupported` says why. Prefill always runs transformers' forward (images, prompt hidden
states); its cache is then copied into the static one.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.static_cache import StaticKVCache

TEXT_TYPES = ("qwen2_vl_text", "qwen2_5_vl_text", "qwen2_vl", "qwen2_5_vl", "llama", "qwen2")


def text_stack(model):
    """The decoder stack (the module with `layers`, `norm`, `rotary_emb`) under a VLM or a causal LM."""
    inner = model.model
    return getattr(inner, "language_model", None) or getattr(inner, "text_model", None) or inner


def unsupported(model) -> str | None:
    """Why the fast forward does not cover this model (None when it does)."""
    config = model.config.get_text_config()
    stack = text_stack(model)
    if config.model_type not in TEXT_TYPES:
        return f"text model type {config.model_type!r} (covered: {', '.join(TEXT_TYPES)})"
    if any(kind != "full_attention" for kind in getattr(config, "layer_types", None) or ()):
        return "sliding-window layers"
    rope = getattr(config, "rope_parameters", None) or {}
    if rope.get("rope_type", "default") != "default" or stack.rotary_emb.attention_scaling != 1.0:
        return f"rope type {rope.get('rope_type')!r}"
    if getattr(config, "hidden_act", None) != "silu" or getattr(config, "mlp_bias", False):
        return f"MLP activation {getattr(config, 'hidden_act', None)!r}"
    if getattr(config, "_attn_implementation", "sdpa") not in ("sdpa", "eager"):
        return f"attention implementation {config._attn_implementation!r}"
    for name, module in stack.layers.named_modules():
        if "proj" in name.rsplit(".", 1)[-1] and type(module) is not torch.nn.Linear:
            return f"{name} is a {type(module).__name__} (quantized?), not a plain Linear"
    if not stack.layers[0].self_attn.q_proj.weight.dtype.is_floating_point:
        return "integer weights"
    if any(hasattr(layer.self_attn, "q_norm") for layer in stack.layers):
        return "q/k norms"
    return None


@dataclass
class Layer:
    """One decoder layer's weights: the fused products' weights are (out, in)."""

    input_norm: torch.Tensor  # (H,)
    qkv_weight: torch.Tensor  # ((heads + 2 kv_heads) * D, H)
    qkv_bias: torch.Tensor | None
    o_weight: torch.Tensor  # (H, heads * D)
    o_bias: torch.Tensor | None
    post_norm: torch.Tensor  # (H,)
    gate_up_weight: torch.Tensor  # (2 I, H)
    down_weight: torch.Tensor  # (H, I)


@dataclass
class Int8Weight:
    """A weight (out, in) as int8 values with one scale per output row (symmetric: the row's
    largest |w| becomes 127), in the layout torch's CPU kernel `_weight_int8pack_mm` reads.
    Half the bytes of bfloat16, so a bandwidth-bound product can run up to twice as fast."""

    values: torch.Tensor  # (out, in) int8
    scales: torch.Tensor  # (out,) in the activations' dtype

    @classmethod
    def quantize(cls, weight: torch.Tensor) -> Int8Weight:
        """weight (out, in), any float dtype; the scales keep its dtype."""
        if weight.dtype == torch.bfloat16 and weight.shape[1] % 16:
            # torch 2.13's bfloat16 kernel reads past the row (wrong values, or a crash) otherwise
            raise ValueError(f"int8 weights in bfloat16 need an input width that is a multiple of 16, not "
                             f"{weight.shape[1]}")
        scales = (weight.float().abs().amax(dim=1) / 127).clamp(min=1e-12).to(weight.dtype)
        values = (weight.float() / scales.float()[:, None]).round().clamp(-127, 127).to(torch.int8)
        return cls(values.contiguous(), scales)


def linear(x: torch.Tensor, weight: torch.Tensor | Int8Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear for x (n, in) and a weight (out, in), stored as a float tensor or an Int8Weight."""
    if isinstance(weight, Int8Weight):
        y = torch._weight_int8pack_mm(x, weight.values, weight.scales)
        return y if bias is None else y + bias
    return F.linear(x, weight, bias)


def _cat(*tensors):
    return None if tensors[0] is None else torch.cat(tensors)


def share(modules: list[torch.nn.Module], input_major: bool) -> torch.Tensor:
    """The modules' weights side by side in one buffer, (sum out, in), which each module's weight
    becomes a view of (same values; the old storage is freed). input_major: the buffer is stored
    (in, sum out) contiguous and the (sum out, in) tensor returned is its transpose."""
    fused = torch.cat([module.weight for module in modules])
    fused = fused.t().contiguous().t() if input_major else fused
    start = 0
    for module in modules:
        rows = module.weight.shape[0]
        module.weight.data = fused[start:start + rows]
        start += rows
    return fused


class FastDecoder:
    """The decode / verify forward of one model (check `unsupported(model)` first)."""

    @torch.no_grad()
    def __init__(self, model, input_major: bool | None = None):
        """input_major: store weights (in, out) (default: for 16-bit weights on a CPU, where it pays)."""
        config = model.config.get_text_config()
        stack = text_stack(model)
        self.embed = model.get_input_embeddings()
        self.lm_head = model.get_output_embeddings()
        self.final_norm = stack.norm.weight
        self.eps = config.rms_norm_eps
        attn = stack.layers[0].self_attn
        self.heads, self.kv_heads, self.head_dim = config.num_attention_heads, config.num_key_value_heads, attn.head_dim
        self.scaling = attn.scaling
        self.inv_freq = stack.rotary_emb.inv_freq.float()
        self.dtype = self.final_norm.dtype
        if input_major is None:
            input_major = self.dtype != torch.float32 and self.final_norm.device.type == "cpu"
        self.input_major = input_major
        self.layers = [self._layer(layer, self.input_major) for layer in stack.layers]
        self.head_weight = share([self.lm_head], self.input_major)  # (V, H), or an Int8Weight
        self.cos = self.signed_sin = torch.empty(0, self.head_dim, dtype=self.dtype, device=self.final_norm.device)

    @torch.no_grad()
    def quantize_int8(self) -> None:
        """Decode and verify passes read int8 copies of the layers' and the output layer's weights
        (`--quantization int8`); the model's own weights stay for prefill (transformers' forward)."""
        self.layers = [Layer(layer.input_norm, Int8Weight.quantize(layer.qkv_weight), layer.qkv_bias,
                             Int8Weight.quantize(layer.o_weight), layer.o_bias, layer.post_norm,
                             Int8Weight.quantize(layer.gate_up_weight), Int8Weight.quantize(layer.down_weight))
                       for layer in self.layers]
        self.head_weight = Int8Weight.quantize(self.head_weight)

    @staticmethod
    def _layer(layer, input_major: bool) -> Layer:
        attn, mlp = layer.self_attn, layer.mlp
        return Layer(layer.input_layernorm.weight,
                     share([attn.q_proj, attn.k_proj, attn.v_proj], input_major),
                     _cat(attn.q_proj.bias, attn.k_proj.bias, attn.v_proj.bias),
                     share([attn.o_proj], input_major), attn.o_proj.bias, layer.post_attention_layernorm.weight,
                     share([mlp.gate_proj, mlp.up_proj], input_major), share([mlp.down_proj], input_major))

    def _rotary(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, signed sin (n, 1, D) at `positions` (n,), as transformers computes them: in float32,
        then cast. signed_sin = sin with its first half negated: with x's halves swapped,
        swapped(x) * signed_sin == rotate_half(x) * sin."""
        end = int(positions.max()) + 1
        if end > len(self.cos):  # extend the table (doubling) to cover `end`
            table_len = max(end, 2 * len(self.cos), 1024)
            freqs = torch.arange(table_len, device=self.inv_freq.device)[:, None].float() * self.inv_freq
            emb = torch.cat((freqs, freqs), dim=-1)
            sin = emb.sin()
            half = self.head_dim // 2
            self.cos = emb.cos().to(self.dtype)
            self.signed_sin = torch.cat((-sin[:, :half], sin[:, half:]), dim=-1).to(self.dtype)
        return self.cos[positions][:, None], self.signed_sin[positions][:, None]

    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """transformers' RMSNorm: in float32, cast back, then scaled."""
        if x.dtype == torch.float32:
            return F.rms_norm(x, weight.shape, weight, self.eps)
        return weight * F.rms_norm(x.float(), weight.shape, None, self.eps).to(x.dtype)

    def forward(self, cache: StaticKVCache, input_ids: torch.Tensor, positions: torch.Tensor,
                attention_mask: torch.Tensor | None, num_logits: int,
                hidden_layers: tuple[int, ...] = ()) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """Run input_ids (n,) at rotary `positions` (n,), appended after the cache's entries.

        attention_mask: None (causal over the new tokens, all cached entries visible) or an
        additive (n, length + n) one (a draft tree's). Returns the logits of the last
        `num_logits` tokens, (num_logits, V), and {layer: (n, H)} for `hidden_layers` (indexed as
        output_hidden_states: 0 embeddings, i the output of layer i, -1 / L the final norm's).
        """
        n = len(input_ids)
        start = cache.length
        cache.reserve(n)
        end = start + n
        cos, signed_sin = self._rotary(positions)
        if attention_mask is None and n > 1:  # causal: row i sees slots 0 .. start + i
            attention_mask = torch.ones(n, end, dtype=torch.bool, device=input_ids.device).tril(start)
        mask = None if attention_mask is None else attention_mask[None, None]
        q_width, kv_width = self.heads * self.head_dim, self.kv_heads * self.head_dim
        num_layers = len(self.layers)
        keep = {num_layers if i == -1 else i for i in hidden_layers}
        hidden = {}
        x = self.embed(input_ids)  # (n, H)
        if 0 in keep:
            hidden[0] = x
        for index, layer in enumerate(self.layers):
            qkv = linear(self._norm(x, layer.input_norm), layer.qkv_weight, layer.qkv_bias)  # (n, q + 2 kv)
            qk = qkv[:, :q_width + kv_width].view(n, self.heads + self.kv_heads, self.head_dim)
            swapped = qk.view(n, -1, 2, self.head_dim // 2).flip(-2).view(qk.shape)  # halves swapped
            qk = qk * cos + swapped * signed_sin
            queries = qk[:, :self.heads].transpose(0, 1)[None]  # (1, heads, n, D)
            keys, values = cache.keys[index], cache.values[index]
            keys[0, :, start:end] = qk[:, self.heads:].transpose(0, 1)
            values[0, :, start:end] = qkv[:, q_width + kv_width:].view(n, self.kv_heads, self.head_dim).transpose(0, 1)
            attended = F.scaled_dot_product_attention(queries, keys[:, :, :end], values[:, :, :end], attn_mask=mask,
                                                      scale=self.scaling, enable_gqa=True)
            x = x + linear(attended[0].transpose(0, 1).reshape(n, q_width), layer.o_weight, layer.o_bias)
            gate, up = linear(self._norm(x, layer.post_norm), layer.gate_up_weight).chunk(2, dim=-1)
            x = x + linear(F.silu(gate) * up, layer.down_weight)
            if index + 1 in keep and index + 1 < num_layers:
                hidden[index + 1] = x
        cache.length = end
        x = self._norm(x[-num_logits:] if not keep else x, self.final_norm)
        if num_layers in keep:
            hidden[num_layers] = x
        hidden = {i: hidden[num_layers if i == -1 else i] for i in hidden_layers}
        return linear(x[-num_logits:], self.head_weight, self.lm_head.bias), hidden
