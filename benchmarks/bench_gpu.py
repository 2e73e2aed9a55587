"""Decode and prefill speed on a GPU, bf16: torchgemma eager, torchgemma compiled (CUDA graphs) and
transformers (sdpa) on the same random weights, the engine at batch 1/8/32, and the fraction of the
device's memory bandwidth a decode step uses.

    python benchmarks/bench_gpu.py                          # on CUDA: E2B-like and 31B-like widths
    python benchmarks/bench_gpu.py --device cpu --tiny      # the code paths on a CPU, tiny widths

The models have the published widths (tests' reference notes,
/work/shared/reference/gemma4-transformers-5.23.md, section 1) with fewer layers, so that building,
loading and compiling fit the time (inductor traces every layer; kernels repeat across layers):
E2B-like with 10 layers (the 4:1 pattern, the last 4 KV-shared, 262144-token vocabulary and PLE),
31B-like with 6 layers (5 sliding + 1 full K=V layer, the 31B's real layer widths). transformers
builds each with random weights on the device, saves it, and torchgemma loads that folder.

Single stream: a one-slot ``Engine`` kept across runs (what ``stream`` runs, without a new cache per
call) / transformers' ``generate`` with a streamer, greedy, no stop token; prefill tok/s = prompt
tokens / time to the first token, decode tok/s = (new tokens - 1) / time from the first to the last
(benchmarks/bench_generate.py's measure). Engine: B requests of the same prompt length;
decode tok/s counts the tokens of the steps in which all B decode, over those steps' time. Medians of
``--runs`` runs after ``--warmup`` runs (the compiled model's first run compiles). Every timer ends in
a host read of the token (the stream's) or a ``torch.cuda.synchronize``.

Bandwidth fraction = bytes a decode step reads / step time / the device's peak bandwidth (H200 4.8
TB/s, H100 SXM 3.35 TB/s, H100 PCIe 2.0, H100 NVL 3.9; ``--peak-tbps`` overrides). Bytes read: every
weight on the device once (the tied embedding counted once, as the LM head reads it whole; the PLE
table stays in host memory and is not counted: a step reads layers x 256 values of it per token) plus
each layer's keys and values over the context (sliding layers: at most the window), per sequence.

A ``--budget-s`` (default 170 s) bounds the run: parts left when it is spent are skipped, saying so.
Timings are measurements, never test assertions.
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

from bench_generate import speeds, time_transformers  # noqa: E402
from common import FULL, SLIDING, e2b_like_config, machine  # noqa: E402

import torchgemma  # noqa: E402
from torchgemma import Engine, SamplingParams  # noqa: E402

PEAKS = [("H200", 4.8), ("H100 PCIe", 2.0), ("H100 NVL", 3.9), ("H100", 3.35)]  # TB/s


def d31b_like_config(layers: int) -> dict:
    """Gemma 4 31B's widths (hidden 5376, MLP 21504, 32 heads, 16 / 4 KV heads of 256 / 512, K=V
    full layers, window 1024) with ``layers`` layers of the 5:1 pattern."""
    pattern = ([SLIDING] * 5 + [FULL]) * ((layers + 5) // 6)
    return dict(
        vocab_size=262144,
        hidden_size=5376,
        intermediate_size=21504,
        num_hidden_layers=layers,
        num_attention_heads=32,
        num_key_value_heads=16,
        num_global_key_value_heads=4,
        head_dim=256,
        global_head_dim=512,
        attention_k_eq_v=True,
        hidden_size_per_layer_input=0,
        layer_types=pattern[:layers],
        sliding_window=1024,
        final_logit_softcapping=30.0,
        max_position_embeddings=262144,
        tie_word_embeddings=True,
        use_bidirectional_attention="vision",
        pad_token_id=0,
        bos_token_id=2,
        eos_token_id=[1, 106],
    )


def tiny(config: dict) -> dict:
    """The same layer structure at widths a CPU runs in seconds (for --tiny)."""
    small = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_attention_heads=4, head_dim=16)
    small.update(global_head_dim=32, sliding_window=16)
    small["num_key_value_heads"] = min(config["num_key_value_heads"], 2)
    if "num_global_key_value_heads" in config:
        small["num_global_key_value_heads"] = 1
    if config.get("hidden_size_per_layer_input"):
        small.update(hidden_size_per_layer_input=8, vocab_size_per_layer_input=512)
    return {**config, **small}


# ── building and measuring ─────────────────────────────────────────────────────────────────────


def build(folder: Path, fields: dict, device: str):
    """transformers' random initialisation on the device, saved in bf16; returns the model, with
    sdpa attention (the one transformers model of the run)."""
    from transformers import Gemma4ForCausalLM, Gemma4TextConfig

    torch.manual_seed(0)
    config = Gemma4TextConfig(**fields, dtype="bfloat16")
    with torch.device(device):
        model = Gemma4ForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(folder)
    model.set_attn_implementation("sdpa")
    return model.eval()


def weight_bytes(model: torch.nn.Module, device: torch.device) -> int:
    """Bytes of the distinct tensors on ``device``'s kind (shared storage counted once)."""
    seen, total = set(), 0
    for tensor in list(model.parameters()) + list(model.buffers()):
        if tensor.device.type == device.type and tensor.data_ptr() not in seen:
            seen.add(tensor.data_ptr())
            total += tensor.numel() * tensor.element_size()
    return total


