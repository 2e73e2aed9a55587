"""``torchgemma info``: parameter counts and memory of a checkpoint, from its config alone."""

from __future__ import annotations

import argparse
import json

import torch

from ..weights.loading import resolve_dtype
from .options import int_at_least, parse_dtype


def add_parser(commands) -> None:
    info = commands.add_parser(
        "info",
        help="parameter counts and memory of a checkpoint, from its config alone",
        description="Parameter counts (total, per tower, PLE table, effective, active per token for "
        "mixtures of experts) and memory (weights at bf16/int8/int4, the KV cache torchgemma allocates) "
        "from a checkpoint's config.json or GGUF metadata; no weights are read (a hub id fetches config.json alone).",
    )
    info.add_argument(
        "path",
        nargs="?",
        default=None,
        help="what generate's --model takes (folder, .gguf file, hub id, gemma3-270m), or a config.json file",
    )
    info.add_argument("--model", default=None, help="the same, as a flag")
    info.add_argument(
        "--context",
        type=int_at_least(1),
        default=None,
        help="tokens per sequence (default: the model's maximum)",
    )
    info.add_argument("--batch", type=int_at_least(1), default=1, help="sequences in the cache (default: 1)")
    info.add_argument(
        "--dtype",
        type=parse_dtype,
        default=None,
        help="KV cache dtype: bf16, fp16 or fp32 (default: the checkpoint's)",
    )
    info.add_argument(
        "--max-rollback",
        type=int_at_least(0),
        default=0,
        help="tokens a sequence can take back (speculative decoding): slack in the sliding layers' ring",
    )
    info.add_argument("--json", action="store_true", help="print a JSON object")
    info.add_argument(
        "--tensor-parallel-size",
        type=int_at_least(1),
        default=1,
        metavar="N",
        help="also what each of N tensor-parallel processes holds (weights in --dtype, default bf16; KV cache)",
    )
    info.add_argument("--expert-parallel", action="store_true", help="with it: whole experts per process")
    info.set_defaults(func=run, parser=info)


def run(args: argparse.Namespace) -> int:
    from ..info import describe, format_report, inspect_checkpoint, sentence_head_shapes

    if args.path is not None and args.model is not None:
        args.parser.error("give the checkpoint once: as an argument or with --model")
    source = args.path if args.path is not None else args.model
    if source is None:
        args.parser.error("which checkpoint? e.g. torchgemma info gemma3-270m")
    config, load_dtype = inspect_checkpoint(source)
    info = describe(
        config,
        context=args.context,
        batch=args.batch,
        dtype=resolve_dtype(args.dtype) or load_dtype,
        max_rollback=args.max_rollback,
        sentence_head=sentence_head_shapes(source),
    )
    if args.tensor_parallel_size > 1 or args.expert_parallel:
        from ..info import GIB, rank_memory

        info["per_rank"] = per_rank = rank_memory(
            config,
            args.tensor_parallel_size,
            expert_parallel=args.expert_parallel,
            context=args.context,
            batch=args.batch,
            dtype=resolve_dtype(args.dtype) or torch.bfloat16,
        )
    print(json.dumps(info, indent=2) if args.json else format_report(info))
    if "per_rank" in info and not args.json:
        print(
            f"\nper rank of {args.tensor_parallel_size}{' (expert parallel)' if args.expert_parallel else ''}: "
            f"weights {per_rank['weights_bytes_per_rank'] / GIB:.2f} GiB, "
            f"KV cache {per_rank['kv_cache_bytes_per_rank'] / GIB:.2f} GiB"
        )
    return 0
