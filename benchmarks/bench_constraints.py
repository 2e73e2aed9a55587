"""Constrained decoding: what a JSON-Schema token mask costs per token on the real 262K vocabulary.

    python benchmarks/bench_constraints.py [--tokens 64] [--threads 1] [--engine | --engine-only]

The tokenizer of the real Gemma 3 270M GGUF (262,144 ids; Gemma 4's vocabulary has the same size).
For each library made for the job that installs here, a realistic JSON Schema (the one pydantic
writes for a nested model, as ``client.chat.completions.parse`` sends it) is compiled once, then
valid documents (different values per row) are fed token by token, as the model would write them:

* ``compile``: building one request's matcher from the schema (per request; the tokenizer's own
  preprocessing is a one-off, reported apart);
* ``mask b=1``: per decode step, computing one row's allowed-token bitmask and applying it to the
  row's float32 logits (262,144 of them), then advancing the matcher by the token;
* ``mask b=16``: the same for 16 requests, each with its own matcher and document, in one step
  (the library's batched call where it has one), per step, all 16 rows.

``--engine`` adds the end-to-end view on the real 270M: the engine's decode step at batch 16 with
every row unconstrained, with 1 row and with all 16 rows constrained by the schema: what the
unconstrained rows of a mixed batch pay for their neighbours' masks.

xgrammar is measured only if importable (``PYTHONPATH=/tmp/xgr``: it is not a dependency; see
README). Timings are measurements, not tests; medians over the steps.
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

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer", "minimum": 0},
        "email": {"type": "string"},
        "verified": {"type": "boolean"},
        "tags": {"type": "array", "items": {"type": "string"}},
        "address": {
            "type": "object",
            "properties": {
                "street": {"type": "string"},
                "city": {"type": "string"},
                "country": {"type": "string", "enum": ["FR", "DE", "US", "JP"]},
            },
            "required": ["street", "city", "country"],
            "additionalProperties": False,
        },
        "score": {"type": "number"},
    },
    "required": ["name", "age", "email", "verified", "tags", "address", "score"],
    "additionalProperties": False,
}
NAMES = ["Ann Smith", "Bernard Dupont", "Chiara Rossi", "Dmitri Ivanov", "Eko Tanaka", "Fatima Zahra"]


def document(row: int) -> str:
    name = NAMES[row % len(NAMES)]
    return json.dumps(
        {
            "name": f"{name} {row}",
            "age": 20 + row,
            "email": f"{name.split()[0].lower()}{row}@example.org",
            "verified": row % 2 == 0,
            "tags": ["customer", f"tier-{row % 3}", "newsletter"],
            "address": {"street": f"{row + 1} Rue de la Paix", "city": "Paris", "country": "FR"},
            "score": 3.25 + row,
        }
    )


def unpack(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """(B, ceil(V/32)) int32 bitmask -> (B, V) bool, bit i of word j = token 32 j + i."""
    bits = (bitmask.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1
    return bits.view(bitmask.shape[0], -1)[:, :vocab].bool()


def timed_steps(step, rows: list[list[int]], steps: int) -> list[tuple[float, float]]:
    """Per step: (the whole step, its mask computation alone); ``step`` returns when its mask
    computation ended."""
    times = []
    for i in range(steps):
        start = time.perf_counter()
        filled = step(i, [row[i] for row in rows])
        times.append((time.perf_counter() - start, filled - start))
    return times


def bench_llguidance(tokenizer, rows: list[list[int]], steps: int, threads: int) -> dict:
    import llguidance
    import llguidance.torch as llt

    start = time.perf_counter()
    lltok = llguidance.LLTokenizer(tokenizer.backend.to_str(), n_vocab=tokenizer.vocab_size, eos_token=[1])
    setup = time.perf_counter() - start
    grammar = llguidance.LLMatcher.grammar_from_json_schema(SCHEMA)
    start = time.perf_counter()
    matchers = [llguidance.LLMatcher(lltok, grammar, log_level=0) for _ in rows]
    compile_s = (time.perf_counter() - start) / len(rows)
    assert not matchers[0].is_error(), matchers[0].get_error()
    executor = llguidance.LLExecutor(num_threads=threads)
    vocab = tokenizer.vocab_size
    logits = torch.randn(len(rows), vocab)
    bitmask = llt.allocate_token_bitmask(len(rows), vocab)

    def one(i, tokens):
        llt.fill_next_token_bitmask(matchers[0], bitmask, 0)
        filled = time.perf_counter()
        torch.where(unpack(bitmask[:1], vocab), logits[:1], float("-inf"))
        assert matchers[0].consume_token(tokens[0]), matchers[0].get_error()
        return filled

    def batch(i, tokens):
        llt.fill_next_token_bitmask_par(executor, list(zip(matchers, range(len(rows)))), bitmask)
        filled = time.perf_counter()
        torch.where(unpack(bitmask, vocab), logits, float("-inf"))
        for matcher, token in zip(matchers, tokens):
            assert matcher.consume_token(token), matcher.get_error()
        return filled

    b1 = timed_steps(one, rows[:1], steps)
    for matcher in matchers:
        matcher.reset()
    b16 = timed_steps(batch, rows, steps)
    return {"setup_s": setup, "compile_ms": 1e3 * compile_s, "b1": b1, "b16": b16}


def bench_outlines(tokenizer, rows: list[list[int]], steps: int) -> dict:
    from outlines_core import Guide, Index, Vocabulary
    from outlines_core.json_schema import build_regex_from_schema

    start = time.perf_counter()
    table: dict[bytes, list[int]] = {}
    for token, data in enumerate(tokenizer.token_bytes):
        if data and token != 1:
            table.setdefault(data, []).append(token)
    vocabulary = Vocabulary(1, table)
    setup = time.perf_counter() - start
    regex = build_regex_from_schema(json.dumps(SCHEMA), whitespace_pattern=r"[ ]?")
    start = time.perf_counter()
    index = Index(regex, vocabulary)  # the per-schema work (cacheable per schema)
    compile_s = time.perf_counter() - start
    guides = [Guide(index) for _ in rows]
    vocab = tokenizer.vocab_size
    logits = torch.randn(len(rows), vocab)
    bitmask = torch.zeros(len(rows), (vocab + 31) // 32, dtype=torch.int32)

    def fill(k):
        row = bitmask[k]
        guides[k].write_mask_into(row.data_ptr(), row.numel(), row.element_size())

    def one(i, tokens):
        fill(0)
        filled = time.perf_counter()
        torch.where(unpack(bitmask[:1], vocab), logits[:1], float("-inf"))
        guides[0].advance(tokens[0])
        return filled

    def batch(i, tokens):
        for k in range(len(rows)):
            fill(k)
        filled = time.perf_counter()
        torch.where(unpack(bitmask, vocab), logits, float("-inf"))
        for guide, token in zip(guides, tokens):
            guide.advance(token)
        return filled

    b1 = timed_steps(one, rows[:1], steps)
    guides = [Guide(index) for _ in rows]
    b16 = timed_steps(batch, rows, steps)
    return {"setup_s": setup, "compile_ms": 1e3 * compile_s, "b1": b1, "b16": b16}


def bench_xgrammar(tokenizer, rows: list[list[int]], steps: int, threads: int) -> dict:
    import xgrammar as xgr

    start = time.perf_counter()
    encoded = [data if data is not None else b"" for data in tokenizer.token_bytes]
    info = xgr.TokenizerInfo(encoded, xgr.VocabType.RAW, vocab_size=tokenizer.vocab_size, stop_token_ids=[1])
    compiler = xgr.GrammarCompiler(info, max_threads=threads)
    setup = time.perf_counter() - start
    start = time.perf_counter()
    compiled = compiler.compile_json_schema(json.dumps(SCHEMA), any_whitespace=False)
    compile_s = time.perf_counter() - start
    matchers = [xgr.GrammarMatcher(compiled) for _ in rows]
    vocab = tokenizer.vocab_size
    logits = torch.randn(len(rows), vocab)
    bitmask = xgr.allocate_token_bitmask(len(rows), vocab)
    batched = xgr.BatchGrammarMatcher(threads) if hasattr(xgr, "BatchGrammarMatcher") else None

    def one(i, tokens):
        matchers[0].fill_next_token_bitmask(bitmask, 0)
        filled = time.perf_counter()
        torch.where(unpack(bitmask[:1], vocab), logits[:1], float("-inf"))
        assert matchers[0].accept_token(tokens[0])
        return filled

    def batch(i, tokens):
        if batched is not None:
            batched.batch_fill_next_token_bitmask(matchers, bitmask)
        else:
            for k, matcher in enumerate(matchers):
                matcher.fill_next_token_bitmask(bitmask, k)
        filled = time.perf_counter()
        torch.where(unpack(bitmask, vocab), logits, float("-inf"))
        for matcher, token in zip(matchers, tokens):
            assert matcher.accept_token(token)
        return filled

    b1 = timed_steps(one, rows[:1], steps)
    matchers = [xgr.GrammarMatcher(compiled) for _ in rows]
    b16 = timed_steps(batch, rows, steps)
    return {"setup_s": setup, "compile_ms": 1e3 * compile_s, "b1": b1, "b16": b16}


def bench_engine(steps: int, repeats: int = 2) -> dict:
    """Decode steps at batch 16 on the real 270M (its GGUF blocks, greedy): 0, 1 or 16 rows
    constrained by SCHEMA, interleaved ``repeats`` times. Per step: the whole step, and the part
    spent on constraints (computing the masks, masking and sampling the constrained rows), timed by
    wrapping the engine's two constraint calls: what every row of the batch waits for."""
    import torchgemma.generation.engine as engine_module
    from torchgemma import Engine, Grammar, SamplingParams

    spent = [0.0]

    def timed(function):
        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                spent[0] += time.perf_counter() - start

        return wrapper

    engine_module.fill_masks = timed(engine_module.fill_masks)
    engine_module.constrained_token = timed(engine_module.constrained_token)
    model = torchgemma.load("gemma3-270m")
    tokenizer = torchgemma.load_tokenizer("gemma3-270m")
    grammar = Grammar.json_schema(tokenizer, SCHEMA)
    prompt = tokenizer.encode("Write a JSON record of a customer: ")
    greedy = SamplingParams(temperature=0)
    results: dict[int, list[tuple[float, float]]] = {0: [], 1: [], 16: []}
    for _ in range(repeats):
        for constrained in results:
            engine = Engine(model, max_batch_size=16, max_len=len(prompt) + steps + 8)
            for row in range(16):
                engine.add_request(
                    row,
                    prompt,
                    sampling=greedy,
                    max_new_tokens=steps,
                    stop_token_ids=[],
                    constraint=grammar if row < constrained else None,
                )
            engine.step()  # prefill and first tokens
            while engine.has_unfinished_requests():
                spent[0] = 0.0
                start = time.perf_counter()
                engine.step()
                results[constrained].append((time.perf_counter() - start, spent[0]))
    return results


