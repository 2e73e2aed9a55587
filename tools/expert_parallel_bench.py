"""Expert parallelism compared (issue 27, item 2): one MoE experts block of a 26B-like config on N
ranks (gloo on the CPU, one torch thread per rank): TP of experts (each expert's feature slice),
EP all-reduce (whole experts computed where the weights are, sums all-reduced) and EP all-to-all
(distributed/routed.py), against one process. Prints medians of interleaved repeats: wall time
(the step ends at a barrier), the main thread's CPU time (time.thread_time: compute without gloo's
threads) and the process's CPU time; then the bytes each rank sends per decode/prefill step for the
published 26B-A4B config (computed from the shapes, not measured).

    torchrun --nproc-per-node 2 tools/expert_parallel_bench.py [H I E K DTYPE]   # default 704 176 128 8 fp32
"""

import dataclasses
import os
import statistics
import sys
import time
from dataclasses import replace

import torch
import torch.distributed as dist

from torchgemma.distributed.routed import RoutedExperts
from torchgemma.distributed.transform import ExpertShard
from torchgemma.model.text import Experts

LAYERS, HIDDEN, TOP_K = 30, 2816, 8  # gemma4-transformers-5.23.md, 1.1: every layer has the MoE block


def sent_bytes(n: int, size: int, row: int = 2, partial: int = 4) -> dict[str, float]:
    """Bytes one rank sends per step (n rows) in the experts' exchange, on average over ranks and
    with uniform routing: a ring all-reduce of n x H float32 partial sums (EP all-reduce) sends
    2 (N-1)/N of it, of n x K x H (TP experts: each pair's float32 part of its down output); all-to-all sends its
    n/N tokens' K rows (bf16) to other ranks' experts ((N-1)/N of them), as many outputs back, then
    an all-gather of its n/N summed rows to the N-1 others."""
    reduce = 2 * (size - 1) / size * n * HIDDEN * partial
    dispatch = n / size * TOP_K * (size - 1) / size * HIDDEN * row
    gather = (size - 1) / size * n * HIDDEN * row
    return {
        "all-reduce": LAYERS * reduce,
        "TP experts": LAYERS * reduce * TOP_K,
        "all-to-all": LAYERS * (2 * dispatch + gather),
        "(no dispatch)": LAYERS * (dispatch + gather),
    }


torch.set_num_threads(1)
dist.init_process_group("gloo")
size, rank = dist.get_world_size(), dist.get_rank()
argv = sys.argv[1:] or ["704", "176", "128", "8", "fp32"]
H, I, E, K = (int(a) for a in argv[:4])  # noqa: E741 - the paper names
dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[argv[4]]


@dataclasses.dataclass(frozen=True)
class Cfg:  # the fields Experts reads
    num_experts: int = E
    moe_intermediate_size: int = I
    hidden_size: int = H


gen = torch.Generator().manual_seed(0)
gate_up = (torch.randn(E, 2 * I, H, generator=gen) * H**-0.5).to(dtype)
down = (torch.randn(E, H, I, generator=gen) * I**-0.5).to(dtype)
full = Experts(Cfg())
full.gate_up_proj.data, full.down_proj.data = gate_up, down
step, f0 = E // size, rank * (E // size)
ep = ExpertShard(Cfg(), f0, f0 + step, "grouped_mm")
ep.gate_up_proj.data, ep.down_proj.data = gate_up[f0 : f0 + step], down[f0 : f0 + step]
a2a = RoutedExperts(Cfg(), f0, f0 + step, "grouped_mm")
a2a.gate_up_proj.data, a2a.down_proj.data = ep.gate_up_proj.data, ep.down_proj.data
i0, i1 = rank * I // size, (rank + 1) * I // size
tp = ExpertShard(replace(Cfg(), moe_intermediate_size=i1 - i0), 0, E, "grouped_mm", sliced=True)
tp.gate_up_proj.data = torch.cat([gate_up[:, i0:i1], gate_up[:, I + i0 : I + i1]], 1).contiguous()
tp.down_proj.data = down[:, :, i0:i1].contiguous()
modes = {"one process": full, "TP experts": tp, "EP all-reduce": ep, "EP all-to-all": a2a}
if rank == 0:
    print(f"H={H} I={I} E={E} K={K} {argv[4]} N={size}; load {os.getloadavg()}", flush=True)
for n in (1, 16, 512):
    x = torch.randn(n, H, generator=gen).to(dtype)
    experts = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(n)])
    weights = torch.rand(n, K, generator=gen)
    reps = 31 if n < 512 else 9
    times = {m: ([], [], []) for m in modes}
    ref = full(x, weights, experts)
    with torch.no_grad():
        for m, mod in modes.items():  # warm-up and check
            out = mod(x, weights, experts)
            if rank == 0 and m != "one process":
                print(
                    f"  n={n} {m}: max diff from one process {(out.float() - ref.float()).abs().max().item():.2e}",
                    flush=True,
                )
        for _ in range(reps):
            for m, mod in modes.items():
                dist.barrier()
                w0, c0, t0 = time.perf_counter(), time.process_time(), time.thread_time()
                mod(x, weights, experts)
                t1 = time.thread_time()
                if m != "one process":
                    dist.barrier()  # the step ends when every rank has its sum
                times[m][0].append(time.perf_counter() - w0)
                times[m][1].append(time.process_time() - c0)
                times[m][2].append(t1 - t0)
    if rank == 0:
        for m in modes:
            wall, cpu, thread = (1e3 * statistics.median(t) for t in times[m])
            print(
                f"n={n:4d} {m:14s} wall {wall:8.2f} ms  thread {thread:8.2f} ms  process {cpu:8.2f} ms",
                flush=True,
            )
if rank == 0:
    print(
        f"\nbytes one rank sends per step, published 26B-A4B ({LAYERS} MoE layers, H={HIDDEN}, top-{TOP_K}, bf16 rows):"
    )
    for ranks in (2, 4, 8):
        for rows in (1, 16, 512):
            row = "  ".join(f"{k} {v / 2**20:8.3f} MiB" for k, v in sent_bytes(rows, ranks).items())
            print(f"N={ranks} n={rows:4d}  {row}")
dist.destroy_process_group()