def kv_bytes(fields: dict, context: int, element: int = 2) -> int:
    """Keys and values one sequence's decode step reads over ``context`` tokens, every layer (a
    KV-shared layer reads its producer's cache)."""
    total = 0
    for kind in fields["layer_types"]:
        if kind == SLIDING:
            columns, heads, dim = (
                min(context, fields["sliding_window"]),
                fields["num_key_value_heads"],
                fields["head_dim"],
            )
        else:
            columns, dim = context, fields["global_head_dim"]
            heads = fields.get("num_global_key_value_heads") if fields.get("attention_k_eq_v") else None
            heads = heads or fields["num_key_value_heads"]
        total += 2 * columns * heads * dim * element
    return total


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def time_engine(engine: Engine, prompt: torch.Tensor, new_tokens: int) -> tuple[list[float], torch.Tensor]:
    """``time_torchgemma``'s stamps, through one engine kept across runs (``stream`` makes an engine,
    and so a cache, per call: a CUDA-graph step would be recorded again for the new cache's
    addresses at every call, which is not the steady state measured here)."""
    start = time.perf_counter()
    stamps, tokens = [], []
    greedy = SamplingParams(temperature=0)
    engine.add_request("s", prompt[0].tolist(), max_new_tokens=new_tokens, sampling=greedy, stop_token_ids=[])
    while engine.has_unfinished_requests():
        for output in engine.step():
            stamps.append(time.perf_counter() - start)
            tokens.append(output.token_id)
    return stamps, torch.tensor([tokens])


def single_stream(model, kind: str, prompt: torch.Tensor, args) -> dict:
    """torchgemma through a one-slot engine (what ``stream`` runs), transformers through its
    ``generate`` with a streamer (bench_generate.py's timer)."""
    if kind == "ours":
        engine = Engine(model, max_batch_size=1, max_len=prompt.shape[1] + args.new_tokens)

        def timer(_, prompt, new):
            return time_engine(engine, prompt, new)
    else:
        timer = time_transformers
    runs, tokens = [], None
    for run in range(args.warmup + args.runs):
        sync(args.device)
        stamps, tokens = timer(model, prompt, args.new_tokens)
        sync(args.device)
        if run >= args.warmup:
            runs.append(speeds(stamps, prompt.shape[1]))
    return {
        "prefill_tok_s": statistics.median(r[0] for r in runs),
        "decode_tok_s": statistics.median(r[1] for r in runs),
        "tokens": tokens.cpu(),
    }


