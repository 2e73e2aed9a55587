// decode_layer_qkv and decode_layer_output: a decoder layer's one-token step (a decode step of a
// quantized model: FusedDecoderLayer in torchgemma/acceleration/cpu_fusions.py) in two calls around
// its attention, which stays in Python with the cache.
//
// Each is the kernels the Python path calls one by one (qlinear, rms_norm, rope, gelu_mul; ATen's
// add), called here in the same order on the same tensors: the same bits, for one dispatch
// where the Python path makes ten. On the 270M (18 layers), the Python left in a decode step with
// every kernel stubbed went 2.9 -> 1.4 ms; real steps at 2 threads 0.5-1.2 ms faster in four
// interleaved runs (~20 ms steps), at 1 thread within noise. The weights come as lists:
//
//   products: (qweight, scales, mins or None) per quantized product; formats: (bits, group size) each
//   norms: each RMSNorm's weight (None: a norm without one); eps, plus_one: one each per norm

#include <ATen/ops/add.h>

#include "common.h"

namespace torchgemma::TG_ISA {
namespace {

using Tensors = c10::List<std::optional<at::Tensor>>;

// x @ W.T for product i of the list (the decode path of QuantizedWeight.matmul: qlinear).
at::Tensor product(const char* op, const at::Tensor& x, const Tensors& products, at::IntArrayRef formats,
                   int64_t i) {
  const std::optional<at::Tensor> qweight = products.get(3 * i), scales = products.get(3 * i + 1);
  TORCH_CHECK(qweight && scales, op, ": product ", i, " has no qweight or no scales");
  return qlinear_cpu(x, *qweight, *scales, products.get(3 * i + 2), formats[2 * i], formats[2 * i + 1]);
}

at::Tensor norm(const at::Tensor& x, const Tensors& weights, at::ArrayRef<double> eps, at::IntArrayRef plus_one,
                int64_t i) {
  return rms_norm_cpu(x, weights.get(i), eps[i], plus_one[i] != 0);
}

void check_lists(const char* op, const Tensors& products, at::IntArrayRef formats, int64_t count,
                 const Tensors& norms, at::ArrayRef<double> eps, at::IntArrayRef plus_one, int64_t min_norms,
                 int64_t max_norms) {
  TORCH_CHECK(static_cast<int64_t>(products.size()) == 3 * count && static_cast<int64_t>(formats.size()) == 2 * count,
              op, ": expected ", count, " products (", 3 * count, " tensors, ", 2 * count, " formats), got ",
              products.size(), " tensors and ", formats.size(), " formats");
  const auto n = static_cast<int64_t>(norms.size());
  TORCH_CHECK(n >= min_norms && n <= max_norms && static_cast<int64_t>(eps.size()) == n &&
                  static_cast<int64_t>(plus_one.size()) == n,
              op, ": expected ", min_norms, "-", max_norms, " norms with an eps and a plus_one each, got ", n,
              " norms, ", eps.size(), " eps and ", plus_one.size(), " plus_one");
}

}  // namespace

// Attention's inputs: x (B, T, hidden) -> query (B, H, T, D), key and value (B, Hkv, T, D), views
// transposed as Attention.forward leaves them. Products q, k, v (v's three entries None: the layer's
// values are its keys' projection, before k's norm and rotation); norms: the layer's input norm, q's,
// k's and, where the layer has one, v's.
std::tuple<at::Tensor, at::Tensor, at::Tensor> decode_layer_qkv_cpu(const at::Tensor& x, const at::Tensor& cos,
                                                                    const at::Tensor& sin, const Tensors& products,
                                                                    at::IntArrayRef formats, const Tensors& norms,
                                                                    at::ArrayRef<double> eps, at::IntArrayRef plus_one,
                                                                    int64_t head_dim) {
  constexpr const char* op = "decode_layer_qkv";
  check_lists(op, products, formats, 3, norms, eps, plus_one, 3, 4);
  TORCH_CHECK(x.dim() == 3 && head_dim > 0, op, ": x (B, T, hidden) and a positive head_dim expected, got ",
              x.sizes(), " and ", head_dim);
  const int64_t B = x.size(0), T = x.size(1);
  const at::Tensor normed = norm(x, norms, eps, plus_one, 0);
  const at::Tensor query =
      rope_cpu(norm(product(op, normed, products, formats, 0).view({B, T, -1, head_dim}), norms, eps, plus_one, 1),
               cos, sin)
          .transpose(1, 2);
  const at::Tensor projected = product(op, normed, products, formats, 1).view({B, T, -1, head_dim});
  at::Tensor value = products.get(6) ? product(op, normed, products, formats, 2).view({B, T, -1, head_dim})
                                     : projected;
  const at::Tensor key = rope_cpu(norm(projected, norms, eps, plus_one, 2), cos, sin).transpose(1, 2);
  if (norms.size() == 4) value = norm(value, norms, eps, plus_one, 3);
  return {query, key, value.transpose(1, 2)};
}

// The rest of the layer after attention: x (B, T, hidden) and attended (B, T, H, D) ->
// h + post_ffw(down(gelu_tanh(gate(m)) * up(m))) with h = x + post_attn(o(attended)), m = pre_ffw(h).
// Products o, gate, up, down; norms post-attention, pre-feedforward, post-feedforward.
at::Tensor decode_layer_output_cpu(const at::Tensor& x, const at::Tensor& attended, const Tensors& products,
                                   at::IntArrayRef formats, const Tensors& norms, at::ArrayRef<double> eps,
                                   at::IntArrayRef plus_one) {
  constexpr const char* op = "decode_layer_output";
  check_lists(op, products, formats, 4, norms, eps, plus_one, 3, 3);
  TORCH_CHECK(attended.dim() >= 2, op, ": attended (B, T, ...) expected, got ", attended.sizes());
  const at::Tensor out =
      product(op, attended.reshape({attended.size(0), attended.size(1), -1}), products, formats, 0);
  const at::Tensor h = at::add(x, norm(out, norms, eps, plus_one, 0));
  const at::Tensor m = norm(h, norms, eps, plus_one, 1);
  const at::Tensor gated = gelu_mul_cpu(product(op, m, products, formats, 1), product(op, m, products, formats, 2));
  return at::add(h, norm(product(op, gated, products, formats, 3), norms, eps, plus_one, 2));
}

}  // namespace torchgemma::TG_ISA
