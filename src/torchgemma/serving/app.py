"""The OpenAI-compatible HTTP API over one model: FastAPI handlers around the engine runner.

    POST /v1/chat/completions   messages (text, images, audio), tools, thinking, streaming
    POST /v1/completions        a raw prompt
    POST /v1/audio/transcriptions   an uploaded clip (checkpoints with an audio tower)
    GET  /v1/models  /health  /metrics  /   (the last: a chat page)

A request's tokens become text through its own stream decoder, then Gemma's reply format becomes
OpenAI's fields (``parsing.ReplyStream``: content, reasoning_content, tool_calls), then user stop
strings cut the content (``parsing.StopStrings``). Streaming and non-streaming responses run the same
pipeline; a non-streaming response is the streamed deltas joined. Errors have OpenAI's shape.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import hashlib
import hmac
import io
import json
import re
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from importlib import resources
from types import SimpleNamespace
from typing import Annotated, Any

from fastapi import FastAPI, File, Form, Request, UploadFile
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from .. import __version__
from ..embedding import token_counts
from ..generation.constraints import JSONObject
from ..generation.engine import Engine
from ..llm import LLM
from ..processing.audio import decode_wav
from ..tokenizer import UnknownTokenError
from .metrics import Metrics
from .parsing import Delta, ReplyStream, StopStrings
from .protocol import ChatCompletionRequest, CompletionRequest, EmbeddingRequest, Message
from .runner import Busy, EngineRunner, Token

# How long a client is told to wait when the waiting room is full.
RETRY_AFTER_SECONDS = 2
TRANSCRIBE_PROMPT = "Transcribe this audio."
# At most this many tokens per transcript (Whisper's cap; 30 s of speech needs far fewer).
TRANSCRIPTION_MAX_TOKENS = 448
TOOL_NAME = re.compile(r"[A-Za-z0-9_.\-]{1,64}")


class APIError(Exception):
    """An error answered in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def response(self, headers: dict[str, str] | None = None) -> JSONResponse:
        kind = {
            400: "invalid_request_error",
            401: "authentication_error",
            404: "not_found_error",
            503: "server_busy",
        }.get(self.status, "server_error")
        body = {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}
        return JSONResponse(body, status_code=self.status, headers=headers)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


@dataclass
class Prepared:
    """A request, checked and turned into what the engine takes."""

    input_ids: list[int]
    engine_args: dict[str, Any]
    stops: list[str]
    tools: bool = False
    # Text forced at the start of the reply (tool_choice), fed to the parser before any token.
    prefix: str = ""
    logprobs: bool = False
    # Raw text (completions): no reply parsing, special tokens kept as the model wrote them.
    raw: bool = False
    # completions with echo: the prompt's text, given back before the completion.
    echo: str = ""


@dataclass
class Outcome:
    """What a finished generation produced, accumulated from its deltas."""

    content: list[str] = field(default_factory=list)
    reasoning: list[str] = field(default_factory=list)
    tool_calls: list[dict] = field(default_factory=list)
    logprobs: list[dict] = field(default_factory=list)
    tokens: int = 0
    finish_reason: str = "stop"


