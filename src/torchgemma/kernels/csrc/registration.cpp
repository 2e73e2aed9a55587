// The one library's entry: the CPU kernels of torchgemma::* registered once, each a call through
// the table of the instruction set chosen at run time (portable, AVX2 or AVX-512: every kernel
// source is compiled once per set into namespace torchgemma::<set>, see build.py). This file is
// compiled without any set's flags, so it runs on every CPU; it links first, so the out-of-line
// copies of shared inline code (ATen, the standard library) that the linker keeps are its
// baseline ones, never a copy built for a wider set.
//
// Driven from Python through ctypes (torchgemma/kernels/library.py): the build's digest is checked,
// a set chosen (torchgemma_select), and only then the kernels registered (torchgemma_register),
// so that a stale library is never registered. Tests switch sets in-process with torchgemma_select.

#include <torch/library.h>

#include <atomic>
#include <cpuid.h>
#include <cstring>
#include <exception>
#include <string>

#define TG_ISA portable
#include "ops.h"
#undef TG_ISA
#define TG_ISA avx2
#include "ops.h"
#undef TG_ISA
#define TG_ISA avx512
#include "ops.h"
#undef TG_ISA

#ifndef TG_DIGEST
#error "compile with -DTG_DIGEST=\"<digest of the sources, flags and torch version>\" (build.py)"
#endif

