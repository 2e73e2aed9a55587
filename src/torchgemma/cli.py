"""The ``torchgemma`` command: a thin layer over the library."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from .config import ConfigError, ModelConfig
from .info import describe, format_report
from .loading import resolve_dtype


def _config_path(source: str) -> Path:
    path = Path(source).expanduser()
    if path.is_dir():
        return path / "config.json"
    if path.is_file():
        return path
    from .loading import HUB_ID

    if HUB_ID.match(source):
        from huggingface_hub import hf_hub_download

        return Path(hf_hub_download(source, "config.json"))
    raise FileNotFoundError(f"{source}: no such checkpoint folder, config.json or hub repository id")


def cmd_info(args: argparse.Namespace) -> int:
    config = ModelConfig.from_file(_config_path(args.path))
    if args.context is not None and args.context <= 0:
        raise ValueError(f"--context must be positive, got {args.context}")
    if args.batch <= 0:
        raise ValueError(f"--batch must be positive, got {args.batch}")
    info = describe(config, context=args.context, batch=args.batch, dtype=resolve_dtype(args.dtype))
    print(json.dumps(info, indent=2) if args.json else format_report(info))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="torchgemma", description="Gemma 4 in PyTorch, exact against transformers."
    )
    commands = parser.add_subparsers(dest="command", required=True)

    info = commands.add_parser(
        "info",
        help="parameter counts and memory of a checkpoint, from config.json alone",
        description="Parameter counts (total, per tower, PLE table, effective) and memory (weights at "
        "bf16/int8/int4, the KV cache torchgemma allocates) from a checkpoint's config.json; no weights needed.",
    )
    info.add_argument("path", help="checkpoint folder, config.json file, or hub repository id")
    info.add_argument(
        "--context", type=int, default=None, help="tokens per sequence (default: the model's maximum)"
    )
    info.add_argument("--batch", type=int, default=1, help="sequences in the cache (default: 1)")
    info.add_argument(
        "--dtype", default=None, help="KV cache dtype: bf16, fp16 or fp32 (default: the checkpoint's)"
    )
    info.add_argument("--json", action="store_true", help="print a JSON object")
    info.set_defaults(func=cmd_info)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ConfigError, FileNotFoundError, ValueError) as err:
        print(f"torchgemma {args.command}: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
