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
// The product never materialises W: per group it forms dot(x, q) in float32 and adds
// scale * dot + min * sum(x), so a decode step reads each weight byte once. This is what makes
// weight-only quantization fast on a CPU: batch-1 decode is bound by the bytes read per token.
//
// Registered as the CPU kernels of torchgemma::qlinear and torchgemma::dequantize, whose schemas
// (and a pure-PyTorch kernel for every other device) are defined in Python
// (torchgemma/quantization/kernels.py). Threads: ATen's pool, split over output rows.

#include <ATen/Parallel.h>
#include <ATen/ThreadLocalState.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/mm.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <c10/util/Half.h>

#include <array>
#include <limits>
#include <cmath>
#include <cstdint>
#include <tuple>
#include <vector>
#include <algorithm>
#include <cstring>
#include <optional>
#include <type_traits>

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

namespace {

// How many activation rows share one pass over a weight row (its integers are converted once).
constexpr int64_t kRowBlock = 4;

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

// R weight rows times MB activation rows, bits 8: out[m * R + r] = sum_g s_rg * dot_g(x_m, q_r). The
// R x MB dot products are independent chains, so the FMA latency overlaps (one chain per row stalls).
template <int MB, int R, typename S>
inline void rows_q8(const int8_t* q, int64_t q_stride, const S* scales, int64_t groups_stride, int64_t K,
                    int64_t G, const float* x, int64_t x_stride, float* acc_out) {
  __m256 total[MB][R];
  for (int m = 0; m < MB; ++m)
    for (int r = 0; r < R; ++r) total[m][r] = _mm256_setzero_ps();
  const int64_t groups = K / G;
  // Two FMA chains per group (8-value blocks alternate between them), so a long group (one scale
  // per row) is not one long chain of FMA latencies (262144 x 640 per row: 21 -> 11-12 ms). The order
  // is the same for any MB and R: a row's result does not depend on the rows beside it.
  for (int64_t g = 0; g < groups; ++g) {
    __m256 dot[MB][R], odd[MB][R];
    for (int m = 0; m < MB; ++m)
      for (int r = 0; r < R; ++r) dot[m][r] = odd[m][r] = _mm256_setzero_ps();
    const int64_t end = (g + 1) * G;
    int64_t k = g * G;
    for (; k + 16 <= end; k += 16) {
      for (int r = 0; r < R; ++r) {
        const __m256 w0 = load_i8(q + r * q_stride + k), w1 = load_i8(q + r * q_stride + k + 8);
        for (int m = 0; m < MB; ++m) {
          dot[m][r] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x + m * x_stride + k), dot[m][r]);
          odd[m][r] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(x + m * x_stride + k + 8), odd[m][r]);
        }
      }
    }
    for (; k < end; k += 8) {  // a group of 8 * odd length: its last 8 values
      for (int r = 0; r < R; ++r) {
        const __m256 w = load_i8(q + r * q_stride + k);
        for (int m = 0; m < MB; ++m) dot[m][r] = _mm256_fmadd_ps(w, _mm256_loadu_ps(x + m * x_stride + k), dot[m][r]);
      }
    }
    for (int m = 0; m < MB; ++m)
      for (int r = 0; r < R; ++r) dot[m][r] = _mm256_add_ps(dot[m][r], odd[m][r]);
    for (int r = 0; r < R; ++r) {
      const __m256 s = _mm256_set1_ps(to_float(scales[r * groups_stride + g]));
      for (int m = 0; m < MB; ++m) total[m][r] = _mm256_fmadd_ps(s, dot[m][r], total[m][r]);
    }
  }
  for (int m = 0; m < MB; ++m)
    for (int r = 0; r < R; ++r) acc_out[m * R + r] = hsum(total[m][r]);
}

#ifdef TG_AVX512
// The two 256-bit halves of v, added: lane i is (lane i) + (lane i + 8).
inline __m256 fold(__m512 v) {
  return _mm256_add_ps(_mm512_castps512_ps256(v), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
}
#endif

// rows_q8 for groups of exactly 32 values (GGUF's Q8_0 and Q5_0): the same sums in the same order,
// with a group's two chains written out rather than left to the general loop (2048 x 640, one
// thread, weights in cache: 99 -> 82 us per product; from memory, 116 -> 100-112).
template <int MB, int R, typename S>
inline void rows_q8_g32(const int8_t* q, int64_t q_stride, const S* scales, int64_t groups_stride, int64_t K,
                        const float* x, int64_t x_stride, float* acc_out) {
  __m256 total[MB][R];
  for (int m = 0; m < MB; ++m)
    for (int r = 0; r < R; ++r) total[m][r] = _mm256_setzero_ps();
  for (int64_t g = 0; g < K / 32; ++g) {
    const int64_t k = g * 32;
    for (int r = 0; r < R; ++r) {
      const int8_t* qr = q + r * q_stride + k;
      const __m256 s = _mm256_set1_ps(to_float(scales[r * groups_stride + g]));
#ifdef TG_AVX512
      const __m512 w0 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qr))));
      const __m512 w1 =
          _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qr + 16))));
      for (int m = 0; m < MB; ++m) {
        const float* xm = x + m * x_stride + k;
        __m512 d = _mm512_fmadd_ps(w0, _mm512_loadu_ps(xm), _mm512_setzero_ps());
        d = _mm512_fmadd_ps(w1, _mm512_loadu_ps(xm + 16), d);
        total[m][r] = _mm256_fmadd_ps(s, fold(d), total[m][r]);
      }
#else
      const __m256 w0 = load_i8(qr), w1 = load_i8(qr + 8), w2 = load_i8(qr + 16), w3 = load_i8(qr + 24);
      for (int m = 0; m < MB; ++m) {
        const float* xm = x + m * x_stride + k;
        __m256 dot = _mm256_fmadd_ps(w0, _mm256_loadu_ps(xm), _mm256_setzero_ps());
        __m256 odd = _mm256_fmadd_ps(w1, _mm256_loadu_ps(xm + 8), _mm256_setzero_ps());
        dot = _mm256_fmadd_ps(w2, _mm256_loadu_ps(xm + 16), dot);
        odd = _mm256_fmadd_ps(w3, _mm256_loadu_ps(xm + 24), odd);
        total[m][r] = _mm256_fmadd_ps(s, _mm256_add_ps(dot, odd), total[m][r]);
      }
#endif
    }
  }
  for (int m = 0; m < MB; ++m)
    for (int r = 0; r < R; ++r) acc_out[m * R + r] = hsum(total[m][r]);
}

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

// The same for bits 4 and 5 (G a multiple of 32). Two chains per group, as rows_q8: values 0-7 and
// 16-23 of each block of 32 in one, 8-15 and 24-31 in the other (an AVX-512 build keeps both in one
// 512-bit register: its lanes 0-15 are a block's first 16 values, then its last 16).
template <int MB, int R, int BITS, typename S>
inline void rows_qn(const uint8_t* q, int64_t q_stride, const S* scales, int64_t groups_stride, int64_t K,
                    int64_t G, const float* x, int64_t x_stride, float* acc_out) {
  __m256 total[MB][R];
  for (int m = 0; m < MB; ++m)
    for (int r = 0; r < R; ++r) total[m][r] = _mm256_setzero_ps();
  const int64_t groups = K / G;
  for (int64_t g = 0; g < groups; ++g) {
#ifdef TG_AVX512
    __m512 dot[MB][R];
    for (int m = 0; m < MB; ++m)
      for (int r = 0; r < R; ++r) dot[m][r] = _mm512_setzero_ps();
#else
    __m256 dot[MB][R], odd[MB][R];
    for (int m = 0; m < MB; ++m)
      for (int r = 0; r < R; ++r) dot[m][r] = odd[m][r] = _mm256_setzero_ps();
#endif
    for (int64_t k = g * G; k < (g + 1) * G; k += 32) {
      for (int r = 0; r < R; ++r) {
        const uint8_t* block = q + r * q_stride + k / 32 * block_bytes(BITS);
#ifdef TG_AVX512
        __m512 w0, w1;  // values k .. k+15, k+16 .. k+31
        if constexpr (BITS == 4) {
          // Bytes widened first, then split: byte j's low nibble is value j, its high one j + 16.
          const __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(block)));
          w0 = _mm512_cvtepi32_ps(_mm512_and_si512(bytes, _mm512_set1_epi32(0x0F)));
          w1 = _mm512_cvtepi32_ps(_mm512_srli_epi32(bytes, 4));
        } else {
          __m128i lo, hi;
          block_bytes_u8<BITS>(block, lo, hi);
          w0 = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(lo)), w1 = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(hi));
        }
        for (int m = 0; m < MB; ++m) {
          const float* xm = x + m * x_stride + k;
          dot[m][r] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(xm), dot[m][r]);
          dot[m][r] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(xm + 16), dot[m][r]);
        }
