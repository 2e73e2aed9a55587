"""The verify pass of speculative decoding (``speculative.py``): one decode step of an engine whose
requests may carry draft tokens.

1. Each decoding request gets its drafting budget (``Adaptive``, the request's room, and in a
   batch-invariant engine the row probe's bound), and the drafter proposes.
2. One forward pass (``apart=True``: each query attends as a decode step's would) reads every
   request's last token and its drafts, right-padded to a common length; a batch-invariant engine
   runs it request by request where the rows would reach the probe's boundary.
3. Each request's rows are chosen from in order, as decode steps would choose (the engine's own
   ``_choices`` / ``_emit``; the rejection rule for sampled requests): tokens are recorded while
   they agree with the drafts, up to and including the first that does not (or the one after the
   last draft); a stop token or the token budget ends the run there.
4. The slot keeps the tokens read whose successors were accepted; the rest are rolled back.
"""

from __future__ import annotations

import torch

from ..quantization.modules import integer_rows
from .invariance import RowProbe
from .requests import Request, StepOutput, token_logprobs
from .sampling import check_scores, process_logits
from .speculative import Adaptive, DraftRequest


def speculative_decode(engine, requests: list[Request]) -> list[StepOutput]:
    """One step of ``engine``'s decoding ``requests`` (sorted by slot), drafts included: their outputs."""
    limit = _row_limit(engine)
    drafts = _drafts(engine, requests, limit)
    if not any(drafts):
        try:
            choices = engine._decode(requests)
        except Exception as error:  # noqa: BLE001 - the shared forward failed: its members fail
            return [engine._fail(request, error) for request in requests]
        return [engine._emit_or_fail(request, choice) for request, choice in zip(requests, choices)]
    width = 1 + max(len(d) for d in drafts)
    if limit is not None and len(requests) > 1 and len(requests) * width >= limit:
        groups = [([r], [d]) for r, d in zip(requests, drafts)]  # each as it would run alone
    else:
        groups = [(requests, drafts)]
    engine.speculative_stats.verify_passes += sum(1 for _, proposed in groups if any(proposed))
    outputs: list[StepOutput] = []
    for members, proposed in groups:
        try:
            normed = _forward(engine, members, proposed)
        except Exception as error:  # noqa: BLE001 - the shared forward failed: its members fail
            outputs += [engine._fail(request, error) for request in members]
            continue
        outputs += _accept(engine, members, proposed, normed)
    return outputs


def _row_limit(engine) -> int | None:
    """In a batch-invariant engine, the first row count at which a product's rows change bits
    (``RowProbe``) for calls as large as verify passes get; in another, the rows from which quantized
    projections take integer activations (``integer_rows``: a verify call of fewer rows gets decode
    steps' bits); None: no bound."""
    if not engine.batch_invariant:
        return integer_rows(engine.model)
    rows = engine.max_batch_size * (1 + engine.speculation.num_tokens)
    return RowProbe.run(engine.model.language_model, rows, engine.model.dtype).first


def _drafts(engine, requests: list[Request], limit: int | None) -> list[list[int]]:
    """Each request's draft tokens (maybe none)."""
    spec = engine.speculation
    most = spec.num_tokens if limit is None else min(spec.num_tokens, limit - 2)
    asks, askers = [], []
    for i, request in enumerate(requests):
        if request.drafting is None:
            request.drafting = Adaptive()
        room = request.max_new_tokens - len(request.output) - 1  # the verified token comes on top
        if most < 1 or room < 1 or request.constraint is not None:
            continue
        budget = min(request.drafting.budget(most), room)
        hidden = request.hidden if spec.drafter.needs_hidden else None
        if budget < 1 or (spec.drafter.needs_hidden and hidden is None):
            continue
        asks.append(DraftRequest(request.prompt + request.output, budget, request.slot, hidden))
        askers.append(i)
    drafts: list[list[int]] = [[] for _ in requests]
    if not asks:
        return drafts
    proposed = spec.drafter.propose(asks, engine.cache)
    if len(proposed) != len(asks):
        raise ValueError(f"the drafter proposed for {len(proposed)} requests, asked for {len(asks)}")
    vocab = engine.model.config.text.vocab_size
    for i, ask, tokens in zip(askers, asks, proposed):
        tokens = [int(t) for t in tokens[: ask.num_tokens]]
        if any(not 0 <= t < vocab for t in tokens):
            raise ValueError(f"the drafter proposed a token outside the vocabulary [0, {vocab}): {tokens}")
        drafts[i] = tokens
    return drafts


