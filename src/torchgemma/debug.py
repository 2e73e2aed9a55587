"""Numerics debugging: per-module statistics of one forward pass, stopping at the first non-finite value.

    report = trace(model, input_ids)            # every module's output, in execution order
    report.first_nonfinite                      # the module whose output first held NaN or inf
    print(format_trace(report))

Each record is one module call: the module's name (the checkpoint's, so it lines up with
transformers and with ``torchgemma.reference``), its output's min, max, mean |x|, NaN and inf
counts, and the headroom of its dtype (the largest finite value of the dtype over max |x|: below 1
the value does not fit). The pass stops at the first module whose output is not finite while all
of its inputs were: that module made the overflow, and the record says by how much its largest
finite input was from the limit.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import nn


@dataclass
class ModuleStats:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    min: float
    max: float
    mean_abs: float
    nan: int
    inf: int
    headroom: float  # finfo(dtype).max / max |finite x|; inf for an all-zero output
    inputs_finite: bool = True
    input_max_abs: float = 0.0

    @property
    def finite(self) -> bool:
        return self.nan == 0 and self.inf == 0


@dataclass
class TraceReport:
    records: list[ModuleStats] = field(default_factory=list)
    first_nonfinite: ModuleStats | None = None


class _Stop(Exception):
    """Raised from a hook to end the pass at the first non-finite output."""


def _stats(name: str, tensor: torch.Tensor) -> ModuleStats:
    values = tensor.detach()
    wide = values.double()
    finite = wide[torch.isfinite(wide)]
    largest = finite.abs().max().item() if finite.numel() else 0.0
    limit = torch.finfo(values.dtype).max
    return ModuleStats(
        name=name,
        dtype=values.dtype,
        shape=tuple(values.shape),
        min=finite.min().item() if finite.numel() else math.nan,
        max=finite.max().item() if finite.numel() else math.nan,
        mean_abs=finite.abs().mean().item() if finite.numel() else math.nan,
        nan=int(torch.isnan(wide).sum()),
        inf=int(torch.isinf(wide).sum()),
        headroom=limit / largest if largest > 0 else math.inf,
    )


def _float_tensors(values) -> list[torch.Tensor]:
    found = []
    for value in values if isinstance(values, (tuple, list)) else (values,):
        if isinstance(value, torch.Tensor) and value.is_floating_point():
            found.append(value)
        elif isinstance(value, (tuple, list)):
            found += _float_tensors(value)
    return found


def trace(model: nn.Module, input_ids: torch.Tensor, *, stop: bool = True, **forward_kwargs) -> TraceReport:
    """Run ``model(input_ids, **forward_kwargs)`` once with a hook on every named module.

    With ``stop`` the pass ends at the first module whose output is not finite though its inputs
    were (``report.first_nonfinite``); without it, every module is recorded.
    """
    report = TraceReport()
    prefix = "model." if hasattr(model, "language_model") else ""

    def hook(name):
        def record(module, args, output):
            outputs = _float_tensors(output)
            if not outputs:
                return
            tensor = outputs[0]
            stats = _stats(prefix + name, tensor)
            inputs = _float_tensors(args)
            stats.inputs_finite = all(bool(torch.isfinite(x).all()) for x in inputs)
            stats.input_max_abs = max(
                (
                    x.detach().double().nan_to_num(0.0, 0.0, 0.0).abs().max().item()
                    for x in inputs
                    if x.numel()
                ),
                default=0.0,
            )
            report.records.append(stats)
            if not stats.finite and stats.inputs_finite and report.first_nonfinite is None:
                report.first_nonfinite = stats
                if stop:
                    raise _Stop

        return record

    handles = [module.register_forward_hook(hook(name)) for name, module in model.named_modules() if name]
    try:
        with torch.no_grad():
            model(input_ids, **forward_kwargs)
    except _Stop:
        pass
    finally:
        for handle in handles:
            handle.remove()
    return report


def format_trace(report: TraceReport, *, last: int = 12) -> str:
    """A table of the last ``last`` records (those before the failure, when there is one)."""
    lines = [
        f"{'module':58} {'dtype':9} {'min':>11} {'max':>11} {'mean|x|':>10} {'NaN':>6} {'inf':>6} {'headroom':>9}"
    ]
    for r in report.records[-last:]:
        lines.append(
            f"{r.name[-58:]:58} {str(r.dtype).removeprefix('torch.'):9} {r.min:11.4g} {r.max:11.4g} "
            f"{r.mean_abs:10.4g} {r.nan:6d} {r.inf:6d} {r.headroom:9.3g}"
        )
    first = report.first_nonfinite
    if first is None:
        lines.append(f"all {len(report.records)} module outputs are finite")
    else:
        limit = torch.finfo(first.dtype).max
        lines.append(
            f"first non-finite output: {first.name} ({first.nan} NaN, {first.inf} inf of "
            f"{math.prod(first.shape)} values); its inputs were finite, largest |x| {first.input_max_abs:.4g} "
            f"({first.input_max_abs / limit:.3g} of {str(first.dtype).removeprefix('torch.')}'s limit {limit:.4g})"
        )
    return "\n".join(lines)
