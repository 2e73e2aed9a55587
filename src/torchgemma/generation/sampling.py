"""Choosing the next token: small pure functions over a batch of logits ``(B, V)``.

Each filter has the semantics of the transformers 5.23 logits processor of the same purpose
(``generation/logits_process.py``) and ``next_token`` applies them in the order transformers'
``generate`` builds them: repetition penalty (which also applies to greedy decoding), then, when
sampling, temperature, top-k, top-p and min-p, then a multinomial draw from the softmax. Logits are
processed in float32, as transformers casts them before its processors.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

NEG_INF = float("-inf")


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens. ``temperature == 0`` is greedy; a filter set to None is off.

    ``top_k = 0`` and ``top_p = 1`` are off too, and ``repetition_penalty = 1`` changes nothing,
    as in transformers. ``seed`` gives each request (each row of a batch) its own generator, so it
    draws what it would draw alone; None draws from torch's global RNG.
    ``GenerationConfig.sampling`` fills what a caller leaves unset from a checkpoint's defaults.
    """

    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    seed: int | None = None

    def __post_init__(self) -> None:
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0 (0 is greedy), got {self.temperature}")
        if self.top_k is not None and (
            isinstance(self.top_k, bool) or int(self.top_k) != self.top_k or self.top_k < 0
        ):
            raise ValueError(f"top_k must be a non-negative integer (0 is off), got {self.top_k}")
        if self.top_p is not None and not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.min_p is not None and not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.repetition_penalty is not None and not self.repetition_penalty > 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def apply_repetition_penalty(
    logits: torch.Tensor,
    history: torch.Tensor,
    penalty: float,
    history_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Make every token already in ``history`` (B, S) less likely: divide a positive logit by
    ``penalty``, multiply a negative one. Each token is penalised once however often it occurred.

    ``history_mask`` (B, S) marks the entries that count (False for left padding, which transformers'
    generate leaves out of the penalty).
    """
    vocab = logits.shape[-1]
    # One extra column absorbs ignored entries (and ids beyond the logits, which cannot be generated).
    ids = history.clamp(max=vocab)
    if history_mask is not None:
        ids = ids.masked_fill(~history_mask.bool(), vocab)
    seen = torch.zeros(logits.shape[0], vocab + 1, dtype=torch.bool, device=logits.device)
    seen.scatter_(1, ids, True)
    penalised = torch.where(logits < 0, logits * penalty, logits / penalty)
    return torch.where(seen[:, :vocab], penalised, logits)


def apply_temperature(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    return logits / temperature


def top_k_filter(logits: torch.Tensor, k: int) -> torch.Tensor:
    """Keep the ``k`` largest logits (and any tied with the k-th); the rest become -inf."""
    k = min(k, logits.shape[-1])
    kth = torch.topk(logits, k, dim=-1).values[..., -1:]
    return logits.masked_fill(logits < kth, NEG_INF)


def top_p_filter(logits: torch.Tensor, p: float) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose probabilities sum to at least ``p``.

    Works from the least likely end, as transformers does: a token goes when the probability mass at
    or below it is at most ``1 - p``; the most likely token always stays.
    """
    ascending, order = torch.sort(logits, descending=False)
    mass_below = ascending.softmax(dim=-1).cumsum(dim=-1)
    drop_sorted = mass_below <= 1 - p
    drop_sorted[..., -1] = False
    drop = drop_sorted.scatter(-1, order, drop_sorted)
    return logits.masked_fill(drop, NEG_INF)


def min_p_filter(logits: torch.Tensor, min_p: float) -> torch.Tensor:
    """Drop tokens less likely than ``min_p`` times the most likely token's probability."""
    probs = logits.softmax(dim=-1)
    drop = probs < min_p * probs.amax(dim=-1, keepdim=True)
    # The most likely token always stays (min_p = 1 with a tie would otherwise keep it anyway).
    drop.scatter_(-1, probs.argmax(dim=-1, keepdim=True), False)
    return logits.masked_fill(drop, NEG_INF)


def process_logits(
    logits: torch.Tensor,
    params: SamplingParams,
    history: torch.Tensor | None = None,
    history_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """The scores ``next_token`` draws from: float32 logits after every active filter, in order."""
    scores = logits.float()
    if params.repetition_penalty not in (None, 1.0):
        if history is None:
            raise ValueError("repetition_penalty needs the token history")
        scores = apply_repetition_penalty(scores, history, params.repetition_penalty, history_mask)
    if params.greedy:
        return scores
    if params.temperature != 1.0:
        scores = apply_temperature(scores, params.temperature)
    if params.top_k:
        scores = top_k_filter(scores, int(params.top_k))
    if params.top_p is not None and params.top_p < 1.0:
        scores = top_p_filter(scores, params.top_p)
    if params.min_p is not None:
        scores = min_p_filter(scores, params.min_p)
    return scores


def next_token(
    logits: torch.Tensor,
    params: SamplingParams,
    *,
    generator: torch.Generator | None = None,
    history: torch.Tensor | None = None,
    history_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """One token per row (B,): the argmax when greedy, else a draw with ``generator``.

    Without a generator the draw uses torch's global RNG, so ``torch.manual_seed(s)`` before
    transformers' ``generate`` and ``generator = torch.Generator().manual_seed(s)`` here draw alike.
    """
    scores = process_logits(logits, params, history, history_mask)
    if params.greedy:
        return scores.argmax(dim=-1)
    probs = scores.softmax(dim=-1)
    return torch.multinomial(probs, num_samples=1, generator=generator).squeeze(1)
