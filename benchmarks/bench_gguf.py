"""Prefill and decode speed on the real Gemma 3 270M (Q4_K_M GGUF): torchgemma, transformers, llama.cpp.

One run, one machine, the same prompt tokens for all three:

* torchgemma: the GGUF dequantized to the chosen dtype (float32 by default), eager PyTorch;
* transformers 5.23: the same file through its GGUF loader (float32), default attention (sdpa);
* llama.cpp through llama-cpp-python, when installed: the Q4_K_M weights as they are.

Greedy decoding without stop tokens; the first token's arrival times the prefill, the rest the
decode. Warm-up runs are excluded; figures are medians. Prints a table and a JSON line. Not a test.

    python benchmarks/bench_gguf.py [--runs 5] [--new-tokens 64] [--dtype fp32]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from bench_generate import machine, speeds, time_torchgemma, time_transformers  # noqa: E402

import torchgemma  # noqa: E402
from torchgemma.weights.loading import resolve_dtype  # noqa: E402
from torchgemma.weights.source import gemma3_270m  # noqa: E402

PROMPT = (
    "The history of the city begins with a small fishing village on the banks of a wide river. Over "
    "the centuries, merchants arrived from distant lands, bringing spices, silk, and new ideas. The "
    "village grew into a market town, then into a walled city with a cathedral, a university, and a "
    "busy harbour. Wars came and went; the walls were torn down and replaced by boulevards. Today the "
    "old town is a maze of narrow streets where bakeries, bookshops and small workshops stand side by "
    "side, and every summer a festival fills the squares with music. Visitors who want to understand "
    "the place should start"
)


def time_llama_cpp(llm, prompt: list[int], new_tokens: int) -> tuple[list[float], list[int]]:
    llm.reset()
    start = time.perf_counter()
    stamps, tokens = [], []
    for token in llm.generate(prompt, top_k=1, top_p=1.0, temp=0.0, repeat_penalty=1.0, reset=True):
        stamps.append(time.perf_counter() - start)
        tokens.append(token)
        if len(tokens) == new_tokens:
            break
    return stamps, tokens


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--dtype", default="fp32", help="torchgemma's dtype (transformers runs float32)")
    parser.add_argument("--threads", type=int, default=None, help="threads for all three (default: torch's)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    threads = torch.get_num_threads()

    path = gemma3_270m()
    tokenizer = torchgemma.load_tokenizer("gemma3-270m")
    ids = tokenizer.encode(PROMPT)
    prompt = torch.tensor([ids])

    runners = {
        "torchgemma": (time_torchgemma, torchgemma.load(path, dtype=resolve_dtype(args.dtype)), prompt)
    }
    from transformers import AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32
    ).eval()
    runners["transformers (sdpa, fp32)"] = (time_transformers, reference, prompt)
    try:
        from llama_cpp import Llama

        llm = Llama(model_path=str(path), n_ctx=1024, n_threads=threads, n_batch=512, verbose=False)
        runners["llama.cpp (Q4_K_M)"] = (time_llama_cpp, llm, ids)
    except ImportError:
        print("llama-cpp-python is not installed: llama.cpp is not timed", file=sys.stderr)

    samples: dict[str, list[tuple[float, float]]] = {name: [] for name in runners}
    outputs = {}
    for run in range(args.warmup + args.runs):
        for name, (timer, model, inputs) in runners.items():
            stamps, tokens = timer(model, inputs, args.new_tokens)
            if run >= args.warmup:
                samples[name].append(speeds(stamps, len(ids)))
            outputs[name] = [
                int(t) for t in (tokens.flatten().tolist() if torch.is_tensor(tokens) else tokens)
            ]

    rows = {
        name: {
            "prefill_tok_s": statistics.median(s[0] for s in runs),
            "decode_tok_s": statistics.median(s[1] for s in runs),
            "same_tokens_as_torchgemma": outputs[name] == outputs["torchgemma"],
        }
        for name, runs in samples.items()
    }
    base = rows["transformers (sdpa, fp32)"]
    print(
        f"Gemma 3 270M, prompt {len(ids)} tokens, {args.new_tokens} new tokens, {threads} threads, "
        f"median of {args.runs} runs (torchgemma {args.dtype})"
    )
    print(
        f"{'':28} {'prefill tok/s':>14} {'decode tok/s':>13} {'decode vs transformers':>23} {'same tokens':>12}"
    )
    for name, row in rows.items():
        ratio = row["decode_tok_s"] / base["decode_tok_s"]
        print(
            f"{name:28} {row['prefill_tok_s']:14.1f} {row['decode_tok_s']:13.1f} {ratio:22.2f}x "
            f"{str(row['same_tokens_as_torchgemma']):>12}"
        )
    print(
        json.dumps(
            {
                "benchmark": "gguf-270m",
                "prompt_tokens": len(ids),
                "new_tokens": args.new_tokens,
                "torchgemma_dtype": args.dtype,
                "threads": threads,
                **machine(),
                "results": rows,
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
