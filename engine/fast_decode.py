"""A hand-written forward of a llama-style text stack for decode and verify passes.

At one token per pass a small model's time goes to per-operation cost (dispatch, Python, the
wrapper's mask and cache bookkeeping), not to arithmetic: docs/performance.md. This forward does
the same arithmetic as transformers' (RMSNorm in float32, rotary embedding, SDPA, SiLU MLP) in
fewer operations, over a StaticKVCache (engine/static_cache.py):
- q, k, v are one matrix product (and gate, up another) on weights concatenated at load;
- on a CPU with the compiled stack (engine/fast_native.py) the weights stay (out, in), which its
  rows kernel reads; without it, on a CPU they are stored input-major, (in, out) contiguous:
  torch's bfloat16 / float16 one-row product then streams them about 1.4-2.9x faster than the
  (out, in) layout, and its float32 verify passes cost up to 1.8x less (docs/performance.md). The model's own Linear
  weights become views of these buffers (same values, no second copy), so transformers' forward
  (prefill) reads the same memory;
- every product is one `torch.mm` / `addmm` on an (in, out) weight: the kernel F.linear calls,
  without its wrappers (four fewer dispatches a product);
- rotary cos / sin come from a table indexed by position, applied to q and k in one go, with
  rotate_half(x) * sin written as x rolled by half its width times signed_sin (the same
  products, exactly);
- RMSNorm is torch's fused `rms_norm` (bitwise equal to transformers' float32 arithmetic; for
  16-bit weights the scale is applied after the cast back, as transformers does);
- a pass writes its K/V into the cache's slots; attention reads slots 0 .. length - 1; for 16-bit
  weights on a CPU the cache and attention are float32 (`attention_dtype`);
- with `--quantization int8` (`quantize`), the products and the output layer read int8 weights
  with per-row scales (engine/quantized.py `Int8Weight`): half the bytes; `w8a8` makes the
  activations int8 too (`W8A8Weight`: VNNI), `q4_0` reads llama.cpp's Q4_0 (`Q4Weight`);
- float32 weights that a GGUF file's Q4_1 / Q8_0 blocks gave are read from those blocks (engine/packed.py
  `PackedWeight`: a fifth of the bytes; float32 rows, the same bits, or int8 rows: --weight-arithmetic).

On a CPU the whole stack runs compiled where the machine can build it (engine/fast_native.py,
engine/fast_layer.cpp: one call a pass; ATen's matrix products with the rest as loops, the same
arithmetic as `decoder_layer` up to float rounding, no Python per operation); `decoder_layer`
below is its reference and the fallback.

One decoder-layer function (`decoder_layer`) and one stack of them (`FastStack`) serve every
user: the target's and model drafters' forward (`FastDecoder`, through engine/runner.py) and
the drafter heads' (engine/fast_heads.py: the MTP head and the block drafter, whose entries
sit at the target's M-RoPE positions, three rows that differ after an image: engine/rotary.py's
`RotaryTable` takes (3, n) positions and recomposes the rows by `mrope_section` as transformers does).

Covered: text stacks of full-attention layers with default RoPE, SiLU MLP and plain float
Linear weights: Qwen2-VL / Qwen2.5-VL (text tokens move all three M-RoPE rows together, which
is 1-D RoPE), Idefics3 / SmolVLM's Llama, text-only Llama / Qwen2 drafters, and the project's
drafter heads built from Qwen2-VL layers (models/drafter_heads.py). Anything else
(Qwen3-VL's q/k norms, sliding windows, quantized weights, ...) keeps transformers' forward;
`unsupported` says why. Prefill always runs transformers' forward (images, prompt hidden
states); its cache is then copied into the static one.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from engine import fast_native, huge_pages, packed
from engine.quantized import QUANTIZED, Int8Weight, Q4Weight, log_slow_path, native_layer, native_weight, quantized_linear
from engine.rotary import RotaryTable
from engine.static_cache import StaticKVCache, attention_dtype
from models.families import fast_text_types

TEXT_TYPES = fast_text_types()  # as each family declares (models/families/)


def text_stack(model):
    """The decoder stack (the module with `layers`, `norm`, `rotary_emb`) under a VLM or a causal LM."""
    inner = model.model
    return getattr(inner, "language_model", None) or getattr(inner, "text_model", None) or inner


def unsupported(model) -> str | None:
    """Why the fast forward does not cover this model (None when it does)."""
    stack = text_stack(model)
    return stack_unsupported(model.config.get_text_config(), stack.layers, stack.rotary_emb)


def stack_unsupported(config, layers: torch.nn.ModuleList, rotary: torch.nn.Module) -> str | None:
    """Why `FastStack` does not cover these decoder layers (built from `config`, with this rotary
    embedding); None when it does."""
    if config.model_type not in TEXT_TYPES:
        return f"text model type {config.model_type!r} (covered: {', '.join(TEXT_TYPES)})"
    if any(kind != "full_attention" for kind in getattr(config, "layer_types", None) or ()):
        return "sliding-window layers"
    rope = getattr(config, "rope_parameters", None) or {}
    if rope.get("rope_type", "default") != "default" or rotary.attention_scaling != 1.0:
        return f"rope type {rope.get('rope_type')!r}"
    if getattr(config, "hidden_act", None) != "silu" or getattr(config, "mlp_bias", False):
        return f"MLP activation {getattr(config, 'hidden_act', None)!r}"
    if getattr(config, "_attn_implementation", "sdpa") not in ("sdpa", "eager"):
        return f"attention implementation {config._attn_implementation!r}"
    for name, module in layers.named_modules():
        if "proj" in name.rsplit(".", 1)[-1] and type(module) is not torch.nn.Linear:
            return f"{name} is a {type(module).__name__} (quantized?), not a plain Linear"
    if not layers[0].self_attn.q_proj.weight.dtype.is_floating_point:
        return "integer weights"
    if any(hasattr(layer.self_attn, "q_norm") for layer in layers):
        return "q/k norms"
    return None


@dataclass
class Layer:
    """One decoder layer's weights: the fused products' weights are (in, out), what `linear`
    multiplies x (n, in) by (a transposed view where the buffer is nn.Linear's (out, in)), or
    engine/quantized.py's and engine/packed.py's kinds."""

    input_norm: torch.Tensor  # (H,)
    qkv_weight: torch.Tensor  # (H, (heads + 2 kv_heads) * D)
    qkv_bias: torch.Tensor | None
    o_weight: torch.Tensor  # (heads * D, H)
    o_bias: torch.Tensor | None
    post_norm: torch.Tensor  # (H,)
    gate_up_weight: torch.Tensor  # (H, 2 I)
    down_weight: torch.Tensor  # (I, H)


@dataclass(frozen=True)
class Attention:
    """The attention sizes every layer of a stack shares."""

    heads: int
    kv_heads: int
    head_dim: int
    scaling: float
    eps: float  # the RMSNorms'


FUSED = {"qkv_weight": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), "o_weight": ("self_attn.o_proj",),
         "gate_up_weight": ("mlp.gate_proj", "mlp.up_proj"), "down_weight": ("mlp.down_proj",)}  # a Layer's product
PRODUCTS = tuple(FUSED)  # weights, and the decoder layer's Linear modules each fuses (FastStack.layer_weights)


def linear(x: torch.Tensor, weight: torch.Tensor | Int8Weight | Q4Weight | packed.PackedWeight,
           bias: torch.Tensor | None = None) -> torch.Tensor:
    """x (n, in) times a weight (in, out) (plus bias): F.linear(x, weight.t(), bias) in the one
    matrix-product call F.linear would make (same kernel, same result), without its wrappers."""
    if isinstance(weight, (packed.PackedWeight, packed.Adapted)):  # float32 or int8 rows on GGUF blocks
        return packed.linear(x, weight, bias, linear)
    if isinstance(weight, (Int8Weight, Q4Weight)):
        return quantized_linear(x, weight, bias)
    return torch.mm(x, weight) if bias is None else torch.addmm(bias, x, weight)


def share(modules: list[torch.nn.Module], input_major: bool, arena: huge_pages.HugePageArena | None = None):
    """The modules' weights side by side in one buffer (in `arena` if any), which each module's weight
    becomes a view of (same values; the old storage is freed). Returns it (in, sum out), as `linear`
    takes it: contiguous where input_major, else the transposed view of a (sum out, in) buffer."""
    fused = torch.cat([module.weight for module in modules])  # (sum out, in)
    fused = fused.t().contiguous().t() if input_major else fused
    fused = arena.place(fused) if arena is not None and not input_major else fused
    start = 0
    for module in modules:
        rows = module.weight.shape[0]
        module.weight.data = fused[start:start + rows]
        start += rows
    return fused.t()


def default_input_major(weight: torch.Tensor) -> bool:
    """Whether products read (in, out) weights: on a CPU, yes for torch's kernels (16-bit one-row
    products, float32 verify passes: docs/performance.md); no where the compiled stack runs, whose
    rows kernel reads (out, in) (engine/fast_layer.cpp)."""
    return weight.device.type == "cpu" and fast_native.layer() is None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' RMSNorm: in float32, cast back, then scaled."""
    if x.dtype == torch.float32:
        return F.rms_norm(x, weight.shape, weight, eps)
    return weight * F.rms_norm(x.float(), weight.shape, None, eps).to(x.dtype)


