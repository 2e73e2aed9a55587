// The CPU kernels that one instruction set's build of the sources defines, in namespace
// torchgemma::TG_ISA. No include guard: registration.cpp includes this once per set.

#include <ATen/core/Tensor.h>

#include <ATen/core/List.h>

#include <optional>
#include <tuple>

namespace torchgemma::TG_ISA {

// qlinear.cpp
at::Tensor qlinear_cpu(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                       const std::optional<at::Tensor>& mins, int64_t bits, int64_t group);
at::Tensor dequantize_cpu(const at::Tensor& qweight, const at::Tensor& scales, const std::optional<at::Tensor>& mins,
                          int64_t bits, int64_t group);
at::Tensor qlinear_dense_cpu(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                             const std::optional<at::Tensor>& mins, int64_t bits, int64_t group);
// int_products.cpp
at::Tensor qlinear_int_cpu(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                           const std::optional<at::Tensor>& mins, int64_t bits, int64_t group, int64_t x_bits);
// greedy_head.cpp
std::tuple<at::Tensor, at::Tensor> qlinear_bounds_cpu(const at::Tensor& x, const at::Tensor& qweight,
                                                      const at::Tensor& scales, const std::optional<at::Tensor>& mins,
                                                      int64_t bits, int64_t group, const at::Tensor& row_norms);
void qlinear_bounds_into_cpu(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                             const std::optional<at::Tensor>& mins, int64_t bits, int64_t group,
                             const at::Tensor& row_norms, at::Tensor& approx, at::Tensor& bound);
at::Tensor row_norms_cpu(const at::Tensor& qweight, const at::Tensor& scales, int64_t bits, int64_t group);
std::tuple<at::Tensor, at::Tensor> bounded_candidates_cpu(const at::Tensor& approx, const at::Tensor& bound);
// norms_rope.cpp
at::Tensor rms_norm_cpu(const at::Tensor& x, const std::optional<at::Tensor>& weight, double eps, bool plus_one);
at::Tensor rope_cpu(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin);
at::Tensor gelu_mul_cpu(const at::Tensor& gate, const at::Tensor& up);
// decode_attention.cpp
at::Tensor decode_attention_cpu(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale,
                                const std::optional<at::Tensor>& visible);
at::Tensor decode_attention_ring_cpu(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale,
                                     const at::Tensor& visible, const at::Tensor& slots, const at::Tensor& offsets);
// decode_layer.cpp
std::tuple<at::Tensor, at::Tensor, at::Tensor> decode_layer_qkv_cpu(
    const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, const c10::List<std::optional<at::Tensor>>& products,
    at::IntArrayRef formats, const c10::List<std::optional<at::Tensor>>& norms, at::ArrayRef<double> eps,
    at::IntArrayRef plus_one, int64_t head_dim);
at::Tensor decode_layer_output_cpu(const at::Tensor& x, const at::Tensor& attended,
                                   const c10::List<std::optional<at::Tensor>>& products, at::IntArrayRef formats,
                                   const c10::List<std::optional<at::Tensor>>& norms, at::ArrayRef<double> eps,
                                   at::IntArrayRef plus_one);

}  // namespace torchgemma::TG_ISA
