"""The measurements behind docs/NUMERICS.md: how far each configuration is from the float64 reference.

    python benchmarks/numerics.py tiny     # tiny random checkpoints of the four styles (~2 min)
    python benchmarks/numerics.py real     # the real Gemma 3 270M (~6 min; transformers loads the GGUF)
    python benchmarks/numerics.py claims   # QK-norm, the 1/sqrt(d) scale and RMSNorm's order, measured
    python benchmarks/numerics.py all --plots docs/numerics

``tiny`` and ``real`` compare every run with ``torchgemma.debug`` against ``torchgemma.reference``
(NumPy, float64) on the same tokens: the logits' max |Δ|, the mean KL divergence from the
reference's distribution, the positions whose top-1 token agrees, and per decoder layer the residual
stream's relative error (max |Δ| over max |x|). ``claims`` compares the attention variants against
our float64 model as trained, and the bf16 RMSNorm orders against the float64 reference (64 tokens)
and our float32 model (512 tokens, greedy continuations). Prints Markdown tables.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch

import torchgemma
from torchgemma import reference
from torchgemma.debug import (
    capture_reference,
    capture_torchgemma,
    capture_transformers,
    compare_captures,
    logit_error,
    plot_compare,
)
from torchgemma.model import attention as model_attention
from torchgemma.model import layers as model_layers
from torchgemma.model import text as model_text

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "benchmarks"))

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def passage_ids(tokenizer, count: int) -> torch.Tensor:
    text = (ROOT / "benchmarks" / "data" / "passage.txt").read_text()
    return torch.tensor([tokenizer.encode(text)[:count]])


def row(label: str, report) -> str:
    g = report.logits
    residual = [m for m in report.modules if m.sublayer == "residual"]
    last = residual[-1].max_rel if residual else float("nan")
    worst = max((m.max_rel for m in residual), default=float("nan"))
    return (
        f"| {label} | {g.max_abs:.2e} | {g.kl_mean:.1e} | {g.top1_agree}/{g.positions} "
        f"| {last:.1e} | {worst:.1e} |"
    )


HEADER = (
    "| configuration | logits max \\|Δ\\| | KL mean (nats) | top-1 agree | last layer's residual rel "
    "| worst layer's residual rel |\n|---|---:|---:|---:|---:|---:|"
)


def per_layer_table(reports: dict[str, object]) -> str:
    labels = list(reports)
    lines = ["| layer | " + " | ".join(labels) + " |", "|---:|" + "---:|" * len(labels)]
    layers = sorted({m.layer for r in reports.values() for m in r.modules if m.sublayer == "residual"})
    for index in layers:
        cells = []
        for report in reports.values():
            found = [m.max_rel for m in report.modules if m.layer == index and m.sublayer == "residual"]
            cells.append(f"{found[0]:.1e}" if found else "")
        lines.append(f"| {index} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


# ── tiny random checkpoints ─────────────────────────────────────────────────────────────────────


def tiny(plots: Path | None) -> None:
    from checkpoints import STYLES, build_text_checkpoint

    ids = torch.tensor([[2, 17, 35, 99, 7, 64, 12, 5, 250, 31, 8, 140, 77, 201, 3, 56]])
    root = Path(tempfile.mkdtemp())
    print("## Tiny random checkpoints (16 tokens, eager unless named)\n")
    for index, style in enumerate(STYLES):
        folder = build_text_checkpoint(root / style, style, seed=index + 1)
        config = torchgemma.ModelConfig.from_file(folder).text
        base = capture_reference(reference.weights_from_checkpoint(folder), config, ids)
        print(f"### {style}\n\n{HEADER}")
        for quantize in (None, "int8", "int4"):
            dtypes = DTYPES if quantize is None else {"fp32": torch.float32}
            for name, dtype in dtypes.items():
                for attention in ("eager", "sdpa") if quantize is None else ("eager",):
                    model = torchgemma.load(folder, dtype=dtype, attention=attention, quantize=quantize)
                    label = f"torchgemma {name} {attention}" + (f" {quantize}" if quantize else "")
                    report = compare_captures(capture_torchgemma(model, ids, label), base)
                    print(row(label, report))
                    if plots and (name, attention, quantize) == ("bf16", "eager", None):
                        plot_compare(report, plots / f"tiny-{style}-bf16.png")
        from transformers import AutoModelForCausalLM

        for name, dtype in DTYPES.items():
            for attention in ("eager", "sdpa"):
                model = AutoModelForCausalLM.from_pretrained(
                    folder, dtype=dtype, attn_implementation=attention, experts_implementation="eager"
                ).eval()
                label = f"transformers {name} {attention}"
                print(row(label, compare_captures(capture_transformers(model, ids, label), base)))
        print()


# ── the real 270M ───────────────────────────────────────────────────────────────────────────────


def real(plots: Path | None) -> None:
    from transformers import AutoModelForCausalLM

    from torchgemma.weights.source import resolve_source

    tokenizer = torchgemma.load_tokenizer("gemma3-270m")
    ids = passage_ids(tokenizer, 64)
    wide = torchgemma.load("gemma3-270m", dtype=torch.float64, quantize=None)
    base = capture_reference(reference.weights_from_model(wide), wide.config.text, ids)
    del wide
    reports = {}
    print(f"## The real Gemma 3 270M (Q4_K_M GGUF, dequantized; {ids.shape[1]} tokens of the passage)\n")
    print(HEADER)
    runs = [(n, d, a, None) for n, d in DTYPES.items() for a in ("eager", "sdpa")]
    runs += [("fp32", torch.float32, "sdpa", q) for q in ("gguf", "int8", "int4")]
    for name, dtype, attention, quantize in runs:
        model = torchgemma.load("gemma3-270m", dtype=dtype, attention=attention, quantize=quantize)
        label = f"torchgemma {name} {attention}" + (f" {quantize}" if quantize else "")
        reports[label] = compare_captures(capture_torchgemma(model, ids, label), base)
        print(row(label, reports[label]))
        del model
    path = resolve_source("gemma3-270m")
    for name, dtype in DTYPES.items():
        for attention in ("eager", "sdpa"):
            model = AutoModelForCausalLM.from_pretrained(
                path.parent, gguf_file=path.name, dtype=dtype, attn_implementation=attention
            ).eval()
            label = f"transformers {name} {attention}"
            reports[label] = compare_captures(capture_transformers(model, ids, label), base)
            print(row(label, reports[label]))
            del model
    print("\nResidual stream's relative error by layer:\n")
    keep = ["torchgemma fp32 eager", "torchgemma bf16 eager", "transformers bf16 eager", "torchgemma fp32 sdpa gguf",
            "torchgemma fp32 sdpa int8", "torchgemma fp32 sdpa int4"]  # fmt: skip
    print(per_layer_table({k: reports[k] for k in keep}))
    if plots:
        plot_compare(reports["torchgemma bf16 eager"], plots / "gemma3-270m-bf16.png")
        plot_compare(reports["torchgemma fp32 sdpa int8"], plots / "gemma3-270m-int8.png")
    print()


# ── the seeds' claims ───────────────────────────────────────────────────────────────────────────


@contextmanager
def attention_probe(entropies: list[float]):
    """Record every eager attention's mean softmax entropy (nats, over heads and query positions)."""
    original = model_attention.eager_attention

    def probed(query, key, value, mask, scale=1.0):
        groups = query.shape[1] // key.shape[1]
        k = key.repeat_interleave(groups, dim=1).double()
        scores = torch.matmul(query.double(), k.transpose(2, 3)) * scale
        if mask is not None:
            scores = scores + mask.double()
        logp = torch.log_softmax(scores, -1)
        entropies.append(float(-(logp.exp() * logp.nan_to_num(0.0, 0.0, 0.0)).sum(-1).mean()))
        return original(query, key, value, mask, scale)

    model_attention.eager_attention = probed
    try:
        yield
    finally:
        model_attention.eager_attention = original


