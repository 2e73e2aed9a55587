"""``torchgemma serve``: the model over an OpenAI-compatible HTTP API."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import signal
import sys
from pathlib import Path

from ..generation.engine import DEFAULT_PREFILL_CHUNK, DEQUANTIZING_PREFILL_CHUNK
from .chat import read_template
from .common import CLIError, importable, load_llm, prepare
from .options import add_model_flags, add_parallel_flags, add_speculative_flags, float_where, int_at_least

# The environment variable that can hold the API key (unlike --api-key, not shown by `ps`).
API_KEY_ENV = "TORCHGEMMA_API_KEY"
# Addresses that only this machine can reach: the Host check is on by default when bound to one.
LOOPBACK_BINDS = ("127.0.0.1", "localhost", "::1")
MiB = 1 << 20


def add_parser(commands) -> None:
    serve = commands.add_parser(
        "serve",
        help="serve the model over an OpenAI-compatible HTTP API",
        description="An OpenAI-compatible server (chat and text completions, the Responses API, streaming, "
        "tools, thinking, "
        "images, audio, transcription, embeddings, /metrics, a chat page at /) with continuous batching. Needs the serve "
        "extra: pip install 'torchgemma[serve]'.",
    )
    add_model_flags(serve)
    add_parallel_flags(serve)
    add_speculative_flags(serve)
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
    serve.add_argument(
        "--prefix-cache-gb",
        type=float_where(lambda x: x >= 0, "at least 0"),
        default=1.0,
        metavar="G",
        help="GiB of keys and values of prompts' beginnings kept for later requests (a shared system "
        "prompt, a conversation's earlier turns: only the rest is prefilled, the replies the same; "
        "least recently used dropped first); 0 turns it off (default: 1)",
    )
    serve.add_argument(
        "--prefill-chunk",
        type=int_at_least(1),
        default=None,
        metavar="N",
        help="prompt tokens read per forward pass (a long prompt takes several, interleaved with the "
        "other requests' decode steps); the prefix cache reuses whole chunks, so a smaller chunk "
        f"reuses more of a shared beginning (default: {DEFAULT_PREFILL_CHUNK}, or "
        f"{DEQUANTIZING_PREFILL_CHUNK} where quantized products dequantize their weights each pass: "
        "GGUF and int4/int8 models with float activations: --activations float, a CPU without AVX-512 VNNI, a GPU)",
    )
    serve.add_argument(
        "--api-key",
        default=None,
        help="require 'Authorization: Bearer KEY' on the API (visible to other users in `ps`: prefer "
        f"--api-key-file or the {API_KEY_ENV} environment variable)",
    )
    serve.add_argument(
        "--api-key-file",
        type=Path,
        default=None,
        metavar="PATH",
        help="read the API key from this file (its first line)",
    )
    serve.add_argument(
        "--served-model-name", default=None, help="the model id clients use (default: --model)"
    )
    add_api_flags(serve)
    add_limit_flags(serve)
    hygiene = serve.add_argument_group("hosts and logs")
    hygiene.add_argument(
        "--allowed-hosts",
        default=None,
        metavar="NAMES",
        help="comma-separated names the Host header may give, any port ('*.example.com': subdomains; "
        "'*': any). Default: localhost, 127.0.0.1 and [::1] when bound to loopback (against DNS "
        "rebinding), any name otherwise",
    )
    hygiene.add_argument(
        "--allowed-origins",
        default=None,
        metavar="ORIGINS",
        help="comma-separated web origins (https://app.example.com; '*': any) whose pages may call the "
        "API from a browser (CORS, preflight included). Default: none, no CORS headers",
    )
    hygiene.add_argument(
        "--log-prompts",
        action="store_true",
        help="add each request's prompt (its first 2000 characters) to its log line; by default a "
        "line has the method, path, status, time and token counts, never the prompt",
    )
    serve.set_defaults(func=run, parser=serve, quiet=False, verbose=False)


def add_api_flags(serve) -> None:
    """The chat template and the Responses API's store."""
    api = serve.add_argument_group("chat and responses")
    api.add_argument(
        "--chat-template",
        default=None,
        metavar="FILE",
        help="a Jinja chat template to use instead of the checkpoint's (e.g. so that a base model or a "
        "GGUF without one can serve chat)",
    )
    api.add_argument(
        "--responses-store",
        type=int_at_least(0),
        default=64,
        metavar="N",
        help="/v1/responses replies kept in memory for previous_response_id and GET /v1/responses/{id} "
        "(the oldest dropped first; each holds its conversation, images included; 0 keeps none) "
        "(default: 64)",
    )


