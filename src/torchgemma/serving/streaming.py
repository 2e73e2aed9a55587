"""From prepared requests to OpenAI's reply, streamed or whole: shared by chat and text completions.

A reply has one or more sequences (OpenAI's ``n``; completions' list of prompts times ``n``), each
run by ``sequences.generate``: the sequences of one prompt share its prefill (the engine forks
it, ``generation/fork.py``). Streaming and non-streaming responses run the same pipeline; a
non-streaming response is the streamed deltas joined (``collect_runs``), a stream interleaves the
sequences' chunks, each with its choice's index.

While a request runs, a task waits for its connection to close, whatever the token rate: a client
that went away frees its slots at once, streaming or not.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import StreamingResponse

from .errors import APIError
from .metrics import log_request
from .runner import Busy
from .sequences import Outcome, Prepared, Run, watch_disconnect
from .sequences import generate as generate_run
from .state import ServerState

__all__ = ["Outcome", "Prepared", "collect", "completion_logprobs", "generate", "respond", "whole_reply"]


def completion_logprobs(entries: list[dict]) -> dict:
    """Completions' logprobs object; ``text_offset``: where each token's text begins in the choice's
    text (a token whose bytes complete a character later begins where that character does)."""
    return {
        "tokens": [e["token"] for e in entries],
        "token_logprobs": [e["logprob"] for e in entries],
        "top_logprobs": [
            None if e["top_logprobs"] is None else {t["token"]: t["logprob"] for t in e["top_logprobs"]}
            for e in entries
        ],
        "text_offset": [e["text_offset"] for e in entries],
    }


async def respond(
    state: ServerState,
    request: Request | None,
    body,
    prepared: Prepared | list[Prepared],
    *,
    chat: bool,
    whole,
) -> dict | StreamingResponse:
    """A prepared chat or text completion's reply (several prompts for completions, each with ``n``
    sequences), logged: a stream of chunks when ``body.stream``, else ``whole(state, outcome,
    prepared)``'s reply per sequence joined into one, once they all ended."""
    prepared = prepared if isinstance(prepared, list) else [prepared]
    ident = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
    for each in prepared:
        each.ident, each.endpoint = ident, "chat" if chat else "completion"
    log_request(request, prepared[0])
    runs = submit(state, prepared)
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return await stream_response(state, request, runs, chat=chat, include_usage=include_usage)
    outcomes = await collect_runs(state, request, runs)
    replies = [whole(state, outcome, run.prepared) for run, outcome in zip(runs, outcomes)]
    reply = replies[0]
    reply["choices"] = [{**each["choices"][0], "index": run.index} for run, each in zip(runs, replies)]
    reply["usage"] = usage(runs)
    return reply


def submit(state: ServerState, prepared: list[Prepared]) -> list[Run]:
    """Every sequence of the reply handed to the engine: per prompt, its ``n`` sequences, the first
    prefilling the prompt and the others forked from it (seeded ones with seeds seed, seed + 1, ...).
    A full waiting room is a 503 (the sequences already queued are withdrawn)."""
    runs: list[Run] = []
    try:
        for each in prepared:
            if each.engine_args.get("max_new_tokens") == 0:  # completions' echo of the prompt alone
                runs += [Run(len(runs), each) for _ in range(each.n)]
                continue
            requests = [each.engine_args]
            for i in range(1, each.n):
                # (A constraint is a Grammar: the engine starts each request's own state of it.)
                args = dict(each.engine_args)
                sampling = args["sampling"]
                if sampling.seed is not None:
                    args["sampling"] = dataclasses.replace(sampling, seed=sampling.seed + i)
                requests.append(args)
            for request_id, tokens in state.runner.submit_fork(each.input_ids, requests):
                runs.append(Run(len(runs), each, request_id, tokens))
    except Busy as error:
        for run in runs:
            if run.tokens is not None:
                state.runner.abort(run.request_id)
        raise APIError(503, f"the server is busy: {error}; retry shortly") from error
    return runs


# ── whole replies ───────────────────────────────────────────────────────────────────────────


async def collect(state: ServerState, request: Request | None, prepared: Prepared, endpoint: str) -> Outcome:
    """One prepared request's sequence, generated and gathered (transcriptions)."""
    prepared.endpoint = endpoint
    return (await collect_runs(state, request, submit(state, [prepared])))[0]


async def collect_runs(state: ServerState, request: Request | None, runs: list[Run]) -> list[Outcome]:
    """Every sequence's outcome, the sequences run concurrently; if one fails, the others are
    aborted and the failure raised."""
    watcher = None if request is None else asyncio.create_task(watch_disconnect(state, request, runs))
    tasks = [asyncio.create_task(_outcome(state, run)) for run in runs]
    try:
        return await asyncio.gather(*tasks)
    finally:
        _stop(tasks, watcher, runs)


async def generate(
    state: ServerState, request: Request | None, prepared: Prepared
) -> AsyncIterator[tuple[str, Any]]:
    """One prepared request's single sequence as events (``sequences.generate``'s), submitted here;
    ``request``, when given, is watched for the client going away. For endpoints that shape their
    own reply from the events."""
    runs = submit(state, [prepared])
    watcher = None if request is None else asyncio.create_task(watch_disconnect(state, request, runs))
    try:
        async for event in generate_run(state, runs[0]):
            yield event
    finally:
        if watcher is not None:
            watcher.cancel()
        _finished(runs)


async def _outcome(state: ServerState, run: Run) -> Outcome:
    outcome = Outcome()
    async for kind, value in generate_run(state, run):
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
    return outcome