#else
        __m256 w[4];  // values k .. k+7, k+8 .. k+15, k+16 .. k+23, k+24 .. k+31
        if constexpr (BITS == 4) {
          const __m256i low = _mm256_set1_epi32(0x0F);
          const __m256i b0 = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(block)));
          const __m256i b1 = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(block + 8)));
          w[0] = _mm256_cvtepi32_ps(_mm256_and_si256(b0, low)), w[1] = _mm256_cvtepi32_ps(_mm256_and_si256(b1, low));
          w[2] = _mm256_cvtepi32_ps(_mm256_srli_epi32(b0, 4)), w[3] = _mm256_cvtepi32_ps(_mm256_srli_epi32(b1, 4));
        } else {
          __m128i lo, hi;
          block_bytes_u8<BITS>(block, lo, hi);
          w[0] = widen_u8(lo), w[1] = widen_u8(_mm_srli_si128(lo, 8));
          w[2] = widen_u8(hi), w[3] = widen_u8(_mm_srli_si128(hi, 8));
        }
        for (int m = 0; m < MB; ++m) {
          const float* xm = x + m * x_stride + k;
          dot[m][r] = _mm256_fmadd_ps(w[0], _mm256_loadu_ps(xm), dot[m][r]);
          odd[m][r] = _mm256_fmadd_ps(w[1], _mm256_loadu_ps(xm + 8), odd[m][r]);
          dot[m][r] = _mm256_fmadd_ps(w[2], _mm256_loadu_ps(xm + 16), dot[m][r]);
          odd[m][r] = _mm256_fmadd_ps(w[3], _mm256_loadu_ps(xm + 24), odd[m][r]);
        }
#endif
      }
    }
    for (int r = 0; r < R; ++r) {
      const __m256 s = _mm256_set1_ps(to_float(scales[r * groups_stride + g]));
      for (int m = 0; m < MB; ++m) {
#ifdef TG_AVX512
        const __m256 sum = fold(dot[m][r]);
#else
        const __m256 sum = _mm256_add_ps(dot[m][r], odd[m][r]);
#endif
        total[m][r] = _mm256_fmadd_ps(s, sum, total[m][r]);
      }
    }
  }
  for (int m = 0; m < MB; ++m)
    for (int r = 0; r < R; ++r) acc_out[m * R + r] = hsum(total[m][r]);
}

#endif  // TG_AVX2

// Portable versions (any CPU): the same sums, left to the compiler to vectorise.
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

