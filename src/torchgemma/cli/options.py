"""The flags several commands share, and argument types that reject a bad value at parse time,
before anything loads."""

from __future__ import annotations

import argparse
import math
import os

import torch

from ..weights.loading import resolve_dtype

# Decode on a CPU is a chain of small matrix products with a barrier after each; when another
# process holds one of the threads' cores, every barrier waits for it. gemma3-270m decode on a shared
# 2-core machine (other work running, load average 2-8; medians of 5 runs of 32-48 tokens): 1 thread
# 4.6 tok/s, 2 threads 1.3 tok/s; with a busy loop on one core as well, 1.8 vs 0.55. Half the cores
# (the physical ones where cores are hyperthreads) leaves room for whatever else runs.
THREADS_HELP = (
    "CPU threads for the model: N, or auto (the cores the last minute's load average leaves idle, at "
    "least 1). Default: half the cores this process may use, at least 1. Every decode step waits for "
    "all its threads, so a thread whose core other work holds stalls each step: gemma3-270m decode on "
    "a busy 2-core machine ran at 4.6 tok/s with 1 thread and 1.3 tok/s with 2 threads"
)


class ArgumentParser(argparse.ArgumentParser):
    """argparse with one-line errors: the message and where the help is, not the whole usage."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def usable_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def default_threads() -> int:
    return max(1, usable_cores() // 2)


def auto_threads(load_average: float | None = None) -> int:
    """``--threads auto``: the cores the 1-minute load average leaves idle (rounded), at least 1 and
    at most the usable cores. A measure of the recent past, not a promise: other work that starts
    later still contends. Without a load average (Windows) the default's half."""
    if load_average is None:
        try:
            load_average = os.getloadavg()[0]
        except (AttributeError, OSError):
            return default_threads()
    cores = usable_cores()
    return max(1, min(cores, round(cores - load_average)))


def parse_threads(text: str) -> int | str:
    if text == "auto":
        return text
    try:
        return int_at_least(1)(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"a number of threads (>= 1) or auto, not {text!r}") from None


# ---- argument types ---------------------------------------------------------------------------------


def int_at_least(low: int):
    def parse(text: str) -> int:
        value = int(text)
        if value < low:
            raise argparse.ArgumentTypeError(f"must be >= {low}, got {value}")
        return value

    parse.__name__ = "int"  # argparse names the type in "invalid int value"
    return parse


def float_where(check, rule: str):
    def parse(text: str) -> float:
        value = float(text)
        if not (math.isfinite(value) and check(value)):
            raise argparse.ArgumentTypeError(f"must be {rule}, got {text}")
        return value

    parse.__name__ = "float"
    return parse


def parse_dtype(text: str) -> str:
    try:
        resolve_dtype(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None
    return text


def parse_device(text: str) -> str:
    if text == "auto":
        return text
    try:
        parsed = torch.device(text)
    except RuntimeError:
        raise argparse.ArgumentTypeError(
            f"unknown device {text!r}; use auto, cpu, cuda, cuda:N or mps"
        ) from None
    if parsed.type not in ("cpu", "cuda", "mps"):
        raise argparse.ArgumentTypeError(f"torchgemma runs on cpu, cuda or mps, not {text!r}")
    return text


# ---- flag groups ------------------------------------------------------------------------------------


def add_model_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model",
        required=True,
        help="checkpoint folder, hub repository id, .gguf file, or a named model (gemma3-270m)",
    )
    parser.add_argument(
        "--mmproj",
        default=None,
        metavar="FILE",
        help="llama.cpp's mmproj .gguf of the model's vision and audio towers, beside a .gguf --model",
    )
    parser.add_argument(
        "--dtype",
        type=parse_dtype,
        default=None,
        help="bf16 or fp32 (default: the checkpoint's; float16 overflows Gemma)",
    )
    parser.add_argument(
        "--device",
        type=parse_device,
        default="auto",
        help="auto (default: CUDA when there is a GPU, else cpu), cpu, cuda, cuda:1, mps",
    )
    parser.add_argument(
        "--threads",
        type=parse_threads,
        default=None,
        metavar="N",
        help=THREADS_HELP,
    )
    parser.add_argument(
        "--attention",
        choices=["sdpa", "eager"],
        default="sdpa",
        help="attention backend: sdpa (default, fast) or eager (transformers' arithmetic to the bit)",
    )
    parser.add_argument(
        "--compile",
        action="store_true",
        help="compile the decode step (torch.compile; CUDA graphs on CUDA): minutes to start, faster steps",
    )
    parser.add_argument(
        "--quantize",
        choices=["auto", "int8", "int4", "gguf", "none"],
        default="auto",
        help="weight-only quantization of the text decoder: int8, int4, gguf (a .gguf file's own blocks), "
        "none (a .gguf file dequantized into --dtype); auto (default): gguf for a .gguf file and for the named "
        "model gemma3-270m, else none",
    )
    parser.add_argument(
        "--activations",
        choices=["auto", "float", "int16", "int8"],
        default="auto",
        help="a quantized model's prefill on the CPU: int16 (float32's accuracy, ~1.6x faster with AVX-512 "
        "VNNI), int8 (llama.cpp's arithmetic: ~2.2x, slightly less accurate), float (the model's dtype); "
        "auto (default): int16 where the CPU has AVX-512 VNNI, else float",
    )


