// qlinear (a few rows: the weight's integers read once, never dequantized), dequantize, and
// qlinear_dense (many rows: slabs of dequantized rows through the float32 BLAS). The layout: common.h.
//
// The product never materialises W: per group it forms dot(x, q) in float32 and adds
// scale * dot + min * sum(x), so a decode step reads each weight byte once. This is what makes
// weight-only quantization fast on a CPU: batch-1 decode is bound by the bytes read per token.
// Threads: ATen's pool, split over output rows.

#include <ATen/ThreadLocalState.h>
#include <ATen/ops/mm.h>

#include "common.h"

namespace torchgemma::TG_ISA {

// How many activation rows share one pass over a weight row (its integers are converted once).
constexpr int64_t kRowBlock = 4;

#ifdef TG_AVX2

// Kernels that read R weight rows side by side (R > 1) fetch the next R rows' bytes this far ahead of
// where they read their own, a cache line per row as they cross one, and those rows' scales: R
// interleaved row streams are more than the hardware's prefetch follows. The 270M's 27 4-bit
// weights (640 x 1024 and 640 x 2048 with mins), one row, read in a decode step's order (Zen 4,
// medians of 15 interleaved passes): 3.10 -> 2.15 ms at one thread, 2.09 -> 1.52 at two; 0-1024
// bytes ahead measured, 128 within 4% of 256-512.
constexpr int64_t kAhead = 256;

template <int R, typename S>
inline void fetch_next_rows(const void* q, int64_t q_stride, int64_t offset, const S* scales, int64_t groups_stride,
                            int64_t g, bool with_scales) {
  for (int r = 0; r < R; ++r)
    _mm_prefetch(static_cast<const char*>(q) + (R + r) * q_stride + offset + kAhead, _MM_HINT_T0);
  if (with_scales)
    for (int r = 0; r < R; ++r) _mm_prefetch(reinterpret_cast<const char*>(scales + (R + r) * groups_stride + g), _MM_HINT_T0);
}

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
      if (R > 1 && k % 64 == 0) fetch_next_rows<R>(q, q_stride, k, scales, groups_stride, g, k % (16 * G) == 0);
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

// Running sums in 16 lanes per (activation row, weight row), added together once at the end: an
// AVX-512 build keeps them in one 512-bit register, AVX2 in two (lanes 0-7, 8-15), the same sums.
template <int MB, int R>
struct Lanes {
#ifdef TG_AVX512
  __m512 sum[MB][R];
  Lanes() {
    for (int m = 0; m < MB; ++m)
      for (int r = 0; r < R; ++r) sum[m][r] = _mm512_setzero_ps();
  }
  // sum += s * v, lane by lane.
  void add(int m, int r, __m512 s, __m512 v) { sum[m][r] = _mm512_fmadd_ps(s, v, sum[m][r]); }
#else
  __m256 low[MB][R], high[MB][R];
  Lanes() {
    for (int m = 0; m < MB; ++m)
      for (int r = 0; r < R; ++r) low[m][r] = high[m][r] = _mm256_setzero_ps();
  }
  // Lanes 0-7 (half 0) or 8-15 (half 1) += s * v.
  void add(int m, int r, int half, __m256 s, __m256 v) {
    __m256& lanes = half ? high[m][r] : low[m][r];
    lanes = _mm256_fmadd_ps(s, v, lanes);
  }
#endif
  // out[m * R + r]: the 16 lanes' total (lane i + lane i + 8, then those 8 added pairwise).
  void store(float* out) const {
    for (int m = 0; m < MB; ++m)
      for (int r = 0; r < R; ++r)
#ifdef TG_AVX512
        out[m * R + r] = hsum(fold(sum[m][r]));
#else
        out[m * R + r] = hsum(_mm256_add_ps(low[m][r], high[m][r]));
#endif
  }
};

// rows_q8 for groups of exactly 32 values (GGUF's Q8_0 and Q5_0). Each group's 32 products go to 16
// lanes (value i with value i + 16), and each lane keeps its own sum of scale x lane over the groups;
// the 16 lanes are added once, at the end. An AVX-512 build keeps a row's lanes in one 512-bit
// register (one FMA per group); AVX2 in two (lanes 0-7: values 0-7 and 16-23; 8-15: 8-15 and 24-31),
// the same sums in the same order. Against folding the lanes per group (an extract, an add and a
// 256-bit FMA per group), with qlinear_cpu's row loop below, the 2048 x 640 product at one thread
// (Zen 4, weights in cache, medians of 7 interleaved): 1 row 87 -> 74 us (AVX2 set 89 -> 80); 4, 8
// and 16 rows 187 -> 167, 356 -> 322, 705 -> 639 us; but the AVX2 set's 4, 8 and 16 rows 173 -> 191,
// 326 -> 371, 669 -> 742 us (a sixth FMA per 8 lanes where the multipliers bind; a CPU with
// AVX-512 takes the AVX-512 set). A decode step of the 270M (Zen 4, interleaved): 23.5 -> 22.8 ms at
// one thread, 14.6 -> 14.2 at two. Four activation rows per pass (kRowBlock): eight, as before,
// took 358 / 712 us at 8 / 16 rows (AVX-512), and the AVX2 set's 16 registers cannot hold 16 sums.
template <int MB, int R, typename S>
inline void rows_q8_g32(const int8_t* q, int64_t q_stride, const S* scales, int64_t groups_stride, int64_t K,
                        const float* x, int64_t x_stride, float* acc_out) {
  Lanes<MB, R> lanes;
  for (int64_t g = 0; g < K / 32; ++g) {
    const int64_t k = g * 32;
    for (int r = 0; r < R; ++r) {
      const int8_t* qr = q + r * q_stride + k;
#ifdef TG_AVX512
      const __m512 s = _mm512_set1_ps(to_float(scales[r * groups_stride + g]));
      const __m512 w0 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qr))));
      const __m512 w1 =
          _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qr + 16))));
      for (int m = 0; m < MB; ++m) {
        const float* xm = x + m * x_stride + k;
        lanes.add(m, r, s, _mm512_fmadd_ps(w1, _mm512_loadu_ps(xm + 16), _mm512_mul_ps(w0, _mm512_loadu_ps(xm))));
      }