def without_qk_norm(model) -> list:
    """Forward hooks that hand each q_norm / k_norm's input through unchanged."""
    return [
        module.register_forward_hook(lambda m, args, out: args[0])
        for name, module in model.named_modules()
        if name.endswith((".q_norm", ".k_norm"))
    ]


def set_scale(model, scale: float | None) -> None:
    for module in model.modules():
        if isinstance(module, model_text.Attention) and scale is not None:
            module.scale = scale


def entropy_of(model, ids, *, qk_norm: bool = True, scale: float | None = None) -> tuple[float, torch.Tensor]:
    saved = {m: m.scale for m in model.modules() if isinstance(m, model_text.Attention)}
    set_scale(model, scale)
    hooks = [] if qk_norm else without_qk_norm(model)
    entropies: list[float] = []
    try:
        with attention_probe(entropies), torch.no_grad():
            logits = model(ids)
    finally:
        for hook in hooks:
            hook.remove()
        for module, value in saved.items():
            module.scale = value
    return float(np.mean(entropies)), logits[0].double()


def llama_order_forward(self, x):
    """Llama's RMSNorm order: normalise in float32, cast to the model dtype, then multiply by the weight."""
    xf = x.to(torch.promote_types(x.dtype, torch.float32))
    if self.plus_one:
        normed = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x)
        return normed * (1.0 + self.weight.to(x.dtype))
    normed = (xf * torch.pow(xf.pow(2).mean(-1, keepdim=True) + self.eps, -0.5)).type_as(x)
    return normed * self.weight.to(x.dtype) if self.with_scale else normed


def greedy(model, tokenizer, prompts, count: int) -> list[list[int]]:
    tokens = []
    for prompt in prompts:
        ids = torch.tensor([tokenizer.encode(prompt)])
        greedy = torchgemma.SamplingParams(temperature=0.0)
        out = torchgemma.generate(model, ids, max_new_tokens=count, sampling=greedy, stop_token_ids=[])
        tokens.append(out[0, ids.shape[1] :].tolist())
    return tokens


