"""What the commands share at run time: one-line errors, the checks made before the model loads,
loading the model, the sampling settings from the flags, the speed line."""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from ..generation import SamplingParams
from ..generation.speculative import parse_cli
from .options import auto_threads, default_threads

# Flags that only matter when sampling: given without --temperature they switch sampling on.
SAMPLING_ONLY = ("top_k", "top_p", "min_p", "seed")


class CLIError(Exception):
    """A failure the user can fix, reported as one line: ``torchgemma CMD: error: MESSAGE``."""


def one_line(err: BaseException) -> str:
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    return "; ".join(lines) or type(err).__name__


def importable(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(name) is not None


def resolve_device(name: str) -> str:
    """``auto`` is CUDA when there is a GPU, else the CPU; a named device must be there."""
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(name)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            why = (
                f"this torch ({torch.__version__}) is a CPU-only build"
                if torch.version.cuda is None
                else "no CUDA GPU was found"
            )
            raise CLIError(f"--device {name}: CUDA is not available ({why}); use --device cpu or auto")
        count = torch.cuda.device_count()
        if device.index is not None and device.index >= count:
            raise CLIError(
                f"--device {name}: this machine has {count} CUDA device(s), cuda:0 to cuda:{count - 1}"
            )
    if device.type == "mps" and not torch.backends.mps.is_available():
        raise CLIError(
            f"--device {name}: Apple's MPS backend is not available here; use --device cpu or auto"
        )
    return name


# ---- checks before the model loads ------------------------------------------------------------------


def utf8(data: bytes, where: str) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise CLIError(
            f"{where} is not UTF-8 text ({err.reason}: byte 0x{data[err.start]:02x} at offset {err.start})"
        ) from None


def check_text(text: str, where: str) -> str:
    # A terminal in a non-UTF-8 locale hands Python undecodable bytes as lone surrogates.
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        raise CLIError(f"{where} is not UTF-8 text (undecodable bytes at character {err.start})") from None
    return text


def check_media_files(args: argparse.Namespace) -> None:
    """Before the model loads, so that a typo or a bad file fails at once: images are opened (header
    only: format, size, the decompression-bomb check), audio is read, videos' headers are read."""
    from PIL import Image

    for path in args.image:
        if not Path(path).expanduser().is_file():
            raise CLIError(f"image file not found: {path!r}")
        try:
            with Image.open(Path(path).expanduser()):
                pass
        except Image.DecompressionBombError as err:
            raise CLIError(f"image {path!r} is too large to decode safely: {err}") from None
        except OSError as err:  # PIL's UnidentifiedImageError is an OSError
            raise CLIError(f"cannot read image {path!r}: {err}") from None
    if args.audio:
        from ..processing.audio import load_audio

        for path in args.audio:
            if not Path(path).expanduser().is_file():
                raise CLIError(f"audio file not found: {path!r}")
            # Reads the header and one frame: its errors name the file (and a missing soundfile).
            load_audio(Path(path).expanduser(), max_frames=1)
    if args.video:
        from ..processing.video import probe_video

        for path in args.video:
            if not Path(path).expanduser().is_file():
                raise CLIError(f"video file not found: {path!r}")
            probe_video(path)  # its errors name the file (and the video extra when PyAV is missing)


def prepare(args: argparse.Namespace) -> None:
    """What parsing cannot check, short of loading the model."""
    check_media_files(args)
    args.device = resolve_device(args.device)
    if args.threads is None:
        args.threads = default_threads()
    elif args.threads == "auto":
        args.threads = auto_threads()


# ---- the model ----------------------------------------------------------------------------------------


@contextmanager
def hub_progress_bars(shown: bool) -> Iterator[None]:
    """Hide huggingface_hub's download bars for --quiet (the loader's bar is LLM's progress=)."""
    if shown:
        yield
        return
    from huggingface_hub.utils import are_progress_bars_disabled, disable_progress_bars, enable_progress_bars

    hub_bars = not are_progress_bars_disabled()
    disable_progress_bars()
    try:
        yield
    finally:
        if hub_bars:
            enable_progress_bars()


def load_llm(args: argparse.Namespace):
    from ..llm import LLM

    torch.set_num_threads(args.threads)
    start = time.perf_counter()
    with hub_progress_bars(not args.quiet):
        llm = LLM(
            args.model,
            dtype=args.dtype,
            device=args.device,
            attention=args.attention,
            progress=not args.quiet,
            quantize=None if args.quantize == "none" else args.quantize,
            activations=None if args.activations == "float" else args.activations,
            mmproj=args.mmproj,
            **parallel_options(args),
            speculative=parse_cli(
                getattr(args, "speculative", None), getattr(args, "num_speculative_tokens", None)
            ),
        )
    if args.compile:
        from ..acceleration import compile

        compile(llm.model)
    if args.verbose:
        print(
            f"loaded {args.model} in {time.perf_counter() - start:.1f} s: {llm.model.device}, "
            f"{str(llm.model.dtype).removeprefix('torch.')}{quantization_note(llm.model)}, "
            f"{torch.get_num_threads()} CPU thread(s), "
            f"context {llm.context_length:,} tokens",
            file=sys.stderr,
        )
    return llm


def parallel_options(args: argparse.Namespace) -> dict:
    """--tensor-parallel-size / --expert-parallel as load options; under them only rank 0 writes to
    stdout (every rank runs the same command); ``load`` seeds every rank's RNG with rank 0's seed."""
    size = getattr(args, "tensor_parallel_size", 1)
    if size == 1 and not getattr(args, "expert_parallel", False):
        return {}
    import os

    from ..distributed import init_group, is_leader

    init_group(size, torch.device(args.device))
    if not is_leader():
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - for the life of the process
    return {"tensor_parallel_size": size, "expert_parallel": args.expert_parallel}


def quantization_note(model) -> str:
    """What --verbose says of a quantized model after its dtype; nothing for a float one."""
    quantization = getattr(model, "quantization", None)
    if not quantization:
        return ""
    bits = max((getattr(m, "activation_bits", 0) for m in model.modules()), default=0)
    prefill = f" (int{bits} in prefill products)" if bits else ""
    return f" activations{prefill}, {quantization['mode']} weights ({len(quantization['layers'])} layers)"


# ---- generating -----------------------------------------------------------------------------------


def sampling_params(args: argparse.Namespace, llm) -> SamplingParams:
    """The sampling flags the user gave; the rest fall back to the checkpoint's defaults.

    --top-k, --top-p, --min-p or --seed without --temperature mean sampling: when the checkpoint's
    default is greedy decoding they would change nothing, so they sample at temperature 1.
    """
    names = ("temperature", "top_k", "top_p", "min_p", "repetition_penalty", "seed")
    chosen = {name: getattr(args, name) for name in names if getattr(args, name) is not None}
    sampling_only = [name for name in SAMPLING_ONLY if name in chosen]
    if sampling_only and "temperature" not in chosen and not llm.generation_config.do_sample:
        chosen["temperature"] = 1.0
    elif sampling_only and chosen.get("temperature") == 0 and not args.quiet:
        flags = ", ".join("--" + name.replace("_", "-") for name in sampling_only)
        print(
            f"torchgemma {args.command}: note: {flags} do nothing with --temperature 0 (greedy)",
            file=sys.stderr,
        )
    return llm.generation_config.sampling(**chosen)


def default_limit_hint(args: argparse.Namespace, llm, new_tokens: int) -> None:
    """Say on stderr how to get a longer reply when one stopped at the default limit (no
    --max-new-tokens given); nothing otherwise, and nothing under --quiet."""
    limit = llm.generation_config.reply_limit(bool(llm.tokenizer.chat_template))
    if args.max_new_tokens is None and new_tokens >= limit and not args.quiet:
        print(
            f"torchgemma {args.command}: the reply reached the default limit of {limit} new tokens; "
            "--max-new-tokens N sets another",
            file=sys.stderr,
            flush=True,
        )


def report_speed(stats, out) -> None:
    print(
        f"prompt: {stats.prompt_tokens} tokens, {stats.prefill_tokens_per_second:.1f} tok/s"
        f"{f' ({stats.cached_tokens} from the prefix cache)' if stats.cached_tokens else ''} | "
        f"decode: {stats.steps} tokens, {stats.decode_tokens_per_second:.1f} tok/s",
        file=out,
        flush=True,
    )