class _ExpertParallel(argparse.Action):
    """--expert-parallel: True, unless --expert-exchange already named the exchange."""

    def __init__(self, option_strings, dest, **kwargs):
        super().__init__(option_strings, dest, nargs=0, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        if not isinstance(getattr(namespace, self.dest, None), str):
            setattr(namespace, self.dest, True)


def add_parallel_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--tensor-parallel-size",
        type=int_at_least(1),
        default=1,
        metavar="N",
        help="split the text decoder over N processes: run under `torchrun --nproc-per-node N` (default 1)",
    )
    parser.add_argument(
        "--expert-parallel",
        action=_ExpertParallel,
        default=False,
        help="a mixture of experts (26B-A4B): whole experts per process instead of a slice of each",
    )
    parser.add_argument(
        "--expert-exchange",
        dest="expert_parallel",
        choices=["all-reduce", "all-to-all"],
        default=False,
        help="expert parallel, its tokens exchanged by all-reduce (the default of --expert-parallel: "
        "each process computes its experts for every token) or all-to-all (each token sent to its "
        "experts' processes and back: more bytes at 2-4 processes, experts bit for bit as one process)",
    )


def add_speculative_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--speculative",
        type=parse_speculative,
        default=None,
        metavar="ngram|mtp:SOURCE",
        help="speculative decoding: ngram (prompt lookup: drafts copied from the prompt and reply, for "
        "replies that quote their input) or mtp:SOURCE (a Gemma 4 assistant drafter); greedy replies are "
        "the same token for token, sampled ones the same distribution (default: off)",
    )
    parser.add_argument(
        "--num-speculative-tokens",
        type=int_at_least(1),
        default=None,
        metavar="K",
        help="most draft tokens per request and step, with --speculative (default: 4)",
    )


def parse_speculative(text: str) -> str:
    method, _, source = text.partition(":")
    if method not in ("ngram", "mtp") or (method == "mtp") != bool(source):
        raise argparse.ArgumentTypeError(f"--speculative takes ngram or mtp:SOURCE, not {text!r}")
    return text


def add_generation_flags(parser: argparse.ArgumentParser, quiet: str, verbose: str) -> None:
    add_model_flags(parser)
    add_speculative_flags(parser)
    parser.add_argument(
        "--max-new-tokens",
        type=int_at_least(1),
        default=None,
        metavar="N",
        help="most tokens per reply (default: the checkpoint's generation_config.json, else 512 for a chat "
        "model, 64 for a base model, whose greedy continuations loop)",
    )
    talk = parser.add_mutually_exclusive_group()
    talk.add_argument("-q", "--quiet", action="store_true", help=quiet)
    talk.add_argument("-v", "--verbose", action="store_true", help=verbose)
    sampling = parser.add_argument_group(
        "sampling",
        "unset flags take the checkpoint's generation_config.json defaults (none: greedy); --top-k, "
        "--top-p, --min-p or --seed without --temperature sample at temperature 1 when that default is greedy",
    )
    sampling.add_argument(
        "--temperature", type=float_where(lambda v: v >= 0, ">= 0"), default=None, help="0 is greedy"
    )
    sampling.add_argument(
        "--top-k", type=int_at_least(0), default=None, help="keep the k most likely tokens (0: off)"
    )
    sampling.add_argument(
        "--top-p",
        type=float_where(lambda v: 0 < v <= 1, "in (0, 1]"),
        default=None,
        help="nucleus: keep this probability mass, in (0, 1]",
    )
    sampling.add_argument(
        "--min-p",
        type=float_where(lambda v: 0 <= v <= 1, "in [0, 1]"),
        default=None,
        help="drop tokens below min-p x the top one, in [0, 1]",
    )
    sampling.add_argument(
        "--repetition-penalty",
        type=float_where(lambda v: v > 0, "> 0"),
        default=None,
        help="> 1 discourages repeats (also when greedy)",
    )
    sampling.add_argument("--seed", type=int, default=None, help="make sampling reproducible")


def add_media_flags(parser: argparse.ArgumentParser, where: str) -> None:
    media = parser.add_argument_group("media", f"images, audio and videos (repeatable); {where}")
    media.add_argument(
        "--image", action="append", default=[], metavar="PATH", help="an image file (PNG, JPEG, ...)"
    )
    media.add_argument(
        "--audio",
        action="append",
        default=[],
        metavar="PATH",
        help="an audio file (WAV; FLAC/OGG/MP3 need soundfile)",
    )
    media.add_argument(
        "--video",
        action="append",
        default=[],
        metavar="PATH",
        help="a video file (MP4, WebM, ...; needs PyAV: pip install 'torchgemma[video]')",
    )
