"""Batched generation: prefill and decode tok/s at batch 1, 4 and 16, ours against transformers'.

    python benchmarks/bench_engine.py                                  # E2B widths, 10 layers, fp32
    python benchmarks/bench_engine.py --batches 1,4 --dtype bf16 --no-compile

Implementations, all greedy from the same B random prompts with no stop token:

* torchgemma ``eager`` and ``sdpa`` attention (the engine: each row its own sequence, one prefill
  per row, one decode forward for all rows), and ``compiled``: sdpa with ``torchgemma.compile``
  (inductor; its static decode step runs every slot). Its compile time is reported apart and its
  first (compiling) run is a warm-up.
* transformers 5.23's ``generate`` with ``attn_implementation="sdpa"`` (its default) and
  ``"eager"``, on the same (unpadded, equal-length) batch.

Prefill tok/s = B x prompt tokens / time until every row has its first token; decode tok/s =
B x (new tokens - 1) / time from then to the last token. Runs of all implementations are
interleaved; medians after warm-up. Timings are measurements, never test assertions.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench_generate import _Stamps  # noqa: E402
from common import build_checkpoint, machine  # noqa: E402

import torchgemma  # noqa: E402
from torchgemma.generation import SamplingParams, stream  # noqa: E402


def time_ours(model, prompts: torch.Tensor, new_tokens: int) -> tuple[float, float, torch.Tensor]:
    """Seconds to every row's first token, seconds from there to the last, the tokens."""
    start = time.perf_counter()
    stamps, tokens = [], []
    greedy = SamplingParams(temperature=0)
    rows = prompts.tolist()
    for step in stream(model, rows, max_new_tokens=new_tokens, sampling=greedy, stop_token_ids=[]):
        stamps.append(time.perf_counter() - start)
        tokens.append(step)
    return stamps[0], stamps[-1] - stamps[0], torch.stack(tokens, 1)


def time_transformers(model, prompts: torch.Tensor, new_tokens: int) -> tuple[float, float, torch.Tensor]:
    start = time.perf_counter()
    streamer = _Stamps(start)
    with torch.no_grad():
        out = model.generate(
            prompts,
            attention_mask=torch.ones_like(prompts),
            max_new_tokens=new_tokens,
            do_sample=False,
            eos_token_id=None,
            streamer=streamer,
        )
    return streamer.stamps[0], streamer.stamps[-1] - streamer.stamps[0], out[:, prompts.shape[1] :]


def bench_batch(ours, compiled, theirs, batch: int, args) -> dict:
    gen = torch.Generator().manual_seed(batch)
    prompts = torch.randint(3, 262144, (batch, args.prompt_len), generator=gen)
    prompts[:, 0] = 2

    def run(name: str):
        if name.startswith("transformers"):
            theirs.set_attn_implementation(name.split()[-1].strip("()"))
            return time_transformers(theirs, prompts, args.new_tokens)
        ours.set_attention("eager" if name == "torchgemma eager" else "sdpa")
        ours.compiled_decode = compiled if name == "torchgemma compiled" else None
        return time_ours(ours, prompts, args.new_tokens)

    names = ["torchgemma eager", "torchgemma sdpa"]
    if compiled is not None:
        names.append("torchgemma compiled")
    names += [f"transformers ({attn})" for attn in args.peers]
    samples = {name: [] for name in names}
    tokens = {}
    compile_seconds = None
    if compiled is not None:  # the first call compiles
        started = time.perf_counter()
        run("torchgemma compiled")
        compile_seconds = time.perf_counter() - started
    for index in range(args.warmup + args.runs):
        for name in names:
            first, rest, out = run(name)
            if index >= args.warmup:
                samples[name].append((first, rest))
            tokens[name] = out
    rows = {}
    decoded = batch * (args.new_tokens - 1)
    for name, runs in samples.items():
        rows[name] = {
            "prefill_tok_s": batch * args.prompt_len / statistics.median(r[0] for r in runs),
            "decode_tok_s": decoded / statistics.median(r[1] for r in runs),
            "same_tokens_as_torchgemma_eager": bool(torch.equal(tokens[name], tokens["torchgemma eager"])),
        }
    if compile_seconds is not None:
        rows["torchgemma compiled"]["first_call_seconds_with_compile"] = compile_seconds
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--checkpoint", type=Path, default=None, help="default: build an E2B-width one")
    parser.add_argument("--layers", type=int, default=10)
    parser.add_argument("--batches", default="1,4,16")
    # float32 by default: CPUs without AVX-512 bf16 run bf16 GEMMs through a slow generic kernel.
    parser.add_argument("--dtype", choices=["bf16", "fp32"], default="fp32")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--peers", default="sdpa,eager", help="transformers attention implementations")
    parser.add_argument("--no-compile", action="store_true", help="skip the compiled decode step")
    args = parser.parse_args(argv)
    args.peers = [p for p in args.peers.split(",") if p]
    if args.threads:
        torch.set_num_threads(args.threads)
    folder = args.checkpoint or Path(tempfile.gettempdir()) / f"torchgemma-bench-e2b-{args.layers}l"
    if args.checkpoint is None:
        build_checkpoint(folder, args.layers)
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype]

    from transformers import AutoModelForCausalLM

    ours = torchgemma.load(folder, dtype=dtype)
    compiled = None
    if not args.no_compile:
        compiled = torchgemma.compile(ours).compiled_decode
    theirs = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, attn_implementation="sdpa").eval()
    results = {}
    for batch in [int(b) for b in args.batches.split(",")]:
        results[batch] = bench_batch(ours, compiled, theirs, batch, args)
        gc.collect()

    info = machine()
    print(
        f"\n{info['cpu']}, {info['cores']} cores, load average {info['load_average']}, "
        f"{info['torch_threads']} torch threads, torch {info['torch']}, transformers {info['transformers']}, "
        f"commit {info['commit']}"
    )
    print(
        f"checkpoint {folder.name}, {args.dtype}: prompts of {args.prompt_len} tokens, {args.new_tokens} new, "
        f"greedy; median of {args.runs} runs after {args.warmup} warm-up\n"
    )
    header = f"{'batch':>5} {'implementation':24} {'prefill tok/s':>14} {'decode tok/s':>13} {'decode vs tf sdpa':>18} {'same tokens':>12}"
    print(header)
    print("-" * len(header))
    for batch, rows in results.items():
        peer = rows.get("transformers (sdpa)")
        for name, row in rows.items():
            ratio = f"{row['decode_tok_s'] / peer['decode_tok_s']:17.2f}x" if peer else ""
            same = "yes" if row["same_tokens_as_torchgemma_eager"] else "no"
            print(
                f"{batch:5d} {name:24} {row['prefill_tok_s']:14.1f} {row['decode_tok_s']:13.2f} {ratio:>18} {same:>12}"
            )
        if "torchgemma compiled" in rows:
            seconds = rows["torchgemma compiled"]["first_call_seconds_with_compile"]
            print(f"{'':5} (compiled: first call, compiling included, {seconds:.0f} s)")
    print(
        json.dumps(
            {
                "benchmark": "engine",
                "checkpoint": str(folder),
                "dtype": args.dtype,
                "prompt_len": args.prompt_len,
                "new_tokens": args.new_tokens,
                "runs": args.runs,
                "warmup": args.warmup,
                "device": "cpu",
                **info,
                "results": results,
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
