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

import numpy as np
import torch
from torch import nn

from .model.text import EXPERTS


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


# ── compare: two runs of the same input, module by module ──────────────────────────────────────

IMPLEMENTATIONS = ("torchgemma", "transformers", "reference")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "fp64": torch.float64}
ATTENTIONS = ("eager", "sdpa")
QUANTIZATIONS = ("int8", "int4", "gguf")
# How a mixture of experts sums its outputs, written experts=NAME ("eager" alone is the attention).
EXPERTS_OPTIONS = tuple(f"experts={name}" for name in EXPERTS)

# Outputs that share a name but not a meaning across implementations: transformers' embedding
# modules scale their rows (ours and the reference's scale after the lookup), and routers return
# different tuples (their effect shows in the experts' output). Left out of every comparison.
NOT_COMPARABLE = ("embed_tokens", "embed_tokens_per_layer", "router")

# The sublayers of a decoder layer that the table shows, by the suffix of their module name.
SUBLAYERS = {
    "attention": "self_attn",
    "mlp": "mlp",
    "experts": "experts",
    "ple": "post_per_layer_input_norm",
    "residual": "",
}


@dataclass(frozen=True)
class Side:
    """One configuration of a comparison, written ``impl[:option...]``:

    ``torchgemma:bf16:sdpa:int8``, ``transformers:fp32:sdpa``, ``reference`` (the float64 NumPy
    decoder of ``torchgemma.reference``). Options are a dtype (fp32, bf16, fp16, fp64), an
    attention implementation (eager, sdpa), a mixture of experts' implementation (experts=grouped_mm,
    experts=eager) and, for torchgemma, a quantization (int8, int4, gguf), in any order. Defaults:
    fp32, eager attention, grouped_mm experts (both libraries' default), no quantization.

    transformers with sdpa runs as its default does (no ``attn_implementation`` given): sdpa in
    the text decoder and the vision tower, eager in the audio tower, which has no sdpa (asked for
    sdpa by name, transformers refuses to load a checkpoint with an audio tower). Ours with sdpa
    is the same arrangement: our audio tower has only the eager path.
    """

    implementation: str
    dtype: torch.dtype = torch.float32
    attention: str = "eager"
    quantize: str | None = None
    experts: str = EXPERTS[0]

    @classmethod
    def parse(cls, text: str) -> Side:
        implementation, *options = text.strip().split(":")
        if implementation not in IMPLEMENTATIONS:
            raise ValueError(f"{text!r}: the implementation must be one of {', '.join(IMPLEMENTATIONS)}")
        fields: dict = {}
        for option in options:
            if option in DTYPES:
                fields["dtype"] = DTYPES[option]
            elif option in ATTENTIONS:
                fields["attention"] = option
            elif option in QUANTIZATIONS:
                fields["quantize"] = option
            elif option in EXPERTS_OPTIONS:
                fields["experts"] = option.removeprefix("experts=")
            else:
                known = ", ".join([*DTYPES, *ATTENTIONS, *EXPERTS_OPTIONS, *QUANTIZATIONS])
                raise ValueError(f"{text!r}: unknown option {option!r} (known: {known})")
        if implementation == "reference" and fields:
            raise ValueError(f"{text!r}: the reference is float64 NumPy and takes no options")
        if implementation == "transformers" and "quantize" in fields:
            raise ValueError(f"{text!r}: quantization is torchgemma's; transformers runs float weights")
        return cls(implementation, **fields)

    @property
    def label(self) -> str:
        if self.implementation == "reference":
            return "reference:fp64"
        parts = [self.implementation, next(k for k, v in DTYPES.items() if v == self.dtype), self.attention]
        if self.experts != EXPERTS[0]:
            parts.append(f"experts={self.experts}")
        return ":".join(parts + ([self.quantize] if self.quantize else []))


@dataclass
class Capture:
    """What one run produced: every text-decoder module's output (float64, by the checkpoint's module
    name, in execution order) and the logits (T, V) of the batch's first row, float64."""

    label: str
    outputs: dict[str, np.ndarray]
    logits: np.ndarray


