"""``torchgemma generate``: continue a raw prompt, streaming the text to stdout."""

from __future__ import annotations

import argparse
import json
import math
import sys
import time

from .common import (
    CLIError,
    check_text,
    default_limit_hint,
    load_llm,
    prepare,
    report_speed,
    sampling_params,
    utf8,
)
from .options import add_generation_flags, add_media_flags, add_parallel_flags
from .precheck import check_media

IMAGE_PLACEHOLDER, AUDIO_PLACEHOLDER, VIDEO_PLACEHOLDER = "<|image|>", "<|audio|>", "<|video|>"


def add_parser(commands) -> None:
    generate = commands.add_parser(
        "generate",
        help="continue a prompt, streaming the text to stdout",
        description="Continue a raw prompt (no chat template), streaming the text to stdout; prompt and "
        "decode speeds go to stderr at the end. Example: torchgemma generate --model gemma3-270m "
        "--max-new-tokens 32 'The capital of France is'",
    )
    generate.add_argument("prompt", nargs="?", default=None, help="the prompt (default: read stdin)")
    generate.add_argument(
        "--json",
        action="store_true",
        help="print one JSON object at the end instead of streaming: text, token_ids, finish_reason "
        "(stop or length), prompt_tokens, new_tokens, timings",
    )
    add_generation_flags(
        generate,
        quiet="no progress bar, no speed line: stdout and errors only",
        verbose="also say how the model loaded (device, dtype, threads, seconds)",
    )
    add_parallel_flags(generate)
    add_media_flags(
        generate,
        "each fills one <|image|> / <|audio|> / <|video|> placeholder of the prompt, in order; a prompt without "
        "placeholders of a kind gets one per file appended at its end",
    )
    generate.set_defaults(func=run, parser=generate)


def with_placeholders(prompt: str, images: list[str], audio: list[str], videos: list[str] = ()) -> str:
    """The raw prompt with one placeholder per file appended, for a kind the prompt has none of."""
    if images and IMAGE_PLACEHOLDER not in prompt:
        prompt += IMAGE_PLACEHOLDER * len(images)
    if audio and AUDIO_PLACEHOLDER not in prompt:
        prompt += AUDIO_PLACEHOLDER * len(audio)
    if videos and VIDEO_PLACEHOLDER not in prompt:
        prompt += VIDEO_PLACEHOLDER * len(videos)
    return prompt


def read_prompt(args: argparse.Namespace) -> str:
    if args.prompt is not None:
        return check_text(args.prompt, "the prompt")
    if sys.stdin is None or sys.stdin.isatty():
        # Nothing piped in: waiting for a terminal's EOF would look like a hang.
        args.parser.print_usage(sys.stderr)
        raise CLIError("no prompt: give it as an argument, or pipe it on stdin")
    if hasattr(sys.stdin, "buffer"):
        return utf8(sys.stdin.buffer.read(), "stdin")
    return check_text(sys.stdin.read(), "stdin")


def run(args: argparse.Namespace) -> int:
    from ..generation import GenerationStats

    prompt = with_placeholders(read_prompt(args), args.image, args.audio, args.video)
    prepare(args)
    check_media(args)
    start = time.perf_counter()
    llm = load_llm(args)
    load_seconds = time.perf_counter() - start
    for kind, files, generic in (
        ("image", args.image, IMAGE_PLACEHOLDER),
        ("audio", args.audio, AUDIO_PLACEHOLDER),
    ):
        if files:  # the checkpoint's own spelling (Gemma 3's <start_of_image>, Gemma 3n's soft tokens)
            prompt = prompt.replace(generic, llm.processor.placeholder(kind))
    stats = GenerationStats()
    options = dict(images=args.image, audio=args.audio, videos=args.video)
    options.update(max_new_tokens=args.max_new_tokens, stats=stats, sampling=sampling_params(args, llm))
    if args.json:
        ids = llm.generate_ids(llm.processor.encode_all([prompt], args.audio, args.image), **options)[0]
        print(json.dumps(json_result(llm, ids, stats, load_seconds), ensure_ascii=False), flush=True)
        return 0
    for piece in llm.stream(prompt, **options):
        sys.stdout.write(piece)
        sys.stdout.flush()
    sys.stdout.write("\n")
    sys.stdout.flush()
    default_limit_hint(args, llm, stats.steps)
    if not args.quiet:
        report_speed(stats, sys.stderr)
    return 0


def json_result(llm, ids: list[int], stats, load_seconds: float) -> dict:
    stopped = bool(ids) and ids[-1] in llm.generation_config.eos_token_ids

    def number(x: float) -> float | None:  # JSON has no NaN
        return None if math.isnan(x) else round(x, 4)

    return {
        "text": llm.tokenizer.decode(ids[:-1] if stopped else ids),
        "token_ids": ids,  # the stop token included
        "finish_reason": "stop" if stopped else "length",
        "prompt_tokens": stats.prompt_tokens,
        "new_tokens": len(ids),
        "timings": {
            "load_seconds": number(load_seconds),
            "prefill_seconds": number(stats.prefill_seconds),
            "decode_seconds": number(stats.decode_seconds),
            "prefill_tokens_per_second": number(stats.prefill_tokens_per_second),
            "decode_tokens_per_second": number(stats.decode_tokens_per_second),
        },
    }