def add_limit_flags(serve) -> None:
    """What one request (and the server) may take on: the flags of the limits group."""
    limits = serve.add_argument_group(
        "limits", "what one request may ask; checked before the work (a 413 or a 400 naming the limit)"
    )
    limits.add_argument(
        "--max-request-bytes",
        type=int_at_least(1),
        default=8 * MiB,
        help="largest request body, refused with 413 before it is read (default: 8 MiB)",
    )
    limits.add_argument(
        "--max-media-per-request",
        type=int_at_least(0),
        default=16,
        help="images, audio clips and videos in one request (default: 16)",
    )
    limits.add_argument(
        "--max-image-pixels",
        type=int_at_least(1),
        default=4096 * 4096,
        help="pixels of one image, from its header before decoding (default: 4096*4096)",
    )
    limits.add_argument(
        "--max-request-pixels",
        type=int_at_least(1),
        default=4 * 4096 * 4096,
        help="pixels of all the images of one request (default: 4*4096*4096)",
    )
    limits.add_argument(
        "--max-audio-seconds",
        type=float_where(lambda x: x >= 0, "at least 0"),
        default=120.0,
        help="seconds of audio in one request, each clip counted up to the 30 s the model hears (default: 120)",
    )
    limits.add_argument(
        "--max-video-bytes",
        type=int_at_least(1),
        default=64 * MiB,
        help="bytes of one video file (default: 64 MiB)",
    )
    limits.add_argument(
        "--max-video-seconds",
        type=float_where(lambda x: x >= 0, "at least 0"),
        default=600.0,
        help="length of one video, from its header before decoding (default: 600)",
    )
    limits.add_argument(
        "--max-video-pixels",
        type=int_at_least(1),
        default=1 << 26,
        help="pixels of a video's sampled frames, decoded (default: 2^26)",
    )
    limits.add_argument(
        "--video-decode-timeout",
        type=float_where(lambda x: x > 0, "positive"),
        default=60.0,
        help="seconds one video's decoding may take (default: 60)",
    )
    limits.add_argument(
        "--prepare-threads",
        type=int_at_least(1),
        default=2,
        help="requests tokenized and their media decoded at once, off the event loop (default: 2)",
    )
    limits.add_argument(
        "--max-connections",
        type=int_at_least(1),
        default=256,
        help="open connections; beyond them a connection is answered 503 and closed (default: 256)",
    )
    limits.add_argument(
        "--timeout-keep-alive",
        type=float_where(lambda x: x > 0, "positive"),
        default=5.0,
        help="seconds an idle kept-alive connection stays open (default: 5)",
    )
    limits.add_argument(
        "--header-timeout",
        type=float_where(lambda x: x > 0, "positive"),
        default=10.0,
        help="seconds a connection may take to send a request's headers before it is closed (default: 10)",
    )


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
    from ..serving.connections import header_timeout_protocol

    api_key = read_api_key(args)
    allowed_hosts = allowed_host_names(args)
    allowed_origins = [origin.strip() for origin in (args.allowed_origins or "").split(",") if origin.strip()]
    if args.allowed_origins is not None and not allowed_origins:
        raise CLIError("--allowed-origins is empty (give '*' to allow any origin)")
    template = read_template(args.chat_template) if args.chat_template else None
    llm = load_llm(args)
    engine = parallel_engine(args, llm)
    if engine is False:  # a follower rank: it ran rank 0's steps until the server stopped
        return 0
    if template is not None:
        llm.tokenizer.chat_template = template
    name = args.served_model_name or str(args.model)
    limits = limits_of(args)
    app = create_app(
        llm,
        model_name=name,
        max_waiting=args.max_waiting,
        api_key=api_key,
        limits=limits,
        allowed_hosts=allowed_hosts,
        log_prompts=args.log_prompts,
        allowed_origins=allowed_origins or None,
        responses_store=args.responses_store,
        engine=engine,
        **engine_settings(args),
    )
    # One line per request on stderr (serving/metrics.py: RequestLog).
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s %(message)s"))
    request_log = logging.getLogger("torchgemma.serving")
    request_log.addHandler(handler)
    request_log.setLevel(logging.INFO)
    request_log.propagate = False
    print(
        f"torchgemma serve: {name} at http://{args.host}:{args.port}/v1 "
        f"({args.max_batch_size} slots of {args.max_len} tokens; chat page at http://{args.host}:{args.port}/)",
        flush=True,
    )
    # uvicorn stops cleanly on Ctrl-C and SIGTERM (the app's shutdown stops the engine thread), then
    # re-raises the signal to the handler it found: SIGTERM then ends the process with status 0.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
        uvicorn.run(
            app,
            host=args.host,
            port=args.port,
            log_level="warning",
            # Beyond this many open connections (or running requests) uvicorn answers 503.
            limit_concurrency=args.max_connections,
            timeout_keep_alive=args.timeout_keep_alive,
            http=header_timeout_protocol(args.header_timeout),
        )
    finally:
        if engine is not None:  # the follower ranks return once the server has stopped
            engine.close()
    return 0