def _forward(engine, requests: list[Request], drafts: list[list[int]]) -> torch.Tensor:
    """The final-normed hidden states (B, 1 + max k, H) of each request's last token and drafts."""
    model = engine.model
    rows = [[request.output[-1], *draft] for request, draft in zip(requests, drafts)]
    width = max(len(row) for row in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    valid = torch.zeros(len(rows), width, dtype=torch.bool)
    for b, row in enumerate(rows):
        ids[b, : len(row)] = torch.tensor(row)
        valid[b, : len(row)] = True
    device = model.device
    return model.language_model(
        model.text_ids(ids.to(device)),
        attention_mask=None if bool(valid.all()) else valid.to(device),
        cache=engine.cache,
        slots=[request.slot for request in requests],
        head=False,
        apart=True,
    )


def _accept(
    engine, requests: list[Request], drafts: list[list[int]], normed: torch.Tensor
) -> list[StepOutput]:
    """Choose each request's tokens from its rows, keep the agreeing drafts, roll back the rest."""
    # Every row that may be chosen from, through the engine's own choice of head (greedy argmax or
    # logits; constrained rows' masks filled).
    flat = [(request, j) for request, draft in zip(requests, drafts) for j in range(len(draft) + 1)]
    index = [b for b, draft in enumerate(drafts) for _ in range(len(draft) + 1)]
    rows = [j for _, j in flat]
    choices = engine._choices([request for request, _ in flat], normed[index, rows])
    outputs: list[StepOutput] = []
    at = 0
    stats = engine.speculative_stats
    for b, (request, draft) in enumerate(zip(requests, drafts)):
        mine = choices[at : at + len(draft) + 1]
        at += len(draft) + 1
        accepted, last = 0, 0
        try:
            for j, choice in enumerate(mine):
                last = j
                if j < len(draft) and not request.params.greedy:
                    token, agrees, logprobs = _draw(request, choice, draft[j])
                    output = engine._record(request, token, logprobs)
                else:
                    output = engine._emit(request, choice)
                    agrees = j < len(draft) and output.token_id == draft[j]
                outputs.append(output)
                if output.finished or not agrees:
                    break
                accepted += 1
        except Exception as error:  # noqa: BLE001 - this request's own sampling: it alone fails
            outputs.append(engine._fail(request, error))
            continue
        if draft:
            stats.drafted_tokens += len(draft)
            stats.accepted_tokens += accepted
            request.drafting.update(len(draft), accepted)
        if request.finish_reason is None:
            engine.cache.rollback(request.slot, len(draft) - accepted)
            if request.hidden is not None:
                request.hidden = normed[b, last]
    return outputs


def _draw(request: Request, logits: torch.Tensor, draft: int) -> tuple[int, bool, object]:
    """The rejection rule for a sampled request's row (1, V) and its draft token (a point mass q):
    the draft with probability p(draft), else a draw from p without it. Returns the token, whether
    it is the draft, and its log-probabilities if the request asks for them."""
    request.check_finite(logits)
    device = logits.device
    history, generated = request.penalty_inputs(device)
    scores = process_logits(logits, request.params, history, generated=generated)
    check_scores(scores)
    probs = scores.softmax(dim=-1)[0]
    generator = request.generator
    token = draft
    if float(torch.rand((), generator=generator, device=device)) >= float(probs[draft]):
        rest = probs.clone()
        rest[draft] = 0.0
        if float(rest.sum()) > 0:
            token = int(torch.multinomial(rest[None] / rest.sum(), 1, generator=generator)[0, 0])
    logprobs = None if request.logprobs is None else token_logprobs(logits[0], token, request.logprobs)
    return token, token == draft, logprobs
