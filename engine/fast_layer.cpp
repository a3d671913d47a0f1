// engine/fast_decode.py's decode / verify pass in C++ (engine/fast_native.py builds it): `stack`
// runs every decoder layer of a pass in one call, for float32 / bfloat16 / float16 activations over
// a float32 cache (the fast path on a CPU). One layer is `fused_layer`: fast_decode.decoder_layer's
// arithmetic (that Python function is the readable reference, and tests/test_fast_native.py checks
// this file against it on both weight layouts), with the matrix products in this file's rows kernel
// (ATen's for passes longer than any verify pass, and for other shapes) and everything between
// them (RMSNorm, rotary, cache writes, attention, SiLU, residual adds) as loops, each row computed
// on its own, so a pass costs a few Python-free calls instead of about twenty operators a layer.
// Its results differ from the Python layer's by float rounding only (sums in another order); other
// pairs of types are refused (fast_decode.FastStack runs the Python layer for them). The weights
// cross from Python as `Layer`, fast_decode.Layer's fields by name.
#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "fast_blocks.h"
#include "fast_int8.h"
#include "fast_q4.h"

using at::Tensor;

// Rotary on q and k and the cache writes in one loop: for each token t, head h (q heads, then kv
// heads) and dimension d, the value ATen computes for qk * cos + roll(qk, D / 2) * signed_sin,
// each product and the sum rounded to T as ATen's elementwise kernels round them (T float: plain
// float arithmetic, built without FMA contraction). q goes to `queries` (heads, n, D), k and v to
// the cache's slots start .. start + n - 1 (kv_heads, capacity, D), all float32.
template <typename T>
static void rotate_and_write(const Tensor& qkv, const Tensor& cos, const Tensor& signed_sin, Tensor& queries,
                             Tensor& keys, Tensor& values, int64_t start, int64_t heads, int64_t kv_heads,
                             int64_t head_dim) {
  const int64_t n = qkv.size(0), row = qkv.stride(0), capacity = keys.size(2), half = head_dim / 2;
  const T* in = qkv.data_ptr<T>();
  const T* cos_p = cos.data_ptr<T>();
  const T* sin_p = signed_sin.data_ptr<T>();
  float* q_out = queries.data_ptr<float>();
  float* k_out = keys.data_ptr<float>();
  float* v_out = values.data_ptr<float>();
  for (int64_t t = 0; t < n; ++t) {
    const T* token = in + t * row;
    const T* c = cos_p + t * head_dim;
    const T* s = sin_p + t * head_dim;
    for (int64_t h = 0; h < heads + kv_heads; ++h) {
      const T* x = token + h * head_dim;
      float* out = h < heads ? q_out + (h * n + t) * head_dim
                         : k_out + ((h - heads) * capacity + start + t) * head_dim;
      for (int64_t d = 0; d < head_dim; ++d) {
        const T a = static_cast<T>(static_cast<float>(x[d]) * static_cast<float>(c[d]));
        const T b = static_cast<T>(static_cast<float>(x[(d + half) % head_dim]) * static_cast<float>(s[d]));
        out[d] = static_cast<float>(static_cast<T>(static_cast<float>(a) + static_cast<float>(b)));
      }
    }
    const T* v = token + (heads + kv_heads) * head_dim;
    for (int64_t h = 0; h < kv_heads; ++h)
      for (int64_t d = 0; d < head_dim; ++d)
        v_out[(h * capacity + start + t) * head_dim + d] = static_cast<float>(v[h * head_dim + d]);
  }
}

// x (n, in) times weight (in, out), plus bias, by ATen (fast_decode.linear): float weights, or int8
// ones with per-output scales (out,).
static Tensor aten_product(const Tensor& x, const Tensor& weight, const c10::optional<Tensor>& bias,
                           const c10::optional<Tensor>& scales = c10::nullopt) {
  if (scales.has_value()) {
    const Tensor y = at::_weight_int8pack_mm(x, weight.t(), *scales);
    return bias.has_value() ? y + *bias : y;
  }
  return bias.has_value() ? at::addmm(*bias, x, weight) : at::mm(x, weight);
}

// The products of decode and verify passes, for (out, in) weights: each output is one row of the
// weight times one row of x, summed in 16 float lanes in the order of `in` (fused multiply-adds),
// the lanes then added in halves, whatever the number of rows, the thread or the rows beside it. A
// verify pass's rows are therefore bitwise the decode passes' (tests/test_fast_native.py), and the
// weight is read once for all the rows: a 5-row bfloat16 product costs about 1.5 one-row products
// here, against 5.6 for oneDNN's (docs/performance.md). The 16 lanes are one AVX-512 register, two
// AVX2 registers, or an array the compiler vectorizes (other CPUs): the same operations in the same
// order, so all three give the same bits and a product does not depend on the CPU's vector width
// (the attention and SiLU below do: an AVX-512 build sums them in lanes, others in plain loops, so
// an answer's bits may differ between builds; docs/performance.md, "Exactness").
// It takes up to ROWS_KERNEL_MAX rows, the most a verify pass has (engine/tree.py MAX_VERIFY_ROWS,
// given by engine/fast_native.py): every pass the settings allow. Longer passes (a drafter head's
// prompt, which no pass is compared with) and other shapes: ATen's product, faster there.
#ifndef ROWS_KERNEL_MAX
#error "build with -DROWS_KERNEL_MAX=<rows> (engine/fast_native.py passes engine/tree.py's MAX_VERIFY_ROWS)"
#endif
constexpr int LANES = 16;

static inline float to_float(float value) { return value; }
static inline float to_float(int8_t value) { return static_cast<float>(value); }
static inline float to_float(at::Half value) { return static_cast<float>(value); }
static inline float to_float(at::BFloat16 value) {  // its bits in the high half of a float
  const uint32_t bits = static_cast<uint32_t>(value.x) << 16;
  float result;
  std::memcpy(&result, &bits, sizeof result);
  return result;
}

// Weights kept in ggml's blocks (engine/packed.py; BlockQ4_1 and BlockQ8_0 in fast_blocks.h): 32
// inputs a block, their values exactly as gguf-py's dequantize makes them in float32, so a product
// over blocks gives the bits of the same product over those float32 values (every load below yields
// the same 16 floats, then the same multiply-adds in the same order), from a fifth (Q4_1) or a
// quarter (Q8_0) of the bytes. fast_blocks.h multiplies the same blocks by int8 rows instead.
template <typename W> constexpr bool is_block = std::is_same_v<W, BlockQ4_1> || std::is_same_v<W, BlockQ8_0>;

// Where input k of a weight row starts, and the bytes of a row of `in` inputs, for each storage.
template <typename W>
static inline const W* row_of(const W* weight, int64_t row, int64_t in) {
  return weight + row * (is_block<W> ? in / 32 : in);
}
template <typename W>
static inline const char* address(const W* row, int64_t k) {
  return reinterpret_cast<const char*>(is_block<W> ? row + k / 32 : row + k);
}
template <typename W>
static inline int64_t row_bytes(int64_t in) { return (is_block<W> ? in / 32 : in) * int64_t(sizeof(W)); }

// The 16 values of inputs k .. k + 15 (k a multiple of 16) of a block row, as floats, for the portable lanes.
static inline void block_values(const BlockQ4_1* row, int64_t k, float out[16]) {
  const BlockQ4_1& b = row[k / 32];
  const float d = static_cast<float>(b.d), m = static_cast<float>(b.m);
  const int shift = (k / 16) % 2 ? 4 : 0;
  for (int i = 0; i < 16; ++i) {
    const float scaled = d * static_cast<float>((b.qs[i] >> shift) & 15);
    out[i] = scaled + m;
  }
}
static inline void block_values(const BlockQ8_0* row, int64_t k, float out[16]) {
  const BlockQ8_0& b = row[k / 32];
  const float d = static_cast<float>(b.d);
  for (int i = 0; i < 16; ++i) out[i] = d * static_cast<float>(b.qs[(k % 32) + i]);
}

