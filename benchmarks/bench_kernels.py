"""The weight-only matrix products a CPU offers PyTorch, timed on the shapes of the real 270M.

Batch-1 decode multiplies one activation row by every weight matrix, so it is bound by the bytes a
product reads. This times, one matrix-vector product at a time (1 row, float32 activations):

* float32 and bfloat16 ``F.linear`` (what an unquantized model runs);
* fbgemm's fp16 weights (``torch.ops.quantized.linear_dynamic_fp16``) and dynamic int8
  (``torch.ops.quantized.linear_dynamic``: activations quantized per tensor on the fly);
* ``torch._weight_int8pack_mm`` (int8 weights, a scale per row) and
  ``torch._weight_int4pack_mm_for_cpu`` (int4 groups of 32);
* torchgemma's ``torchgemma::qlinear`` (C++ kernels): 8-bit groups of 32 with float32 scales and
  with float16 scales (Q8_0 as stored), 8-bit per row, 4-bit groups of 32 with offsets (Q4_K), 5-bit
  groups of 32 with float16 scales and offsets (Q5_0 as stored), and its pure-PyTorch fallback.

Shapes: the tied LM head (262144 x 640, 63% of the file's bytes) and the MLP's up projection
(2048 x 640). Reports the median time of interleaved repetitions, the bytes each reads and the
bandwidth that makes; prints the load average and thread count. Not a test.

    python benchmarks/bench_kernels.py [--threads 1] [--repeats 30] [--isa portable|avx2|avx512]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import warnings

import torch
import torch.nn.functional as F

from torchgemma import kernels
from torchgemma.quantization import Format, ensure_kernels, kernel_status, quantize_rtn

SHAPES = {"lm head 262144x640": (262144, 640), "mlp up 2048x640": (2048, 640)}


def candidates(weight: torch.Tensor) -> dict[str, tuple[callable, int]]:
    """name -> (product of a (1, K) float32 row, bytes it reads)."""
    n, k = weight.shape
    out: dict[str, tuple[callable, int]] = {}
    out["float32 F.linear"] = (lambda x, w=weight: F.linear(x, w), weight.nbytes)
    bf16 = weight.to(torch.bfloat16)
    out["bfloat16 F.linear"] = (lambda x, w=bf16: F.linear(x.to(torch.bfloat16), w), bf16.nbytes)
    try:
        packed = torch.ops.quantized.linear_prepack_fp16(weight, None)
        out["fbgemm fp16 weights"] = (
            lambda x, p=packed: torch.ops.quantized.linear_dynamic_fp16(x, p),
            weight.numel() * 2,
        )
        qw = torch.quantize_per_channel(
            weight, weight.abs().amax(1) / 127, torch.zeros(n, dtype=torch.long), 0, torch.qint8
        )
        packed8 = torch.ops.quantized.linear_prepack(qw, None)
        out["fbgemm dynamic int8"] = (
            lambda x, p=packed8: torch.ops.quantized.linear_dynamic(x, p, True),
            weight.numel() + 8 * n,
        )
    except (RuntimeError, AttributeError) as err:
        print(f"fbgemm: {err}", file=sys.stderr)
    q8, s8, _ = quantize_rtn(weight, Format(8, k, False))
    scales_row = s8[:, 0].contiguous()
    out["torch._weight_int8pack_mm"] = (
        lambda x, q=q8, s=scales_row: torch._weight_int8pack_mm(x, q, s),
        q8.nbytes + scales_row.nbytes,
    )
    try:
        ints = torch.randint(0, 16, (n, k), dtype=torch.int32)
        packed4 = torch._convert_weight_to_int4pack_for_cpu(ints, 1)
        sz = torch.rand(k // 32, n, 2)
        out["torch._weight_int4pack_mm_for_cpu"] = (
            lambda x, p=packed4, sz=sz: torch._weight_int4pack_mm_for_cpu(x, p, 32, sz),
            packed4.nbytes + sz.nbytes,
        )
    except (RuntimeError, AttributeError) as err:
        print(f"int4pack: {err}", file=sys.stderr)
    for label, fmt in (
        ("torchgemma qlinear 8-bit g32", Format(8, 32, False)),
        ("torchgemma qlinear 8-bit g32 fp16 scales", Format(8, 32, False, "float16")),
        ("torchgemma qlinear 8-bit per row", Format(8, k, False)),
        ("torchgemma qlinear 4-bit g32 + offsets", Format(4, 32, True)),
        ("torchgemma qlinear 5-bit g32 + offsets fp16", Format(5, 32, True, "float16")),
    ):
        q, s, m = quantize_rtn(weight, fmt)
        nbytes = q.nbytes + s.nbytes + (m.nbytes if m is not None else 0)
        out[label] = (
            lambda x, q=q, s=s, m=m, f=fmt: torch.ops.torchgemma.qlinear(x, q, s, m, f.bits, f.group_size),
            nbytes,
        )
        if fmt == Format(8, 32, False):
            out["torchgemma fallback (dequantize + F.linear)"] = (
                lambda x, q=q, s=s, f=fmt: kernels._qlinear_reference(x, q, s, None, f.bits, f.group_size),
                nbytes,
            )
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument(
        "--isa", choices=kernels.ISAS, help="the C++ kernels' instruction set (default: the widest it has)"
    )
    args = parser.parse_args(argv)
    warnings.simplefilter("ignore")
    torch.set_num_threads(args.threads)
    ensure_kernels()
    if args.isa:
        kernels.set_isa(args.isa)
    results = {}
    for shape_name, (n, k) in SHAPES.items():
        weight = torch.randn(n, k, generator=torch.Generator().manual_seed(0)) * 0.02
        x = torch.randn(1, k)
        ops = candidates(weight)
        times: dict[str, list[float]] = {name: [] for name in ops}
        for fn, _ in ops.values():
            fn(x)  # warm up
        repeats = args.repeats if n < 100_000 else max(5, args.repeats // 3)
        for _ in range(repeats):
            for name, (fn, _) in ops.items():  # interleaved
                start = time.perf_counter()
                fn(x)
                times[name].append(time.perf_counter() - start)
        results[shape_name] = {
            name: {"ms": statistics.median(t) * 1e3, "bytes": ops[name][1]} for name, t in times.items()
        }
    print(
        f"threads {args.threads}, load average {[round(v, 2) for v in os.getloadavg()]}, torch {torch.__version__}, "
        f"cpu capability {torch.backends.cpu.get_cpu_capability()}; {kernel_status()}"
    )
    for shape_name, rows in results.items():
        print(f"\n{shape_name}: one float32 row, median of interleaved repeats")
        print(f"{'product':45} {'ms':>9} {'MB read':>9} {'GB/s':>7}")
        for name, row in rows.items():
            print(
                f"{name:45} {row['ms']:9.3f} {row['bytes'] / 1e6:9.1f} {row['bytes'] / row['ms'] / 1e6:7.1f}"
            )
    record = {"benchmark": "kernels", "threads": args.threads, "isa": kernels.isa(), "results": results}
    print(json.dumps(record))
    return 0


if __name__ == "__main__":
    sys.exit(main())