def claims(plots: Path | None) -> None:
    from quality import PROMPTS  # the same five prompts as the quantization quality table

    tokenizer = torchgemma.load_tokenizer("gemma3-270m")
    ids = passage_ids(tokenizer, 64)
    model = torchgemma.load("gemma3-270m", dtype=torch.float64, attention="eager", quantize=None)
    d = model.config.text.layers[0].head_dim
    print(
        f"## QK-norm and the score scale (real 270M, float64, {ids.shape[1]} tokens; uniform over k keys = ln k)\n"
    )
    print("| attention | mean softmax entropy (nats) | logits max \\|Δ\\| vs as trained | top-1 agree |")
    print("|---|---:|---:|---:|")
    base_entropy, base = entropy_of(model, ids)
    variants = [
        ("as trained: QK-norm, scale 1/√d", dict()),
        ("no QK-norm, scale 1/√d", dict(qk_norm=False)),
        ("QK-norm, scale 1 (Gemma 4's)", dict(scale=1.0)),
        ("no QK-norm, scale 1", dict(qk_norm=False, scale=1.0)),
    ]
    for label, options in variants:
        entropy, logits = entropy_of(model, ids, **options)
        agree = int((logits.argmax(-1) == base.argmax(-1)).sum())
        print(
            f"| {label} | {entropy:.3f} | {float((logits - base).abs().max()):.3g} | {agree}/{ids.shape[1]} |"
        )
    print(f"\n(head dim d = {d}; mean ln(keys visible) = {mean_log_keys(model, ids):.3f})\n")

    from checkpoints import build_text_checkpoint

    folder = build_text_checkpoint(Path(tempfile.mkdtemp()) / "e4b", "e4b", seed=2)
    tiny = torchgemma.load(folder, dtype=torch.float64, attention="eager")
    tiny_ids = torch.tensor([[2, 17, 35, 99, 7, 64, 12, 5, 250, 31, 8, 140, 77, 201, 3, 56]])
    dt = tiny.config.text.layers[0].head_dim
    print("Tiny random Gemma 4 (e4b style, float64, 16 tokens):\n")
    print("| attention | mean softmax entropy (nats) |\n|---|---:|")
    for label, options in [
        ("as built: QK-norm, scale 1", dict()),
        ("QK-norm, scale 1/√d", dict(scale=dt**-0.5)),
        ("no QK-norm, scale 1", dict(qk_norm=False)),
    ]:
        print(f"| {label} | {entropy_of(tiny, tiny_ids, **options)[0]:.3f} |")
    print()

    print("## RMSNorm's order in bf16 (real 270M): Gemma's (x·w in float32, then cast) against Llama's\n")
    wide = capture_reference(reference.weights_from_model(model), model.config.text, ids)
    fp32 = torchgemma.load("gemma3-270m", dtype=torch.float32, quantize=None)
    expected = greedy(fp32, tokenizer, PROMPTS, 64)
    long_ids = passage_ids(tokenizer, 512)
    with torch.no_grad():
        long_expected = fp32(long_ids)[0].double().numpy()
    del model, fp32
    bf16 = torchgemma.load("gemma3-270m", dtype=torch.bfloat16, attention="eager", quantize=None)
    print(
        "| order | vs float64, 64 tokens: logits max \\|Δ\\| | KL mean | top-1 agree "
        "| vs float32, 512 tokens: KL mean | top-1 agree | greedy tokens equal to float32 (5 × 64) |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|")
    for label, forward in [
        ("Gemma: (x̂·w) in float32, cast", None),
        ("Llama: cast x̂, then ·w in bf16", llama_order_forward),
    ]:
        original = model_layers.RMSNorm.forward
        if forward is not None:
            model_layers.RMSNorm.forward = forward
        try:
            report = compare_captures(capture_torchgemma(bf16, ids, label), wide)
            tokens = greedy(bf16, tokenizer, PROMPTS, 64)
            with torch.no_grad():
                long = bf16(long_ids)[0].double().numpy()
        finally:
            model_layers.RMSNorm.forward = original
        equal = sum(prefix_length(a, b) for a, b in zip(tokens, expected))
        g, forced = report.logits, logit_error(long, long_expected)
        print(
            f"| {label} | {g.max_abs:.3g} | {g.kl_mean:.2e} | {g.top1_agree}/{g.positions} "
            f"| {forced.kl_mean:.2e} | {forced.top1_agree}/{forced.positions} | {equal}/320 |"
        )
    print()


def prefix_length(a: list[int], b: list[int]) -> int:
    """How many tokens agree before the first difference (after that the two runs diverge)."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return min(len(a), len(b))


def mean_log_keys(model, ids) -> float:
    """The mean over layers and positions of ln(number of keys a query sees): the uniform entropy."""
    t = ids.shape[1]
    values = []
    for spec in model.config.text.layers:
        w = spec.window or t
        values.append(np.mean([np.log(min(i + 1, w)) for i in range(t)]))
    return float(np.mean(values))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("part", choices=["tiny", "real", "claims", "all"])
    parser.add_argument("--plots", type=Path, default=None, help="write error-by-layer PNGs here")
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.plots:
        args.plots.mkdir(parents=True, exist_ok=True)
    for part in ("tiny", "real", "claims") if args.part == "all" else (args.part,):
        globals()[part](args.plots)


if __name__ == "__main__":
    main()
