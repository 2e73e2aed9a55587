"""Long prompts: chunked prefill of 1K to 32K tokens, its speed and the memory it needs.

    python benchmarks/bench_long_prompt.py                         # 5 layers at E2B widths, fp32
    python benchmarks/bench_long_prompt.py --lengths 1024,8192 --attention sdpa,eager --peer

Each (length, backend) runs in a fresh process: load the checkpoint, make the engine (its cache is
allocated and zeroed), note the resident memory, reset the kernel's peak-RSS counter, then prefill a
random prompt of that length through the engine (chunks of ``--chunk`` tokens) up to its first new
token. Reported: prefill tok/s = prompt tokens / time to the first token, and the peak resident
memory beyond what the weights and the cache already held. ``--peer`` times transformers' own
one-shot prefill (sdpa) the same way, for lengths up to ``--peer-max``. One run per point: these
take minutes, and the load average is printed with them. Timings are never test assertions.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "benchmarks"))

from common import build_checkpoint, machine  # noqa: E402

GIB = 2**30


def rss_bytes(field: str = "VmRSS") -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def reset_peak() -> None:
    # Linux: writing 5 to clear_refs resets VmHWM (the peak RSS) to the current RSS.
    Path("/proc/self/clear_refs").write_text("5")


def child(args) -> dict:
    """One measurement, in this (fresh) process."""
    import torchgemma

    torch.set_num_threads(args.threads)
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype]
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(3, 262144, (args.length,), generator=gen).tolist()
    prompt[0] = 2
    if args.implementation == "transformers":
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(args.checkpoint, dtype=dtype, attn_implementation="sdpa")
        model.eval()
        base = rss_bytes()
        reset_peak()
        start = time.perf_counter()
        with torch.no_grad():
            model.generate(torch.tensor([prompt]), max_new_tokens=1, do_sample=False, eos_token_id=None)
        seconds = time.perf_counter() - start
        cache_bytes = None  # transformers' DynamicCache grows during the call: counted in the peak
    else:
        model = torchgemma.load(args.checkpoint, dtype=dtype, attention=args.implementation)
        engine = torchgemma.Engine(model, max_batch_size=1, max_len=args.length + 1, prefill_chunk=args.chunk)
        cache_bytes = engine.cache.nbytes
        base = rss_bytes()
        reset_peak()
        start = time.perf_counter()
        engine.add_request(0, prompt, max_new_tokens=1, sampling=torchgemma.SamplingParams(temperature=0))
        while engine.has_unfinished_requests():
            engine.step()
        seconds = time.perf_counter() - start
    peak = rss_bytes("VmHWM")
    return {
        "length": args.length,
        "implementation": args.implementation,
        "prefill_seconds": seconds,
        "prefill_tok_s": args.length / seconds,
        "rss_before_bytes": base,
        "peak_beyond_weights_and_cache_bytes": peak - base,
        "cache_bytes": cache_bytes,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--checkpoint", type=Path, default=None, help="default: build an E2B-width one")
    parser.add_argument("--layers", type=int, default=5, help="layers of the built checkpoint (4:1 pattern)")
    parser.add_argument("--lengths", default="1024,8192,32768")
    parser.add_argument("--attention", default="sdpa", help="our backends to time, comma-separated")
    # float32 by default: CPUs without AVX-512 bf16 (like the 2-core EPYC here) run bf16 GEMMs through a
    # slow generic kernel, five times slower than MKL float32.
    parser.add_argument("--dtype", choices=["bf16", "fp32"], default="fp32")
    parser.add_argument("--chunk", type=int, default=512, help="prefill chunk (tokens)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--peer", action="store_true", help="also time transformers' one-shot prefill")
    parser.add_argument("--peer-max", type=int, default=8192, help="longest prompt given to transformers")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--length", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--implementation", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(child(args)))
        return 0

    folder = args.checkpoint or Path(tempfile.gettempdir()) / f"torchgemma-bench-e2b-{args.layers}l-noshare"
    if args.checkpoint is None:
        build_checkpoint(folder, args.layers, shared=0)
    lengths = [int(n) for n in args.lengths.split(",")]
    plan = [(n, impl) for n in lengths for impl in args.attention.split(",")]
    if args.peer:
        plan += [(n, "transformers") for n in lengths if n <= args.peer_max]
    results = []
    for length, implementation in plan:
        command = [
            sys.executable, __file__, "--child", "--checkpoint", str(folder), "--length", str(length),
            "--implementation", implementation, "--dtype", args.dtype, "--chunk", str(args.chunk),
            "--threads", str(args.threads),
        ]  # fmt: skip
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode != 0:
            print(done.stderr[-2000:], file=sys.stderr)
            results.append({"length": length, "implementation": implementation, "error": done.returncode})
            continue
        results.append(json.loads(done.stdout.strip().splitlines()[-1]))
        row = results[-1]
        print(
            f"{implementation:12} {length:6d} tokens: {row['prefill_tok_s']:8.1f} tok/s, "
            f"peak beyond weights and cache {row['peak_beyond_weights_and_cache_bytes'] / GIB:.2f} GiB",
            file=sys.stderr,
        )

    info = machine()
    info["torch_threads"] = args.threads
    print(
        f"\n{info['cpu']}, {info['cores']} cores, load average {info['load_average']}, {args.threads} torch "
        f"threads, torch {info['torch']}, commit {info['commit']}"
    )
    print(f"checkpoint {folder.name}, {args.dtype}, prefill chunk {args.chunk}\n")
    header = f"{'implementation':14} {'prompt':>7} {'prefill tok/s':>14} {'seconds':>9} {'peak beyond weights+cache':>26} {'KV cache':>10}"
    print(header)
    print("-" * len(header))
    for row in results:
        if "error" in row:
            print(f"{row['implementation']:14} {row['length']:7d}  failed (exit {row['error']})")
            continue
        cache = "" if row["cache_bytes"] is None else f"{row['cache_bytes'] / GIB:.3f} GiB"
        print(
            f"{row['implementation']:14} {row['length']:7d} {row['prefill_tok_s']:14.1f} "
            f"{row['prefill_seconds']:9.1f} {row['peak_beyond_weights_and_cache_bytes'] / GIB:22.2f} GiB {cache:>10}"
        )
    print(
        json.dumps(
            {
                "benchmark": "long_prompt",
                "checkpoint": str(folder),
                "dtype": args.dtype,
                **info,
                "results": results,
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
