"""Prefix caching: the keys and values of prompts' first tokens, kept across requests.

    store = PrefixCache(max_bytes=1 << 30)          # 1 GiB, blocks of 32 tokens
    engine = Engine(model, prefix_cache=store)      # LLM(..., prefix_cache_gb=1.0) holds one
    store.stats()  # {"hits", "queries", "cached_tokens", "bytes", "evictions", ...}

A request whose prompt begins with tokens whose keys and values the store holds (an earlier
request's prompt, an earlier chat turn, a shared system prompt) gets them copied into its slot
and prefills only the rest; its first ``StepOutput`` says how many (``cached_tokens``). A prompt
the store holds to its end (the same prompt again) is taken whole and prefills nothing.

**The store.** Blocks of ``block_size`` tokens, each keyed exactly by (its parent block's id, its
tokens): a chain from a root, so a key names one sequence of tokens from position 0 and no hash
can collide. A block holds those positions' keys and values for every layer that owns a cache,
full and sliding alike (KV-shared layers own nothing). Least recently used blocks are evicted
first, and with them the blocks that continue them (unreachable without their parent), so that
``bytes`` (the tensors' own bytes) never exceeds ``max_bytes``. A match or a store touches the
blocks of its chain from its end back to its root: a chain's first blocks (a shared system
prompt) are the last to go.

**Exactness by construction.** A reused prefix must give the bits the request gets without the
store. Those bits depend on how the positions were computed, not only on the tokens: on the CPU
a sliding layer's keys sit at columns that depend on where the prefill chunk starts, and sdpa's
kernel sums a row in lanes that follow those columns; the quantized products switch kernels by
row count; a decode step is another product than a prefill chunk. Measured on this AVX2 machine:
bf16 tiny models, sdpa, a prompt of 70 tokens prefilled whole or split at 3, 4, 5, 8, 32 or 64
differs in its last logits by up to 0.2 (eager attention happened to agree); the real 270M in
gguf mode (float32) differs in its keys by 1e-4 between one chunk and two, and between prefill
and decode. So the store reuses only what a run without it computes identically:

* the reuse point is a multiple of the engine's ``prefill_chunk`` C, where a run without the store
  starts a chunk too: from there on both runs make the same calls (same chunks, same layouts, same
  row counts), and the engine's batch invariance makes a chunk's bits its own whatever shares its
  forward (so nothing here depends on the row-count boundaries ``invariance.py`` finds: reuse
  stays on under the emulated AVX-512 dispatch too);
* only whole prefill chunks ``[jC, (j+1)C)`` of prompts are stored as blocks: a run without the
  store computes exactly those; a prompt's last, shorter chunk and decoded tokens are not (the next
  chat turn reuses its conversation up to the last multiple of C of its previous prompt, and
  prefills the rest: the previous reply, the new message);
* a prompt's last chunk (shorter or whole) is stored apart as the prompt's *end*, with the
  final-normed hidden state of its last position, and only the very same prompt matches it: a run
  without the store computes that chunk from the same start with the same tokens, and chooses the
  first token from that state. So a repeated prompt (a retry, a regenerated answer, the same
  question again) runs no prefill forward at all and gets the same bits;
* chains have one root per way of computing: dtype, attention backend, ``prefill_chunk``, batch
  invariance, and whether the prompt carries image blocks (a multimodal request's text runs with
  a mask where a text request's runs without one). A store belongs to one model (``attach``).

The lead's first design reused any block boundary and decoded tokens too (block-granular, like
vLLM's and llama-server's caches); it is exact only where the kernels do not care how a sequence
was cut, which on the CPU they do. The price of exactness is granularity: up to C - 1 prompt
tokens plus the last reply are prefilled again. So the engine's default C is 256 (it was 512): the
real 270M (GGUF blocks, 1 thread, thread CPU time, medians of 3, load average 3-8) answers a
1,551-token prompt with 16 greedy tokens in 3.60 s at C = 256, 3.93 s at 512, 3.88 s at 128 and
4.14 s at 64, so the finer grid costs prefill nothing there; a request decoding meanwhile waits at
most 0.65 s between tokens instead of 1.33 s (the long prompt's first token 3.68 s against 3.74);
and where two requests of ``benchmarks/bench_server.py``'s shared-prefix workload share
1,531-1,535 tokens (its worst case), 1,280 are reused instead of 1,024: the second request, 16
greedy tokens, took 29% of the first's time instead of 43% (20% at C = 128, 16% at 64). A finer grid
costs more forward calls per prompt, and each quantized product of 32 rows or more dequantizes its
weight once per call: the products alone (a Q4 weight with offsets, 1 thread, thread CPU time) cost
per row 1.02 / 1.48 / 2.41 ms at 512 / 256 / 128 rows for 2560 x 10240 (a 4B model's MLP width),
0.048 / 0.061 / 0.103 ms for the 270M's 640 x 2048: the 270M's prefill hides that behind its
attention, a wider quantized model would not. With integer activations (AVX-512 VNNI's default) the
products do not dequantize and cost the same per row at 256 and 512 (0.298 / 0.294 ms for 2560 x
10240), so the engine's default (``default_prefill_chunk``) is 256 except for a model whose quantized
products take float activations: 512 there, prefilling faster and reusing coarser. ``block_size`` divides C;
blocks finer than C make eviction finer (a chain loses its last blocks first).

Reusing at block boundaries finer than C stays out: it would need every product and the attention
to give a row the same bits however the sequence is cut, and they do not (above; the quantized
products also switch from the row kernel to the dequantized BLAS product at 32 rows, and a
sliding layer's key columns move with the chunk's start).

**What is never stored or matched:** positions from a request's first media token on (image,
audio and video placeholders: their embeddings are not a function of the token ids), and any
request given an ``embedded=`` prompt (``stream``'s padded multimodal batch). The text before a
request's first media token is (when ``media=`` is given to the engine, which embeds it itself).

To keep every chunk of a prompt readable after its forward, an engine with a store widens its
sliding rings to hold C positions (``KVCache(min_ring=)``): the layers read the same keys, the
ring just forgets later. Decode steps store nothing: a store costs decode nothing.

Measured (``benchmarks/bench_prefix_cache.py``, 2-core AVX2 EPYC shared with other jobs, load
average 4-6, 1 thread, medians of 5 interleaved runs, commit de34e23): the real 270M (GGUF blocks,
float32), a 1,536-token prefix plus a 24-token question, then another question: time to the first
token 12.24 s, then 0.49 s (1,536 tokens reused; 0.04x), tokens equal to a run without the store
(13.14 s). Decode with and without a store (the step runs the same code either way): the 270M,
96 tokens after a 64-token prompt, 7 runs: 18.10 and 18.07 tok/s (1.002x); the tests' tiny E2B-like
model, 300 tokens, 9 runs: 54.38 and 54.01 tok/s (1.007x).

The store is used from the engine's thread only (``stats()`` may be read from anywhere).
"""