template <int BITS, typename S>
inline void row_portable(const uint8_t* q, const S* scales, int64_t K, int64_t G, const float* x,
                         int64_t x_stride, int64_t rows, float* acc_out) {
  for (int64_t m = 0; m < rows; ++m) {
    const float* xm = x + m * x_stride;
    float total = 0.f;
    for (int64_t g = 0; g < K / G; ++g) {
      float dot = 0.f;
      for (int64_t k = g * G; k < (g + 1) * G; ++k) dot += xm[k] * static_cast<float>(q_at<BITS>(q, k));
      total += to_float(scales[g]) * dot;
    }
    acc_out[m] = total;
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
std::vector<float> group_sums(const at::Tensor& x, int64_t G) {
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

// MB activation rows against R weight rows (out: MB x R), by the best path the build has.
template <int BITS, typename S>
inline void block_dot(const uint8_t* q, int64_t q_stride, const S* scales, int64_t groups, int64_t K, int64_t G,
                      const float* x, int64_t x_stride, int64_t rows, int64_t weights, float* acc_out) {
#ifdef TG_AVX2
  auto run = [&](auto mb, auto r) {
    constexpr int MB = decltype(mb)::value, R = decltype(r)::value;
    if constexpr (BITS == 8) {
      if (G == 32) return rows_q8_g32<MB, R>(reinterpret_cast<const int8_t*>(q), q_stride, scales, groups, K, x, x_stride, acc_out);
      rows_q8<MB, R>(reinterpret_cast<const int8_t*>(q), q_stride, scales, groups, K, G, x, x_stride, acc_out);
    } else {
      rows_qn<MB, R, BITS>(q, q_stride, scales, groups, K, G, x, x_stride, acc_out);
    }
  };
  using I1 = std::integral_constant<int, 1>;
  using I2 = std::integral_constant<int, 2>;
  using I3 = std::integral_constant<int, 3>;
  using I4 = std::integral_constant<int, 4>;
  if (weights == 4 && rows == 1) return run(I1{}, I4{});
  if (weights == 2 && rows == 2) return run(I2{}, I2{});
  if (weights == 2 && rows == 1) return run(I1{}, I2{});
  TORCH_CHECK(weights == 1, "qlinear: no kernel for ", rows, " x ", weights, " rows");
  switch (rows) {  // weights == 1
    case 4: return run(I4{}, I1{});
    case 3: return run(I3{}, I1{});
    case 2: return run(I2{}, I1{});
    default: return run(I1{}, I1{});
  }
#else
  for (int64_t r = 0; r < weights; ++r) {
    float acc[kRowBlock];
    row_portable<BITS>(q + r * q_stride, scales + r * groups, K, G, x, x_stride, rows, acc);
    for (int64_t m = 0; m < rows; ++m) acc_out[m * weights + r] = acc[m];
  }
#endif
}

// How many weight rows one pass takes for `rows` activation rows (register budget: MB x R chains).
// Measured (AMD EPYC, one thread, 262144 x 640): 4-bit rows unpack in more steps and gain from
// four independent chains (16.0 -> 12.3 ms); 8-bit rows stream fastest one at a time (14 ms; 27-34
// ms with two or four, whose interleaved loads the prefetcher serves worse). 5-bit rows (the fifth bits
// take more registers): two at a time for one or two activation rows (one row, 262144 x 640 with
// float16 scales: 18.4 ms with one, 17.5 with two, 19.7 with four; 8-bit rows take 13.3).
inline int64_t weight_block(int64_t rows, int64_t bits) {
  if (bits == 8) return 1;
  if (bits == 5) return rows <= 2 ? 2 : 1;
  return rows == 1 ? 4 : rows == 2 ? 2 : 1;
}

void check_layout(const at::Tensor& qweight, const at::Tensor& scales, const std::optional<at::Tensor>& mins,
                  int64_t bits, int64_t group, int64_t K) {
  TORCH_CHECK(bits == 4 || bits == 5 || bits == 8, "qlinear: bits must be 4, 5 or 8, got ", bits);
  TORCH_CHECK(qweight.dim() == 2 && qweight.is_contiguous(), "qlinear: qweight must be a contiguous 2-D tensor");
  TORCH_CHECK(qweight.scalar_type() == (bits == 8 ? at::kChar : at::kByte), "qlinear: qweight of bits ", bits,
              " must be ", bits == 8 ? "int8" : "uint8", ", got ", qweight.scalar_type());
  TORCH_CHECK(bits != 5 || qweight.size(1) % 20 == 0, "qlinear: 5-bit rows take 20 bytes per 32 values, got ",
              qweight.size(1));
  TORCH_CHECK(group > 0 && K % group == 0 && group % (bits == 8 ? 8 : 32) == 0, "qlinear: group size ", group,
              " does not divide ", K, " values into whole blocks of ", bits == 8 ? 8 : 32);
  const int64_t N = qweight.size(0);
  const bool half = scales.scalar_type() == at::kHalf;
  TORCH_CHECK((half || scales.scalar_type() == at::kFloat) && scales.is_contiguous() && scales.dim() == 2 &&
                  scales.size(0) == N && scales.size(1) == K / group,
              "qlinear: scales must be float32 or float16 (", N, ", ", K / group, "), got ", scales.scalar_type(),
              " ", scales.sizes());
  if (mins) {
    TORCH_CHECK(mins->scalar_type() == scales.scalar_type() && mins->is_contiguous() &&
                    mins->sizes() == scales.sizes(),
                "qlinear: mins must be of the scales' dtype and shape ", scales.sizes(), ", got ",
                mins->scalar_type(), " ", mins->sizes());
  }
}

int64_t in_features(const at::Tensor& qweight, int64_t bits) {
  return bits == 8 ? qweight.size(1) : bits == 4 ? qweight.size(1) * 2 : qweight.size(1) / 20 * 32;
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
at::Tensor product_rows(const char* op, const at::Tensor& x_in, const at::Tensor& qweight, const at::Tensor& scales,
                        const std::optional<at::Tensor>& mins, int64_t bits, int64_t group) {
  const int64_t K = in_features(qweight, bits);
  check_layout(qweight, scales, mins, bits, group, K);
  TORCH_CHECK(x_in.size(-1) == K, op, ": input has ", x_in.size(-1), " features, the weight takes ", K);
  return x_in.reshape({-1, K}).to(at::kFloat).contiguous();
}

// x (M, K) float32 -> (M, N) float32.
at::Tensor qlinear_cpu(const at::Tensor& x_in, const at::Tensor& qweight, const at::Tensor& scales,
                       const std::optional<at::Tensor>& mins, int64_t bits, int64_t group) {
  const at::Tensor x = product_rows("qlinear", x_in, qweight, scales, mins, bits, group);
  const int64_t K = x.size(1), M = x.size(0), N = qweight.size(0), groups = K / group;
  at::Tensor out = at::empty({M, N}, x.options());

  // Offsets enter as min_g * sum(x over group g): those sums are computed once per call.
  const std::vector<float> xsum = mins ? group_sums(x, group) : std::vector<float>();  // (M, groups)

  dispatch(bits, scales, [&](auto bits_tag, auto scale_tag) {
  constexpr int BITS = decltype(bits_tag)::value;
  using S = decltype(scale_tag);
  const float* xp = x.data_ptr<float>();
  const S* sp = static_cast<const S*>(scales.data_ptr());
  const S* mp = mins ? static_cast<const S*>(mins->data_ptr()) : nullptr;
  const float* xs = mins ? xsum.data() : nullptr;
  float* op = out.data_ptr<float>();
  const int64_t row_bytes = qweight.size(1);
  const uint8_t* qp = static_cast<const uint8_t*>(qweight.data_ptr());

  // Enough rows per task that a thread streams a long run of weights.
  const int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(K, 1));
  at::parallel_for(0, N, grain, [&](int64_t n0, int64_t n1) {
    float acc[kRowBlock * 4];
    for (int64_t m0 = 0; m0 < M; m0 += kRowBlock) {
      const int64_t rows = std::min(kRowBlock, M - m0);
      for (int64_t n = n0; n < n1;) {
        const int64_t block = weight_block(rows, bits);
        const int64_t weights = n + block <= n1 ? block : 1;
        block_dot<BITS>(qp + n * row_bytes, row_bytes, sp + n * groups, groups, K, group, xp + m0 * K, K, rows,
                        weights, acc);
        for (int64_t m = 0; m < rows; ++m) {
          for (int64_t r = 0; r < weights; ++r) {
            float y = acc[m * weights + r];
            if (mp) {
              y += min_dot(mp + (n + r) * groups, xs + (m0 + m) * groups, groups);
            }
            op[(m0 + m) * N + n + r] = y;
          }
        }
        n += weights;
      }
    }
  });
  });
  auto shape = x_in.sizes().vec();
  shape.back() = N;
  return out.view(shape);
}

// Rows n0..n1 of the float32 weight into out (row n at out + (n - n0) * K): scales * q (+ mins), the
// operations and order of GGML's dequantizers.
template <int BITS, typename S>
void dequantize_rows(const uint8_t* qp, const S* sp, const S* mp, int64_t row_bytes, int64_t K, int64_t group,
                     int64_t n0, int64_t n1, float* out) {
  const int64_t groups = K / group;
  at::parallel_for(n0, n1, 16, [&](int64_t a, int64_t b_end) {
    for (int64_t n = a; n < b_end; ++n) {
      const uint8_t* qrow = qp + n * row_bytes;
      float* orow = out + (n - n0) * K;
#ifdef TG_AVX2
      // 8 values at a time: multiply, then add (two roundings, as the scalar loop below).
      for (int64_t g = 0; g < groups; ++g) {
        const __m256 s = _mm256_set1_ps(to_float(sp[n * groups + g]));
        const __m256 b = _mm256_set1_ps(mp ? to_float(mp[n * groups + g]) : 0.f);
        for (int64_t k = g * group; k < (g + 1) * group; k += BITS == 8 ? 8 : 32) {
          __m256 w[4];
          int count = 1;
          if constexpr (BITS == 8) {
            w[0] = load_i8(reinterpret_cast<const int8_t*>(qrow) + k);
          } else {
            __m128i lo, hi;
            block_bytes_u8<BITS>(qrow + k / 32 * block_bytes(BITS), lo, hi);
            w[0] = widen_u8(lo), w[1] = widen_u8(_mm_srli_si128(lo, 8));
            w[2] = widen_u8(hi), w[3] = widen_u8(_mm_srli_si128(hi, 8));
            count = 4;
          }
          for (int j = 0; j < count; ++j) {
            __m256 v = _mm256_mul_ps(s, w[j]);
            if (mp) v = _mm256_add_ps(v, b);
            _mm256_storeu_ps(orow + k + 8 * j, v);
          }
        }
      }
      continue;
#endif
      for (int64_t k = 0; k < K; ++k) {
        const int64_t g = k / group;
        float w = to_float(sp[n * groups + g]) * static_cast<float>(q_at<BITS>(qrow, k));
        if (mp) w = w + to_float(mp[n * groups + g]);
        orow[k] = w;
      }
    }
  });
}

// The float32 weight (N, K).
at::Tensor dequantize_cpu(const at::Tensor& qweight, const at::Tensor& scales, const std::optional<at::Tensor>& mins,
                          int64_t bits, int64_t group) {
  const int64_t K = in_features(qweight, bits);
  check_layout(qweight, scales, mins, bits, group, K);
  const int64_t N = qweight.size(0);
  at::Tensor out = at::empty({N, K}, scales.options().dtype(at::kFloat));
  dispatch(bits, scales, [&](auto bits_tag, auto scale_tag) {
    using S = decltype(scale_tag);
    dequantize_rows<decltype(bits_tag)::value>(
        static_cast<const uint8_t*>(qweight.data_ptr()), static_cast<const S*>(scales.data_ptr()),
        mins ? static_cast<const S*>(mins->data_ptr()) : nullptr, qweight.size(1), K, group, 0, N,
        out.data_ptr<float>());
  });
  return out;
}

// x (M, K) @ W.T for many rows (prefill): W dequantized a slab of rows at a time into one small
// buffer, each slab multiplied by the float32 BLAS into its columns of the output. The BLAS's speed
// without the whole float32 weight in memory (a 6144 x 1536 layer would be 38 MB per call).
at::Tensor qlinear_dense_cpu(const at::Tensor& x_in, const at::Tensor& qweight, const at::Tensor& scales,
                             const std::optional<at::Tensor>& mins, int64_t bits, int64_t group) {
  const at::Tensor x = product_rows("qlinear_dense", x_in, qweight, scales, mins, bits, group);
  const int64_t K = x.size(1), M = x.size(0), N = qweight.size(0);
  at::Tensor out = at::empty({M, N}, x.options());
  // Slabs of ~1 MB of float32 (a core's L2), at least 64 rows so that each product stays a GEMM, and
  // at least one per thread where there are rows enough. Each thread dequantizes its own slabs and
  // multiplies them on its own (the BLAS runs single-threaded inside a parallel region): threads that
  // took turns at a shared buffer (dequantize on all, then the BLAS on all) gained nothing from a
  // second thread (real 270M prefill, 125 tokens: 339 ms on one thread, 335 on two).
  const int64_t threads = std::max<int64_t>(1, at::get_num_threads());
  int64_t slab = std::min<int64_t>(N, std::max<int64_t>(64, (1 << 18) / std::max<int64_t>(K, 1)));
  if (threads > 1) slab = std::max<int64_t>(std::min<int64_t>(64, N), std::min(slab, (N + threads - 1) / threads));
  const int64_t slabs = (N + slab - 1) / slab;
  dispatch(bits, scales, [&](auto bits_tag, auto scale_tag) {
    using S = decltype(scale_tag);
    const at::ThreadLocalState state;  // the caller's inference / grad mode, for the workers' tensors
    at::parallel_for(0, slabs, 1, [&](int64_t s0, int64_t s1) {
      const at::ThreadLocalStateGuard guard(state);
      at::Tensor buffer = at::empty({slab, K}, x.options());
      for (int64_t s = s0; s < s1; ++s) {
        const int64_t n0 = s * slab, n1 = std::min(N, n0 + slab);
        dequantize_rows<decltype(bits_tag)::value>(
            static_cast<const uint8_t*>(qweight.data_ptr()), static_cast<const S*>(scales.data_ptr()),
            mins ? static_cast<const S*>(mins->data_ptr()) : nullptr, qweight.size(1), K, group, n0, n1,
            buffer.data_ptr<float>());
        at::Tensor part = out.narrow(1, n0, n1 - n0);
        at::mm_out(part, x, buffer.narrow(0, 0, n1 - n0).t());
      }
    });
  });
  auto shape = x_in.sizes().vec();
  shape.back() = N;
  return out.view(shape);
}

// ── Bounds for a greedy head ─────────────────────────────────────────────────────────────────
//
// Greedy decoding needs only the largest logit. qlinear_bounds scores every row with the activations
// rounded to int8 (per block of 32 values: x ~ d * xq, |xq| <= 127), which integer dot products read
// at the bytes' speed, and returns with each approximate score a bound on its distance from what
// qlinear computes:
//
//     |qlinear(x)[n] - approx[n]| <= bound[n]
//
// The rounding of x moves row n's product by sum_k (s q)[n, k] * e[k] (e = x - d * xq), at most
// ||(s q)[n]|| * ||e|| (Cauchy-Schwarz); float32 rounding moves each computation by at most
// gamma * ||(s q)[n]|| * ||x|| (gamma = (K + 64) * 2^-24, a sum of K products, both orders); the offsets'
// share (mins) is the same float32 computation in both. `row_norms` are ||(s q)[n]||, rounded up.
// A row whose upper end (approx + bound) is below the largest lower end (approx - bound) cannot hold
// the maximum; the rows that can are few, and the caller computes them exactly (qlinear on those rows).

constexpr double kUnit = 1.0 / 16777216.0;  // 2^-24, float32's unit roundoff

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

// round_to_ints (int8), and ||x - d xq||, ||x||, ||d xq||.
std::array<double, 3> quantize_activations(const float* x, int64_t K, int8_t* xq, float* d) {
  round_to_ints(x, K, xq, d);
  double err = 0, norm = 0, approx = 0;
  for (int64_t k = 0; k < K; ++k) {
    const double back = static_cast<double>(d[k / 32]) * xq[k];
    err += (x[k] - back) * (x[k] - back);
    norm += static_cast<double>(x[k]) * x[k];
    approx += back * back;
  }
  return {std::sqrt(err), std::sqrt(norm), std::sqrt(approx)};
}

// One weight row against xq: sum_b (s d)_b * dot(q_b, xq_b), 32 values per block b.
template <int BITS, typename S>
inline float approx_row(const uint8_t* q, const S* scales, int64_t K, int64_t G, const int8_t* xq, const float* d) {
  const int64_t blocks = K / 32;
#ifdef TG_AVX2
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 t0 = _mm256_setzero_ps(), t1 = _mm256_setzero_ps();
  auto block = [&](int64_t b, float sd, __m256 acc) {
    const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + b * 32));
    __m256i pairs;
    if constexpr (BITS == 8) {
      // maddubs multiplies unsigned by signed bytes: |q| (0..128, -128 included) times xq with q's
      // sign (|xq| <= 127, so the sign never overflows; pairs stay below 2 * 128 * 127 < 2^15).
      const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + b * 32));
      pairs = _mm256_maddubs_epi16(_mm256_abs_epi8(w), _mm256_sign_epi8(xv, w));
    } else {  // bits 4: unsigned 0..15, values 0-15 in the low nibbles, 16-31 in the high ones
      const __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + b * 16));
      const __m128i low = _mm_set1_epi8(0x0F);
      const __m256i w = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(packed, 4), low), _mm_and_si128(packed, low));
      pairs = _mm256_maddubs_epi16(w, xv);
    }
    const __m256 dot = _mm256_cvtepi32_ps(_mm256_madd_epi16(pairs, ones));
    return _mm256_fmadd_ps(_mm256_set1_ps(sd), dot, acc);
  };
  if (G == 32) {  // one scale per block
    int64_t b = 0;
    for (; b + 2 <= blocks; b += 2) {  // two chains: the FMA latency overlaps
      t0 = block(b, to_float(scales[b]) * d[b], t0);
      t1 = block(b + 1, to_float(scales[b + 1]) * d[b + 1], t1);
    }
    if (b < blocks) t0 = block(b, to_float(scales[b]) * d[b], t0);
  } else {
    const int64_t per = G / 32;
    for (int64_t g = 0; g < K / G; ++g) {
      const float s = to_float(scales[g]);
      for (int64_t b = g * per; b < (g + 1) * per; ++b) {
        if (b & 1) t1 = block(b, s * d[b], t1);
        else t0 = block(b, s * d[b], t0);
      }
    }
  }
  return hsum(_mm256_add_ps(t0, t1));
