"""What every handler reads: the model, its tokenizer, the engine runner, metrics and limits.

Built once by ``create_app`` (or by a test) and passed to each handler as its first argument.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

from ..generation.engine import Engine
from ..generation.prefix_cache import prefix_cache_of
from ..llm import LLM
from ..tokenizer import UnknownTokenError
from ..version import __version__
from .errors import APIError, bad_request
from .limits import Limits
from .metrics import Metrics
from .openmp import released
from .runner import EngineRunner

T = TypeVar("T")


class ResponseStore:
    """The last ``capacity`` /v1/responses replies (``store`` true), for ``previous_response_id``
    and GET/DELETE /v1/responses/{id}: in memory, the oldest dropped first, gone on restart.

    Each entry: the response object as sent and the conversation it ends (the chat messages of its
    input, its predecessors' included, and its output as an assistant turn)."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self._entries: OrderedDict[str, tuple[dict, list[dict]]] = OrderedDict()

    def put(self, response: dict, conversation: list[dict]) -> None:
        if self.capacity <= 0:
            return
        self._entries[response["id"]] = (response, conversation)
        self._entries.move_to_end(response["id"])
        while len(self._entries) > self.capacity:
            self._entries.popitem(last=False)

    def get(self, response_id: str) -> tuple[dict, list[dict]] | None:
        return self._entries.get(response_id)

    def delete(self, response_id: str) -> bool:
        return self._entries.pop(response_id, None) is not None


def server_engine(
    llm: LLM, *, max_batch_size: int, max_len: int, prefill_chunk: int | None, prefix_cache_gb: float
) -> Engine:
    """The engine a server runs over ``llm.model``: the one place the server's settings become an
    ``Engine`` (one process, and each rank under ``serve --tensor-parallel-size``), speculative
    decoding (``llm.speculative``) included."""
    return Engine(
        llm.model,
        max_batch_size=max_batch_size,
        max_len=max_len,
        prefill_chunk=prefill_chunk,
        generation_config=llm.generation_config,
        prefix_cache=prefix_cache_of(prefix_cache_gb),
        speculative=getattr(llm, "speculative", None),
    )


@dataclass
class ServerState:
    llm: LLM
    runner: EngineRunner
    metrics: Metrics
    model_name: str
    # Prompt and reply together, in tokens (the engine's cache length).
    max_len: int
    api_key: str | None
    # Identifies the build serving the replies (OpenAI's system_fingerprint).
    fingerprint: str
    created: int
    # What ends a chat reply: the checkpoint's end-of-sequence ids and the end of a turn.
    chat_stops: list[int]
    limits: Limits = field(default_factory=Limits)
    # Requests waiting for a slot (the runner's limit), also the bound on requests queued to be
    # prepared: beyond it a request is a 503 before its body is worked on.
    max_waiting: int = 64
    # /v1/responses replies kept for previous_response_id (ServerState.build's responses_store).
    responses: ResponseStore = field(default_factory=lambda: ResponseStore(64))
    # One embedding batch at a time, off the event loop; generation keeps its own engine thread.
    embedding_lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    # Where requests are prepared (template, tokenizer, media): off the event loop, so that /health
    # and streams stay responsive while a large request is worked on; limits.prepare_threads at once.
    _executor: ThreadPoolExecutor | None = field(default=None, repr=False)
    _preparing: int = 0

    @classmethod
    def build(
        cls,
        llm: LLM,
        *,
        model_name: str,
        max_batch_size: int = 8,
        max_len: int = 4096,
        max_waiting: int = 64,
        api_key: str | None = None,
        prefill_chunk: int | None = None,
        engine: Engine | None = None,
        limits: Limits | None = None,
        prefix_cache_gb: float = 1.0,
        responses_store: int = 64,
    ) -> ServerState:
        """Start the engine thread over ``llm.model`` (or over ``engine``, whose ``max_len`` then
        sets the limit, and whose own ``prefix_cache``, if any, is reported).

        ``prefix_cache_gb``: GiB of a prefix cache the requests share (``PrefixCache``: a prompt
        that begins as an earlier one did prefills only the rest, with the same results); 0 turns it
        off. Its own store, not ``llm.prefix_cache``: that one is the library's, for ``LLM``'s calls.
        ``responses_store``: how many /v1/responses replies are kept (``ResponseStore``)."""
        if engine is None:
            engine = server_engine(
                llm,
                max_batch_size=max_batch_size,
                max_len=max_len,
                prefill_chunk=prefill_chunk,
                prefix_cache_gb=prefix_cache_gb,
            )
        runner: EngineRunner | None = None  # the gauges read it once it exists
        metrics = Metrics(lambda: runner.running, lambda: runner.waiting)
        store = getattr(engine, "prefix_cache", None)
        if store is not None:
            metrics.watch_prefix_cache(store)
        if getattr(engine, "speculation", None) is not None:
            metrics.watch_speculation(engine.speculative_stats)
        runner = EngineRunner(engine, max_waiting=max_waiting, metrics=metrics)
        fingerprint = (
            "fp_"
            + hashlib.sha256(
                f"{__version__}|{model_name}|{llm.model.dtype}|{llm.model.attention}".encode()
            ).hexdigest()[:10]
        )
        try:
            turn_end = [llm.tokenizer.turn_end_id]
        except UnknownTokenError:
            turn_end = []
        state = cls(
            llm=llm,
            runner=runner,
            metrics=metrics,
            model_name=model_name,
            max_len=engine.max_len,
            api_key=api_key,
            fingerprint=fingerprint,
            created=int(time.time()),
            chat_stops=list(dict.fromkeys([*llm.generation_config.eos_token_ids, *turn_end])),
            limits=limits or Limits(),
            max_waiting=max_waiting,
            responses=ResponseStore(responses_store),
        )
        _ = state.max_prompt_chars  # read the vocabulary now, not on the first request's event loop
        return state

    @property
    def tokenizer(self):
        return self.llm.tokenizer

    @property
    def context_limit(self) -> int:
        """Prompt and reply together: the cache length, or the model's positions if fewer."""
        return min(self.max_len, self.llm.model.config.text.max_position_embeddings)

    @property
    def takes_images(self) -> bool:
        """Whether the model has a vision tower torchgemma builds (or gemma4_unified's embedder)."""
        config = self.llm.model.config
        if config.encoder_free:
            return config.unified_vision is not None
        return (config.vision_config or config.siglip_vision or config.gemma3n_vision) is not None

    @property
    def takes_audio(self) -> bool:
        return self.llm.takes_audio

    @functools.cached_property
    def max_prompt_chars(self) -> int | None:
        """Characters beyond which a prompt cannot fit the context, whatever its tokens: each token
        covers at most as many characters as its longest piece has bytes. None when the tokenizer
        may shrink text before splitting it (a normalizer other than Gemma's space -> "▁"), where
        a character count proves nothing."""
        backend = self.tokenizer.backend
        normalizer = backend.normalizer
        if normalizer is not None and normalizer.normalize_str(" ab c") != "\u2581ab\u2581c":
            return None
        longest = max((len(piece) for piece in self.tokenizer.token_bytes if piece), default=1)
        return longest * self.context_limit

    def check_prompt_chars(self, chars: int, param: str) -> None:
        """Refuse a prompt of ``chars`` characters that cannot fit the context, without tokenizing it."""
        limit = self.max_prompt_chars
        if limit is not None and chars > limit:
            raise bad_request(
                f"This model's maximum context length is {self.context_limit} tokens. However, your "
                f"prompt has {chars:,} characters, more than that many tokens can hold, since no token "
                f"covers more than {limit // self.context_limit} characters (refused before tokenizing).",
                param,
                "context_length_exceeded",
            )

    async def prepare(self, work: Callable[..., T], *args: Any) -> T:
        """``work(*args)`` on the preparation threads; a 503 when more requests than the waiting
        room holds are already queued there."""
        if self._preparing >= self.limits.prepare_threads + self.max_waiting:
            raise APIError(
                503, f"the server is busy: {self._preparing} requests are being prepared; retry shortly"
            )
        if self._executor is None:
            self._executor = ThreadPoolExecutor(
                self.limits.prepare_threads, thread_name_prefix="torchgemma-prepare"
            )
        self._preparing += 1  # only the event loop's thread counts
        try:
            return await asyncio.get_running_loop().run_in_executor(self._executor, released(work), *args)
        finally:
            self._preparing -= 1

    def check_model(self, name: str | None) -> None:
        if name not in (None, "", self.model_name):
            raise APIError(
                404,
                f"model {name!r} is not served here; this server serves {self.model_name!r}",
                param="model",
                code="model_not_found",
            )

    def close(self) -> None:
        self.runner.close()
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
