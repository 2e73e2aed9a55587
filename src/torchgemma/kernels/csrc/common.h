// Weight-only quantized matrix products on the CPU: float32 activations times grouped integer weights.
//
// A quantized weight W (N rows of K values) is stored as integers q with one scale per group of G
// consecutive values of a row, and optionally one offset ("min") per group:
//
//     W[n, k] = scales[n, k / G] * q[n, k] + mins[n, k / G]
//
// Scales and mins are float32 or float16 (the same for both; float16 where the values are exactly
// those of a float16 field, e.g. GGML's block scales: half the bytes); either way a product takes
// them as float32.
//
// bits 8: q is int8, (N, K).  bits 4: q is unsigned 0..15, two per byte, (N, K / 2); within each 32
// values of a row, byte j holds value j in its low nibble and value j + 16 in its high nibble (the
// layout of GGML's Q4 blocks, so that one 16-byte load and two masks give 32 values in order).
// bits 5: q is unsigned 0..31, 20 bytes per 32 values, (N, K / 32 * 20): the 4-bit layout's 16 bytes
// of low nibbles, then 4 bytes whose bit j (little-endian) is bit 4 of value j (GGML's Q5 "qh").
//
// This header: what every family of kernels shares (the layout's checks and unpacking, scale loads,
// the activations' integer rounding). Each kernel source (qlinear.cpp, int_products.cpp,
// greedy_head.cpp, norms_rope.cpp, decode_attention.cpp) is compiled once per instruction set
// (build.py compiles variant.cpp, which includes them all, for portable, AVX2 and AVX-512) with
// -DTG_ISA=<that set's name>, so all of it, this header's inline helpers included, lives in
// namespace torchgemma::<set>: the three builds of a helper never stand in for one another at link
// time. registration.cpp picks one set at run time. Schemas, fakes and pure-PyTorch references:
// torchgemma/kernels/ops.py.

#pragma once

#ifndef TG_ISA
#error "compile with -DTG_ISA=portable|avx2|avx512 (torchgemma/kernels/build.py)"
#endif

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <tuple>
#include <type_traits>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define TG_AVX2 1
// Built for a CPU with AVX-512: the products take 16 values per instruction where the sums allow it,
// in exactly the AVX2 code's order (lanes 0-7 and 8-15 of a 512-bit accumulator are its two 256-bit
// chains), so both builds give the same bits.
#if defined(__AVX512F__)
#define TG_AVX512 1
#endif
#endif

#include "ops.h"

namespace torchgemma::TG_ISA {

// body(begin, end) over [0, n) in tasks of `task` items. at::parallel_for gives each thread an equal
// share up front, so a thread the OS takes off its core (a server's event loop, a client on the same
// cores) holds the others at the end of the call for its whole share; here each thread takes the
// tasks of its own share in order from a counter, and then those left in the others' shares. A
// thread's tasks are thus one run of memory while the threads keep up, which the hardware
// prefetches as a stream: tasks handed out in turn from one counter restart each thread's streams
// at every task (the 270M's greedy head at two threads: 7.4-8.2 ms in tasks of 64 rows taken in
// turn, 5.4-5.9 in tasks of 512 rows and more, 5.1 in these shares). Each item is computed by one
// task whatever thread runs it: the same bits as one thread.
template <typename F>
void parallel_tasks(int64_t n, int64_t task, const F& body) {
  if (n <= 0) return;
  task = std::max<int64_t>(1, task);
  const int64_t tasks = (n + task - 1) / task;
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), tasks);
  if (threads <= 1 || at::in_parallel_region()) {
    body(0, n);
    return;
  }
  const auto share_end = [&](int64_t s) { return (s + 1) * tasks / threads; };
  std::vector<std::atomic<int64_t>> next(threads);
  for (int64_t s = 0; s < threads; ++s) next[s].store(s * tasks / threads);
  at::parallel_for(0, threads, 1, [&](int64_t first, int64_t last) {
    for (int64_t self = first; self < last; ++self)
      for (int64_t k = 0; k < threads; ++k) {
        const int64_t s = (self + k) % threads;
        for (int64_t t = next[s].fetch_add(1); t < share_end(s); t = next[s].fetch_add(1))
          body(t * task, std::min(n, (t + 1) * task));
      }
  });
}