#else
  float total = 0.f;
  for (int64_t b = 0; b < blocks; ++b) {
    int32_t dot = 0;
    for (int64_t k = b * 32; k < (b + 1) * 32; ++k) dot += q_at<BITS>(q, k) * xq[k];
    total += to_float(scales[b * 32 / G]) * d[b] * static_cast<float>(dot);
  }
  return total;
#endif
}

std::tuple<at::Tensor, at::Tensor> qlinear_bounds_cpu(const at::Tensor& x_in, const at::Tensor& qweight,
                                                      const at::Tensor& scales, const std::optional<at::Tensor>& mins,
                                                      int64_t bits, int64_t group, const at::Tensor& row_norms) {
  const at::Tensor x = product_rows("qlinear_bounds", x_in, qweight, scales, mins, bits, group);
  const int64_t K = x.size(1);
  TORCH_CHECK(bits == 8 || bits == 4, "qlinear_bounds: bits must be 8 or 4, got ", bits);
  TORCH_CHECK(K % 32 == 0 && group % 32 == 0, "qlinear_bounds: needs groups of a multiple of 32 values");
  const int64_t N = qweight.size(0), groups = K / group;
  TORCH_CHECK(row_norms.scalar_type() == at::kFloat && row_norms.dim() == 1 && row_norms.size(0) == N &&
                  row_norms.is_contiguous(),
              "qlinear_bounds: row_norms must be float32 (", N, ")");
  const int64_t M = x.size(0);
  at::Tensor approx = at::empty({M, N}, x.options()), bound = at::empty({M, N}, x.options());
  const std::vector<float> xsum = mins ? group_sums(x, group) : std::vector<float>();
  std::vector<int8_t> xq(K);
  std::vector<float> d(K / 32);
  const double gamma = (K + 64) * kUnit / (1.0 - (K + 64) * kUnit);
  dispatch(bits, scales, [&](auto bits_tag, auto scale_tag) {
    constexpr int BITS = decltype(bits_tag)::value;
    using S = decltype(scale_tag);
    const S* sp = static_cast<const S*>(scales.data_ptr());
    const S* mp = mins ? static_cast<const S*>(mins->data_ptr()) : nullptr;
    const uint8_t* qp = static_cast<const uint8_t*>(qweight.data_ptr());
    const float* rn = row_norms.data_ptr<float>();
    const int64_t row_bytes = qweight.size(1);
    for (int64_t m = 0; m < M; ++m) {
      float* ap = approx.data_ptr<float>() + m * N;
      float* bp = bound.data_ptr<float>() + m * N;
      const float* xm = x.data_ptr<float>() + m * K;
      if (!std::all_of(xm, xm + K, [](float v) { return std::isfinite(v); })) {
        // Nothing to bound with: every row stays in doubt (the caller computes them all).
        std::fill(ap, ap + N, 0.f);
        std::fill(bp, bp + N, std::numeric_limits<float>::infinity());
        continue;
      }
      const auto [err, norm, norm_approx] = quantize_activations(xm, K, xq.data(), d.data());
      // Per unit of row norm: the rounding of x, then both computations' float32 rounding (1 + 2^-20:
      // this sum's own rounding, in double).
      const float beta = static_cast<float>((err + 2 * gamma * (norm + norm_approx)) * (1.0 + 1.0 / 1048576));
      const float* xs = mins ? xsum.data() + m * groups : nullptr;
      const int64_t grain = std::max<int64_t>(1, 16384 / K);
      at::parallel_for(0, N, grain, [&](int64_t n0, int64_t n1) {
        for (int64_t n = n0; n < n1; ++n) {
          float a = approx_row<BITS>(qp + n * row_bytes, sp + n * groups, K, group, xq.data(), d.data());
          if (mp) a += min_dot(mp + n * groups, xs, groups);
          const float b = rn[n] * beta;
          // 2^-21 of |a| + b: the final additions of both computations, and the caller's a +- b in
          // float32 (each at most 2^-24 relative).
          ap[n] = a;
          bp[n] = b + (std::fabs(a) + b) * (1.0f / 2097152);
        }
      });
    }
  });
  auto shape = x_in.sizes().vec();
  shape.back() = N;
  return {approx.view(shape), bound.view(shape)};
}

// ── Products with integer activations (qlinear_int, for calls of many rows) ─────────────────────
//
// qlinear_int rounds each row of x to integers of `x_bits` bits (8 or 16) per block of 32 values
// (d = max|x| / L, xq = x / d rounded to nearest, ties to even, L = 127 or 32767), then multiplies
// integers. Per "span" of F values (F = the weight's group size, or 32 if the group is longer: one
// activation scale and one weight scale over it), with q' = q + off the weight's integers (for 8-bit
// activations made unsigned: off = 128 for 8-bit weights; off = 0 otherwise):
//
//     I = sum q'[n, k] xq[m, k]   X = sum xq[m, k]                       (int32, exact)
//     t = float(I - off X) * s[n, g]      then  t = fma(min[n, g], float(X), t)  if mins
//     out[m, n] = fma(t, d[m, k / 32], out[m, n])                         span after span
//
// (float(I) rounds to nearest where |I| > 2^24: 16-bit activations only.) The float operations are
// these, in this order, for every (m, n), so every build gives the same bits.
//
// x_bits 8 is llama.cpp's arithmetic (its activations are Q8_0/Q8_K blocks): 2-3x the float32
// BLAS's speed where the CPU has AVX-512 VNNI (vpdpbusd: 64 byte products per instruction), for a
// visible rounding of the activations (perplexity +0.2% on Gemma 3 270M). x_bits 16 (vpdpwssd: 32
// products per instruction) rounds them 258 times finer: the float32 products' perplexity and greedy
// tokens there, at ~1.6x the float32 BLAS's speed (benchmarks/README.md).
//
// For VNNI the integers of 16 rows are interleaved a dword at a time (one 64-byte load holds values
// k..k+3 (bytes) or k..k+1 (int16) of each row), a slab of rows at a time, in each thread's own buffer.

constexpr int64_t kIntRows = 16;  // rows per interleaved group (the lanes of one 512-bit register)
// A VNNI tile: this many activation rows times this many interleaved groups (4 x 2: tiles of 6 x 2,
// 4 x 3, 3 x 4, 8 x 1 and 5 x 2 measured within noise of it, for both widths).
constexpr int kTileRows = 4, kTileGroups = 2;

