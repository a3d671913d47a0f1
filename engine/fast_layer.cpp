// engine/fast_decode.py's decoder_layer in C++ (engine/fast_native.py builds it): its ATen calls
// made from C++, and rotary with the cache writes as one loop that rounds as those calls do, so a
// layer costs no Python per operation and its results are bitwise those of the Python function
// (tests/test_fast_native.py). Keep the two in step.
#include <torch/extension.h>

using at::Tensor;

// transformers' RMSNorm: in float32, cast back, then scaled (fast_decode.rms_norm).
static Tensor normed(const Tensor& x, const Tensor& weight, double eps) {
  if (x.scalar_type() == at::kFloat) return at::rms_norm(x, {weight.size(0)}, weight, eps);
  return weight * at::rms_norm(x.to(at::kFloat), {weight.size(0)}, c10::nullopt, eps).to(x.scalar_type());
}

// Rotary on q and k and the cache writes in one loop: for each token t, head h (q heads, then kv
// heads) and dimension d, the value ATen computes for qk * cos + roll(qk, D / 2) * signed_sin,
// each product and the sum rounded to T as ATen's elementwise kernels round them (T float: plain
// float arithmetic, built without FMA contraction). q goes to `queries` (heads, n, D), k and v to
// the cache's slots start .. start + n - 1 (kv_heads, capacity, D), all in the cache's type C.
template <typename T, typename C>
static void rotate_and_write(const Tensor& qkv, const Tensor& cos, const Tensor& signed_sin, Tensor& queries,
                             Tensor& keys, Tensor& values, int64_t start, int64_t heads, int64_t kv_heads,
                             int64_t head_dim) {
  const int64_t n = qkv.size(0), row = qkv.stride(0), capacity = keys.size(2), half = head_dim / 2;
  const T* in = qkv.data_ptr<T>();
  const T* cos_p = cos.data_ptr<T>();
  const T* sin_p = signed_sin.data_ptr<T>();
  C* q_out = queries.data_ptr<C>();
  C* k_out = keys.data_ptr<C>();
  C* v_out = values.data_ptr<C>();
  for (int64_t t = 0; t < n; ++t) {
    const T* token = in + t * row;
    const T* c = cos_p + t * head_dim;
    const T* s = sin_p + t * head_dim;
    for (int64_t h = 0; h < heads + kv_heads; ++h) {
      const T* x = token + h * head_dim;
      C* out = h < heads ? q_out + (h * n + t) * head_dim
                         : k_out + ((h - heads) * capacity + start + t) * head_dim;
      for (int64_t d = 0; d < head_dim; ++d) {
        const T a = static_cast<T>(static_cast<float>(x[d]) * static_cast<float>(c[d]));
        const T b = static_cast<T>(static_cast<float>(x[(d + half) % head_dim]) * static_cast<float>(s[d]));
        out[d] = static_cast<C>(static_cast<T>(static_cast<float>(a) + static_cast<float>(b)));
      }
    }
    const T* v = token + (heads + kv_heads) * head_dim;
    for (int64_t h = 0; h < kv_heads; ++h)
      for (int64_t d = 0; d < head_dim; ++d)
        v_out[(h * capacity + start + t) * head_dim + d] = static_cast<C>(v[h * head_dim + d]);
  }
}

// x (n, in) times weight (in, out), plus bias (fast_decode.linear, float weights).
static Tensor product(const Tensor& x, const Tensor& weight, const c10::optional<Tensor>& bias) {
  return bias.has_value() ? at::addmm(*bias, x, weight) : at::mm(x, weight);
}

Tensor decoder_layer(Tensor x, const Tensor& input_norm, const Tensor& qkv_weight, const c10::optional<Tensor>& qkv_bias,
                     const Tensor& o_weight, const c10::optional<Tensor>& o_bias, const Tensor& post_norm,
                     const Tensor& gate_up_weight, const Tensor& down_weight, const Tensor& cos,
                     const Tensor& signed_sin, Tensor keys, Tensor values, int64_t start,
                     const c10::optional<Tensor>& mask, int64_t heads, int64_t kv_heads, int64_t head_dim,
                     double scaling, double eps) {
  const int64_t n = x.size(0), end = start + n;
  const int64_t q_width = heads * head_dim, kv_width = kv_heads * head_dim;
  Tensor qkv = product(normed(x, input_norm, eps), qkv_weight, qkv_bias);  // (n, q + 2 kv)
  Tensor queries = at::empty({1, heads, n, head_dim}, keys.options());
  const auto type = x.scalar_type(), cache_type = keys.scalar_type();
  const bool plain_layouts = keys.is_contiguous() && values.is_contiguous() && cos.is_contiguous() &&
                             signed_sin.is_contiguous() && qkv.stride(1) == 1;
  if (plain_layouts && type == at::kFloat && cache_type == at::kFloat) {
    rotate_and_write<float, float>(qkv, cos, signed_sin, queries, keys, values, start, heads, kv_heads, head_dim);
  } else if (plain_layouts && type == at::kBFloat16 && cache_type == at::kFloat) {
    rotate_and_write<at::BFloat16, float>(qkv, cos, signed_sin, queries, keys, values, start, heads, kv_heads,
                                          head_dim);
  } else if (plain_layouts && type == at::kHalf && cache_type == at::kFloat) {
    rotate_and_write<at::Half, float>(qkv, cos, signed_sin, queries, keys, values, start, heads, kv_heads, head_dim);
  } else {  // any other pair of types: ATen's calls, as fast_decode.decoder_layer makes them
    Tensor qk = qkv.slice(1, 0, q_width + kv_width).view({n, heads + kv_heads, head_dim});
    qk = qk * cos + qk.roll({head_dim / 2}, {-1}) * signed_sin;
    keys.select(0, 0).slice(1, start, end).copy_(qk.slice(1, heads).transpose(0, 1));
    values.select(0, 0).slice(1, start, end).copy_(
        qkv.slice(1, q_width + kv_width).view({n, kv_heads, head_dim}).transpose(0, 1));
    queries.copy_(qk.slice(1, 0, heads).transpose(0, 1).unsqueeze(0));
  }
  Tensor attended = at::scaled_dot_product_attention(queries, keys.slice(2, 0, end), values.slice(2, 0, end), mask,
                                                     /*dropout_p=*/0.0, /*is_causal=*/false, scaling,
                                                     /*enable_gqa=*/true);
  attended = n == 1 ? attended.view({n, q_width}) : attended.select(0, 0).transpose(0, 1).reshape({n, q_width});
  x = x + product(attended.to(x.scalar_type()), o_weight, o_bias);
  std::vector<Tensor> gate_up = product(normed(x, post_norm, eps), gate_up_weight, c10::nullopt).chunk(2, -1);
  return x + product(at::silu(gate_up[0]) * gate_up[1], down_weight, c10::nullopt);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("decoder_layer", &decoder_layer); }
