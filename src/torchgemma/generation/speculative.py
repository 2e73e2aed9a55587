"""Speculative decoding: drafters propose tokens, the engine verifies them in one forward pass.

    engine = Engine(model, speculative="ngram")                         # prompt lookup, 4 tokens
    engine = Engine(model, speculative={"method": "ngram", "num_tokens": 6})
    engine = Engine(model, speculative={"method": "mtp", "model": drafter_or_source, "num_tokens": 4})

Each decoding step, every decoding request may carry up to ``num_tokens`` draft tokens; one
forward pass scores them, with the ordinary decode rows of the requests that carry none, and each
request keeps the drafts its own choice agrees with, plus the target's next token; the rest are
rolled back from its cache slot (``KVCache.rollback``, ``verify.py``).

**The drafter interface.** A ``Drafter`` sees each request as a ``DraftRequest``: its tokens
(prompt and output; ``tokens[-1]`` is the token the target reads next, not yet in the cache: the
slot holds exactly ``tokens[:-1]`` when ``propose`` is called, rejected drafts already rolled
back), how many tokens to propose at most, its slot in the target's ``KVCache`` and, when the
drafter's ``needs_hidden`` is True, the target's last hidden state **after the final norm** (what
the LM head reads; transformers' ``hidden_states[-1]``, which it ties to ``last_hidden_state``) at
the position that produced ``tokens[-1]``. The brief asked for the state before the final norm;
transformers' Gemma 4 assistant driver (``SinglePositionMultiTokenCandidateGenerator``) feeds the
drafter the normed one, so that is what is passed. ``propose`` returns each request's draft tokens
(at most ``num_tokens``; fewer or none are fine). Drafts are deterministic given what the drafter
sees (prompt lookup; the MTP drafter's argmax): the draft distribution ``q`` is a point mass, which
is what the rejection rule below uses. A drafter needs no rollback: whatever state it keeps must be
a function of ``tokens`` (and of the target's cache, which the engine has rolled back), and rejected
drafts never enter ``tokens``. Optionally a drafter has ``min_ring(max_rollback) -> int``: the
sliding-ring width it needs to read (the MTP drafter reads W + 1 positions, the target only W - 1);
the engine makes its cache that wide.

**Prompt lookup** (``NgramDrafter``): the tokens that followed the latest earlier occurrence of the
longest suffix n-gram (n from 3 down to 1) of prompt and output, as transformers' prompt lookup
and vLLM's ngram proposer; a continuation that reaches the end of the sequence repeats the span
(so a loop continues). Each request's index maps n-grams to their latest end and is updated with
the new tokens only: a step costs O(new tokens), not O(length).

**Adaptive drafting** (``Adaptive``): a request whose drafts are rejected drafts fewer tokens (as
many as would all be accepted with probability >= 1/2 at its recent rate), and below ``STOP_RATE``
stops drafting for a while (1, 2, 4, ... up to ``MAX_PAUSE`` steps), so that
text with nothing to copy is slowed little by verify passes that keep one token (every draft wrong,
on the real 270M: 0.97x at 1 thread, 0.93x at 2; benchmarks/README.md).

**Exactness.** Greedy output equals the output without speculation token for token: each verify
row's logits are chosen from exactly as a decode step's (the same sampling code, history including
the accepted drafts), and each query of the verify pass attends as a one-token call at its position
would (``model.attention.attend_apart``: the same keys in the same order, the same kernel: bits
equal). The products (projections, MLP, head) see 1 + k rows per request instead of 1, so the bits
are equal where the kernels are row-invariant: the quantized row kernels below ``DENSE_ROWS`` rows
(int8/int4/GGUF blocks: the logits are bit-identical, tested; below ``INT_ROWS`` where projections take
integer activations, so verify then drafts at most ``INT_ROWS - 2`` tokens and runs request by request
where a pass would reach that many rows: ``verify._row_limit``), bf16 wherever ``RowProbe`` finds no
boundary. A ``batch_invariant`` engine (bf16 on the CPU by default) keeps every verify call below
the probe's first boundary (fewer drafts, or request by request), and drafts nothing where that
boundary is 2 rows (tiny bf16 models on AVX-512 CPUs, whose small products switch to oneDNN at 2
rows): there, bits equal always. Elsewhere (float32 with MKL's dense GEMM, which rounds one row,
2-3 rows and 4+ rows differently; batches of 32+ rows of a quantized model) the logits differ from
a decode step's by float32 rounding, as batching requests already makes them differ: the tokens are
identical except where two logits tie to within that rounding.

**Sampling** keeps the output distribution: a draft ``x`` is accepted with probability ``p(x)``
(``min(1, p/q)`` with ``q`` a point mass), ``p`` the request's own distribution after every filter
and penalty (``sampling.process_logits``, history including the accepted drafts); on rejection the
token is drawn from ``p`` with ``x`` removed, renormalised; after ``k`` accepted drafts the next
token is drawn from the last row as usual. All draws use the request's generator, so a seeded
request reproduces (a different sequence of draws than without speculation: the same distribution,
not the same samples). Constrained requests (``constraint=``) do not speculate.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch

from ..cache import KVCache

DEFAULT_NUM_TOKENS = 4
MAX_NUM_TOKENS = 16  # per request and step: a verify pass of 17 rows at most
MAX_NGRAM, MIN_NGRAM = 3, 1
# Adaptive drafting: the recent acceptance rate (accepted / drafted, an exponential average with
# this weight on the newest pass) below which a request stops drafting for a while.
RATE_WEIGHT = 0.5
STOP_RATE = 0.3
KEEP_CHANCE = 0.5
MAX_PAUSE = 64
METHODS = ("ngram", "mtp")


@dataclass
class DraftRequest:
    """What a drafter sees of one decoding request (see the module docstring)."""

    tokens: Sequence[int]  # prompt + generated tokens; tokens[-1] is the token the target reads next
    num_tokens: int  # propose at most this many
    slot: int  # the request's slot in the target's KVCache (which holds tokens[:-1])
    # The target's last hidden state after the final norm, at the position that produced tokens[-1],
    # shape (H,): when the drafter's needs_hidden is True (else None).
    hidden: torch.Tensor | None = None


@runtime_checkable
class Drafter(Protocol):
    """Proposes draft tokens for a batch of requests (see the module docstring)."""

    needs_hidden: bool

    def propose(self, requests: list[DraftRequest], cache: KVCache) -> list[list[int]]: ...


# ── prompt lookup ────────────────────────────────────────────────────────────────────────────


class NgramIndex:
    """One sequence's n-grams (n in [min_n, max_n]) mapped to the end of their latest occurrence
    that has a following token; extended with new tokens only."""

    def __init__(self, max_n: int = MAX_NGRAM, min_n: int = MIN_NGRAM):
        self.max_n, self.min_n = max_n, min_n
        self.tokens: list[int] = []
        self.latest: dict[tuple[int, ...], int] = {}

    def extend(self, tokens: Sequence[int]) -> None:
        """Take the sequence's new tokens (``tokens`` is the whole sequence, of which the index
        holds a prefix)."""
        old = len(self.tokens)
        self.tokens.extend(tokens[old:])
        seq, latest = self.tokens, self.latest
        # The n-gram ending just before position e (exclusive) is followed by seq[e]: indexed once
        # seq[e] exists, i.e. for e up to len - 1.
        for e in range(max(old, 1), len(seq)):
            for n in range(self.min_n, min(self.max_n, e) + 1):
                latest[tuple(seq[e - n : e])] = e

    def propose(self, count: int) -> list[int]:
        """Up to ``count`` tokens after the latest earlier occurrence of the longest suffix n-gram."""
        seq = self.tokens
        length = len(seq)
        for n in range(min(self.max_n, length), self.min_n - 1, -1):
            end = self.latest.get(tuple(seq[length - n :]))
            if end is not None:
                out: list[int] = []
                for j in range(count):
                    i = end + j  # past the end, the span repeats (a loop continues)
                    out.append(seq[i] if i < length else out[i - length])
                return out
        return []


class NgramDrafter:
    """Prompt lookup (see the module docstring). Keeps an ``NgramIndex`` per cache slot, used while
    the slot's sequence extends the one indexed (a new request in the slot starts a new index)."""

    needs_hidden = False

    def __init__(self, max_n: int = MAX_NGRAM, min_n: int = MIN_NGRAM):
        if not 1 <= min_n <= max_n:
            raise ValueError(f"n-gram sizes must satisfy 1 <= min_n <= max_n, got {min_n} and {max_n}")
        self.max_n, self.min_n = max_n, min_n
        self._indexes: dict[int, NgramIndex] = {}

    def propose(self, requests: list[DraftRequest], cache: KVCache) -> list[list[int]]:
        return [self._index(r.slot, r.tokens).propose(r.num_tokens) for r in requests]

    def _index(self, slot: int, tokens: Sequence[int]) -> NgramIndex:
        index = self._indexes.get(slot)
        held = 0 if index is None else len(index.tokens)
        if index is None or held > len(tokens) or list(tokens[:held]) != index.tokens:
            index = self._indexes[slot] = NgramIndex(self.max_n, self.min_n)
        index.extend(tokens)
        return index


