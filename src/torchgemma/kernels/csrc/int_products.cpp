// qlinear_int: products with activations rounded to integers, for calls of many rows.

#include "common.h"

namespace torchgemma::TG_ISA {

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
// k..k+3 (bytes) or k..k+1 (int16) of each row): the weight's, a slab of rows at a time, in each
// thread's own buffer, for calls of 8-11 rows; the activations', once per call, for calls of 12 rows
// and more (the lane tiles, below). Calls of a few rows with 16-bit activations read the stored
// integers in place instead (int16_direct, below): interleaving would cost more than the products.

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
// weights; XB 16: int16), row after row at `rows` (K values each; rows past N are zero), and their
// scales and mins per group as float32 (16 per group: spack[g * 16 + r]).
template <int XB, int BITS, typename S>
void int_rows(const uint8_t* qp, const S* sp, const S* mp, int64_t row_bytes, int64_t N, int64_t K, int64_t G,
              int64_t n0, uint8_t* rows, float* spack, float* mpack) {
  using W = typename IntTypes<XB>::W;
  const int64_t groups = K / G, row_size = K * static_cast<int64_t>(sizeof(W));
  for (int64_t r = 0; r < kIntRows; ++r) {
    const int64_t n = n0 + r;
    W* row = reinterpret_cast<W*>(rows + r * row_size);
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
}

// 16 rows of `row_size` bytes (row_size a multiple of 4) interleaved a dword at a time:
// dst[j * 64 + r * 4 ..] = row r's dword j.
inline void interleave_dwords16(const uint8_t* rows, int64_t row_size, uint8_t* dst) {
  int64_t at = 0;  // bytes of each row done
#ifdef TG_AVX512
  for (; at + 64 <= row_size; at += 64) transpose_dwords16(rows + at, row_size, dst + at * kIntRows);
#endif
  for (; at < row_size; at += 4)
    for (int64_t r = 0; r < kIntRows; ++r) std::memcpy(dst + at * kIntRows + r * 4, rows + r * row_size + at, 4);
}

// int_rows, interleaved (the portable loop's layout: one 16-lane vector per dword of values).
template <int XB, int BITS, typename S>
void pack_int_rows(const uint8_t* qp, const S* sp, const S* mp, int64_t row_bytes, int64_t N, int64_t K,
                   int64_t G, int64_t n0, uint8_t* wpack, float* spack, float* mpack) {
  const int64_t row_size = K * static_cast<int64_t>(sizeof(typename IntTypes<XB>::W));
  thread_local std::vector<uint8_t> buffer;
  buffer.resize(kIntRows * row_size);
  int_rows<XB, BITS>(qp, sp, mp, row_bytes, N, K, G, n0, buffer.data(), spack, mpack);
  interleave_dwords16(buffer.data(), row_size, wpack);
}

// The activations' rounding: xq (M, K) of XB bits (as bytes), d (M, K / 32), and the span sums X (M, K / F).
struct IntActivations {
  std::vector<uint8_t> xq;
  std::vector<float> d;
  std::vector<int32_t> sums;
};

// The same interleaved for the lane tiles (VNNI, calls of kLaneRows rows or more; below).
struct LaneActivations {
  int64_t groups = 0;
  std::vector<uint8_t> x;     // [lane group][K * xb / 4 dwords][16 rows]
  std::vector<float> d;       // [lane group][K / 32 blocks][16 rows]
  std::vector<int32_t> sums;  // [lane group][K / F spans][16 rows]
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

// Calls of kLaneRows rows or more (prefill, batched decode of 12+ requests) interleave the
// activations instead, 16 rows per lane group a dword at a time, once per call, and broadcast each
// weight row's integers a dword at a time against them (a tile: 4 weight rows times 2 lane groups);
// the accumulators' lanes are 16 activation rows of one output column, transposed on the way out. The
// weight is only widened (int_rows), row after row, with the next 16 rows fetched into L2 while these
// are computed. The same integer sums and float steps in the same order: the same bits as the
// interleaved-weight tiles above. Gemma 3 270M's 126 layer weights, one thread, Zen 4, medians of 15
// calls interleaved in one process (lanes / interleaved weights): 8 rows 32.4 / 30.4 ms, 12 rows 31.9
// / 34.6, 16 rows 32.3 / 39.4, 24 rows 51.0 / 49.6, 48 rows 70.5 / 76.8, 125 rows (the prefill of
// bench_gguf's prompt) 214 / 221 while the machine was shared (the whole prefill 211.6 / 213.5 ms);
// fetching the next rows ahead or not: 16 rows 41.3 / 43.3 ms, 125 rows 166.7 / 168.1. Lanes left empty (8 rows: half of
// the group's) cost what they would have computed, so fewer rows keep the interleaved weights.
constexpr int64_t kLaneRows = 12;

template <int XB>
void lane_activations(const IntActivations& a, int64_t M, int64_t K, int64_t F, LaneActivations& l) {
  const int64_t row = K * (XB / 8), blocks = K / 32, spans = K / F;
  l.groups = (M + kIntRows - 1) / kIntRows;
  l.x.resize(l.groups * kIntRows * row);  // all written below (rows past M as zeros)
  l.d.assign(l.groups * blocks * kIntRows, 0.f);
  l.sums.assign(l.groups * spans * kIntRows, 0);
  at::parallel_for(0, l.groups, 1, [&](int64_t g0, int64_t g1) {
    std::vector<uint8_t> rows(kIntRows * row, 0);
    for (int64_t g = g0; g < g1; ++g) {
      const int64_t m0 = g * kIntRows, count = std::min<int64_t>(kIntRows, M - m0);
      std::memcpy(rows.data(), a.xq.data() + m0 * row, count * row);
      std::memset(rows.data() + count * row, 0, (kIntRows - count) * row);  // rows past M: zero
      interleave_dwords16(rows.data(), row, l.x.data() + g * kIntRows * row);
      for (int64_t r = 0; r < count; ++r) {
        for (int64_t b = 0; b < blocks; ++b) l.d[(g * blocks + b) * kIntRows + r] = a.d[(m0 + r) * blocks + b];
        for (int64_t s = 0; s < spans; ++s) l.sums[(g * spans + s) * kIntRows + r] = a.sums[(m0 + r) * spans + s];
      }
    }
  });
}

// NT weight rows (row after row at w, `row_size` bytes apart; scales and mins at spack / mpack[g * 16 +
// n]) times MG lane groups from g0: the float steps of the interleaved tiles above, per (row, column),
// in the same order. tmp[j * 256 + n * 16 + lane] = column n's value for row lane of group g0 + j.
template <int XB, int NT, int MG, bool MINS>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,fma"))) void int_lane_tile(
    const uint8_t* w, int64_t row_size, const float* spack, const float* mpack, const LaneActivations& l,
    int64_t g0, int64_t K, int64_t G, int64_t F, int off, float* tmp) {
  constexpr int64_t xb = XB / 8, per = 4 / xb;  // bytes per value, values per dword
  const int64_t spans = K / F, blocks = K / 32, gstride = K * xb * kIntRows;
  const uint8_t* x = l.x.data() + g0 * gstride;
  __m512 acc[NT][MG];
  for (int n = 0; n < NT; ++n)
    for (int j = 0; j < MG; ++j) acc[n][j] = _mm512_setzero_ps();
  for (int64_t s = 0; s < spans; ++s) {
    __m512i isum[NT][MG];
    for (int n = 0; n < NT; ++n)
      for (int j = 0; j < MG; ++j) isum[n][j] = _mm512_setzero_si512();
    for (int64_t k = s * F; k < (s + 1) * F; k += per) {
      __m512i xv[MG];
      for (int j = 0; j < MG; ++j)
        xv[j] = _mm512_loadu_si512(reinterpret_cast<const void*>(x + j * gstride + k * xb * kIntRows));
      for (int n = 0; n < NT; ++n) {
        int32_t dword;
        std::memcpy(&dword, w + n * row_size + k * xb, 4);
        const __m512i wv = _mm512_set1_epi32(dword);
        for (int j = 0; j < MG; ++j) {
          if constexpr (XB == 8) isum[n][j] = _mm512_dpbusd_epi32(isum[n][j], wv, xv[j]);
          else isum[n][j] = _mm512_dpwssd_epi32(isum[n][j], xv[j], wv);
        }
      }
    }
    const int64_t g = s * F / G;
    __m512i X[MG];
    __m512 Xf[MG], dm[MG];
    for (int j = 0; j < MG; ++j) {
      X[j] = _mm512_loadu_si512(reinterpret_cast<const void*>(l.sums.data() + ((g0 + j) * spans + s) * kIntRows));
      if constexpr (MINS) Xf[j] = _mm512_cvtepi32_ps(X[j]);
      dm[j] = _mm512_loadu_ps(l.d.data() + ((g0 + j) * blocks + s * F / 32) * kIntRows);
      if (off) X[j] = _mm512_mullo_epi32(X[j], _mm512_set1_epi32(off));
    }
    for (int n = 0; n < NT; ++n) {
      const __m512 sc = _mm512_set1_ps(spack[g * kIntRows + n]);
      __m512 mn;
      if constexpr (MINS) mn = _mm512_set1_ps(mpack[g * kIntRows + n]);
      for (int j = 0; j < MG; ++j) {
        __m512i i = isum[n][j];
        if (off) i = _mm512_sub_epi32(i, X[j]);
        __m512 v = _mm512_mul_ps(_mm512_cvtepi32_ps(i), sc);
        if constexpr (MINS) v = _mm512_fmadd_ps(mn, Xf[j], v);
        acc[n][j] = _mm512_fmadd_ps(v, dm[j], acc[n][j]);
      }
    }
  }
  for (int n = 0; n < NT; ++n)
    for (int j = 0; j < MG; ++j) _mm512_storeu_ps(tmp + j * 256 + n * kIntRows, acc[n][j]);
}

// Weight rows n0..n0 + valid (int_rows' layout at rows, spack, mpack) against every lane group:
// out[m, n0 + n].
template <int XB, bool MINS>
void int_lane_rows(const uint8_t* rows, const float* spack, const float* mpack, const LaneActivations& l,
                   int64_t M, int64_t K, int64_t G, int64_t F, int off, int64_t valid, float* out, int64_t N) {
  constexpr int NT = 4, MG = 2;  // a tile: 4 weight rows times 2 lane groups (32 activation rows)
  const int64_t row_size = K * (XB / 8);
  alignas(64) float tmp[MG * 256];
  alignas(64) float cols[256];
  for (int64_t g0 = 0; g0 < l.groups; g0 += MG) {
    const int64_t mg = std::min<int64_t>(MG, l.groups - g0);
    for (int64_t n = 0; n < valid; n += NT) {
      const uint8_t* w = rows + n * row_size;
      const float* mn = mpack ? mpack + n : nullptr;
      float* t = tmp + n * kIntRows;
      if (mg == MG)
        int_lane_tile<XB, NT, MG, MINS>(w, row_size, spack + n, mn, l, g0, K, G, F, off, t);
      else
        int_lane_tile<XB, NT, 1, MINS>(w, row_size, spack + n, mn, l, g0, K, G, F, off, t);
    }
    const __mmask16 mask = static_cast<__mmask16>((1u << valid) - 1u);
    for (int64_t j = 0; j < mg; ++j) {
      // tmp's block j: column n's 16 rows at n * 16 -> cols: row m's 16 columns at m * 16.
      transpose_dwords16(reinterpret_cast<const uint8_t*>(tmp + j * 256), 64, reinterpret_cast<uint8_t*>(cols));
      const int64_t m0 = (g0 + j) * kIntRows;
      for (int64_t m = 0; m < std::min<int64_t>(kIntRows, M - m0); ++m)
        _mm512_mask_storeu_ps(out + (m0 + m) * N, mask, _mm512_load_ps(cols + m * kIntRows));
    }
  }
}

// Few activation rows, 16-bit (decode steps): the stored integers read in place, no interleaving.
// Per weight row and 32 values, vpmaddwd of the row's int16 (sign- or zero-extended from the stored
// bytes) with the activations' gives 16 exact int32 pair sums; 16 rows' vectors are reduced by a
// transpose-add into the span sums I of all 16 rows (one vector, or two for spans of 16), then the float
// steps above run for the 16 rows at once: the same I, X and float operations, so the same bits.
// Calls of at most this many rows take this path. Gemma 3 270M's 126 layer weights, 1 thread, Zen 4
// (thread CPU time, sum per step, this / interleaved): 7.3 / 15.0 ms at 1 row, 9.1 / 16.4 at 2, about
// even at 4-8 (noisy machine), 49 / 44 at 16: from 8 rows the interleaved tiles (4 activation rows per
// weight load) win. Against the float row kernel (qlinear) with each weight read from memory once per
// call (the lead's check, the same weights grouped by shape, with the prefetch below): 11.8 / 9.0 ms
// at 1 row, slower on the 8-bit 2048 x 640 weights (6.6 / 4.2 ms), level or faster on the rest; so
// decode steps keep the row kernel (quantization/modules.py: INT16_DECODE off).
constexpr int64_t kDirectRows = 7;

// 32 values of row q's block b as int16 (4 bits: see there).
template <int BITS>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,fma"))) inline __m512i block_i16(const uint8_t* q,
                                                                                              int64_t b) {
  if constexpr (BITS == 8) {
    return _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + b * 32)));
  } else if constexpr (BITS == 4) {
    // The 16 bytes twice, masked: values 0..15 (low nibbles), then 16 x values 16..31 (high nibbles,
    // unshifted: the caller divides those sums by 16, exactly).
    const __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + b * 16));
    const __m512i both = _mm512_cvtepu8_epi16(_mm256_broadcastsi128_si256(packed));
    return _mm512_and_si512(both, _mm512_inserti64x4(_mm512_set1_epi16(0x0F), _mm256_set1_epi16(0xF0), 1));
  } else {
    __m128i lo, hi;
    block_bytes_u8<BITS>(q + b * block_bytes(BITS), lo, hi);
    return _mm512_cvtepu8_epi16(_mm256_set_m128i(hi, lo));
  }
}

