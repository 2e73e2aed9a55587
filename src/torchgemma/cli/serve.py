"""``torchgemma serve``: the model over an OpenAI-compatible HTTP API."""

from __future__ import annotations

import argparse
import signal
import sys

from .common import CLIError, importable, load_llm, prepare
from .options import add_model_flags, int_at_least


def add_parser(commands) -> None:
    serve = commands.add_parser(
        "serve",
        help="serve the model over an OpenAI-compatible HTTP API",
        description="An OpenAI-compatible server (chat and text completions, streaming, tools, thinking, "
        "images, audio, transcription, embeddings, /metrics, a chat page at /) with continuous batching. Needs the serve "
        "extra: pip install 'torchgemma[serve]'.",
    )
    add_model_flags(serve)
    serve.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    serve.add_argument("--port", type=int_at_least(0), default=8000)
    serve.add_argument(
        "--max-batch-size", type=int_at_least(1), default=8, help="requests decoded together (default: 8)"
    )
    serve.add_argument(
        "--max-len",
        type=int_at_least(2),
        default=4096,
        help="tokens per request, prompt and reply (default: 4096)",
    )
    serve.add_argument(
        "--max-waiting",
        type=int_at_least(0),
        default=64,
        help="requests queued for a slot before 503s (default: 64)",
    )
    serve.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on the API")
    serve.add_argument(
        "--served-model-name", default=None, help="the model id clients use (default: --model)"
    )
    serve.set_defaults(func=run, parser=serve, quiet=False, verbose=False)


def run(args: argparse.Namespace) -> int:
    missing = [
        name for name in ("fastapi", "uvicorn", "prometheus_client", "multipart") if not importable(name)
    ]
    if missing:
        raise CLIError(f"the server needs {', '.join(missing)}: pip install 'torchgemma[serve]'")
    args.image = args.audio = args.video = []
    prepare(args)
    import uvicorn

    from ..serving.app import create_app

    llm = load_llm(args)
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
