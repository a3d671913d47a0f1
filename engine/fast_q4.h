// 4-bit weights x int8 activations for engine/fast_layer.cpp (`--quantization q4_0`; engine/quantized.py's
// Q4Weight is the readable reference, bitwise): y (n, out) of T = x (n, in) of T times a weight (out, in)
// in llama.cpp's Q4_0 format (a float16 scale d and codes q in 0 .. 15 per 32 inputs, the weight
// (q - 8) * d), stored as Q4Weight stores it: the input padded to a multiple of 64, byte j of each 128
// inputs' 64 bytes holding input j in its low 4 bits and input 64 + j in its high 4 bits (a last 64
// inputs: 32 bytes, inputs j and 32 + j), so that one load and two masks give two steps' codes.
//
// 1. Each row of x on its own as engine/fast_int8.h makes it int8 (one scale per row, so each step
//    below needs the weight's scales only, shared by every row: one multiply fewer per row, output
//    and 64 inputs than a scale per 32 activations), kept signed, with each 4 values' sum times -8
//    (`corrections`).
// 2. For each output, each 64 inputs (a step) in order: 16 int32 lanes, lane l the exact sum over
//    inputs 4l .. 4l + 3 of value * (q - 8) (`vpdpbusd` of the codes as unsigned bytes by the values,
//    started from the lane's correction: q * x - 8 x), made float and multiplied by its block's scale
//    (lanes 0-7 the first block, 8-15 the second; exact: |sum| < 2^12 times float16's 11 bits fits
//    float32's 24, so a fused multiply-add rounds as an add), added to the lane's float32 total.
// 3. The 16 totals added in halves (8 + 8, 4 + 4, 2 + 2, 1 + 1), times the row's scale (+ bias),
//    rounded once to T.
// Every step is the same for a row whatever the rows beside it, the threads and the kernel
// (AVX512-VNNI, or a portable loop with the same arithmetic): a verify pass is bitwise its decode
// passes. The kernel in use is int8_rows::in_use (one choice for both int8-activation products).
#pragma once

#include "fast_int8.h"

#include <cstring>

