// One instruction set's kernels: build.py compiles this file once per set, with that set's flags and
// -DTG_ISA=<set>, so every family's source below lands in namespace torchgemma::<set>. One
// translation unit per set rather than one per source: ATen's headers are parsed, and the inline
// code every source uses instantiated, once per set (28 s of CPU for the AVX2 set, against 70 s as
// five units).

#include "qlinear.cpp"
#include "int_products.cpp"
#include "greedy_head.cpp"
#include "norms_rope.cpp"
#include "decode_attention.cpp"
#include "decode_layer.cpp"
