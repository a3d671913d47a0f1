// Integer rows on the weights' own GGUF blocks for engine/fast_layer.cpp (`--weight-arithmetic
// integer`; engine/packed.py's `integer_product` is the readable reference, bitwise): y (n, out)
// float32 = x (n, in) float32 times a weight (out, in) kept in ggml's blocks of 32 inputs,
//
//     Q4_0: w = float(d) * (q - 8)    Q4_1: w = float(d) * q + float(m)    Q8_0: w = float(d) * q
//
// (d, m float16; q in 0 .. 15, or -128 .. 127 for Q8_0), with x made int8 per block of 32 as
// llama.cpp's Q8_0 / Q8_1 make it:
//
// 1. Each block of 32 values of a row of x on its own: top = its largest |x|, d_x = top / 127 and
//    inverse = 127 / top (0 for a block of zeros), both float32 divisions; q_x = x * inverse
//    rounded to the nearest integer, halves to even (std::nearbyint in the default rounding mode,
//    torch.round), clamped to -127 .. 127; and the block's sum of q_x (int32), s_x = d_x * float(sum).
//    d_x stays float32 (llama.cpp's Q8_1 stores d and s as float16: one more rounding each, for a
//    smaller activation row that costs nothing here, where x is made once a pass and stays in L1).
// 2. For each output and each block: the exact int32 sum of the block's 32 products, q_w * q_x
//    (Q4_0: (q_w - 8) * q_x, as sum q_w q_x - 8 sum q_x; |sum| <= 32 * 128 * 127 < 2^24, so
//    float(sum) is exact too). Integer sums do not depend on their order, so the kernels, the
//    threads and the rows beside a row change nothing.
// 3. For each output, blocks in input order, one fixed float epilogue (no fused multiply-add: the
//    build has -ffp-contract=off):  term = float(sum) * (d_w * d_x);  Q4_1: term = term + m_w * s_x;
//    total = total + term, from total = 0; then y = total (+ bias). The vector kernels run it with
//    lanes = outputs, each lane sequential over the blocks: lane j's operations are the scalar
//    ones for output j, so every kernel gives the scalar bits, and a pass over n rows is bitwise
//    n one-row passes.
//
// Kernels: "portable" (plain loops, everywhere), "avx2" (`vpmaddubsw`, then Q4 codes' 16-bit pairs
// summed across outputs by `vphaddw`, Q8_0's (|w| times x with w's sign) widened by `vpmaddwd`
// first) and "avx512-vnni" (`vpdpbusd` on 256-bit registers, the same lanes; built where
// -march=native has AVX512-VNNI and AVX512-VL; compiled, never run, in this workplace: no such
// CPU). `product` takes the kernel by name; docs/performance.md has the measured figures.
#pragma once

#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <vector>
#if defined(__AVX2__)
#include <immintrin.h>
#endif

// ggml's blocks (ggml-common.h): 32 inputs each, codes of input i in byte i % 16 (the low 4 bits for
// i < 16, the high 4 bits for i >= 16) or byte i (Q8_0).
struct BlockQ4_0 {  // block_q4_0: value i = float(d) * (q_i - 8), q_i in 0 .. 15
  at::Half d;
  uint8_t qs[16];
};
struct BlockQ4_1 {  // block_q4_1: value i = float(d) * q_i + float(m) (two roundings), q_i in 0 .. 15
  at::Half d, m;
  uint8_t qs[16];
};
struct BlockQ8_0 {  // block_q8_0: value i = float(d) * q_i, q_i in -128 .. 127
  at::Half d;
  int8_t qs[32];
};
static_assert(sizeof(BlockQ4_0) == 18 && sizeof(BlockQ4_1) == 20 && sizeof(BlockQ8_0) == 34, "ggml's block sizes");