// Each kind of lanes: its name, the block of rows x columns its registers hold, sum (halves added
// pairwise: 8 + 8, 4 + 4, 2 + 2, 1 + 1) and, for the intrinsics, V (16 floats), zero, load (16
// values of a weight or x, as floats) and fma (a * b + c, one rounding). The portable lanes are
// float arrays (dot_block).
struct PortableLanes {
  static constexpr const char* name = "portable";
  static constexpr int rows = 2, columns = 4;
  static float sum(float* lanes) {
    for (int width = LANES / 2; width > 0; width /= 2)
      for (int i = 0; i < width; ++i) lanes[i] += lanes[i + width];
    return lanes[0];
  }
};

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define HAVE_AVX2_LANES
struct Avx2Lanes {
  static constexpr const char* name = "avx2";
  static constexpr int rows = 3, columns = 2;  // 12 accumulators of 16 registers (the best of 2x2, 1x4, 2x4, 3x2)
  struct V { __m256 low, high; };
  static V zero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
  static V load(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
  static V load(const at::BFloat16* p) {
    const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return {_mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm256_castsi256_si128(bits)), 16)),
            _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm256_extracti128_si256(bits, 1)), 16))};
  }
  static V load(const at::Half* p) {
    const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return {_mm256_cvtph_ps(_mm256_castsi256_si128(bits)), _mm256_cvtph_ps(_mm256_extracti128_si256(bits, 1))};
  }
  static V load(const int8_t* p) {
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return {_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes)),
            _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(bytes, 8)))};
  }
  static V load(const BlockQ4_1* row, int64_t k) {
    const BlockQ4_1& b = row[k / 32];
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b.qs));
    const __m128i codes = (k / 16) % 2 ? _mm_and_si128(_mm_srli_epi16(bytes, 4), _mm_set1_epi8(15))
                                       : _mm_and_si128(bytes, _mm_set1_epi8(15));
    const __m256 d = _mm256_set1_ps(_cvtsh_ss(b.d.x)), m = _mm256_set1_ps(_cvtsh_ss(b.m.x));
    const __m256 low = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(codes));
    const __m256 high = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(codes, 8)));
    return {_mm256_add_ps(_mm256_mul_ps(low, d), m), _mm256_add_ps(_mm256_mul_ps(high, d), m)};
  }
  static V load(const BlockQ8_0* row, int64_t k) {
    const BlockQ8_0& b = row[k / 32];
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b.qs + k % 32));
    const __m256 d = _mm256_set1_ps(_cvtsh_ss(b.d.x));
    return {_mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes)), d),
            _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(bytes, 8))), d)};
  }
  static V fma(V a, V b, V c) {
    return {_mm256_fmadd_ps(a.low, b.low, c.low), _mm256_fmadd_ps(a.high, b.high, c.high)};
  }
  static float sum(V v) {
    const __m256 eight = _mm256_add_ps(v.low, v.high);
    const __m128 four = _mm_add_ps(_mm256_castps256_ps128(eight), _mm256_extractf128_ps(eight, 1));
    const __m128 two = _mm_add_ps(four, _mm_movehl_ps(four, four));
    return _mm_cvtss_f32(_mm_add_ss(two, _mm_shuffle_ps(two, two, 1)));
  }
};
#endif

#ifdef __AVX512F__
#define HAVE_AVX512_LANES
struct Avx512Lanes {
  static constexpr const char* name = "avx512";
  static constexpr int rows = 4, columns = 4;  // 16 accumulators of 32 registers
  using V = __m512;
  static V zero() { return _mm512_setzero_ps(); }
  static V load(const float* p) { return _mm512_loadu_ps(p); }
  static V load(const at::BFloat16* p) {
    const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
  }
  static V load(const at::Half* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
  static V load(const int8_t* p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  }
  static V load(const BlockQ4_1* row, int64_t k) {
    const BlockQ4_1& b = row[k / 32];
    const __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b.qs)));
    const __m512i codes = (k / 16) % 2 ? _mm512_srli_epi32(bytes, 4) : _mm512_and_si512(bytes, _mm512_set1_epi32(15));
    return _mm512_add_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(codes), _mm512_set1_ps(_cvtsh_ss(b.d.x))),
                         _mm512_set1_ps(_cvtsh_ss(b.m.x)));
  }
  static V load(const BlockQ8_0* row, int64_t k) {
    const BlockQ8_0& b = row[k / 32];
    const __m512i codes = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b.qs + k % 32)));
    return _mm512_mul_ps(_mm512_cvtepi32_ps(codes), _mm512_set1_ps(_cvtsh_ss(b.d.x)));
  }
  static void load_block(const BlockQ4_1& b, V& first, V& second) {  // inputs 0 .. 15 and 16 .. 31
    const __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b.qs)));
    const __m512 d = _mm512_set1_ps(_cvtsh_ss(b.d.x)), m = _mm512_set1_ps(_cvtsh_ss(b.m.x));
    first = _mm512_add_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_and_si512(bytes, _mm512_set1_epi32(15))), d), m);
    second = _mm512_add_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(bytes, 4)), d), m);
  }
  static void load_block(const BlockQ8_0& b, V& first, V& second) {
    const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b.qs));
    const __m512 d = _mm512_set1_ps(_cvtsh_ss(b.d.x));
    first = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(bytes))), d);
    second = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(bytes, 1))), d);
  }
  static V fma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
  static float sum(V v) {
    const __m256 eight = _mm256_add_ps(_mm512_castps512_ps256(v),
                                       _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
    const __m128 four = _mm_add_ps(_mm256_castps256_ps128(eight), _mm256_extractf128_ps(eight, 1));
    const __m128 two = _mm_add_ps(four, _mm_movehl_ps(four, four));
    return _mm_cvtss_f32(_mm_add_ss(two, _mm_shuffle_ps(two, two, 1)));
  }
};
#endif

// Each block asks for its weight rows this many bytes ahead (docs/performance.md, "Prefetch"). A
// block of several rows (a verify pass) does R x C multiply-adds a load, and the hardware
// prefetcher alone leaves the core waiting on memory: 5 rows of the SmolVLM-256M shape's products
// went from 1.35-1.46x one row to 1.23-1.29x with 1 KB. A one-row block (decode) of a narrow
// weight (576 inputs: 1,152 bytes a row) restarts its streams every few rows; 8 KB ahead took the
// SmolVLM-256M shape's one-row products from about 7.5 to 10 GB/s on one thread. Beside that,
// 1 KB left 2 rows at 1.47x one row; 4 KB ahead, 1.08x.
// A block of C > 1 weight rows reads C streams side by side, so it asks that far ahead of the
// next block's rows: before, 8 rows of the output head (49,152 x 576, float32) took 6.3-6.7 ms
// and 4 rows 4.3-4.9; after, 5.0-5.1 and 4.4 (7 December, a timing loop over `product`).
// It changes no arithmetic: the sums, and so the bits, are the same.
constexpr int64_t PREFETCH_BYTES_ROWS = 4096;
constexpr int64_t PREFETCH_BYTES_ONE_ROW = 8192;

// A pass of up to FEW_ROWS rows of x (a decode pass, a verify pass of up to 4 rows) reads its
// weight one row at a time; a longer one shares each weight load
// across the lanes' `columns` weight rows. With 4 weight rows in flight a one-row product of the
// SmolLM2-135M shape's 30 layers streamed 21 GB/s in float32 and 16-17 GB/s in bfloat16 on 2
// threads; one at a time, 29 and 17-23 GB/s; 2 and 3 rows gained too, 5 and 9 did not
// (docs/performance.md, "One weight row at a time"). Each output's sum is the same either way, so
// the bits are too.
constexpr int FEW_ROWS_COLUMNS = 1;
// With 4 rows in one block (one AVX-512 block of rows) a product of the SmolLM2-135M shape's 30
// layers took 17.0-17.9 ms in float32, against 12.7-13.9 with 3 and 16.4-16.8 with 5, which share
// each load among 4 weight rows; 4 rows that way: 14.9-15.3 (7 December, a timing loop over `product`).
// 4 rows as two blocks of 2 over each weight row (its second read from L1) are as fast as 3: the
// layers 11.6-12.8 ms against 13.6-15.3 shared, the output head 3.5-4.2 against 4.4-5.1
// (`columns_few`). 5 rows and more that way were slower than shared.
constexpr int64_t FEW_ROWS = 4;
// Weights in blocks (engine/packed.py) are made into floats once per weight row for this many rows
// of x: the conversion, not the memory, is most of such a product's time.
constexpr int BLOCKS_ROWS = 8;

