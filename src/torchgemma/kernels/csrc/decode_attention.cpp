// decode_attention: one new token's attention over all its keys.

#include "common.h"

namespace torchgemma::TG_ISA {

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

}  // namespace torchgemma::TG_ISA
