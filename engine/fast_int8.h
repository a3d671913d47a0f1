// int8 x int8 products for engine/fast_layer.cpp (`--quantization w8a8`; engine/quantized.py's
// W8A8Weight is the readable reference, bitwise): y (n, out) of T = x (n, in) of T times an int8
// weight (out, in) with per-output scales, each row of x made int8 first with its own scale.
//
// 1. Each row of x on its own: scale = its largest |x| / 127 (1 for a row of zeros), value = x /
//    scale rounded to the nearest integer, halves to even (quantized.quantize_rows), stored as
//    value + 128 (0 .. 255: `vpdpbusd` multiplies unsigned by signed bytes).
// 2. For each output: the sum over `in` of (value + 128) * weight, in int32, minus 128 times the
//    weight row's sum (W8A8Weight.sums): the exact integer sum of value * weight. Integer sums do not
//    depend on their order, so the kernels (AVX512-VNNI, portable), the threads and the rows beside
//    a row change nothing: a verify pass is bitwise its decode passes. |sum| <= 255 * 127 * in fits in
//    int32 for in up to 66,000.
// 3. float(sum) * weight scale * row scale (+ bias), rounded once to T (no fused multiply-add: the
//    build has -ffp-contract=off), the same for every row.
#pragma once

#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace int8_rows {

using at::Tensor;

// The VNNI kernels (here and in fast_q4.h) ask for weight bytes this far ahead of the ones they
// load, as the rows kernel does for one-row blocks (fast_layer.cpp, PREFETCH_BYTES_ONE_ROW): narrow
// weights (SmolVLM-256M's 576-byte int8 rows) restart the hardware prefetcher's streams often. No
// arithmetic changes.
constexpr int64_t PREFETCH_AHEAD = 8192;

// The kernels this build has (the first runs unless use() says otherwise), and why the VNNI one
// does not run where it is missing: a named reason, which engine/fast_native.py prints.
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define HAVE_VNNI_KERNEL
inline bool cpu_has_vnni() { return __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512bw"); }
inline const std::vector<std::string> built = {"avx512-vnni", "portable"};
inline std::string in_use = cpu_has_vnni() ? "avx512-vnni" : "portable";
inline std::string fallback_reason() { return cpu_has_vnni() ? "" : "this CPU has no AVX512-VNNI (avx512_vnni)"; }
#else
inline const std::vector<std::string> built = {"portable"};
inline std::string in_use = "portable";
inline std::string fallback_reason() {
  return "built for a CPU without AVX512-VNNI and AVX512-BW (no avx512_vnni / avx512bw in -march=native)";
}
#endif

// Rows of x as unsigned bytes (value + 128), each row padded with 128 (value 0) to a multiple of 64.
struct Rows {
  std::vector<uint8_t> values;  // (n, stride)
  std::vector<float> scales;  // (n,)
  int64_t stride;
};

#ifdef HAVE_VNNI_KERNEL
static inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
static inline __m512 load16(const at::BFloat16* p) {  // the bits in the high half of each float
  const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}
static inline __m512 load16(const at::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
#endif

// One row's largest |x| and its bytes (value + 128), 16 at a time where the CPU has AVX-512 (the
// same operations: a division rounded as IEEE says, rounding to the nearest integer, halves to even,
// as std::nearbyint does in the default rounding mode), the rest one by one.
template <typename T>
static float row_top(const T* row, int64_t in) {
  float top = 0.f;
  int64_t k = 0;
#ifdef HAVE_VNNI_KERNEL
  __m512 tops = _mm512_setzero_ps();
  for (; k + 16 <= in; k += 16) tops = _mm512_max_ps(tops, _mm512_abs_ps(load16(row + k)));
  top = _mm512_reduce_max_ps(tops);
#endif
  for (; k < in; ++k) top = std::max(top, std::fabs(static_cast<float>(row[k])));
  return top;
}

template <typename T>
static void row_bytes(const T* row, int64_t in, float scale, uint8_t* out) {
  int64_t k = 0;
#ifdef HAVE_VNNI_KERNEL
  const __m512 scales = _mm512_set1_ps(scale), low = _mm512_set1_ps(-127.f), high = _mm512_set1_ps(127.f);
  for (; k + 16 <= in; k += 16) {
    const __m512 value = _mm512_min_ps(high, _mm512_max_ps(low, _mm512_div_ps(load16(row + k), scales)));
    const __m512i rounded = _mm512_cvt_roundps_epi32(value, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + k),
                     _mm512_cvtepi32_epi8(_mm512_add_epi32(rounded, _mm512_set1_epi32(128))));
  }
#endif
  for (; k < in; ++k) {
    const float value = std::min(127.f, std::max(-127.f, static_cast<float>(row[k]) / scale));
    out[k] = static_cast<uint8_t>(static_cast<int>(std::nearbyint(value)) + 128);
  }
}

template <typename T>
static Rows quantize(const T* x, int64_t n, int64_t in) {
  const int64_t stride = (in + 63) / 64 * 64;
  Rows rows{std::vector<uint8_t>(n * stride, 128), std::vector<float>(n), stride};
  for (int64_t r = 0; r < n; ++r) {
    const float top = row_top(x + r * in, in);
    rows.scales[r] = top > 0.f ? top / 127.f : 1.f;
    row_bytes(x + r * in, in, rows.scales[r], rows.values.data() + r * stride);
  }
  return rows;
}

// sums[r][c] = sum over k of x row r (bytes) * weight row c (int8), for R rows and C weight rows.
template <int R, int C>
static inline void portable_block(const uint8_t* x, int64_t stride, const int8_t* weight, int64_t in,
                                  int32_t sums[R][C]) {
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) {
      int32_t sum = 0;
#pragma omp simd reduction(+ : sum)
      for (int64_t k = 0; k < in; ++k) sum += static_cast<int32_t>(x[r * stride + k]) * weight[c * in + k];
      sums[r][c] = sum;
    }
}

