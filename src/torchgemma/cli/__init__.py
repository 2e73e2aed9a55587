"""The ``torchgemma`` command: a thin layer over the library, one module per command.

Arguments are checked before the model loads, and every failure is one line on stderr,
``torchgemma CMD: error: ...``, with exit status 2 (``--verbose`` adds the traceback of a failure
nobody anticipated).
"""

from __future__ import annotations

import os
import sys
from contextlib import suppress

import torch

from ..config import ConfigError
from . import chat, debug, embed, generate, info, serve
from .common import CLIError, one_line
from .options import ArgumentParser

COMMANDS = (info, generate, chat, embed, serve, debug)  # in --help's order


def package_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("torchgemma")
    except PackageNotFoundError:
        return "unknown (not installed; run from a source tree)"


def build_parser() -> ArgumentParser:
    parser = ArgumentParser(prog="torchgemma", description="Gemma 4 in PyTorch, exact against transformers.")
    parser.add_argument("--version", action="version", version=f"torchgemma {package_version()}")
    commands = parser.add_subparsers(dest="command", required=True)
    for command in COMMANDS:
        command.add_parser(commands)
    return parser


def describe_error(err: Exception) -> str | None:
    """The one-line message of an anticipated failure; None for one that is a bug."""
    import jinja2
    from PIL import Image

    if isinstance(err, jinja2.TemplateSyntaxError):
        return f"the chat template has a syntax error at line {err.lineno}: {one_line(err)}"
    if isinstance(err, jinja2.TemplateError):  # raise_exception() in a template, an undefined name, ...
        return f"the chat template failed: {one_line(err)}"
    if isinstance(err, Image.DecompressionBombError):
        return f"an image is too large to decode safely: {one_line(err)}"
    if isinstance(err, torch.OutOfMemoryError):
        return f"out of memory: {one_line(err)}"
    if isinstance(err, ModuleNotFoundError) and str(err).startswith("No module named"):
        return f"a package is missing: {err} (pip install it, or see the README's optional extras)"
    if isinstance(err, (CLIError, ConfigError, ValueError, OSError, ImportError)):
        return one_line(err)
    return None


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130
    except BrokenPipeError:
        # The reader went away (`torchgemma generate ... | head -1`): stop quietly, and let the
        # final flush at exit write nowhere rather than fail again.
        with suppress(OSError, ValueError):
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except Exception as err:
        message = describe_error(err)
        if message is None:
            if getattr(args, "verbose", False):
                import traceback

                traceback.print_exc()
            message = f"{type(err).__name__}: {one_line(err)} (a bug? --verbose shows the traceback)"
        print(f"torchgemma {args.command}: error: {message}", file=sys.stderr)
        return 2