@dataclass
class ModuleError:
    name: str
    layer: int | None  # the decoder layer it belongs to; None outside the layers
    sublayer: str | None  # a key of SUBLAYERS, or None for the modules the table does not show
    shape: tuple[int, ...]
    max_abs: float  # max |a − b|
    max_rel: float  # max |a − b| / max |b|: the error against the size of the baseline's values


@dataclass
class LogitError:
    max_abs: float
    kl_mean: float  # mean over positions of KL(softmax(b) ‖ softmax(a)), in nats
    kl_max: float
    top1_agree: int  # positions whose argmax is the same on both sides
    positions: int


@dataclass
class CompareReport:
    a: str
    b: str  # the baseline: relative errors and the KL divergence are taken against it
    threshold: float
    modules: list[ModuleError]
    logits: LogitError
    first_past: ModuleError | None  # the first module (execution order) with max_rel > threshold
    skipped: list[str]  # names both sides have whose shapes disagree

    def to_dict(self) -> dict:
        import dataclasses

        return dataclasses.asdict(self)


def capture_torchgemma(model: nn.Module, input_ids: torch.Tensor, label: str = "torchgemma") -> Capture:
    """Run our model once with a hook on every text-decoder module."""
    names = {n: "model." + n for n, _ in model.named_modules() if n.startswith("language_model.")}
    outputs, logits = _captured(model, names, lambda: model(input_ids))
    return Capture(label, outputs, _wide(logits[0]))


def capture_transformers(model: nn.Module, input_ids: torch.Tensor, label: str = "transformers") -> Capture:
    """Run a transformers Gemma model once with a hook on every text-decoder module; names are
    brought to the ``gemma4`` layout (``model.layers.3`` of a ``*ForCausalLM`` becomes
    ``model.language_model.layers.3``)."""
    names = {n: _transformers_text_name(n) for n, _ in model.named_modules()}
    names = {n: text for n, text in names.items() if text is not None}
    outputs, logits = _captured(model, names, lambda: model(input_ids, use_cache=False).logits)
    return Capture(label, outputs, _wide(logits[0]))


def _captured(model: nn.Module, names: dict[str, str], run) -> tuple[dict[str, np.ndarray], torch.Tensor]:
    """``run()`` under ``no_grad`` with a hook on each module of ``names`` (module name -> the name
    to record it under): each one's first floating-point output, in float64, and ``run()``'s result."""
    outputs: dict[str, np.ndarray] = {}

    def hook(key):
        def record(module, args, output):
            found = _float_tensors(output.to_tuple() if hasattr(output, "to_tuple") else output)
            if found:
                outputs[key] = _wide(found[0])

        return record

    handles = [m.register_forward_hook(hook(names[n])) for n, m in model.named_modules() if n in names]
    try:
        with torch.no_grad():
            result = run()
    finally:
        for handle in handles:
            handle.remove()
    return outputs, result


def capture_reference(weights: dict, config, input_ids: torch.Tensor) -> Capture:
    """The float64 reference's forward (``torchgemma.reference``), recording every block."""
    from . import reference

    record: dict = {}
    logits = reference.forward(weights, config, input_ids.numpy(), record=record)
    outputs = {name: value for name, value in record.items() if isinstance(value, np.ndarray)}
    return Capture("reference:fp64", outputs, logits[0])