# ── adaptive drafting ────────────────────────────────────────────────────────────────────────


@dataclass
class Adaptive:
    """One request's drafting budget from its recent acceptance rate ``a`` (accepted / drafted, a
    cautious estimate of each draft's chance): the most drafts ``j`` (up to ``num_tokens``) whose
    chance of all being accepted, ``a ** j``, is still at least ``KEEP_CHANCE`` (a draft costs a
    verify row whether or not it is kept); below ``STOP_RATE`` no drafts for ``pause`` steps, the
    pause doubling each time (up to ``MAX_PAUSE``) until a pass accepts again."""

    rate: float = 1.0
    wait: int = 0
    pause: int = 1

    def budget(self, most: int) -> int:
        """How many tokens to draft this step (0: none)."""
        if self.wait > 0:
            self.wait -= 1
            return 0
        if self.rate >= 1.0:
            return most
        return max(1, min(most, math.floor(math.log(KEEP_CHANCE) / math.log(self.rate))))

    def update(self, drafted: int, accepted: int) -> None:
        if drafted <= 0:
            return
        self.rate = (1 - RATE_WEIGHT) * self.rate + RATE_WEIGHT * accepted / drafted
        if self.rate < STOP_RATE:
            self.wait, self.pause = self.pause, min(2 * self.pause, MAX_PAUSE)
            self.rate = STOP_RATE  # tried again at the lowest budget after the pause
        elif accepted:
            self.pause = 1