#ifdef HAVE_VNNI_KERNEL
// The 16 lanes of each of a, b, c, d summed: {sum a, sum b, sum c, sum d}.
static inline __m128i sum4(__m512i a, __m512i b, __m512i c, __m512i d) {
  const __m512i ab = _mm512_add_epi32(_mm512_unpacklo_epi32(a, b), _mm512_unpackhi_epi32(a, b));
  const __m512i cd = _mm512_add_epi32(_mm512_unpacklo_epi32(c, d), _mm512_unpackhi_epi32(c, d));
  const __m512i abcd = _mm512_add_epi32(_mm512_unpacklo_epi64(ab, cd), _mm512_unpackhi_epi64(ab, cd));
  const __m256i half = _mm256_add_epi32(_mm512_castsi512_si256(abcd), _mm512_extracti64x4_epi64(abcd, 1));
  return _mm_add_epi32(_mm256_castsi256_si128(half), _mm256_extracti128_si256(half, 1));
}

// portable_block with vpdpbusd: 64 bytes of a row times 64 of each weight row a step, 4 products
// summed into each of 16 int32 lanes; the last step's weight bytes past `in` read as 0.
template <int R, int C>
static inline void vnni_block(const uint8_t* x, int64_t stride, const int8_t* weight, int64_t in,
                              int32_t sums[R][C]) {
  __m512i acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = _mm512_setzero_si512();
  for (int64_t k = 0; k < in; k += 64) {
    const __mmask64 mask = in - k >= 64 ? ~0ULL : (1ULL << (in - k)) - 1;
    __m512i w[C];
    for (int c = 0; c < C; ++c)
      _mm_prefetch(reinterpret_cast<const char*>(weight + c * in + k) + PREFETCH_AHEAD, _MM_HINT_T0);
    for (int c = 0; c < C; ++c) w[c] = _mm512_maskz_loadu_epi8(mask, weight + c * in + k);
    for (int r = 0; r < R; ++r) {
      const __m512i xs = _mm512_loadu_si512(x + r * stride + k);
      for (int c = 0; c < C; ++c) acc[r][c] = _mm512_dpbusd_epi32(acc[r][c], xs, w[c]);
    }
  }
  for (int r = 0; r < R; ++r) {
    if constexpr (C == 4) {
      _mm_storeu_si128(reinterpret_cast<__m128i*>(sums[r]), sum4(acc[r][0], acc[r][1], acc[r][2], acc[r][3]));
    } else {
      for (int c = 0; c < C; ++c) sums[r][c] = _mm512_reduce_add_epi32(acc[r][c]);
    }
  }
}
#endif

