"""``torchgemma debug``: numerics debugging (trace: where a run first goes non-finite; compare: two
configurations module by module)."""

from __future__ import annotations

import argparse
import json

import torch

from ..weights.loading import resolve_dtype
from .common import CLIError, importable
from .options import int_at_least, parse_dtype


def add_parser(commands) -> None:
    debug = commands.add_parser(
        "debug",
        help="numerics debugging (trace: where a run first goes non-finite; compare: two configurations module by module)",
        description="Numerics debugging tools.",
    )
    tools = debug.add_subparsers(dest="tool", required=True)
    trace = tools.add_parser(
        "trace",
        help="per-module statistics of one forward pass, stopping at the first non-finite output",
        description="Run one forward pass over the prompt with a hook on every module: min, max, mean |x|, "
        "NaN/inf counts and the dtype's headroom (its largest value over max |x|) of each output, stopping at "
        "the first module whose output is not finite though its inputs were. --dtype fp16 loads the weights "
        "in float32 and casts the model to float16 (which load refuses for running: this is how to see why).",
    )
    trace.add_argument("prompt", help="the text of the forward pass (raw, no chat template)")
    trace.add_argument("--model", required=True, help="what generate's --model takes")
    trace.add_argument(
        "--dtype", type=parse_dtype, default="fp32", help="fp32, bf16, fp16 or fp64 (default: fp32)"
    )
    trace.add_argument("--attention", choices=["sdpa", "eager"], default="eager")
    trace.add_argument("--last", type=int_at_least(1), default=12, help="table rows to show (default: 12)")
    trace.add_argument("--all", action="store_true", help="record every module; do not stop at the failure")
    trace.add_argument("--json", action="store_true", help="print every record as JSON")
    trace.set_defaults(func=run_trace, parser=trace, command="debug trace")
    compare = tools.add_parser(
        "compare",
        help="two configurations on the same input, module by module",
        description="Run the prompt through two configurations with a hook on the same module names and "
        "report, for every decoder layer, the max error of each sublayer's output (attention, MLP, experts, "
        "per-layer input, residual) against the second (the baseline), the first module past --threshold, "
        "and the logits' max error, KL divergence and top-1 agreement. A configuration is "
        "IMPL[:OPTION...]: torchgemma, transformers or reference (the float64 NumPy decoder), with a "
        "dtype (fp32, bf16, fp16, fp64), an attention (eager, sdpa) and, for torchgemma, a quantization "
        "(int8, int4, gguf); e.g. torchgemma:bf16:sdpa, transformers:fp32:eager, reference.",
    )
    compare.add_argument("prompt", help="the text of the forward pass (raw, no chat template)")
    compare.add_argument("--model", required=True, help="what generate's --model takes")
    compare.add_argument(
        "--a", default="torchgemma:bf16", help="the configuration measured (default: torchgemma:bf16)"
    )
    compare.add_argument("--b", default="reference", help="the baseline (default: reference)")
    compare.add_argument(
        "--threshold", type=float, default=1e-2, help="relative error that marks a module (default: 0.01)"
    )
    compare.add_argument("--all", action="store_true", help="one row per module instead of per layer")
    compare.add_argument("--json", action="store_true", help="print the whole report as JSON")
    compare.add_argument(
        "--plot", metavar="FILE.png", help="write error by layer, log scale (needs matplotlib)"
    )
    compare.set_defaults(func=run_compare, parser=compare, command="debug compare")


def run_trace(args: argparse.Namespace) -> int:
    import dataclasses

    from ..debug import format_trace, trace
    from ..tokenizer import load_tokenizer
    from ..weights.loading import load

    dtype = resolve_dtype(args.dtype)
    # The float model (quantize=None): the trace is about the dtype's range, not quantized weights.
    model = load(
        args.model,
        dtype=torch.float32 if dtype == torch.float16 else dtype,
        attention=args.attention,
        quantize=None,
    )
    if dtype == torch.float16:
        model = model.to(torch.float16)  # refused by load for running; here to show where it breaks
    tokenizer = load_tokenizer(args.model)
    ids = torch.tensor([tokenizer.encode(args.prompt)])
    report = trace(model, ids, stop=not args.all)
    if args.json:
        rows = [
            {**dataclasses.asdict(r), "dtype": str(r.dtype).removeprefix("torch.")} for r in report.records
        ]
        first = report.first_nonfinite.name if report.first_nonfinite else None
        print(json.dumps({"first_nonfinite": first, "records": rows}))
    else:
        print(format_trace(report, last=args.last))
    return 0


def run_compare(args: argparse.Namespace) -> int:
    from ..debug import Side, compare, format_compare, plot_compare
    from ..tokenizer import load_tokenizer

    sides = [Side.parse(text) for text in (args.a, args.b)]  # bad specs fail before any loading
    if args.plot and not importable("matplotlib"):
        raise CLIError("--plot needs matplotlib: pip install 'torchgemma[plot]'")
    ids = torch.tensor([load_tokenizer(args.model).encode(args.prompt)])
    report = compare(args.model, ids, *sides, threshold=args.threshold)
    if args.plot:
        plot_compare(report, args.plot)
    if args.json:
        print(json.dumps(report.to_dict()))
    else:
        print(format_compare(report, every_module=args.all))
    return 0