namespace block_rows {

using at::Tensor;

constexpr int64_t BLOCK = 32;
constexpr int GROUP = 8;  // outputs a vector kernel takes at once (its epilogue's lanes)
// Rows of x a kernel takes at once, each group's weights read and unpacked once for them: with 4, the
// SmolLM2 demo's 5-row passes read the weights twice and cost more than float rows' (which take 8).
constexpr int ROWS = 8;

// The kernels this build has, the widest first (the one `product` runs for an empty name).
#if defined(__AVX512VNNI__) && defined(__AVX512VL__) && defined(__AVX2__)
#define HAVE_BLOCKS_VNNI
#endif
inline const std::vector<std::string> built = {
#ifdef HAVE_BLOCKS_VNNI
    "avx512-vnni",
#endif
#ifdef __AVX2__
    "avx2",
#endif
    "portable"};

enum class Kernel { vnni, avx2, portable };  // `built`'s names: "avx512-vnni", "avx2", "portable"

// Rows of x made int8 block by block (step 1), (n, in) and (n, in / 32).
struct Rows {
  std::vector<int8_t> values;
  std::vector<float> scales;  // d_x
  std::vector<int32_t> sums;  // the block's sum of q_x
  std::vector<float> scaled_sums;  // s_x = d_x * float(sum)
  int64_t in, blocks;
};

inline Rows quantize(const float* x, int64_t n, int64_t in) {
  const int64_t blocks = in / BLOCK;
  Rows rows{std::vector<int8_t>(n * in), std::vector<float>(n * blocks), std::vector<int32_t>(n * blocks),
            std::vector<float>(n * blocks), in, blocks};
  for (int64_t b = 0; b < n * blocks; ++b) {
    const float* values = x + b * BLOCK;
    float top = 0.f;
    for (int64_t i = 0; i < BLOCK; ++i) top = std::max(top, std::fabs(values[i]));
    const float inverse = top > 0.f ? 127.f / top : 0.f;
    int32_t sum = 0;
    for (int64_t i = 0; i < BLOCK; ++i) {
      const float q = std::min(127.f, std::max(-127.f, std::nearbyint(values[i] * inverse)));
      rows.values[b * BLOCK + i] = static_cast<int8_t>(q);
      sum += static_cast<int32_t>(q);
    }
    rows.scales[b] = top / 127.f;
    rows.sums[b] = sum;
    rows.scaled_sums[b] = rows.scales[b] * static_cast<float>(sum);
  }
  return rows;
}

// Step 2 for one block of each format, in plain loops (the portable kernel).
inline int32_t block_sum(const BlockQ4_0& w, const int8_t* x) {
  int32_t sum = 0;
  for (int i = 0; i < 16; ++i) sum += ((w.qs[i] & 15) - 8) * x[i] + ((w.qs[i] >> 4) - 8) * x[16 + i];
  return sum;
}
inline int32_t block_sum(const BlockQ4_1& w, const int8_t* x) {
  int32_t sum = 0;
  for (int i = 0; i < 16; ++i) sum += (w.qs[i] & 15) * x[i] + (w.qs[i] >> 4) * x[16 + i];
  return sum;
}
inline int32_t block_sum(const BlockQ8_0& w, const int8_t* x) {
  int32_t sum = 0;
  for (int i = 0; i < 32; ++i) sum += w.qs[i] * x[i];
  return sum;
}
inline float offset(const BlockQ4_1& w) { return static_cast<float>(w.m); }
template <typename W>
inline float offset(const W&) { return 0.f; }

// Step 3's term for one block: the one definition of the epilogue's scalar arithmetic.
template <typename W>
inline float term(int32_t sum, float d_w, float m_w, float d_x, float s_x) {
  float value = static_cast<float>(sum) * (d_w * d_x);
  if constexpr (std::is_same_v<W, BlockQ4_1>) value = value + m_w * s_x;
  return value;
}

// totals[r][c] for rows first .. first + R - 1 and weight rows 0 .. C - 1 of `weight` (each `blocks` W).
template <typename W, int R>
void portable_block(const Rows& x, int64_t first, const W* weight, int C, float totals[R][GROUP]) {
  for (int c = 0; c < C; ++c)
    for (int r = 0; r < R; ++r) {
      const int64_t row = first + r;
      float total = 0.f;
      for (int64_t b = 0; b < x.blocks; ++b) {
        const W& w = weight[c * x.blocks + b];
        const int64_t at = row * x.blocks + b;
        const int32_t sum = block_sum(w, x.values.data() + at * BLOCK);
        total = total + term<W>(sum, static_cast<float>(w.d), offset(w), x.scales[at], x.scaled_sums[at]);
      }
      totals[r][c] = total;
    }
}

#ifdef __AVX2__
// A block's 32 codes as bytes in input order: Q4 unsigned 0 .. 15, Q8_0 signed.
inline __m256i codes(const BlockQ4_0& w) {
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w.qs)), low4 = _mm_set1_epi8(15);
  return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(bytes, 4), low4), _mm_and_si128(bytes, low4));
}
inline __m256i codes(const BlockQ4_1& w) {
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w.qs)), low4 = _mm_set1_epi8(15);
  return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(bytes, 4), low4), _mm_and_si128(bytes, low4));
}
inline __m256i codes(const BlockQ8_0& w) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w.qs)); }

