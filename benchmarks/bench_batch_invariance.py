"""What batch invariance costs: engine decode tok/s at batch 1, 4 and 16, with and without it.

    python benchmarks/bench_batch_invariance.py                 # real Gemma 3 270M, bf16 and fp32
    python benchmarks/bench_batch_invariance.py --dtypes bf16 --batches 1,4 --runs 3

``Engine(batch_invariant=True)`` runs a forward over several requests request by request when
``RowProbe`` finds that this machine's kernels round a row differently in a larger call
(generation/invariance.py). Where it finds nothing (bf16 on AVX2), the only cost is the probe,
once per model; where it does (float32 on MKL: 1 row vs 2+), decode runs one forward per request.
Both settings are timed in the same run, interleaved, medians of ``--runs``; one torch thread by
default (steadier on shared 2-core machines). The probe's own time is reported apart.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

import torchgemma  # noqa: E402
from torchgemma.generation import Engine, SamplingParams  # noqa: E402
from torchgemma.generation.invariance import RowProbe  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def decode_rate(model, batch: int, invariant: bool, prompt_len: int, new: int) -> float:
    """Decode tokens per second of ``batch`` greedy requests of ``new`` tokens (after their prefill)."""
    engine = Engine(model, max_batch_size=batch, max_len=prompt_len + new + 1, batch_invariant=invariant)
    gen = torch.Generator().manual_seed(batch)
    for i in range(batch):
        prompt = torch.randint(10, 20000, (prompt_len,), generator=gen).tolist()
        engine.add_request(i, prompt, sampling=SamplingParams(), max_new_tokens=new, stop_token_ids=[])
    tokens, started = 0, None
    while engine.has_unfinished_requests():
        outputs = engine.step()
        if started is None and all(engine.requests[r].decoding for r in engine.requests):
            started = time.perf_counter()  # every request has its first token: decoding from here
            continue
        if started is not None:
            tokens += len(outputs)
    return tokens / (time.perf_counter() - started)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="gemma3-270m")
    parser.add_argument("--dtypes", default="bf16,fp32")
    parser.add_argument("--batches", default="1,4,16")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--new", type=int, default=24)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(
        f"machine: {os.cpu_count()} cores, torch {torch.__version__}, {args.threads} thread(s), "
        f"load average {os.getloadavg()[0]:.2f}; oneDNN bf16: {torch.ops.mkldnn._is_mkldnn_bf16_supported()}"
    )
    batches = [int(b) for b in args.batches.split(",")]
    for name in args.dtypes.split(","):
        model = torchgemma.load(args.model, dtype=DTYPES[name], quantize=None)
        started = time.perf_counter()
        probe = RowProbe.run(model.language_model, max(batches), DTYPES[name])
        probe_seconds = time.perf_counter() - started
        print(
            f"\n{args.model} {name} dense: probe {probe_seconds:.2f} s, first row-count boundary: {probe.first}"
        )
        print(f"{'batch':>5} {'plain tok/s':>12} {'invariant tok/s':>16} {'ratio':>6}")
        for batch in batches:
            rates: dict[bool, list[float]] = {False: [], True: []}
            for _ in range(args.runs):
                for invariant in (False, True):  # interleaved
                    rates[invariant].append(decode_rate(model, batch, invariant, args.prompt_len, args.new))
            plain, invariant = statistics.median(rates[False]), statistics.median(rates[True])
            print(f"{batch:>5} {plain:>12.1f} {invariant:>16.1f} {invariant / plain:>6.2f}", flush=True)
        print(f"load average after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
