"""What ``GET /metrics`` reports, in Prometheus' text format (``prometheus_client``), and the
per-request log lines (``RequestLog``)."""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

# Seconds over which the throughput gauge averages the engine's output.
THROUGHPUT_WINDOW = 10.0


class Metrics:
    def __init__(self, running: Callable[[], int], waiting: Callable[[], int]):
        self.registry = CollectorRegistry()
        r = self.registry
        Gauge("torchgemma_requests_running", "Requests holding a slot", registry=r).set_function(running)
        Gauge("torchgemma_requests_waiting", "Requests waiting for a slot", registry=r).set_function(waiting)
        self.requests = Counter(
            "torchgemma_requests", "Finished requests", ["endpoint", "finish_reason"], registry=r
        )
        self.prompt_tokens = Counter(
            "torchgemma_prompt_tokens", "Prompt tokens of accepted requests", registry=r
        )
        self.generation_tokens = Counter("torchgemma_generation_tokens", "Tokens generated", registry=r)
        self.time_to_first_token = Histogram(
            "torchgemma_time_to_first_token_seconds",
            "From a request's arrival to its first token",
            buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120),
            registry=r,
        )
        self.step_seconds = Histogram(
            "torchgemma_engine_step_seconds",
            "Duration of one engine step (prefill chunks and one decode forward)",
            buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
            registry=r,
        )
        Gauge(
            "torchgemma_generation_tokens_per_second",
            f"Tokens generated per second over the last {THROUGHPUT_WINDOW:g} s",
            registry=r,
        ).set_function(self._throughput)
        self._recent: deque[tuple[float, int]] = deque()
        self._lock = threading.Lock()

    # Called from the engine thread.
    def step(self, tokens: int, seconds: float) -> None:
        self.generation_tokens.inc(tokens)
        self.step_seconds.observe(seconds)
        with self._lock:
            self._recent.append((time.monotonic(), tokens))

    def first_token(self, seconds: float) -> None:
        self.time_to_first_token.observe(seconds)

    def _throughput(self) -> float:
        now = time.monotonic()
        with self._lock:
            while self._recent and self._recent[0][0] < now - THROUGHPUT_WINDOW:
                self._recent.popleft()
            return sum(tokens for _, tokens in self._recent) / THROUGHPUT_WINDOW

    def watch_prefix_cache(self, store) -> None:
        """Report ``store``'s counters (a ``PrefixCache``): read from it at each scrape."""
        self.registry.register(PrefixCacheCollector(store))

    def watch_speculation(self, stats) -> None:
        """Report an engine's speculative decoding counters (a ``SpeculativeStats``), read at each scrape."""
        self.registry.register(SpeculativeCollector(stats))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class PrefixCacheCollector:
    """The prefix cache's own counters (``PrefixCache.stats()``), read when /metrics is scraped: the
    store counts them as it works, so nothing is added to the engine's step."""

    COUNTERS = (
        (
            "cached_tokens",
            "torchgemma_prefix_cache_cached_tokens",
            "Prompt tokens taken from the prefix cache",
        ),
        ("queries", "torchgemma_prefix_cache_queries", "Requests that looked in the prefix cache"),
        ("hits", "torchgemma_prefix_cache_hits", "Requests that reused a prefix from the cache"),
        ("evictions", "torchgemma_prefix_cache_evictions", "Blocks evicted from the prefix cache"),
    )

    def __init__(self, store):
        self.store = store

    def collect(self):
        stats = self.store.stats()
        for key, name, help_text in self.COUNTERS:
            yield CounterMetricFamily(name, help_text, value=stats[key])
        yield GaugeMetricFamily(
            "torchgemma_prefix_cache_bytes",
            "Bytes of keys and values the prefix cache holds",
            value=stats["bytes"],
        )
        yield GaugeMetricFamily(
            "torchgemma_prefix_cache_max_bytes",
            "The prefix cache's limit in bytes",
            value=self.store.max_bytes,
        )


class SpeculativeCollector:
    """Speculative decoding's counters (``Engine.speculative_stats``), read when /metrics is scraped."""

    COUNTERS = (
        ("drafted_tokens", "torchgemma_speculative_draft_tokens", "Draft tokens scored by verify passes"),
        ("accepted_tokens", "torchgemma_speculative_accepted_tokens", "Draft tokens accepted"),
        ("verify_passes", "torchgemma_speculative_verify_passes", "Forward passes that scored drafts"),
    )

    def __init__(self, stats):
        self.stats = stats

    def collect(self):
        for key, name, help_text in self.COUNTERS:
            yield CounterMetricFamily(name, help_text, value=getattr(self.stats, key))


# ── the request log ─────────────────────────────────────────────────────────────────────────

# One line per request at INFO: `torchgemma serve` sends it to stderr.
logger = logging.getLogger("torchgemma.serving")

# Characters of a prompt written to the log when prompts are logged at all.
LOGGED_PROMPT_CHARS = 2000


@dataclass
class RequestLog:
    """One request's log line, filled as it goes: the app's log middleware writes it once the
    response has been sent; handlers hand it their prepared request (``log_request``)."""

    method: str
    path: str
    client: str
    started: float = field(default_factory=time.perf_counter)
    status: int | None = None
    # A handler's ``streaming.Prepared``: its prompt ids and, once the reply ended, its tokens.
    prepared: Any = None

    def line(self, tokenizer=None) -> str:
        """``POST /v1/chat/completions 200 1.234s id=chatcmpl-... prompt_tokens=12 cached_tokens=0
        completion_tokens=30 ttft=0.050s tok/s=48.1 finish=stop client=...``; with ``tokenizer``,
        the prompt's text too (``--log-prompts``), cut to LOGGED_PROMPT_CHARS.

        ``ttft``: from the request's arrival to its first token; ``tok/s``: the tokens after the
        first over the time from the first to the last (the decode rate this request saw); "-"
        where there is nothing to measure (no token, one token, a reply that never ended)."""
        # No status: the client left before a response began.
        status = self.status if self.status is not None else "-"
        text = f"{self.method} {self.path} {status} {time.perf_counter() - self.started:.3f}s"
        prepared = self.prepared
        if prepared is not None:
            text += self._generation(prepared)
        text += f" client={self.client}"
        if tokenizer is not None and prepared is not None:
            prompt = tokenizer.decode(prepared.input_ids[:LOGGED_PROMPT_CHARS])[:LOGGED_PROMPT_CHARS]
            text += f" prompt={prompt!r}"
        return text

    def _generation(self, prepared) -> str:
        generated = prepared.completion_tokens  # None until the reply ended
        first, last = prepared.first_token_at, prepared.last_token_at
        ttft = "-" if first is None else f"{first - self.started:.3f}s"
        rate = "-"
        if generated is not None and generated > 1 and first is not None and last > first:
            rate = f"{(generated - 1) / (last - first):.1f}"
        generated = "-" if generated is None else generated
        return (
            f" id={prepared.ident or '-'} prompt_tokens={len(prepared.input_ids)}"
            f" cached_tokens={prepared.cached_tokens} completion_tokens={generated}"
            f" ttft={ttft} tok/s={rate} finish={prepared.finish_reason or '-'}"
        )


def log_request(request, prepared) -> None:
    """Give ``request``'s log line its prepared request (token counts; the prompt, if logged)."""
    if request is not None and "torchgemma.log" in request.scope:
        request.scope["torchgemma.log"].prepared = prepared