template <typename T>
struct Product {
  const Rows& x;
  const int8_t* weight;  // (out, in)
  const int32_t* weight_sums;  // (out,)
  const T* scales;  // (out,)
  const T* bias;  // (out,) or nullptr
  T* y;  // (n, out)
  int64_t n, in, out;
  bool vnni;

  template <int R, int C>
  void block(int64_t first, int64_t column) const {
    int32_t sums[R][C];
    const uint8_t* rows = x.values.data() + first * x.stride;
#ifdef HAVE_VNNI_KERNEL
    if (vnni) {
      vnni_block<R, C>(rows, x.stride, weight + column * in, in, sums);
    } else
#endif
      portable_block<R, C>(rows, x.stride, weight + column * in, in, sums);
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < C; ++c) {
        const int32_t sum = sums[r][c] - 128 * weight_sums[column + c];
        const float scaled = static_cast<float>(sum) * static_cast<float>(scales[column + c]) * x.scales[first + r];
        y[(first + r) * out + column + c] =
            static_cast<T>(bias ? scaled + static_cast<float>(bias[column + c]) : scaled);
      }
  }
};

// product.block<R, C> over every row (4 at a time) for outputs column .. column + C - 1.
template <int C, typename P>
static inline void columns(const P& product, int64_t n, int64_t column) {
  int64_t r = 0;
  for (; r + 4 <= n; r += 4) product.template block<4, C>(r, column);
  switch (n - r) {
    case 3: product.template block<3, C>(r, column); break;
    case 2: product.template block<2, C>(r, column); break;
    case 1: product.template block<1, C>(r, column); break;
  }
}

// product.block over n rows and `out` outputs: groups of 4 outputs in parallel (a thread takes a
// range of at least `grain` groups), the outputs left over one by one.
template <typename P>
static void each_block(const P& product, int64_t n, int64_t out, int64_t grain) {
  if (n <= 4) {  // one block of rows: one weight row at a time (engine/fast_layer.cpp FEW_ROWS_COLUMNS; up to 4
    // rows here in one block, where float weights take 4 as 2 + 2: int8 and q4_0 showed no jump at 4
    // rows, 7 December)
    at::parallel_for(0, out, 4 * grain, [&](int64_t first, int64_t last) {
      for (int64_t column = first; column < last; ++column) columns<1>(product, n, column);
    });
    return;
  }
  const int64_t groups = out / 4;
  at::parallel_for(0, groups, grain, [&](int64_t first, int64_t last) {
    for (int64_t group = first; group < last; ++group) columns<4>(product, n, 4 * group);
  });
  for (int64_t column = 4 * groups; column < out; ++column) columns<1>(product, n, column);
}

// y (n, out) of T = x (n, in) of T times weight (out, in) int8 with scales (out,) of T and the weight
// rows' sums (out,) int32, plus bias (out,) of T or none; any number of rows.
template <typename T>
static Tensor product(const Tensor& x, const Tensor& weight, const Tensor& scales, const Tensor& sums,
                      const c10::optional<Tensor>& bias) {
  const int64_t n = x.size(0), in = x.size(1), out = weight.size(0);
  const Tensor rows_x = x.contiguous();
  const Rows rows = quantize<T>(rows_x.data_ptr<T>(), n, in);
  Tensor y = at::empty({n, out}, x.options());
  const Product<T> product{rows, weight.data_ptr<int8_t>(), sums.data_ptr<int32_t>(), scales.data_ptr<T>(),
                           bias ? bias->data_ptr<T>() : nullptr, y.data_ptr<T>(), n, in, out,
                           in_use == "avx512-vnni"};
  each_block(product, n, out, std::max<int64_t>(1, 8192 / in));
  return y;
}

inline void use(const std::string& name) {
  TORCH_CHECK(std::find(built.begin(), built.end(), name) != built.end(), "no int8 kernel ", name,
              " in this build (it has ", c10::Join(", ", built), ")");
#ifdef HAVE_VNNI_KERNEL
  TORCH_CHECK(name != "avx512-vnni" || cpu_has_vnni(), fallback_reason());
#endif
  in_use = name;
}

}  // namespace int8_rows