// body(n) for every n < count, the rows read as `streams` sequential streams side by side: row r of
// each of `streams` equal parts in turn (threads share r as parallel_tasks shares rows, tasks of
// `task`), then the last count % streams rows in order. One core keeps more of memory's bandwidth busy
// with a few streams than with one (greedy_head.cpp has the measurements).
template <typename F>
void parallel_streams(int64_t count, int64_t streams, int64_t task, const F& body) {
  const int64_t per = count / streams;
  parallel_tasks(per, task, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r)
      for (int64_t s = 0; s < streams; ++s) body(s * per + r);
  });
  for (int64_t n = streams * per; n < count; ++n) body(n);
}

// e^y from IEEE operations only (no fused multiply-add), so that every instruction set and a
// PyTorch reference give the same bits (ops.py's _exp_ieee): n = round(y log2 e) (ties to even),
// r = (y - n ln2_high) - n ln2_low, e^r = ((((((p0 r + p1) r + p2) r + p3) r + p4) r + p5) r^2 + r) +
// 1 (Cephes' expf polynomial, good to ~1 ulp), times 2^n built from its bits; y above kExpHigh gives
// infinity, below kExpLow 0, NaN itself. Scalar here; 8 and 16 lanes below (the same operations).
constexpr float kLog2e = 1.44269504088896341f;
constexpr float kLn2High = 0.693359375f, kLn2Low = -2.12194440e-4f;  // ln 2 in two parts: n * kLn2High exact
constexpr float kExpPoly[6] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f,
                               4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f};
constexpr float kExpHigh = 88.0f, kExpLow = -87.0f;  // e^y is infinite above, 0 below
inline float exp_ieee(float y) {
  if (std::isnan(y)) return y;
  if (y > kExpHigh) return std::numeric_limits<float>::infinity();
  if (y < kExpLow) return 0.f;
  const float n = std::nearbyint(y * kLog2e);
  const float r = (y - n * kLn2High) - n * kLn2Low;
  float p = kExpPoly[0];
  for (int i = 1; i < 6; ++i) p = p * r + kExpPoly[i];
  p = (p * (r * r) + r) + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

#ifdef TG_AVX2
inline __m256 exp_ieee(__m256 y) {
  const __m256 c = _mm256_min_ps(_mm256_max_ps(y, _mm256_set1_ps(kExpLow)), _mm256_set1_ps(kExpHigh));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(c, _mm256_set1_ps(kLog2e)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 r = _mm256_sub_ps(_mm256_sub_ps(c, _mm256_mul_ps(n, _mm256_set1_ps(kLn2High))),
                                 _mm256_mul_ps(n, _mm256_set1_ps(kLn2Low)));
  __m256 p = _mm256_set1_ps(kExpPoly[0]);
  for (int i = 1; i < 6; ++i) p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(kExpPoly[i]));
  p = _mm256_add_ps(_mm256_add_ps(_mm256_mul_ps(p, _mm256_mul_ps(r, r)), r), _mm256_set1_ps(1.0f));
  const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  __m256 e = _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
  e = _mm256_blendv_ps(e, _mm256_set1_ps(std::numeric_limits<float>::infinity()),
                       _mm256_cmp_ps(y, _mm256_set1_ps(kExpHigh), _CMP_GT_OQ));
  e = _mm256_blendv_ps(e, _mm256_setzero_ps(), _mm256_cmp_ps(y, _mm256_set1_ps(kExpLow), _CMP_LT_OQ));
  return _mm256_blendv_ps(e, y, _mm256_cmp_ps(y, y, _CMP_UNORD_Q));
}
#endif
#ifdef TG_AVX512
inline __m512 exp_ieee(__m512 y) {
  const __m512 c = _mm512_min_ps(_mm512_max_ps(y, _mm512_set1_ps(kExpLow)), _mm512_set1_ps(kExpHigh));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(c, _mm512_set1_ps(kLog2e)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 r = _mm512_sub_ps(_mm512_sub_ps(c, _mm512_mul_ps(n, _mm512_set1_ps(kLn2High))),
                                 _mm512_mul_ps(n, _mm512_set1_ps(kLn2Low)));
  __m512 p = _mm512_set1_ps(kExpPoly[0]);
  for (int i = 1; i < 6; ++i) p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(kExpPoly[i]));
  p = _mm512_add_ps(_mm512_add_ps(_mm512_mul_ps(p, _mm512_mul_ps(r, r)), r), _mm512_set1_ps(1.0f));
  const __m512i bits = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  __m512 e = _mm512_mul_ps(p, _mm512_castsi512_ps(bits));
  e = _mm512_mask_mov_ps(e, _mm512_cmp_ps_mask(y, _mm512_set1_ps(kExpHigh), _CMP_GT_OQ),
                         _mm512_set1_ps(std::numeric_limits<float>::infinity()));
  e = _mm512_mask_mov_ps(e, _mm512_cmp_ps_mask(y, _mm512_set1_ps(kExpLow), _CMP_LT_OQ), _mm512_setzero_ps());
  return _mm512_mask_mov_ps(e, _mm512_cmp_ps_mask(y, y, _CMP_UNORD_Q), y);
}
#endif

// Whether n floats are all finite (no infinity, no NaN): exponent bits never all ones, tested as
// integers so that the loop vectorizes (std::all_of with std::isfinite compared one value at a time:
// 27 of qlinear_int's 64 us on 125 x 640 activations against 16 weight rows, Zen 4).
inline bool all_finite(const float* x, int64_t n) {
  uint32_t exponent = 0;
  for (int64_t i = 0; i < n; ++i) {
    uint32_t bits;
    std::memcpy(&bits, x + i, sizeof bits);
    exponent = std::max(exponent, bits & 0x7F800000u);
  }
  return exponent != 0x7F800000u;
}

// A scale or min as float32 (exact from float16).
inline float to_float(float v) { return v; }
inline float to_float(c10::Half v) {
#ifdef TG_AVX2
  return _cvtsh_ss(v.x);
#else
  return static_cast<float>(v);
#endif
}

// Bytes per 32 values of a row.
constexpr int64_t block_bytes(int bits) { return bits == 8 ? 32 : bits == 4 ? 16 : 20; }

#ifdef TG_AVX2

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// 8 scales or mins at p, as float32.
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const c10::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// 8 int8 values at p, as float32.
inline __m256 load_i8(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}

// 8 bytes (0..15 each) at lane offset `at` of a 16-byte vector, as float32.
inline __m256 widen_u8(__m128i v) { return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(v)); }

