// engine/fast_decode.py's decoder_layer, the same ATen calls made from C++ (engine/fast_native.py
// builds it): a layer then costs no Python per operation, and its results are bitwise those of
// the Python function (tests/test_fast_native.py). Keep the two in step.
#include <torch/extension.h>

using at::Tensor;

// transformers' RMSNorm: in float32, cast back, then scaled (fast_decode.rms_norm).
static Tensor normed(const Tensor& x, const Tensor& weight, double eps) {
  if (x.scalar_type() == at::kFloat) return at::rms_norm(x, {weight.size(0)}, weight, eps);
  return weight * at::rms_norm(x.to(at::kFloat), {weight.size(0)}, c10::nullopt, eps).to(x.scalar_type());
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
  Tensor qk = qkv.slice(1, 0, q_width + kv_width).view({n, heads + kv_heads, head_dim});
  qk = qk * cos + qk.roll({head_dim / 2}, {-1}) * signed_sin;  // roll by half: the halves swapped
  keys.select(0, 0).slice(1, start, end).copy_(qk.slice(1, heads).transpose(0, 1));
  values.select(0, 0).slice(1, start, end).copy_(
      qkv.slice(1, q_width + kv_width).view({n, kv_heads, head_dim}).transpose(0, 1));
  Tensor queries = qk.slice(1, 0, heads).transpose(0, 1).unsqueeze(0);  // (1, heads, n, D)
  if (queries.scalar_type() != keys.scalar_type()) queries = queries.to(keys.scalar_type());
  Tensor attended = at::scaled_dot_product_attention(queries, keys.slice(2, 0, end), values.slice(2, 0, end), mask,
                                                     /*dropout_p=*/0.0, /*is_causal=*/false, scaling,
                                                     /*enable_gqa=*/true);
  attended = n == 1 ? attended.view({n, q_width}) : attended.select(0, 0).transpose(0, 1).reshape({n, q_width});
  x = x + product(attended.to(x.scalar_type()), o_weight, o_bias);
  std::vector<Tensor> gate_up = product(normed(x, post_norm, eps), gate_up_weight, c10::nullopt).chunk(2, -1);
  return x + product(at::silu(gate_up[0]) * gate_up[1], down_weight, c10::nullopt);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("decoder_layer", &decoder_layer); }