#else
      const __m256 s = _mm256_set1_ps(to_float(scales[r * groups_stride + g]));
      // Lanes 0-7 for every row, then lanes 8-15: two weight vectors live at a time, not four.
      for (int half = 0; half < 2; ++half) {
        const __m256 wa = load_i8(qr + 8 * half), wb = load_i8(qr + 16 + 8 * half);
        for (int m = 0; m < MB; ++m) {
          const float* xm = x + m * x_stride + k + 8 * half;
          lanes.add(m, r, half, s, _mm256_fmadd_ps(wb, _mm256_loadu_ps(xm + 16), _mm256_mul_ps(wa, _mm256_loadu_ps(xm))));
        }
      }
#endif
    }
  }
  lanes.store(acc_out);
}

// rows_q8 for groups of exactly 16 values (GGUF's Q6_K, with float32 scales): each value's product
// scaled and summed over the groups in its own lane (16 lanes: one 512-bit register, or two 256-bit
// ones for AVX2, the same sums), the lanes added once, at the end. Against rows_q8 (two chains added
// and scaled per group), 640 x 2048, one thread, Zen 4, interleaved: 1 / 2 / 4 / 8 rows in cache 93 ->
// 70, 155 -> 119, 226 -> 201, 446 -> 396 us (AVX2 set 96 -> 84, 154 -> 123, 227 -> 207, 450 -> 407);
// the 270M's nine from memory, one row, 1347 -> 1162 us. With rows_qn_g32, a 270M decode step
// 23.8 -> 23.5 ms at one thread, 15.3 -> 15.3 at two (interleaved).
template <int MB, int R, typename S>
inline void rows_q8_g16(const int8_t* q, int64_t q_stride, const S* scales, int64_t groups_stride, int64_t K,
                        const float* x, int64_t x_stride, float* acc_out) {
  Lanes<MB, R> lanes;
  for (int64_t g = 0; g < K / 16; ++g) {
    const int64_t k = g * 16;
    if (R > 1 && k % 64 == 0) fetch_next_rows<R>(q, q_stride, k, scales, groups_stride, g, k % 256 == 0);
    for (int r = 0; r < R; ++r) {
      const int8_t* qr = q + r * q_stride + k;
#ifdef TG_AVX512
      const __m512 s = _mm512_set1_ps(to_float(scales[r * groups_stride + g]));
      const __m512 w = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qr))));
      for (int m = 0; m < MB; ++m) lanes.add(m, r, s, _mm512_mul_ps(w, _mm512_loadu_ps(x + m * x_stride + k)));
