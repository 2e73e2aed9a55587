"""Speculative sampling keeps the output distribution (the rejection rule, generation/verify.py),
seeded requests reproduce, and the server reports drafted and accepted tokens."""

from __future__ import annotations

import httpx
import pytest
import torch

import torchgemma
from serving_fixtures import running_server
from torchgemma import Engine, SamplingParams
from torchgemma.generation.requests import Request
from torchgemma.generation.sampling import process_logits
from torchgemma.generation.verify import _draw
from torchgemma.llm import LLM
from torchgemma.serving.app import create_app

pytestmark = pytest.mark.usefixtures("one_thread")

SETTINGS = [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.7, top_k=4),
    SamplingParams(temperature=1.3, top_p=0.8),
    SamplingParams(temperature=1.0, min_p=0.1, repetition_penalty=1.5),
]


@pytest.mark.parametrize(
    "params",
    [
        SETTINGS[0],
        pytest.param(SETTINGS[1], marks=pytest.mark.slow),
        pytest.param(SETTINGS[2], marks=pytest.mark.slow),
        SETTINGS[3],
    ],
    ids=["plain", "top-k", "top-p", "min-p+penalty"],
)
def test_the_rejection_rule_draws_from_the_target_distribution(params):
    """One row's draws under the rule, with a draft token chosen by someone else each time (here
    uniformly): the tokens follow p, the request's distribution after every filter and penalty,
    within a total variation of 0.04 over 4,000 draws (seeded: the check is deterministic; the
    sampling error's expected size is ~0.015 here); each draft is accepted with probability p(draft)
    (to 0.07: ~500 offers of each)."""
    vocab, draws = 8, 4_000
    logits = torch.tensor([[2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, 3.0]])
    request = Request(0, [7, 7, 1], params, 10, frozenset(), torch.Generator().manual_seed(1))
    history = torch.tensor([request.prompt])
    p = process_logits(logits, params, history).softmax(-1)[0]
    drafts = torch.randint(0, vocab, (draws,), generator=torch.Generator().manual_seed(2)).tolist()
    counts = torch.zeros(vocab)
    offered, kept = torch.zeros(vocab), torch.zeros(vocab)
    for draft in drafts:
        token, accepted, _ = _draw(request, logits, draft)
        counts[token] += 1
        offered[draft] += 1
        kept[draft] += accepted
    assert 0.5 * (counts / draws - p).abs().sum() < 0.04
    assert (kept / offered - p).abs().max() < 0.07


def test_a_draft_the_target_cannot_draw_is_never_kept():
    params = SamplingParams(temperature=1.0, top_k=2)
    logits = torch.tensor([[3.0, 2.0, 0.0, -1.0]])
    request = Request(0, [1], params, 10, frozenset(), torch.Generator().manual_seed(0))
    for _ in range(200):
        token, accepted, _ = _draw(request, logits, 3)
        assert token in (0, 1) and not accepted


class FixedDrafts:
    """Proposes, after token t, the token ``table[t]`` (one draft)."""

    needs_hidden = False

    def __init__(self, table: dict[int, int]):
        self.table = table

    def propose(self, requests, cache):
        return [[self.table[r.tokens[-1]]] if r.tokens[-1] in self.table else [] for r in requests]