namespace torchgemma {
namespace {

struct Kernels {
  decltype(&portable::qlinear_cpu) qlinear;
  decltype(&portable::dequantize_cpu) dequantize;
  decltype(&portable::qlinear_dense_cpu) qlinear_dense;
  decltype(&portable::qlinear_int_cpu) qlinear_int;
  decltype(&portable::qlinear_bounds_cpu) qlinear_bounds;
  decltype(&portable::qlinear_bounds_into_cpu) qlinear_bounds_into;
  decltype(&portable::row_norms_cpu) row_norms;
  decltype(&portable::bounded_candidates_cpu) bounded_candidates;
  decltype(&portable::rms_norm_cpu) rms_norm;
  decltype(&portable::rope_cpu) rope;
  decltype(&portable::gelu_mul_cpu) gelu_mul;
  decltype(&portable::decode_attention_cpu) decode_attention;
  decltype(&portable::decode_attention_ring_cpu) decode_attention_ring;
  decltype(&portable::decode_layer_qkv_cpu) decode_layer_qkv;
  decltype(&portable::decode_layer_output_cpu) decode_layer_output;
};

#define TG_KERNELS(isa)                                                                                         \
  Kernels {                                                                                                     \
    &isa::qlinear_cpu, &isa::dequantize_cpu, &isa::qlinear_dense_cpu, &isa::qlinear_int_cpu,                  \
        &isa::qlinear_bounds_cpu, &isa::qlinear_bounds_into_cpu, &isa::row_norms_cpu, &isa::bounded_candidates_cpu, &isa::rms_norm_cpu,      \
        &isa::rope_cpu, &isa::gelu_mul_cpu, &isa::decode_attention_cpu, &isa::decode_attention_ring_cpu, &isa::decode_layer_qkv_cpu, \
        &isa::decode_layer_output_cpu                                                                          \
  }

constexpr int kSets = 3;
const char* const kNames[kSets] = {"portable", "avx2", "avx512"};
const Kernels kTables[kSets] = {TG_KERNELS(portable), TG_KERNELS(avx2), TG_KERNELS(avx512)};

std::atomic<const Kernels*> active{nullptr};

const Kernels& kernels() { return *active.load(std::memory_order_acquire); }

// The features each set's flags assume: AVX2 = AVX2, FMA and F16C (-mavx2 -mfma -mf16c); AVX-512 =
// those and AVX-512 F, BW, VL and DQ (ATen's own test for its AVX512 kernels).
bool cpu_supports(const char* name) {
  __builtin_cpu_init();
  const auto f16c = [] {
    unsigned a = 0, b = 0, c = 0, d = 0;
    return __get_cpuid(1, &a, &b, &c, &d) && (c & bit_F16C);
  };
  const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && f16c();
  const bool avx512 = avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
  if (!std::strcmp(name, "portable")) return true;
  if (!std::strcmp(name, "avx2")) return avx2;
  if (!std::strcmp(name, "avx512")) return avx512;
  if (!std::strcmp(name, "avx512vnni")) return avx512 && __builtin_cpu_supports("avx512vnni");
  return false;
}

// The registered kernels: each a call through the chosen set's table.
at::Tensor qlinear(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                   const std::optional<at::Tensor>& mins, int64_t bits, int64_t group) {
  return kernels().qlinear(x, qweight, scales, mins, bits, group);
}
at::Tensor dequantize(const at::Tensor& qweight, const at::Tensor& scales, const std::optional<at::Tensor>& mins,
                      int64_t bits, int64_t group) {
  return kernels().dequantize(qweight, scales, mins, bits, group);
}
at::Tensor qlinear_dense(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                         const std::optional<at::Tensor>& mins, int64_t bits, int64_t group) {
  return kernels().qlinear_dense(x, qweight, scales, mins, bits, group);
}
at::Tensor qlinear_int(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                       const std::optional<at::Tensor>& mins, int64_t bits, int64_t group, int64_t x_bits) {
  return kernels().qlinear_int(x, qweight, scales, mins, bits, group, x_bits);
}
std::tuple<at::Tensor, at::Tensor> qlinear_bounds(const at::Tensor& x, const at::Tensor& qweight,
                                                  const at::Tensor& scales, const std::optional<at::Tensor>& mins,
                                                  int64_t bits, int64_t group, const at::Tensor& row_norms) {
  return kernels().qlinear_bounds(x, qweight, scales, mins, bits, group, row_norms);
}
void qlinear_bounds_into(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                         const std::optional<at::Tensor>& mins, int64_t bits, int64_t group,
                         const at::Tensor& row_norms, at::Tensor& approx, at::Tensor& bound) {
  kernels().qlinear_bounds_into(x, qweight, scales, mins, bits, group, row_norms, approx, bound);
}
at::Tensor row_norms(const at::Tensor& qweight, const at::Tensor& scales, int64_t bits, int64_t group) {
  return kernels().row_norms(qweight, scales, bits, group);
}
std::tuple<at::Tensor, at::Tensor> bounded_candidates(const at::Tensor& approx, const at::Tensor& bound) {
  return kernels().bounded_candidates(approx, bound);
}
at::Tensor rms_norm(const at::Tensor& x, const std::optional<at::Tensor>& weight, double eps, bool plus_one) {
  return kernels().rms_norm(x, weight, eps, plus_one);
}
at::Tensor rope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  return kernels().rope(x, cos, sin);
}
at::Tensor gelu_mul(const at::Tensor& gate, const at::Tensor& up) { return kernels().gelu_mul(gate, up); }
at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale,
                            const std::optional<at::Tensor>& visible) {
  return kernels().decode_attention(q, k, v, scale, visible);
}
at::Tensor decode_attention_ring(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale,
                                 const at::Tensor& visible, const at::Tensor& slots, const at::Tensor& offsets) {
  return kernels().decode_attention_ring(q, k, v, scale, visible, slots, offsets);
}

using OptionalTensors = c10::List<std::optional<at::Tensor>>;
std::tuple<at::Tensor, at::Tensor, at::Tensor> decode_layer_qkv(const at::Tensor& x, const at::Tensor& cos,
                                                                const at::Tensor& sin, const OptionalTensors& products,
                                                                at::IntArrayRef formats, const OptionalTensors& norms,
                                                                at::ArrayRef<double> eps, at::IntArrayRef plus_one,
                                                                int64_t head_dim) {
  return kernels().decode_layer_qkv(x, cos, sin, products, formats, norms, eps, plus_one, head_dim);
}
at::Tensor decode_layer_output(const at::Tensor& x, const at::Tensor& attended, const OptionalTensors& products,
                               at::IntArrayRef formats, const OptionalTensors& norms, at::ArrayRef<double> eps,
                               at::IntArrayRef plus_one) {
  return kernels().decode_layer_output(x, attended, products, formats, norms, eps, plus_one);
}

