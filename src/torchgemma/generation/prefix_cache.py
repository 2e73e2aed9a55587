"""Prefix caching: keys and values of token blocks kept across requests (work in progress).

    store = PrefixCache(max_bytes=1 << 30, block_size=32)
    engine = Engine(model, prefix_cache=store)
    store.stats()  # hits, queries, cached_tokens, bytes, evictions, ...

The engine takes the longest stored chain of whole blocks that begins a new request's prompt and
prefills only the rest; ``StepOutput.cached_tokens`` reports how many prompt tokens came from here.
"""

from __future__ import annotations

DEFAULT_BLOCK_SIZE = 32


class PrefixCache:
    """A byte-bounded, least-recently-used store of token blocks' keys and values."""

    def __init__(self, max_bytes: int, block_size: int = DEFAULT_BLOCK_SIZE):
        if max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.max_bytes = int(max_bytes)
        self.block_size = int(block_size)
        self.hits = 0
        self.queries = 0
        self.cached_tokens = 0
        self.evictions = 0
        self.bytes = 0

    def stats(self) -> dict[str, int]:
        return {
            "hits": self.hits,
            "queries": self.queries,
            "cached_tokens": self.cached_tokens,
            "bytes": self.bytes,
            "evictions": self.evictions,
        }