// 8 int32 lanes whose sum is the 32 products of unsigned bytes u and signed bytes s.
struct Avx2Dot {
  static __m256i dot(__m256i u, __m256i s) { return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)); }
};
#ifdef HAVE_BLOCKS_VNNI
struct VnniDot {
  static __m256i dot(__m256i u, __m256i s) { return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s); }
};
#endif

// Step 2's int32 lanes of one block of codes against 32 values of x. Q4: codes unsigned (the -8 of
// Q4_0 comes after the sum); Q8_0: |w| (128 for -128, as an unsigned byte) times x with w's sign.
// vpmaddubsw's 16-bit pairs do not saturate: at most 2 * 15 * 127 (Q4) or 2 * 128 * 127 (Q8_0).
template <typename D, typename W>
inline __m256i block_lanes(__m256i w, __m256i x) {
  if constexpr (std::is_same_v<W, BlockQ8_0>) return D::dot(_mm256_abs_epi8(w), _mm256_sign_epi8(x, w));
  else return D::dot(w, x);
}

// Lane j: the sum of p[j]'s 8 lanes (integer adds: exact in any order).
inline __m256i sum_each(const __m256i p[GROUP]) {
  const __m256i a = _mm256_hadd_epi32(_mm256_hadd_epi32(p[0], p[1]), _mm256_hadd_epi32(p[2], p[3]));
  const __m256i b = _mm256_hadd_epi32(_mm256_hadd_epi32(p[4], p[5]), _mm256_hadd_epi32(p[6], p[7]));
  return _mm256_add_epi32(_mm256_permute2x128_si256(a, b, 0x20), _mm256_permute2x128_si256(a, b, 0x31));
}

// sum_each for Q4 codes' vpmaddubsw pairs (16-bit, each at most 2 * 15 * 127): three rounds of
// vphaddw keep every partial sum of up to 16 products under 2^15 (at most 30,480), leaving each
// output's sums over inputs 0 .. 15 (low 128 bits) and 16 .. 31 (high), widened and added: the
// same integers as sum_each of the vpmaddwd lanes, with 8 vpmaddwd fewer.
inline __m256i sum_each_pairs(const __m256i p[GROUP]) {
  const __m256i a = _mm256_hadd_epi16(_mm256_hadd_epi16(p[0], p[1]), _mm256_hadd_epi16(p[2], p[3]));
  const __m256i b = _mm256_hadd_epi16(_mm256_hadd_epi16(p[4], p[5]), _mm256_hadd_epi16(p[6], p[7]));
  const __m256i c = _mm256_hadd_epi16(a, b);
  return _mm256_add_epi32(_mm256_cvtepi16_epi32(_mm256_castsi256_si128(c)),
                          _mm256_cvtepi16_epi32(_mm256_extracti128_si256(c, 1)));
}