def engine_settings(args: argparse.Namespace) -> dict:
    """The flags that shape the server's engine, as ``serving.state.server_engine``'s keywords: the
    one list both paths pass (``create_app`` in one process, ``parallel_engine`` on every rank), so
    that no flag reaches one and not the other. Speculative decoding travels in the ``LLM``."""
    return dict(
        max_batch_size=args.max_batch_size,
        max_len=args.max_len,
        prefill_chunk=args.prefill_chunk,
        prefix_cache_gb=args.prefix_cache_gb,
    )


def parallel_engine(args: argparse.Namespace, llm):
    """Under --tensor-parallel-size: rank 0's ``LeaderEngine`` for the server, or False on the other
    ranks once they have followed it to the end (``generation/ranks.py``); None without it."""
    from ..distributed import is_leader

    if args.tensor_parallel_size == 1 and not args.expert_parallel:
        return None
    from ..generation.ranks import LeaderEngine, follow
    from ..serving.state import server_engine

    engine = server_engine(llm, **engine_settings(args))
    if is_leader():
        return LeaderEngine(engine)
    follow(engine)
    return False


def read_api_key(args: argparse.Namespace) -> str | None:
    """The key from --api-key, --api-key-file (its first line) or $TORCHGEMMA_API_KEY, in that
    order; at most one of the two flags."""
    if args.api_key is not None and args.api_key_file is not None:
        raise CLIError("give --api-key or --api-key-file, not both")
    if args.api_key is not None:
        key = args.api_key
    elif args.api_key_file is not None:
        try:
            text = args.api_key_file.expanduser().read_text(encoding="utf-8")
        except OSError as error:
            raise CLIError(
                f"cannot read --api-key-file {str(args.api_key_file)!r}: {error.strerror}"
            ) from error
        key = text.splitlines()[0].strip() if text.strip() else ""
        if not key:
            raise CLIError(f"--api-key-file {str(args.api_key_file)!r} is empty")
    else:
        key = os.environ.get(API_KEY_ENV) or None
    if key is not None and not key.strip():
        raise CLIError("the API key is empty")
    return key


def allowed_host_names(args: argparse.Namespace) -> list[str] | None:
    """--allowed-hosts as a list; by default the loopback names when bound to loopback, else None
    (any name: behind a public name or a proxy, the operator says which)."""
    if args.allowed_hosts is not None:
        names = [name.strip() for name in args.allowed_hosts.split(",") if name.strip()]
        if not names:
            raise CLIError("--allowed-hosts is empty (give '*' to allow any host name)")
        return None if "*" in names else names
    from ..serving.app import LOOPBACK_HOSTS

    return list(LOOPBACK_HOSTS) if args.host.strip("[]") in LOOPBACK_BINDS else None


def limits_of(args: argparse.Namespace):
    """The ``serving.limits.Limits`` the limit flags ask for (their names are its fields')."""
    from ..serving.limits import Limits

    return Limits(**{field.name: getattr(args, field.name) for field in dataclasses.fields(Limits)})
