"""One sequence of a reply, from its engine request's tokens to OpenAI's deltas (``generate``).

A sequence's tokens become text through its own stream decoder, then Gemma's reply format becomes
OpenAI's fields (``replies.ReplyStream``: content, reasoning_content, tool_calls), then user stop
strings cut the content (``replies.StopStrings``). Special tokens the reply format does not read
(``<|image>``, ``<mask>``, ``<unusedN>``, ...) are left out before the parser sees them: they never
reach content or reasoning_content. Tokens that arrived together (the event loop fell behind the
engine) are handled in one pass and their text sent as one event.
"""

from __future__ import annotations

import asyncio
import functools
import re
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request

from ..replies import Delta, ReplyStream, StopStrings
from ..replies.grammar import SPECIAL_TOKENS
from .errors import APIError
from .runner import Token
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
    # completions with echo: the prompt's text, given back before the completion, and with
    # logprobs its tokens' entries (the first one's logprob None, as OpenAI has it).
    echo: str = ""
    prompt_logprobs: list[dict] | None = None
    # OpenAI's n: sequences sampled from this prompt (one prefill, forked in the engine).
    n: int = 1
    # vLLM's ignore_eos: the engine has no stop tokens and the reply's own end does not stop it.
    ignore_eos: bool = False
    # The /metrics label ("chat", "completion", "transcription").
    endpoint: str = ""
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


@dataclass
class Run:
    """One sequence of a reply (a choice): its prompt's ``Prepared``, its engine request's id and
    token queue (None for a choice that generates nothing: completions' echo with max_tokens 0)."""

    index: int
    prepared: Prepared
    request_id: Any = None
    tokens: asyncio.Queue | None = None
    # Set as it runs: tokens generated, prompt tokens the prefix cache held, why it ended.
    completion_tokens: int = 0
    cached_tokens: int = 0
    finish_reason: str | None = None


class _Reader:
    """A sequence's tokens -> its events: the stream decoder, the reply parser (or raw text), the
    stop strings, and what they have seen."""

    def __init__(self, state: ServerState, prepared: Prepared):
        self.state, self.prepared = state, prepared
        self.decoder = state.tokenizer.stream_decoder()
        self.parser = RawText() if prepared.raw else ReplyStream(tools=prepared.tools)
        # Special tokens the reply format does not read never reach the parser (content or reasoning).
        self.hidden = frozenset() if prepared.raw else hidden_token_ids(state.tokenizer)
        self.stops = StopStrings(prepared.stops)
        self.done = False  # a stop string ended the content
        self.tool_calls = 0
        # Raw text: characters decoded so far (where the next token's text begins, after the echo).
        self.decoded = len(prepared.echo)

    def convert(self, deltas) -> list[tuple[str, Any]]:
        events = []
        for delta in deltas:
            if delta.kind == "tool_call":
                self.tool_calls += 1
                events.append(("tool_call", tool_call_dict(delta.index, delta.tool_call)))
            elif delta.kind == "reasoning":
                events.append(("reasoning", delta.text))
            elif not self.done:
                text, stopped = self.stops.push(delta.text)
                if text:
                    events.append(("content", text))
                self.done = self.done or stopped
        return events

    def token(self, token: Token) -> list[tuple[str, Any]]:
        """A generated token's events: its logprob entry (if asked), then any text it released."""
        events = []
        # A stop token ends the reply unwritten: neither its text nor its logprob is given.
        ending = token.finished and token.finish_reason == "stop"
        if self.prepared.logprobs and token.logprobs is not None and not ending:
            entry = logprob_entry(self.state, token)
            if self.prepared.raw:  # completions' text_offset
                entry["text_offset"] = self.decoded
            events.append(("logprob", entry))
        piece = ""
        if not ending and token.token_id not in self.hidden:
            piece = self.decoder.push(token.token_id)
            self.decoded += len(piece)
        return events + self.convert(self.parser.push(piece))

    def finish(self) -> list[tuple[str, Any]]:
        """The text still held back, at the end."""
        tail = "" if self.done else self.decoder.flush()
        events = self.convert(self.parser.push(tail) + self.parser.finish())
        if not self.done:
            text = self.stops.finish()
            if text:
                events.append(("content", text))
        return events


