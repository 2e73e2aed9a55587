"""From a prepared request to OpenAI's reply, streamed or whole: shared by chat and text completions.

A request's tokens become text through its own stream decoder, then Gemma's reply format becomes
OpenAI's fields (``replies.ReplyStream``: content, reasoning_content, tool_calls), then user stop
strings cut the content (``replies.StopStrings``). Streaming and non-streaming responses run the same
pipeline (``generate``); a non-streaming response is the streamed deltas joined (``collect``).

While a request runs, a task waits for its connection to close, whatever the token rate: a client
that went away frees its slot at once, streaming or not. Tokens that arrived together (the event
loop fell behind the engine) are handled in one pass and their text sent as one chunk.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request
from fastapi.responses import StreamingResponse

from ..replies import Delta, ReplyStream, StopStrings
from .errors import APIError
from .metrics import log_request
from .runner import Busy, Token
from .state import ServerState

DISCONNECT_POLL_SECONDS = 0.2
# Put in a request's token queue when its client went away.
DISCONNECTED = object()


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
    # The reply's id (chatcmpl-..., cmpl-...), set by respond(): its chunks' and the log line's.
    ident: str = ""
    # Set as the reply runs, for usage and the request log: prompt tokens taken from the prefix
    # cache, tokens generated (once the reply ended), when the first and last tokens arrived
    # (perf_counter), and why it ended.
    cached_tokens: int = 0
    completion_tokens: int | None = None
    first_token_at: float | None = None
    last_token_at: float | None = None
    finish_reason: str | None = None


@dataclass
class Outcome:
    """What a finished generation produced, accumulated from its deltas."""

    content: list[str] = field(default_factory=list)
    reasoning: list[str] = field(default_factory=list)
    tool_calls: list[dict] = field(default_factory=list)
    logprobs: list[dict] = field(default_factory=list)
    tokens: int = 0
    finish_reason: str = "stop"


class RawText:
    """The parser's interface for raw completions: every piece is content, as decoded."""

    stopped = False

    def push(self, piece: str) -> list[Delta]:
        return [Delta("content", piece)] if piece else []

    def finish(self) -> list[Delta]:
        return []


# ── the token-to-delta loop ─────────────────────────────────────────────────────────────────


async def generate(
    state: ServerState, request: Request | None, prepared: Prepared
) -> AsyncIterator[tuple[str, Any]]:
    """("content" | "reasoning", text), ("tool_call", OpenAI dict), ("logprob", entry), and last
    ("finish", (finish_reason, completion tokens)). ``request``, when given, is watched for the
    client going away."""
    runner = state.runner
    try:
        request_id, tokens = runner.submit(prepared.input_ids, **prepared.engine_args)
    except Busy as error:
        raise APIError(503, f"the server is busy: {error}; retry shortly") from error
    watcher = None
    if request is not None:
        watcher = asyncio.create_task(watch_disconnect(state, request, tokens, request_id))
    decoder = state.tokenizer.stream_decoder()
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
        finished = False
        while not finished:
            # Every token already delivered is handled in one pass, and its text leaves as one
            # event (one chunk, one write): a loop that fell behind catches up in fewer, larger
            # bursts instead of one per token.
            batch = [await tokens.get()]
            while not tokens.empty():
                batch.append(tokens.get_nowait())
            prepared.last_token_at = time.perf_counter()
            if prepared.first_token_at is None:
                prepared.first_token_at = prepared.last_token_at
            events: list[tuple[str, Any]] = []
            for token in batch:
                if token is DISCONNECTED:
                    raise asyncio.CancelledError
                if token is None:
                    finished = True
                    break
                if isinstance(token, Exception):
                    for event in _merged(events):  # what came before the failure is the client's
                        yield event
                    raise APIError(400 if isinstance(token, ValueError) else 500, str(token))
                if count == 0:
                    prepared.cached_tokens = token.cached_tokens
                count += 1
                if prepared.logprobs and token.logprobs is not None:
                    events.append(("logprob", logprob_entry(state, token)))
                piece = (
                    "" if token.finished and token.finish_reason == "stop" else decoder.push(token.token_id)
                )
                events += convert(parser.push(piece))
                if token.finished:
                    reason = token.finish_reason or "stop"
                    finished = True
                    break
                if done or parser.stopped:
                    runner.abort(request_id)
                    reason = "stop"
                    finished = True
                    break
            for event in _merged(events):
                yield event
        tail = "" if done else decoder.flush()
        for event in convert(parser.push(tail) + parser.finish()):
            yield event
        if not done:
            text = stops.finish()
            if text:
                yield "content", text
        prepared.completion_tokens = count
        prepared.finish_reason = "tool_calls" if tool_calls else reason
        yield "finish", (prepared.finish_reason, count)
    except (asyncio.CancelledError, GeneratorExit):
        runner.abort(request_id)
        raise
    finally:
        if watcher is not None:
            watcher.cancel()


def _merged(events: list[tuple[str, Any]]) -> list[tuple[str, Any]]:
    """``events`` with each run of content (or of reasoning) joined into one event."""
    merged: list[tuple[str, Any]] = []
    for kind, value in events:
        if merged and kind in ("content", "reasoning") and merged[-1][0] == kind:
            merged[-1] = (kind, merged[-1][1] + value)
        else:
            merged.append((kind, value))
    return merged


