"""Prefix caching in the engine: what a repeated prefix saves, and what a store costs decode.

    python benchmarks/bench_prefix_cache.py [--threads 1] [--runs 5] [--prefix 1536] [--new-tokens 64]
    python benchmarks/bench_prefix_cache.py --model tiny      # decode only: the tests' tiny E2B-like model

The real 270M in its default mode (the GGUF file's own blocks), greedy, through ``Engine``:

* ``repeat``: a ``--prefix``-token prompt plus a 24-token question, then the same prefix with another
  question: time to the first token of each (fresh engine each; the second with the store the
  first filled), and with no store at all. Reuse happens at multiples of ``prefill_chunk``.
* ``decode``: ``--new-tokens`` greedy tokens after a 64-token prompt, decode tok/s with and
  without a store (a store that the request's prompt misses: every prompt chunk is stored).

Runs are interleaved (store, no store, store, ...); medians. Timings are measurements, not tests.
"""

from __future__ import annotations

import argparse
import json
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
from torchgemma.generation.prefix_cache import PrefixCache  # noqa: E402
from torchgemma.weights.source import gemma3_270m  # noqa: E402

GREEDY = SamplingParams(temperature=0)


def run(
    model, prompt: list[int], new_tokens: int, store: PrefixCache | None
) -> tuple[float, float, list[int]]:
    """Seconds to the first token, decode tok/s after it, the tokens."""
    engine = Engine(model, max_batch_size=1, max_len=len(prompt) + new_tokens + 1, prefix_cache=store)
    engine.add_request(0, prompt, sampling=GREEDY, max_new_tokens=new_tokens, stop_token_ids=[])
    start = time.perf_counter()
    stamps, tokens = [], []
    while engine.has_unfinished_requests():
        for out in engine.step():
            stamps.append(time.perf_counter() - start)
            tokens.append(out.token_id)
    decode = (len(stamps) - 1) / (stamps[-1] - stamps[0]) if len(stamps) > 1 else float("nan")
    return stamps[0], decode, tokens


def tiny_model():
    """The tests' tiny E2B-like model (tests/checkpoints.py), built in a temporary folder."""
    import tempfile

    sys.path.insert(0, str(ROOT / "tests"))
    from transformers import Gemma4ForCausalLM

    from checkpoints import randomize_, text_config

    folder = Path(tempfile.mkdtemp()) / "tiny-e2b"
    reference = Gemma4ForCausalLM(text_config("e2b"))
    randomize_(reference, seed=0)
    reference.save_pretrained(folder)
    return torchgemma.load(folder, dtype=torch.float32, progress=False)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--prefix", type=int, default=1536, help="shared prefix tokens")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--model", choices=("270m", "tiny"), default="270m")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model = tiny_model() if args.model == "tiny" else torchgemma.load(gemma3_270m(), progress=False)
    gen = torch.Generator().manual_seed(0)
    vocab = min(model.config.text.vocab_size, 200000)

    def ids(n: int) -> list[int]:
        return torch.randint(3, vocab, (n,), generator=gen).tolist()

    med = statistics.median
    short = [2] + ids(63)
    decode = {"store": [], "none": []}
    for _ in range(args.runs):
        for name in decode:
            store = PrefixCache(1 << 30) if name == "store" else None
            decode[name].append(run(model, short, args.new_tokens, store)[1])
    speeds = {name: round(med(values), 2) for name, values in decode.items()}
    speeds["store_over_none"] = round(speeds["store"] / speeds["none"], 4)
    print(f"decode tok/s ({args.new_tokens} tokens after 64, {args.model}): {speeds}")
    if args.model == "tiny":
        print(json.dumps({"benchmark": "prefix-cache-tiny", "decode": speeds, **machine()}))
        return

    prefix = [2] + ids(args.prefix - 1)
    first_ttft, second_ttft, plain_ttft, exact = [], [], [], True
    for _ in range(args.runs):
        store = PrefixCache(1 << 30)
        first, second = prefix + ids(24), prefix + ids(24)
        t1, _, _ = run(model, first, 1, store)
        t2, _, cached_tokens = run(model, second, 8, store)
        t0, _, plain_tokens = run(model, second, 8, None)
        exact &= cached_tokens == plain_tokens
        first_ttft.append(t1)
        second_ttft.append(t2)
        plain_ttft.append(t0)
    repeat = {
        "prompt_tokens": len(prefix) + 24,
        "reused_tokens": store.stats()["cached_tokens"],  # the last run's: its second request's
        "first_ttft_s": round(med(first_ttft), 3),
        "second_ttft_s": round(med(second_ttft), 3),
        "uncached_ttft_s": round(med(plain_ttft), 3),
        "second_over_first": round(med(second_ttft) / med(first_ttft), 3),
        "tokens_equal": exact,
    }
    print(f"repeat: {repeat}")
    print(json.dumps({"benchmark": "prefix-cache-270m", "repeat": repeat, "decode": speeds, **machine()}))


if __name__ == "__main__":
    main()