// Four rows' pair sums -> per 128-bit lane L: the 4 rows' sums of lane L's four dwords.
__attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,fma"))) inline __m512i reduce4(__m512i a, __m512i b,
                                                                                           __m512i c, __m512i d) {
  const __m512i ab = _mm512_add_epi32(_mm512_unpacklo_epi32(a, b), _mm512_unpackhi_epi32(a, b));
  const __m512i cd = _mm512_add_epi32(_mm512_unpacklo_epi32(c, d), _mm512_unpackhi_epi32(c, d));
  return _mm512_add_epi32(_mm512_unpacklo_epi64(ab, cd), _mm512_unpackhi_epi64(ab, cd));
}

// MT activation rows (m0..) times 16 weight rows (q0 + r * row_bytes, r < 16; rows past `valid` repeat
// the last and are not stored), spans of F (32 or 16) values.
template <int BITS, int MT, int F, bool MINS>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,fma"))) void int16_direct_tile(
    const uint8_t* q0, int64_t row_bytes, int64_t valid, const float* spack, const float* mpack,
    const IntActivations& a, int64_t K, int64_t G, int64_t m0, float* out, int64_t out_stride) {
  const uint8_t* rows[16];
  for (int r = 0; r < 16; ++r) rows[r] = q0 + std::min<int64_t>(r, valid - 1) * row_bytes;
  const int64_t spans = K / F, dstride = K / 32;
  const int16_t* xq = reinterpret_cast<const int16_t*>(a.xq.data()) + m0 * K;
  __m512 acc[MT];
  for (int t = 0; t < MT; ++t) acc[t] = _mm512_setzero_ps();
  for (int64_t b = 0; b < K / 32; ++b) {
    if ((b * block_bytes(BITS)) % 64 < block_bytes(BITS)) {
      // The next 16 rows' same cache line, fetched ahead: 16 interleaved row streams defeat the
      // hardware's prefetch (the 270M's 36 2048 x 640 weights, one row, one thread: 8.8 ms of
      // products against the float row kernel's 4.4 without this; the rows past the weight's end
      // are fetched for nothing, never read).
      for (int r = 0; r < 16; ++r)
        _mm_prefetch(reinterpret_cast<const char*>(q0 + (16 + r) * row_bytes + b * block_bytes(BITS)), _MM_HINT_T0);
    }
    __m512i xv[MT], part[MT][4];
    for (int t = 0; t < MT; ++t) xv[t] = _mm512_loadu_si512(reinterpret_cast<const void*>(xq + t * K + b * 32));
    for (int j = 0; j < 4; ++j) {
      __m512i w[4];
      for (int i = 0; i < 4; ++i) w[i] = block_i16<BITS>(rows[4 * j + i], b);
      for (int t = 0; t < MT; ++t)
        part[t][j] = reduce4(_mm512_madd_epi16(w[0], xv[t]), _mm512_madd_epi16(w[1], xv[t]),
                             _mm512_madd_epi16(w[2], xv[t]), _mm512_madd_epi16(w[3], xv[t]));
    }
    for (int t = 0; t < MT; ++t) {
      // part[t][j] lane L: rows 4j..4j+3 over values 8L..8L+7. Lanes 0-1 are the block's first 16
      // values, lanes 2-3 its last 16.
      const __m512i p01 = _mm512_add_epi32(_mm512_shuffle_i32x4(part[t][0], part[t][1], 0x88),
                                           _mm512_shuffle_i32x4(part[t][0], part[t][1], 0xDD));
      const __m512i p23 = _mm512_add_epi32(_mm512_shuffle_i32x4(part[t][2], part[t][3], 0x88),
                                           _mm512_shuffle_i32x4(part[t][2], part[t][3], 0xDD));
      const __m512i first = _mm512_shuffle_i32x4(p01, p23, 0x88);  // row r's sum over values 0..15
      __m512i second = _mm512_shuffle_i32x4(p01, p23, 0xDD);
      if constexpr (BITS == 4) second = _mm512_srai_epi32(second, 4);  // 16 x the sums (block_i16)
      const float dm = a.d[(m0 + t) * dstride + b];
      auto step = [&](__m512i I, int64_t s) {
        const int64_t g = s * F / G;
        __m512 v = _mm512_mul_ps(_mm512_cvtepi32_ps(I), _mm512_loadu_ps(spack + g * kIntRows));
        if constexpr (MINS)
          v = _mm512_fmadd_ps(_mm512_loadu_ps(mpack + g * kIntRows),
                              _mm512_set1_ps(static_cast<float>(a.sums[(m0 + t) * spans + s])), v);
        acc[t] = _mm512_fmadd_ps(v, _mm512_set1_ps(dm), acc[t]);
      };
      if constexpr (F == 32) {
        step(_mm512_add_epi32(first, second), b);
      } else {
        step(first, 2 * b);
        step(second, 2 * b + 1);
      }
    }
  }
  const __mmask16 mask = static_cast<__mmask16>((1u << std::min<int64_t>(16, valid)) - 1u);
  for (int t = 0; t < MT; ++t) _mm512_mask_storeu_ps(out + t * out_stride, mask, acc[t]);
}

