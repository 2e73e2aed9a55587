"""Choosing the next token: small pure functions over a batch of logits ``(B, V)``.

Each filter has the semantics of the transformers 5.23 logits processor of the same purpose
(``generation/logits_process.py``) and ``next_token`` applies them in the order transformers'
``generate`` builds them: logit bias (``SequenceBiasLogitsProcessor``'s place), repetition penalty
(both also apply to greedy decoding), OpenAI's presence and frequency penalties (over the generated
tokens, as OpenAI and vLLM define them; transformers has none), then, when sampling, temperature,
top-k, top-p and min-p, then a multinomial draw from the softmax. Logits are processed in float32, as transformers casts them
before its processors.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import torch

NEG_INF = float("-inf")

# Below this temperature a request decodes greedily. Sampling at T draws a token other than the
# argmax only against logits within a few T of it, so below 0.01 the draw is the argmax but for
# near-ties; and dividing float32 logits by a temperature near 0 overflows to inf, whose softmax
# is NaN (temperature=1e-40 did). vLLM clamps such temperatures to 0.01 for the same reason.
MIN_TEMPERATURE = 1e-2
# OpenAI's logit_bias range. The lowest value bans the token (its logit becomes -inf, as
# transformers' bad_words_ids and suppress_tokens do): adding -100 alone would not ban it at a
# high temperature (-100 / T), and OpenAI says -100 "should result in a ban".
MAX_LOGIT_BIAS = 100.0
# A repetition penalty further from 1 than this only saturates (a seen token becomes certain or
# impossible); near 0 or infinity it overflows float32 logits to inf (transformers only asks > 0).
MAX_REPETITION_PENALTY = 100.0
# OpenAI's range for presence_penalty and frequency_penalty.
MAX_OCCURRENCE_PENALTY = 2.0


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens. ``temperature == 0`` is greedy; a filter set to None is off.

    ``top_k = 0`` and ``top_p = 1`` are off too, and ``repetition_penalty = 1`` changes nothing,
    as in transformers. A temperature below ``MIN_TEMPERATURE`` (0.01) is greedy as well: the
    limit of sampling as T -> 0, and what a client sending 0.001 means. ``seed`` gives each request
    (each row of a batch) its own generator, so it draws what it would draw alone; None draws from
    torch's global RNG. ``logit_bias`` maps token ids to a bias in [-100, 100] added to their logits
    before anything else (OpenAI's field; -100 bans the token); it is kept as sorted (id, bias)
    pairs. ``presence_penalty`` and ``frequency_penalty`` (OpenAI's, in [-2, 2]) subtract from a
    token's logit once if it was generated already, and once per time it was. ``GenerationConfig.sampling`` fills what a caller leaves unset from a checkpoint's
    defaults.

    Every value that could turn finite logits into NaN or inf is refused here, with the field's name.
    """

    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    seed: int | None = None
    logit_bias: Mapping[int, float] | tuple[tuple[int, float], ...] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None

    def __post_init__(self) -> None:
        if not (self.temperature >= 0 and math.isfinite(self.temperature)):
            raise ValueError(
                f"temperature must be a finite number >= 0 (0 is greedy), got {self.temperature}"
            )
        if self.top_k is not None and (
            isinstance(self.top_k, bool) or int(self.top_k) != self.top_k or self.top_k < 0
        ):
            raise ValueError(f"top_k must be a non-negative integer (0 is off), got {self.top_k}")
        if self.top_p is not None and not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.min_p is not None and not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.repetition_penalty is not None and not (
            1 / MAX_REPETITION_PENALTY <= self.repetition_penalty <= MAX_REPETITION_PENALTY
        ):
            raise ValueError(
                f"repetition_penalty must be in [{1 / MAX_REPETITION_PENALTY}, {MAX_REPETITION_PENALTY:g}] "
                f"(1 is off), got {self.repetition_penalty}"
            )
        if self.logit_bias is not None:
            object.__setattr__(self, "logit_bias", _checked_bias(self.logit_bias) or None)
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if value is not None and not -MAX_OCCURRENCE_PENALTY <= value <= MAX_OCCURRENCE_PENALTY:
                raise ValueError(f"{name} must be in [-2, 2] (0 is off), got {value}")

    @property
    def penalizes_output(self) -> bool:
        """Whether the generated tokens change the scores (presence or frequency penalty)."""
        return bool(self.presence_penalty) or bool(self.frequency_penalty)

    @property
    def greedy(self) -> bool:
        return self.temperature < MIN_TEMPERATURE


