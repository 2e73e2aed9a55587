"""Tensor and expert parallelism of the text decoder over torch.distributed (``plan.py``: which
slice each rank holds; ``transform.py``: the rank's modules and their collectives; ``group.py``:
the process group, from torchrun's environment)."""

from .group import init_group, is_leader, sync_seed
from .plan import ParallelError, ShardPlan, shard_plan
from .transform import ExpertShard, VocabShard, build_sharded, connect, shard_model, shard_source

__all__ = [
    "ExpertShard",
    "ParallelError",
    "ShardPlan",
    "VocabShard",
    "build_sharded",
    "connect",
    "init_group",
    "is_leader",
    "shard_model",
    "shard_plan",
    "shard_source",
    "sync_seed",
]