// portable_block for GROUP weight rows with lanes = outputs: each block's codes and scales unpacked
// once for the R rows, the sums made by D, step 3 in 8 float lanes (the scalar `term`, lane by lane).
template <typename D, typename W, int R>
void vector_block(const Rows& x, int64_t first, const W* weight, float totals[R][GROUP]) {
  __m256 total[R];
  for (int r = 0; r < R; ++r) total[r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < x.blocks; ++b) {
    __m256i w[GROUP];
    alignas(16) uint16_t d_bits[GROUP], m_bits[GROUP] = {};
    for (int c = 0; c < GROUP; ++c) {
      const W& block = weight[c * x.blocks + b];
      w[c] = codes(block);
      d_bits[c] = block.d.x;
      if constexpr (std::is_same_v<W, BlockQ4_1>) m_bits[c] = block.m.x;
    }
    const __m256 d_w = _mm256_cvtph_ps(_mm_load_si128(reinterpret_cast<const __m128i*>(d_bits)));
    const __m256 m_w = std::is_same_v<W, BlockQ4_1> ? _mm256_cvtph_ps(_mm_load_si128(reinterpret_cast<const __m128i*>(m_bits)))
                                                    : _mm256_setzero_ps();
    for (int r = 0; r < R; ++r) {
      const int64_t at = (first + r) * x.blocks + b;
      const __m256i xs = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.values.data() + at * BLOCK));
      __m256i p[GROUP], sums;
      if constexpr (std::is_same_v<D, Avx2Dot> && !std::is_same_v<W, BlockQ8_0>) {
        for (int c = 0; c < GROUP; ++c) p[c] = _mm256_maddubs_epi16(w[c], xs);
        sums = sum_each_pairs(p);
      } else {
        for (int c = 0; c < GROUP; ++c) p[c] = block_lanes<D, W>(w[c], xs);
        sums = sum_each(p);
      }
      if constexpr (std::is_same_v<W, BlockQ4_0>) sums = _mm256_sub_epi32(sums, _mm256_set1_epi32(8 * x.sums[at]));
      __m256 value = _mm256_mul_ps(_mm256_cvtepi32_ps(sums), _mm256_mul_ps(d_w, _mm256_set1_ps(x.scales[at])));
      if constexpr (std::is_same_v<W, BlockQ4_1>)
        value = _mm256_add_ps(value, _mm256_mul_ps(m_w, _mm256_set1_ps(x.scaled_sums[at])));
      total[r] = _mm256_add_ps(total[r], value);
    }
  }
  for (int r = 0; r < R; ++r) _mm256_storeu_ps(totals[r], total[r]);
}
#endif

// y rows first .. first + R - 1, outputs column .. column + C - 1 (C <= GROUP) by `kernel`.
template <typename W, int R>
void rows_block(Kernel kernel, const Rows& x, int64_t first, const W* weight, int64_t column, int C,
                const float* bias, float* y, int64_t out) {
  float totals[R][GROUP];
  const W* rows = weight + column * x.blocks;
#ifdef HAVE_BLOCKS_VNNI
  if (kernel == Kernel::vnni && C == GROUP) vector_block<VnniDot, W, R>(x, first, rows, totals);
  else
#endif
#ifdef __AVX2__
  if (kernel == Kernel::avx2 && C == GROUP) vector_block<Avx2Dot, W, R>(x, first, rows, totals);
  else
#endif
    portable_block<W, R>(x, first, rows, C, totals);
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) y[(first + r) * out + column + c] = bias ? totals[r][c] + bias[column + c] : totals[r][c];
}