// out[r][c] = x row r (in floats) . weight row c (in of W), for R rows and C weight rows. Always
// inlined: with GCC 12's own choice, 3 rows of the SmolLM2-135M shape's layers in bfloat16 took
// 11.2-11.8 ms, against 7.9-8.7 marked always_inline (or noinline), 6.1-6.8 for 2 rows; the
// float32 blocks were the same every way (7 December). Which code GCC made was not looked into.
template <typename L, int R, int C, typename W>
__attribute__((always_inline)) static inline void dot_block_lanes(const float* x, const W* weight, int64_t in, float out[R][C]) {
  typename L::V sums[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) sums[r][c] = L::zero();
  const int64_t ahead = (R > 1 ? PREFETCH_BYTES_ROWS : PREFETCH_BYTES_ONE_ROW) + (C > 1 ? C * row_bytes<W>(in) : 0);
  for (int64_t k = 0; k < in; k += LANES) {
    typename L::V w[C];
    for (int c = 0; c < C; ++c) __builtin_prefetch(address(row_of(weight, c, in), k) + ahead, 0, 3);
    for (int c = 0; c < C; ++c) {
      if constexpr (is_block<W>) w[c] = L::load(row_of(weight, c, in), k);
      else w[c] = L::load(weight + c * in + k);
    }
    for (int r = 0; r < R; ++r) {
      const typename L::V xs = L::load(x + r * in + k);
      for (int c = 0; c < C; ++c) sums[r][c] = L::fma(xs, w[c], sums[r][c]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) out[r][c] = L::sum(sums[r][c]);
}

// The 32 values of one block as two lanes' loads: one read of its bytes and scales where the lanes
// have `load_block` (AVX-512), else two `load`s.
template <typename L, typename W, typename = void>
struct has_load_block : std::false_type {};
template <typename L, typename W>
struct has_load_block<L, W, std::void_t<decltype(L::load_block(std::declval<const W&>(), std::declval<typename L::V&>(),
                                                               std::declval<typename L::V&>()))>> : std::true_type {};

template <typename L, typename W>
__attribute__((always_inline)) static inline void block_pair(const W* row, int64_t k, typename L::V& first,
                                                             typename L::V& second) {
  if constexpr (has_load_block<L, W>::value) {
    L::load_block(row[k / 32], first, second);
  } else {
    first = L::load(row, k), second = L::load(row, k + 16);
  }
}

// dot_block_lanes for weights in blocks: R rows of x against one weight row, a block (32 inputs,
// two steps of 16 lanes) at a time, its values made once for all R rows. The multiply-adds are
// dot_block_lanes' in the same order, so the sums are the same.
template <typename L, int R, typename W>
__attribute__((always_inline)) static inline void dot_rows_blocks(const float* x, const W* row, int64_t in,
                                                                   float out[R][1]) {
  typename L::V sums[R];
  for (int r = 0; r < R; ++r) sums[r] = L::zero();
  const int64_t ahead = R > 1 ? PREFETCH_BYTES_ROWS : PREFETCH_BYTES_ONE_ROW;
  for (int64_t k = 0; k < in; k += 32) {
    __builtin_prefetch(address(row, k) + ahead, 0, 3);
    typename L::V first, second;
    block_pair<L>(row, k, first, second);
    for (int r = 0; r < R; ++r) sums[r] = L::fma(L::load(x + r * in + k), first, sums[r]);
    for (int r = 0; r < R; ++r) sums[r] = L::fma(L::load(x + r * in + k + 16), second, sums[r]);
  }
  for (int r = 0; r < R; ++r) out[r][0] = L::sum(sums[r]);
}

// dot_block_lanes, for the portable lanes the same loops over float arrays, written out for the
// compiler to vectorize.
template <typename L, int R, int C, typename W>
static inline void dot_block(const float* x, const W* weight, int64_t in, float out[R][C]) {
  if constexpr (std::is_same_v<L, PortableLanes>) {
    float sums[R][C][LANES] = {};
    for (int64_t k = 0; k < in; k += LANES) {
      float w[C][LANES];
      for (int c = 0; c < C; ++c) {
        if constexpr (is_block<W>) {
          block_values(row_of(weight, c, in), k, w[c]);
        } else {
#pragma omp simd
          for (int i = 0; i < LANES; ++i) w[c][i] = to_float(weight[c * in + k + i]);
        }
      }
      for (int r = 0; r < R; ++r)
        for (int c = 0; c < C; ++c)
#pragma omp simd
          for (int i = 0; i < LANES; ++i) sums[r][c][i] = std::fma(x[r * in + k + i], w[c][i], sums[r][c][i]);
    }
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < C; ++c) out[r][c] = PortableLanes::sum(sums[r][c]);
  } else if constexpr (is_block<W> && C == 1) {
    dot_rows_blocks<L, R, W>(x, weight, in, out);
  } else {
    dot_block_lanes<L, R, C, W>(x, weight, in, out);
  }
}

// Where y's rows first .. first + R - 1 and columns column .. column + C - 1 come from: the products
// times the int8 weights' per-output scales (none for float weights), plus the bias (or none).
template <typename L, typename T, typename W>
struct Product {
  const float* x;  // (n, in)
  const W* weight;  // (out, in)
  const T* scales;  // (out,) or nullptr
  const T* bias;  // (out,) or nullptr
  T* y;  // (n, out)
  int64_t n, in, out;

  template <int R, int C>
  void block(int64_t first, int64_t column) const {
    float sums[R][C];
    dot_block<L, R, C, W>(x + first * in, row_of(weight, column, in), in, sums);
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < C; ++c) {
        const float scaled = scales ? sums[r][c] * static_cast<float>(scales[column + c]) : sums[r][c];
        y[(first + r) * out + column + c] =
            static_cast<T>(scaled + (bias ? static_cast<float>(bias[column + c]) : 0.f));
      }
  }

  template <int C>
  void columns_few(int64_t column) const {  // every row of up to 4, 3 at a time, 4 as 2 + 2 (FEW_ROWS)
    switch (n) {
      case 4: block<2, C>(0, column); block<2, C>(2, column); break;
      case 3: block<3, C>(0, column); break;
      case 2: block<2, C>(0, column); break;
      case 1: block<1, C>(0, column); break;
    }
  }

  void columns_blocks(int64_t column) const {  // weights in blocks: every row, up to BLOCKS_ROWS at a time
    int64_t r = 0;
    for (; r + BLOCKS_ROWS <= n; r += BLOCKS_ROWS) block<BLOCKS_ROWS, 1>(r, column);
    switch (n - r) {
      case 7: block<7, 1>(r, column); break;
      case 6: block<6, 1>(r, column); break;
      case 5: block<5, 1>(r, column); break;
      case 4: block<4, 1>(r, column); break;
      case 3: block<3, 1>(r, column); break;
      case 2: block<2, 1>(r, column); break;
      case 1: block<1, 1>(r, column); break;
    }
  }

  template <int C>
  void columns(int64_t column) const {  // every row, L::rows (at most 4) at a time
    constexpr int R = L::rows;
    int64_t r = 0;
    for (; r + R <= n; r += R) block<R, C>(r, column);
    switch (n - r) {
      case 3: if constexpr (R > 3) block<3, C>(r, column); break;
      case 2: if constexpr (R > 2) block<2, C>(r, column); break;
      case 1: if constexpr (R > 1) block<1, C>(r, column); break;
    }
  }
};

// y (n, out) of T = x (n, in) times weight (out, in) of W (times scales), plus bias; in a multiple of 16.
template <typename L, typename T, typename W>
static Tensor rows_product_with(const Tensor& x, const Tensor& weight, const c10::optional<Tensor>& scales,
                                const c10::optional<Tensor>& bias) {
  const int64_t n = x.size(0), in = x.size(1), out = weight.size(0);
  const Tensor x_float = x.to(at::kFloat).contiguous();
  Tensor y = at::empty({n, out}, x.options());
  const Product<L, T, W> product{x_float.data_ptr<float>(), reinterpret_cast<const W*>(weight.data_ptr()),
                                 scales ? reinterpret_cast<const T*>(scales->data_ptr()) : nullptr,
                                 bias ? reinterpret_cast<const T*>(bias->data_ptr()) : nullptr,
                                 reinterpret_cast<T*>(y.data_ptr()), n, in, out};
  const int64_t grain = std::max<int64_t>(1, 4096 / in);
  if constexpr (is_block<W>) {  // one weight row at a time, its blocks' values made once for up to 8 rows
    at::parallel_for(0, out, grain, [&](int64_t first, int64_t last) {
      for (int64_t column = first; column < last; ++column) product.columns_blocks(column);
    });
    return y;
  }
  if (n <= FEW_ROWS) {  // a few rows of x: one weight row at a time (FEW_ROWS_COLUMNS), the same sums
    at::parallel_for(0, out, grain, [&](int64_t first, int64_t last) {
      for (int64_t column = first; column < last; ++column) product.template columns_few<FEW_ROWS_COLUMNS>(column);
    });
    return y;
  }
  constexpr int C = L::columns;
  const int64_t groups = out / C;  // groups of C outputs; a thread takes a range of them
  at::parallel_for(0, groups, grain, [&](int64_t first, int64_t last) {
    for (int64_t group = first; group < last; ++group) product.template columns<C>(C * group);
  });
  for (int64_t column = C * groups; column < out; ++column) product.template columns<1>(column);
  return y;
}

// The kernels this build has, the widest first (the one that runs unless use_rows_kernel says).
static const std::vector<std::string> rows_kernels = {
#ifdef HAVE_AVX512_LANES
    Avx512Lanes::name,
#endif
#ifdef HAVE_AVX2_LANES
    Avx2Lanes::name,
#endif
    PortableLanes::name};
static std::string rows_kernel_in_use = rows_kernels.front();

template <typename T, typename W>
static Tensor rows_product(const Tensor& x, const Tensor& weight, const c10::optional<Tensor>& scales,
                           const c10::optional<Tensor>& bias) {
#ifdef HAVE_AVX512_LANES
  if (rows_kernel_in_use == Avx512Lanes::name) return rows_product_with<Avx512Lanes, T, W>(x, weight, scales, bias);
#endif
#ifdef HAVE_AVX2_LANES
  if (rows_kernel_in_use == Avx2Lanes::name) return rows_product_with<Avx2Lanes, T, W>(x, weight, scales, bias);
#endif
  return rows_product_with<PortableLanes, T, W>(x, weight, scales, bias);
}

static bool plain(const c10::optional<Tensor>& vector, at::ScalarType type) {
  return !vector.has_value() || (vector->scalar_type() == type && vector->is_contiguous());
}

// x (n, in) times an int8 weight (in, out), a transposed view of an (out, in) buffer, with scales
// (out,) in x's dtype and the weight rows' sums (out,) int32, plus bias: x made int8 row by row
// (engine/fast_int8.h; W8A8Weight in engine/quantized.py), any number of rows.
static Tensor int8_activations_product(const Tensor& x, const Tensor& weight, const c10::optional<Tensor>& bias,
                                       const c10::optional<Tensor>& scales, const Tensor& sums) {
  const auto type = x.scalar_type();
  const int64_t in = weight.size(0);
  TORCH_CHECK(weight.scalar_type() == at::kChar && weight.stride(0) == 1 && weight.stride(1) == in &&
                  scales.has_value() && plain(scales, type) && plain(bias, type) &&
                  sums.scalar_type() == at::kInt && sums.is_contiguous() && sums.numel() == weight.size(1),
              "int8 activations take an int8 (out, in) weight seen as (in, out), scales and bias in the "
              "activations' dtype and int32 sums");
  TORCH_CHECK(in <= 66000, "int8 activations take rows of at most 66,000 values (int32 sums), not ", in);
  const Tensor rows = weight.t();  // (out, in), contiguous
  switch (type) {
    case at::kFloat: return int8_rows::product<float>(x, rows, *scales, sums, bias);
    case at::kBFloat16: return int8_rows::product<at::BFloat16>(x, rows, *scales, sums, bias);
    case at::kHalf: return int8_rows::product<at::Half>(x, rows, *scales, sums, bias);
    default: TORCH_CHECK(false, "int8 activations from float32, bfloat16 or float16, not ", type);
  }
}