def ms(times: list[float]) -> str:
    return f"{1e3 * statistics.median(times):.3f}"


def both(times: list[tuple[float, float]]) -> str:
    """'step (mask computation)' in ms, medians."""
    return f"{ms([t for t, _ in times])} ({ms([f for _, f in times])})"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tokens", type=int, default=64, help="decode steps measured per document")
    parser.add_argument(
        "--threads", type=int, default=1, help="torch threads and threads of the batched mask calls"
    )
    parser.add_argument("--engine", action="store_true", help="also the engine's decode step on the 270M")
    parser.add_argument("--engine-only", action="store_true", help="only the engine's decode step")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    tokenizer = torchgemma.load_tokenizer("gemma3-270m")
    rows = [tokenizer.encode(document(row), add_special_tokens=False) for row in range(16)]
    steps = min(args.tokens, min(len(row) for row in rows))
    print(json.dumps(machine()))
    print(f"vocabulary {tokenizer.vocab_size}, {steps} steps per document, threads {args.threads}")
    print("per step: the whole step (the mask computation alone), ms; b=16: all 16 rows")
    print("library        setup (s)  compile (ms)          b=1 step (mask)       b=16 step (masks)")
    benches = {
        "llguidance": lambda: bench_llguidance(tokenizer, rows, steps, args.threads),
        "outlines-core": lambda: bench_outlines(tokenizer, rows, steps),
        "xgrammar": lambda: bench_xgrammar(tokenizer, rows, steps, args.threads),
    }
    for name, bench in {} if args.engine_only else benches.items():
        try:
            result = bench()
        except ImportError as error:
            print(f"{name:14s} not installed ({error})")
            continue
        print(
            f"{name:14s} {result['setup_s']:9.2f}  {result['compile_ms']:12.1f}  "
            f"{both(result['b1']):>24s}  {both(result['b16']):>24s}"
        )
    if args.engine or args.engine_only:
        results = bench_engine(steps)
        for constrained, times in results.items():
            print(f"engine b=16, {constrained:2d} rows constrained: {both(times)} ms/step (constraints)")


if __name__ == "__main__":
    main()
