"""Weight-only quantization as a transform of a built model (the model file stays plain).

    model = torchgemma.quantize(torchgemma.load(...), "int8")          # or "int4", group_size=...
    model = torchgemma.load("model.gguf", quantize="gguf")             # the file's own blocks

What is quantized: the text decoder's linear layers, its token table (which is also the tied LM
head, about half the bytes of a small model), the per-layer-embedding table and the stacked weights
of the experts. What is not: norms, the MoE router, soft-caps, the vision and audio towers.
Activations stay in the model's dtype (unless integer activations are asked for, below); products
accumulate in float32.

Modes (``MODES``):

* ``"int8"``: 8-bit symmetric round-to-nearest, one scale per ``group_size`` values of a row
  (default: one per row);
* ``"int4"``: 4-bit round-to-nearest with a scale and an offset per group of ``group_size`` (default
  32). Round-to-nearest 4-bit weights of a model trained in bf16 lose accuracy: prefer the weights of
  a quantization-aware checkpoint or a GGUF file's own blocks (``"gguf"``);
* ``"gguf"``: only when loading a GGUF file: each tensor keeps its file precision (Q8_0, Q5_x, Q6_K
  as 8-bit groups; Q4_0, Q4_1, Q4_K as 4-bit groups; scales float16 where that is exact), the values
  equal to its dequantization.

Integer activations (``activations=`` of ``quantize`` and ``load``; ``set_activations``): products of
16 rows or more (a prompt's prefill, not a decode step) may round their activations to integers per
32 values and multiply integers. ``"int16"`` keeps the float32 products' perplexity and greedy tokens
(measured on Gemma 3 270M) at ~1.6x the float prefill's speed; ``"int8"`` is llama.cpp's arithmetic,
~2.2x, with its small loss of accuracy; None keeps float activations. ``"auto"`` (the default) is int16 where the
CPU has AVX-512 VNNI, else None (benchmarks/README.md measures all three).

``modules.py`` holds the quantized modules and the round-to-nearest quantizer; ``transform.py``
``quantize`` and ``set_activations``; ``plan.py`` what ``load`` decides about quantization, once
(``QuantizationPlan``). Quantized models on the CPU also get the CPU fusions
(``torchgemma.acceleration.fuse_cpu_ops``).
"""

# fuse_ops: what README calls the CPU fusions (acceleration.fuse_cpu_ops) that quantized CPU models get.
from ..acceleration.cpu_fusions import fuse_cpu_ops as fuse_ops
from ..kernels import ensure_kernels, kernel_status, vnni_available
from .modules import (
    Format,
    QuantizedEmbedding,
    QuantizedLinear,
    QuantizedStack,
    QuantizedWeight,
    quantize_rtn,
)
from .plan import QuantizationPlan
from .transform import (
    ACTIVATIONS,
    MODES,
    auto_activations,
    check_activations,
    choose_formats,
    float_weight,
    mode_format,
    quantizable,
    quantize,
    quantized_shell,
    record,
    replace_module,
    set_activations,
)

__all__ = [
    "ACTIVATIONS",
    "MODES",
    "Format",
    "QuantizationPlan",
    "QuantizedEmbedding",
    "QuantizedLinear",
    "QuantizedStack",
    "QuantizedWeight",
    "auto_activations",
    "check_activations",
    "choose_formats",
    "ensure_kernels",
    "float_weight",
    "fuse_ops",
    "kernel_status",
    "mode_format",
    "quantizable",
    "quantize",
    "quantize_rtn",
    "quantized_shell",
    "record",
    "replace_module",
    "set_activations",
    "vnni_available",
]
