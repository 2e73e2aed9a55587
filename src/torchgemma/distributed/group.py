"""The process group a tensor-parallel model runs in: the one already set up, or one set up from
torchrun's environment (``init_process_group`` with ``env://``): NCCL on CUDA, gloo on the CPU."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from .plan import ParallelError


def init_group(size: int, device: torch.device) -> tuple[int, torch.device]:
    """This process's rank in a process group of ``size`` processes (set up from torchrun's
    ``RANK``/``WORLD_SIZE``/``MASTER_ADDR``/``MASTER_PORT`` when none exists) and the device it
    computes on (on CUDA, ``cuda:LOCAL_RANK`` unless an index was given)."""
    if size < 1:
        raise ParallelError(f"tensor_parallel_size must be at least 1, got {size}")
    if not dist.is_initialized():
        if "WORLD_SIZE" not in os.environ or "MASTER_ADDR" not in os.environ:
            raise ParallelError(
                f"tensor_parallel_size={size} needs a process group: run under "
                f"`torchrun --nproc-per-node {size} ...` or call torch.distributed.init_process_group first"
            )
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", init_method="env://")
    world = dist.get_world_size()
    if world != size:
        raise ParallelError(f"tensor_parallel_size={size} but the process group has {world} processes")
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", dist.get_rank())))
    return dist.get_rank(), device


def is_leader() -> bool:
    """Whether this process runs what only one rank should (the scheduler, tokenizer, HTTP, output):
    rank 0 of a process group, or a process outside any."""
    return not dist.is_initialized() or dist.get_rank() == 0


def sync_seed() -> None:
    """Seed torch's RNG on every rank with one seed drawn on rank 0: unseeded sampling then draws
    the same numbers on every rank, which computes the same logits (``load`` calls this when it
    splits a model)."""
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else "cpu"
    seed = (
        torch.randint(2**62, (), dtype=torch.int64)
        if dist.get_rank() == 0
        else torch.zeros((), dtype=torch.int64)
    )
    seed = seed.to(device)
    dist.broadcast(seed, src=0)
    torch.manual_seed(int(seed))
