"""The engine in its own thread, fed by asyncio handlers.

    handler ── submit() ──▶ inbox ──▶ engine thread: add_request / abort, step(), tokens
    handler ◀── asyncio.Queue per request ◀── loop.call_soon_threadsafe(...) ◀──┘

Only the engine thread touches the engine: handlers never wait for a forward pass to end, they put
their request (or an abort) in the inbox and read their own queue. A request's queue receives one
``Token`` per generated token, then ``None`` when it finished; an ``Exception`` if it failed.
The waiting room is bounded: beyond ``max_waiting`` requests not yet running, ``submit`` raises
``Busy`` (the server answers 503 with Retry-After).

What a step produced reaches each event loop in one ``call_soon_threadsafe`` (one wakeup of the
loop per step, not one per token; see ``Outbox``): 16 streams of 64 tokens woke the loop 1,375
times instead of 5,344 and made 215k Python calls there instead of 1.15M. (Whether that shows in
tok/s was not measurable on a shared 2-core machine.)

The engine thread outlives every request: a request's own failure reaches that request alone (the
engine reports it as a step output), a request whose event loop has closed is aborted, and an
unexpected error in the loop fails the requests in flight, not the thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import queue
import threading
import time
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any

from ..generation.engine import Engine, StepOutput, TokenLogprobs
from .openmp import release_openmp_workers


class Busy(RuntimeError):
    """The waiting room is full."""


@dataclass(frozen=True)
class Token:
    token_id: int
    finished: bool
    finish_reason: str | None  # "stop" or "length" with the last token
    logprobs: TokenLogprobs | None
    # On a request's first token: its prompt tokens taken from the prefix cache (not prefilled).
    cached_tokens: int = 0


class Outbox:
    """What the engine thread hands the event loops, held until the end of a step or a drain, then
    given to each loop in one call: ``put(subscriber, item)``, then ``flush()``."""

    def __init__(self):
        self._items: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, Any]]] = {}

    def put(self, subscriber: _Subscriber, item: Any) -> bool:
        """Hold ``item`` for the subscriber's queue; False if its event loop has closed (nobody can
        receive it)."""
        if subscriber.loop.is_closed():
            return False
        self._items.setdefault(subscriber.loop, []).append((subscriber.queue, item))
        return True

    def flush(self) -> None:
        items, self._items = self._items, {}
        for loop, pairs in items.items():
            # A loop that closed since put(): its requests cannot be told anything any more.
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(_put_all, pairs)


def _put_all(pairs: list[tuple[asyncio.Queue, Any]]) -> None:
    for tokens, item in pairs:
        tokens.put_nowait(item)


@dataclass
class _Subscriber:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    submitted: float
    first_token: float | None = None
    tokens: int = 0


class EngineRunner:
    """Runs ``engine`` on a daemon thread until ``close()``; see the module docstring."""

    def __init__(self, engine: Engine, *, max_waiting: int = 64, metrics: Any = None):
        self.engine = engine
        self.max_waiting = max_waiting
        self.metrics = metrics
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._subscribers: dict[Hashable, _Subscriber] = {}
        self._outbox = Outbox()  # touched by the engine thread alone
        self._ids = itertools.count()
        self._lock = threading.Lock()  # guards the in-flight count
        self._in_flight = 0
        self._closed = threading.Event()
        # The engine thread runs the model from now on: this (loading) thread's OpenMP workers
        # would otherwise keep the engine's from spinning between parallel regions (openmp.py).
        release_openmp_workers()
        self._thread = threading.Thread(target=self._run, name="torchgemma-engine", daemon=True)
        self._thread.start()

    # ── for handlers (event loop thread) ────────────────────────────────────────────────────

    def submit(self, input_ids: list[int], **request: Any) -> tuple[Hashable, asyncio.Queue]:
        """Queue a request (``Engine.add_request``'s keyword arguments: ``sampling``, ``media``,
        ``max_new_tokens``, ...); its id and the queue of its tokens."""
        return self.submit_fork(input_ids, [request])[0]

    def submit_fork(self, input_ids: list[int], requests: list[dict]) -> list[tuple[Hashable, asyncio.Queue]]:
        """Queue one prompt's sequences (OpenAI's ``n``), each with its own ``add_request`` keyword
        arguments: the first prefills the prompt, the others fork from it (``fork_of``), all handed
        to the engine at once. Each one's id and token queue."""
        with self._lock:
            waiting = self._in_flight - self.engine.max_batch_size
            if waiting + len(requests) > self.max_waiting:
                raise Busy(f"{waiting} requests are waiting for a slot (the limit is {self.max_waiting})")
            self._in_flight += len(requests)
        added = []
        loop = asyncio.get_running_loop()
        for index, request in enumerate(requests):
            request_id = f"req-{next(self._ids)}"
            if index:
                request = {**request, "fork_of": added[0][0]}
            subscriber = _Subscriber(loop, asyncio.Queue(), time.perf_counter())
            added.append((request_id, input_ids, request, subscriber))
        self._inbox.put(("add", added))
        return [(request_id, subscriber.queue) for request_id, _, _, subscriber in added]

    def abort(self, request_id: Hashable) -> None:
        """Drop a request (a client went away); its slot is free at the next step."""
        self._inbox.put(("abort", request_id))

    @property
    def waiting(self) -> int:
        with self._lock:
            return max(self._in_flight - self.engine.max_batch_size, 0)

    @property
    def running(self) -> int:
        with self._lock:
            return min(self._in_flight, self.engine.max_batch_size)

    def close(self) -> None:
        self._closed.set()
        self._inbox.put(("wake",))
        self._thread.join(timeout=30)

    # ── the engine thread ────────────────────────────────────────────────────────────────────

    def _run(self) -> None:
        while not self._closed.is_set():
            try:
                self._iterate()
            except Exception as error:  # noqa: BLE001 - a bug here fails what is in flight, not the thread
                self._fail_all(error)
            finally:
                self._outbox.flush()

    def _iterate(self) -> None:
        engine = self.engine
        # Block for work when idle; otherwise take what arrived and step.
        self._drain(block=not engine.has_unfinished_requests())
        self._outbox.flush()  # requests refused on arrival hear it before the step
        if not engine.has_unfinished_requests():
            return
        started = time.perf_counter()
        try:
            outputs = engine.step()
        except Exception as error:  # noqa: BLE001 - the engine reports requests' own failures as
            # outputs; a step that raises anyway leaves nothing to trust: its requests fail.
            self._fail_all(error)
            return
        now = time.perf_counter()
        tokens = 0
        for output in outputs:
            if output.error is not None:
                self._end(output.request_id, output.error)
            else:
                self._deliver(output, now)
                tokens += 1
        if self.metrics is not None:
            self.metrics.step(tokens, now - started)

    def _drain(self, block: bool) -> None:
        while True:
            try:
                message = self._inbox.get(block=block, timeout=0.5 if block else None)
            except queue.Empty:
                return
            block = False
            kind = message[0]
            if kind == "add":
                for request_id, input_ids, request, subscriber in message[1]:
                    self._subscribers[request_id] = subscriber
                    try:
                        self.engine.add_request(request_id, input_ids, **request)
                    except Exception as error:  # noqa: BLE001 - reported to the one request
                        self._end(request_id, error)
            elif kind == "abort":
                _, request_id = message
                if request_id in self._subscribers:
                    self.engine.abort_request(request_id)
                    self._end(request_id, None, notify=False)

    def _deliver(self, output: StepOutput, now: float) -> None:
        request_id = output.request_id
        token = Token(
            output.token_id, output.finished, output.finish_reason, output.logprobs, output.cached_tokens
        )
        subscriber = self._subscribers.get(request_id)
        if subscriber is None:
            return
        if subscriber.first_token is None:
            subscriber.first_token = now
            if self.metrics is not None:
                self.metrics.first_token(now - subscriber.submitted)
        subscriber.tokens += 1
        if not self._outbox.put(subscriber, token):
            # Nobody can receive it (the client's event loop has closed): free its slot.
            self.engine.abort_request(request_id)
            self._end(request_id, None, notify=False)
        elif token.finished:
            self._end(request_id, None)

    def _end(self, request_id: Hashable, error: Exception | None, notify: bool = True) -> None:
        subscriber = self._subscribers.pop(request_id, None)
        if subscriber is None:
            return  # already ended (aborted, or failed earlier)
        with self._lock:
            self._in_flight -= 1
        if notify:
            self._outbox.put(subscriber, error)

    def _fail_all(self, error: Exception) -> None:
        for request_id in list(self._subscribers):
            with contextlib.suppress(Exception):  # the engine is already broken: end the request anyway
                self.engine.abort_request(request_id)
            self._end(request_id, RuntimeError(f"generation failed: {error}"))