// A span's length for a weight group G (0: no span fits, G neither divides 32 nor is a multiple).
inline int64_t int_span(int64_t G) { return G % 32 == 0 ? 32 : (32 % G == 0 ? G : 0); }

// The integer types of x_bits 8 and 16: activations, and weights as the products take them.
template <int XB> struct IntTypes;
template <> struct IntTypes<8> { using X = int8_t; using W = uint8_t; };
template <> struct IntTypes<16> { using X = int16_t; using W = int16_t; };

#ifdef TG_AVX512
// 16 rows of 16 dwords (at src + r * stride) -> dst[j * 16 + r] = row r's dword j: the 16 x 16 transpose,
// in registers (pairs of dwords, then of qwords, then of 128-bit lanes, twice).
inline void transpose_dwords16(const uint8_t* src, int64_t stride, uint8_t* dst) {
  __m512i r[16], t[16];
  for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_si512(reinterpret_cast<const void*>(src + i * stride));
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {
    r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  // r[4a + b] holds, in each 128-bit lane L, dword 4L + b' of rows 4a..4a+3 (b' = 0, 1, 2, 3 for
  // b = 0, 1, 2, 3). Gather lanes across the four groups a.
  for (int b = 0; b < 4; ++b) {
    const __m512i a01lo = _mm512_shuffle_i32x4(r[b], r[4 + b], 0x44);   // lanes 0,1 of a=0 | lanes 0,1 of a=1
    const __m512i a01hi = _mm512_shuffle_i32x4(r[b], r[4 + b], 0xEE);   // lanes 2,3 of a=0 | lanes 2,3 of a=1
    const __m512i a23lo = _mm512_shuffle_i32x4(r[8 + b], r[12 + b], 0x44);
    const __m512i a23hi = _mm512_shuffle_i32x4(r[8 + b], r[12 + b], 0xEE);
    // dword 4L + b of all 16 rows: lane L of a = 0, 1, 2, 3 in order
    t[b] = _mm512_shuffle_i32x4(a01lo, a23lo, 0x88);       // L = 0
    t[4 + b] = _mm512_shuffle_i32x4(a01lo, a23lo, 0xDD);   // L = 1
    t[8 + b] = _mm512_shuffle_i32x4(a01hi, a23hi, 0x88);   // L = 2
    t[12 + b] = _mm512_shuffle_i32x4(a01hi, a23hi, 0xDD);  // L = 3
  }
  for (int j = 0; j < 16; ++j) _mm512_storeu_si512(reinterpret_cast<void*>(dst + j * 64), t[j]);
}
#endif

// Rows n0..n0 + 16 of the weight as the products' integers (XB 8: unsigned bytes, q + 128 for 8-bit
// weights; XB 16: int16), interleaved a dword at a time (rows past N are zero), and their scales and
// mins per group as float32 (16 per group).
template <int XB, int BITS, typename S>
void pack_int_rows(const uint8_t* qp, const S* sp, const S* mp, int64_t row_bytes, int64_t N, int64_t K,
                   int64_t G, int64_t n0, uint8_t* wpack, float* spack, float* mpack) {
  using W = typename IntTypes<XB>::W;
  const int64_t groups = K / G, row_size = K * static_cast<int64_t>(sizeof(W));
  thread_local std::vector<uint8_t> buffer;
  buffer.resize(kIntRows * row_size);
  for (int64_t r = 0; r < kIntRows; ++r) {
    const int64_t n = n0 + r;
    W* row = reinterpret_cast<W*>(buffer.data() + r * row_size);
    if (n < N) {
      const uint8_t* q = qp + n * row_bytes;
      if constexpr (BITS == 8) {
        for (int64_t k = 0; k < K; ++k) {
          if constexpr (XB == 8) row[k] = static_cast<uint8_t>(q[k] ^ 0x80);  // q + 128
          else row[k] = reinterpret_cast<const int8_t*>(q)[k];
        }
      } else {
        for (int64_t b = 0; b < K / 32; ++b) {
#ifdef TG_AVX2
          __m128i lo, hi;
          block_bytes_u8<BITS>(q + b * block_bytes(BITS), lo, hi);
          if constexpr (XB == 8) {
            _mm_storeu_si128(reinterpret_cast<__m128i*>(row + b * 32), lo);
            _mm_storeu_si128(reinterpret_cast<__m128i*>(row + b * 32 + 16), hi);
          } else {
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(row + b * 32), _mm256_cvtepu8_epi16(lo));
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(row + b * 32 + 16), _mm256_cvtepu8_epi16(hi));
          }
#else
          for (int64_t k = b * 32; k < (b + 1) * 32; ++k) row[k] = static_cast<W>(q_at<BITS>(q, k));
#endif
        }
      }
    } else {
      std::memset(row, 0, row_size);
    }
    for (int64_t g = 0; g < groups; ++g) {
      spack[g * kIntRows + r] = n < N ? to_float(sp[n * groups + g]) : 0.f;
      if (mpack) mpack[g * kIntRows + r] = n < N ? to_float(mp[n * groups + g]) : 0.f;
    }
  }
  int64_t at = 0;  // bytes of each row done
#ifdef TG_AVX512
  for (; at + 64 <= row_size; at += 64) transpose_dwords16(buffer.data() + at, row_size, wpack + at * kIntRows);
#endif
  for (; at < row_size; at += 4)
    for (int64_t r = 0; r < kIntRows; ++r)
      std::memcpy(wpack + at * kIntRows + r * 4, buffer.data() + r * row_size + at, 4);
}

// The activations' rounding: xq (M, K) of XB bits (as bytes), d (M, K / 32), and the span sums X (M, K / F).
struct IntActivations {
  std::vector<uint8_t> xq;
  std::vector<float> d;
  std::vector<int32_t> sums;
};

// One interleaved group of 16 rows against activation rows m0..m0 + count, portable: out[m][r].
template <int XB>
void int_group_portable(const uint8_t* wpack, const float* spack, const float* mpack, const IntActivations& a,
                        int64_t K, int64_t G, int64_t F, int off, int64_t m0, int64_t count, float* out,
                        int64_t out_stride, int64_t valid) {
  using X = typename IntTypes<XB>::X;
  using W = typename IntTypes<XB>::W;
  constexpr int64_t per = 4 / static_cast<int64_t>(sizeof(W));  // values per dword
  const W* w = reinterpret_cast<const W*>(wpack);
  const int64_t spans = K / F;
  for (int64_t m = m0; m < m0 + count; ++m) {
    const X* xq = reinterpret_cast<const X*>(a.xq.data()) + m * K;
    float acc[kIntRows] = {};
    for (int64_t s = 0; s < spans; ++s) {
      const int32_t Xs = a.sums[m * spans + s];
      const float dm = a.d[m * (K / 32) + s * F / 32];
      const int64_t g = s * F / G;
      int32_t sums[kIntRows] = {};
      for (int64_t k = s * F; k < (s + 1) * F; k += per) {  // rows innermost: the compiler vectorizes
        const W* wk = w + k * kIntRows;
        for (int64_t j = 0; j < per; ++j) {
          const int32_t xj = xq[k + j];
          for (int64_t r = 0; r < kIntRows; ++r) sums[r] += static_cast<int32_t>(wk[r * per + j]) * xj;
        }
      }
      for (int64_t r = 0; r < kIntRows; ++r) {
        const int32_t I = sums[r];
        float t = static_cast<float>(I - off * Xs) * spack[g * kIntRows + r];
        if (mpack) t = std::fma(mpack[g * kIntRows + r], static_cast<float>(Xs), t);
        acc[r] = std::fma(t, dm, acc[r]);
      }
    }
    for (int64_t r = 0; r < valid; ++r) out[(m - m0) * out_stride + r] = acc[r];
  }
}