def run_side(side: Side, source, input_ids: torch.Tensor) -> Capture:
    """Load ``source`` as ``side`` says and capture one forward pass over ``input_ids`` (1, T)."""
    from .weights.loading import load
    from .weights.source import resolve_source

    if side.implementation == "torchgemma":
        fp16 = side.dtype == torch.float16
        model = load(
            source,
            dtype=torch.float32 if fp16 else side.dtype,
            attention=side.attention,
            experts=side.experts,
            quantize=side.quantize,
            progress=False,
        )
        if fp16:
            model = model.to(torch.float16)  # refused by load for running; here to measure it
        return capture_torchgemma(model, input_ids, side.label)
    path = resolve_source(source)
    if side.implementation == "transformers":
        return capture_transformers(_transformers_model(path, side), input_ids, side.label)
    from . import reference

    if path.suffix == ".gguf":  # the file's values, dequantized by our reader
        model = load(path, dtype=torch.float64, quantize=None, progress=False)
        return capture_reference(reference.weights_from_model(model), model.config.text, input_ids)
    from .config import ModelConfig

    config = ModelConfig.from_file(path)
    return capture_reference(reference.weights_from_checkpoint(path), config.text, input_ids)


def compare(
    source, input_ids: torch.Tensor, a: Side | str, b: Side | str = "reference", *, threshold: float = 1e-2
) -> CompareReport:
    """Run ``source`` as configuration ``a`` and as ``b`` on the same ``input_ids`` (1, T) and
    measure, module by module, how far ``a`` is from ``b`` (see ``compare_captures``)."""
    a, b = (Side.parse(s) if isinstance(s, str) else s for s in (a, b))
    if input_ids.dim() != 2 or input_ids.shape[0] != 1:
        raise ValueError(f"compare takes one sequence, input_ids (1, T); got {tuple(input_ids.shape)}")
    return compare_captures(
        run_side(a, source, input_ids), run_side(b, source, input_ids), threshold=threshold
    )


def compare_captures(a: Capture, b: Capture, *, threshold: float = 1e-2) -> CompareReport:
    """Every module both captures hold (in ``a``'s execution order), its max absolute and relative
    error against ``b``, the first past ``threshold`` (relative), and the logits' agreement."""
    modules, skipped = [], []
    for name, value in a.outputs.items():
        if name not in b.outputs or name.rsplit(".", 1)[-1] in NOT_COMPARABLE:
            continue
        base = b.outputs[name]
        if value.size != base.size:
            skipped.append(f"{name} {value.shape} vs {base.shape}")
            continue
        value = value.reshape(base.shape)
        diff = float(np.abs(value - base).max()) if base.size else 0.0
        scale = float(np.abs(base).max()) if base.size else 0.0
        layer, sublayer = _place(name)
        rel = diff / scale if scale > 0 else (0.0 if diff == 0 else math.inf)
        modules.append(ModuleError(name, layer, sublayer, tuple(base.shape), diff, rel))
    first = next((m for m in modules if m.max_rel > threshold), None)
    return CompareReport(
        a.label, b.label, threshold, modules, logit_error(a.logits, b.logits), first, skipped
    )


def format_compare(report: CompareReport, *, every_module: bool = False) -> str:
    """A table: one row per decoder layer, the max absolute error of each sublayer's output (the
    residual's relative error last), then the first module past the threshold and the logits."""
    lines = [f"{report.a}  against  {report.b} (baseline)"]
    if every_module:
        lines.append(f"{'module':64} {'max |Δ|':>10} {'max rel':>10}")
        lines += [f"{m.name[-64:]:64} {m.max_abs:10.3g} {m.max_rel:10.3g}" for m in report.modules]
    else:
        layers: dict[int, dict[str, ModuleError]] = {}
        for m in report.modules:
            if m.sublayer is not None:
                layers.setdefault(m.layer, {})[m.sublayer] = m
        shown = [s for s in SUBLAYERS if any(s in parts for parts in layers.values())]
        lines.append("layer " + "".join(f"{s + ' |Δ|':>16}" for s in shown) + f"{'residual rel':>14}")
        for index in sorted(layers):
            parts = layers[index]
            cells = "".join(f"{parts[s].max_abs:16.3g}" if s in parts else f"{'':16}" for s in shown)
            rel = f"{parts['residual'].max_rel:14.3g}" if "residual" in parts else ""
            lines.append(f"{index:5d} {cells}{rel}")
    first = report.first_past
    lines.append(
        f"first module past {report.threshold:g} relative: "
        + ("none" if first is None else f"{first.name} ({first.max_rel:.3g}, max |Δ| {first.max_abs:.3g})")
    )
    g = report.logits
    lines.append(
        f"logits: max |Δ| {g.max_abs:.3g}, KL mean {g.kl_mean:.3g} max {g.kl_max:.3g} nats, "
        f"top-1 agree {g.top1_agree}/{g.positions}"
    )
    if report.skipped:
        lines.append(f"not compared (shapes differ): {', '.join(report.skipped)}")
    return "\n".join(lines)


