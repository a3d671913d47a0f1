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
// Kernels: "portable" (plain loops over the ggml blocks, everywhere), "avx2" (`vpmaddubsw` on the
// blocks interleaved by 8 outputs at load, `Interleaved`; Q8_0 as |w| times x with w's sign) and
// "avx512-vnni" (`vpdpbusd` on 256-bit registers, the same lanes; built where -march=native has
// AVX512-VNNI and AVX512-VL; compiled, never run, in this workplace: no such CPU). `prepare` makes a
// weight ready for a kernel once, when it is loaded; docs/performance.md has the measured figures.
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

// Step 1 for one block of 32 values: its int8 values, d_x, the sum of its q_x and s_x. The AVX2 body
// is the same operations on 8 lanes (max, one float32 multiply, round to nearest even, clamp), so the
// same bits.
inline void quantize_block(const float* values, int8_t* q_out, float& scale, int32_t& sum_out, float& scaled_sum) {
  float top = 0.f;
#ifdef __AVX2__
  const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  __m256 tops = _mm256_setzero_ps();
  for (int i = 0; i < BLOCK; i += 8) tops = _mm256_max_ps(tops, _mm256_and_ps(_mm256_loadu_ps(values + i), magnitude));
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, tops);
  for (float lane : lanes) top = std::max(top, lane);
#else
  for (int64_t i = 0; i < BLOCK; ++i) top = std::max(top, std::fabs(values[i]));
#endif
  const float inverse = top > 0.f ? 127.f / top : 0.f;
  int32_t sum = 0;
#ifdef __AVX2__
  const __m256 scale_by = _mm256_set1_ps(inverse), high = _mm256_set1_ps(127.f), low = _mm256_set1_ps(-127.f);
  __m256i ints[4];
  for (int i = 0; i < 4; ++i) {
    const __m256 q = _mm256_round_ps(_mm256_mul_ps(_mm256_loadu_ps(values + 8 * i), scale_by),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    ints[i] = _mm256_cvtps_epi32(_mm256_min_ps(high, _mm256_max_ps(low, q)));
  }
  const __m256i all = _mm256_add_epi32(_mm256_add_epi32(ints[0], ints[1]), _mm256_add_epi32(ints[2], ints[3]));
  alignas(32) int32_t partial[8];
  _mm256_store_si256(reinterpret_cast<__m256i*>(partial), all);
  for (int32_t value : partial) sum += value;
  // int32 -> int16 -> int8 (packs work within 128-bit halves: put the values back in order after)
  const __m256i words = _mm256_permute4x64_epi64(_mm256_packs_epi32(ints[0], ints[1]), 0xd8);
  const __m256i words2 = _mm256_permute4x64_epi64(_mm256_packs_epi32(ints[2], ints[3]), 0xd8);
  const __m256i bytes = _mm256_permute4x64_epi64(_mm256_packs_epi16(words, words2), 0xd8);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q_out), bytes);
#else
  for (int64_t i = 0; i < BLOCK; ++i) {
    const float q = std::min(127.f, std::max(-127.f, std::nearbyint(values[i] * inverse)));
    q_out[i] = static_cast<int8_t>(q);
    sum += static_cast<int32_t>(q);
  }
#endif
  scale = top / 127.f;
  sum_out = sum;
  scaled_sum = scale * static_cast<float>(sum);
}