async def watch_disconnect(state: ServerState, request: Request, tokens: asyncio.Queue, request_id) -> None:
    """Until cancelled (the request ended): wait for the client's connection to close, whatever the
    token rate (tokens may keep coming for a client long gone); once it is gone, abort the request
    and wake its reader.

    The server says so by answering ``receive()`` with ``http.disconnect`` (the body has been read:
    nothing else can come), so the wait costs nothing while the request runs; a server that answered
    otherwise is asked again every ``DISCONNECT_POLL_SECONDS``. (Polling ``request.is_disconnected()``
    on a timer instead cost each running request ~0.1 ms of the event loop five times a second, in
    Python, holding the GIL the engine thread needs.)"""
    while True:
        message = await request.receive()
        if message.get("type") == "http.disconnect":
            state.runner.abort(request_id)
            tokens.put_nowait(DISCONNECTED)
            return
        await asyncio.sleep(DISCONNECT_POLL_SECONDS)


def logprob_entry(state: ServerState, token: Token) -> dict:
    lp = token.logprobs

    def described(token_id: int, logprob: float) -> dict:
        text = state.tokenizer.decode([token_id])
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    return {**described(lp.token_id, lp.logprob), "top_logprobs": [described(t, v) for t, v in lp.top]}


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


async def respond(
    state: ServerState, request: Request | None, body, prepared: Prepared, *, chat: bool, whole
) -> dict | StreamingResponse:
    """A prepared chat or text completion's reply, logged: a stream of chunks when ``body.stream``,
    else ``whole(state, outcome, prepared)`` once the generation is done."""
    prepared.ident = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
    log_request(request, prepared)
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return await stream_response(state, request, prepared, chat=chat, include_usage=include_usage)
    outcome = await collect(state, request, prepared, "chat" if chat else "completion")
    return whole(state, outcome, prepared)


# ── whole replies ───────────────────────────────────────────────────────────────────────────


async def collect(state: ServerState, request: Request | None, prepared: Prepared, endpoint: str) -> Outcome:
    outcome = Outcome()
    async for kind, value in generate(state, request, prepared):
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
    state.metrics.requests.labels(endpoint, outcome.finish_reason).inc()
    return outcome


def whole_reply(
    state: ServerState, prefix: str, kind: str, choice: dict, prepared: Prepared, tokens: int
) -> dict:
    """A non-streamed reply: one choice, with the id, model, fingerprint and usage around it."""
    return {
        "id": prepared.ident or f"{prefix}-{uuid.uuid4().hex}",
        "object": kind,
        "created": int(time.time()),
        "model": state.model_name,
        "system_fingerprint": state.fingerprint,
        "choices": [choice],
        "usage": usage(prepared, tokens),
    }


def usage(prepared: Prepared, tokens: int) -> dict:
    """OpenAI's usage object; ``prompt_tokens_details.cached_tokens``: the prompt tokens the prefix
    cache held (counted in ``prompt_tokens`` too, as OpenAI counts them)."""
    prompt = len(prepared.input_ids)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": tokens,
        "total_tokens": prompt + tokens,
        "prompt_tokens_details": {"cached_tokens": prepared.cached_tokens},
    }


# ── server-sent events ──────────────────────────────────────────────────────────────────────


async def stream_response(
    state: ServerState, request: Request | None, prepared: Prepared, *, chat: bool, include_usage: bool
) -> StreamingResponse:
    """The reply as server-sent events; errors before the first token are raised, not streamed."""
    events = stream_chunks(state, request, prepared, chat=chat, include_usage=include_usage)
    first = await anext(events)
    return StreamingResponse(_prepend(first, events), media_type="text/event-stream")


class ChunkWriter:
    """One response's ``data:`` lines: chat.completion.chunk or text_completion objects.

    Every chunk of a response has the same id, object, created time, model and fingerprint (as
    OpenAI's do): they are rendered once, and each chunk encodes only its choice."""

    def __init__(self, state: ServerState, chat: bool, ident: str = ""):
        self.state, self.chat = state, chat
        self.ident = ident or (f"chatcmpl-{uuid.uuid4().hex}" if chat else f"cmpl-{uuid.uuid4().hex}")
        self.kind = "chat.completion.chunk" if chat else "text_completion"
        head = {
            "id": self.ident,
            "object": self.kind,
            "created": int(time.time()),
            "model": state.model_name,
            "system_fingerprint": state.fingerprint,
        }
        self._head = json.dumps(head, ensure_ascii=False)[:-1]  # the object left open for "choices"

    def __call__(
        self, delta: dict | None = None, finish: str | None = None, logprobs=None, choices=True
    ) -> str:
        if not choices:
            return f'data: {self._head}, "choices": []}}\n\n'
        if self.chat:
            choice = {"index": 0, "delta": delta or {}, "logprobs": logprobs, "finish_reason": finish}
        else:
            choice = {
                "index": 0,
                "text": (delta or {}).get("content", ""),
                "logprobs": logprobs,
                "finish_reason": finish,
            }
        return f'data: {self._head}, "choices": [{json.dumps(choice, ensure_ascii=False)}]}}\n\n'


async def stream_chunks(
    state: ServerState, request: Request | None, prepared: Prepared, *, chat: bool, include_usage: bool
) -> AsyncIterator[str]:
    """Server-sent events: one chunk per delta, the finish chunk, the usage chunk, [DONE]."""
    chunk = ChunkWriter(state, chat, prepared.ident)
    events = generate(state, request, prepared)
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
        state.metrics.requests.labels(endpoint, "error").inc()
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
    state.metrics.requests.labels(endpoint, finish).inc()
    yield chunk({}, finish)
    if include_usage:
        body = json.loads(chunk(choices=False)[len("data: ") :])
        body["usage"] = usage(prepared, outcome_tokens)
        yield f"data: {json.dumps(body)}\n\n"
    yield "data: [DONE]\n\n"


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
