"""Prefill and decode speed of torchgemma's generate against transformers' on one checkpoint.

    python benchmarks/bench_generate.py                      # E2B widths, 10 layers, bf16 and fp32
    python benchmarks/bench_generate.py --checkpoint PATH --dtype bf16 --prompt-len 512

Both generate greedily from the same random prompt with no stop token, so every run produces the
same number of tokens. Each token's arrival is timestamped the same way for both (our iterator,
transformers' streamer): prefill tok/s = prompt tokens / time to the first new token; decode tok/s =
(new tokens - 1) / time from the first to the last. Warm-up runs are dropped; medians of the rest
are reported, with the runs of the implementations interleaved so that machine noise hits all alike.
Prints a table and one JSON line. Timings are measurements, never test assertions.
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

from common import build_checkpoint, machine  # noqa: E402

import torchgemma  # noqa: E402
from torchgemma.generation import SamplingParams, stream  # noqa: E402

# ---- timing one generation ---------------------------------------------------------------------


def time_torchgemma(model, prompt: torch.Tensor, new_tokens: int) -> tuple[list[float], torch.Tensor]:
    """Arrival times of each new token (seconds from the call) and the tokens."""
    start = time.perf_counter()
    stamps, tokens = [], []
    greedy = SamplingParams(temperature=0)
    for token in stream(model, prompt, max_new_tokens=new_tokens, sampling=greedy, stop_token_ids=[]):
        stamps.append(time.perf_counter() - start)
        tokens.append(token)
    return stamps, torch.stack(tokens, 1)


class _Stamps:
    """A transformers streamer that only records when tokens arrive (the first put is the prompt)."""

    def __init__(self, start: float):
        self.start, self.stamps, self.seen_prompt = start, [], False

    def put(self, value):
        if not self.seen_prompt:
            self.seen_prompt = True
            return
        self.stamps.append(time.perf_counter() - self.start)

    def end(self):
        pass


def time_transformers(model, prompt: torch.Tensor, new_tokens: int) -> tuple[list[float], torch.Tensor]:
    start = time.perf_counter()
    streamer = _Stamps(start)
    with torch.no_grad():
        out = model.generate(
            prompt,
            attention_mask=torch.ones_like(prompt),
            max_new_tokens=new_tokens,
            do_sample=False,
            eos_token_id=None,
            streamer=streamer,
        )
    return streamer.stamps, out[:, prompt.shape[1] :]


def speeds(stamps: list[float], prompt_len: int) -> tuple[float, float]:
    prefill = prompt_len / stamps[0]
    decode = (len(stamps) - 1) / (stamps[-1] - stamps[0])
    return prefill, decode


# ---- the run -----------------------------------------------------------------------------------


def bench_dtype(folder: Path, dtype: torch.dtype, args) -> dict:
    from transformers import AutoModelForCausalLM

    models = {"torchgemma": ("ours", torchgemma.load(folder, dtype=dtype))}
    for attn in args.peers:
        ref = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, attn_implementation=attn).eval()
        models[f"transformers ({attn})"] = ("ref", ref)

    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(3, 262144, (1, args.prompt_len), generator=gen)
    prompt[0, 0] = 2  # <bos>
    samples = {name: [] for name in models}
    outputs = {}
    for run in range(args.warmup + args.runs):
        for name, (kind, model) in models.items():
            timer = time_torchgemma if kind == "ours" else time_transformers
            stamps, tokens = timer(model, prompt, args.new_tokens)
            if run >= args.warmup:
                samples[name].append(speeds(stamps, args.prompt_len))
            outputs[name] = tokens
    del models
    gc.collect()

    rows = {}
    for name, runs in samples.items():
        rows[name] = {
            "prefill_tok_s": statistics.median(r[0] for r in runs),
            "decode_tok_s": statistics.median(r[1] for r in runs),
            "same_tokens_as_torchgemma": bool(torch.equal(outputs[name], outputs["torchgemma"])),
        }
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--checkpoint", type=Path, default=None, help="default: build an E2B-width one")
    parser.add_argument("--layers", type=int, default=10, help="layers of the built checkpoint")
    parser.add_argument("--dtype", choices=["bf16", "fp32", "both"], default="both")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument(
        "--peers", default="sdpa,eager", help="transformers attention implementations to compare with"
    )
    args = parser.parse_args(argv)
    args.peers = [p for p in args.peers.split(",") if p]
    if args.threads:
        torch.set_num_threads(args.threads)

    folder = args.checkpoint or Path(tempfile.gettempdir()) / f"torchgemma-bench-e2b-{args.layers}l"
    if args.checkpoint is None:
        build_checkpoint(folder, args.layers)
    dtypes = {"bf16": [torch.bfloat16], "fp32": [torch.float32], "both": [torch.bfloat16, torch.float32]}

    results = {}
    for dtype in dtypes[args.dtype]:
        results[str(dtype).removeprefix("torch.")] = bench_dtype(folder, dtype, args)

    info = machine()
    print(
        f"\n{info['cpu']}, {info['cores']} cores, {info['torch_threads']} torch threads, "
        f"torch {info['torch']}, transformers {info['transformers']}, commit {info['commit']}"
    )
    print(
        f"checkpoint {folder.name}: prompt {args.prompt_len} tokens, {args.new_tokens} new, greedy, batch 1"
    )
    print(f"median of {args.runs} runs after {args.warmup} warm-up\n")
    header = f"{'dtype':9} {'implementation':24} {'prefill tok/s':>14} {'decode tok/s':>13} {'ours/peer prefill':>18} {'ours/peer decode':>17} {'same tokens':>12}"
    print(header)
    print("-" * len(header))
    for dtype, rows in results.items():
        ours = rows["torchgemma"]
        for name, row in rows.items():
            ratio_p = ours["prefill_tok_s"] / row["prefill_tok_s"]
            ratio_d = ours["decode_tok_s"] / row["decode_tok_s"]
            print(
                f"{dtype:9} {name:24} {row['prefill_tok_s']:14.1f} {row['decode_tok_s']:13.2f} "
                f"{ratio_p:17.2f}x {ratio_d:16.2f}x {'yes' if row['same_tokens_as_torchgemma'] else 'NO':>12}"
            )
    print(
        json.dumps(
            {
                "benchmark": "generate",
                "checkpoint": str(folder),
                "layers": args.layers if args.checkpoint is None else None,
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