template <int BITS, int F, bool MINS>
void int16_direct_rows(const uint8_t* q0, int64_t row_bytes, int64_t valid, const float* spack, const float* mpack,
                       const IntActivations& a, int64_t M, int64_t K, int64_t G, float* out, int64_t out_stride) {
  int64_t m = 0;
  for (; m + 2 <= M; m += 2)
    int16_direct_tile<BITS, 2, F, MINS>(q0, row_bytes, valid, spack, mpack, a, K, G, m, out + m * out_stride,
                                        out_stride);
  if (m < M)
    int16_direct_tile<BITS, 1, F, MINS>(q0, row_bytes, valid, spack, mpack, a, K, G, m, out + m * out_stride,
                                        out_stride);
}

// The products of qlinear_int_impl<16> for M <= kDirectRows and spans of 32 or 16 (false: not taken).
template <int BITS, typename S>
bool int16_direct(const uint8_t* qp, const S* sp, const S* mp, int64_t row_bytes, int64_t N, int64_t K,
                  int64_t G, const IntActivations& a, int64_t M, float* op) {
  const int64_t F = int_span(G);
  if (!cpu_has_vnni() || M > kDirectRows || (F != 32 && F != 16)) return false;
  const int64_t groups = K / G, blocks = (N + kIntRows - 1) / kIntRows;
  const int64_t task = std::max<int64_t>(1, std::min<int64_t>(8, blocks / (4 * at::get_num_threads())));
  parallel_tasks(blocks, task, [&](int64_t b0, int64_t b1) {
    std::vector<float> spack(groups * kIntRows), mpack(mp ? groups * kIntRows : 0);
    for (int64_t blk = b0; blk < b1; ++blk) {
      const int64_t n0 = blk * kIntRows, valid = std::min<int64_t>(kIntRows, N - n0);
      for (int64_t r = 0; r < kIntRows; ++r) {
        const int64_t n = n0 + std::min<int64_t>(r, valid - 1);
        for (int64_t g = 0; g < groups; ++g) {
          spack[g * kIntRows + r] = to_float(sp[n * groups + g]);
          if (mp) mpack[g * kIntRows + r] = to_float(mp[n * groups + g]);
        }
      }
      const uint8_t* q0 = qp + n0 * row_bytes;
      float* o = op + n0;
      if (F == 32 && mp)
        int16_direct_rows<BITS, 32, true>(q0, row_bytes, valid, spack.data(), mpack.data(), a, M, K, G, o, N);
      else if (F == 32)
        int16_direct_rows<BITS, 32, false>(q0, row_bytes, valid, spack.data(), nullptr, a, M, K, G, o, N);
      else if (mp)
        int16_direct_rows<BITS, 16, true>(q0, row_bytes, valid, spack.data(), mpack.data(), a, M, K, G, o, N);
      else
        int16_direct_rows<BITS, 16, false>(q0, row_bytes, valid, spack.data(), nullptr, a, M, K, G, o, N);
    }
  });
  return true;
}
#endif