// Every row of x (ROWS at a time) for outputs column .. column + C - 1.
template <typename W>
void all_rows(Kernel kernel, const Rows& x, int64_t n, const W* weight, int64_t column, int C,
              const float* bias, float* y, int64_t out) {
  int64_t r = 0;
  for (; r + ROWS <= n; r += ROWS) rows_block<W, ROWS>(kernel, x, r, weight, column, C, bias, y, out);
  switch (n - r) {
    case 7: rows_block<W, 7>(kernel, x, r, weight, column, C, bias, y, out); break;
    case 6: rows_block<W, 6>(kernel, x, r, weight, column, C, bias, y, out); break;
    case 5: rows_block<W, 5>(kernel, x, r, weight, column, C, bias, y, out); break;
    case 4: rows_block<W, 4>(kernel, x, r, weight, column, C, bias, y, out); break;
    case 3: rows_block<W, 3>(kernel, x, r, weight, column, C, bias, y, out); break;
    case 2: rows_block<W, 2>(kernel, x, r, weight, column, C, bias, y, out); break;
    case 1: rows_block<W, 1>(kernel, x, r, weight, column, C, bias, y, out); break;
  }
}

// y (n, out) float32 = x (n, in) float32 times the blocks (out, in / 32) of W, plus bias (out,)
// float32 or none: groups of GROUP outputs in parallel, the outputs past the last whole group by
// the portable loops (the same bits).
template <typename W>
Tensor product_with(Kernel kernel, const Tensor& x, const Tensor& blocks, const c10::optional<Tensor>& bias) {
  const int64_t n = x.size(0), in = x.size(1), out = blocks.size(0);
  const Tensor rows_x = x.contiguous();
  const Rows rows = quantize(rows_x.data_ptr<float>(), n, in);
  Tensor y = at::empty({n, out}, x.options());
  const W* weight = reinterpret_cast<const W*>(blocks.data_ptr());
  const float* bias_values = bias ? bias->data_ptr<float>() : nullptr;
  float* y_values = y.data_ptr<float>();
  const int64_t groups = out / GROUP, grain = std::max<int64_t>(1, 2048 / in);
  at::parallel_for(0, groups, grain, [&](int64_t start, int64_t end) {
    for (int64_t group = start; group < end; ++group)
      all_rows<W>(kernel, rows, n, weight, group * GROUP, GROUP, bias_values, y_values, out);
  });
  if (out % GROUP) all_rows<W>(Kernel::portable, rows, n, weight, groups * GROUP, out % GROUP, bias_values, y_values, out);
  return y;
}

// The kernel `product` runs for `name` ("" the widest built): a name this build lacks is refused.
inline Kernel kernel_named(const std::string& name) {
  const std::string chosen = name.empty() ? built.front() : name;
  TORCH_CHECK(std::find(built.begin(), built.end(), chosen) != built.end(), "no integer blocks kernel ", chosen,
              " in this build (it has ", c10::Join(", ", built), ")");
  return chosen == "avx512-vnni" ? Kernel::vnni : chosen == "avx2" ? Kernel::avx2 : Kernel::portable;
}

// x (n, in) float32 times ggml blocks (out, in / 32, bytes) uint8: 18 bytes Q4_0, 20 Q4_1, 34 Q8_0.
inline Tensor product(const Tensor& x, const Tensor& blocks, const c10::optional<Tensor>& bias,
                      const std::string& kernel_name) {
  const int64_t bytes = blocks.dim() == 3 ? blocks.size(2) : 0;
  TORCH_CHECK(blocks.scalar_type() == at::kByte && blocks.is_contiguous() && (bytes == 18 || bytes == 20 || bytes == 34) &&
                  x.scalar_type() == at::kFloat && x.dim() == 2 && x.size(1) == BLOCK * blocks.size(1) &&
                  (!bias || (bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == blocks.size(0))),
              "integer rows take float32 x (n, in) and (out, in / 32, 18) Q4_0, 20 Q4_1 or 34 Q8_0 uint8 blocks, "
              "and a float32 bias (out,) or none");
  const Kernel kernel = kernel_named(kernel_name);
  if (bytes == 18) return product_with<BlockQ4_0>(kernel, x, blocks, bias);
  if (bytes == 20) return product_with<BlockQ4_1>(kernel, x, blocks, bias);
  return product_with<BlockQ8_0>(kernel, x, blocks, bias);
}

}  // namespace block_rows