async def generate(state: ServerState, run: Run) -> AsyncIterator[tuple[str, Any]]:
    """One submitted sequence's events: ("content" | "reasoning", text), ("tool_call", OpenAI dict),
    ("logprob", entry) before the text event its token's text is in, and last ("finish",
    (finish_reason, completion tokens)). Counts the sequence in /metrics when it ends: by its finish
    reason, "error", or "abort" (its client went away)."""
    prepared, runner = run.prepared, state.runner
    endpoint = prepared.endpoint or "chat"
    if run.tokens is None:  # nothing to generate
        run.finish_reason = "length"
        state.metrics.requests.labels(endpoint, "length").inc()
        yield "finish", ("length", 0)
        return
    tokens, reader = run.tokens, _Reader(state, prepared)
    count, reason = 0, "stop"
    try:
        for event in reader.convert(reader.parser.push(prepared.prefix)) if prepared.prefix else []:
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
                    run.cached_tokens = token.cached_tokens
                count += 1
                events += reader.token(token)
                if token.finished:
                    reason = token.finish_reason or "stop"
                    finished = True
                    break
                if reader.done or (reader.parser.stopped and not prepared.ignore_eos):
                    runner.abort(run.request_id)
                    reason = "stop"
                    finished = True
                    break
            for event in _merged(events):
                yield event
        for event in reader.finish():
            yield event
        run.completion_tokens = count
        run.finish_reason = "tool_calls" if reader.tool_calls else reason
        state.metrics.requests.labels(endpoint, run.finish_reason).inc()
        yield "finish", (run.finish_reason, count)
    except (asyncio.CancelledError, GeneratorExit):
        runner.abort(run.request_id)
        state.metrics.requests.labels(endpoint, "abort").inc()
        raise
    except APIError:
        state.metrics.requests.labels(endpoint, "error").inc()
        raise


def _merged(events: list[tuple[str, Any]]) -> list[tuple[str, Any]]:
    """``events`` with each run of content (or of reasoning) joined into one event, the log
    probabilities first (they ride in the chunk of the next text, which holds their tokens' text)."""
    merged: list[tuple[str, Any]] = [event for event in events if event[0] == "logprob"]
    for kind, value in (event for event in events if event[0] != "logprob"):
        if merged and kind in ("content", "reasoning") and merged[-1][0] == kind:
            merged[-1] = (kind, merged[-1][1] + value)
        else:
            merged.append((kind, value))
    return merged


async def watch_disconnect(state: ServerState, request: Request, runs: list[Run]) -> None:
    """Until cancelled (the reply ended): wait for the client's connection to close, whatever the
    token rate (tokens may keep coming for a client long gone); once it is gone, abort the reply's
    sequences and wake their readers.

    The server says so by answering ``receive()`` with ``http.disconnect`` (the body has been read:
    nothing else can come), so the wait costs nothing while the request runs; a server that answered
    otherwise is asked again every ``DISCONNECT_POLL_SECONDS``. (Polling ``request.is_disconnected()``
    on a timer instead cost each running request ~0.1 ms of the event loop five times a second, in
    Python, holding the GIL the engine thread needs.)"""
    while True:
        message = await request.receive()
        if message.get("type") == "http.disconnect":
            for run in runs:
                if run.tokens is not None:
                    state.runner.abort(run.request_id)
                    run.tokens.put_nowait(DISCONNECTED)
            return
        await asyncio.sleep(DISCONNECT_POLL_SECONDS)


# Control tokens some tokenizers do not mark special: Gemma's unused slots (<unused0>, ...), Gemma 3's
# media markers (<start_of_image>, <image_soft_token>, [multimodal]). Never text.
UNMARKED_CONTROL = re.compile(r"<unused[^<>]*>|<(?:start|end)_of_[a-z_]+>|<[a-z_]*soft_token>|\[multimodal\]")


@functools.lru_cache(maxsize=8)
def hidden_token_ids(tokenizer) -> frozenset[int]:
    """The tokens left out of a chat reply's text: every special token of the tokenizer, every
    control token of its chat template and every unused slot (``<|image>``, ``<mask>``,
    ``<unusedN>``, ``<start_of_image>``, ...), except those Gemma's reply format reads (``replies.grammar.SPECIAL_TOKENS``:
    it drops the strays itself)."""
    ids = set(tokenizer.special_ids)
    if tokenizer.chat_template is not None:
        ids.update(tokenizer.token_id(text) for text in tokenizer.control_tokens())
    ids.update(i for piece, i in tokenizer.backend.get_vocab().items() if UNMARKED_CONTROL.fullmatch(piece))
    return frozenset(ids - {tokenizer.backend.token_to_id(text) for text in SPECIAL_TOKENS})


def logprob_entry(state: ServerState, token: Token) -> dict:
    lp = token.logprobs
    return {
        **described(state, lp.token_id, lp.logprob),
        "top_logprobs": [described(state, t, v) for t, v in lp.top],
    }


def described(state: ServerState, token_id: int, logprob: float | None) -> dict:
    text = state.tokenizer.decode([token_id])
    return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}


def tool_call_dict(index: int, call) -> dict:
    return {
        "index": index,
        "id": call.id,
        "type": "function",
        "function": {"name": call.name, "arguments": call.arguments_json()},
    }
