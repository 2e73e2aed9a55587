"""Prefill, decode and peak memory on the real Gemma 3 270M (Q4_K_M GGUF): torchgemma in each
weight mode, transformers and llama.cpp, in one run.

* torchgemma ``gguf``: the file's own blocks (``load(..., quantize="gguf")``, the gemma3-270m
  default), multiplied by the C++ kernels, with the default prefill activations (``"auto"``: int16
  where the CPU has AVX-512 VNNI, else float); ``gguf+float`` / ``gguf+int8``: the same with float
  or int8 prefill activations (int8: llama.cpp's arithmetic); ``int8`` / ``int4``: round-to-nearest
  of the dequantized weights; ``fp32``: the file dequantized to float32;
* transformers 5.23: the same file through its GGUF loader (float32), default attention (sdpa);
* llama.cpp through llama-cpp-python, when installed (built from source, see benchmarks/README.md):
  the Q4_K_M weights as they are, the same thread count, with llama.cpp's own tools' defaults
  (llama-server, llama-cli) rather than llama-cpp-python's: flash attention on and the sliding
  layers' cache a window (``swa_full=False``); llama-cpp-python's (off, full-size) decode a
  4K-token context at two thirds of the speed.

Greedy decoding without stop tokens from the same prompt tokens; the first token's arrival times the
prefill, the rest the decode. Besides the short prompt, long contexts (``--contexts``, default 4096
and 16384 tokens: the passage of ``data/passage.txt`` repeated after BOS) time the prefill of that
prompt and the decode after it (fewer runs: ``--long-runs``). Each implementation runs in a process of its own (all alive at once,
all but the one being timed stopped);
for each thread count they take turns within every round (interleaved), warm-up rounds are dropped,
figures are medians. Peak memory is each
implementation's maximum resident set size in a process of its own that loads the model and
generates once from the prompt's token ids; what torchgemma's tokenizer adds is measured apart. Prints a table and a JSON line. Not a test.

    python benchmarks/bench_gguf.py                 # gguf mode vs llama.cpp, 1 and 2 threads, 4K/16K contexts
    python benchmarks/bench_gguf.py --modes gguf,gguf+float,gguf+int8,int8,int4,fp32 --transformers
    python benchmarks/bench_gguf.py --contexts ''   # the short prompt only
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from bench_generate import machine, speeds, time_torchgemma, time_transformers  # noqa: E402

import torchgemma  # noqa: E402
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
# torchgemma's modes, name: (quantize, group size for torchgemma.quantize or None to quantize while loading, activations)
MODES = {
    "gguf": ("gguf", None, "auto"),
    "gguf+float": ("gguf", None, None),
    "gguf+int8": ("gguf", None, "int8"),
    "int8": ("int8", None, "auto"),
    "int4": ("int4", 32, "auto"),
    "fp32": (None, None, None),
}
TRANSFORMERS = "transformers (fp32)"
LLAMA = "llama.cpp (Q4_K_M)"
PASSAGE = Path(__file__).parent / "data" / "passage.txt"


def llama_cpp_model(threads: int, n_ctx: int):
    """llama.cpp as its own tools run it (llama-server, llama-cli): flash attention on, the sliding
    layers' cache a window; llama-cpp-python's defaults are off and full-size."""
    from llama_cpp import Llama

    return Llama(
        model_path=str(gemma3_270m()),
        n_ctx=n_ctx,
        n_threads=threads,
        n_batch=512,
        flash_attn=True,
        swa_full=False,
        verbose=False,
    )


def prompt_ids(length: int | None) -> list[int]:
    """The short prompt's ids, or ``length`` ids: BOS, then the passage's repeated."""
    tokenizer = torchgemma.load_tokenizer("gemma3-270m")
    if length is None:
        return tokenizer.encode(PROMPT)
    passage = tokenizer.encode(PASSAGE.read_text(), add_special_tokens=False)
    body = passage * (length // len(passage) + 1)
    return [tokenizer.bos_id, *body][:length]


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


def build(name: str, threads: int, n_ctx: int = 1024):
    """(timer, model, prompt) for one implementation; ``n_ctx``: llama.cpp's context (prompt and
    new tokens)."""
    path = gemma3_270m()
    ids = prompt_ids(None)
    if name.startswith("torchgemma"):
        mode, group, activations = MODES[name.split()[1]]
        if group is None:
            model = torchgemma.load(path, quantize=mode, progress=False, activations=activations)
        else:
            model = torchgemma.quantize(
                torchgemma.load(path, quantize=None, progress=False),
                mode,
                group_size=group,
                activations=activations,
            )
        return time_torchgemma, model, torch.tensor([ids])
    if name == TRANSFORMERS:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
        return time_transformers, model.eval(), torch.tensor([ids])
    return time_llama_cpp, llama_cpp_model(threads, n_ctx), ids


def _serve(name: str, threads: int, new_tokens: int, n_ctx: int, conn) -> None:
    """A worker process: build one implementation, then time a generation per request (the short
    prompt, or the ids a request gives)."""
    warnings.simplefilter("ignore")
    torch.set_num_threads(threads)
    timer, model, inputs = build(name, threads, n_ctx)
    conn.send(len(inputs) if isinstance(inputs, list) else inputs.shape[-1])
    while (request := conn.recv()) != "stop":
        prompt = inputs
        if request is not None:  # a long context's ids
            prompt = request if isinstance(inputs, list) else torch.tensor([request])
        stamps, tokens = timer(model, prompt, new_tokens)
        conn.send(
            (stamps, [int(t) for t in (tokens.flatten().tolist() if torch.is_tensor(tokens) else tokens)])
        )


class _Worker:
    """One implementation in a process of its own, stopped (SIGSTOP) except while it runs: an idle
    implementation's threads cannot take a core from the one being timed (llama.cpp's keep
    running after a call: with its process merely idle beside it, torchgemma's one-thread decode
    measured 29.0 tok/s, with it absent 35.0)."""

    def __init__(self, name: str, threads: int, new_tokens: int, n_ctx: int):
        import multiprocessing

        context = multiprocessing.get_context("spawn")
        self.conn, child = context.Pipe()
        self.process = context.Process(
            target=_serve, args=(name, threads, new_tokens, n_ctx, child), daemon=True
        )
        self.process.start()
        self._prompt_len = self.conn.recv()
        os.kill(self.process.pid, signal.SIGSTOP)

    def prompt_len(self) -> int:
        return self._prompt_len

    def run(self, ids: list[int] | None = None) -> tuple[list[float], list[int]]:
        """Token arrival times and tokens of one generation from ``ids`` (default: the short prompt)."""
        os.kill(self.process.pid, signal.SIGCONT)
        try:
            self.conn.send(ids)
            return self.conn.recv()
        finally:
            os.kill(self.process.pid, signal.SIGSTOP)

    def close(self) -> None:
        os.kill(self.process.pid, signal.SIGCONT)
        self.conn.send("stop")
        self.process.join()


def peak_rss(name: str, threads: int, new_tokens: int) -> float:
    """MiB: the peak resident set of a process that loads ``name`` and generates once."""
    # VmHWM, the high-water mark of this process's own memory (ru_maxrss would carry the parent's
    # across fork and exec).
    if name == LLAMA:  # llama.cpp alone, without torch in the process
        ids = prompt_ids(None)
        code = (
            "from llama_cpp import Llama;"
            f"llm = Llama(model_path={str(gemma3_270m())!r}, n_ctx=1024, n_threads={threads}, n_batch=512, "
            "flash_attn=True, swa_full=False, verbose=False);"
            f"g = llm.generate({ids!r}, top_k=1, top_p=1.0, temp=0.0, repeat_penalty=1.0);"
            f"[next(g) for _ in range({new_tokens})];"
        )
        return _high_water(code)
    if name.startswith("torchgemma"):  # torchgemma alone: no benchmark helpers, no transformers
        mode, group, activations = MODES[name.split()[1]]
        load = (
            f"torchgemma.load(path, quantize={mode!r}, progress=False, activations={activations!r})"
            if group is None
            else f"torchgemma.quantize(torchgemma.load(path, quantize=None, progress=False), {mode!r}, group_size={group}, activations={activations!r})"
        )
        # The prompt's ids are given: the tokenizer (the `tokenizers` library: ~330 MB for Gemma's
        # 262k-token BPE) is measured apart, by tokenizer_rss.
        ids = prompt_ids(None)
        code = (
            "import warnings, torch, torchgemma; warnings.simplefilter('ignore');"
            f"torch.set_num_threads({threads}); path = {str(gemma3_270m())!r}; model = {load};"
            f"ids = torch.tensor([{ids!r}]);"
            f"torchgemma.generate(model, ids, max_new_tokens={new_tokens}, sampling=torchgemma.SamplingParams(temperature=0.0), stop_token_ids=[]);"
        )
        return _high_water(code)
    code = (
        "import sys, warnings, torch; warnings.simplefilter('ignore');"
        f"sys.path.insert(0, {str(Path(__file__).parent)!r}); torch.set_num_threads({threads});"
        "import bench_gguf as b;"
        f"timer, model, prompt = b.build({name!r}, {threads}); timer(model, prompt, {new_tokens});"
    )
    return _high_water(code)


def _high_water(code: str) -> float:
    """MiB: the peak resident set (VmHWM) of a Python process running ``code``."""
    code += "\nprint([l.split()[1] for l in open('/proc/self/status') if l.startswith('VmHWM')][0])"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return int(done.stdout.strip().splitlines()[-1]) / 1024  # kB -> MiB


def tokenizer_rss() -> float:
    """MiB that loading torchgemma's tokenizer of the file adds to a process (resident, after)."""
    code = (
        "import torchgemma;"
        "rss = lambda: int([l.split()[1] for l in open('/proc/self/status') if l.startswith('VmRSS')][0]);"
        f"before = rss(); tok = torchgemma.load_tokenizer({str(gemma3_270m())!r}); print(rss() - before)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return int(done.stdout.strip().splitlines()[-1]) / 1024


def time_rounds(workers: dict, ids: list[int] | None, rounds: int, warmup: int, prompt_len: int, label: str):
    """Interleaved runs of every worker from the same prompt: (prefill, decode) tok/s per worker
    after ``warmup`` dropped rounds, and each worker's last tokens."""
    samples: dict[str, list[tuple[float, float]]] = {name: [] for name in workers}
    outputs = {}
    for run in range(warmup + rounds):
        for name, worker in workers.items():
            # llama.cpp's worker threads spin a while after each call: let them settle, so
            # that they do not take a core from whoever runs next.
            time.sleep(0.5)
            stamps, tokens = worker.run(ids)
            prefill, decode = speeds(stamps, prompt_len)
            if run >= warmup:
                samples[name].append((prefill, decode))
            outputs[name] = tokens
            if ids is not None:  # long contexts take minutes: say where we are
                print(
                    f"{label} run {run + 1}: {name:22} prefill {prefill:7.1f} tok/s, decode {decode:5.1f} tok/s, "
                    f"load {os.getloadavg()[0]:.2f}",
                    file=sys.stderr,
                )
    medians = {
        name: {
            "prefill_tok_s": statistics.median(s[0] for s in runs),
            "decode_tok_s": statistics.median(s[1] for s in runs),
        }
        for name, runs in samples.items()
    }
    return medians, outputs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument(
        "--modes",
        default="gguf",
        help=f"torchgemma modes, comma-separated, of {','.join(MODES)} (default: gguf)",
    )
    parser.add_argument("--transformers", action="store_true", help="time transformers (fp32) too")
    parser.add_argument("--no-memory", action="store_true", help="skip the peak-memory processes")
    parser.add_argument(
        "--contexts",
        default="4096,16384",
        help="long prompts (tokens), comma-separated: prefill, and decode after them; '' for none",
    )
    parser.add_argument("--long-runs", type=int, default=1, help="runs per long context (medians)")
    args = parser.parse_args(argv)
    warnings.simplefilter("ignore")

    modes = [m for m in args.modes.split(",") if m]
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        parser.error(f"--modes: unknown mode {unknown[0]!r}; the modes are {', '.join(MODES)}")
    names = [f"torchgemma {m}" for m in modes]
    if args.transformers:
        names.append(TRANSFORMERS)
    try:
        import llama_cpp  # noqa: F401

        names.append(LLAMA)
    except ImportError:
        print("llama-cpp-python is not installed: llama.cpp is not timed", file=sys.stderr)
    contexts = [int(c) for c in args.contexts.split(",") if c.strip()]
    long_prompts = {length: prompt_ids(length) for length in contexts}
    # llama.cpp's context holds the longest prompt and its new tokens.
    n_ctx = max([1024, *(length + args.new_tokens + 16 for length in contexts)])

    results: dict[str, dict] = {}
    long_results: dict[str, dict] = {}
    for threads in args.threads:
        # One process per implementation, all alive, taking turns: no implementation shares a
        # process (its thread pools, its allocator, its memory) with another.
        torch.set_num_threads(threads)  # (what the report's machine line says)
        workers = {name: _Worker(name, threads, args.new_tokens, n_ctx) for name in names}
        prompt_len = workers[names[0]].prompt_len()
        medians, outputs = time_rounds(workers, None, args.runs, args.warmup, prompt_len, "")
        reference = "torchgemma fp32" if "torchgemma fp32" in outputs else names[0]
        for name, row in medians.items():
            row["greedy_equal_to_reference"] = sum(a == b for a, b in zip(outputs[name], outputs[reference]))
        results[str(threads)] = medians
        # Long contexts: transformers is left out (its dynamic cache and one-shot prefill of 16K
        # tokens take minutes and gigabytes; bench_long_prompt.py covers it).
        long_workers = {name: worker for name, worker in workers.items() if name != TRANSFORMERS}
        long_results[str(threads)] = {}
        for length in contexts:
            label = f"{threads} thread(s), {length} tokens,"
            rows, _ = time_rounds(long_workers, long_prompts[length], args.long_runs, 0, length, label)
            long_results[str(threads)][str(length)] = rows
        for worker in workers.values():
            worker.close()
    memory = {}
    if not args.no_memory:
        memory = {name: peak_rss(name, args.threads[0], args.new_tokens) for name in names}
        memory["torchgemma tokenizer (added)"] = tokenizer_rss()

    info = machine()
    print(
        f"\nGemma 3 270M Q4_K_M, prompt {prompt_len} tokens, {args.new_tokens} new tokens, greedy, batch 1; "
        f"median of {args.runs} interleaved runs after {args.warmup} warm-up"
    )
    print(
        f"{info['cpu']}, {info['cores']} cores, load average {info['load_average']}, threads {args.threads}, "
        f"torch {info['torch']}, commit {info['commit']}"
    )
    same = "fp32" if reference == "torchgemma fp32" else reference.split()[-1]
    header = (
        f"{'threads':>7} {'implementation':22} {'prefill tok/s':>14} {'decode tok/s':>13} "
        f"{'decode vs llama.cpp':>20} {'prefill vs llama.cpp':>21} {'tokens = ' + same:>14} {'peak RSS MiB':>13}"
    )
    print(header)
    print("-" * len(header))
    for threads, rows in results.items():
        peer = rows.get(LLAMA)
        for name, row in rows.items():
            vs_d = f"{row['decode_tok_s'] / peer['decode_tok_s']:.2f}x" if peer else "-"
            vs_p = f"{row['prefill_tok_s'] / peer['prefill_tok_s']:.2f}x" if peer else "-"
            rss = f"{memory[name]:.0f}" if name in memory and threads == str(args.threads[0]) else ""
            print(
                f"{threads:>7} {name:22} {row['prefill_tok_s']:14.1f} {row['decode_tok_s']:13.1f} {vs_d:>20} "
                f"{vs_p:>21} {row['greedy_equal_to_reference']:>8}/{args.new_tokens:<5} {rss:>13}"
            )
    if memory:
        print(
            f"peak RSS: a process that loads and generates from given token ids; llama.cpp's includes its "
            f"vocabulary; torchgemma's tokenizer adds {memory['torchgemma tokenizer (added)']:.0f} MiB when loaded"
        )
    if contexts:
        print(
            f"\nLong contexts: a prompt of N tokens (data/passage.txt repeated), then {args.new_tokens} new "
            f"tokens; median of {args.long_runs} run(s); 'vs short': decode against the same implementation's "
            f"after the {prompt_len}-token prompt"
        )
        header = (
            f"{'threads':>7} {'context':>7} {'implementation':22} {'prefill tok/s':>14} {'decode tok/s':>13} "
            f"{'decode vs llama.cpp':>20} {'prefill vs llama.cpp':>21} {'decode vs short':>16}"
        )
        print(header)
        print("-" * len(header))
        for threads, by_length in long_results.items():
            for length, rows in by_length.items():
                peer = rows.get(LLAMA)
                for name, row in rows.items():
                    vs_d = f"{row['decode_tok_s'] / peer['decode_tok_s']:.2f}x" if peer else "-"
                    vs_p = f"{row['prefill_tok_s'] / peer['prefill_tok_s']:.2f}x" if peer else "-"
                    short = row["decode_tok_s"] / results[threads][name]["decode_tok_s"]
                    print(
                        f"{threads:>7} {length:>7} {name:22} {row['prefill_tok_s']:14.1f} "
                        f"{row['decode_tok_s']:13.1f} {vs_d:>20} {vs_p:>21} {short:15.2f}x"
                    )
    print(
        json.dumps(
            {
                "benchmark": "gguf-270m",
                "prompt_tokens": prompt_len,
                "new_tokens": args.new_tokens,
                "runs": args.runs,
                **info,
                "threads": args.threads,
                "greedy_reference": reference,
                "results": results,
                "long_context_runs": args.long_runs,
                "long_context": long_results,
                "peak_rss_mib": memory,
                "memory_threads": args.threads[0],
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