// 32 bits at p -> 32 bytes: byte j is 0x10 where bit j is set (bit 4 of 5-bit value j), else 0.
// Each byte of the broadcast word goes to 8 lanes (shuffle), then each lane tests its own bit.
inline __m256i fifth_bits(const uint8_t* p) {
  uint32_t word;
  std::memcpy(&word, p, 4);
  const __m256i spread = _mm256_shuffle_epi8(
      _mm256_set1_epi32(static_cast<int>(word)),
      _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202, 0x0101010101010101, 0));
  const __m256i probe = _mm256_set1_epi64x(static_cast<int64_t>(0x8040201008040201ULL));
  const __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(spread, probe), probe);
  return _mm256_and_si256(set, _mm256_set1_epi8(0x10));
}

// 32 values of a 4- or 5-bit block at p, as 16 + 16 bytes in order (values 0-15, values 16-31).
template <int BITS>
inline void block_bytes_u8(const uint8_t* p, __m128i& lo, __m128i& hi) {
  const __m128i low = _mm_set1_epi8(0x0F);
  const __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  lo = _mm_and_si128(packed, low);
  hi = _mm_and_si128(_mm_srli_epi16(packed, 4), low);
  if constexpr (BITS == 5) {
    const __m256i fifth = fifth_bits(p + 16);
    lo = _mm_or_si128(lo, _mm256_castsi256_si128(fifth));
    hi = _mm_or_si128(hi, _mm256_extracti128_si256(fifth, 1));
  }
}

#endif  // TG_AVX2