namespace q4_rows {

using at::Tensor;

// Rows of x as signed bytes padded with 0 to a multiple of 64, and -8 times each 4 values' sum.
struct Rows {
  std::vector<int8_t> values;  // (n, stride)
  std::vector<int32_t> corrections;  // (n, stride / 4)
  std::vector<float> scales;  // (n,)
  int64_t stride;
};

template <typename T>
static Rows quantize(const T* x, int64_t n, int64_t in) {
  int8_rows::Rows bytes = int8_rows::quantize<T>(x, n, in);  // value + 128, padded with 128
  const size_t size = bytes.values.size();
  Rows rows{std::vector<int8_t>(size), std::vector<int32_t>(size / 4), std::move(bytes.scales), bytes.stride};
  for (size_t i = 0; i < size; ++i) rows.values[i] = static_cast<int8_t>(bytes.values[i] ^ 0x80);
  for (size_t lane = 0; lane < size / 4; ++lane) {
    const int8_t* v = rows.values.data() + 4 * lane;
    rows.corrections[lane] = -8 * (v[0] + v[1] + v[2] + v[3]);
  }
  return rows;
}

// The 16 lane totals added in halves: 8 + 8, 4 + 4, 2 + 2, 1 + 1.
static inline float halves_sum(float* lanes) {
  for (int width = 8; width > 0; width /= 2)
    for (int i = 0; i < width; ++i) lanes[i] += lanes[i + width];
  return lanes[0];
}

// The 64 codes of step s (inputs 64 s .. 64 s + 63) of one weight row, unsigned 0 .. 15, unpacked.
static inline void step_codes(const uint8_t* row, int64_t stride, int64_t s, int8_t codes[64]) {
  const int64_t pairs = stride / 128;
  const uint8_t* bytes = row + 64 * (s / 2);
  for (int j = 0; j < 64; ++j) {
    if (s < 2 * pairs) {
      codes[j] = static_cast<int8_t>(s % 2 == 0 ? bytes[j] & 15 : bytes[j] >> 4);
    } else {  // the last 64 inputs, in 32 bytes
      codes[j] = static_cast<int8_t>(j < 32 ? bytes[j] & 15 : bytes[j - 32] >> 4);
    }
  }
}

// totals[r][c]: step 2 for R rows of x from `first` and C weight rows, `stride` inputs (padded).
template <int R, int C>
static inline void portable_block(const Rows& x, int64_t first, const uint8_t* codes, const at::Half* scales,
                                  float totals[R][C]) {
  const int64_t stride = x.stride, steps = stride / 64;
  float lanes[R][C][16] = {};
  for (int64_t s = 0; s < steps; ++s) {
    int8_t w[C][64];
    float d[C][16];
    for (int c = 0; c < C; ++c) {
      step_codes(codes + c * stride / 2, stride, s, w[c]);
      for (int l = 0; l < 16; ++l) d[c][l] = static_cast<float>(scales[c * stride / 32 + 2 * s + l / 8]);
    }
    for (int r = 0; r < R; ++r) {
      const int8_t* xs = x.values.data() + (first + r) * stride + s * 64;
      const int32_t* corrections = x.corrections.data() + (first + r) * stride / 4 + s * 16;
      for (int c = 0; c < C; ++c)
        for (int l = 0; l < 16; ++l) {
          int32_t sum = corrections[l];
          for (int k = 4 * l; k < 4 * l + 4; ++k) sum += static_cast<int32_t>(w[c][k]) * xs[k];
          lanes[r][c][l] += static_cast<float>(sum) * d[c][l];
        }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) totals[r][c] = halves_sum(lanes[r][c]);
}

#ifdef HAVE_VNNI_KERNEL
static inline float halves_sum(__m512 v) {  // halves_sum's order
  const __m256 eight = _mm256_add_ps(_mm512_castps512_ps256(v),
                                     _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
  const __m128 four = _mm_add_ps(_mm256_castps256_ps128(eight), _mm256_extractf128_ps(eight, 1));
  const __m128 two = _mm_add_ps(four, _mm_movehl_ps(four, four));
  return _mm_cvtss_f32(_mm_add_ss(two, _mm_shuffle_ps(two, two, 1)));
}

// Scales k and k + 1 of four (floats) spread over lanes 0-7 and 8-15.
static inline __m512 spread(__m128 four, int k) {
  const __m512i lanes = _mm512_set_epi32(k + 1, k + 1, k + 1, k + 1, k + 1, k + 1, k + 1, k + 1, k, k, k, k, k, k, k, k);
  return _mm512_permutexvar_ps(lanes, _mm512_castps128_ps512(four));
}

// Step 2 for R rows and C weight rows at step s: w[c] its 64 codes, d[c] its two scales spread.
template <int R, int C>
static inline void vnni_step(const Rows& x, int64_t first, int64_t s, const __m512i* w, const __m512* d,
                             __m512 lanes[R][C]) {
  for (int r = 0; r < R; ++r) {
    const __m512i xs = _mm512_loadu_si512(x.values.data() + (first + r) * x.stride + s * 64);
    const __m512i corrections = _mm512_loadu_si512(x.corrections.data() + (first + r) * x.stride / 4 + s * 16);
    for (int c = 0; c < C; ++c)
      lanes[r][c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_dpbusd_epi32(corrections, w[c], xs)), d[c], lanes[r][c]);
  }
}

// portable_block with AVX512-VNNI: each 128 inputs' 64 bytes of codes masked into two steps' 64
// unsigned bytes (low halves, then high halves), their four scales made float once and spread.
template <int R, int C>
static inline void vnni_block(const Rows& x, int64_t first, const uint8_t* codes, const at::Half* scales,
                              float totals[R][C]) {
  const int64_t stride = x.stride, pairs = stride / 128;
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  __m512 lanes[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) lanes[r][c] = _mm512_setzero_ps();
  __m512i packed[C], w[C];
  __m512 d[C];
  __m128 four[C];
  for (int64_t p = 0; p < pairs; ++p) {
    for (int c = 0; c < C; ++c) {
      const uint8_t* step_codes = codes + c * stride / 2 + 64 * p;
      const at::Half* step_scales = scales + c * stride / 32 + 4 * p;
      // 8 KB of codes ahead, and their scales (an eighth of the codes' bytes)
      _mm_prefetch(reinterpret_cast<const char*>(step_codes) + int8_rows::PREFETCH_AHEAD, _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(step_scales) + int8_rows::PREFETCH_AHEAD / 8, _MM_HINT_T0);
      packed[c] = _mm512_loadu_si512(step_codes);
      four[c] = _mm_cvtph_ps(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(step_scales)));
      w[c] = _mm512_and_si512(packed[c], low4);
      d[c] = spread(four[c], 0);
    }
    vnni_step<R, C>(x, first, 2 * p, w, d, lanes);
    for (int c = 0; c < C; ++c) {
      w[c] = _mm512_and_si512(_mm512_srli_epi16(packed[c], 4), low4);
      d[c] = spread(four[c], 2);
    }
    vnni_step<R, C>(x, first, 2 * p + 1, w, d, lanes);
  }
  if (stride % 128) {  // the last 64 inputs, in 32 bytes
    for (int c = 0; c < C; ++c) {
      const __m256i half = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + c * stride / 2 + 64 * pairs));
      const __m256i low = _mm512_castsi512_si256(low4);
      w[c] = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_and_si256(half, low)),
                                _mm256_and_si256(_mm256_srli_epi16(half, 4), low), 1);
      int32_t two;
      std::memcpy(&two, scales + c * stride / 32 + 4 * pairs, sizeof two);
      d[c] = spread(_mm_cvtph_ps(_mm_cvtsi32_si128(two)), 0);
    }
    vnni_step<R, C>(x, first, 2 * pairs, w, d, lanes);
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) totals[r][c] = halves_sum(lanes[r][c]);
}
#endif

