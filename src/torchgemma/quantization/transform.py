"""``quantize(model, mode)`` and ``set_activations``: the quantizable weights of a built model, the
format each gets, and their swap for quantized modules (``modules.py``), in place."""

from __future__ import annotations

import warnings
from collections.abc import Iterator

import torch
from torch import nn

from ..acceleration.cpu_fusions import fuse_cpu_ops
from ..kernels import int_span, kernel_status, vnni_available
from ..model.text import Experts
from .modules import (
    DENSE_ROWS,
    INT_ROWS,
    Format,
    QuantizedEmbedding,
    QuantizedLinear,
    QuantizedStack,
    QuantizedWeight,
)

MODES = ("int8", "int4", "gguf")
ACTIVATIONS = ("auto", None, "int16", "int8")


def mode_format(mode: str, group_size: int | None, in_features: int) -> Format:
    """The storage format ``mode`` gives a weight of ``in_features`` columns."""
    if mode == "int8":
        return Format(8, group_size or in_features, has_mins=False)
    if mode == "int4":
        return Format(4, group_size or 32, has_mins=True)
    if mode == "gguf":
        raise ValueError('quantize="gguf" keeps a GGUF file\'s own blocks: use it when loading a .gguf file')
    raise ValueError(f"unknown quantization mode {mode!r}; use one of {', '.join(MODES)}")


def quantizable(model: nn.Module) -> Iterator[tuple[str, nn.Module | nn.Parameter]]:
    """(name, module or parameter) of every weight ``quantize`` replaces: the text decoder's linear
    layers but the router, its token table(s), untied LM head and stacked expert weights."""
    text = getattr(model, "language_model", model)
    prefix = "language_model." if text is not model else ""
    for name, module in text.named_modules():
        if name.endswith("router.proj"):
            continue  # routing decides which experts run: kept in high precision
        if ".altup." in name:
            continue  # Gemma 3n's AltUp router and stream-mixing coefficients: tiny, kept as they are
        if type(module) is nn.Linear or isinstance(module, nn.Embedding):
            yield prefix + name, module
        elif isinstance(module, Experts):
            for part in ("gate_up_proj", "down_proj"):
                if isinstance(getattr(module, part), nn.Parameter):
                    yield f"{prefix}{name}.{part}", getattr(module, part)


def float_weight(item: nn.Module | nn.Parameter) -> torch.Tensor:
    return item if isinstance(item, torch.Tensor) else item.weight


def replace_module(model: nn.Module, name: str, new: nn.Module) -> None:
    """Put ``new`` at ``name`` (a module, or a parameter that becomes a module of the same name)."""
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    parent._parameters.pop(child, None)  # an expert stack: the parameter gives way to the module
    setattr(parent, child, new)


def quantized_shell(item: nn.Module | nn.Parameter, fmt: Format, dtype: torch.dtype) -> QuantizedWeight:
    """An empty quantized module standing in for ``item``: an nn.Linear, an nn.Embedding or a stack
    of expert weights (E, N, K)."""
    if isinstance(item, torch.Tensor):
        return QuantizedStack(*item.shape, fmt, dtype)
    if isinstance(item, nn.Embedding):
        return QuantizedEmbedding(item.num_embeddings, item.embedding_dim, fmt, dtype)
    if item.bias is not None:
        raise ValueError("quantized linear layers have no bias")
    return QuantizedLinear(item.in_features, item.out_features, fmt, dtype)


def quantize(
    model: nn.Module, mode: str = "int8", *, group_size: int | None = None, activations: str | None = "auto"
) -> nn.Module:
    """Replace ``model``'s quantizable layers (see ``quantizable``) by quantized ones, in place.

    Each weight is quantized and freed in turn, so memory peaks at the model plus one layer's
    float32 copy. A layer whose width the format cannot hold (e.g. 4-bit groups of 32 over 8
    features) stays in full precision; ``model.quantization`` records the mode, the format of each
    quantized layer and the layers kept, with the reason (and a warning says so). ``activations``:
    how products of many rows (prefill, batched decode) take their activations (``set_activations``; "auto":
    int16 where the CPU has AVX-512 VNNI). Returns the model.
    """
    check_activations(activations)
    if mode == "gguf" or mode not in MODES:
        mode_format(mode, group_size, 0)  # the error for a bad or load-only mode
    dtype = model.dtype if hasattr(model, "dtype") else torch.float32
    chosen, kept = choose_formats(
        list(quantizable(model)), lambda name, features: mode_format(mode, group_size, features)
    )
    items = dict(quantizable(model))
    for name, fmt in chosen.items():
        weight = float_weight(items[name])
        shell = quantized_shell(items[name], fmt, dtype).to(weight.device)
        with torch.no_grad():
            shell.set_weight(weight)
        replace_module(model, name, shell)
    model.quantization = record(mode, chosen, kept)
    if chosen and model_device(model).type == "cpu":
        fuse_cpu_ops(model)
    return set_activations(model, activations) if chosen else model


