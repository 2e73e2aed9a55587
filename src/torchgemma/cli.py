"""The ``torchgemma`` command: a thin layer over the library."""

from __future__ import annotations

import argparse
import json
import signal
import sys
from pathlib import Path

from .config import ConfigError, ModelConfig
from .info import describe, format_report
from .weights.loading import resolve_dtype


def _config_path(source: str) -> Path:
    path = Path(source).expanduser()
    if path.is_dir():
        return path / "config.json"
    if path.is_file():
        return path
    from .weights.source import HUB_ID

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
    info = describe(
        config,
        context=args.context,
        batch=args.batch,
        dtype=resolve_dtype(args.dtype),
        max_rollback=args.max_rollback,
    )
    print(json.dumps(info, indent=2) if args.json else format_report(info))
    return 0


def _load_llm(args: argparse.Namespace):
    from .llm import LLM

    llm = LLM(args.model, dtype=args.dtype, device=args.device, attention=args.attention)
    if args.compile:
        from .acceleration import compile

        compile(llm.model)
    return llm


def _sampling(args: argparse.Namespace) -> dict:
    """The sampling flags the user gave; the rest fall back to the checkpoint's defaults."""
    names = ("temperature", "top_k", "top_p", "min_p", "repetition_penalty", "seed")
    return {name: getattr(args, name) for name in names if getattr(args, name) is not None}


def _report(stats, out) -> None:
    print(
        f"prompt: {stats.prompt_tokens} tokens, {stats.prefill_tokens_per_second:.1f} tok/s | "
        f"decode: {stats.steps} tokens, {stats.decode_tokens_per_second:.1f} tok/s",
        file=out,
    )


IMAGE_PLACEHOLDER, AUDIO_PLACEHOLDER = "<|image|>", "<|audio|>"


def with_placeholders(prompt: str, images: list[str], audio: list[str]) -> str:
    """The raw prompt with one placeholder per file appended, for a kind the prompt has none of."""
    if images and IMAGE_PLACEHOLDER not in prompt:
        prompt += IMAGE_PLACEHOLDER * len(images)
    if audio and AUDIO_PLACEHOLDER not in prompt:
        prompt += AUDIO_PLACEHOLDER * len(audio)
    return prompt


def _check_media_files(args: argparse.Namespace) -> None:
    # Before the model loads, so that a typo fails at once (contents are checked when read).
    for kind, paths in (("image", args.image), ("audio", args.audio)):
        for path in paths:
            if not Path(path).expanduser().is_file():
                raise FileNotFoundError(f"{kind} file not found: {path!r}")


def cmd_generate(args: argparse.Namespace) -> int:
    from .generation import GenerationStats

    _check_media_files(args)
    prompt = args.prompt if args.prompt is not None else sys.stdin.read()
    prompt = with_placeholders(prompt, args.image, args.audio)
    llm = _load_llm(args)
    stats = GenerationStats()
    pieces = llm.stream(
        prompt,
        images=args.image,
        audio=args.audio,
        max_new_tokens=args.max_new_tokens,
        stats=stats,
        **_sampling(args),
    )
    for piece in pieces:
        sys.stdout.write(piece)
        sys.stdout.flush()
    sys.stdout.write("\n")
    sys.stdout.flush()
    _report(stats, sys.stderr)
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    _check_media_files(args)
    llm = _load_llm(args)
    media = [{"type": "image", "image": path} for path in args.image]
    media += [{"type": "audio", "audio": path} for path in args.audio]
    messages: list[dict] = [{"role": "system", "content": args.system}] if args.system else []
    interactive = sys.stdin.isatty()
    sampling = _sampling(args)
    while True:
        if interactive:
            print("> ", end="", file=sys.stderr, flush=True)
        line = sys.stdin.readline()
        if not line or line.strip() == "/exit":  # EOF or an explicit exit
            return 0
        if not line.strip():
            continue
        text = line.rstrip("\n")
        attach = media if not any(m["role"] == "user" for m in messages) else []
        # Media first, then the text, as in Gemma's own examples.
        messages.append(
            {"role": "user", "content": [*attach, {"type": "text", "text": text}] if attach else text}
        )
        answer, in_thought = [], False
        chunks = llm.stream_chat(
            messages, enable_thinking=args.think, max_new_tokens=args.max_new_tokens, **sampling
        )
        for chunk in chunks:
            # Thinking goes to stderr so that stdout carries the answers alone.
            if chunk.thinking and not in_thought:
                print("[thinking] ", end="", file=sys.stderr)
            elif in_thought and not chunk.thinking:
                print(file=sys.stderr)
            in_thought = chunk.thinking
            print(chunk.text, end="", file=sys.stderr if chunk.thinking else sys.stdout, flush=True)
            if not chunk.thinking:
                answer.append(chunk.text)
        if in_thought:
            print(file=sys.stderr)
        print(flush=True)
        messages.append({"role": "assistant", "content": "".join(answer)})