def engine_decode(model, batch: int, prompt_len: int, args, slots: int | None = None) -> float:
    """Decode tok/s of ``batch`` requests stepped together (median over runs), over the steps in
    which all of them decode. ``slots``: the engine's size (default ``batch``)."""
    new = args.new_tokens + batch  # room for the prefills of the others before the window starts
    # One cache length for every batch: a compiled step is traced once per cache shape.
    max_len = prompt_len + args.new_tokens + max(args.batches)
    engine = Engine(model, max_batch_size=slots or batch, max_len=max_len)
    gen = torch.Generator().manual_seed(batch)
    samples = []
    for run in range(args.warmup + args.engine_runs):
        for r in range(batch):
            ids = torch.randint(3, 262144 if not args.tiny else 512, (prompt_len,), generator=gen).tolist()
            engine.add_request(
                (run, r), ids, max_new_tokens=new, sampling=SamplingParams(temperature=0), stop_token_ids=[]
            )
        started, tokens, start = set(), 0, None
        while engine.has_unfinished_requests():
            outputs = engine.step()
            if any(o.finished for o in outputs):
                if start is not None:
                    tokens += len(outputs)  # this step's tokens count: all B still decoded in it
                break
            if start is not None:
                tokens += len(outputs)
            started.update(o.request_id for o in outputs)
            if start is None and len(started) == batch:
                sync(args.device)
                start = time.perf_counter()
        sync(args.device)
        elapsed = time.perf_counter() - start
        while engine.has_unfinished_requests():
            engine.step()
        if run >= args.warmup:
            samples.append(tokens / elapsed)
    return statistics.median(samples)


def compiled_single_stream(model, prompt, eager: dict, row, args):
    """Compile ``model`` (torchgemma.compile) and time its single stream; returns its compiled step,
    carrying the result row as ``.row``."""
    t = time.perf_counter()
    step = torchgemma.compile(model).compiled_decode
    compiled = single_stream(model, "ours", prompt, args)
    same = (
        "same tokens"
        if torch.equal(compiled["tokens"], eager["tokens"])
        else "tokens differ from eager (random weights: bf16 near-ties)"
    )
    note = f"{same}; compile+runs {time.perf_counter() - t:.0f} s"
    step.row = row("torchgemma compiled", 1, compiled["prefill_tok_s"], compiled["decode_tok_s"], note)
    return step


def peak_tbps(args) -> float | None:
    if args.peak_tbps:
        return args.peak_tbps
    if not args.device.startswith("cuda"):
        return None
    name = torch.cuda.get_device_name()
    return next((tbps for key, tbps in PEAKS if key in name), None)


def fraction(step_bytes: float, tok_s: float, batch: int, peak: float | None) -> str:
    if peak is None:
        return "n/a"
    return f"{step_bytes * tok_s / batch / (peak * 1e12):.0%}"