def set_activations(model: nn.Module, activations: str | None) -> nn.Module:
    """How the quantized products of many rows take their activations, in place: those of DENSE_ROWS
    (32) rows or more (prefill), and a decoder's projections from INT_ROWS (8) rows on (batched decode
    steps; see quantization/modules.py):

    * ``"auto"``: ``"int16"`` where the CPU kernels have AVX-512 VNNI (``kernels.vnni_available()``),
      else None;
    * ``"int16"``: rounded to int16 per 32 values, then integer products (``torchgemma::qlinear_int``):
      on Gemma 3 270M the float32 products' perplexity to 4 decimals and greedy tokens, ~1.6x
      the float prefill's speed on CPUs with AVX-512 VNNI (slower than float32 elsewhere);
    * ``"int8"``: rounded to int8 per 32 values (llama.cpp's arithmetic): ~2.2x the float prefill's
      speed with VNNI, perplexity +0.24% and greedy tokens that part from full precision's within a
      few tokens of a long prompt, as llama.cpp's do;
    * None: in the model's dtype (the reference's products, to float32 rounding).

    Decode steps of fewer rows (and the greedy head below DENSE_ROWS) are not affected. A weight whose groups do not split into spans of 32
    values (or divide 32), or whose rows are not a multiple of 32 values, keeps float activations."""
    check_activations(activations)
    weights = [m for m in model.modules() if isinstance(m, QuantizedWeight)]
    if activations == "auto":
        activations = auto_activations(bool(weights), model_device(model))
    if activations is not None and not weights:
        raise ValueError(
            f'activations="{activations}" needs a quantized model (quantize="gguf", "int8" or "int4")'
        )
    if activations is not None and model_device(model).type != "cpu":
        raise ValueError(
            f'activations="{activations}" runs on the CPU kernels; the model is on {model_device(model)}'
        )
    bits = {None: 0, "int8": 8, "int16": 16}[activations]
    if bits and not vnni_available():
        warnings.warn(
            f'torchgemma: activations="{activations}" without AVX-512 VNNI (this CPU or build: '
            f"{kernel_status()}) runs a portable loop, 3-8x slower than float activations "
            '(activations=None, what "auto" picks here)',
            RuntimeWarning,
            stacklevel=2,
        )
    for module in weights:
        module.activation_bits = bits if int_span(module.format.group_size, module.weight_shape[-1]) else 0
        # a decoder's projections from INT_ROWS rows (batched decode steps) where the CPU has VNNI,
        # the rest (and all without VNNI, where integer products are portable loops) from DENSE_ROWS
        linear = module.activation_bits and type(module) is QuantizedLinear and vnni_available()
        module.int_rows = INT_ROWS if linear else DENSE_ROWS
    return model


def check_activations(activations) -> None:
    """The error for an ``activations=`` that is not one of ``ACTIVATIONS`` (before any work)."""
    if activations not in ACTIVATIONS:
        raise ValueError(f"unknown activations {activations!r}; use 'auto', 'int16', 'int8' or None")


def auto_activations(quantized: bool, device: torch.device) -> str | None:
    """What ``activations="auto"`` means: "int16" for a quantized model on a CPU whose kernels have
    AVX-512 VNNI (``kernels.vnni_available()``), else None."""
    return "int16" if quantized and device.type == "cpu" and vnni_available() else None


def choose_formats(modules, fmt_for, context: str = "") -> tuple[dict[str, Format], dict[str, str]]:
    """({name: format} of the modules to quantize, {name: reason} of those kept in full precision).

    ``fmt_for(name, in_features)`` gives a module's format, or None to keep it as it is; ``context``
    follows "their width" in the warning (tensor parallelism: whose width)."""
    chosen: dict[str, Format] = {}
    kept: dict[str, str] = {}
    for name, item in modules:
        features = float_weight(item).shape[-1]
        fmt = fmt_for(name, features)
        if fmt is None:
            continue
        try:
            fmt.check(features, name)
            chosen[name] = fmt
        except ValueError as err:
            kept[name] = str(err)
    if kept and not chosen:
        first = next(iter(kept.values()))
        raise ValueError(f"no layer can be quantized in this format: {first}")
    if kept:
        warnings.warn(
            f"torchgemma: {len(kept)} layer(s) kept in full precision, their width{context} does not fit "
            f"the format: {'; '.join(list(kept.values())[:3])}",
            stacklevel=3,
        )
    return chosen, kept


def record(mode: str, chosen: dict[str, Format], kept: dict[str, str]) -> dict:
    """What ``model.quantization`` holds (and config.json's quantization_config, when saved)."""
    return {"mode": mode, "layers": {name: fmt.as_dict() for name, fmt in chosen.items()}, "kept": kept}


def model_device(model: nn.Module) -> torch.device:
    return getattr(model, "device", None) or next(model.buffers()).device


def dequantizes_per_pass(model: nn.Module) -> bool:
    """Whether some quantized product of ``model`` takes float activations in a prefill (no
    ``set_activations`` integers): those dequantize their weight once per forward pass, so fewer
    rows per pass pay that more often."""
    return any(isinstance(m, QuantizedWeight) and not m.activation_bits for m in model.modules())