#if defined(TG_AVX512) && defined(__GNUC__)
#define TG_VNNI 1
// MT activation rows times RV interleaved groups (16 rows each): int32 sums per span in registers,
// then the span's float step. Built for VNNI whatever the build's flags; called only where the CPU
// has it (__builtin_cpu_supports).
template <int XB, int MT, int RV, bool MINS>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,fma"))) void int_tile_vnni(
    const uint8_t* wpack, int64_t wstride, const float* spack, const float* mpack, int64_t sstride,
    const IntActivations& a, int64_t K, int64_t G, int64_t F, int off, int64_t m0, float* out, int64_t out_stride,
    int64_t valid) {
  constexpr int64_t xb = XB / 8, per = 4 / xb;  // bytes per activation, values per dword
  const int64_t spans = K / F, dstride = K / 32;
  __m512 acc[MT][RV];
  for (int t = 0; t < MT; ++t)
    for (int r = 0; r < RV; ++r) acc[t][r] = _mm512_setzero_ps();
  const uint8_t* xq = a.xq.data() + m0 * K * xb;
  for (int64_t s = 0; s < spans; ++s) {
    __m512i isum[MT][RV];
    for (int t = 0; t < MT; ++t)
      for (int r = 0; r < RV; ++r) isum[t][r] = _mm512_setzero_si512();
    for (int64_t k = s * F; k < (s + 1) * F; k += per) {
      __m512i w[RV];
      for (int r = 0; r < RV; ++r)
        w[r] = _mm512_loadu_si512(reinterpret_cast<const void*>(wpack + r * wstride + k * xb * kIntRows));
      for (int t = 0; t < MT; ++t) {
        int32_t dword;
        std::memcpy(&dword, xq + (t * K + k) * xb, 4);
        const __m512i xv = _mm512_set1_epi32(dword);
        for (int r = 0; r < RV; ++r) {
          if constexpr (XB == 8) isum[t][r] = _mm512_dpbusd_epi32(isum[t][r], w[r], xv);
          else isum[t][r] = _mm512_dpwssd_epi32(isum[t][r], w[r], xv);
        }
      }
    }
    const int64_t g = s * F / G;
    __m512 sc[RV], mn[RV];
    for (int r = 0; r < RV; ++r) {
      sc[r] = _mm512_loadu_ps(spack + r * sstride + g * kIntRows);
      if constexpr (MINS) mn[r] = _mm512_loadu_ps(mpack + r * sstride + g * kIntRows);
    }
    for (int t = 0; t < MT; ++t) {
      const int32_t X = a.sums[(m0 + t) * spans + s];
      const __m512 dm = _mm512_set1_ps(a.d[(m0 + t) * dstride + s * F / 32]);
      for (int r = 0; r < RV; ++r) {
        __m512i i = isum[t][r];
        if (off) i = _mm512_sub_epi32(i, _mm512_set1_epi32(off * X));
        __m512 v = _mm512_mul_ps(_mm512_cvtepi32_ps(i), sc[r]);
        if constexpr (MINS) v = _mm512_fmadd_ps(mn[r], _mm512_set1_ps(static_cast<float>(X)), v);
        acc[t][r] = _mm512_fmadd_ps(v, dm, acc[t][r]);
      }
    }
  }
  for (int t = 0; t < MT; ++t)
    for (int r = 0; r < RV; ++r) {
      const int64_t lanes = std::min<int64_t>(kIntRows, valid - r * kIntRows);
      if (lanes <= 0) continue;
      _mm512_mask_storeu_ps(out + t * out_stride + r * kIntRows, static_cast<__mmask16>((1u << lanes) - 1u),
                            acc[t][r]);
    }
}

template <int XB, int RV, bool MINS>
void int_rows_vnni(const uint8_t* wpack, int64_t wstride, const float* spack, const float* mpack, int64_t sstride,
                   const IntActivations& a, int64_t M, int64_t K, int64_t G, int64_t F, int off, float* out,
                   int64_t out_stride, int64_t valid) {
  int64_t m = 0;
  for (; m + kTileRows <= M; m += kTileRows)
    int_tile_vnni<XB, kTileRows, RV, MINS>(wpack, wstride, spack, mpack, sstride, a, K, G, F, off, m,
                                          out + m * out_stride, out_stride, valid);
  for (; m < M; ++m)
    int_tile_vnni<XB, 1, RV, MINS>(wpack, wstride, spack, mpack, sstride, a, K, G, F, off, m,
                                   out + m * out_stride, out_stride, valid);
}

bool cpu_has_vnni() {
  static const bool has = __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512bw");
  return has;
}
#endif

template <int XB>
void qlinear_int_impl(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                      const std::optional<at::Tensor>& mins, int64_t bits, int64_t group, at::Tensor& out) {
  using X = typename IntTypes<XB>::X;
  using W = typename IntTypes<XB>::W;
  const int64_t K = x.size(1), M = x.size(0), N = qweight.size(0), F = int_span(group);
  IntActivations a{std::vector<uint8_t>(M * K * sizeof(X)), std::vector<float>(M * K / 32),
                   std::vector<int32_t>(M * K / F)};
  const float* xp = x.data_ptr<float>();
  std::vector<char> bad(M, 0);
  at::parallel_for(0, M, 16, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) {
      const float* xm = xp + m * K;
      X* xq = reinterpret_cast<X*>(a.xq.data()) + m * K;
      if (!std::all_of(xm, xm + K, [](float v) { return std::isfinite(v); })) {
        bad[m] = 1;  // no integer rounding of inf or NaN: the row's products are NaN (below)
        std::fill(xq, xq + K, static_cast<X>(0));
        std::fill(a.d.begin() + m * (K / 32), a.d.begin() + (m + 1) * (K / 32), 0.f);
      } else {
        round_to_ints(xm, K, xq, a.d.data() + m * (K / 32));
      }
      for (int64_t s = 0; s < K / F; ++s) {
        int32_t sum = 0;
        for (int64_t k = s * F; k < (s + 1) * F; ++k) sum += xq[k];
        a.sums[m * (K / F) + s] = sum;
      }
    }
  });
  const int off = XB == 8 && bits == 8 ? 128 : 0;
  const int64_t groups = K / group, wstride = K * static_cast<int64_t>(sizeof(W)) * kIntRows,
                sstride = groups * kIntRows;
  dispatch(bits, scales, [&](auto bits_tag, auto scale_tag) {
    constexpr int BITS = decltype(bits_tag)::value;
    using S = decltype(scale_tag);
    const uint8_t* qp = static_cast<const uint8_t*>(qweight.data_ptr());
    const S* sp = static_cast<const S*>(scales.data_ptr());
    const S* mp = mins ? static_cast<const S*>(mins->data_ptr()) : nullptr;
    float* op = out.data_ptr<float>();
    // Two interleaved groups (32 rows) per task: their integers (~20-128 KB) stay in L1/L2 while every
    // activation row passes over them.
    constexpr int64_t kGroups = kTileGroups;
    const int64_t slabs = (N + kGroups * kIntRows - 1) / (kGroups * kIntRows);
    at::parallel_for(0, slabs, 1, [&](int64_t b0, int64_t b1) {
      std::vector<uint8_t> wpack(kGroups * wstride);
      std::vector<float> spack(kGroups * sstride), mpack(mp ? kGroups * sstride : 0);
      for (int64_t b = b0; b < b1; ++b) {
        const int64_t n0 = b * kGroups * kIntRows;
        const int64_t valid = std::min<int64_t>(kGroups * kIntRows, N - n0);
        const int64_t used = (valid + kIntRows - 1) / kIntRows;
        for (int64_t j = 0; j < used; ++j)
          pack_int_rows<XB, BITS>(qp, sp, mp, qweight.size(1), N, K, group, n0 + j * kIntRows,
                                  wpack.data() + j * wstride, spack.data() + j * sstride,
                                  mp ? mpack.data() + j * sstride : nullptr);
        const float* mpk = mp ? mpack.data() : nullptr;
#ifdef TG_VNNI
        if (cpu_has_vnni()) {
          auto run = [&](auto rv, int64_t j, int64_t rows) {
            constexpr int RV = decltype(rv)::value;
            const float* mj = mp ? mpk + j * sstride : nullptr;
            if (mp)
              int_rows_vnni<XB, RV, true>(wpack.data() + j * wstride, wstride, spack.data() + j * sstride, mj,
                                          sstride, a, M, K, group, F, off, op + n0 + j * kIntRows, N, rows);
            else
              int_rows_vnni<XB, RV, false>(wpack.data() + j * wstride, wstride, spack.data() + j * sstride, mj,
                                           sstride, a, M, K, group, F, off, op + n0 + j * kIntRows, N, rows);
          };
          if (used == kGroups) {
            run(std::integral_constant<int, kGroups>{}, 0, valid);
          } else {  // the last rows: a group at a time
            for (int64_t j = 0; j < used; ++j)
              run(std::integral_constant<int, 1>{}, j, std::min<int64_t>(kIntRows, valid - j * kIntRows));
          }
          continue;
        }
#endif
        for (int64_t j = 0; j < used; ++j)
          int_group_portable<XB>(wpack.data() + j * wstride, spack.data() + j * sstride,
                                 mp ? mpack.data() + j * sstride : nullptr, a, K, group, F, off, 0, M,
                                 op + n0 + j * kIntRows, N, std::min<int64_t>(kIntRows, valid - j * kIntRows));
      }
    });
  });
  for (int64_t m = 0; m < M; ++m)
    if (bad[m]) out[m].fill_(std::numeric_limits<float>::quiet_NaN());
}

// x (M, K) float32 -> (M, N) float32, x rounded to x_bits-bit integers (see above).
at::Tensor qlinear_int_cpu(const at::Tensor& x_in, const at::Tensor& qweight, const at::Tensor& scales,
                           const std::optional<at::Tensor>& mins, int64_t bits, int64_t group, int64_t x_bits) {
  const at::Tensor x = product_rows("qlinear_int", x_in, qweight, scales, mins, bits, group);
  const int64_t K = x.size(1), M = x.size(0), N = qweight.size(0);
  TORCH_CHECK(x_bits == 8 || x_bits == 16, "qlinear_int: x_bits must be 8 or 16, got ", x_bits);
  TORCH_CHECK(int_span(group) > 0 && K % 32 == 0,
              "qlinear_int: needs groups that divide 32 values or are a multiple of them, and a multiple of 32 ",
              "features; got groups of ", group, " over ", K);
  at::Tensor out = at::empty({M, N}, x.options());
  if (x_bits == 8) qlinear_int_impl<8>(x, qweight, scales, mins, bits, group, out);
  else qlinear_int_impl<16>(x, qweight, scales, mins, bits, group, out);
  auto shape = x_in.sizes().vec();
  shape.back() = N;
  return out.view(shape);
}

