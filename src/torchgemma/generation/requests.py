"""What goes in and out of the engine: a request's state, a prompt already embedded, a step's output."""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Any

import torch

from ..model.inputs import MediaInputs
from .sampling import SamplingParams


class NonFiniteLogits(RuntimeError):
    """The model's logits for a request hold NaN or inf: no token can be chosen from them."""


@dataclass(frozen=True)
class TokenLogprobs:
    """A generated token's log-probability and the most likely alternatives, most likely first."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]


def token_logprobs(logits: torch.Tensor, token: int, top: int) -> TokenLogprobs:
    """``token``'s log-probability and the ``top`` most likely tokens' under ``logits`` (V,)."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    values, ids = torch.topk(logprobs, top) if top else (logprobs[:0], logprobs[:0].long())
    return TokenLogprobs(token, float(logprobs[token]), list(zip(ids.tolist(), values.tolist())))


@dataclass(frozen=True)
class StepOutput:
    """What one ``Engine.step()`` did for one request: a token, or the error that ended it.

    ``finish_reason`` comes with the request's last output: ``"stop"`` (a stop token, or the
    end of a constraint given no stop ids), ``"length"`` (its token budget) or ``"error"`` (its own
    inputs, its prefill, its sampling or constraint, or the model's logits for it failed: ``error``
    says why, ``token_id`` is None). ``logprobs`` is set for requests that asked for them.
    """

    request_id: Hashable
    token_id: int | None
    finished: bool
    finish_reason: str | None = None
    logprobs: TokenLogprobs | None = None
    error: Exception | None = None
    # On a request's first output: prompt tokens taken from the prefix cache (not prefilled).
    cached_tokens: int = 0


@dataclass(frozen=True)
class EmbeddedPrompt:
    """A prompt already embedded with its media scattered in, for ``add_request(embedded=...)``:
    ``stream`` embeds a padded multimodal batch at once (as transformers does) and gives each row
    its part; the engine makes one itself from a request's ``media``."""

    embeds: torch.Tensor  # (1, L, H)
    text_ids: torch.Tensor  # (1, L): the ids for the per-layer table
    vision_blocks: torch.Tensor | None = None  # (1, L): image-block ids of bidirectional vision attention


@dataclass
class Request:
    """One sequence's state inside the engine."""

    request_id: Hashable
    prompt: list[int]
    params: SamplingParams
    max_new_tokens: int
    stop_token_ids: frozenset[int]
    generator: torch.Generator | None
    media: MediaInputs | None = None
    # The prompt embedded with its media, made at the first chunk (or given); dropped once prefilled.
    embedded: EmbeddedPrompt | None = None
    slot: int | None = None
    prefilled: int = 0
    output: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    # Top log-probabilities to report per token (0: the chosen token's only); None: none.
    logprobs: int | None = None
    # Decides which tokens may come next (see generation/constraints.py); None: any.
    constraint: Any = None
    # Prompt tokens taken from the prefix cache (reported with the first output).
    cached: int = 0
    # The prefix cache chain its prompt's chunks continue (None: stores nothing), and how far its
    # prompt may be stored (its first media token).
    prefix: int | None = None
    store_limit: int = 0
    # Its whole prompt taken from the prefix cache: the final-normed hidden state of the prompt's
    # last position, stored with it, which chooses the first token (no forward).
    final: torch.Tensor | None = field(default=None, compare=False, repr=False)
    # Parallel sampling (fork.py): the requests forked from this one's prefill, or the one whose
    # prefill this one waits for.
    followers: list[Request] = field(default_factory=list, compare=False, repr=False)
    leader: Request | None = field(default=None, compare=False, repr=False)
    # Speculative decoding (speculative.py): its drafting budget, and the target's final-normed
    # hidden state at the position that produced its last token (for drafters that read it).
    drafting: Any = field(default=None, compare=False, repr=False)
    hidden: torch.Tensor | None = field(default=None, compare=False, repr=False)

    @property
    def decoding(self) -> bool:
        return bool(self.output)

    def check_finite(self, logits: torch.Tensor) -> None:
        """Refuse this request's logits if any is NaN or inf (``NonFiniteLogits``)."""
        # Its lowest and highest logits are finite iff all are (NaN propagates through both):
        # one pass, ~20x cheaper than isfinite().all() over 262,144 logits.
        if not torch.isfinite(torch.stack(torch.aminmax(logits))).all():
            raise NonFiniteLogits(
                f"the model produced non-finite logits (NaN or inf) for request {self.request_id!r} "
                f"at its token {len(self.output)}: its weights or activations are broken "
                "(a checkpoint with NaN or inf values, or a dtype that overflows)"
            )

    def penalty_inputs(self, device) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """What its penalties read (``sampling.process_logits``): prompt and output (repetition
        penalty), output alone (presence and frequency penalties); None where unused."""
        history = generated = None
        if self.params.repetition_penalty not in (None, 1.0):
            history = torch.tensor([self.prompt + self.output], device=device)
        if self.params.penalizes_output:
            generated = torch.tensor([self.output], dtype=torch.long, device=device)
        return history, generated

    @property
    def plain_greedy(self) -> bool:
        """Greedy with nothing but the logits' argmax to decide (no penalty, bias, constraint or
        log-probabilities): the head's argmax alone gives its token (``TextModel.greedy``)."""
        p = self.params
        return (
            p.greedy
            and p.repetition_penalty in (None, 1.0)
            and not p.penalizes_output
            and not p.logit_bias
            and self.constraint is None
            and self.logprobs is None
        )
