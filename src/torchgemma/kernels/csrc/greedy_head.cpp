// The greedy head's helpers: qlinear_bounds (approximate scores and their bounds), row_norms and
// bounded_candidates (QuantizedWeight.argmax in torchgemma/quantization/modules.py).

#include "common.h"

namespace torchgemma::TG_ISA {

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
constexpr int64_t kHeadStreams = 3;  // qlinear_bounds' weight rows: see there

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

#ifdef TG_AVX2
// approx_row for MB activation rows at once (xq[m], d[m]): the weight row's blocks are loaded (and
// unpacked) once for all of them. Each row's sums are approx_row's, in its order (block b into chain
// b % 2, the two chains added at the end), so a row's approx does not depend on the rows beside it.
template <int BITS, int MB, typename S>
inline void approx_rows(const uint8_t* q, const S* scales, int64_t K, int64_t G, const int8_t* const* xq,
                        const float* const* d, float* out) {
  const int64_t blocks = K / 32;
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 t[2][MB];
  for (int m = 0; m < MB; ++m) t[0][m] = t[1][m] = _mm256_setzero_ps();
  auto block = [&](int64_t b, __m256 (&chain)[MB]) {
    const float s = to_float(scales[b * 32 / G]);
    __m256i w, aw;
    if constexpr (BITS == 8) {
      w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + b * 32));
      aw = _mm256_abs_epi8(w);
    } else {
      const __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + b * 16));
      const __m128i low = _mm_set1_epi8(0x0F);
      w = aw = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(packed, 4), low), _mm_and_si128(packed, low));
    }
    for (int m = 0; m < MB; ++m) {
      const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq[m] + b * 32));
      const __m256i pairs =
          BITS == 8 ? _mm256_maddubs_epi16(aw, _mm256_sign_epi8(xv, w)) : _mm256_maddubs_epi16(aw, xv);
      const __m256 dot = _mm256_cvtepi32_ps(_mm256_madd_epi16(pairs, ones));
      chain[m] = _mm256_fmadd_ps(_mm256_set1_ps(s * d[m][b]), dot, chain[m]);
    }
  };
  int64_t b = 0;
  for (; b + 2 <= blocks; b += 2) {
    block(b, t[0]);
    block(b + 1, t[1]);
  }
  if (b < blocks) block(b, t[0]);
  for (int m = 0; m < MB; ++m) out[m] = hsum(_mm256_add_ps(t[0][m], t[1][m]));
}
#endif

// Rows `count` (<= 4) of xq against one weight row: approx_rows where the build has AVX2.
template <int BITS, typename S>
inline void approx_block(const uint8_t* q, const S* scales, int64_t K, int64_t G, const int8_t* const* xq,
                         const float* const* d, int64_t count, float* out) {
#ifdef TG_AVX2
  switch (count) {
    case 4: return approx_rows<BITS, 4>(q, scales, K, G, xq, d, out);
    case 3: return approx_rows<BITS, 3>(q, scales, K, G, xq, d, out);
    case 2: return approx_rows<BITS, 2>(q, scales, K, G, xq, d, out);
    default: out[0] = approx_row<BITS>(q, scales, K, G, xq[0], d[0]);  // one row: its own loop (~8% faster)
  }
#else
  for (int64_t m = 0; m < count; ++m) out[m] = approx_row<BITS>(q, scales, K, G, xq[m], d[m]);
#endif
}

std::tuple<at::Tensor, at::Tensor> qlinear_bounds_cpu(const at::Tensor& x_in, const at::Tensor& qweight,
                                                      const at::Tensor& scales, const std::optional<at::Tensor>& mins,
                                                      int64_t bits, int64_t group, const at::Tensor& row_norms) {
  product_rows("qlinear_bounds", x_in, qweight, scales, mins, bits, group);  // (its checks, before sizing)
  auto shape = x_in.sizes().vec();
  shape.back() = qweight.size(0);
  at::Tensor approx = at::empty(shape, x_in.options().dtype(at::kFloat)), bound = at::empty(shape, approx.options());
  qlinear_bounds_into_cpu(x_in, qweight, scales, mins, bits, group, row_norms, approx, bound);
  return {approx, bound};
}