template <typename T>
struct Product {
  const Rows& x;
  const uint8_t* codes;  // (out, stride / 2)
  const at::Half* scales;  // (out, stride / 32)
  const T* bias;  // (out,) or nullptr
  T* y;  // (n, out)
  int64_t n, out;
  bool vnni;

  template <int R, int C>
  void block(int64_t first, int64_t column) const {
    float totals[R][C];
    const uint8_t* weight_codes = codes + column * x.stride / 2;
    const at::Half* weight_scales = scales + column * x.stride / 32;
#ifdef HAVE_VNNI_KERNEL
    if (vnni) {
      vnni_block<R, C>(x, first, weight_codes, weight_scales, totals);
    } else
#endif
      portable_block<R, C>(x, first, weight_codes, weight_scales, totals);
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < C; ++c) {
        const float scaled = totals[r][c] * x.scales[first + r];
        y[(first + r) * out + column + c] =
            static_cast<T>(bias ? scaled + static_cast<float>(bias[column + c]) : scaled);
      }
  }
};

// y (n, out) of T = x (n, in) of T times the Q4_0 weight codes (out, padded / 2) uint8 and scales
// (out, padded / 32) float16 (padded: in rounded up to 64), plus bias (out,) of T or none.
template <typename T>
static Tensor product(const Tensor& x, const Tensor& codes, const Tensor& scales, const c10::optional<Tensor>& bias) {
  const int64_t n = x.size(0), in = x.size(1), out = codes.size(0);
  const Tensor rows_x = x.contiguous();
  const Rows rows = quantize<T>(rows_x.data_ptr<T>(), n, in);
  Tensor y = at::empty({n, out}, x.options());
  const Product<T> product{rows, codes.data_ptr<uint8_t>(), reinterpret_cast<const at::Half*>(scales.data_ptr()),
                           bias ? bias->data_ptr<T>() : nullptr, y.data_ptr<T>(), n, out,
                           int8_rows::in_use == "avx512-vnni"};
  int8_rows::each_block(product, n, out, std::max<int64_t>(1, 16384 / in));
  return y;
}

}  // namespace q4_rows