std::string error;  // the last failure's message (torchgemma_error)

}  // namespace
}  // namespace torchgemma

extern "C" {

// What this library was built from (build.py's digest): a library whose digest is not the sources'
// is stale and is not registered.
const char* torchgemma_digest() { return TG_DIGEST; }

// 1 if this CPU runs the set (or feature) `name` ("portable", "avx2", "avx512", "avx512vnni"), else 0.
int torchgemma_cpu_supports(const char* name) { return torchgemma::cpu_supports(name) ? 1 : 0; }

// Chooses the set the kernels run: 0 done; 1 no such set; 2 this CPU lacks it.
int torchgemma_select(const char* name) {
  for (int i = 0; i < torchgemma::kSets; ++i) {
    if (std::strcmp(name, torchgemma::kNames[i])) continue;
    if (!torchgemma::cpu_supports(name)) return 2;
    torchgemma::active.store(&torchgemma::kTables[i], std::memory_order_release);
    return 0;
  }
  return 1;
}

// The chosen set's name, or "" before any choice.
const char* torchgemma_selected() {
  const auto* table = torchgemma::active.load(std::memory_order_acquire);
  for (int i = 0; i < torchgemma::kSets; ++i)
    if (table == &torchgemma::kTables[i]) return torchgemma::kNames[i];
  return "";
}

// Registers the CPU kernels (once; a set must be chosen first): 0 done, else torchgemma_error() says why.
int torchgemma_register() {
  static torch::Library* library = nullptr;
  if (library) return 0;
  if (!torchgemma::active.load()) {
    torchgemma::error = "torchgemma_register: no instruction set chosen (torchgemma_select)";
    return 1;
  }
  try {
    auto* fresh = new torch::Library(torch::Library::IMPL, "torchgemma", c10::DispatchKey::CPU, __FILE__, __LINE__);
    fresh->impl("qlinear", TORCH_FN(torchgemma::qlinear));
    fresh->impl("dequantize", TORCH_FN(torchgemma::dequantize));
    fresh->impl("qlinear_dense", TORCH_FN(torchgemma::qlinear_dense));
    fresh->impl("qlinear_int", TORCH_FN(torchgemma::qlinear_int));
    fresh->impl("qlinear_bounds", TORCH_FN(torchgemma::qlinear_bounds));
    fresh->impl("qlinear_bounds_into", TORCH_FN(torchgemma::qlinear_bounds_into));
    fresh->impl("row_norms", TORCH_FN(torchgemma::row_norms));
    fresh->impl("bounded_candidates", TORCH_FN(torchgemma::bounded_candidates));
    fresh->impl("rms_norm", TORCH_FN(torchgemma::rms_norm));
    fresh->impl("rope", TORCH_FN(torchgemma::rope));
    fresh->impl("gelu_mul", TORCH_FN(torchgemma::gelu_mul));
    fresh->impl("decode_attention", TORCH_FN(torchgemma::decode_attention));
    fresh->impl("decode_attention_ring", TORCH_FN(torchgemma::decode_attention_ring));
    fresh->impl("decode_layer_qkv", TORCH_FN(torchgemma::decode_layer_qkv));
    fresh->impl("decode_layer_output", TORCH_FN(torchgemma::decode_layer_output));
    library = fresh;
  } catch (const std::exception& e) {
    torchgemma::error = e.what();
    return 1;
  }
  return 0;
}

const char* torchgemma_error() { return torchgemma::error.c_str(); }

}  // extern "C"
