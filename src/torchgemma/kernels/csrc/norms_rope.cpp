// rms_norm, rope and gelu_mul: a quantized model's norms, rotations and GeGLU activations in one call
// each (CPU fusions).

#include <ATen/ops/empty_like.h>

#include "common.h"

namespace torchgemma::TG_ISA {

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
  // The mean of no values is 0 / 0: a norm over no features is refused, not computed.
  TORCH_CHECK(x_in.dim() >= 1 && x_in.size(-1) > 0, "rms_norm: x ", x_in.sizes(), " has no features to normalize");
  const int64_t K = x_in.size(-1);
  const at::Tensor x = x_in.reshape({-1, K}).contiguous();
  const int64_t M = x.size(0);
  // The weight's factors (1 + w or w), as the reference rounds them; the pointer read once (a
  // data_ptr() per value cost ~3 us per 640-value norm).
  std::vector<float> scale;
  if (weight) {
    TORCH_CHECK(weight->dim() == 1 && weight->numel() == K, "rms_norm: weight ", weight->sizes(), " for ", K,
                " features (one value each)");
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

// ── GeGLU's activation in one call ─────────────────────────────────────────────────────────────
//
// gelu_mul(gate, up) = gelu_tanh(gate) * up, value by value, float32: a quantized model's MLPs
// (FusedGatedMLP, decode_layer_output). gelu_tanh(g) = g / 2 * (1 + tanh(u)) with u = sqrt(2 / pi) *
// (g + 0.044715 g^3) is computed as g / (1 + e^(-2u)), the same function (1 + tanh(u) = 2 / (1 +
// e^(-2u))), so the result is the exact function's to a few float32 roundings everywhere (ATen's
// tanh form loses relative precision where 1 + tanh(u) cancels, g below about -2), not ATen's bits.
// e^y is exp_ieee's (common.h): IEEE operations only, so every instruction set and the reference in
// ops.py give the same bits. ATen's gelu and mul took 438 + 23 us on 125 x 2048 values
// (one thread, Zen 4: its AVX-512 tanh runs at 2.5 ns a value).

constexpr float kGeluBeta = 0.7978845608028654f, kGeluKappa = 0.044715f;

inline float gelu_mul_one(float g, float up) {
  const float u = kGeluBeta * (g + kGeluKappa * ((g * g) * g));
  return g / (1.0f + exp_ieee(u * -2.0f)) * up;
}

at::Tensor gelu_mul_cpu(const at::Tensor& gate_in, const at::Tensor& up_in) {
  TORCH_CHECK(gate_in.scalar_type() == at::kFloat && up_in.scalar_type() == at::kFloat,
              "gelu_mul: float32 tensors expected, got ", gate_in.scalar_type(), " and ", up_in.scalar_type());
  TORCH_CHECK(gate_in.sizes() == up_in.sizes(), "gelu_mul: gate ", gate_in.sizes(), " and up ", up_in.sizes(),
              " differ in shape");
  const at::Tensor gate = gate_in.contiguous(), up = up_in.contiguous();
  at::Tensor out = at::empty_like(gate);
  const float* gp = gate.data_ptr<float>();
  const float* up_p = up.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, gate.numel(), 16384, [&](int64_t i0, int64_t i1) {
    int64_t i = i0;
#ifdef TG_AVX512
    for (; i + 16 <= i1; i += 16) {
      const __m512 g = _mm512_loadu_ps(gp + i);
      const __m512 u = _mm512_mul_ps(
          _mm512_set1_ps(kGeluBeta),
          _mm512_add_ps(g, _mm512_mul_ps(_mm512_set1_ps(kGeluKappa), _mm512_mul_ps(_mm512_mul_ps(g, g), g))));
      const __m512 e = exp_ieee(_mm512_mul_ps(u, _mm512_set1_ps(-2.0f)));
      _mm512_storeu_ps(op + i, _mm512_mul_ps(_mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.0f), e)),
                                             _mm512_loadu_ps(up_p + i)));
    }
#elif defined(TG_AVX2)
    for (; i + 8 <= i1; i += 8) {
      const __m256 g = _mm256_loadu_ps(gp + i);
      const __m256 u = _mm256_mul_ps(
          _mm256_set1_ps(kGeluBeta),
          _mm256_add_ps(g, _mm256_mul_ps(_mm256_set1_ps(kGeluKappa), _mm256_mul_ps(_mm256_mul_ps(g, g), g))));
      const __m256 e = exp_ieee(_mm256_mul_ps(u, _mm256_set1_ps(-2.0f)));
      _mm256_storeu_ps(op + i, _mm256_mul_ps(_mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.0f), e)),
                                             _mm256_loadu_ps(up_p + i)));
    }
#endif
    for (; i < i1; ++i) op[i] = gelu_mul_one(gp[i], up_p[i]);
  });
  return out;
}

}  // namespace torchgemma::TG_ISA
