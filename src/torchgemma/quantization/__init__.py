"""Weight-only quantization as a transform of a built model (the model file stays plain).

    model = torchgemma.quantize(torchgemma.load(...), "int8")          # or "int4", group_size=...
    model = torchgemma.load("model.gguf", quantize="gguf")             # the file's own blocks

What is quantized: the text decoder's linear layers, its token table (which is also the tied LM
head, about half the bytes of a small model) and the per-layer-embedding table. What is not: norms,
the MoE router, soft-caps, the vision and audio towers, and the experts (not yet: they stay in the
model's dtype). Activations stay in the model's dtype; products accumulate in float32.

Modes (``MODES``):

* ``"int8"``: 8-bit symmetric round-to-nearest, one scale per ``group_size`` values of a row
  (default: one per row);
* ``"int4"``: 4-bit round-to-nearest with a scale and an offset per group of ``group_size`` (default
  32). Round-to-nearest 4-bit weights of a model trained in bf16 lose accuracy: prefer the weights of
  a quantization-aware checkpoint or a GGUF file's own blocks (``"gguf"``);
* ``"gguf"``: only when loading a GGUF file: each tensor keeps its file precision (Q8_0, Q5_x, Q6_K,
  Q5_K as 8-bit groups; Q4_0, Q4_1, Q4_K as 4-bit groups), the values equal to its dequantization.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn

from .kernels import ensure_kernels, kernel_status
from .modules import Format, QuantizedEmbedding, QuantizedLinear, QuantizedWeight, quantize_rtn

MODES = ("int8", "int4", "gguf")

__all__ = [
    "MODES",
    "Format",
    "QuantizedEmbedding",
    "QuantizedLinear",
    "QuantizedWeight",
    "ensure_kernels",
    "kernel_status",
    "mode_format",
    "quantizable",
    "quantize",
    "quantize_rtn",
    "quantized_shell",
    "replace_module",
]


def mode_format(mode: str, group_size: int | None, in_features: int) -> Format:
    """The storage format ``mode`` gives a weight of ``in_features`` columns."""
    if mode == "int8":
        return Format(8, group_size or in_features, has_mins=False)
    if mode == "int4":
        return Format(4, group_size or 32, has_mins=True)
    if mode == "gguf":
        raise ValueError('quantize="gguf" keeps a GGUF file\'s own blocks: use it when loading a .gguf file')
    raise ValueError(f"unknown quantization mode {mode!r}; use one of {', '.join(MODES)}")


def quantizable(model: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """(name, module) of every module ``quantize`` replaces: the text decoder's linear layers but the
    router, its token table(s) and untied LM head."""
    text = getattr(model, "language_model", model)
    prefix = "language_model." if text is not model else ""
    for name, module in text.named_modules():
        if name.endswith("router.proj"):
            continue  # routing decides which experts run: kept in high precision
        if type(module) is nn.Linear or isinstance(module, nn.Embedding):
            yield prefix + name, module


def replace_module(model: nn.Module, name: str, new: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, child, new)


def quantized_shell(module: nn.Module, fmt: Format, dtype: torch.dtype) -> QuantizedWeight:
    """An empty quantized module standing in for ``module`` (an nn.Linear or nn.Embedding)."""
    if isinstance(module, nn.Embedding):
        return QuantizedEmbedding(module.num_embeddings, module.embedding_dim, fmt, dtype)
    if module.bias is not None:
        raise ValueError("quantized linear layers have no bias")
    return QuantizedLinear(module.in_features, module.out_features, fmt, dtype)


def quantize(model: nn.Module, mode: str = "int8", *, group_size: int | None = None) -> nn.Module:
    """Replace ``model``'s quantizable layers (see ``quantizable``) by quantized ones, in place.

    Each weight is quantized and freed in turn, so memory peaks at the model plus one layer's
    float32 copy. A layer whose width the group size does not divide is an error naming it. Returns
    the model, whose ``quantization`` attribute records the mode and the format of each layer.
    """
    if mode == "gguf" or mode not in MODES:
        mode_format(mode, group_size, 0)  # the error for a bad or load-only mode
    dtype = model.dtype if hasattr(model, "dtype") else torch.float32
    layers: dict[str, dict] = {}
    for name, module in list(quantizable(model)):
        fmt = mode_format(mode, group_size, module.weight.shape[1])
        try:
            fmt.check(module.weight.shape[1], name)
        except ValueError as err:
            raise ValueError(f"cannot quantize {name} to {mode}: {err}") from None
        shell = quantized_shell(module, fmt, dtype).to(module.weight.device)
        with torch.no_grad():
            shell.set_weight(module.weight)
        replace_module(model, name, shell)
        layers[name] = fmt.as_dict()
    model.quantization = {"mode": mode, "layers": layers}
    if next(iter(layers), None) is not None and model_device(model).type == "cpu":
        ensure_kernels()
    return model


def model_device(model: nn.Module) -> torch.device:
    return getattr(model, "device", None) or next(model.buffers()).device