def create_app(
    llm: LLM,
    *,
    model_name: str,
    max_batch_size: int = 8,
    max_len: int = 4096,
    max_waiting: int = 64,
    api_key: str | None = None,
    prefill_chunk: int = 512,
    engine: Engine | None = None,
) -> FastAPI:
    """The server's application: ``uvicorn.run(create_app(llm, model_name=...))``.

    ``engine`` replaces the one built from ``llm.model`` (anything with ``Engine``'s methods: tests
    script model outputs this way); its ``max_len`` then sets the limit.
    """
    tokenizer = llm.tokenizer
    if engine is None:
        engine = Engine(
            llm.model,
            max_batch_size=max_batch_size,
            max_len=max_len,
            prefill_chunk=prefill_chunk,
            generation_config=llm.generation_config,
        )
    max_len = engine.max_len
    state: dict[str, Any] = {}
    metrics = Metrics(lambda: state["runner"].running, lambda: state["runner"].waiting)
    state["runner"] = runner = EngineRunner(engine, max_waiting=max_waiting, metrics=metrics)
    config = llm.model.config
    fingerprint = (
        "fp_"
        + hashlib.sha256(
            f"{__version__}|{model_name}|{llm.model.dtype}|{llm.model.attention}".encode()
        ).hexdigest()[:10]
    )
    created = int(time.time())
    try:
        turn_end = [tokenizer.turn_end_id]
    except UnknownTokenError:
        turn_end = []
    chat_stops = list(dict.fromkeys([*llm.generation_config.eos_token_ids, *turn_end]))

    app = FastAPI(title="torchgemma", version=__version__, docs_url=None, redoc_url=None)
    app.state.runner = runner
    app.state.metrics = metrics

    @app.on_event("shutdown")
    def _close() -> None:
        runner.close()

    # ── errors and authentication ───────────────────────────────────────────────────────────

    @app.exception_handler(APIError)
    async def _api_error(request: Request, error: APIError):
        headers = {"Retry-After": str(RETRY_AFTER_SECONDS)} if error.status == 503 else None
        return error.response(headers)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, error: RequestValidationError):
        first = error.errors()[0] if error.errors() else {}
        if first.get("type") == "json_invalid":
            return bad_request(f"the request body is not valid JSON: {first.get('msg', '')}").response()
        location = [str(part) for part in first.get("loc", ()) if part != "body"]
        param = ".".join(location) or None
        return bad_request(f"{param or 'request'}: {first.get('msg', 'invalid value')}", param).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, error: StarletteHTTPException):
        return APIError(error.status_code, str(error.detail)).response()

    @app.middleware("http")
    async def _authenticate(request: Request, call_next):
        # The health check and the (static) chat page stay open; the page sends the key itself.
        open_paths = ("/health", "/", "/favicon.ico")
        given = request.headers.get("authorization", "")
        if (
            api_key is not None
            and request.url.path not in open_paths
            and not hmac.compare_digest(given.encode(), f"Bearer {api_key}".encode())
        ):
            return APIError(401, "missing or wrong API key (send Authorization: Bearer KEY)").response()
        return await call_next(request)

    # ── small endpoints ──────────────────────────────────────────────────────────────────────

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        entry = {"id": model_name, "object": "model", "created": created, "owned_by": "torchgemma"}
        return {"object": "list", "data": [entry]}

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/favicon.ico")
    async def favicon():
        return Response(status_code=204)

    @app.get("/", response_class=HTMLResponse)
    async def chat_page():
        return resources.files("torchgemma.serving").joinpath("static/chat.html").read_text(encoding="utf-8")

    # ── chat ─────────────────────────────────────────────────────────────────────────────────

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        check_model(body.model)
        prepared = prepare_chat(body)
        return await respond(request, body, prepared, chat=True)

    def prepare_chat(body: ChatCompletionRequest) -> Prepared:
        refuse_unsupported(body)
        if tokenizer.chat_template is None:
            raise bad_request(
                "this checkpoint has no chat template (a base model): use /v1/completions with a raw prompt",
                "messages",
            )
        thinking = bool(body.chat_template_kwargs and body.chat_template_kwargs.enable_thinking)
        if body.reasoning_effort is not None:
            thinking = body.reasoning_effort != "none"
        if body.response_format is not None and body.response_format.type == "json_object":
            thinking = False  # the JSON constraint starts at the first generated token
        choice = body.tool_choice or ("auto" if body.tools else "none")
        tools = [tool.function.model_dump(exclude_none=True) for tool in body.tools or []]
        for tool in tools:
            # A name is written into the prompt as it is (and forced after `call:`): no room for
            # control tokens or delimiters. OpenAI's rule, plus '.', which Gemma's parser accepts.
            if not TOOL_NAME.fullmatch(tool["name"]):
                raise bad_request(
                    f"tool name {tool['name']!r} must be 1-64 letters, digits, '_', '-' or '.'", "tools"
                )
        if choice != "none" and not tools:
            raise bad_request(f"tool_choice {choice!r} needs tools", "tool_choice")
        prefix = ""
        if choice == "required":
            prefix = "<|tool_call>call:"
        elif not isinstance(choice, str):
            name = choice.function.get("name", "")
            if name not in {tool["name"] for tool in tools}:
                raise bad_request(f"tool_choice names {name!r}, which is not among the tools", "tool_choice")
            prefix = f"<|tool_call>call:{name}{{"
        messages, images, audio = template_messages(body.messages)
        try:
            # Clients are untrusted: control tokens typed in any message, tool or result stay text.
            ids = tokenizer.apply_chat_template(
                messages,
                add_generation_prompt=True,
                enable_thinking=thinking,
                tools=tools if choice != "none" else None,
                sanitize_control_tokens=True,
                chat_template=llm.chat_template_for(audio, tools if choice != "none" else None),
            )
        except Exception as error:  # noqa: BLE001 - the template's own message says what is wrong
            raise bad_request(f"the chat template rejected the messages: {error}", "messages") from error
        if prefix:
            ids = ids + tokenizer.encode(prefix, add_special_tokens=False)
        # (After the template: placeholders are expanded below and the limit checked on the result.)
        if images or audio:
            try:
                inputs = llm.inputs([ids], images, audio)
            except (ValueError, OSError) as error:
                raise bad_request(str(error), "messages") from error
            real = inputs["attention_mask"][0].bool()
            ids = inputs["input_ids"][0][real].tolist()
            media = {
                name: inputs[name]
                for name in ("pixel_values", "image_position_ids", "input_features", "input_features_mask")
                if name in inputs
            }
            if "mm_token_type_ids" in inputs:
                media["mm_token_type_ids"] = inputs["mm_token_type_ids"][0][real]
        else:
            media = {}
        max_tokens = body.max_completion_tokens or body.max_tokens
        engine_args = sampling_args(body, len(ids), max_tokens, chat_stops)
        engine_args.update(media)
        if body.response_format is not None and body.response_format.type == "json_object":
            if prefix:
                raise bad_request("a JSON object reply cannot also be a forced tool call", "response_format")
            # Every token must keep the reply a valid prefix of a JSON object (generation/constraints.py).
            engine_args["constraint"] = JSONObject(tokenizer.token_bytes, chat_stops)
        if body.logprobs:
            engine_args["logprobs"] = body.top_logprobs or 0
        return Prepared(
            ids,
            engine_args,
            stop_list(body.stop),
            tools=choice != "none",
            prefix=prefix,
            logprobs=body.logprobs,
        )

    def template_messages(messages: Sequence[Message]) -> tuple[list[dict], list, list]:
        """OpenAI messages -> the template's: content items with decoded media, tool calls with
        dict arguments, tool results named after the call they answer."""
        call_names: dict[str, str] = {}
        out, images, audio = [], [], []
        for index, message in enumerate(messages):
            entry: dict[str, Any] = {"role": message.role}
            if isinstance(message.content, list):
                items = []
                for part_index, part in enumerate(message.content):
                    where = f"messages.{index}.content.{part_index}"
                    if part.type == "text":
                        items.append({"type": "text", "text": part.text or ""})
                    elif part.type == "image_url" and part.image_url is not None:
                        image = decode_image(part.image_url.url, where)
                        images.append(image)
                        items.append({"type": "image", "image": image})
                    elif part.type == "input_audio" and part.input_audio is not None:
                        clip = decode_audio(part.input_audio.data, part.input_audio.format, where)
                        audio.append(clip)
                        items.append({"type": "audio", "audio": clip})
                    else:
                        raise bad_request(f"unsupported content part of type {part.type!r}", where)
                entry["content"] = items
            else:
                entry["content"] = message.content or ""
            if message.tool_calls:
                calls = []
                for call in message.tool_calls:
                    arguments = call.function.arguments
                    if isinstance(arguments, str):
                        try:
                            arguments = json.loads(arguments or "{}")
                        except json.JSONDecodeError as error:
                            raise bad_request(
                                f"tool call arguments are not JSON: {error}", f"messages.{index}.tool_calls"
                            ) from error
                    if call.id:
                        call_names[call.id] = call.function.name
                    calls.append(
                        {"type": "function", "function": {"name": call.function.name, "arguments": arguments}}
                    )
                entry["tool_calls"] = calls
            if message.role == "tool":
                entry["name"] = message.name or call_names.get(message.tool_call_id or "", "tool")
                content = entry["content"]
                if isinstance(content, list):
                    entry["content"] = "".join(item.get("text", "") for item in content)
            out.append(entry)
        return out, images, audio

    # ── completions ──────────────────────────────────────────────────────────────────────────

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        check_model(body.model)
        refuse_unsupported(body)
        if isinstance(body.prompt, str):
            ids = llm.encode(body.prompt)  # <bos> first, as a raw prompt to LLM.generate
        else:
            ids = list(body.prompt)
        if not ids:
            raise bad_request("the prompt is empty", "prompt")
        vocab = llm.model.config.text.vocab_size
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise bad_request(f"prompt token {bad} is outside the vocabulary [0, {vocab})", "prompt")
        engine_args = sampling_args(body, len(ids), body.max_tokens, None)
        if body.logprobs is not None:
            engine_args["logprobs"] = body.logprobs
        prepared = Prepared(
            ids, engine_args, stop_list(body.stop), logprobs=body.logprobs is not None, raw=True
        )
        if body.echo:
            prepared.echo = body.prompt if isinstance(body.prompt, str) else tokenizer.decode(ids)
        return await respond(request, body, prepared, chat=False)

    # ── transcription ────────────────────────────────────────────────────────────────────────

    @app.post("/v1/audio/transcriptions")
    async def transcriptions(
        request: Request,
        file: Annotated[UploadFile, File()],
        model: Annotated[str | None, Form()] = None,
        prompt: Annotated[str | None, Form()] = None,
        language: Annotated[str | None, Form()] = None,
        response_format: Annotated[str, Form()] = "json",
        temperature: Annotated[float, Form()] = 0.0,
    ):
        check_model(model)
        if not llm.takes_audio:
            raise APIError(404, "this checkpoint has no audio tower: it cannot transcribe", param="model")
        if response_format not in ("json", "text"):
            raise bad_request("response_format must be 'json' or 'text'", "response_format")
        clip = decode_wav_upload(await file.read())
        instruction = prompt or TRANSCRIBE_PROMPT
        if language:
            instruction += f" The speech is in {language}."
        sampling = SimpleNamespace(
            temperature=temperature, top_k=None, top_p=None, min_p=None, repetition_penalty=None, seed=None
        )
        messages = [
            {
                "role": "user",
                "content": [{"type": "audio", "audio": clip}, {"type": "text", "text": instruction}],
            }
        ]
        ids = tokenizer.apply_chat_template(
            messages,
            add_generation_prompt=True,
            sanitize_control_tokens=True,
            chat_template=llm.chat_template_for([clip]),
        )
        try:
            inputs = llm.inputs([ids], [], [clip])
        except ValueError as error:  # e.g. samples that are not finite
            raise bad_request(f"file: {error}", "file") from error
        real = inputs["attention_mask"][0].bool()
        ids = inputs["input_ids"][0][real].tolist()
        room = min(max_len, config.text.max_position_embeddings) - len(ids)
        engine_args = sampling_args(sampling, len(ids), min(TRANSCRIPTION_MAX_TOKENS, room), chat_stops)
        engine_args.update(
            input_features=inputs["input_features"], input_features_mask=inputs["input_features_mask"]
        )
        if "mm_token_type_ids" in inputs:  # (Gemma 3n's processor has none)
            engine_args["mm_token_type_ids"] = inputs["mm_token_type_ids"][0][real]
        outcome = await collect(request, Prepared(ids, engine_args, [], tools=False), "transcription")
        text = "".join(outcome.content).strip()
        return PlainTextResponse(text) if response_format == "text" else {"text": text}

    # ── embeddings ───────────────────────────────────────────────────────────────────────────

    # One embedding batch at a time, off the event loop; generation keeps its own engine thread.
    embedding_lock = asyncio.Lock()

    @app.post("/v1/embeddings")
    async def embeddings(body: EmbeddingRequest):
        check_model(body.model)
        if not llm.has_sentence_head:
            raise APIError(
                404,
                "this checkpoint has no sentence-transformers modules (modules.json): it cannot embed",
                param="model",
            )
        texts = [body.input] if isinstance(body.input, str) else body.input
        if not texts:
            raise bad_request("input is empty", "input")
        if not all(isinstance(text, str) for text in texts):
            raise bad_request("input must be text (a string or a list of strings), not token ids", "input")
        head = llm.sentence_head
        if body.dimensions is not None and not 0 < body.dimensions <= head.dimension:
            raise bad_request(f"dimensions must be in 1..{head.dimension}", "dimensions")
        try:
            counts = token_counts(llm.tokenizer, head, texts, prompt_name=body.prompt_name)
            async with embedding_lock:
                vectors = await asyncio.to_thread(
                    llm.embed, texts, prompt_name=body.prompt_name, truncate_dim=body.dimensions
                )
        except ValueError as error:  # an unknown prompt_name, a text with no tokens
            raise bad_request(str(error), "input") from error
        vectors = vectors.float().cpu()
        data = []
        for index, vector in enumerate(vectors):
            if body.encoding_format == "base64":
                embedding: Any = base64.b64encode(vector.numpy().astype("<f4").tobytes()).decode()
            else:
                embedding = vector.tolist()
            data.append({"object": "embedding", "index": index, "embedding": embedding})
        usage = {"prompt_tokens": sum(counts), "total_tokens": sum(counts)}
        return {"object": "list", "data": data, "model": model_name, "usage": usage}

    # ── shared request handling ──────────────────────────────────────────────────────────────

    def check_model(name: str | None) -> None:
        if name not in (None, "", model_name):
            raise APIError(
                404,
                f"model {name!r} is not served here; this server serves {model_name!r}",
                param="model",
                code="model_not_found",
            )

    def refuse_unsupported(body) -> None:
        if body.n not in (None, 1):
            raise bad_request("n > 1 is not supported: send n separate requests", "n")
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(body, name) not in (None, 0, 0.0):
                raise bad_request(f"{name} is not supported; use repetition_penalty", name)
        response_format = getattr(body, "response_format", None)
        if response_format is not None and response_format.type == "json_schema":
            raise bad_request(
                "response_format json_schema is not enforced here; use json_object", "response_format"
            )

    def sampling_args(body, prompt_len: int, max_tokens: int | None, stop_ids) -> dict[str, Any]:
        room = min(max_len, config.text.max_position_embeddings) - prompt_len
        if room <= 0:
            raise bad_request(
                f"the prompt has {prompt_len} tokens; this server's limit is {max_len} tokens of prompt "
                "and reply together",
                "messages",
                "context_length_exceeded",
            )
        if max_tokens is not None and max_tokens > room:
            raise bad_request(
                f"max_tokens={max_tokens} does not fit: the prompt has {prompt_len} tokens and the limit is "
                f"{max_len}, so at most {room} can be generated",
                "max_tokens",
                "context_length_exceeded",
            )
        args: dict[str, Any] = {
            "max_new_tokens": max_tokens or room,
            "temperature": body.temperature,
            "top_k": body.top_k,
            "top_p": body.top_p,
            "min_p": body.min_p,
            "repetition_penalty": body.repetition_penalty,
            "seed": body.seed,
            "stop_token_ids": stop_ids,
        }
        try:
            llm.generation_config.sampling(
                **{k: args[k] for k in ("temperature", "top_k", "top_p", "min_p", "repetition_penalty")}
            )
        except ValueError as error:
            raise bad_request(str(error)) from error
        metrics.prompt_tokens.inc(prompt_len)
        return args

    async def respond(request: Request, body, prepared: Prepared, chat: bool):
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            events = stream_chunks(request, prepared, chat, include_usage)
            first = await anext(events)  # errors before the first token are answered as errors
            return StreamingResponse(_prepend(first, events), media_type="text/event-stream")
        outcome = await collect(request, prepared, "chat" if chat else "completion")
        return chat_response(outcome, prepared) if chat else completion_response(outcome, prepared)

    async def collect(request: Request, prepared: Prepared, endpoint: str) -> Outcome:
        outcome = Outcome()
        async for kind, value in generate(request, prepared):
            if kind == "content":
                outcome.content.append(value)
            elif kind == "reasoning":
                outcome.reasoning.append(value)
            elif kind == "tool_call":
                outcome.tool_calls.append(value)
            elif kind == "logprob":
                outcome.logprobs.append(value)
            elif kind == "finish":
                outcome.finish_reason, outcome.tokens = value
        metrics.requests.labels(endpoint, outcome.finish_reason).inc()
        return outcome

    async def generate(request: Request, prepared: Prepared) -> AsyncIterator[tuple[str, Any]]:
        """("content" | "reasoning", text), ("tool_call", OpenAI dict), ("logprob", entry), and last
        ("finish", (finish_reason, completion tokens))."""
        try:
            request_id, tokens = runner.submit(prepared.input_ids, **prepared.engine_args)
        except Busy as error:
            raise APIError(503, f"the server is busy: {error}; retry shortly") from error
        decoder = tokenizer.stream_decoder()
        parser = RawText() if prepared.raw else ReplyStream(tools=prepared.tools)
        stops = StopStrings(prepared.stops)
        count, reason, done = 0, "stop", False
        tool_calls = 0

        def convert(deltas) -> list[tuple[str, Any]]:
            nonlocal done, tool_calls
            events = []
            for delta in deltas:
                if delta.kind == "tool_call":
                    tool_calls += 1
                    events.append(("tool_call", tool_call_dict(delta.index, delta.tool_call)))
                elif delta.kind == "reasoning":
                    events.append(("reasoning", delta.text))
                elif not done:
                    text, stopped = stops.push(delta.text)
                    if text:
                        events.append(("content", text))
                    done = done or stopped
            return events

        try:
            for event in convert(parser.push(prepared.prefix)) if prepared.prefix else []:
                yield event
            while True:
                token = await next_token(request, tokens, request_id)
                if token is None:
                    break
                if isinstance(token, Exception):
                    raise APIError(400 if isinstance(token, ValueError) else 500, str(token))
                count += 1
                if prepared.logprobs and token.logprobs is not None:
                    yield "logprob", logprob_entry(token)
                piece = (
                    "" if token.finished and token.finish_reason == "stop" else decoder.push(token.token_id)
                )
                for event in convert(parser.push(piece)):
                    yield event
                if token.finished:
                    reason = token.finish_reason or "stop"
                    break
                if done or parser.stopped:
                    runner.abort(request_id)
                    reason = "stop"
                    break
            tail = "" if done else decoder.flush()
            for event in convert(parser.push(tail) + parser.finish()):
                yield event
            if not done:
                text = stops.finish()
                if text:
                    yield "content", text
            yield "finish", ("tool_calls" if tool_calls else reason, count)
        except (asyncio.CancelledError, GeneratorExit):
            runner.abort(request_id)
            raise

    async def next_token(request: Request, tokens: asyncio.Queue, request_id) -> Token | Exception | None:
        # Poll for a disconnected client while waiting: its slot must be freed at once.
        while True:
            try:
                return await asyncio.wait_for(tokens.get(), timeout=0.5)
            except asyncio.TimeoutError:
                if await request.is_disconnected():
                    runner.abort(request_id)
                    raise asyncio.CancelledError from None

    def logprob_entry(token: Token) -> dict:
        lp = token.logprobs

        def described(token_id: int, logprob: float) -> dict:
            text = tokenizer.decode([token_id])
            return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

        return {**described(lp.token_id, lp.logprob), "top_logprobs": [described(t, v) for t, v in lp.top]}

    def chat_response(outcome: Outcome, prepared: Prepared) -> dict:
        content = "".join(outcome.content) or None
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if outcome.reasoning:
            message["reasoning_content"] = "".join(outcome.reasoning)
        if outcome.tool_calls:
            message["tool_calls"] = [
                {k: v for k, v in call.items() if k != "index"} for call in outcome.tool_calls
            ]
        choice = {
            "index": 0,
            "message": message,
            "logprobs": {"content": outcome.logprobs} if prepared.logprobs else None,
            "finish_reason": outcome.finish_reason,
        }
        return response("chatcmpl", "chat.completion", choice, prepared, outcome.tokens)

    def completion_response(outcome: Outcome, prepared: Prepared) -> dict:
        choice = {
            "index": 0,
            "text": prepared.echo + "".join(outcome.content),
            "logprobs": completion_logprobs(outcome.logprobs) if prepared.logprobs else None,
            "finish_reason": outcome.finish_reason,
        }
        return response("cmpl", "text_completion", choice, prepared, outcome.tokens)

    def response(prefix: str, kind: str, choice: dict, prepared: Prepared, tokens: int) -> dict:
        """A non-streamed reply: one choice, with the id, model, fingerprint and usage around it."""
        return {
            "id": f"{prefix}-{uuid.uuid4().hex}",
            "object": kind,
            "created": int(time.time()),
            "model": model_name,
            "system_fingerprint": fingerprint,
            "choices": [choice],
            "usage": usage(prepared, tokens),
        }

    def usage(prepared: Prepared, tokens: int) -> dict:
        prompt = len(prepared.input_ids)
        return {"prompt_tokens": prompt, "completion_tokens": tokens, "total_tokens": prompt + tokens}

    async def stream_chunks(request: Request, prepared: Prepared, chat: bool, include_usage: bool):
        """Server-sent events: one chunk per delta, the finish chunk, the usage chunk, [DONE]."""
        ident = f"chatcmpl-{uuid.uuid4().hex}" if chat else f"cmpl-{uuid.uuid4().hex}"
        kind = "chat.completion.chunk" if chat else "text_completion"

        def chunk(delta: dict | None = None, finish: str | None = None, logprobs=None, choices=True) -> str:
            body: dict[str, Any] = {
                "id": ident,
                "object": kind,
                "created": int(time.time()),
                "model": model_name,
                "system_fingerprint": fingerprint,
            }
            if choices:
                if chat:
                    choice = {"index": 0, "delta": delta or {}, "logprobs": logprobs, "finish_reason": finish}
                else:
                    choice = {
                        "index": 0,
                        "text": (delta or {}).get("content", ""),
                        "logprobs": logprobs,
                        "finish_reason": finish,
                    }
                body["choices"] = [choice]
            else:
                body["choices"] = []
            return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"

        events = generate(request, prepared)
        # Start generating before the response begins, so that a refused request is a plain error.
        first = await anext(events)
        yield chunk({"role": "assistant", "content": ""}) if chat else chunk({"content": prepared.echo})
        pending = [first]
        outcome_tokens, finish = 0, "stop"
        endpoint = "chat" if chat else "completion"
        try:
            async for event in _chain(pending, events):
                name, value = event
                if name == "content":
                    yield chunk({"content": value})
                elif name == "reasoning":
                    yield chunk({"reasoning_content": value})
                elif name == "tool_call":
                    yield chunk({"tool_calls": [value]})
                elif name == "logprob":
                    yield chunk({}, logprobs={"content": [value]} if chat else completion_logprobs([value]))
                elif name == "finish":
                    finish, outcome_tokens = value
        except APIError as error:
            # The response has begun: the error goes in the stream, as OpenAI's API sends it.
            metrics.requests.labels(endpoint, "error").inc()
            body = {
                "error": {
                    "message": error.message,
                    "type": "server_error",
                    "param": error.param,
                    "code": error.code,
                }
            }
            yield f"data: {json.dumps(body)}\n\n"
            yield "data: [DONE]\n\n"
            return
        metrics.requests.labels(endpoint, finish).inc()
        yield chunk({}, finish)
        if include_usage:
            body = json.loads(chunk(choices=False)[len("data: ") :])
            body["usage"] = usage(prepared, outcome_tokens)
            yield f"data: {json.dumps(body)}\n\n"
        yield "data: [DONE]\n\n"

    return app