from __future__ import annotations

import itertools
import weakref
from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field

import torch

from ..cache import KVCache
from ..config import TextConfig
from ..model import Gemma
from ..model.inputs import MediaInputs

DEFAULT_BLOCK_SIZE = 32

# Per layer, a block's keys and values (Hkv, block_size, D), or None for a KV-shared layer.
LayerBlocks = list[tuple[torch.Tensor, torch.Tensor] | None]


@dataclass(eq=False)
class Block:
    """``block_size`` positions' keys and values; the chain's ``parent`` comes before them. A
    prompt's end (``store_end``) is a block of its own: its last chunk's positions (at most the
    prefill chunk, not whole blocks), and in ``final`` the final-normed hidden state of its last
    position, which chooses the prompt's first token."""

    id: int
    parent: int
    tokens: tuple[int, ...]
    layers: LayerBlocks
    nbytes: int
    children: set[int] = field(default_factory=set)
    final: torch.Tensor | None = None


class PrefixCache:
    """A byte-bounded, least-recently-used store of token blocks' keys and values (see the module
    docstring). ``max_bytes`` bounds the tensors held; 0 stores nothing."""

    def __init__(self, max_bytes: int, block_size: int = DEFAULT_BLOCK_SIZE):
        if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 0:
            raise ValueError(f"max_bytes must be an int >= 0, got {max_bytes!r}")
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size <= 0:
            raise ValueError(f"block_size must be a positive int, got {block_size!r}")
        self.max_bytes = max_bytes
        self.block_size = block_size
        self._blocks: OrderedDict[int, Block] = OrderedDict()  # least recently used first
        self._children: dict[tuple[int, tuple[int, ...]], int] = {}  # (parent id, tokens) -> block id
        self._ends: dict[tuple[int, tuple[int, ...]], int] = {}  # the same for prompts' ends
        self._roots: dict[Hashable, int] = {}
        self._root_ids: set[int] = set()
        self._ids = itertools.count()
        self._model: weakref.ref | None = None
        self.bytes = 0
        self.hits = 0
        self.queries = 0
        self.cached_tokens = 0
        self.evictions = 0
        self.stored_blocks = 0

    def stats(self) -> dict[str, int]:
        """Counters since the store was made: ``queries`` (requests that looked), ``hits`` (those
        that reused something), ``cached_tokens`` (prompt tokens not prefilled), ``bytes`` held
        (of ``max_bytes``), ``blocks`` and prompt ``ends`` held, ``stored_blocks`` and ``evictions``
        (both counting ends too)."""
        return {
            "hits": self.hits,
            "queries": self.queries,
            "cached_tokens": self.cached_tokens,
            "bytes": self.bytes,
            "max_bytes": self.max_bytes,
            "blocks": len(self._blocks) - len(self._ends),
            "ends": len(self._ends),
            "block_size": self.block_size,
            "stored_blocks": self.stored_blocks,
            "evictions": self.evictions,
        }

    def clear(self) -> None:
        """Drop every block (the counters stay)."""
        self._blocks.clear()
        self._children.clear()
        self._ends.clear()
        self.bytes = 0

    def attach(self, model: torch.nn.Module) -> None:
        """Tie the store to ``model``: keys and values are one model's, another model may not use
        it while that one lives (once it is gone, the store is emptied for the next). A model whose
        weights change in place (a quantization transform) must not keep its store: ``clear()``."""
        held = None if self._model is None else self._model()
        if held is model:
            return
        if held is not None:
            raise ValueError(
                "this PrefixCache holds another model's keys and values: give each model its own store"
            )
        if self._model is not None:
            self.clear()  # the model they were computed by is gone
        self._model = weakref.ref(model)

    def root(self, signature: Hashable) -> int:
        """The id chains computed one way start from (see the module docstring)."""
        if signature not in self._roots:
            self._roots[signature] = next(self._ids)
            self._root_ids.add(self._roots[signature])
        return self._roots[signature]

    # ── matching ─────────────────────────────────────────────────────────────────────────────

    def match(
        self, root: int, tokens: Sequence[int], limit: int, unit: int, whole: bool = False
    ) -> list[Block]:
        """The longest chain of stored blocks spelling ``tokens[:n]``, for the largest ``n <= limit``
        that is a multiple of ``unit`` (the engine's prefill chunk); counted in ``stats``. With
        ``whole``, where that chain reaches ``limit`` and the rest of ``tokens`` is a stored prompt
        end there (``store_end``), the end block follows: all of ``tokens``."""
        size = self.block_size
        if unit % size:
            raise ValueError(f"unit ({unit}) must be a multiple of block_size ({size})")
        chain: list[Block] = []
        parent = root
        for start in range(0, limit - size + 1, size):
            found = self._children.get((parent, tuple(tokens[start : start + size])))
            if found is None:
                break
            chain.append(self._blocks[found])
            parent = found
        if chain:
            self._touch(chain[-1])
        chain = chain[: len(chain) * size // unit * unit // size]
        if whole and len(chain) * size == limit:
            found = self._ends.get((chain[-1].id if chain else root, tuple(tokens[limit:])))
            if found is not None:
                chain.append(self._blocks[found])
                self._touch(chain[-1])
        self.queries += 1
        if chain:
            self.hits += 1
            self.cached_tokens += sum(len(block.tokens) for block in chain)
        return chain

    # ── storing ──────────────────────────────────────────────────────────────────────────────

    def store(
        self, parent: int, tokens: Sequence[int], start: int, read: Callable[[int, int], LayerBlocks]
    ) -> int | None:
        """Store ``tokens`` (positions ``start``, ``start + 1``, ... of a chain that continues block
        ``parent``) as whole blocks, each block's keys and values read by ``read(first, end)``
        (positions) unless already held. Returns the id of the chain's new last block, or None
        when the chain cannot go on (its parent was evicted, or a block is over ``max_bytes``)."""
        size = self.block_size
        if len(tokens) % size:
            raise ValueError(f"{len(tokens)} tokens are not whole blocks of {size}")
        if not self._holds(parent):
            return None  # evicted meanwhile: what follows could never be matched
        if parent in self._blocks:
            self._touch(self._blocks[parent])  # in use: the last to be evicted by its own blocks
        last = None
        for offset in range(0, len(tokens), size):
            block_tokens = tuple(tokens[offset : offset + size])
            found = self._children.get((parent, block_tokens))
            if found is None:
                found = self._insert(parent, block_tokens, read(start + offset, start + offset + size))
                if found is None:
                    return None
            parent = last = found
        if last is not None:
            self._touch(self._blocks[last])
        return parent

    def store_end(
        self,
        parent: int,
        tokens: Sequence[int],
        start: int,
        read: Callable[[int, int], LayerBlocks],
        final: torch.Tensor,
    ) -> None:
        """Store a prompt's end: its last chunk ``tokens`` (positions ``start``, ... after block
        ``parent``, which a chunk start ends), their keys and values read by ``read(start, end)``,
        and ``final``, the final-normed hidden state of its last position. A request whose prompt
        is that chain and these tokens then takes all of it (``match(whole=True)``) and chooses its
        first token from ``final``, with no forward at all."""
        key = (parent, tuple(tokens))
        if not self._holds(parent):
            return
        if key in self._ends:
            self._touch(self._blocks[self._ends[key]])
            return
        if parent in self._blocks:
            self._touch(self._blocks[parent])
        found = self._insert(parent, key[1], read(start, start + len(tokens)), final.clone())
        if found is not None:
            self._touch(self._blocks[found])

    def _insert(
        self, parent: int, tokens: tuple[int, ...], layers: LayerBlocks, final: torch.Tensor | None = None
    ) -> int | None:
        nbytes = sum(k.nbytes + v.nbytes for k, v in filter(None, layers))
        nbytes += 0 if final is None else final.nbytes
        if nbytes > self.max_bytes:
            return None
        if self.bytes + nbytes > self.max_bytes:
            # The chain being stored was touched last: if the least recently used block is its own,
            # nothing else is left to evict, and it stops here rather than eat its own beginning.
            own = self._path(parent)
            while self.bytes + nbytes > self.max_bytes:
                oldest = next(iter(self._blocks))
                if oldest in own:
                    return None
                self._evict(oldest)
        block = Block(next(self._ids), parent, tokens, layers, nbytes, final=final)
        self._blocks[block.id] = block
        (self._children if final is None else self._ends)[parent, tokens] = block.id
        if parent in self._blocks:
            self._blocks[parent].children.add(block.id)
        self.bytes += nbytes
        self.stored_blocks += 1
        return block.id

    def _path(self, block_id: int) -> set[int]:
        """The ids of a block and the blocks before it in its chain."""
        path = set()
        while block_id in self._blocks:
            path.add(block_id)
            block_id = self._blocks[block_id].parent
        return path

    def _holds(self, block_id: int) -> bool:
        return block_id in self._blocks or block_id in self._root_ids

    def _evict(self, block_id: int) -> None:
        """Drop a block and every block that continues it (a loop, not recursion: chains of a
        long context are thousands of blocks deep)."""
        first = self._blocks[block_id]
        if first.parent in self._blocks:
            self._blocks[first.parent].children.discard(block_id)
        doomed = [block_id]
        while doomed:
            block = self._blocks.pop(doomed.pop())
            doomed.extend(block.children)
            del (self._children if block.final is None else self._ends)[block.parent, block.tokens]
            self.bytes -= block.nbytes
            self.evictions += 1

    def _touch(self, block: Block) -> None:
        """Mark a chain used, its end first and its root last (the most recently used)."""
        while True:
            self._blocks.move_to_end(block.id)
            parent = self._blocks.get(block.parent)
            if parent is None:
                return
            block = parent


def prefix_cache_of(gib: float) -> PrefixCache | None:
    """A store of ``gib`` GiB (``LLM(prefix_cache_gb=)``, ``serve --prefix-cache-gb``), None for 0."""
    if not gib >= 0:
        raise ValueError(f"prefix_cache_gb must be >= 0 (0 turns the prefix cache off), got {gib}")
    size = int(gib * 2**30)
    return PrefixCache(size) if size > 0 else None


def load_chain(cache: KVCache, slot: int, chain: Sequence[Block], config: TextConfig) -> int:
    """Load a matched chain into free slot ``slot`` of ``cache``: every position for full layers,
    the blocks that cover the last ``cache.ring`` positions for sliding ones. Returns its length."""
    if not chain:
        return 0
    length = sum(len(block.tokens) for block in chain)
    first, covered = len(chain), 0  # the last blocks, back to ring positions (or the chain's start)
    while first > 0 and covered < cache.ring:
        first -= 1
        covered += len(chain[first].tokens)
    tail = chain[first:]
    layers: LayerBlocks = []
    for index, spec in enumerate(config.layers):
        if chain[0].layers[index] is None:
            layers.append(None)
            continue
        blocks = tail if spec.is_sliding else chain
        keys = torch.cat([block.layers[index][0] for block in blocks], dim=1)
        values = torch.cat([block.layers[index][1] for block in blocks], dim=1)
        layers.append((keys, values))
    cache.load_prefix(slot, layers, length)
    return length


def media_start(model: Gemma, prompt: Sequence[int], media: MediaInputs | None) -> int:
    """The position of the prompt's first media token (its length without media): image, video and
    audio placeholders, whose embeddings are the media's, not a function of the token ids."""
    if media is None:
        return len(prompt)
    ids = torch.tensor(prompt)
    special = model.text_ids(ids) != ids  # gemma4 layouts: placeholders read as the pad token
    audio, vision = model.config.gemma3n_audio, model.config.gemma3n_vision
    if audio is not None:
        special |= ids == audio.audio_token_id
    if vision is not None:
        special |= ids == vision.image_token_id
    types = media.mm_token_type_ids
    if types is not None:
        types = types.reshape(-1).cpu()
        if types.shape != ids.shape:
            return 0  # media that do not fit the prompt: nothing stored (its prefill fails, alone)
        special |= types != 0
    found = special.nonzero()
    return int(found[0, 0]) if len(found) else len(prompt)
