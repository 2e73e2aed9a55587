"""Speculative decoding with prompt lookup on the real Gemma 3 270M: speed-up and acceptance.

    python benchmarks/bench_speculative.py [--threads 1 2] [--runs 5] [--new-tokens 128] [--num-tokens 4]

The 270M in its default mode (the GGUF file's own blocks), greedy, one request at a time through
``Engine``, with and without ``speculative={"method": "ngram", "num_tokens": K}``:

* ``copy``: prompts whose continuations quote them (a text with its spelling corrected, code with
  a function renamed, an answer quoting a passage, a passage written out again): the workload
  prompt lookup is for (target >= 1.5x);
* ``free, drafts always wrong``: the same with prompt lookup's drafts made wrong (every token + 1):
  what adaptive drafting costs when no draft is ever accepted;
* ``free``: open-ended continuations (a story, an essay), where little is copied (target >= 0.95x:
  adaptive drafting must keep verify passes that keep one token from slowing it). The 270M base
  model still repeats itself now and then when greedy, which prompt lookup also drafts.

Decode tok/s is the tokens after the first over the time from the first to the last (prefill
excluded), per prompt; a workload's figure is the median over ``--runs`` interleaved runs (off, on,
off, on, ...) of the summed tokens over the summed time. The tokens with and without speculation
are checked identical (greedy). Load averages are printed before and after: the machine may be
shared. Timings are measurements, not tests.
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
sys.path.insert(0, str(ROOT / "benchmarks"))

from common import machine  # noqa: E402

import torchgemma  # noqa: E402
from torchgemma import Engine, SamplingParams  # noqa: E402
from torchgemma.generation.speculative import NgramDrafter  # noqa: E402

GREEDY = SamplingParams(temperature=0)

PASSAGE = (
    "The lighthouse at Cape Verity was built in 1874 from granite quarried on the island itself. "
    "Its lamp was first fuelled by whale oil, then by kerosene, and since 1921 by electricity from a "
    "small diesel generator. The keeper's cottage stands fifty metres to the north and now houses a "
    "museum of shipwrecks. Visitors can climb the 132 steps to the lantern room on weekends between "
    "April and October; the view reaches the mainland on clear days."
)
MISSPELT = (
    PASSAGE.replace("granite", "granitte").replace("electricity", "electrisity").replace("museum", "musuem")
)
CODE = """def total_price(items, tax_rate):
    subtotal = 0
    for item in items:
        subtotal += item["price"] * item["quantity"]
    tax = subtotal * tax_rate
    return subtotal + tax
"""
# The 270M GGUF is a base model: the prompts are text to continue. ``copy`` continuations quote the
# prompt (checked by eye: the table's first column prints each reply's start); ``free`` ones do not.
COPY = [
    f"Text with spelling mistakes:\n{MISSPELT}\n\nThe same text with the spelling corrected:\n",
    f"Original code:\n```python\n{CODE}```\n\nThe same code with total_price renamed to order_total:\n```python\n",
    f"{PASSAGE}\n\nQuestion: When was the lighthouse built, and what was its lamp first fuelled by?\n"
    "Answer (quoting the text):",
    f"Text:\n{PASSAGE}\n\nThe same text, word for word:\n",
]
FREE = [
    "Once upon a time, in a small village by the sea, there lived",
    "The history of the bicycle begins in",
    "Scientists have long wondered why",
    "The best thing about living in a big city is",
]


class WrongDrafts:
    """Prompt lookup's drafts with every token replaced by the next id: never accepted. What
    adaptive drafting costs when nothing a drafter proposes is right (the worst case)."""

    needs_hidden = False

    def __init__(self):
        self.lookup = NgramDrafter()

    def propose(self, requests, cache):
        return [[t + 1 for t in d] for d in self.lookup.propose(requests, cache)]


def run_one(model, prompt: list[int], new_tokens: int, speculative) -> tuple[int, float, list[int], tuple]:
    """Decoded tokens after the first, their seconds, the tokens, (drafted, accepted)."""
    engine = Engine(model, max_batch_size=1, max_len=len(prompt) + new_tokens + 1, speculative=speculative)
    engine.add_request(0, prompt, sampling=GREEDY, max_new_tokens=new_tokens)
    stamps, tokens = [], []
    while engine.has_unfinished_requests():
        for out in engine.step():
            stamps.append(time.perf_counter())
            tokens.append(out.token_id)
    stats = engine.speculative_stats
    return len(tokens) - 1, stamps[-1] - stamps[0], tokens, (stats.drafted_tokens, stats.accepted_tokens)


def workload(model, prompts, new_tokens, speculative, reference=None):
    """tok/s over the workload's prompts, their tokens, (drafted, accepted)."""
    count = seconds = drafted = accepted = 0
    outputs = []
    for i, prompt in enumerate(prompts):
        n, s, tokens, (d, a) = run_one(model, prompt, new_tokens, speculative)
        if reference is not None and tokens != reference[i]:
            raise AssertionError(f"prompt {i}: the tokens differ with speculation")
        count, seconds, drafted, accepted = count + n, seconds + s, drafted + d, accepted + a
        outputs.append(tokens)
    return count / seconds, outputs, (drafted, accepted)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--num-tokens", type=int, default=4, help="most draft tokens per step")
    args = parser.parse_args()
    print(machine())
    print(f"load average before: {os.getloadavg()}")
    model = torchgemma.load("gemma3-270m", progress=False)
    tokenizer = torchgemma.load_tokenizer("gemma3-270m")
    spec = {"method": "ngram", "num_tokens": args.num_tokens}
    free = [tokenizer.encode(t) for t in FREE]
    workloads = {
        "copy": ([tokenizer.encode(t) for t in COPY], spec),
        "free": (free, spec),
        "free, drafts always wrong": (
            free,
            {"method": "mtp", "model": WrongDrafts(), "num_tokens": args.num_tokens},
        ),
    }
    print(
        f"greedy, up to {args.new_tokens} new tokens per prompt, {args.runs} interleaved runs, K={args.num_tokens}"
    )
    print(
        "| workload | threads | off tok/s | ngram tok/s | speed-up | acceptance | drafts per token | load avg |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for threads in args.threads:
        torch.set_num_threads(threads)
        with torch.inference_mode():
            for name, (prompts, speculative) in workloads.items():
                _, reference, _ = workload(model, prompts, args.new_tokens, None)  # warm-up, reference
                if threads == args.threads[0] and name != "free, drafts always wrong":
                    for tokens in reference:
                        print(f"  {name} reply: {tokenizer.decode(tokens)[:160]!r}", flush=True)
                off, on = [], []
                drafted = accepted = 0
                for _ in range(args.runs):
                    rate, _, _ = workload(model, prompts, args.new_tokens, None, reference)
                    off.append(rate)
                    rate, _, (drafted, accepted) = workload(
                        model, prompts, args.new_tokens, speculative, reference
                    )
                    on.append(rate)
                tokens = sum(len(t) - 1 for t in reference)
                a, b = statistics.median(off), statistics.median(on)
                acceptance = accepted / drafted if drafted else 0.0
                print(
                    f"| {name} | {threads} | {a:.1f} | {b:.1f} | {b / a:.2f}x | {acceptance:.2f} "
                    f"({accepted}/{drafted}) | {drafted / tokens:.2f} | "
                    f"{' '.join(f'{x:.2f}' for x in os.getloadavg())} |",
                    flush=True,
                )
    print(f"load average after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