def _checked_bias(bias) -> tuple[tuple[int, float], ...]:
    """``logit_bias`` as sorted (id, bias) pairs, each checked; the vocabulary's size is checked
    where it is known (``Engine.add_request``)."""
    pairs = bias.items() if isinstance(bias, Mapping) else bias
    checked = {}
    for token, value in pairs:
        if isinstance(token, bool) or not isinstance(token, int) or token < 0:
            raise ValueError(f"logit_bias keys must be token ids (integers >= 0), got {token!r}")
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"logit_bias[{token}] must be a number, got {value!r}")
        if not -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS:
            raise ValueError(
                f"logit_bias[{token}] must be in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}], got {value}"
            )
        checked[token] = float(value)
    return tuple(sorted(checked.items()))


def apply_logit_bias(logits: torch.Tensor, bias: tuple[tuple[int, float], ...]) -> torch.Tensor:
    """Add each (id, bias) to that id's logit in every row; a bias of -100 bans the id (-inf)."""
    vocab = logits.shape[-1]
    ids = [token for token, _ in bias]
    if ids and max(ids) >= vocab:
        raise ValueError(f"logit_bias names token {max(ids)}, outside the vocabulary of {vocab} tokens")
    index = torch.tensor(ids, dtype=torch.long, device=logits.device)
    values = torch.tensor([value for _, value in bias], dtype=logits.dtype, device=logits.device)
    values = values.masked_fill(values <= -MAX_LOGIT_BIAS, NEG_INF)
    return logits.index_add(-1, index, values.expand(logits.shape[0], -1))


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


def apply_occurrence_penalties(
    logits: torch.Tensor, generated: torch.Tensor, presence: float | None, frequency: float | None
) -> torch.Tensor:
    """OpenAI's penalties: each token's logit minus ``frequency`` times the number of times it is in
    ``generated`` (B, S), minus ``presence`` if it is there at all."""
    vocab = logits.shape[-1]
    counts = torch.zeros(logits.shape[0], vocab + 1, dtype=logits.dtype, device=logits.device)
    counts.scatter_add_(1, generated.clamp(max=vocab), torch.ones_like(generated, dtype=logits.dtype))
    counts = counts[:, :vocab]
    penalty = counts * (frequency or 0.0) + (counts > 0).to(logits.dtype) * (presence or 0.0)
    return logits - penalty


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
    generated: torch.Tensor | None = None,
) -> torch.Tensor:
    """The scores ``next_token`` draws from: float32 logits after every active filter, in order.
    ``history`` (B, S): prompt and generated tokens (the repetition penalty's); ``generated``: the
    generated ones alone (the presence and frequency penalties')."""
    scores = logits.float()
    if params.logit_bias:
        scores = apply_logit_bias(scores, params.logit_bias)
    if params.repetition_penalty not in (None, 1.0):
        if history is None:
            raise ValueError("repetition_penalty needs the token history")
        scores = apply_repetition_penalty(scores, history, params.repetition_penalty, history_mask)
    if params.penalizes_output:
        if generated is None:
            raise ValueError("presence_penalty and frequency_penalty need the generated tokens")
        scores = apply_occurrence_penalties(
            scores, generated, params.presence_penalty, params.frequency_penalty
        )
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
    generated: torch.Tensor | None = None,
) -> torch.Tensor:
    """One token per row (B,): the argmax when greedy, else a draw with ``generator``.

    Without a generator the draw uses torch's global RNG, so ``torch.manual_seed(s)`` before
    transformers' ``generate`` and ``generator = torch.Generator().manual_seed(s)`` here draw alike.
    """
    scores = process_logits(logits, params, history, history_mask, generated)
    check_scores(scores)
    if params.greedy:
        return scores.argmax(dim=-1)
    probs = scores.softmax(dim=-1)
    return torch.multinomial(probs, num_samples=1, generator=generator).squeeze(1)


def check_scores(scores: torch.Tensor) -> None:
    """Refuse rows with nothing to choose from: NaN anywhere (argmax would pick it, multinomial
    fails), +inf, or every token at -inf (all banned). One reduction per row: NaN propagates
    through ``amax``."""
    best = scores.amax(dim=-1)
    if not torch.isfinite(best).all():
        value = best[~torch.isfinite(best)][0].item()
        if math.isnan(value) or value > 0:
            raise ValueError(f"the scores to sample from are not finite (a row's maximum is {value})")
        raise ValueError(
            "no token can be chosen: every token's score is -inf (e.g. logit_bias bans them all)"
        )