// The rows that may hold each row's maximum: n with approx + bound >= max over n' of approx - bound
// (float32 sums, as the caller would form them; the bound's slack covers their rounding). Returns the
// indices, row after row, ascending, and how many each row has.
std::tuple<at::Tensor, at::Tensor> bounded_candidates_cpu(const at::Tensor& approx, const at::Tensor& bound) {
  TORCH_CHECK(approx.scalar_type() == at::kFloat && bound.scalar_type() == at::kFloat && approx.dim() == 2 &&
                  approx.sizes() == bound.sizes() && approx.is_contiguous() && bound.is_contiguous(),
              "bounded_candidates: approx and bound must be contiguous float32 (M, N) tensors of one shape");
  const int64_t M = approx.size(0), N = approx.size(1);
  std::vector<int64_t> picked;
  at::Tensor counts = at::empty({M}, approx.options().dtype(at::kLong));
  for (int64_t m = 0; m < M; ++m) {
    const float* a = approx.data_ptr<float>() + m * N;
    const float* b = bound.data_ptr<float>() + m * N;
    float best = -std::numeric_limits<float>::infinity();
    const size_t before = picked.size();
    int64_t n = 0;
#ifdef TG_AVX2
    __m256 top = _mm256_set1_ps(best);
    for (; n + 8 <= N; n += 8)
      top = _mm256_max_ps(top, _mm256_sub_ps(_mm256_loadu_ps(a + n), _mm256_loadu_ps(b + n)));
    float lanes[8];
    _mm256_storeu_ps(lanes, top);
    for (float v : lanes) best = std::max(best, v);
#endif
    for (int64_t r = n; r < N; ++r) best = std::max(best, a[r] - b[r]);
    n = 0;
#ifdef TG_AVX2
    const __m256 floor = _mm256_set1_ps(best);
    for (; n + 8 <= N; n += 8) {
      const __m256 upper = _mm256_add_ps(_mm256_loadu_ps(a + n), _mm256_loadu_ps(b + n));
      unsigned mask = _mm256_movemask_ps(_mm256_cmp_ps(upper, floor, _CMP_GE_OQ));
      for (; mask; mask &= mask - 1) picked.push_back(n + __builtin_ctz(mask));
    }
#endif
    for (; n < N; ++n)
      if (a[n] + b[n] >= best) picked.push_back(n);
    counts.data_ptr<int64_t>()[m] = static_cast<int64_t>(picked.size() - before);
  }
  at::Tensor indices = at::empty({static_cast<int64_t>(picked.size())}, counts.options());
  std::copy(picked.begin(), picked.end(), indices.data_ptr<int64_t>());
  return {indices, counts};
}

// ||(s q)[n]|| per row (float32, rounded up): what qlinear_bounds' rows are measured by.
at::Tensor row_norms_cpu(const at::Tensor& qweight, const at::Tensor& scales, int64_t bits, int64_t group) {
  const int64_t K = in_features(qweight, bits);
  check_layout(qweight, scales, std::nullopt, bits, group, K);
  const int64_t N = qweight.size(0), groups = K / group, row_bytes = qweight.size(1);
  at::Tensor out = at::empty({N}, scales.options().dtype(at::kFloat));
  dispatch(bits, scales, [&](auto bits_tag, auto scale_tag) {
    constexpr int BITS = decltype(bits_tag)::value;
    using S = decltype(scale_tag);
    const S* sp = static_cast<const S*>(scales.data_ptr());
    const uint8_t* qp = static_cast<const uint8_t*>(qweight.data_ptr());
    float* op = out.data_ptr<float>();
    at::parallel_for(0, N, 64, [&](int64_t n0, int64_t n1) {
      for (int64_t n = n0; n < n1; ++n) {
        double total = 0;
        for (int64_t g = 0; g < groups; ++g) {
          int64_t squares = 0;
          for (int64_t k = g * group; k < (g + 1) * group; ++k) {
            const int64_t v = q_at<BITS>(qp + n * row_bytes, k);
            squares += v * v;
          }
          const double s = to_float(sp[n * groups + g]);
          total += s * s * static_cast<double>(squares);
        }
        op[n] = static_cast<float>(std::sqrt(total) * (1.0 + 1.0 / 1048576));
      }
    });
  });
  return out;
}

// ── RMSNorm in one call ──────────────────────────────────────────────────────────────────────
//
// x * (mean(x^2) + eps)^-1/2 * scale over the last dimension, float32, with scale = weight, 1 + weight
// (Gemma 1-3) or 1 (no weight). The mean is accumulated in double (eight interleaved sums, then added
// in a fixed order: one serial chain of K additions was ~0.6 us of a 640-value norm) and rounded
// once, so the result is the reference's to a float32 rounding, not its bits (its float32 sum has
// its own order): a quantized model uses it in place of a dozen small operators per norm.
at::Tensor rms_norm_cpu(const at::Tensor& x_in, const std::optional<at::Tensor>& weight, double eps,
                        bool plus_one) {
  TORCH_CHECK(x_in.scalar_type() == at::kFloat, "rms_norm: float32 input expected, got ", x_in.scalar_type());
  const int64_t K = x_in.size(-1);
  const at::Tensor x = x_in.reshape({-1, K}).contiguous();
  const int64_t M = x.size(0);
  // The weight's factors (1 + w or w), as the reference rounds them; the pointer read once (a
  // data_ptr() per value cost ~3 us per 640-value norm).
  std::vector<float> scale;
  if (weight) {
    TORCH_CHECK(weight->numel() == K, "rms_norm: weight of ", weight->numel(), " values for ", K, " features");
    const at::Tensor w = weight->to(at::kFloat).contiguous();
    const float* wp = w.data_ptr<float>();
    scale.resize(K);
    for (int64_t k = 0; k < K; ++k) scale[k] = plus_one ? 1.0f + wp[k] : wp[k];
  }
  const float* sp = weight ? scale.data() : nullptr;
  at::Tensor out = at::empty_like(x);
  const float* xp = x.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, M, std::max<int64_t>(1, 16384 / std::max<int64_t>(K, 1)), [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) {
      const float* row = xp + m * K;
      float* dst = op + m * K;
      double part[8] = {0, 0, 0, 0, 0, 0, 0, 0};
      int64_t k = 0;
      for (; k + 8 <= K; k += 8)
        for (int j = 0; j < 8; ++j) part[j] += static_cast<double>(row[k + j]) * row[k + j];
      for (; k < K; ++k) part[k % 8] += static_cast<double>(row[k]) * row[k];
      const double squares = ((part[0] + part[1]) + (part[2] + part[3])) + ((part[4] + part[5]) + (part[6] + part[7]));
      const float r = static_cast<float>(1.0 / std::sqrt(static_cast<double>(static_cast<float>(squares / K)) + eps));
      if (sp) {
        for (int64_t k = 0; k < K; ++k) dst[k] = row[k] * r * sp[k];
      } else {
        for (int64_t k = 0; k < K; ++k) dst[k] = row[k] * r;
      }
    }
  });
  return out.view(x_in.sizes());
}

// RoPE in one call: x (B, T, H, D) float32 rotated by cos/sin tables (B, T, D), half-split pairs
// (dimension j with j + D/2). Per value x * cos + r * sin with r = -x[j + D/2] or x[j - D/2], two
// products and a sum rounded as torch's operators round them (no fused multiply-add): the bits of
// layers.apply_rope.
at::Tensor rope_cpu(const at::Tensor& x_in, const at::Tensor& cos_in, const at::Tensor& sin_in) {
  TORCH_CHECK(x_in.scalar_type() == at::kFloat && cos_in.scalar_type() == at::kFloat &&
                  sin_in.scalar_type() == at::kFloat,
              "rope: float32 tensors expected");
  TORCH_CHECK(x_in.dim() == 4 && cos_in.dim() == 3 && sin_in.sizes() == cos_in.sizes() &&
                  cos_in.size(0) == x_in.size(0) && cos_in.size(1) == x_in.size(1) &&
                  cos_in.size(2) == x_in.size(3) && x_in.size(3) % 2 == 0,
              "rope: x (B, T, H, D) and tables (B, T, D) expected, got ", x_in.sizes(), " and ", cos_in.sizes());
  const at::Tensor x = x_in.contiguous(), c = cos_in.contiguous(), s = sin_in.contiguous();
  const int64_t rows = x.size(0) * x.size(1), H = x.size(2), D = x.size(3), half = D / 2;
  at::Tensor out = at::empty_like(x);
  const float* xp = x.data_ptr<float>();
  const float* cp = c.data_ptr<float>();
  const float* sp = s.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, rows, std::max<int64_t>(1, 16384 / std::max<int64_t>(H * D, 1)), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float* cr = cp + r * D;
      const float* sr = sp + r * D;
      for (int64_t h = 0; h < H; ++h) {
        const float* xr = xp + (r * H + h) * D;
        float* o = op + (r * H + h) * D;
        for (int64_t j = 0; j < half; ++j) o[j] = xr[j] * cr[j] + (-xr[j + half]) * sr[j];
        for (int64_t j = half; j < D; ++j) o[j] = xr[j] * cr[j] + xr[j - half] * sr[j];
      }
    }
  });
  return out;
}