def test_two_token_distribution_is_unchanged(gen_checkpoints):
    """64 seeded requests of one prompt at a time, the second token of each drafted (the target's
    second most likely token): the joint distribution of the first two tokens over 1,536 samples
    matches the model's exact one (computed from its logits) within a chi-square test at p > 0.001,
    with a fixed seed per request (deterministic)."""
    model = torchgemma.load(gen_checkpoints["31b"], dtype=torch.float32, quantize="int8")
    params = SamplingParams(temperature=1.0, top_k=3)
    prompt = [5, 17, 42, 8, 99]
    lm = model.language_model
    with torch.inference_mode():
        first = process_logits(lm(torch.tensor([prompt]))[:, -1], params).softmax(-1)[0]
        joint, table = {}, {}
        for t1 in torch.nonzero(first).flatten().tolist():
            second = process_logits(lm(torch.tensor([prompt + [t1]]))[:, -1], params).softmax(-1)[0]
            table[t1] = int(second.topk(2).indices[1])
            for t2 in torch.nonzero(second).flatten().tolist():
                joint[t1, t2] = float(first[t1] * second[t2])
    counts = dict.fromkeys(joint, 0)
    engine = Engine(
        model,
        max_batch_size=64,
        max_len=16,
        speculative={"method": "mtp", "model": FixedDrafts(table), "num_tokens": 1},
    )
    for batch in range(24):
        for i in range(64):
            engine.add_request(
                i,
                prompt,
                sampling=SamplingParams(temperature=1.0, top_k=3, seed=batch * 64 + i),
                max_new_tokens=3,
                stop_token_ids=[],
            )
        tokens: dict = {}
        while engine.has_unfinished_requests():
            for o in engine.step():
                tokens.setdefault(o.request_id, []).append(o.token_id)
        for reply in tokens.values():
            counts[tuple(reply[:2])] += 1
    stats = engine.speculative_stats
    assert stats.drafted_tokens >= 24 * 64 and 0 < stats.accepted_tokens < stats.drafted_tokens
    cells = sorted(joint)
    observed = [counts[c] for c in cells]
    expected = [joint[c] * sum(observed) for c in cells]
    statistic = sum((o - e) ** 2 / e for o, e in zip(observed, expected))
    # The chi-square distribution's survival function: Q(df / 2, statistic / 2).
    pvalue = torch.special.gammaincc(torch.tensor((len(cells) - 1) / 2), torch.tensor(statistic / 2))
    assert pvalue > 1e-3, (statistic, len(cells))


def test_seeded_requests_reproduce_alone_and_batched(gen_checkpoints):
    """Seeded sampling with prompt lookup: the same output twice, and alone as in a batch (a
    quantized target, whose verify rows get a decode step's bits)."""
    model = torchgemma.load(gen_checkpoints["31b"], dtype=torch.float32, quantize="int8")
    prompt = [5, 6, 7, 5, 6, 7, 5, 6, 7, 5, 6]
    others = [[9, 10, 11, 9, 10], [3, 4, 3, 4, 3, 4]]
    sampling = SamplingParams(temperature=0.8, top_p=0.95, repetition_penalty=1.1, seed=7)

    def reply(with_others: bool) -> list[int]:
        engine = Engine(model, max_batch_size=3, max_len=64, speculative="ngram")
        engine.add_request("x", prompt, sampling=sampling, max_new_tokens=30, stop_token_ids=[])
        if with_others:
            for i, other in enumerate(others):
                engine.add_request(
                    i, other, sampling=SamplingParams(temperature=1.0, seed=i), max_new_tokens=20
                )
        out = []
        while engine.has_unfinished_requests():
            out += [o.token_id for o in engine.step() if o.request_id == "x"]
        return out

    alone = reply(False)
    assert reply(False) == alone
    assert reply(True) == alone


def test_server_metrics_count_drafts(llm_checkpoint):
    """`serve --speculative ngram`: /metrics reports the engine's drafted and accepted tokens."""
    llm = LLM(llm_checkpoint, speculative={"method": "ngram", "num_tokens": 3})
    app = create_app(llm, model_name="tiny", max_batch_size=2, max_len=256)
    with running_server(app) as url:
        for text in ("one two one two one two one two", "a b c a b c a b c a b"):
            response = httpx.post(
                f"{url}/v1/completions",
                json={"model": "tiny", "prompt": text, "max_tokens": 24, "temperature": 0},
                timeout=60,
            )
            assert response.status_code == 200
        metrics = httpx.get(f"{url}/metrics").text
        stats = app.state.server.runner.engine.speculative_stats
    assert stats.drafted_tokens > 0
    assert f"torchgemma_speculative_draft_tokens_total {float(stats.drafted_tokens)}" in metrics
    assert f"torchgemma_speculative_accepted_tokens_total {float(stats.accepted_tokens)}" in metrics
    assert f"torchgemma_speculative_verify_passes_total {float(stats.verify_passes)}" in metrics