inline Rows quantize(const float* x, int64_t n, int64_t in) {
  const int64_t blocks = in / BLOCK;
  Rows rows{std::vector<int8_t>(n * in), std::vector<float>(n * blocks), std::vector<int32_t>(n * blocks),
            std::vector<float>(n * blocks), in, blocks};
  for (int64_t b = 0; b < n * blocks; ++b)
    quantize_block(x + b * BLOCK, rows.values.data() + b * BLOCK, rows.scales[b], rows.sums[b], rows.scaled_sums[b]);
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

// The vector kernels read a weight's blocks interleaved at load (`interleave`, as llama.cpp repacks
// Q4_0 into block_q4_0x8): for each group of GROUP outputs and each block of 32 inputs, one record of
// the group's scales (and Q4_1's offsets) as GROUP float16 each, then its codes so that each 32-byte
// vector holds 4 consecutive inputs of each of the 8 outputs (byte 4c + i: output c, input 4j + i).
// One `vpmaddubsw` (or `vpdpbusd`) of such a vector against 4 bytes of x broadcast to every lane then
// adds products of 8 outputs at once, each output in its own 32-bit lane, and no sum across outputs
// is left to do. Q4 codes: vector j's bytes hold inputs 4j .. 4j + 3 in the low nibble and 16 + 4j ..
// 16 + 4j + 3 in the high one (j = 0 .. 3). Q8_0: 8 vectors of signed codes.
template <typename W>
struct Interleaved;
template <>
struct Interleaved<BlockQ4_0> {
  uint16_t d[GROUP];
  uint8_t qs[4][32];
};
template <>
struct Interleaved<BlockQ4_1> {
  uint16_t d[GROUP], m[GROUP];
  uint8_t qs[4][32];
};
template <>
struct Interleaved<BlockQ8_0> {
  uint16_t d[GROUP];
  int8_t qs[8][32];
};

// Input k's code (0 .. 15 for Q4, signed for Q8_0) of one ggml block.
inline int code(const BlockQ4_0& w, int k) { return k < 16 ? w.qs[k] & 15 : w.qs[k - 16] >> 4; }
inline int code(const BlockQ4_1& w, int k) { return k < 16 ? w.qs[k] & 15 : w.qs[k - 16] >> 4; }
inline int code(const BlockQ8_0& w, int k) { return w.qs[k]; }

// The records of outputs 0 .. out - out % GROUP (groups, blocks): group g, block b at g * blocks + b.
template <typename W>
Tensor interleave_with(const Tensor& blocks) {
  const int64_t groups = blocks.size(0) / GROUP, count = blocks.size(1);
  Tensor records = at::empty({groups * count, int64_t(sizeof(Interleaved<W>))}, blocks.options());
  const W* weight = reinterpret_cast<const W*>(blocks.data_ptr());
  auto* out = reinterpret_cast<Interleaved<W>*>(records.data_ptr());
  at::parallel_for(0, groups, 1, [&](int64_t start, int64_t end) {
    for (int64_t g = start; g < end; ++g)
      for (int64_t b = 0; b < count; ++b) {
        Interleaved<W>& record = out[g * count + b];
        for (int c = 0; c < GROUP; ++c) {
          const W& w = weight[(g * GROUP + c) * count + b];
          record.d[c] = w.d.x;
          if constexpr (std::is_same_v<W, BlockQ4_1>) record.m[c] = w.m.x;
          for (int i = 0; i < 4; ++i)
            if constexpr (std::is_same_v<W, BlockQ8_0>) {
              for (int j = 0; j < 8; ++j) record.qs[j][4 * c + i] = static_cast<int8_t>(code(w, 4 * j + i));
            } else {
              for (int j = 0; j < 4; ++j)
                record.qs[j][4 * c + i] = static_cast<uint8_t>(code(w, 4 * j + i) | code(w, 16 + 4 * j + i) << 4);
            }
        }
      }
  });
  return records;
}

#ifdef __AVX2__
// The int32 sums of one record's 8 outputs against one block of a row of x (32 int8 at xs): lane c is
// output c's exact sum of q_w x q_x (Q4 codes unsigned, Q4_0's -8 applied after). Q4 (vpmaddubsw):
// each 16-bit lane adds 2 products a vector, 16 over the block, at most 16 * 15 * 127 = 30,480, so
// the 16-bit adds cannot overflow; then one vpmaddwd pairs them into 32 bits. Q8_0: |w| times x with
// w's sign (abs(-128) read as the unsigned byte 128), each vector's pairs (at most 2 * 128 * 127)
// widened by vpmaddwd before the adds. VNNI: vpdpbusd does both steps.
struct Avx2Dot {};
#ifdef HAVE_BLOCKS_VNNI
struct VnniDot {};
#endif

inline __m256i broadcast4(const int8_t* x, int k) {  // x[k .. k + 3] in every 32-bit lane
  int32_t four;
  std::memcpy(&four, x + k, 4);
  return _mm256_set1_epi32(four);
}

template <typename D>
inline __m256i q4_sums(const __m256i codes[8], const int8_t* xs) {  // codes[j]: inputs 4j .. (j < 4) or 16 + 4(j - 4) ..
#ifdef HAVE_BLOCKS_VNNI
  if constexpr (std::is_same_v<D, VnniDot>) {
    __m256i sums = _mm256_setzero_si256();
    for (int j = 0; j < 8; ++j) sums = _mm256_dpbusd_epi32(sums, codes[j], broadcast4(xs, j < 4 ? 4 * j : 16 + 4 * (j - 4)));
    return sums;
  }
#endif
  __m256i pairs = _mm256_maddubs_epi16(codes[0], broadcast4(xs, 0));
  for (int j = 1; j < 8; ++j)
    pairs = _mm256_add_epi16(pairs, _mm256_maddubs_epi16(codes[j], broadcast4(xs, j < 4 ? 4 * j : 16 + 4 * (j - 4))));
  return _mm256_madd_epi16(pairs, _mm256_set1_epi16(1));
}

template <typename D>
inline __m256i q8_sums(const __m256i magnitudes[8], const __m256i codes[8], const int8_t* xs) {
  __m256i sums = _mm256_setzero_si256();
  for (int j = 0; j < 8; ++j) {
    const __m256i signed_x = _mm256_sign_epi8(broadcast4(xs, 4 * j), codes[j]);
#ifdef HAVE_BLOCKS_VNNI
    if constexpr (std::is_same_v<D, VnniDot>) {
      sums = _mm256_dpbusd_epi32(sums, magnitudes[j], signed_x);
      continue;
    }
#endif
    sums = _mm256_add_epi32(sums, _mm256_madd_epi16(_mm256_maddubs_epi16(magnitudes[j], signed_x), _mm256_set1_epi16(1)));
  }
  return sums;
}

// portable_block for one group's records with lanes = outputs: each record's codes unpacked once for
// the R rows, the sums made by D, step 3 in 8 float lanes (the scalar `term`, lane by lane).
template <typename D, typename W, int R>
void vector_block(const Rows& x, int64_t first, const Interleaved<W>* records, float totals[R][GROUP]) {
  __m256 total[R];
  for (int r = 0; r < R; ++r) total[r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < x.blocks; ++b) {
    const Interleaved<W>& record = records[b];
    __m256i codes[8], magnitudes[8];
    if constexpr (std::is_same_v<W, BlockQ8_0>) {
      for (int j = 0; j < 8; ++j) {
        codes[j] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(record.qs[j]));
        magnitudes[j] = _mm256_abs_epi8(codes[j]);
      }
    } else {
      const __m256i low4 = _mm256_set1_epi8(15);
      for (int j = 0; j < 4; ++j) {
        const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(record.qs[j]));
        codes[j] = _mm256_and_si256(bytes, low4);
        codes[4 + j] = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), low4);
      }
    }
    const __m256 d_w = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(record.d)));
    __m256 m_w = _mm256_setzero_ps();
    if constexpr (std::is_same_v<W, BlockQ4_1>) m_w = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(record.m)));
    for (int r = 0; r < R; ++r) {
      const int64_t at = (first + r) * x.blocks + b;
      const int8_t* xs = x.values.data() + at * BLOCK;
      __m256i sums;
      if constexpr (std::is_same_v<W, BlockQ8_0>) sums = q8_sums<D>(magnitudes, codes, xs);
      else sums = q4_sums<D>(codes, xs);
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

// A weight's blocks as the kernels read them, made once when the weight is loaded (`prepare`): the
// ggml blocks (the portable kernel, and the outputs past the last whole group) and, for a vector
// kernel, their records interleaved by groups of GROUP outputs.
struct Prepared {
  Tensor blocks;  // (out, in / 32, bytes) uint8
  Tensor records;  // (out / GROUP * in / 32, record bytes) uint8, or undefined for the portable kernel
  Kernel kernel;
  std::string name;  // the kernel's, as `built` spells it
};

// y rows first .. first + R - 1, outputs column .. column + C - 1 (C <= GROUP; a vector kernel takes
// whole groups only, from the records).
template <typename W, int R>
void rows_block(const Prepared& weight, const Rows& x, int64_t first, int64_t column, int C, const float* bias,
                float* y, int64_t out) {
  float totals[R][GROUP];
  [[maybe_unused]] const auto* records = weight.records.defined()
      ? reinterpret_cast<const Interleaved<W>*>(weight.records.data_ptr()) + column / GROUP * x.blocks : nullptr;
#ifdef HAVE_BLOCKS_VNNI
  if (weight.kernel == Kernel::vnni && C == GROUP) vector_block<VnniDot, W, R>(x, first, records, totals);
  else
#endif
#ifdef __AVX2__
  if (weight.kernel == Kernel::avx2 && C == GROUP) vector_block<Avx2Dot, W, R>(x, first, records, totals);
  else
#endif
    portable_block<W, R>(x, first, reinterpret_cast<const W*>(weight.blocks.data_ptr()) + column * x.blocks, C, totals);
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) y[(first + r) * out + column + c] = bias ? totals[r][c] + bias[column + c] : totals[r][c];
}