def plot_compare(report: CompareReport, path) -> None:
    """Error by layer, one line per sublayer, log scale, written to ``path`` (PNG): needs matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        from matplotlib import pyplot as plt
    except ImportError as err:
        raise ImportError("--plot needs matplotlib: pip install 'torchgemma[plot]'") from err
    figure, axes = plt.subplots(figsize=(8, 4.5))
    for sublayer in SUBLAYERS:
        points = sorted((m.layer, m.max_abs) for m in report.modules if m.sublayer == sublayer)
        if points:
            xs, ys = zip(*points)
            axes.plot(xs, [max(y, 1e-300) for y in ys], marker="o", markersize=3, label=sublayer)
    axes.set_yscale("log")
    axes.set_xlabel("decoder layer")
    axes.set_ylabel("max |Δ| of the output")
    axes.set_title(f"{report.a} against {report.b}", fontsize=10)
    axes.grid(True, which="both", alpha=0.3)
    axes.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def _transformers_model(path, side: Side) -> nn.Module:
    from transformers import AutoModelForCausalLM

    # sdpa and grouped_mm are transformers' defaults: left to it, it picks them where it can (eager in
    # an audio tower, eager experts where grouped_mm cannot run), as a user's from_pretrained does.
    options: dict = {"dtype": side.dtype}
    if side.attention != "sdpa":
        options["attn_implementation"] = side.attention
    if side.experts != EXPERTS[0]:
        options["experts_implementation"] = side.experts
    if path.suffix == ".gguf":
        model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, **options)
    else:
        model = AutoModelForCausalLM.from_pretrained(path, **options)
    return model.eval()


def _transformers_text_name(name: str) -> str | None:
    """A transformers module name in the ``gemma4`` layout, or None outside the text decoder."""
    for prefix in ("model.language_model.", "language_model.model.", "model."):
        if name.startswith(prefix):
            rest = name[len(prefix) :]
            if rest.startswith(("layers.", "norm", "per_layer_", "embed_tokens")):
                return "model.language_model." + rest
    return None


def _place(name: str) -> tuple[int | None, str | None]:
    """(layer index, sublayer) of a module name such as ``model.language_model.layers.3.mlp``."""
    head, sep, rest = name.partition("language_model.layers.")
    if not sep:
        return None, None
    index, _, part = rest.partition(".")
    sublayer = next((key for key, suffix in SUBLAYERS.items() if part == suffix), None)
    return int(index), sublayer


def logit_error(a: np.ndarray, b: np.ndarray) -> LogitError:
    if a.shape != b.shape:
        raise ValueError(f"the two runs' logits differ in shape: {a.shape} vs {b.shape}")
    log_a, log_b = _log_softmax(a), _log_softmax(b)
    kl = (np.exp(log_b) * (log_b - log_a)).sum(-1)
    return LogitError(
        max_abs=float(np.abs(a - b).max()),
        kl_mean=float(kl.mean()),
        kl_max=float(kl.max()),
        top1_agree=int((a.argmax(-1) == b.argmax(-1)).sum()),
        positions=a.shape[0],
    )


def _log_softmax(x: np.ndarray) -> np.ndarray:
    shifted = x - x.max(-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))


def _wide(tensor: torch.Tensor) -> np.ndarray:
    return tensor.detach().to("cpu", torch.float64).numpy().copy()