// x (n, in) times a Q4_0 weight: codes (out, padded / 2) uint8 and scales (out, padded / 32) float16
// (engine/quantized.py's Q4Weight; padded: in rounded up to 64), plus bias: engine/fast_q4.h.
static Tensor q4_product(const Tensor& x, const Tensor& codes, const c10::optional<Tensor>& bias,
                         const c10::optional<Tensor>& scales) {
  const auto type = x.scalar_type();
  const int64_t in = x.size(1), padded = (in + 63) / 64 * 64;
  TORCH_CHECK(in % 32 == 0 && codes.is_contiguous() && codes.size(1) * 2 == padded && scales.has_value() &&
                  scales->scalar_type() == at::kHalf && scales->is_contiguous() &&
                  scales->numel() == codes.size(0) * (padded / 32) && plain(bias, type),
              "q4_0 takes x (n, in), in a multiple of 32, uint8 codes (out, in padded to 64 / 2), float16 scales "
              "(out, in padded to 64 / 32) and a bias in x's dtype");
  TORCH_CHECK(in <= 66000, "q4_0 takes rows of at most 66,000 values (int32 sums), not ", in);
  switch (type) {
    case at::kFloat: return q4_rows::product<float>(x, codes, *scales, bias);
    case at::kBFloat16: return q4_rows::product<at::BFloat16>(x, codes, *scales, bias);
    case at::kHalf: return q4_rows::product<at::Half>(x, codes, *scales, bias);
    default: TORCH_CHECK(false, "q4_0 from float32, bfloat16 or float16 activations, not ", type);
  }
}

// x (n, in) float32 times a weight in ggml's blocks, (out, in / 32, 20) bytes of BlockQ4_1 or
// (out, in / 32, 34) of BlockQ8_0 (engine/packed.py's PackedWeight), plus bias: the rows kernel, any
// number of rows (each row's sums are the same whatever the rows beside it).
static Tensor blocks_product(const Tensor& x, const Tensor& blocks, const c10::optional<Tensor>& bias) {
  const int64_t bytes = blocks.size(2);
  TORCH_CHECK(blocks.scalar_type() == at::kByte && blocks.is_contiguous() && (bytes == 20 || bytes == 34) &&
                  x.scalar_type() == at::kFloat && x.dim() == 2 && x.size(1) == 32 * blocks.size(1) &&
                  plain(bias, at::kFloat),
              "blocks take float32 x (n, in) and (out, in / 32, 20) Q4_1 or (out, in / 32, 34) Q8_0 uint8 blocks");
  if (bytes == 20) return rows_product<float, BlockQ4_1>(x, blocks, c10::nullopt, bias);
  return rows_product<float, BlockQ8_0>(x, blocks, c10::nullopt, bias);
}

// The CPU path's format table: each storage a product's weight comes in is one entry, recognised once
// when the weight is loaded (`storage_of`) and multiplied by its one kernel (`product_by`); its
// packing and its readable reference product are in Python (engine/quantized.py, engine/packed.py):
//   rows: float32 / bfloat16 / float16 (in, out) views of (out, in) buffers, in a multiple of 16;
//         int8 the same with per-output scales (quantized.Int8Weight): the rows kernel above
//   int8 activations: int8 values, scales and row sums (quantized.W8A8Weight): fast_int8.h
//   q4_0: codes and block scales (quantized.Q4Weight): fast_q4.h
//   blocks: ggml Q4_1 / Q8_0 blocks times float32 rows (packed.PackedWeight): the rows kernel
//   integer blocks: ggml Q4_0 / Q4_1 / Q8_0 blocks times int8 rows (packed, integer): fast_blocks.h
//   aten: any other weight, named with why when it is loaded (Weight.storage, logged by
//         engine/fast_decode.py as the slow path), never found only by timing.
// A rows weight also takes ATen's product for a pass longer than any verify pass (a prompt's), where
// ATen is faster and no pass is compared with it.
enum class Storage { rows, int8_activations, q4_0, blocks, integer_blocks, aten };

struct Recognised {
  Storage storage;
  std::string name;  // the entry's name, and for aten why no kernel takes the weight
};

static Recognised storage_of(const Tensor& weight, const c10::optional<Tensor>& scales,
                             const c10::optional<Tensor>& sums, bool integer_rows) {
  if (integer_rows) return {Storage::integer_blocks, "integer blocks"};
  if (sums.has_value()) return {Storage::int8_activations, "int8 activations"};
  if (weight.dim() == 3) return {Storage::blocks, "blocks"};
  if (weight.scalar_type() == at::kByte) return {Storage::q4_0, "q4_0"};
  const auto type = weight.scalar_type();
  const int64_t in = weight.size(0);
  if (type != at::kFloat && type != at::kBFloat16 && type != at::kHalf && type != at::kChar)
    return {Storage::aten, std::string("aten: no rows kernel for ") + c10::toString(type) + " weights"};
  if (scales.has_value() != (type == at::kChar))
    return {Storage::aten, "aten: scales " + std::string(scales ? "beside float" : "missing for int8") + " weights"};
  if (in % 16 || weight.stride(0) != 1 || weight.stride(1) != in)
    return {Storage::aten, "aten: the rows kernel takes (in, out) views of (out, in) buffers, in a multiple of 16"};
  return {Storage::rows, "rows"};
}

// Whether a product of n rows of x of `type` times a rows weight (storage_of's rows entry) runs the
// rows kernel: at most ROWS_KERNEL_MAX rows, bias and scales in x's dtype, the weight's too or int8.
// Else ATen's, whose sums of a row depend on the rows beside it.
static bool rows_call_takes(int64_t n, const Tensor& weight, const c10::optional<Tensor>& bias,
                            const c10::optional<Tensor>& scales, at::ScalarType type) {
  return n <= ROWS_KERNEL_MAX && plain(bias, type) && plain(scales, type) &&
         (weight.scalar_type() == type || weight.scalar_type() == at::kChar);
}

// Whether n rows of x of `type` times this (in, out) weight go to the rows kernel.
static bool rows_kernel_takes(int64_t n, const Tensor& weight, const c10::optional<Tensor>& bias,
                              const c10::optional<Tensor>& scales, at::ScalarType type) {
  return storage_of(weight, scales, c10::nullopt, false).storage == Storage::rows &&
         rows_call_takes(n, weight, bias, scales, type);
}

// x (n, in) times weight (in, out) (float, or int8 with scales (out,): fast_decode.Int8Weight's
// values transposed), plus bias, by the rows kernel: ATen's for longer passes and for x, bias or
// scales in another dtype than the kernel takes.
static Tensor rows_or_aten(const Tensor& x, const Tensor& weight, const c10::optional<Tensor>& bias,
                           const c10::optional<Tensor>& scales) {
  const auto type = x.scalar_type();
  if (rows_call_takes(x.size(0), weight, bias, scales, type)) {
    const Tensor rows = weight.t();  // (out, in), contiguous
    switch (weight.scalar_type()) {
      case at::kFloat: return rows_product<float, float>(x, rows, scales, bias);
      case at::kBFloat16: return rows_product<at::BFloat16, at::BFloat16>(x, rows, scales, bias);
      case at::kHalf: return rows_product<at::Half, at::Half>(x, rows, scales, bias);
      case at::kChar:
        if (type == at::kFloat) return rows_product<float, int8_t>(x, rows, scales, bias);
        if (type == at::kBFloat16) return rows_product<at::BFloat16, int8_t>(x, rows, scales, bias);
        if (type == at::kHalf) return rows_product<at::Half, int8_t>(x, rows, scales, bias);
        break;
      default: break;
    }
  }
  return aten_product(x, weight, bias, scales);
}

// x (n, in) times a weight of `storage` (the tensors as fast_decode.linear takes them), plus bias.
static Tensor product_by(Storage storage, const Tensor& x, const Tensor& weight, const c10::optional<Tensor>& bias,
                         const c10::optional<Tensor>& scales, const c10::optional<Tensor>& sums,
                         const c10::optional<block_rows::Prepared>& prepared) {
  switch (storage) {
    case Storage::integer_blocks: return block_rows::product(x, *prepared, bias);
    case Storage::int8_activations: return int8_activations_product(x, weight, bias, scales, *sums);
    case Storage::blocks: return blocks_product(x, weight, bias);
    case Storage::q4_0: return q4_product(x, weight, bias, scales);
    case Storage::rows: return rows_or_aten(x, weight, bias, scales);
    case Storage::aten: break;
  }
  return aten_product(x, weight, bias, scales);
}

// A product with its weight's tensors given each call (tests, measure/kernels.py, engine/rows_kernel.py's
// drafter products): the same entry of the table as that weight loaded.
static Tensor product(const Tensor& x, const Tensor& weight, const c10::optional<Tensor>& bias,
                      const c10::optional<Tensor>& scales = c10::nullopt,
                      const c10::optional<Tensor>& sums = c10::nullopt) {
  return product_by(storage_of(weight, scales, sums, false).storage, x, weight, bias, scales, sums, c10::nullopt);
}

// The rows kernel that runs ("avx512", "avx2" or "portable"), and the ones this build has; choosing a
// narrower one than this CPU's is for tests and measure/kernels.py.
std::string rows_kernel() { return rows_kernel_in_use; }

std::vector<std::string> rows_kernels_built() { return rows_kernels; }