def _add_generation_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model",
        required=True,
        help="checkpoint folder, hub repository id, .gguf file, or a named model (gemma3-270m)",
    )
    parser.add_argument("--dtype", default=None, help="bf16, fp16 or fp32 (default: the checkpoint's)")
    parser.add_argument("--device", default=None, help="cpu, cuda, cuda:1, ... (default: cpu)")
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
        "--max-new-tokens", type=int, default=None, help="most tokens per reply (default: 512)"
    )
    sampling = parser.add_argument_group(
        "sampling", "unset flags take the checkpoint's generation_config.json defaults"
    )
    sampling.add_argument("--temperature", type=float, default=None, help="0 is greedy")
    sampling.add_argument("--top-k", type=int, default=None, help="keep the k most likely tokens (0: off)")
    sampling.add_argument("--top-p", type=float, default=None, help="nucleus: keep this probability mass")
    sampling.add_argument("--min-p", type=float, default=None, help="drop tokens below min-p x the top one")
    sampling.add_argument("--repetition-penalty", type=float, default=None, help="> 1 discourages repeats")
    sampling.add_argument("--seed", type=int, default=None, help="make sampling reproducible")


def _add_media_flags(parser: argparse.ArgumentParser, where: str) -> None:
    media = parser.add_argument_group("media", f"images and audio (repeatable); {where}")
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
    info.add_argument(
        "--max-rollback",
        type=int,
        default=0,
        help="tokens a sequence can take back (speculative decoding): slack in the sliding layers' ring",
    )
    info.add_argument("--json", action="store_true", help="print a JSON object")
    info.set_defaults(func=cmd_info)

    generate = commands.add_parser(
        "generate",
        help="continue a prompt, streaming the text to stdout",
        description="Continue a raw prompt (no chat template), streaming the text to stdout; prompt and "
        "decode speeds go to stderr at the end.",
    )
    generate.add_argument("prompt", nargs="?", default=None, help="the prompt (default: read stdin)")
    _add_generation_flags(generate)
    _add_media_flags(
        generate,
        "each fills one <|image|> / <|audio|> placeholder of the prompt, in order; a prompt without "
        "placeholders of a kind gets one per file appended at its end",
    )
    generate.set_defaults(func=cmd_generate)

    chat = commands.add_parser(
        "chat",
        help="chat interactively (one user message per stdin line)",
        description="Interactive chat with the checkpoint's chat template: each stdin line is a user "
        "message; the conversation is kept. Answers go to stdout, thinking to stderr. Ends on EOF or /exit.",
    )
    chat.add_argument("--system", default=None, help="a system prompt")
    chat.add_argument("--think", action="store_true", help="let the model think before answering")
    _add_generation_flags(chat)
    _add_media_flags(
        chat,
        "attached to the first user message (before its text) and kept in the conversation",
    )
    chat.set_defaults(func=cmd_chat)

    serve = commands.add_parser(
        "serve",
        help="serve the model over an OpenAI-compatible HTTP API",
        description="An OpenAI-compatible server (chat and text completions, streaming, tools, thinking, "
        "images, audio, transcription, /metrics, a chat page at /) with continuous batching. Needs the serve "
        "extra: pip install 'torchgemma[serve]'.",
    )
    serve.add_argument(
        "--model",
        required=True,
        help="checkpoint folder, hub repository id, .gguf file, or a named model (gemma3-270m)",
    )
    serve.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--max-batch-size", type=int, default=8, help="requests decoded together (default: 8)")
    serve.add_argument(
        "--max-len", type=int, default=4096, help="tokens per request, prompt and reply (default: 4096)"
    )
    serve.add_argument(
        "--max-waiting", type=int, default=64, help="requests queued for a slot before 503s (default: 64)"
    )
    serve.add_argument("--dtype", default=None, help="bf16, fp16 or fp32 (default: the checkpoint's)")
    serve.add_argument("--device", default=None, help="cpu, cuda, cuda:1, ... (default: cpu)")
    serve.add_argument("--attention", choices=["sdpa", "eager"], default="sdpa")
    serve.add_argument("--compile", action="store_true", help="compile the decode step (see generate --help)")
    serve.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on the API")
    serve.add_argument(
        "--served-model-name", default=None, help="the model id clients use (default: --model)"
    )
    serve.set_defaults(func=cmd_serve)
    return parser


def cmd_serve(args: argparse.Namespace) -> int:
    missing = [
        name for name in ("fastapi", "uvicorn", "prometheus_client", "multipart") if not _importable(name)
    ]
    if missing:
        print(
            f"torchgemma serve: error: the server needs {', '.join(missing)}: pip install 'torchgemma[serve]'",
            file=sys.stderr,
        )
        return 2
    if args.max_batch_size < 1 or args.max_len < 2 or args.max_waiting < 0:
        print(
            "torchgemma serve: error: --max-batch-size >= 1, --max-len >= 2, --max-waiting >= 0",
            file=sys.stderr,
        )
        return 2
    import uvicorn

    from .serving.app import create_app

    llm = _load_llm(args)
    name = args.served_model_name or str(args.model)
    app = create_app(
        llm,
        model_name=name,
        max_batch_size=args.max_batch_size,
        max_len=args.max_len,
        max_waiting=args.max_waiting,
        api_key=args.api_key,
    )
    print(
        f"torchgemma serve: {name} at http://{args.host}:{args.port}/v1 "
        f"({args.max_batch_size} slots of {args.max_len} tokens; chat page at http://{args.host}:{args.port}/)",
        flush=True,
    )
    # uvicorn stops cleanly on Ctrl-C and SIGTERM (the app's shutdown stops the engine thread), then
    # re-raises the signal to the handler it found: SIGTERM then ends the process with status 0.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
    return 0


def _importable(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(name) is not None


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ConfigError, OSError, ValueError) as err:
        # OSError: a missing folder or file, or a hub download that failed.
        print(f"torchgemma {args.command}: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