#else
      const __m256 s = _mm256_set1_ps(to_float(scales[r * groups_stride + g]));
      const __m256 w0 = load_i8(qr), w1 = load_i8(qr + 8);
      for (int m = 0; m < MB; ++m) {
        const float* xm = x + m * x_stride + k;
        lanes.add(m, r, 0, s, _mm256_mul_ps(w0, _mm256_loadu_ps(xm)));
        lanes.add(m, r, 1, s, _mm256_mul_ps(w1, _mm256_loadu_ps(xm + 8)));
      }
#endif
    }
  }
  lanes.store(acc_out);
}

// The 32 values of a 4- or 5-bit block as float32: w[0..3] values 0-7, 8-15, 16-23, 24-31.
template <int BITS>
inline void unpack_block(const uint8_t* block, __m256 (&w)[4]) {
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
}

#ifdef TG_AVX512
// The same as two 512-bit vectors: values 0-15, 16-31.
template <int BITS>
inline void unpack_block(const uint8_t* block, __m512& w0, __m512& w1) {
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
}
#endif

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
      const int64_t offset = k / 32 * block_bytes(BITS);
      if (R > 1 && offset % 64 < block_bytes(BITS))  // the first block to start in a cache line
        fetch_next_rows<R>(q, q_stride, offset, scales, groups_stride, g, g % 16 == 0 && k == g * G);
      for (int r = 0; r < R; ++r) {
        const uint8_t* block = q + r * q_stride + k / 32 * block_bytes(BITS);
#ifdef TG_AVX512
        __m512 w0, w1;  // values k .. k+15, k+16 .. k+31
        unpack_block<BITS>(block, w0, w1);
        for (int m = 0; m < MB; ++m) {
          const float* xm = x + m * x_stride + k;
          dot[m][r] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(xm), dot[m][r]);
          dot[m][r] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(xm + 16), dot[m][r]);
        }
#else
        __m256 w[4];  // values k .. k+7, k+8 .. k+15, k+16 .. k+23, k+24 .. k+31
        unpack_block<BITS>(block, w);
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

// rows_qn for groups of exactly 32 values (GGUF's Q4_K, Q5_K; the int4 mode's default): one block per
// group, whose two chains (as rows_qn's) go straight to 16 lanes of scaled sums per row, added once,
// at the end (one 512-bit register per row on AVX-512, two 256-bit ones on AVX2: the same sums).
// Against rows_qn (a fold and a 256-bit FMA per group), the 270M's 27 Q4_K weights, one row, one
// thread, Zen 4, interleaved: 2086 -> 1980 us from memory; 640 x 1024 in cache 1 / 2 / 4 / 8 rows
// 47 -> 44, 75 -> 64, 115 -> 100, 211 -> 184 us (AVX2 set 52 -> 46, 74 -> 69, 115 -> 108, 214 ->
// 201). Longer groups keep rows_qn: this order there cost the AVX2 set's 4 rows 5-11% (its 16
// registers cannot hold the sums and the chains).
template <int MB, int R, int BITS, typename S>
inline void rows_qn_g32(const uint8_t* q, int64_t q_stride, const S* scales, int64_t groups_stride, int64_t K,
                        const float* x, int64_t x_stride, float* acc_out) {
  Lanes<MB, R> lanes;
  const int64_t groups = K / 32;
  for (int64_t g = 0; g < groups; ++g) {
    const int64_t k = g * 32, offset = g * block_bytes(BITS);
    if (R > 1 && offset % 64 < block_bytes(BITS))  // the first block to start in a cache line
      fetch_next_rows<R>(q, q_stride, offset, scales, groups_stride, g, g % 16 == 0);
    for (int r = 0; r < R; ++r) {
      const uint8_t* block = q + r * q_stride + offset;
      const float scale = to_float(scales[r * groups_stride + g]);
#ifdef TG_AVX512
      __m512 w0, w1;
      unpack_block<BITS>(block, w0, w1);
      const __m512 sv = _mm512_set1_ps(scale);
      for (int m = 0; m < MB; ++m) {
        const float* xm = x + m * x_stride + k;
        lanes.add(m, r, sv, _mm512_fmadd_ps(w1, _mm512_loadu_ps(xm + 16), _mm512_mul_ps(w0, _mm512_loadu_ps(xm))));
      }
#else
      __m256 w[4];
      unpack_block<BITS>(block, w);
      const __m256 sv = _mm256_set1_ps(scale);
      for (int m = 0; m < MB; ++m) {
        const float* xm = x + m * x_stride + k;
        lanes.add(m, r, 0, sv, _mm256_fmadd_ps(w[2], _mm256_loadu_ps(xm + 16), _mm256_mul_ps(w[0], _mm256_loadu_ps(xm))));
        lanes.add(m, r, 1, sv, _mm256_fmadd_ps(w[3], _mm256_loadu_ps(xm + 24), _mm256_mul_ps(w[1], _mm256_loadu_ps(xm + 8))));
      }
#endif
    }
  }
  lanes.store(acc_out);
}