# ── helpers ──────────────────────────────────────────────────────────────────────────────────


def stop_list(stop: str | list[str] | None) -> list[str]:
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else list(stop)
    if len(stops) > 16:
        raise bad_request("at most 16 stop strings", "stop")
    return [s for s in stops if s]


def tool_call_dict(index: int, call) -> dict:
    return {
        "index": index,
        "id": call.id,
        "type": "function",
        "function": {"name": call.name, "arguments": call.arguments_json()},
    }


def completion_logprobs(entries: list[dict]) -> dict:
    return {
        "tokens": [e["token"] for e in entries],
        "token_logprobs": [e["logprob"] for e in entries],
        "top_logprobs": [{t["token"]: t["logprob"] for t in e["top_logprobs"]} for e in entries],
    }


def decode_image(url: str, where: str):
    from PIL import Image, UnidentifiedImageError

    if not url.startswith("data:"):
        raise bad_request(
            "images are taken as data URLs (data:image/png;base64,...); URLs are not fetched", where
        )
    try:
        header, payload = url.split(",", 1)
        if ";base64" not in header:
            raise ValueError("not base64")
        data = base64.b64decode(payload, validate=True)
        image = Image.open(io.BytesIO(data))
        image.load()
    except (
        ValueError,
        binascii.Error,
        UnidentifiedImageError,
        OSError,
        Image.DecompressionBombError,
    ) as error:
        raise bad_request(f"cannot read the image: {error}", where) from error
    return image


def decode_audio(payload: str, fmt: str, where: str):
    if fmt != "wav":
        raise bad_request(f"input_audio format {fmt!r} is not supported; send wav", where)
    try:
        data = base64.b64decode(payload, validate=True)
    except (ValueError, binascii.Error) as error:
        raise bad_request(f"input_audio data is not base64: {error}", where) from error
    return decode_wav_upload(data, where)


def decode_wav_upload(data: bytes, where: str = "file"):
    try:
        return decode_wav(data)
    except ValueError as error:
        raise bad_request(f"cannot read the audio: {error}", where) from error


class RawText:
    """The parser's interface for raw completions: every piece is content, as decoded."""

    stopped = False

    def push(self, piece: str) -> list[Delta]:
        return [Delta("content", piece)] if piece else []

    def finish(self) -> list[Delta]:
        return []


async def _prepend(first: str, rest: AsyncIterator[str]) -> AsyncIterator[str]:
    if first:
        yield first
    async for item in rest:
        yield item


async def _chain(pending: list, rest: AsyncIterator):
    for item in pending:
        yield item
    async for item in rest:
        yield item