// ── Attention of one new token ───────────────────────────────────────────────────────────────
//
// A decode step's attention: one query per head against S keys, every key seen (no mask), keys
// and values shared by groups of H / Hkv query heads. softmax(scale * q k^T) v in float32, each
// group of heads reading its keys and values once, on one thread per (row, KV head): for one token
// the work is too small to share (scaled_dot_product_attention spends more on its two threads than
// on the sums). Exponentials by a polynomial good to ~1 ulp, so the result is the exact softmax's
// to a float32 rounding, not sdpa's bits.

#ifdef TG_AVX2
// e^x for x <= 0, 8 lanes: x = n ln2 + r with |r| <= ln2 / 2, e^r = 1 + r + r^2 P(r) (Cephes' expf
// coefficients), times 2^n. Below -87.3 (e^x < 2^-126) the lanes give e^-87.3, not 0: nothing that
// adds to a sum of at least 1 (the largest term) notices.
inline __m256 exp_nonpositive(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.3f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.f)));
  const __m256i two_n = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(two_n));
}

// The sums of eight vectors' lanes, as the lanes of one.
inline __m256 hsum8(const __m256 (&a)[8]) {
  const __m256 t0 = _mm256_hadd_ps(a[0], a[1]), t1 = _mm256_hadd_ps(a[2], a[3]);
  const __m256 t2 = _mm256_hadd_ps(a[4], a[5]), t3 = _mm256_hadd_ps(a[6], a[7]);
  const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}
#endif

// q (B, H, 1, D), k and v (B, Hkv, S, D) (any strides but the last) -> (B, 1, H, D), float32.
at::Tensor decode_attention_cpu(const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in,
                                double scale_in) {
  TORCH_CHECK(q_in.scalar_type() == at::kFloat && k_in.scalar_type() == at::kFloat &&
                  v_in.scalar_type() == at::kFloat,
              "decode_attention: float32 tensors expected");
  TORCH_CHECK(q_in.dim() == 4 && q_in.size(2) == 1 && k_in.dim() == 4 && v_in.sizes() == k_in.sizes() &&
                  k_in.size(0) == q_in.size(0) && k_in.size(3) == q_in.size(3) && k_in.size(1) > 0 &&
                  q_in.size(1) % k_in.size(1) == 0 && k_in.size(2) > 0,
              "decode_attention: q (B, H, 1, D) and k, v (B, Hkv, S, D) expected, got ", q_in.sizes(), ", ",
              k_in.sizes(), ", ", v_in.sizes());
  const at::Tensor q = q_in.contiguous();
  const at::Tensor k = k_in.stride(3) == 1 ? k_in : k_in.contiguous();
  const at::Tensor v = v_in.stride(3) == 1 ? v_in : v_in.contiguous();
  const int64_t B = q.size(0), H = q.size(1), Hkv = k.size(1), S = k.size(2), D = q.size(3), G = H / Hkv;
  const float scale = static_cast<float>(scale_in);
  at::Tensor out = at::empty({B, 1, H, D}, q.options());
  const float* qp = q.data_ptr<float>();
  const float* kp = k.data_ptr<float>();
  const float* vp = v.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, B * Hkv, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> probs(G * S);
    for (int64_t bk = begin; bk < end; ++bk) {
      const int64_t b = bk / Hkv, kh = bk % Hkv;
      const float* keys = kp + b * k.stride(0) + kh * k.stride(1);
      const float* values = vp + b * v.stride(0) + kh * v.stride(1);
      const float* queries = qp + (b * H + kh * G) * D;  // the group's G query heads, one after another
      float* outs = op + (b * H + kh * G) * D;
      // Scores: every key read once for the group's heads.
      int64_t j0 = 0;
#ifdef TG_AVX2
      if (G % 4 == 0 && D % 8 == 0) {
        // Two keys x four heads at a time: eight independent chains, summed together at the end.
        for (; j0 + 2 <= S; j0 += 2) {
          const float* key0 = keys + j0 * k.stride(2);
          const float* key1 = key0 + k.stride(2);
          for (int64_t g0 = 0; g0 < G; g0 += 4) {
            __m256 acc[8];
            for (int i = 0; i < 8; ++i) acc[i] = _mm256_setzero_ps();
            for (int64_t d = 0; d < D; d += 8) {
              const __m256 a0 = _mm256_loadu_ps(key0 + d), a1 = _mm256_loadu_ps(key1 + d);
              for (int i = 0; i < 4; ++i) {
                const __m256 qv = _mm256_loadu_ps(queries + (g0 + i) * D + d);
                acc[i] = _mm256_fmadd_ps(qv, a0, acc[i]);
                acc[4 + i] = _mm256_fmadd_ps(qv, a1, acc[4 + i]);
              }
            }
            alignas(32) float dots[8];
            _mm256_store_ps(dots, hsum8(acc));
            for (int i = 0; i < 4; ++i) {
              probs[(g0 + i) * S + j0] = dots[i] * scale;
              probs[(g0 + i) * S + j0 + 1] = dots[4 + i] * scale;
            }
          }
        }
      }
#endif
      for (int64_t j = j0; j < S; ++j) {
        const float* key = keys + j * k.stride(2);
        for (int64_t g = 0; g < G; ++g) {
          const float* query = queries + g * D;
          float dot = 0.f;
          for (int64_t d = 0; d < D; ++d) dot += query[d] * key[d];
          probs[g * S + j] = dot * scale;
        }
      }
      // Softmax of each head's scores (the division left for the end).
      std::vector<float> sums(G);
      for (int64_t g = 0; g < G; ++g) {
        float* p = probs.data() + g * S;
        const float top = *std::max_element(p, p + S);
        int64_t j = 0;
        float sum = 0.f;
#ifdef TG_AVX2
        __m256 total = _mm256_setzero_ps();
        for (; j + 8 <= S; j += 8) {
          const __m256 e = exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(p + j), _mm256_set1_ps(top)));
          _mm256_storeu_ps(p + j, e);
          total = _mm256_add_ps(total, e);
        }
        sum = hsum(total);
#endif
        for (; j < S; ++j) {
          p[j] = std::exp(p[j] - top);
          sum += p[j];
        }
        sums[g] = sum;
      }
      // Outputs: every value read once for the group's heads.
      std::fill(outs, outs + G * D, 0.f);
      int64_t d0 = 0;
#ifdef TG_AVX2
      if (G % 4 == 0) {
        // Sixteen values of four heads held in registers across all keys.
        for (; d0 + 16 <= D; d0 += 16) {
          for (int64_t g0 = 0; g0 < G; g0 += 4) {
            __m256 acc[4][2];
            for (int i = 0; i < 4; ++i) acc[i][0] = acc[i][1] = _mm256_setzero_ps();
            for (int64_t j = 0; j < S; ++j) {
              const float* value = values + j * v.stride(2) + d0;
              const __m256 v0 = _mm256_loadu_ps(value), v1 = _mm256_loadu_ps(value + 8);
              for (int i = 0; i < 4; ++i) {
                const __m256 w = _mm256_broadcast_ss(&probs[(g0 + i) * S + j]);
                acc[i][0] = _mm256_fmadd_ps(w, v0, acc[i][0]);
                acc[i][1] = _mm256_fmadd_ps(w, v1, acc[i][1]);
              }
            }
            for (int i = 0; i < 4; ++i) {
              _mm256_storeu_ps(outs + (g0 + i) * D + d0, acc[i][0]);
              _mm256_storeu_ps(outs + (g0 + i) * D + d0 + 8, acc[i][1]);
            }
          }
        }
      }
#endif
      for (int64_t j = 0; j < S; ++j) {
        const float* value = values + j * v.stride(2);
        for (int64_t g = 0; g < G; ++g) {
          const float w = probs[g * S + j];
          for (int64_t d = d0; d < D; ++d) outs[g * D + d] += w * value[d];
        }
      }
      for (int64_t g = 0; g < G; ++g)
        for (int64_t d = 0; d < D; ++d) outs[g * D + d] /= sums[g];
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(torchgemma, CPU, m) {
  m.impl("decode_attention", &decode_attention_cpu);
  m.impl("rope", &rope_cpu);
  m.impl("qlinear", &qlinear_cpu);
  m.impl("dequantize", &dequantize_cpu);
  m.impl("qlinear_dense", &qlinear_dense_cpu);
  m.impl("qlinear_int", &qlinear_int_cpu);
  m.impl("qlinear_bounds", &qlinear_bounds_cpu);
  m.impl("row_norms", &row_norms_cpu);
  m.impl("bounded_candidates", &bounded_candidates_cpu);
  m.impl("rms_norm", &rms_norm_cpu);
}