#endif  // TG_AVX2

// Portable version (any CPU): the same sums, left to the compiler to vectorise.
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

// MB activation rows against R weight rows (out: MB x R), by the best path the build has.
template <int BITS, typename S>
inline void block_dot(const uint8_t* q, int64_t q_stride, const S* scales, int64_t groups, int64_t K, int64_t G,
                      const float* x, int64_t x_stride, int64_t rows, int64_t weights, float* acc_out) {
#ifdef TG_AVX2
  auto run = [&](auto mb, auto r) {
    constexpr int MB = decltype(mb)::value, R = decltype(r)::value;
    if constexpr (BITS == 8) {
      if (G == 32) return rows_q8_g32<MB, R>(reinterpret_cast<const int8_t*>(q), q_stride, scales, groups, K, x, x_stride, acc_out);
      if (G == 16) return rows_q8_g16<MB, R>(reinterpret_cast<const int8_t*>(q), q_stride, scales, groups, K, x, x_stride, acc_out);
      rows_q8<MB, R>(reinterpret_cast<const int8_t*>(q), q_stride, scales, groups, K, G, x, x_stride, acc_out);
    } else {
      if (G == 32) return rows_qn_g32<MB, R, BITS>(q, q_stride, scales, groups, K, x, x_stride, acc_out);
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
// four independent chains (16.0 -> 12.3 ms); 8-bit rows in groups of 32 stream fastest one at a time
// (14 ms; 27-34 ms with two or four, whose interleaved loads the prefetcher serves worse; with the
// next rows fetched ahead, the 270M's 126 layer weights' 8-bit groups of 32 still took 8.7 ms one at a
// time against 11.7 / 12.5 two / four at a time). 8-bit groups of 16 (GGUF's Q6_K) end a chain of
// scale FMAs every 16 values, so one row waits on their latency: four at a time, the next four fetched
// ahead (the 270M's nine 640 x 2048 Q6_K weights, one row, a decode step's order, Zen 4: 2.49 -> 2.16
// ms at one thread, 1.23 -> 1.16 at two; calls of one activation row now stream one weight row at a
// time instead, see qlinear_cpu; a last single row of a longer call keeps four). 5-bit rows (the
// fifth bits take more registers): two at a time for one or two activation rows (one row, 262144 x 640 with float16 scales: 18.4 ms with one,
// 17.5 with two, 19.7 with four; 8-bit rows take 13.3).
inline int64_t weight_block(int64_t rows, int64_t bits, int64_t group) {
  if (bits == 8) return group != 32 && rows == 1 ? 4 : 1;
  if (bits == 5) return rows <= 2 ? 2 : 1;
  return rows == 1 ? 4 : rows == 2 ? 2 : 1;
}

// One activation row against an 8-bit weight: its rows read as this many streams (qlinear_cpu).
constexpr int64_t kRowStreams = 3;

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
  // Tiles of weight rows (~32 KB) outermost: a tile is read from memory once and stays in L1/L2 while
  // every block of activation rows (kRowBlock x K floats, in L1) passes over it, so M rows cost one
  // pass over the weight until the arithmetic binds. (Activation rows outermost re-read the weight
  // from memory per block; single weight rows outermost stream all M x K activations from L2 per row.)
  const int64_t tile = std::max<int64_t>(4, (32 << 10) / std::max<int64_t>(row_bytes, 1));
#ifdef TG_AVX2
  // Activation row m against weight row n of 8-bit groups of 32 (Q8_0, Q5_0): the kernel itself, without
  // block_dot's dispatch per row (2048 x 640, one thread, Zen 4: 5% of the product).
  const auto row_q8_g32 = [&](int64_t m, int64_t n) {
    rows_q8_g32<1, 1>(reinterpret_cast<const int8_t*>(qp) + n * row_bytes, row_bytes, sp + n * groups, groups, K,
                      xp + m * K, K, op + m * N + n);
  };
#endif
  if constexpr (BITS == 8) {
    // One activation row (a decode step) against 8-bit rows (Q8_0, Q5_0, Q6_K, the int8 mode), one
    // weight row at a time, the rows read as kRowStreams streams side by side (row r of each third,
    // then row r + 1 of each), as qlinear_bounds reads the greedy head: one core keeps more of
    // memory's bandwidth busy with a few sequential streams than with one. Each row's value is the
    // same whichever way the rows are taken. Against tiles of rows (8-bit groups other than 32 four
    // rows at a time), one thread, Zen 4, weights from memory, interleaved in one process: the 270M's
    // 126 layer weights in a decode step's order 9.0 -> 8.2 and 9.4 -> 8.6 ms (its 640 x 2048 Q6_K
    // weights 2.5 -> 1.8-2.0) while the machine's memory was shared (one stream read at 18 GB/s,
    // 28 when quiet); quiet, 8.2 -> 6.8 (with its 4-bit ones streamed too). Together with
    // qlinear_bounds' one-row loop (greedy_head.cpp), decode steps 21.7 -> 18.7 ms at one thread,
    // 17.2 -> 16.5 at two (memory shared). Synthetic weights, quiet: 2048 x 640 in groups of 64
    // 141 -> 89 us, 2048 x 2048 in groups of 128 342 -> 235; the 262144 x 640 Q8_0 head (sampled
    // steps, read so before) 12.9 / 11.5 / 9.0 / 9.1 ms with 1 / 2 / 3 / 4 streams. Two streams
    // measured within noise of three. (4- and 5-bit rows keep the tiles: their several rows per pass
    // measured level with streams or faster, e.g. 4-bit 640 x 2048 84 against 93 us.)
    if (M == 1) {
      parallel_streams(N, kRowStreams, std::max(grain, tile), [&](int64_t n) {
#ifdef TG_AVX2
        if (group == 32 && !mp) return row_q8_g32(0, n);
#endif
        float y;
        block_dot<BITS>(qp + n * row_bytes, row_bytes, sp + n * groups, groups, K, group, xp, K, 1, 1, &y);
        if (mp) y += min_dot(mp + n * groups, xs, groups);
        op[n] = y;
      });
      return;
    }
  }
  // Tasks of whole tiles, taken in turn (parallel_tasks: a preempted thread delays only its tile).
  parallel_tasks(N, std::max(grain, tile), [&](int64_t t0, int64_t t1) {
    float acc[kRowBlock * 4];
    for (int64_t n0 = t0; n0 < t1; n0 += tile) {
      const int64_t n1 = std::min(t1, n0 + tile);
      for (int64_t m0 = 0; m0 < M; m0 += kRowBlock) {
        const int64_t rows = std::min(kRowBlock, M - m0);
        const int64_t block = weight_block(rows, bits, group);
#ifdef TG_AVX2
        if constexpr (BITS == 8) {
          // One activation row against 8-bit groups of 32 (a decode step's Q8_0 and Q5_0 weights).
          if (group == 32 && rows == 1 && !mp) {
            for (int64_t n = n0; n < n1; ++n) row_q8_g32(m0, n);
            continue;
          }
        }
#endif
        for (int64_t n = n0; n < n1;) {
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
  const int64_t K = check_layout("dequantize", qweight, scales, mins, bits, group);
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
  auto shape = x_in.sizes().vec();
  shape.back() = N;
  if (N == 0) return out.view(shape);  // no rows: no slabs (the slab count below divides by the slab's rows)
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
  return out.view(shape);
}

}  // namespace torchgemma::TG_ISA