// qlinear_bounds into given tensors (float32, contiguous, x's shape with N last): a decode loop keeps
// them, instead of two fresh (1, 262144) tensors per step whose freed memory small allocations then
// split, so that the next step's pair came from new heap pages (QuantizedWeight._bounds).
void qlinear_bounds_into_cpu(const at::Tensor& x_in, const at::Tensor& qweight, const at::Tensor& scales,
                             const std::optional<at::Tensor>& mins, int64_t bits, int64_t group,
                             const at::Tensor& row_norms, at::Tensor& approx, at::Tensor& bound) {
  const at::Tensor x = product_rows("qlinear_bounds", x_in, qweight, scales, mins, bits, group);
  const int64_t K = x.size(1);
  TORCH_CHECK(bits == 8 || bits == 4, "qlinear_bounds: bits must be 8 or 4, got ", bits);
  TORCH_CHECK(K % 32 == 0 && group % 32 == 0, "qlinear_bounds: needs groups of a multiple of 32 values");
  const int64_t N = qweight.size(0), groups = K / group;
  TORCH_CHECK(row_norms.scalar_type() == at::kFloat && row_norms.dim() == 1 && row_norms.size(0) == N &&
                  row_norms.is_contiguous(),
              "qlinear_bounds: row_norms must be float32 (", N, ")");
  const int64_t M = x.size(0);
  for (const at::Tensor* out : {&approx, &bound})
    TORCH_CHECK(out->scalar_type() == at::kFloat && out->is_contiguous() && out->numel() == M * N &&
                    out->dim() >= 1 && out->size(-1) == N,
                "qlinear_bounds: approx and bound must be contiguous float32 tensors of ", M, " x ", N,
                " values (x's rows by the weight's), got ", out->scalar_type(), " ", out->sizes());
  const std::vector<float> xsum = mins ? group_sums(x, group) : std::vector<float>();
  std::vector<int8_t> xq(M * K);
  std::vector<float> d(M * (K / 32)), beta(M);
  std::vector<int64_t> live;  // the rows with finite activations
  const double gamma = (K + 64) * kUnit / (1.0 - (K + 64) * kUnit);
  for (int64_t m = 0; m < M; ++m) {
    const float* xm = x.data_ptr<float>() + m * K;
    if (!all_finite(xm, K)) {
      // Nothing to bound with: every row stays in doubt (the caller computes them all).
      std::fill(approx.data_ptr<float>() + m * N, approx.data_ptr<float>() + (m + 1) * N, 0.f);
      std::fill(bound.data_ptr<float>() + m * N, bound.data_ptr<float>() + (m + 1) * N,
                std::numeric_limits<float>::infinity());
      continue;
    }
    const auto [err, norm, norm_approx] = quantize_activations(xm, K, xq.data() + m * K, d.data() + m * (K / 32));
    // Per unit of row norm: the rounding of x, then both computations' float32 rounding (1 + 2^-20:
    // this sum's own rounding, in double).
    beta[m] = static_cast<float>((err + 2 * gamma * (norm + norm_approx)) * (1.0 + 1.0 / 1048576));
    live.push_back(m);
  }
  dispatch(bits, scales, [&](auto bits_tag, auto scale_tag) {
    constexpr int BITS = decltype(bits_tag)::value;
    using S = decltype(scale_tag);
    const S* sp = static_cast<const S*>(scales.data_ptr());
    const S* mp = mins ? static_cast<const S*>(mins->data_ptr()) : nullptr;
    const uint8_t* qp = static_cast<const uint8_t*>(qweight.data_ptr());
    const float* rn = row_norms.data_ptr<float>();
    float* ap = approx.data_ptr<float>();
    float* bp = bound.data_ptr<float>();
    const int64_t row_bytes = qweight.size(1), rows = static_cast<int64_t>(live.size());
    const int64_t grain = std::max<int64_t>(1, 16384 / K);
    // Weight rows outermost: each is read from memory once for all M activation rows (whose integers,
    // M x K bytes, stay in L1), so a batch of rows costs about one row's pass until the arithmetic binds.
    // Tried on the 270M's head (262144 x 640, one activation row, Zen 4), each interleaved against this
    // code in one process, and not kept: VNNI scores (vpdpbusd, each lane scaled by its block's s d;
    // 512-bit: 15-17 ms against 11-13 at one thread; 256-bit: within noise of this); a software
    // prefetch 2-64 rows ahead (alone: neutral at one thread, 0.5-1 ms less at two; in decode steps,
    // 4 rows ahead: 31.5 -> 30.7 ms at one thread, 27.1 -> 27.1 at two); the weights on transparent
    // huge pages (THP_MEM_ALLOC_ENABLE=1: no change); VNNI scores again (two blocks per 512-bit
    // vpdpbusd, the same bits: a standalone copy of the loop 5.7-7.7 -> 3.8-4.8 ms in cache; in the
    // kernel, from memory, within noise).
    //
    // The rows are read as kHeadStreams streams side by side (row r of each third, then row r + 1 of
    // each), each thread's share likewise: one core keeps more of memory's bandwidth busy with several
    // sequential streams than with one. The scores' loop reads only the weights and their scales; the
    // bounds follow in a pass of their own. Real 270M, decode steps of one request, Zen 4, 1 / 2 / 3
    // streams interleaved in one process (medians of 8 x 25 steps): the head's call 10.15 / 9.74 /
    // 9.49 ms at one thread, 6.41 / 6.31 / 6.20 at two; the step 24.0 / 23.7 / 23.5 and 16.5 / 16.2 /
    // 16.0 ms. Four: 10.12 against 9.93 ms for one (the head in steps, one thread); six, the head
    // alone: 17.2 against 12.2.
    const auto score = [&](int64_t n) {  // weight row n against every live activation row
      const int8_t* xqs[4];
      const float* ds[4];
      float a4[4];
      for (int64_t i0 = 0; i0 < rows; i0 += 4) {
        const int64_t count = std::min<int64_t>(4, rows - i0);
        for (int64_t i = 0; i < count; ++i) {
          xqs[i] = xq.data() + live[i0 + i] * K;
          ds[i] = d.data() + live[i0 + i] * (K / 32);
        }
        approx_block<BITS>(qp + n * row_bytes, sp + n * groups, K, group, xqs, ds, count, a4);
        for (int64_t j = 0; j < count; ++j) {
          const int64_t m = live[i0 + j];
          float a = a4[j];
          if (mp) a += min_dot(mp + n * groups, xsum.data() + m * groups, groups);
          ap[m * N + n] = a;
        }
      }
    };
    if (rows == 1) {
      // One activation row (a decode step's): the same scores without the batch's bookkeeping
      // (its pointers, counts and index reads per weight row). The 270M's head at one thread,
      // interleaved in one process: 8.6 -> 6.9 ms (two threads 5.4 -> 5.1); a software prefetch
      // 2 or 4 rows ahead on top of it: 7.2 / 7.6.
      const int64_t m = live[0];
      const int8_t* x0 = xq.data() + m * K;
      const float* d0 = d.data() + m * (K / 32);
      const float* s0 = mp ? xsum.data() + m * groups : nullptr;
      float* a0 = ap + m * N;
      parallel_streams(N, kHeadStreams, std::max<int64_t>(grain, 64), [&](int64_t n) {
        float a = approx_row<BITS>(qp + n * row_bytes, sp + n * groups, K, group, x0, d0);
        if (mp) a += min_dot(mp + n * groups, s0, groups);
        a0[n] = a;
      });
    } else {
      parallel_streams(N, kHeadStreams, std::max<int64_t>(grain, 64), score);
    }
    // The bounds after the scores (the scores' loop then reads only the weights and their scales).
    parallel_tasks(N, 4096, [&](int64_t n0, int64_t n1) {
      for (int64_t m : live)
        for (int64_t n = n0; n < n1; ++n) {
          const float a = ap[m * N + n], b = rn[n] * beta[m];
          // 2^-21 of |a| + b: the final additions of both computations, and the caller's a +- b in
          // float32 (each at most 2^-24 relative).
          bp[m * N + n] = b + (std::fabs(a) + b) * (1.0f / 2097152);
        }
    });
  });
}