// Every row of x (ROWS at a time) for outputs column .. column + C - 1.
template <typename W>
void all_rows(const Prepared& weight, const Rows& x, int64_t n, int64_t column, int C, const float* bias, float* y,
              int64_t out) {
  int64_t r = 0;
  for (; r + ROWS <= n; r += ROWS) rows_block<W, ROWS>(weight, x, r, column, C, bias, y, out);
  switch (n - r) {
    case 7: rows_block<W, 7>(weight, x, r, column, C, bias, y, out); break;
    case 6: rows_block<W, 6>(weight, x, r, column, C, bias, y, out); break;
    case 5: rows_block<W, 5>(weight, x, r, column, C, bias, y, out); break;
    case 4: rows_block<W, 4>(weight, x, r, column, C, bias, y, out); break;
    case 3: rows_block<W, 3>(weight, x, r, column, C, bias, y, out); break;
    case 2: rows_block<W, 2>(weight, x, r, column, C, bias, y, out); break;
    case 1: rows_block<W, 1>(weight, x, r, column, C, bias, y, out); break;
  }
}

// y (n, out) float32 = x (n, in) float32 times the blocks (out, in / 32) of W, plus bias (out,)
// float32 or none: groups of GROUP outputs in parallel, the outputs past the last whole group by
// the portable loops (the same bits).
template <typename W>
Tensor product_with(const Prepared& weight, const Tensor& x, const c10::optional<Tensor>& bias) {
  const int64_t n = x.size(0), in = x.size(1), out = weight.blocks.size(0);
  const Tensor rows_x = x.contiguous();
  const Rows rows = quantize(rows_x.data_ptr<float>(), n, in);
  Tensor y = at::empty({n, out}, x.options());
  const float* bias_values = bias ? bias->data_ptr<float>() : nullptr;
  float* y_values = y.data_ptr<float>();
  const int64_t groups = out / GROUP, grain = std::max<int64_t>(1, 2048 / in);
  at::parallel_for(0, groups, grain, [&](int64_t start, int64_t end) {
    for (int64_t group = start; group < end; ++group)
      all_rows<W>(weight, rows, n, group * GROUP, GROUP, bias_values, y_values, out);
  });
  if (out % GROUP) all_rows<W>(weight, rows, n, groups * GROUP, out % GROUP, bias_values, y_values, out);
  return y;
}