void use_rows_kernel(const std::string& name) {
  TORCH_CHECK(std::find(rows_kernels.begin(), rows_kernels.end(), name) != rows_kernels.end(), "no rows kernel ",
              name, " in this build (it has ", c10::Join(", ", rows_kernels), ")");
  rows_kernel_in_use = name;
}

// A product's weight as fast_decode.linear takes it, (in, out): float values, or int8 values
// (engine/quantized.py's Int8Weight transposed) with their per-output scales (out,), and for int8
// activations (W8A8Weight) the values' row sums; or Q4Weight's codes and block scales.
struct Weight {
  Tensor values;  // (in, out), a transposed view of an (out, in) buffer for the rows kernel; q4_0: codes; or ggml blocks (out, in / 32, bytes)
  c10::optional<Tensor> scales;  // (out,) for int8 values; q4_0: (out, blocks) float16; else none
  c10::optional<Tensor> sums;  // (out,) int32 for int8 activations, else none
  c10::optional<Tensor> down;  // a low-rank update's (in, rank) float32, a transposed view of (rank, in); or none
  c10::optional<Tensor> up;  // its (rank, out), a transposed view of (out, rank)
  // ggml blocks only: the blocks prepared for integer rows' kernel (fast_blocks.h), or none: float rows
  c10::optional<block_rows::Prepared> integer_rows;
  Recognised storage;  // its entry of the format table, found once here
};

// A Weight as Python makes it (engine/quantized.py native_weight): integer rows on anything but
// ggml blocks, or with a kernel this build lacks, are refused here, when the weight is loaded.
static Weight weight_of(Tensor values, c10::optional<Tensor> scales, c10::optional<Tensor> sums,
                        c10::optional<Tensor> down, c10::optional<Tensor> up, c10::optional<std::string> integer_rows) {
  c10::optional<block_rows::Prepared> prepared;
  if (integer_rows.has_value()) {
    TORCH_CHECK(!scales && !sums, "integer rows take a weight in ggml's blocks (engine/packed.py), without scales or sums");
    prepared = block_rows::prepare(values, *integer_rows);
  }
  const Recognised storage = storage_of(values, scales, sums, prepared.has_value());
  return Weight{values, scales, sums, down, up, prepared, storage};
}

// fast_decode.linear: x (n, in) times weight, plus bias.
static Tensor linear(const Tensor& x, const Weight& weight, const c10::optional<Tensor>& bias) {
  Tensor y = product_by(weight.storage.storage, x, weight.values, bias, weight.scales, weight.sums, weight.integer_rows);
  if (weight.down.has_value())  // plus (x down) up: two more products of the rows kernel, row by row
    y.add_(product(product(x, *weight.down, c10::nullopt), *weight.up, c10::nullopt));
  return y;
}

// One decoder layer's weights: fast_decode.Layer, field for field (the Python class builds it by
// its fields' names: fast_decode.FastStack.native_layers).
struct Layer {
  Tensor input_norm;  // (H,)
  Weight qkv_weight;  // (H, (heads + 2 kv_heads) D)
  c10::optional<Tensor> qkv_bias;  // ((heads + 2 kv_heads) D,)
  Weight o_weight;  // (heads D, H)
  c10::optional<Tensor> o_bias;  // (H,)
  Tensor post_norm;  // (H,)
  Weight gate_up_weight;  // (H, 2 I)
  Weight down_weight;  // (I, H)
};

// Whether `linear` sums each of n rows of x of `type` on its own, so that a row's bits do not depend
// on the rows beside it: the rows kernel, int8 activations', Q4_0's and ggml blocks' kernels (any
// number of rows, each row quantized on its own); not ATen's product.
static bool sums_rows_alone(const Weight& w, const c10::optional<Tensor>& bias, int64_t n, at::ScalarType type) {
  const Storage storage = w.storage.storage;
  const bool own_kernel = storage != Storage::rows && storage != Storage::aten;
  const bool update_alone = !w.down || (rows_kernel_takes(n, *w.down, c10::nullopt, c10::nullopt, type) &&
                                        rows_kernel_takes(n, *w.up, c10::nullopt, c10::nullopt, type));
  return (own_kernel || (storage == Storage::rows && rows_call_takes(n, w.values, bias, w.scales, type))) &&
         update_alone;
}

// Whether each of a layer's products sums each of n rows on its own.
static bool layer_sums_rows_alone(const Layer& w, int64_t n, at::ScalarType type) {
  return sums_rows_alone(w.qkv_weight, w.qkv_bias, n, type) && sums_rows_alone(w.o_weight, w.o_bias, n, type) &&
         sums_rows_alone(w.gate_up_weight, c10::nullopt, n, type) &&
         sums_rows_alone(w.down_weight, c10::nullopt, n, type);
}

// Whether a pass of n rows of x's dtype through these layers and the output layer (head, head_bias) sums
// every row of every product on its own: then several requests' rows can share one pass (stack_parts),
// each row's logits bitwise those of its request's own pass.
bool rows_alone(const std::vector<Layer>& layers, const Weight& head, const c10::optional<Tensor>& head_bias,
                int64_t n, const Tensor& x) {
  const auto type = x.scalar_type();
  return sums_rows_alone(head, head_bias, n, type) &&
         std::all_of(layers.begin(), layers.end(), [&](const Layer& w) { return layer_sums_rows_alone(w, n, type); });
}

// One request's rows in a pass (stack_parts): rows first .. first + n - 1 of the pass, at slots
// start .. start + n - 1 of its own cache layer, keys / values float (1, kv_heads, capacity, D),
// under its own mask: undefined (every slot visible), or (n, start + n) bool or additive float.
struct Part {
  Tensor keys, values;
  int64_t start, first, n;
  Tensor mask;
};

// Float value as T holds it (rounding to 16 bits where T is a 16-bit type).
template <typename T>
static inline float rounded(float value) { return static_cast<float>(static_cast<T>(value)); }

// x (n, H) of T, weight (H,): fast_decode.rms_norm's arithmetic (float32; for 16-bit types the
// normed value is rounded to T, then scaled and rounded again).
template <typename T>
static Tensor rms_norm_rows(const Tensor& x, const Tensor& weight, double eps) {
  const int64_t n = x.size(0), width = x.size(1);
  Tensor out = at::empty_like(x);
  const T* in = x.data_ptr<T>();
  const T* w = weight.data_ptr<T>();
  T* o = out.data_ptr<T>();
  for (int64_t r = 0; r < n; ++r) {
    const T* row = in + r * width;
    T* out_row = o + r * width;
    float squares = 0.f;
#pragma omp simd reduction(+ : squares)
    for (int64_t i = 0; i < width; ++i) squares += static_cast<float>(row[i]) * static_cast<float>(row[i]);
    const float inverse = 1.f / std::sqrt(squares / static_cast<float>(width) + static_cast<float>(eps));
    for (int64_t i = 0; i < width; ++i) {
      if constexpr (std::is_same_v<T, float>) {
        out_row[i] = row[i] * inverse * w[i];
      } else {
        out_row[i] = static_cast<T>(static_cast<float>(w[i]) * rounded<T>(static_cast<float>(row[i]) * inverse));
      }
    }
  }
  return out;
}

// One query row's attention over slots 0 .. end - 1 of one kv head's keys / values (capacity, D):
// allowed / added are the row's mask (or null), weights a buffer of end floats; writes o (D).
// Slots the mask hides (or whose weight's exp is 0) add nothing; every other slot's terms come in
// slot order, so a row's result is the same whatever slots after its own a pass holds: a verify
// pass gives each row its decode pass's bits.
static void attend_row(const float* q, const float* k, const float* v, int64_t end, const bool* allowed,
                       const float* added, float scaling, int64_t D, float* weights, float* o) {
  float top = -INFINITY;
  for (int64_t s = 0; s < end; ++s) {
    if (allowed && !allowed[s]) {
      weights[s] = -INFINITY;
      continue;
    }
    float dot = 0.f;
#pragma omp simd reduction(+ : dot)
    for (int64_t d = 0; d < D; ++d) dot += q[d] * k[s * D + d];
    weights[s] = dot * scaling + (added ? added[s] : 0.f);
    top = std::max(top, weights[s]);
  }
  float total = 0.f;
  std::fill(o, o + D, 0.f);
  for (int64_t s = 0; s < end; ++s) {
    const float weight = weights[s] == -INFINITY ? 0.f : std::exp(weights[s] - top);
    total += weight;
    if (weight == 0.f) continue;
#pragma omp simd
    for (int64_t d = 0; d < D; ++d) o[d] += weight * v[s * D + d];
  }
  const float inverse = 1.f / total;
  for (int64_t d = 0; d < D; ++d) o[d] *= inverse;
}

// Attention rows and SiLU's exp in 16 lanes (attend_row_lanes, exp_lanes) where this build has
// them; tests and measurements turn them off to compare with the loops (attend_row, std::exp).
static bool use_lanes_math = true;

#ifdef HAVE_AVX512_LANES
// e^x for 16 floats, -inf and anything under -87.3 giving 0 (attention: a score minus the row's
// largest; SiLU: minus a gate): x = n ln 2 + r, |r| <= ln 2 / 2, e^r by its degree-7 Taylor
// polynomial (Horner, each step one fused multiply-add), times 2^n. Within about 1 ulp of
// std::exp, not its bits; the same bits every time.
static inline __m512 exp_lanes(__m512 x) {
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.f / 5040.f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 720.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 120.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 24.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 6.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  const __mmask16 kept = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.3f), _CMP_GE_OQ);
  return _mm512_maskz_mov_ps(kept, _mm512_scalef_ps(p, n));
}