// Value k of a row (any CPU): int8, or 0..15 / 0..31 unpacked from its block.
template <int BITS>
inline int q_at(const uint8_t* q, int64_t k) {
  if constexpr (BITS == 8) {
    return reinterpret_cast<const int8_t*>(q)[k];
  } else {
    const uint8_t* block = q + k / 32 * block_bytes(BITS);
    const int64_t j = k & 31;
    const int nibble = j < 16 ? (block[j] & 0x0F) : (block[j - 16] >> 4);
    if constexpr (BITS == 5) return nibble | (((block[16 + j / 8] >> (j % 8)) & 1) << 4);
    return nibble;
  }
}

// sum_g mins[g] * xsum[g], the offsets' share of one output. Eight groups at a time where the build
// has AVX2 (a scalar chain of one add per group cost 7 of 20 ms on the 262144-row head in 5 bits).
template <typename S>
inline float min_dot(const S* mins, const float* xsum, int64_t groups) {
  float y = 0.f;
  int64_t g = 0;
#ifdef TG_AVX2
  if (groups >= 8) {
    __m256 acc = _mm256_setzero_ps();
    for (; g + 8 <= groups; g += 8) acc = _mm256_fmadd_ps(load8(mins + g), _mm256_loadu_ps(xsum + g), acc);
    y = hsum(acc);
  }
#endif
  for (; g < groups; ++g) y += to_float(mins[g]) * xsum[g];
  return y;
}

// x (M, K) float32 -> the sum of each group of G values of each row (M, K / G), accumulated in
// double and rounded once: what the offsets multiply (qlinear and qlinear_bounds use the same sums).
inline std::vector<float> group_sums(const at::Tensor& x, int64_t G) {
  const int64_t M = x.size(0), K = x.size(1);
  const float* p = x.data_ptr<float>();
  std::vector<float> out(M * (K / G));
  for (int64_t i = 0; i < M * (K / G); ++i) {
    double total = 0;
    for (int64_t k = 0; k < G; ++k) total += p[i * G + k];
    out[i] = static_cast<float>(total);
  }
  return out;
}

inline int64_t in_features(const at::Tensor& qweight, int64_t bits) {
  return bits == 8 ? qweight.size(1) : bits == 4 ? qweight.size(1) * 2 : qweight.size(1) / 20 * 32;
}

// The layout's checks, before anything is sized or divided by it: every message names the operator
// and the argument. Returns K, the weight's input features (at least one whole group).
inline int64_t check_layout(const char* op, const at::Tensor& qweight, const at::Tensor& scales,
                            const std::optional<at::Tensor>& mins, int64_t bits, int64_t group) {
  TORCH_CHECK(bits == 4 || bits == 5 || bits == 8, op, ": bits must be 4, 5 or 8, got ", bits);
  TORCH_CHECK(qweight.dim() == 2 && qweight.is_contiguous(), op, ": qweight must be a contiguous 2-D tensor, got ",
              qweight.sizes());
  TORCH_CHECK(qweight.scalar_type() == (bits == 8 ? at::kChar : at::kByte), op, ": qweight of bits ", bits,
              " must be ", bits == 8 ? "int8" : "uint8", ", got ", qweight.scalar_type());
  TORCH_CHECK(bits != 5 || qweight.size(1) % 20 == 0, op, ": 5-bit rows take 20 bytes per 32 values, got qweight ",
              qweight.sizes());
  const int64_t K = in_features(qweight, bits);
  TORCH_CHECK(K > 0, op, ": qweight ", qweight.sizes(), " has no input features");
  TORCH_CHECK(group > 0 && K % group == 0 && group % (bits == 8 ? 8 : 32) == 0, op, ": group size ", group,
              " does not divide ", K, " values into whole blocks of ", bits == 8 ? 8 : 32);
  const int64_t N = qweight.size(0);
  const bool half = scales.scalar_type() == at::kHalf;
  TORCH_CHECK((half || scales.scalar_type() == at::kFloat) && scales.is_contiguous() && scales.dim() == 2 &&
                  scales.size(0) == N && scales.size(1) == K / group,
              op, ": scales must be contiguous float32 or float16 (", N, ", ", K / group, "), got ",
              scales.scalar_type(), " ", scales.sizes());
  if (mins) {
    TORCH_CHECK(mins->scalar_type() == scales.scalar_type() && mins->is_contiguous() &&
                    mins->sizes() == scales.sizes(),
                op, ": mins must be of the scales' dtype and shape ", scales.sizes(), ", got ",
                mins->scalar_type(), " ", mins->sizes());
  }
  return K;
}