def bench_model(name: str, fields: dict, args, deadline: float) -> list[dict]:
    def left() -> float:
        return deadline - time.perf_counter()

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        t = time.perf_counter()
        ref = build(Path(tmp) / name, fields, args.device)
        ours = torchgemma.load(Path(tmp) / name, dtype=torch.bfloat16, device=args.device, progress=False)
        assert ref.config._attn_implementation == "sdpa"
        print(f"{name}: built and loaded in {time.perf_counter() - t:.1f} s", file=sys.stderr)
    device = torch.device(args.device)
    weights = weight_bytes(ours, device)
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(3, fields["vocab_size"], (1, args.prompt_len), generator=gen)
    prompt[0, 0] = 2
    prompt = prompt.to(args.device)
    context = args.prompt_len + args.new_tokens // 2
    peak = peak_tbps(args)

    def row(impl: str, batch: int, prefill, decode: float, extra: str = "") -> dict:
        step_bytes = weights + batch * kv_bytes(fields, context)
        result = dict(
            model=name,
            impl=impl,
            batch=batch,
            prefill_tok_s=prefill,
            decode_tok_s=decode,
            step_mb=step_bytes / 1e6,
            bandwidth=fraction(step_bytes, decode, batch, peak),
            note=extra,
        )
        print(f"  {json.dumps(result)}", file=sys.stderr, flush=True)  # in case the run is cut short
        return result

    eager = single_stream(ours, "ours", prompt, args)
    rows.append(row("torchgemma eager", 1, eager["prefill_tok_s"], eager["decode_tok_s"]))
    theirs = single_stream(ref, "ref", prompt, args)
    same = (
        "same tokens"
        if torch.equal(theirs["tokens"], eager["tokens"])
        else "tokens differ from eager (random weights: bf16 near-ties)"
    )
    rows.append(row("transformers sdpa", 1, theirs["prefill_tok_s"], theirs["decode_tok_s"], same))
    del ref
    gc.collect()
    if args.device.startswith("cuda"):
        torch.cuda.empty_cache()
    # The engine eager (seconds), then compiling (the longest part: only with 45 s of the model's
    # budget left), the compiled single stream and the compiled engine (one more trace and capture,
    # for its 32-slot cache).
    for batch in args.batches:
        if left() < 10:
            print(f"{name}: engine batch {batch} skipped (time budget)", file=sys.stderr)
            continue
        rows.append(row("engine eager", batch, None, engine_decode(ours, batch, args.engine_prompt, args)))
    compiled_step = None
    if args.compile and left() > 45:
        compiled_step = compiled_single_stream(ours, prompt, eager, row, args)
    elif args.compile:
        print(f"{name}: compiled runs skipped (time budget)", file=sys.stderr)
    if compiled_step is not None:
        rows.append(compiled_step.row)
        slots = max(args.batches)
        for batch in args.batches:
            if left() < 30:
                print(f"{name}: compiled engine batch {batch} skipped (time budget)", file=sys.stderr)
                continue
            tok_s = engine_decode(ours, batch, args.engine_prompt, args, slots=slots)
            rows.append(row("engine compiled", batch, None, tok_s, f"{slots}-slot graph, {batch} used"))
    del ours
    gc.collect()
    if args.device.startswith("cuda"):
        torch.cuda.empty_cache()
    return rows


def table(rows: list[dict]) -> str:
    lines = [
        "| model | implementation | batch | prefill tok/s | decode tok/s | MB read / step | of peak bandwidth | note |",
        "|---|---|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        prefill = f"{r['prefill_tok_s']:.0f}" if r["prefill_tok_s"] else ""
        lines.append(
            f"| {r['model']} | {r['impl']} | {r['batch']} | {prefill} | {r['decode_tok_s']:.1f} | "
            f"{r['step_mb']:.0f} | {r['bandwidth']} | {r['note']} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true", help="tiny widths (to run the code on a CPU)")
    parser.add_argument("--models", nargs="+", default=["e2b", "31b"], choices=["e2b", "31b"])
    parser.add_argument("--e2b-layers", type=int, default=10)
    parser.add_argument("--31b-layers", dest="d31b_layers", type=int, default=6)
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--engine-prompt", type=int, default=128, help="prompt length of engine requests")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--engine-runs", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--no-compile", dest="compile", action="store_false")
    parser.add_argument("--peak-tbps", type=float, default=None, help="the device's peak bandwidth, TB/s")
    parser.add_argument("--budget-s", type=float, default=170.0)
    args = parser.parse_args(argv)

    started = time.perf_counter()
    if args.device.startswith("cuda"):
        name = torch.cuda.get_device_name()
        print(f"device: {name}; peak {peak_tbps(args)} TB/s; torch {torch.__version__}", file=sys.stderr)
    configs = {"e2b": e2b_like_config(args.e2b_layers), "31b": d31b_like_config(args.d31b_layers)}
    layers = {"e2b": args.e2b_layers, "31b": args.d31b_layers}
    rows = []
    for i, key in enumerate(args.models):
        fields = tiny(configs[key]) if args.tiny else configs[key]
        name = f"{key.upper()}-like {layers[key]}L" + (" tiny" if args.tiny else "")
        # Each model gets an equal share of what is left of the budget.
        share = (args.budget_s - (time.perf_counter() - started)) / (len(args.models) - i)
        if share < 40:
            print(f"{name}: skipped (time budget: {share:.0f} s left for it)", file=sys.stderr)
            continue
        rows += bench_model(name, fields, args, time.perf_counter() + share)
    print(table(rows))
    info = {**machine(), "device": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"}
    print(json.dumps({"machine": info, "rows": rows, "seconds": round(time.perf_counter() - started, 1)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