// Lane j of the result: the sum of vectors[j]'s 16 lanes (halves added pairwise, the same tree
// for every j): 16 dot products' horizontal sums in 15 adds of two shuffles each.
static inline __m512 sum_each(const __m512 vectors[16]) {
  __m512 a[8], b[4], c[2];
  for (int i = 0; i < 8; ++i) {  // 256-bit halves: lanes 0-7 from vector j, 8-15 from vector j + 4
    const int j = i < 4 ? i : i + 4;
    a[i] = _mm512_add_ps(_mm512_shuffle_f32x4(vectors[j], vectors[j + 4], 0x44),   // low halves
                         _mm512_shuffle_f32x4(vectors[j], vectors[j + 4], 0xEE));  // high halves
  }
  for (int i = 0; i < 4; ++i)  // 128-bit quarters: vectors i, i + 4, i + 8, i + 12
    b[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a[i], a[i + 4], 0x88), _mm512_shuffle_f32x4(a[i], a[i + 4], 0xDD));
  for (int i = 0; i < 2; ++i) {  // 64-bit pairs: in each quarter, two of b[2i]'s then two of b[2i + 1]'s
    const __m512d low = _mm512_castps_pd(b[2 * i]), high = _mm512_castps_pd(b[2 * i + 1]);
    c[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(low, high)),
                         _mm512_castpd_ps(_mm512_unpackhi_pd(low, high)));
  }
  return _mm512_add_ps(_mm512_shuffle_ps(c[0], c[1], 0x88), _mm512_shuffle_ps(c[0], c[1], 0xDD));
}

// attend_row for D a multiple of 16, in 16 lanes: the scores 16 slots at a time (each slot's dot
// product lane by lane over D, then `sum_each`), their exp 16 at a time (`exp_lanes`), the values
// in slot order. The total of the weights is summed over the row's nonzero weights alone, packed
// in slot order (`_mm512_mask_compressstoreu_ps`): the i-th nonzero weight sits in lane i % 16,
// whatever slot it came from. A tree node's row (its path's slots scattered among other branches'
// hidden ones) therefore adds its weights in the same lanes as its path's decode row, where the
// same slots are contiguous; so does a verify row whatever slots after its own the pass holds.
static void attend_row_lanes(const float* q, const float* k, const float* v, int64_t end, const bool* allowed,
                             const float* added, float scaling, int64_t D, float* weights, float* o) {
  const int64_t chunks = D / 16;
  __m512 top = _mm512_set1_ps(-INFINITY);
  for (int64_t first = 0; first < end; first += 16) {
    const int64_t count = std::min<int64_t>(16, end - first);
    __m512 dots[16];
    for (int64_t j = 0; j < 16; ++j) {
      dots[j] = _mm512_setzero_ps();
      if (j >= count) continue;
      const float* key = k + (first + j) * D;
      for (int64_t c = 0; c < chunks; ++c)
        dots[j] = _mm512_fmadd_ps(_mm512_loadu_ps(q + 16 * c), _mm512_loadu_ps(key + 16 * c), dots[j]);
    }
    const __mmask16 live = static_cast<__mmask16>((1u << count) - 1u);
    __m512 scores = _mm512_mul_ps(sum_each(dots), _mm512_set1_ps(scaling));
    if (added) scores = _mm512_add_ps(scores, _mm512_maskz_loadu_ps(live, added + first));
    __mmask16 visible = live;
    if (allowed)
      for (int64_t j = 0; j < count; ++j)
        if (!allowed[first + j]) visible &= static_cast<__mmask16>(~(1u << j));
    scores = _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), visible, scores);
    _mm512_mask_storeu_ps(weights + first, live, scores);
    top = _mm512_max_ps(top, scores);
  }
  const __m512 largest = _mm512_set1_ps(_mm512_reduce_max_ps(top));
  __m512 totals = _mm512_setzero_ps();
  __m512 pending = _mm512_setzero_ps();  // the nonzero weights not yet added, in lanes 0 .. kept - 1
  int kept = 0;
  for (int64_t first = 0; first < end; first += 16) {
    const __mmask16 live = static_cast<__mmask16>((1u << std::min<int64_t>(16, end - first)) - 1u);
    const __m512 e = _mm512_maskz_mov_ps(live, exp_lanes(_mm512_sub_ps(_mm512_maskz_loadu_ps(live, weights + first),
                                                                        largest)));
    _mm512_mask_storeu_ps(weights + first, live, e);
    // Append this chunk's nonzero weights after the pending ones; each full 16 goes to the totals.
    const __mmask16 nonzero = _mm512_cmp_ps_mask(e, _mm512_setzero_ps(), _CMP_NEQ_OQ);
    alignas(64) float packed[32];
    _mm512_store_ps(packed, pending);
    _mm512_mask_compressstoreu_ps(packed + kept, nonzero, e);
    kept += __builtin_popcount(nonzero);
    if (kept >= 16) {
      totals = _mm512_add_ps(totals, _mm512_load_ps(packed));
      kept -= 16;
      pending = _mm512_maskz_loadu_ps(static_cast<__mmask16>((1u << kept) - 1u), packed + 16);
    } else {
      pending = _mm512_load_ps(packed);
    }
  }
  totals = _mm512_add_ps(totals, _mm512_maskz_mov_ps(static_cast<__mmask16>((1u << kept) - 1u), pending));
  __m512 out[8];  // D <= 128 in registers; wider heads go through o
  const bool in_registers = chunks <= 8;
  for (int64_t c = 0; c < chunks; ++c) {
    if (in_registers) out[c] = _mm512_setzero_ps();
    else _mm512_storeu_ps(o + 16 * c, _mm512_setzero_ps());
  }
  for (int64_t s = 0; s < end; ++s) {
    if (weights[s] == 0.f) continue;
    const __m512 weight = _mm512_set1_ps(weights[s]);
    const float* value = v + s * D;
    for (int64_t c = 0; c < chunks; ++c) {
      if (in_registers) out[c] = _mm512_fmadd_ps(weight, _mm512_loadu_ps(value + 16 * c), out[c]);
      else _mm512_storeu_ps(o + 16 * c, _mm512_fmadd_ps(weight, _mm512_loadu_ps(value + 16 * c),
                                                        _mm512_loadu_ps(o + 16 * c)));
    }
  }
  const __m512 inverse = _mm512_set1_ps(1.f / Avx512Lanes::sum(totals));
  for (int64_t c = 0; c < chunks; ++c)
    _mm512_storeu_ps(o + 16 * c, _mm512_mul_ps(in_registers ? out[c] : _mm512_loadu_ps(o + 16 * c), inverse));
}
#endif

// Attention of queries (heads, n, D) over cache slots 0 .. end - 1 of keys / values
// (kv_heads, capacity, D), all float; mask: undefined (every slot visible), bool (n, end), True =
// attend, or additive float (n, end). Query head h reads kv head h / (heads / kv_heads) (SDPA's
// enable_gqa). Writes out (n, heads * D). Rows and heads run in parallel when the context is long.
static void attend(const float* queries, const float* keys, const float* values, int64_t capacity, int64_t n,
                   int64_t end, const Tensor& mask, int64_t heads, int64_t kv_heads, int64_t head_dim, float scaling,
                   float* out) {
  const int64_t group = heads / kv_heads, D = head_dim;
  const bool* allowed = mask.defined() && mask.scalar_type() == at::kBool ? mask.data_ptr<bool>() : nullptr;
  const float* added = mask.defined() && mask.scalar_type() == at::kFloat ? mask.data_ptr<float>() : nullptr;
  const int64_t grain = std::max<int64_t>(1, (1 << 16) / std::max<int64_t>(1, 2 * end * D));
  at::parallel_for(0, heads * n, grain, [&](int64_t first, int64_t last) {
    std::vector<float> weights(end);
    for (int64_t pair = first; pair < last; ++pair) {
      const int64_t h = pair / n, t = pair % n;
      const float* q = queries + (h * n + t) * D;
      const float* k = keys + (h / group) * capacity * D;
      const float* v = values + (h / group) * capacity * D;
      const bool* row_allowed = allowed ? allowed + t * end : nullptr;
      const float* row_added = added ? added + t * end : nullptr;
      float* o = out + t * heads * D + h * D;
#ifdef HAVE_AVX512_LANES
      if (D % 16 == 0 && use_lanes_math) {
        attend_row_lanes(q, k, v, end, row_allowed, row_added, scaling, D, weights.data(), o);
        continue;
      }
#endif
      attend_row(q, k, v, end, row_allowed, row_added, scaling, D, weights.data(), o);
    }
  });
}

// gate_up (n, 2 I) of T: silu(gate) * up, (n, I), each rounded to T as ATen's silu and mul round.
template <typename T>
static Tensor silu_times_up(const Tensor& gate_up) {
  const int64_t n = gate_up.size(0), width = gate_up.size(1) / 2;
  Tensor out = at::empty({n, width}, gate_up.options());
  const T* in = gate_up.data_ptr<T>();
  T* o = out.data_ptr<T>();
  std::vector<float> negated_exp(width);  // exp(-gate) of a row
  for (int64_t r = 0; r < n; ++r) {
    const T* gates = in + r * 2 * width;
    int64_t i = 0;
#ifdef HAVE_AVX512_LANES
    if (use_lanes_math)
      for (; i + 16 <= width; i += 16) {
        float sixteen[16];
        for (int j = 0; j < 16; ++j) sixteen[j] = -static_cast<float>(gates[i + j]);
        _mm512_storeu_ps(negated_exp.data() + i, exp_lanes(_mm512_loadu_ps(sixteen)));
      }
#endif
    for (; i < width; ++i) negated_exp[i] = std::exp(-static_cast<float>(gates[i]));
    for (i = 0; i < width; ++i) {
      const float gate = gates[i], up = gates[width + i];
      o[r * width + i] = static_cast<T>(rounded<T>(gate / (1.f + negated_exp[i])) * up);
    }
  }
  return out;
}