// The rows that may hold each row's maximum: n with approx + bound >= max over n' of approx - bound
// (float32 sums, as the caller would form them; the bound's slack covers their rounding). A bound of
// one column is the same for every n of its row (int8_bounds): then n with approx >= max(approx) -
// 2 bound, the floor rounded once in float32. Returns the indices, row after row, ascending, and how
// many each row has.
std::tuple<at::Tensor, at::Tensor> bounded_candidates_cpu(const at::Tensor& approx, const at::Tensor& bound) {
  TORCH_CHECK(approx.scalar_type() == at::kFloat && bound.scalar_type() == at::kFloat && approx.dim() == 2 &&
                  bound.dim() == 2 && bound.size(0) == approx.size(0) &&
                  (bound.size(1) == approx.size(1) || bound.size(1) == 1) && approx.is_contiguous() &&
                  bound.is_contiguous(),
              "bounded_candidates: approx must be a contiguous float32 (M, N) tensor and bound one of (M, N) or "
              "(M, 1), got ",
              approx.scalar_type(), " ", approx.sizes(), " and ", bound.scalar_type(), " ", bound.sizes());
  const int64_t M = approx.size(0), N = approx.size(1);
  TORCH_CHECK(N > 0 || M == 0, "bounded_candidates: approx ", approx.sizes(), " has no columns to pick from");
  const bool per_row = bound.size(1) == 1 && N != 1;
  std::vector<int64_t> picked;
  at::Tensor counts = at::empty({M}, approx.options().dtype(at::kLong));
  for (int64_t m = 0; m < M; ++m) {
    const float* a = approx.data_ptr<float>() + m * N;
    const float* b = bound.data_ptr<float>() + m * bound.size(1);
    const size_t before = picked.size();
    if (per_row) {
      // approx >= max(approx) - 2 b: the same test as approx + b >= max(approx - b) for one b
      float best = -std::numeric_limits<float>::infinity();
      int64_t n = 0;
#ifdef TG_AVX2
      __m256 top = _mm256_set1_ps(best);
      for (; n + 8 <= N; n += 8) top = _mm256_max_ps(top, _mm256_loadu_ps(a + n));
      float lanes[8];
      _mm256_storeu_ps(lanes, top);
      for (float v : lanes) best = std::max(best, v);
#endif
      for (; n < N; ++n) best = std::max(best, a[n]);
      const float floor = best - 2.0f * b[0];
      n = 0;
#ifdef TG_AVX2
      const __m256 f = _mm256_set1_ps(floor);
      for (; n + 8 <= N; n += 8) {
        unsigned mask = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(a + n), f, _CMP_GE_OQ));
        for (; mask; mask &= mask - 1) picked.push_back(n + __builtin_ctz(mask));
      }
#endif
      for (; n < N; ++n)
        if (a[n] >= floor) picked.push_back(n);
      counts.data_ptr<int64_t>()[m] = static_cast<int64_t>(picked.size() - before);
      continue;
    }
    float best = -std::numeric_limits<float>::infinity();
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
  const int64_t K = check_layout("row_norms", qweight, scales, std::nullopt, bits, group);
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

}  // namespace torchgemma::TG_ISA