// The kernel `product` runs for `name` ("" the widest built): a name this build lacks is refused.
inline Kernel kernel_named(const std::string& name) {
  const std::string chosen = name.empty() ? built.front() : name;
  TORCH_CHECK(std::find(built.begin(), built.end(), chosen) != built.end(), "no integer blocks kernel ", chosen,
              " in this build (it has ", c10::Join(", ", built), ")");
  return chosen == "avx512-vnni" ? Kernel::vnni : chosen == "avx2" ? Kernel::avx2 : Kernel::portable;
}

// ggml blocks (out, in / 32, bytes) uint8, 18 bytes Q4_0, 20 Q4_1, 34 Q8_0, made ready for the kernel
// named (refused: other shapes or types, a kernel this build lacks).
inline Prepared prepare(const Tensor& blocks, const std::string& kernel_name) {
  const int64_t bytes = blocks.dim() == 3 ? blocks.size(2) : 0;
  TORCH_CHECK(blocks.scalar_type() == at::kByte && blocks.is_contiguous() && (bytes == 18 || bytes == 20 || bytes == 34),
              "integer rows take a weight in ggml's blocks (out, in / 32, 18) Q4_0, 20 Q4_1 or 34 Q8_0 uint8 (engine/packed.py), not a ", blocks.scalar_type(),
              " tensor of ", blocks.dim(), " dimensions");
  const Kernel kernel = kernel_named(kernel_name);
  Tensor records;
  if (kernel != Kernel::portable)
    records = bytes == 18 ? interleave_with<BlockQ4_0>(blocks) : bytes == 20 ? interleave_with<BlockQ4_1>(blocks)
                                                                             : interleave_with<BlockQ8_0>(blocks);
  return Prepared{blocks, records, kernel, kernel_name.empty() ? built.front() : kernel_name};
}

// x (n, in) float32 times a prepared weight, plus a float32 bias (out,) or none.
inline Tensor product(const Tensor& x, const Prepared& weight, const c10::optional<Tensor>& bias) {
  const Tensor& blocks = weight.blocks;
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2 && x.size(1) == BLOCK * blocks.size(1) &&
                  (!bias || (bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == blocks.size(0))),
              "integer rows take float32 x (n, in) for blocks of in / 32, and a float32 bias (out,) or none");
  const int64_t bytes = blocks.size(2);
  if (bytes == 18) return product_with<BlockQ4_0>(weight, x, bias);
  if (bytes == 20) return product_with<BlockQ4_1>(weight, x, bias);
  return product_with<BlockQ8_0>(weight, x, bias);
}

}  // namespace block_rows