# ── configuration ────────────────────────────────────────────────────────────────────────────


@dataclass
class SpeculativeStats:
    """Counters of an engine's speculation: tokens drafted, drafts accepted, verify passes (forward
    passes that scored at least one draft)."""

    drafted_tokens: int = 0
    accepted_tokens: int = 0
    verify_passes: int = 0

    @property
    def acceptance(self) -> float:
        return self.accepted_tokens / self.drafted_tokens if self.drafted_tokens else 0.0


@dataclass
class SpeculativeConfig:
    """A parsed ``speculative=`` setting: the method, the most tokens drafted per request and step,
    and the drafter."""

    method: str
    num_tokens: int
    drafter: Any = field(repr=False)

    def min_ring(self, max_rollback: int) -> int:
        """Sliding-ring width the drafter reads (0: what the target needs anyway)."""
        wanted = getattr(self.drafter, "min_ring", None)
        return int(wanted(max_rollback)) if callable(wanted) else 0


def speculative_config(speculative: Any, target=None) -> SpeculativeConfig | None:
    """``speculative=`` as given to ``Engine``, ``generate``, ``stream`` or ``LLM``, checked:
    None (off), ``"ngram"``, ``{"method": "ngram", "num_tokens": k}``, ``{"method": "mtp",
    "model": SOURCE_OR_DRAFTER, "num_tokens": k}`` or a ``SpeculativeConfig``. ``target``: the model
    drafted for (an MTP source is loaded against it)."""
    if speculative is None:
        return None
    if isinstance(speculative, SpeculativeConfig):
        drafter = speculative.drafter
        if isinstance(drafter, NgramDrafter):  # each engine its own indexes (they are per slot)
            return replace(speculative, drafter=NgramDrafter(drafter.max_n, drafter.min_n))
        return speculative
    if isinstance(speculative, str):
        speculative = {"method": speculative}
    if not isinstance(speculative, Mapping):
        raise TypeError(
            f"speculative must be 'ngram', a dict such as {{'method': 'ngram', 'num_tokens': 4}} or None, "
            f"got {type(speculative).__name__}"
        )
    unknown = set(speculative) - {"method", "num_tokens", "model"}
    if unknown:
        raise ValueError(
            f"speculative: unknown key(s) {sorted(unknown)}; the keys are 'method', 'num_tokens', 'model'"
        )
    method = speculative.get("method")
    if method not in METHODS:
        raise ValueError(f"speculative: method must be one of {list(METHODS)}, got {method!r}")
    k = speculative.get("num_tokens", DEFAULT_NUM_TOKENS)
    if isinstance(k, bool) or not isinstance(k, int):
        raise TypeError(f"speculative: num_tokens must be an integer, got {k!r}")
    if not 1 <= k <= MAX_NUM_TOKENS:
        raise ValueError(f"speculative: num_tokens must be in [1, {MAX_NUM_TOKENS}], got {k}")
    source = speculative.get("model")
    if method == "ngram":
        if source is not None:
            raise ValueError("speculative: method 'ngram' drafts from the text itself and takes no 'model'")
        return SpeculativeConfig("ngram", k, NgramDrafter())
    if source is None:
        raise ValueError("speculative: method 'mtp' needs 'model', the drafter (a Drafter or its checkpoint)")
    if isinstance(source, (str, Path)):
        if target is None:
            raise ValueError("speculative: an MTP drafter checkpoint is loaded against its target model")
        source = load_drafter(source, target)
    if not isinstance(source, Drafter):
        raise TypeError(
            f"speculative: 'model' must be a checkpoint (path or hub id) or a Drafter (needs_hidden and "
            f"propose(requests, cache)), got {type(source).__name__}"
        )
    return SpeculativeConfig("mtp", k, source)


def load_drafter(source: str | Path, target) -> Drafter:
    """The Gemma 4 assistant (MTP) drafter of ``source`` (folder, hub id or GGUF file) for
    ``target`` (``generation.mtp.load_drafter``: the pair is checked before any weight is read)."""
    from .mtp import load_drafter as load

    return load(source, target)


def parse_cli(value: str | None, num_tokens: int | None) -> dict | None:
    """``--speculative ngram|mtp:SOURCE`` and ``--num-speculative-tokens K`` as ``speculative=``."""
    if value is None:
        if num_tokens is not None:
            raise ValueError("--num-speculative-tokens goes with --speculative")
        return None
    method, _, source = value.partition(":")
    if method not in METHODS or (method == "mtp") != bool(source):
        raise ValueError(f"--speculative must be 'ngram' or 'mtp:SOURCE', got {value!r}")
    spec: dict[str, Any] = {"method": method}
    if source:
        spec["model"] = source
    if num_tokens is not None:
        spec["num_tokens"] = num_tokens
    return spec