// The most bytes of rounded activations a thread keeps between qlinear_int calls (1024 rows of 2048
// int16 values; longer calls free theirs).
constexpr size_t kKeptBytes = 4 << 20;

template <int XB>
void qlinear_int_impl(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                      const std::optional<at::Tensor>& mins, int64_t bits, int64_t group, at::Tensor& out) {
  using X = typename IntTypes<XB>::X;
  using W = typename IntTypes<XB>::W;
  const int64_t K = x.size(1), M = x.size(0), N = qweight.size(0), F = int_span(group);
  // The calling thread's buffers, kept from call to call up to kKeptBytes (every value is written
  // below). Against fresh ones per call: the 270M's peak resident memory through bench_gguf's
  // generation 572-583 -> 565-568 MiB (a call's buffers of 160-512 KB no longer land on fresh pages of the
  // heap's free space each time), prefill within noise.
  // (References: a thread_local named inside the parallel loops' lambdas would be each worker's own.)
  thread_local IntActivations kept_activations;
  thread_local LaneActivations kept_lanes;
  IntActivations& a = kept_activations;
  LaneActivations& lanes = kept_lanes;
  a.xq.resize(M * K * sizeof(X));
  a.d.resize(M * K / 32);
  a.sums.resize(M * K / F);
  const float* xp = x.data_ptr<float>();
  std::vector<char> bad(M, 0);
  at::parallel_for(0, M, 16, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) {
      const float* xm = xp + m * K;
      X* xq = reinterpret_cast<X*>(a.xq.data()) + m * K;
      if (!all_finite(xm, K)) {
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
#ifdef TG_VNNI
    if constexpr (XB == 16) {
      if (int16_direct<BITS>(qp, sp, mp, qweight.size(1), N, K, group, a, M, op)) return;
    }
#endif
#ifdef TG_VNNI
    if (cpu_has_vnni() && M >= kLaneRows) {
      LaneActivations& l = lanes;
      lane_activations<XB>(a, M, K, F, l);
      const int64_t blocks = (N + kIntRows - 1) / kIntRows, row_size = K * static_cast<int64_t>(sizeof(W));
      const int64_t task = std::max<int64_t>(1, std::min<int64_t>(8, blocks / (4 * at::get_num_threads())));
      parallel_tasks(blocks, task, [&](int64_t b0, int64_t b1) {
        std::vector<uint8_t> rows(kIntRows * row_size);
        std::vector<float> spack(sstride), mpack(mp ? sstride : 0);
        for (int64_t b = b0; b < b1; ++b) {
          const int64_t n0 = b * kIntRows, valid = std::min<int64_t>(kIntRows, N - n0);
          if (b + 1 < blocks) {  // the next block's rows, fetched while this one is computed
            const char* next = reinterpret_cast<const char*>(qp + (n0 + kIntRows) * qweight.size(1));
            const int64_t bytes = std::min<int64_t>(kIntRows, N - n0 - kIntRows) * qweight.size(1);
            for (int64_t at = 0; at < bytes; at += 64) _mm_prefetch(next + at, _MM_HINT_T1);
          }
          int_rows<XB, BITS>(qp, sp, mp, qweight.size(1), N, K, group, n0, rows.data(), spack.data(),
                             mp ? mpack.data() : nullptr);
          if (mp)
            int_lane_rows<XB, true>(rows.data(), spack.data(), mpack.data(), l, M, K, group, F, off, valid, op + n0, N);
          else
            int_lane_rows<XB, false>(rows.data(), spack.data(), nullptr, l, M, K, group, F, off, valid, op + n0, N);
        }
      });
      return;
    }
#endif
    // Two interleaved groups (32 rows) per task: their integers (~20-128 KB) stay in L1/L2 while every
    // activation row passes over them. (Prefetching the next slab's rows while this one is computed
    // changed nothing measurable: 16 rows through the 270M's head, 39.5 -> 38.3 ms at one thread,
    // 21.7 -> 21.5 at two; through its 126 layer weights, 48.2 -> 46.6 and 32.8 -> 32.6.)
    constexpr int64_t kGroups = kTileGroups;
    const int64_t slabs = (N + kGroups * kIntRows - 1) / (kGroups * kIntRows);
    // Tasks of up to 8 slabs from a shared counter (parallel_tasks: a thread taken off its core holds
    // up only its current task), at least 4 per thread.
    const int64_t task = std::max<int64_t>(1, std::min<int64_t>(8, slabs / (4 * at::get_num_threads())));
    parallel_tasks(slabs, task, [&](int64_t b0, int64_t b1) {
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
  if (a.xq.size() > kKeptBytes) a = IntActivations{};  // a long prefill's: back to the allocator
  if (lanes.x.size() > kKeptBytes) lanes = LaneActivations{};
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

}  // namespace torchgemma::TG_ISA
