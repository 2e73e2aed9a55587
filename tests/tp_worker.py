"""One rank of a tensor-parallel test run (tests/test_distributed.py starts N of them, with torchrun's
environment, or under torchrun itself): loads each checkpoint split over the ranks and runs the
same calls as the test's single process; rank 0 writes what it got to a safetensors file.

    python tests/tp_worker.py OUT.safetensors TASK [--expert-parallel | --expert-exchange all-to-all]
        [--dtype fp32] NAME=FOLDER ...
"""

from __future__ import annotations

import argparse
import sys
import zlib
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).parent))

import torchgemma  # noqa: E402
from checkpoints import padded_batch, padded_prompts  # noqa: E402
from torchgemma.generation.ranks import LeaderEngine, follow  # noqa: E402

NEW_TOKENS = 12


def logits_and_tokens(model, seed: int, tokens: bool = True) -> dict[str, torch.Tensor]:
    """A padded batch's logits, and greedy continuations of padded prompts (as the test's single process)."""
    ids, mask = padded_batch(seed)
    prompts, prompt_mask = padded_prompts(seed)
    with torch.no_grad():
        logits = model(ids, attention_mask=mask)
    logits = logits if logits.dtype == torch.float64 else logits.float()
    if not tokens:
        return {"logits": logits}
    tokens = torchgemma.generate(
        model, prompts, attention_mask=prompt_mask, max_new_tokens=NEW_TOKENS, stop_token_ids=[]
    )
    return {"logits": logits, "tokens": tokens}


def engine_batch(model, seed: int) -> dict[str, torch.Tensor]:
    """Three prompts of different lengths through one Engine, batched together (two greedy, one
    sampled with a seed); under tensor parallelism rank 0 leads and the others follow."""
    prompts, prompt_mask = padded_prompts(seed)
    rows = [prompts[b][prompt_mask[b].bool()].tolist() for b in range(prompts.shape[0])]
    engine = torchgemma.Engine(model, max_batch_size=3, max_len=64, prefill_chunk=4)
    if dist.is_initialized():
        if dist.get_rank() != 0:
            follow(engine)
            return {}
        engine = LeaderEngine(engine)
    sampled = torchgemma.SamplingParams(temperature=0.9, seed=seed)
    out = {b: [] for b in range(len(rows))}
    for b, row in enumerate(rows):
        engine.add_request(b, row, max_new_tokens=NEW_TOKENS, sampling=sampled if b == 1 else None)
    while engine.has_unfinished_requests():
        for step in engine.step():
            out[step.request_id].append(step.token_id)
    if isinstance(engine, LeaderEngine):
        engine.close()
    return {"engine": torch.tensor([out[b] + [-1] * (NEW_TOKENS - len(out[b])) for b in out])}


def routed_experts(model, seed: int) -> dict[str, torch.Tensor]:
    """The first MoE layer's experts called directly on routings chosen to stress token routing, in
    both implementations: 5 tokens (shares of 2 and 3 at 2 ranks), 1 token (rank 0 owns none),
    4 tokens routed only to the first half of the experts (at 2 ranks, rank 1 receives none)."""
    text = model.language_model
    layer = next(layer for layer in text.layers if layer.spec.moe)
    config = text.config
    e, k, dtype = config.num_experts, config.top_k_experts, text.embed_tokens.weight.dtype
    out = {}
    for implementation in ("grouped_mm", "eager"):
        text.set_experts(implementation)
        gen = torch.Generator().manual_seed(seed)
        for name, n, pool in (("ragged", 5, e), ("one", 1, e), ("half", 4, e // 2)):
            x = torch.randn(n, config.hidden_size, generator=gen).to(dtype)
            experts = torch.stack([torch.randperm(pool, generator=gen)[:k] for _ in range(n)])
            weights = torch.rand(n, k, generator=gen)
            with torch.no_grad():
                out[f"{implementation}.{name}"] = layer.experts(x, weights, experts)
    text.set_experts("grouped_mm")
    return out


def rng_draws(model, seed: int) -> dict[str, torch.Tensor]:
    """Every rank's next draws of torch's global RNG after the load (the ranks were seeded apart
    before it: ``load`` must have given them rank 0's seed), gathered in rank order."""
    draws = torch.rand(4)
    if not dist.is_initialized():
        return {"rng": draws[None]}
    gathered = [torch.empty(4) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, draws)
    return {"rng": torch.stack(gathered)}


def seed_of(name: str) -> int:
    return zlib.crc32(name.encode()) % 1000


def _status_kib(field: str) -> int:
    """A field of /proc/self/status in KiB (VmRSS: resident now; VmHWM: the peak)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def memory(model, seed: int) -> dict[str, torch.Tensor]:
    """The rank's parameter bytes and its resident memory after loading and at the peak (KiB)."""
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    # Parameters and buffers (a quantized layer's weights are buffers: qweight, scales, mins).
    weights = params + sum(b.numel() * b.element_size() for b in model.buffers())
    figures = [params // 1024, _status_kib("VmRSS"), _status_kib("VmHWM"), BEFORE_KIB]
    return {"memory": torch.tensor(figures), "weights": torch.tensor([weights // 1024])}


TASKS = {
    "rng": rng_draws,
    "logits": logits_and_tokens,
    "engine": engine_batch,
    "memory": memory,
    "experts": routed_experts,
}
BEFORE_KIB = 0


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("task", help=f"one of {', '.join(TASKS)}, or several joined by commas")
    parser.add_argument("checkpoints", nargs="+")
    parser.add_argument("--expert-parallel", action="store_true")
    parser.add_argument(
        "--expert-exchange", default=None, help="all-reduce or all-to-all (implies --expert-parallel)"
    )
    parser.add_argument("--dtype", default="fp32")
    parser.add_argument("--quantize", default=None)
    parser.add_argument("--activations", default="auto")  # quantized products' activations; "none"
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(1 + int(__import__("os").environ.get("RANK", 0)))  # ranks apart until the load
    global BEFORE_KIB
    BEFORE_KIB = _status_kib("VmRSS")  # torch imported, nothing loaded
    results = {}
    for item in args.checkpoints:
        name, folder = item.split("=", 1)
        model = torchgemma.load(
            folder,
            dtype=args.dtype,
            tensor_parallel_size=int(__import__("os").environ["WORLD_SIZE"]),
            expert_parallel=args.expert_exchange or args.expert_parallel,
            quantize=None if args.quantize == "none" else args.quantize,
            activations=None if args.activations == "none" else args.activations,
        )
        for task in args.task.split(","):
            for key, value in TASKS[task](model, seed=seed_of(name)).items():
                results[f"{name}.{key}"] = value.contiguous()
        quantization = getattr(model, "quantization", None)
        if quantization is not None:  # the rank's layers quantized, and those kept in float
            results[f"{name}.layers"] = torch.tensor([len(quantization["layers"]), len(quantization["kept"])])
    if not dist.is_initialized():  # one process (WORLD_SIZE=1): the comparison's own figures
        save_file(results, args.out)
        return
    if dist.get_rank() == 0:
        save_file(results, args.out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