def _stop(tasks: list, watcher, runs) -> None:
    """Cancel a reply's tasks and its disconnect watcher, and see its runs finished."""
    for task in tasks:
        task.cancel()
    if watcher is not None:
        watcher.cancel()
    _finished(runs)


def _finished(runs: list[Run]) -> None:
    """The reply's figures for the request log, on its first prompt's ``Prepared``."""
    first = runs[0].prepared
    first.completion_tokens = sum(run.completion_tokens for run in runs)
    first.cached_tokens = runs[0].cached_tokens
    first.finish_reason = runs[0].finish_reason


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
        "usage": usage([Run(0, prepared, completion_tokens=tokens, cached_tokens=prepared.cached_tokens)]),
    }


def usage(runs: list[Run]) -> dict:
    """OpenAI's usage object: each prompt counted once, every sequence's tokens;
    ``prompt_tokens_details.cached_tokens``: the prompt tokens the prefix cache held (counted in
    ``prompt_tokens`` too, as OpenAI counts them)."""
    prompts = {id(run.prepared): run for run in reversed(runs)}.values()  # each prompt's first run
    prompt = sum(len(run.prepared.input_ids) for run in prompts)
    tokens = sum(run.completion_tokens for run in runs)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": tokens,
        "total_tokens": prompt + tokens,
        "prompt_tokens_details": {"cached_tokens": sum(run.cached_tokens for run in prompts)},
    }


# ── server-sent events ──────────────────────────────────────────────────────────────────────


async def stream_response(
    state: ServerState, request: Request | None, runs: list[Run], *, chat: bool, include_usage: bool
) -> StreamingResponse:
    """The reply as server-sent events; errors before the first token are raised, not streamed."""
    events = stream_chunks(state, request, runs, chat=chat, include_usage=include_usage)
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
        self,
        delta: dict | None = None,
        finish: str | None = None,
        logprobs=None,
        choices=True,
        index: int = 0,
    ) -> str:
        if not choices:
            return f'data: {self._head}, "choices": []}}\n\n'
        if self.chat:
            choice = {"index": index, "delta": delta or {}, "logprobs": logprobs, "finish_reason": finish}
        else:
            choice = {
                "index": index,
                "text": (delta or {}).get("content", ""),
                "logprobs": logprobs,
                "finish_reason": finish,
            }
        return f'data: {self._head}, "choices": [{json.dumps(choice, ensure_ascii=False)}]}}\n\n'


async def stream_chunks(
    state: ServerState, request: Request | None, runs: list[Run], *, chat: bool, include_usage: bool
) -> AsyncIterator[str]:
    """Server-sent events: per sequence its first chunk, one chunk per delta (the log probabilities
    of its tokens in the chunk that carries their text), its finish chunk; then the usage chunk and
    [DONE]. The sequences' chunks interleave as they come, each with its choice's index."""
    chunk = ChunkWriter(state, chat, runs[0].prepared.ident)
    merged = _merge(state, request, runs)
    try:
        # Start generating before the response begins, so that a refused request is a plain error.
        pending = [await anext(merged)]
        for run in runs:
            yield (
                chunk({"role": "assistant", "content": ""}, index=run.index)
                if chat
                else chunk({"content": run.prepared.echo}, index=run.index, logprobs=_echo_logprobs(run))
            )
        logprobs: dict[int, list] = {run.index: [] for run in runs}

        def carried(index: int):
            entries, logprobs[index] = logprobs[index], []
            if not entries:
                return None
            return {"content": entries} if chat else completion_logprobs(entries)

        async for index, (name, value) in _chain(pending, merged):
            if name == "logprob":
                logprobs[index].append(value)
            elif name == "content":
                yield chunk({"content": value}, logprobs=carried(index), index=index)
            elif name == "reasoning":
                yield chunk({"reasoning_content": value}, logprobs=carried(index), index=index)
            elif name == "tool_call":
                yield chunk({"tool_calls": [value]}, logprobs=carried(index), index=index)
            elif name == "finish":
                yield chunk({}, value[0], logprobs=carried(index), index=index)
    except APIError as error:
        # The response has begun: the error goes in the stream, as OpenAI's API sends it.
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
    finally:
        await merged.aclose()
    if include_usage:
        body = json.loads(chunk(choices=False)[len("data: ") :])
        body["usage"] = usage(runs)
        yield f"data: {json.dumps(body)}\n\n"
    yield "data: [DONE]\n\n"


def _echo_logprobs(run: Run) -> dict | None:
    entries = run.prepared.prompt_logprobs
    return None if entries is None else completion_logprobs(entries)


async def _merge(
    state: ServerState, request: Request | None, runs: list[Run]
) -> AsyncIterator[tuple[int, Any]]:
    """The sequences' events as they come, as (choice index, event); a sequence's failure is raised
    (the others are aborted). Closing it aborts what is still running."""
    events: asyncio.Queue = asyncio.Queue()
    ended = object()

    async def pump(run: Run) -> None:
        try:
            async for event in generate_run(state, run):
                events.put_nowait((run.index, event))
            events.put_nowait((run.index, ended))
        except asyncio.CancelledError as error:  # its client went away (or the reply was closed)
            events.put_nowait((run.index, error))
            raise
        except Exception as error:  # noqa: BLE001 - raised by the reader
            events.put_nowait((run.index, error))

    watcher = None if request is None else asyncio.create_task(watch_disconnect(state, request, runs))
    tasks = [asyncio.create_task(pump(run)) for run in runs]
    try:
        running = len(runs)
        while running:
            index, event = await events.get()
            if event is ended:
                running -= 1
            elif isinstance(event, BaseException):
                raise event
            else:
                yield index, event
    finally:
        _stop(tasks, watcher, runs)


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