// y += x in place (both (n, H) of T), rounded to T: the residual connection.
template <typename T>
static Tensor add_residual(Tensor y, const Tensor& x) {
  T* out = y.data_ptr<T>();
  const T* in = x.data_ptr<T>();
  const int64_t size = y.numel();
  for (int64_t i = 0; i < size; ++i) out[i] = static_cast<T>(static_cast<float>(out[i]) + static_cast<float>(in[i]));
  return y;
}

// A llama-style layer's attention and MLP over `input` (n, width), the normed rows q, k and v read;
// each part's rows at its slots of its own cache layer (a pass over one request: one part, all its
// rows); the attention's output joins `residual` (n, H) of T. fast_decode.decoder_layer's
// arithmetic, step for step, after its input norm: the products over all rows, the rotary, cache
// writes and attention per part.
template <typename T>
static Tensor attention_and_mlp(const Tensor& input, const Tensor& residual, const Layer& w, const Tensor& cos,
                                const Tensor& signed_sin, const std::vector<Part>& parts, int64_t heads,
                                int64_t kv_heads, int64_t head_dim, double scaling, double eps) {
  const int64_t n = input.size(0);
  Tensor qkv = linear(input, w.qkv_weight, w.qkv_bias);  // (n, q + 2 kv)
  Tensor attended = at::empty({n, heads * head_dim}, parts.front().keys.options());
  for (const Part& part : parts) {
    Tensor keys = part.keys, values = part.values;
    Tensor queries = at::empty({1, heads, part.n, head_dim}, keys.options());
    rotate_and_write<T>(qkv.narrow(0, part.first, part.n), cos.narrow(0, part.first, part.n),
                        signed_sin.narrow(0, part.first, part.n), queries, keys, values, part.start, heads, kv_heads,
                        head_dim);
    attend(queries.data_ptr<float>(), keys.data_ptr<float>(), values.data_ptr<float>(), keys.size(2), part.n,
           part.start + part.n, part.mask, heads, kv_heads, head_dim, static_cast<float>(scaling),
           attended.data_ptr<float>() + part.first * heads * head_dim);
  }
  Tensor h = add_residual<T>(linear(attended.to(residual.scalar_type()), w.o_weight, w.o_bias), residual);
  Tensor gate_up = linear(rms_norm_rows<T>(h, w.post_norm, eps), w.gate_up_weight, c10::nullopt);  // (n, 2 I)
  return add_residual<T>(linear(silu_times_up<T>(gate_up), w.down_weight, c10::nullopt), h);
}

// One decoder layer over x (n, H) of T, each part's rows at its slots of its own cache layer:
// fast_decode.decoder_layer's arithmetic, step for step.
template <typename T>
static Tensor fused_layer(const Tensor& x, const Layer& w, const Tensor& cos, const Tensor& signed_sin,
                          const std::vector<Part>& parts, int64_t heads, int64_t kv_heads, int64_t head_dim,
                          double scaling, double eps) {
  return attention_and_mlp<T>(rms_norm_rows<T>(x, w.input_norm, eps), x, w, cos, signed_sin, parts, heads, kv_heads,
                              head_dim, scaling, eps);
}

// Every layer of a pass over several requests' rows: x (n, H) of float32, bfloat16 or float16, part p
// its rows rows_of[p] after those of the parts before it, at slots starts[p] .. of its own cache,
// keys[p][i] / values[p][i] float32 (1, kv_heads, capacity, D), contiguous, for layer i (layers[i]
// its weights); cos, signed_sin (n, 1, D) contiguous (fast_decode.RotaryTable), each row's own;
// masks[p]: None (every slot visible) or (1, 1, rows, start + rows), bool (True = attend) or
// additive float32. Several parts only where every product sums each row alone (`rows_alone`): each
// part's rows are then bitwise its own pass's. Anything else is refused (fast_decode.FastStack runs
// the Python layer for it). Returns {the last layer's output, then the output of layer i for each i in keep}.
std::vector<Tensor> stack_parts(Tensor x, const std::vector<Layer>& layers, const Tensor& cos,
                                const Tensor& signed_sin, const std::vector<std::vector<Tensor>>& keys,
                                const std::vector<std::vector<Tensor>>& values, const std::vector<int64_t>& starts,
                                const std::vector<int64_t>& rows_of, const std::vector<c10::optional<Tensor>>& masks,
                                int64_t heads, int64_t kv_heads, int64_t head_dim, double scaling, double eps,
                                const std::vector<int64_t>& keep) {
  const int64_t n = x.size(0);
  const size_t num_parts = starts.size();
  const auto type = x.scalar_type();
  TORCH_CHECK(type == at::kFloat || type == at::kBFloat16 || type == at::kHalf,
              "the compiled stack takes float32, bfloat16 or float16 activations, not ", type);
  TORCH_CHECK(num_parts > 0 && keys.size() == num_parts && values.size() == num_parts && rows_of.size() == num_parts &&
                  masks.size() == num_parts, "a cache, a start, a number of rows and a mask for each part");
  TORCH_CHECK(cos.is_contiguous() && signed_sin.is_contiguous(), "cos and signed_sin must be contiguous");
  std::vector<std::vector<Part>> parts(layers.size());  // parts[i]: layer i's
  int64_t first = 0;
  for (size_t p = 0; p < num_parts; ++p) {
    const int64_t rows = rows_of[p], start = starts[p];
    const auto& mask = masks[p];
    TORCH_CHECK(!mask.has_value() || mask->scalar_type() == at::kBool || mask->scalar_type() == at::kFloat,
                "the mask must be bool or float32, not ", mask.has_value() ? mask->scalar_type() : at::kBool);
    const Tensor rows_mask = mask.has_value() ? mask->reshape({rows, start + rows}).contiguous() : Tensor();
    for (size_t i = 0; i < layers.size(); ++i) {
      TORCH_CHECK(keys[p][i].scalar_type() == at::kFloat && keys[p][i].is_contiguous() && values[p][i].is_contiguous(),
                  "the compiled stack takes a contiguous float32 cache (static_cache.attention_dtype)");
      parts[i].push_back(Part{keys[p][i], values[p][i], start, first, rows, rows_mask});
    }
    first += rows;
  }
  TORCH_CHECK(first == n, "the parts have ", first, " rows, x ", n);
  TORCH_CHECK(num_parts == 1 || std::all_of(layers.begin(), layers.end(), [&](const Layer& w) {
                return layer_sums_rows_alone(w, n, type);
              }), "a pass over several requests' rows takes products that sum each row alone (rows_alone): ", n,
              " rows here would run ATen's; pass each request alone");
  x = x.contiguous();
  std::vector<Tensor> out(1 + keep.size());
  for (size_t i = 0; i < layers.size(); ++i) {
    if (type == at::kFloat) {
      x = fused_layer<float>(x, layers[i], cos, signed_sin, parts[i], heads, kv_heads, head_dim, scaling, eps);
    } else if (type == at::kBFloat16) {
      x = fused_layer<at::BFloat16>(x, layers[i], cos, signed_sin, parts[i], heads, kv_heads, head_dim, scaling, eps);
    } else {
      x = fused_layer<at::Half>(x, layers[i], cos, signed_sin, parts[i], heads, kv_heads, head_dim, scaling, eps);
    }
    for (size_t j = 0; j < keep.size(); ++j)
      if (keep[j] == static_cast<int64_t>(i) + 1) out[1 + j] = x;
  }
  out[0] = x;
  return out;
}

// Every layer of one request's pass: stack_parts with one part, x (n, H) at slots start .. start + n - 1
// of keys[i] / values[i]; mask: None or (1, 1, n, start + n).
std::vector<Tensor> stack(Tensor x, const std::vector<Layer>& layers, const Tensor& cos, const Tensor& signed_sin,
                          std::vector<Tensor> keys, std::vector<Tensor> values, int64_t start,
                          const c10::optional<Tensor>& mask, int64_t heads, int64_t kv_heads, int64_t head_dim,
                          double scaling, double eps, const std::vector<int64_t>& keep) {
  return stack_parts(x, layers, cos, signed_sin, {keys}, {values}, {start}, {x.size(0)}, {mask}, heads, kv_heads,
                     head_dim, scaling, eps, keep);
}

// EAGLE-3's layer over rows of T: its two input norms, then attention_and_mlp with its own residual.
template <typename T>
static Tensor eagle3_rows(const Tensor& embeds, const Tensor& hidden, const Tensor& hidden_norm, const Layer& layer,
                          const Tensor& cos, const Tensor& signed_sin, Tensor& keys, Tensor& values, int64_t start,
                          const Tensor& mask, int64_t heads, int64_t kv_heads, int64_t head_dim, double scaling,
                          double eps, bool normed_residual) {
  const Tensor normed = rms_norm_rows<T>(hidden, hidden_norm, eps);
  const Tensor input = at::cat({rms_norm_rows<T>(embeds, layer.input_norm, eps), normed}, 1);  // (n, 2 H)
  return attention_and_mlp<T>(input, normed_residual ? normed : hidden, layer, cos, signed_sin,
                              {Part{keys, values, start, 0, embeds.size(0), mask}}, heads, kv_heads, head_dim, scaling,
                              eps);
}