// Calls f(std::integral_constant<int, bits>{}, S{}) for the layout's bits and scale type.
template <typename F>
void dispatch(int64_t bits, const at::Tensor& scales, F&& f) {
  auto with_bits = [&](auto scale) {
    if (bits == 8) return f(std::integral_constant<int, 8>{}, scale);
    if (bits == 5) return f(std::integral_constant<int, 5>{}, scale);
    return f(std::integral_constant<int, 4>{}, scale);
  };
  if (scales.scalar_type() == at::kHalf) return with_bits(c10::Half{});
  return with_bits(float{});
}

// A product's checked inputs: x (..., K) as float32 rows (M, K), for a weight of K features.
inline at::Tensor product_rows(const char* op, const at::Tensor& x_in, const at::Tensor& qweight,
                               const at::Tensor& scales, const std::optional<at::Tensor>& mins, int64_t bits, int64_t group) {
  const int64_t K = check_layout(op, qweight, scales, mins, bits, group);
  TORCH_CHECK(x_in.dim() >= 1 && x_in.size(-1) == K, op, ": input x ", x_in.sizes(), " must end in the ", K,
              " features the weight takes");
  return x_in.reshape({-1, K}).to(at::kFloat).contiguous();
}

// The activations' rounding (qlinear_bounds with int8, qlinear_int with int8 or int16):
// x (K) -> xq (K, int8 or int16), d (K / 32): x[k] ~ d[k / 32] * xq[k] (d = max |x| / L over the block,
// L = 127 or 32767, xq = x / d rounded to nearest, ties to even).
template <typename X>
void round_to_ints(const float* x, int64_t K, X* xq, float* d) {
  constexpr int kLevels = std::is_same_v<X, int8_t> ? 127 : 32767;
#ifdef TG_AVX512
  // The same operations 16 values at a time (a division, and vcvtps2dq's round to nearest even: lrint's
  // rounding in the default mode), so the same integers.
  const __m512 sign = _mm512_set1_ps(-0.0f);
  const __m512i lo = _mm512_set1_epi32(-kLevels), hi = _mm512_set1_epi32(kLevels);
  for (int64_t b = 0; b < K / 32; ++b) {
    const __m512 x0 = _mm512_loadu_ps(x + b * 32), x1 = _mm512_loadu_ps(x + b * 32 + 16);
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_andnot_ps(sign, x0), _mm512_andnot_ps(sign, x1)));
    const float scale = amax / static_cast<float>(kLevels);
    d[b] = scale;
    if (!(scale > 0.f)) {
      std::memset(xq + b * 32, 0, 32 * sizeof(X));
      continue;
    }
    const __m512 sv = _mm512_set1_ps(scale);
    const __m512i q0 = _mm512_min_epi32(hi, _mm512_max_epi32(lo, _mm512_cvtps_epi32(_mm512_div_ps(x0, sv))));
    const __m512i q1 = _mm512_min_epi32(hi, _mm512_max_epi32(lo, _mm512_cvtps_epi32(_mm512_div_ps(x1, sv))));
    if constexpr (std::is_same_v<X, int8_t>) {
      _mm_storeu_si128(reinterpret_cast<__m128i*>(xq + b * 32), _mm512_cvtepi32_epi8(q0));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(xq + b * 32 + 16), _mm512_cvtepi32_epi8(q1));
    } else {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(xq + b * 32), _mm512_cvtepi32_epi16(q0));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(xq + b * 32 + 16), _mm512_cvtepi32_epi16(q1));
    }
  }
  return;
#endif
  for (int64_t b = 0; b < K / 32; ++b) {
    float amax = 0.f;
    for (int64_t k = b * 32; k < (b + 1) * 32; ++k) amax = std::max(amax, std::fabs(x[k]));
    const float scale = amax / static_cast<float>(kLevels);
    d[b] = scale;
    for (int64_t k = b * 32; k < (b + 1) * 32; ++k) {
      const long v = scale > 0.f ? std::lrint(x[k] / scale) : 0;
      xq[k] = static_cast<X>(std::max<long>(-kLevels, std::min<long>(kLevels, v)));
    }
  }
}

}  // namespace torchgemma::TG_ISA
