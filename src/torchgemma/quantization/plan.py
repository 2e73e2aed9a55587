"""What ``load`` does about quantization, decided once: ``QuantizationPlan``.

``load`` resolves the plan from the user's arguments, the checkpoint and the device (every
``"auto"`` made concrete there), then hands it the model it builds at three moments:

    plan.prepare(model, dtype)               # meta model: a saved quantized checkpoint's shells
    loads = plan.assign(model, loads, dtype) # names matched: shells for the layers quantized now
    plan.apply(model)                        # filled: model.quantization, CPU fusions, activations
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..acceleration.cpu_fusions import fuse_cpu_ops
from ..weights.source import CheckpointError
from .modules import Format
from .transform import (
    MODES,
    auto_activations,
    check_activations,
    choose_formats,
    mode_format,
    quantizable,
    quantized_shell,
    record,
    replace_module,
    set_activations,
)


@dataclass(frozen=True)
class QuantizationPlan:
    """Every quantization choice of one ``load``, concrete.

    ``mode``: "int8", "int4", "gguf" (a GGUF file's own blocks) or None (nothing quantized while
    loading); ``saved``: the checkpoint's own quantization record (saved by ``torchgemma.save``) or
    None; ``activations``: "int16", "int8" or None for the quantized products of 16 rows or more
    (``set_activations``); ``device``: where the model goes (quantized layers on the CPU get the
    C++ kernels and the CPU fusions); ``gguf``: the GGUF checkpoint whose blocks mode "gguf" keeps
    (``weights.gguf.GGUFCheckpoint``).
    """

    mode: str | None = None
    saved: dict | None = None
    activations: str | None = None
    device: torch.device = torch.device("cpu")
    gguf: Any = None

    @property
    def shard_granule(self) -> int:
        """The width tensor parallelism keeps whole when it splits a layer's input features (the
        MLP's and experts' intermediate features; ``distributed.ShardPlan.granule``): 32 where the
        weights are quantized in groups of 32 ("int4") or of 32 or 16 (a GGUF file's blocks read as
        grouped integers), so that each rank's columns are whole groups; else 1. ("int8" has one
        scale per row: each rank's share of a split row gets its own scale.)"""
        return 32 if self.mode in ("int4", "gguf") else 1

    @staticmethod
    def check(quantize: str | None, activations: str | None) -> None:
        """The error for a ``quantize=`` or ``activations=`` that ``load`` does not take (before any work)."""
        if quantize not in (*MODES, "auto", None):
            raise ValueError(
                f"unknown quantization {quantize!r}; use one of {', '.join(MODES)}, 'auto' or None"
            )
        check_activations(activations)

    @classmethod
    def resolve(
        cls,
        mode: str | None,
        activations: str | None,
        *,
        path: Path,
        saved: dict | None,
        gguf: Any,
        device: torch.device,
    ) -> QuantizationPlan:
        """The plan for quantizing ``mode`` (``quantize=`` with "auto" already made concrete) the
        checkpoint at ``path`` (``saved``: its quantization record; ``gguf``: the GGUF file, or None)
        onto ``device``; ``activations="auto"`` becomes "int16" or None here."""
        if mode == "gguf" and gguf is None:
            raise ValueError(f'quantize="gguf" keeps a GGUF file\'s blocks, and {path} is not a .gguf file')
        if saved is not None and mode is not None:
            raise ValueError(f"{path} is already quantized ({saved['mode']}): load it without quantize")
        if mode == "gguf":  # only the tensors the file stores as grouped integers are quantized
            quantized = any(gguf.int_format(name) for name in gguf.tensor_names())
        else:
            quantized = mode is not None or bool(saved and saved["layers"])
        if activations == "auto":
            activations = auto_activations(quantized, device)
        return cls(mode, saved, activations, device, gguf if mode == "gguf" else None)

    def prepare(self, model: nn.Module, dtype: torch.dtype) -> None:
        """On the meta model, before the checkpoint's names are matched: the layers of a checkpoint
        saved quantized (it holds their qweight/scales/mins) become empty quantized modules."""
        if self.saved is None:
            return
        items = dict(quantizable(model))
        for name, spec in self.saved["layers"].items():
            if name not in items:
                raise CheckpointError(f"quantization_config names {name}, which the model has not")
            with torch.device("meta"):
                shell = quantized_shell(items[name], Format(**spec), dtype)
            replace_module(model, name, shell)
        model.quantization = self.saved

    def assign(self, model: nn.Module, loads: list[tuple], dtype: torch.dtype) -> list[tuple]:
        """On the meta model, its names matched to the checkpoint's (``loads``: ``(name, key, load)``):
        the layers ``mode`` quantizes become empty quantized modules, in the format it gives them;
        returns the loads, a GGUF tensor kept as blocks read as such.

        "int8"/"int4": every quantizable layer, its float weight quantized when it is read. "gguf": the
        layers whose tensor the file stores as grouped integers (others stay float)."""
        if self.mode is None:
            return loads
        items = dict(quantizable(model))
        keys = {name.removesuffix(".weight"): key for name, key, _ in loads}
        modules = [(name, item) for name, item in items.items() if name in keys]
        shards = getattr(model, "shard_plan", None)  # tensor parallelism: the widths are the rank's
        context = "" if shards is None else f" (this rank's share of {shards.size})"
        if self.mode == "gguf":
            spec = {name: self.gguf.int_format(keys[name]) for name, _ in modules}
            chosen, kept = choose_formats(
                modules, lambda name, features: spec[name] and Format(*spec[name]), context
            )
        else:
            chosen, kept = choose_formats(
                modules, lambda name, features: mode_format(self.mode, None, features), context
            )
        for name, fmt in chosen.items():
            with torch.device("meta"):
                shell = quantized_shell(items[name], fmt, dtype)
            replace_module(model, name, shell)
        model.quantization = record(self.mode, chosen, kept)
        if self.mode != "gguf":
            return loads
        blocks = {keys[name] for name in chosen}
        # (a GGUF tensor's load, weights.gguf.TensorLoad, reads its blocks, or its rank's piece's)
        return [(name, key, load.blocks if key in blocks else load) for name, key, load in loads]

    def apply(self, model: nn.Module) -> nn.Module:
        """On the filled model: its quantization record final, and a quantized model on the CPU fused
        (``fuse_cpu_ops``) with its prefill activations set. Returns the model."""
        quantization = getattr(model, "quantization", None)
        if quantization is None:
            return set_activations(model, self.activations)
        if self.mode == "gguf":  # a GGUF tensor's scale dtype is chosen as it is converted: record it
            layers = {name: model.get_submodule(name).format for name in quantization["layers"]}
            model.quantization = quantization = record(self.mode, layers, quantization["kept"])
        if quantization["layers"] and self.device.type == "cpu":
            fuse_cpu_ops(model)
        return set_activations(model, self.activations)
