"""What every handler reads: the model, its tokenizer, the engine runner, metrics and limits.

Built once by ``create_app`` (or by a test) and passed to each handler as its first argument.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from dataclasses import dataclass, field

from ..generation.engine import Engine
from ..llm import LLM
from ..tokenizer import UnknownTokenError
from ..version import __version__
from .errors import APIError
from .metrics import Metrics
from .runner import EngineRunner


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
    # One embedding batch at a time, off the event loop; generation keeps its own engine thread.
    embedding_lock: asyncio.Lock = field(default_factory=asyncio.Lock)

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
        prefill_chunk: int = 512,
        engine: Engine | None = None,
    ) -> ServerState:
        """Start the engine thread over ``llm.model`` (or over ``engine``, whose ``max_len`` then
        sets the limit)."""
        if engine is None:
            engine = Engine(
                llm.model,
                max_batch_size=max_batch_size,
                max_len=max_len,
                prefill_chunk=prefill_chunk,
                generation_config=llm.generation_config,
            )
        runner: EngineRunner | None = None  # the gauges read it once it exists
        metrics = Metrics(lambda: runner.running, lambda: runner.waiting)
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
        return cls(
            llm=llm,
            runner=runner,
            metrics=metrics,
            model_name=model_name,
            max_len=engine.max_len,
            api_key=api_key,
            fingerprint=fingerprint,
            created=int(time.time()),
            chat_stops=list(dict.fromkeys([*llm.generation_config.eos_token_ids, *turn_end])),
        )

    @property
    def tokenizer(self):
        return self.llm.tokenizer

    @property
    def context_limit(self) -> int:
        """Prompt and reply together: the cache length, or the model's positions if fewer."""
        return min(self.max_len, self.llm.model.config.text.max_position_embeddings)

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