def decoder_layer(layer: Layer, sizes: Attention, x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor,
                  keys: torch.Tensor, values: torch.Tensor, start: int, mask: torch.Tensor | None,
                  left_out=frozenset()) -> torch.Tensor:
    """One llama-style decoder layer over x (n, H) at slots start .. start + n - 1 of a cache layer's keys / values
    (1, kv_heads, capacity, D), which it writes; attends to slots 0 .. start + n - 1 under mask (None, or
    (1, 1, n, start + n): bool, True = attend, or additive in the cache's dtype). cos, signed_sin (n, 1, D) from
    RotaryTable. Attention runs in the cache's dtype (float32 for 16-bit weights on a CPU: `attention_dtype`).
    Returns the layer's output (n, H). left_out: measure/layer_costs.py's PARTS to skip (the engine skips none)."""
    n, end = len(x), start + len(x)
    q_width, kv_width = sizes.heads * sizes.head_dim, sizes.kv_heads * sizes.head_dim
    norm = (lambda x, weight, eps: x) if "norm" in left_out else rms_norm
    qkv = linear(norm(x, layer.input_norm, sizes.eps), layer.qkv_weight, layer.qkv_bias)  # (n, q + 2 kv)
    qk = qkv[:, :q_width + kv_width].view(n, sizes.heads + sizes.kv_heads, sizes.head_dim)
    qk = qk if "rotary" in left_out else qk * cos + qk.roll(sizes.head_dim // 2, -1) * signed_sin  # roll: halves swap
    if "write" not in left_out:
        keys[0, :, start:end] = qk[:, sizes.heads:].transpose(0, 1)
        values[0, :, start:end] = qkv[:, q_width + kv_width:].view(n, sizes.kv_heads, sizes.head_dim).transpose(0, 1)
    queries = qk[:, :sizes.heads].transpose(0, 1)[None].to(keys.dtype)  # (1, heads, n, D), a copy only when it differs
    attended = queries if "attention" in left_out else F.scaled_dot_product_attention(  # (1, heads, n, D)
        queries, keys[:, :, :end], values[:, :, :end], attn_mask=mask, scale=sizes.scaling, enable_gqa=True)
    attended = attended.reshape(n, q_width) if n == 1 else attended[0].transpose(0, 1).reshape(n, q_width)
    x = x + linear(attended.to(x.dtype), layer.o_weight, layer.o_bias)
    gate, up = linear(norm(x, layer.post_norm, sizes.eps), layer.gate_up_weight).chunk(2, dim=-1)
    return x + linear(gate if "silu" in left_out else F.silu(gate) * up, layer.down_weight)


class FastStack:
    """A model's decoder layers (check `stack_unsupported` first) over a StaticKVCache, without
    the final norm: what the target's forward and the drafter heads share."""

    @torch.no_grad()
    def __init__(self, layers: torch.nn.ModuleList, config, rotary: torch.nn.Module, input_major: bool, arena=None):
        """layers: the model's decoder layers (their Linear weights become views of fused buffers, in `arena`)."""
        attn = layers[0].self_attn
        self.sizes = Attention(config.num_attention_heads, config.num_key_value_heads, attn.head_dim, attn.scaling,
                               config.rms_norm_eps)
        self.layers = [self.layer_weights(layer, input_major, arena) for layer in layers]
        self.sizes_args = (self.sizes.heads, self.sizes.kv_heads, self.sizes.head_dim, self.sizes.scaling,
                           self.sizes.eps)  # the compiled stack's last arguments
        norm = layers[0].input_layernorm.weight
        self.rotary = RotaryTable(rotary, attn.head_dim, norm.dtype)
        self.dtype, self.device = norm.dtype, norm.device
        self.cache_dtype = attention_dtype(norm.dtype, norm.device)
        # engine/fast_layer.cpp, on a CPU over a float32 cache (what it takes); else the Python layer
        compiled = norm.device.type == "cpu" and self.cache_dtype == torch.float32
        self.native = fast_native.layer() if compiled else None
        self.layer_fn = decoder_layer  # the Python layer (measure/layer_costs.py times variants of it)

    @staticmethod
    def layer_weights(layer, input_major: bool, arena: huge_pages.HugePageArena | None = None) -> Layer:
        attn = layer.self_attn
        products = {name: share([layer.get_submodule(module) for module in modules], input_major, arena)
                    for name, modules in FUSED.items()}
        qkv_bias = None if attn.q_proj.bias is None else torch.cat([attn.q_proj.bias, attn.k_proj.bias, attn.v_proj.bias])
        return Layer(input_norm=layer.input_layernorm.weight, qkv_bias=qkv_bias, o_bias=attn.o_proj.bias,
                     post_norm=layer.post_attention_layernorm.weight, **products)

    def norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """rms_norm of x (n, H) with this stack's eps: compiled where the stack is (one call,
        not five operators)."""
        return rms_norm(x, weight, self.sizes.eps) if self.native is None else self.native.rms_norm(x, weight,
                                                                                                  self.sizes.eps)

    def _native_layers(self) -> list:
        """The layers' weights as the compiled stack takes them (quantized.py `native_layer`), once a `layers`."""
        if getattr(self, "_packed_for", None) is not self.layers:
            self._packed = [native_layer(self.native, layer) for layer in self.layers]
            self._packed_for = self.layers
            log_slow_path([getattr(layer, name) for layer in self._packed for name in PRODUCTS])
        return self._packed

    def new_cache(self, capacity: int) -> StaticKVCache:
        return StaticKVCache(len(self.layers), self.sizes.kv_heads, self.sizes.head_dim, capacity, self.cache_dtype,
                             self.device)

    def forward(self, caches: list[StaticKVCache], x: torch.Tensor, positions: list[torch.Tensor | range],
                attention_masks: list[torch.Tensor | None], keep: set[int] = frozenset()) -> tuple[torch.Tensor, dict]:
        """Run x (N, H), appended after each cache's entries: request p's rows (after those of the requests
        before it) at its rotary positions[p], (n,) or a range of them, or M-RoPE (3, n), over its own
        caches[p] under attention_masks[p]: None (causal over the new rows, every cached entry visible) or
        (n, length + n), bool (True = attend) or additive. Several requests only on the compiled stack
        (engine/fast_layer.cpp `stack_parts`: the products over all N rows, the attention per request),
        where every product sums each row alone (`FastDecoder.shares_passes`). Returns the last layer's
        output (N, H), not normed, and {i: (N, H)} for i in `keep` (0 = x, i = the output of layer i)."""
        if len(caches) > 1 and self.native is None:
            raise ValueError("the Python layer's products are not summed row by row: pass each request alone")
        rows = [len(p) if isinstance(p, range) else p.shape[-1] for p in positions]
        starts = [cache.length for cache in caches]
        for cache, n in zip(caches, rows):
            cache.reserve(n)
        tables = [self.rotary(p) for p in positions]
        cos, signed_sin = tables[0] if len(tables) == 1 else (torch.cat(table) for table in zip(*tables))
        masks = [self._mask(mask, start, n, x.device) for mask, start, n in zip(attention_masks, starts, rows)]
        hidden = {0: x} if 0 in keep else {}
        if self.native is not None:  # every layer in one call (engine/fast_layer.cpp)
            later = sorted(keep - {0})
            x, *kept = self.native.stack_parts(x, self._native_layers(), cos, signed_sin,
                                               [cache.keys for cache in caches], [cache.values for cache in caches],
                                               starts, rows, masks, *self.sizes_args, later)
            hidden.update(zip(later, kept))
        else:
            cache, start, mask = caches[0], starts[0], masks[0]
            for index, layer in enumerate(self.layers):
                x = self.layer_fn(layer, self.sizes, x, cos, signed_sin, cache.keys[index], cache.values[index],
                                  start, mask)
                if index + 1 in keep:
                    hidden[index + 1] = x
        for cache, start, n in zip(caches, starts, rows):
            cache.length = start + n
        return x, hidden

    def _mask(self, attention_mask: torch.Tensor | None, start: int, n: int, device) -> torch.Tensor | None:
        """A request's mask as the layers take it, (1, 1, n, start + n), or None (one row, all visible)."""
        if attention_mask is None and n > 1:  # causal: row i sees slots 0 .. start + i
            attention_mask = torch.ones(n, start + n, dtype=torch.bool, device=device).tril(start)
        if attention_mask is not None and attention_mask.is_floating_point():
            attention_mask = attention_mask.to(self.cache_dtype)  # additive: in the attention's dtype
        return None if attention_mask is None else attention_mask[None, None]


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
        self.input_major = default_input_major(self.final_norm) if input_major is None else input_major
        streamed = not self.input_major and fast_native.layer() is not None  # the rows kernel's (out, in) rows
        weights = [layer.get_submodule(name).weight for layer in stack.layers for names in FUSED.values()
                   for name in names] + [self.lm_head.weight]
        arena = huge_pages.arena_for(weights) if streamed and all(w.is_floating_point() for w in weights) else None
        self.stack = FastStack(stack.layers, config, stack.rotary_emb, self.input_major, arena)
        self.head_weight = share([self.lm_head], self.input_major, arena)  # (H, V), or an Int8Weight
        if streamed and self.stack.native is not None and packed.enabled():
            self.pack()

    @torch.no_grad()
    def pack(self) -> None:
        """Passes read float32 weights from the GGUF blocks they came from (engine/packed.py)."""
        self._convert(lambda weight: packed.pack(weight) or weight)
        packed.place([w for w in self.weights() if isinstance(w, packed.PackedWeight)])
        self._build_native()

    def use_weight_arithmetic(self, arithmetic: str, kernel: str = "") -> None:  # over GGUF blocks: packed.py
        self._convert(lambda weight: packed.with_arithmetic(weight, arithmetic, kernel))
        self._build_native()

    @property
    def packed_bytes(self) -> int:  # the bytes of the weights read from blocks (0: none)
        return sum(w.nbytes for w in self.weights() if isinstance(w, packed.PackedWeight))

    @torch.no_grad()
    def quantize(self, quantization: str = "int8") -> None:
        """Decode and verify passes read quantized copies of the layers' and the output layer's weights
        (engine/quantized.py: `int8`; with int8 activations too, `w8a8`; llama.cpp's Q4_0 weights times int8
        activations, `q4_0`); the model's own weights stay for prefill (transformers' forward)."""
        self._convert(lambda weight: QUANTIZED[quantization].quantize(packed.values(weight)))
        self._build_native()

    def weights(self) -> list:  # every product's weight: the layers' (PRODUCTS each), then the output layer's
        return [getattr(layer, name) for layer in self.stack.layers for name in PRODUCTS] + [self.head_weight]

    def _convert(self, convert) -> None:  # under no_grad: from __init__, pack or quantize
        self.stack.layers = [replace(layer, **{name: convert(getattr(layer, name)) for name in PRODUCTS})
                             for layer in self.stack.layers]
        self.head_weight = convert(self.head_weight)

    def _build_native(self) -> None:
        """The compiled path's weights made now, at load, not in the first pass (integer rows
        interleave their blocks: engine/fast_blocks.h `prepare`)."""
        if self.stack.native is not None:
            self.stack._native_layers()
            self._native_head()

    def _native_head(self):
        """The output layer's weight as the compiled path takes it (quantized.py `native_weight`), once a head_weight."""
        if getattr(self, "_native_head_for", None) is not self.head_weight:
            self._native_head_weight = native_weight(self.stack.native, self.head_weight)
            self._native_head_for = self.head_weight
            log_slow_path([self._native_head_weight])
        return self._native_head_weight

    def shares_passes(self, num_rows: int, dtype: torch.dtype) -> bool:
        """Whether a pass of `num_rows` rows can hold several requests' (`forward` with several parts): the
        compiled stack, each product summing each row alone (engine/fast_layer.cpp `rows_alone`)."""
        native = self.stack.native
        return native is not None and native.rows_alone(self.stack._native_layers(), self._native_head(),
                                                        self.lm_head.bias, num_rows, torch.empty(0, dtype=dtype))

    def forward(self, parts: list) -> list[tuple[torch.Tensor, dict[int, torch.Tensor]]]:
        """Run each part's tokens (engine/runner.py PassPart) over its cache in one pass (several only where
        `shares_passes`). Returns for each the logits of all its tokens, (n, V), and {layer: (n, H)} for
        its hidden_layers (indexed as output_hidden_states: 0 embeddings, i layer i's output, -1 / L the
        final norm's)."""
        num_layers = len(self.stack.layers)
        keep = {num_layers if i == -1 else i for part in parts for i in part.hidden_layers}
        native = self.stack.native
        token_ids = [token for part in parts for token in part.token_ids]
        weight = self.embed.weight  # the covered families' embedding: a lookup
        if native is not None and weight.is_contiguous():
            x = native.embed(weight, token_ids)
        else:  # a GPU, or a tied embedding stored (in, out)
            x = F.embedding(torch.tensor(token_ids, device=weight.device), weight)
        x, hidden = self.stack.forward([part.cache for part in parts], x, [part.positions for part in parts],
                                       [part.attention_mask for part in parts], keep - {num_layers})
        if num_layers in keep:
            hidden[num_layers] = self.stack.norm(x, self.final_norm)
        if native is not None:  # final norm and output layer in one call, whatever a drafter reads: the
            # same kernel as plain decoding's passes (torch.mm here read the head at half the speed)
            logits = native.logits(x, self.final_norm, self._native_head(), self.lm_head.bias, self.eps, len(x))
        else:
            normed = hidden[num_layers] if num_layers in keep else self.stack.norm(x, self.final_norm)
            logits = linear(normed, self.head_weight, self.lm_head.bias)
        sizes = [len(part.token_ids) for part in parts]
        rows = {layer: kept.split(sizes) for layer, kept in hidden.items()}
        return [(part_logits, {i: rows[num_layers if i == -1 else i][p] for i in part.hidden_layers})
                for p, (part, part_logits) in enumerate(zip(parts, logits.split(sizes)))]