// EAGLE-3's layer (models/eagle3.py Eagle3.forward) over embeds and hidden (n, H) of T at slots start
// .. start + n - 1 of one float32 cache layer (1, kv_heads, capacity, D): q, k and v read
// [layer.input_norm(embeds), hidden_norm(hidden)] (n, 2 H), the residual is hidden (or its normed
// rows where normed_residual); then the layer's MLP. mask: None (every slot visible) or (1, 1, n,
// start + n), bool or additive float32. Returns the layer's output h (n, H), before the final norm.
Tensor eagle3_layer(const Tensor& embeds, const Tensor& hidden, const Tensor& hidden_norm, const Layer& layer,
                    const Tensor& cos, const Tensor& signed_sin, Tensor keys, Tensor values, int64_t start,
                    const c10::optional<Tensor>& mask, int64_t heads, int64_t kv_heads, int64_t head_dim,
                    double scaling, double eps, bool normed_residual) {
  const int64_t n = embeds.size(0);
  const auto type = embeds.scalar_type();
  TORCH_CHECK(hidden.scalar_type() == type && (type == at::kFloat || type == at::kBFloat16),
              "the compiled EAGLE-3 layer takes float32 or bfloat16 embeds and hidden rows of one dtype");
  TORCH_CHECK(keys.scalar_type() == at::kFloat && keys.is_contiguous() && values.is_contiguous(),
              "the compiled EAGLE-3 layer takes a contiguous float32 cache");
  TORCH_CHECK(cos.is_contiguous() && signed_sin.is_contiguous(), "cos and signed_sin must be contiguous");
  TORCH_CHECK(!mask.has_value() || mask->scalar_type() == at::kBool || mask->scalar_type() == at::kFloat,
              "the mask must be bool or float32");
  const Tensor rows_mask = mask.has_value() ? mask->reshape({n, start + n}).contiguous() : Tensor();
  const auto rows = type == at::kFloat ? &eagle3_rows<float> : &eagle3_rows<at::BFloat16>;
  return rows(embeds.contiguous(), hidden.contiguous(), hidden_norm, layer, cos, signed_sin, keys, values, start,
              rows_mask, heads, kv_heads, head_dim, scaling, eps, normed_residual);
}

// fast_decode.rms_norm over x (n, H) (the final norm), in the same loop as the layers'.
Tensor rms_norm(const Tensor& x, const Tensor& weight, double eps) {
  const Tensor rows = x.contiguous();
  switch (x.scalar_type()) {
    case at::kFloat: return rms_norm_rows<float>(rows, weight, eps);
    case at::kBFloat16: return rms_norm_rows<at::BFloat16>(rows, weight, eps);
    case at::kHalf: return rms_norm_rows<at::Half>(rows, weight, eps);
    default: TORCH_CHECK(false, "rms_norm takes float32, bfloat16 or float16, not ", x.scalar_type());
  }
}

// The output layer: logits (num_logits, V) of the last num_logits rows of x (n, H), after the
// final norm; weight (H, V) as `stack` takes its weights.
Tensor logits(const Tensor& x, const Tensor& norm, const Weight& weight, const c10::optional<Tensor>& bias, double eps,
              int64_t num_logits) {
  return linear(rms_norm(x.narrow(0, x.size(0) - num_logits, num_logits), norm, eps), weight, bias);
}

// The embedding rows (n, H) of token_ids (n,): a lookup.
Tensor embed(const Tensor& weight, const std::vector<int64_t>& token_ids) {
  const int64_t n = static_cast<int64_t>(token_ids.size()), width = weight.size(1), rows = weight.size(0);
  Tensor x = at::empty({n, width}, weight.options());
  const int64_t bytes = width * weight.element_size();
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK(token_ids[i] >= 0 && token_ids[i] < rows, "token id ", token_ids[i], " outside the vocabulary");
    std::memcpy(static_cast<char*>(x.data_ptr()) + i * bytes,
                static_cast<const char*>(weight.data_ptr()) + token_ids[i] * weight.stride(0) * weight.element_size(),
                bytes);
  }
  return x;
}

// The index of each row's largest value, the first of equals (torch.argmax's answer on rows
// without NaN): logits (n, V) float32, contiguous. ATen's argmax over SmolLM2's 49,152 logits takes
// about 80 us on this machine's CPUs, its max 7; greedy decoding asks once a token, a drafter once
// a draft token.
std::vector<int64_t> argmax_rows(const Tensor& logits) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.is_contiguous(),
              "argmax_rows takes contiguous float32 (n, V) logits");
  const int64_t n = logits.size(0), V = logits.size(1);
  TORCH_CHECK(V > 0, "argmax_rows takes at least one column");
  std::vector<int64_t> best(n);
  for (int64_t r = 0; r < n; ++r) {
    const float* row = logits.data_ptr<float>() + r * V;
    int64_t index = 0;
    float top = row[0];
    int64_t i = 0;
#ifdef HAVE_AVX512_LANES
    if (V >= 16) {  // each lane's first largest, then the largest of the lanes with the smallest index
      __m512 values = _mm512_loadu_ps(row);
      __m512i indices = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
      __m512i at = indices;
      for (i = 16; i + 16 <= V; i += 16) {
        at = _mm512_add_epi32(at, _mm512_set1_epi32(16));
        const __m512 next = _mm512_loadu_ps(row + i);
        const __mmask16 larger = _mm512_cmp_ps_mask(next, values, _CMP_GT_OQ);
        values = _mm512_mask_mov_ps(values, larger, next);
        indices = _mm512_mask_mov_epi32(indices, larger, at);
      }
      float lane_values[16];
      int32_t lane_indices[16];
      _mm512_storeu_ps(lane_values, values);
      _mm512_storeu_si512(lane_indices, indices);
      top = lane_values[0], index = lane_indices[0];
      for (int j = 1; j < 16; ++j)
        if (lane_values[j] > top || (lane_values[j] == top && lane_indices[j] < index))
          top = lane_values[j], index = lane_indices[j];
    }
#endif
    for (; i < V; ++i)
      if (row[i] > top) top = row[i], index = i;
    best[r] = index;
  }
  return best;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  namespace py = pybind11;
  py::class_<Weight>(m, "Weight")
      .def(py::init(&weight_of), py::arg("values"), py::arg("scales") = c10::nullopt, py::arg("sums") = c10::nullopt,
           py::arg("down") = c10::nullopt, py::arg("up") = c10::nullopt, py::arg("integer_rows") = c10::nullopt)
      .def_property_readonly("storage", [](const Weight& w) { return w.storage.name; })
      .def_property_readonly("integer_rows", [](const Weight& w) {
        return w.integer_rows ? c10::optional<std::string>(w.integer_rows->name) : c10::nullopt;
      });
  py::class_<Layer>(m, "Layer")
      .def(py::init<Tensor, Weight, c10::optional<Tensor>, Weight, c10::optional<Tensor>, Tensor, Weight, Weight>(),
           py::arg("input_norm"), py::arg("qkv_weight"), py::arg("qkv_bias"), py::arg("o_weight"), py::arg("o_bias"),
           py::arg("post_norm"), py::arg("gate_up_weight"), py::arg("down_weight"))
      .def_readonly("qkv_weight", &Layer::qkv_weight)
      .def_readonly("o_weight", &Layer::o_weight)
      .def_readonly("gate_up_weight", &Layer::gate_up_weight)
      .def_readonly("down_weight", &Layer::down_weight);
  m.def("embed", &embed);
  m.def("stack", &stack);
  m.def("stack_parts", &stack_parts);
  m.def("rows_alone", &rows_alone);
  m.def("eagle3_layer", &eagle3_layer);
  m.def("rms_norm", &rms_norm);
  m.def("logits", &logits);
  m.attr("rows_kernel_max") = ROWS_KERNEL_MAX;
  m.def("rows_kernel", &rows_kernel);
  m.def("use_rows_kernel", &use_rows_kernel);
  m.def("use_lanes_math", [](bool on) { use_lanes_math = on; });
  m.def("argmax_rows", &argmax_rows);
  m.def("rows_kernels_built", &rows_kernels_built);
  m.def("product", &product, pybind11::arg("x"), pybind11::arg("weight"), pybind11::arg("bias"),
        pybind11::arg("scales") = c10::nullopt, pybind11::arg("sums") = c10::nullopt);
  // int8 activations' kernel (engine/fast_int8.h; w8a8 and q4_0): the one in use, the built ones, choosing one
  // (tests), and why the VNNI one is not in use ("" when it is)
  m.def("int8_kernel", [] { return int8_rows::in_use; });
  m.def("int8_kernels_built", [] { return int8_rows::built; });
  m.def("use_int8_kernel", &int8_rows::use);
  m.def("int8_fallback_reason", &int8_rows::fallback_reason);
  // integer rows on ggml blocks (engine/fast_blocks.h): the product with its kernel named ("" the widest), the built ones
  m.def(
      "integer_rows_product",
      [](const Tensor& x, const Tensor& blocks, const c10::optional<Tensor>& bias, const std::string& kernel) {
        return block_rows::product(x, block_rows::prepare(blocks, kernel), bias);
      },
      py::arg("x"), py::arg("blocks"), py::arg("bias") = c10::nullopt, py::arg("kernel") = "");
  m.def("integer_rows_kernels_built", [] { return block_rows::built; });
}
