"""Sampling functions against transformers' logits processors, on random logits."""

from __future__ import annotations

import pytest
import torch
from transformers.generation.logits_process import (
    LogitsProcessorList,
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from torchgemma.config import ModelConfig
from torchgemma.generation import (
    GenerationConfig,
    SamplingParams,
    apply_logit_bias,
    apply_repetition_penalty,
    apply_temperature,
    min_p_filter,
    next_token,
    process_logits,
    top_k_filter,
    top_p_filter,
)

VOCAB = 500


def random_logits(seed: int, batch: int = 4, ties: bool = False) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(batch, VOCAB, generator=gen) * 3
    if ties:
        # Coarse values: many exact ties, also at the top-k / top-p boundaries.
        logits = (logits * 2).round() / 2
    logits[0, :7] = float("-inf")  # already-filtered entries must stay filtered
    return logits


def history(seed: int, batch: int = 4, length: int = 30) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (batch, length), generator=gen)


def assert_same(ours: torch.Tensor, theirs: torch.Tensor) -> None:
    assert ours.dtype == theirs.dtype
    assert torch.equal(ours, theirs), f"{(ours != theirs).sum()} entries differ"


@pytest.mark.parametrize("ties", [False, True])
@pytest.mark.parametrize("k", [1, 5, 64, VOCAB, VOCAB + 10])
def test_top_k(k, ties):
    logits = random_logits(k, ties=ties)
    assert_same(top_k_filter(logits, k), TopKLogitsWarper(k)(None, logits.clone()))


@pytest.mark.parametrize("ties", [False, True])
@pytest.mark.parametrize("p", [0.01, 0.3, 0.9, 0.95, 1.0])
def test_top_p(p, ties):
    logits = random_logits(int(p * 100), ties=ties)
    ours = top_p_filter(logits, p)
    assert_same(ours, TopPLogitsWarper(p)(None, logits.clone()))
    assert torch.isfinite(ours).any(dim=-1).all()  # the most likely token always survives


def test_top_p_exact_boundary():
    """A token whose mass-at-or-below equals 1 - p exactly is dropped (the boundary is inclusive)."""
    logits = random_logits(12, batch=1)
    mass_below = logits.sort().values.softmax(-1).cumsum(-1)[0]
    for k in (VOCAB - 3, VOCAB - 10, VOCAB - 40):
        # 1 - (1 - c) == c exactly for a float32 c, so the comparison meets the boundary itself.
        p = 1.0 - float(mass_below[k])
        ours = top_p_filter(logits, p)
        assert_same(ours, TopPLogitsWarper(p)(None, logits.clone()))
        assert int(torch.isfinite(ours).sum()) == VOCAB - 1 - k


@pytest.mark.parametrize("ties", [False, True])
@pytest.mark.parametrize("min_p", [0.0, 0.05, 0.5, 1.0])
def test_min_p(min_p, ties):
    logits = random_logits(int(min_p * 100) + 1, ties=ties)
    assert_same(min_p_filter(logits, min_p), MinPLogitsWarper(min_p)(None, logits.clone()))


@pytest.mark.parametrize("temperature", [0.3, 1.0, 1.7])
def test_temperature(temperature):
    logits = random_logits(3)
    assert_same(apply_temperature(logits, temperature), TemperatureLogitsWarper(temperature)(None, logits))


@pytest.mark.parametrize("penalty", [0.7, 1.3, 2.0])
def test_repetition_penalty(penalty):
    logits, ids = random_logits(4), history(4)
    theirs = RepetitionPenaltyLogitsProcessor(penalty)(ids, logits.clone())
    assert_same(apply_repetition_penalty(logits, ids, penalty), theirs)
    # Tokens never seen are untouched; seen ones moved towards (or away from) zero once.
    unseen = torch.ones_like(logits, dtype=torch.bool).scatter(1, ids, False)
    assert torch.equal(theirs[unseen], logits[unseen])


def test_repetition_penalty_ignores_left_padding():
    """generate() leaves each row's left padding out of the penalty (prompt_ignore_length)."""
    logits, ids = random_logits(5), history(5)
    padding = torch.tensor([0, 3, 10, 29])
    mask = torch.arange(ids.shape[1])[None, :] >= padding[:, None]
    theirs = RepetitionPenaltyLogitsProcessor(1.5, prompt_ignore_length=padding)(ids, logits.clone())
    assert_same(apply_repetition_penalty(logits, ids, 1.5, mask), theirs)


def test_repetition_penalty_ids_beyond_vocab():
    logits = random_logits(6)
    ids = torch.tensor([[VOCAB + 3, 1, 2]] * 4)  # an id the logits do not cover is ignored
    theirs = RepetitionPenaltyLogitsProcessor(1.5)(ids, logits.clone())
    assert_same(apply_repetition_penalty(logits, ids, 1.5), theirs)


def test_logit_bias_is_transformers_sequence_bias():
    """Biases above -100 are transformers' sequence_bias on single tokens; -100 bans (-inf)."""
    logits = random_logits(12)
    bias = {3: 2.5, 40: -7.0, 499: 100.0, 8: -99.5}
    theirs = SequenceBiasLogitsProcessor({(t,): b for t, b in bias.items()})(history(12), logits.clone())
    params = SamplingParams(logit_bias=bias)
    assert params.logit_bias == ((3, 2.5), (8, -99.5), (40, -7.0), (499, 100.0))
    assert_same(apply_logit_bias(logits, params.logit_bias), theirs)
    banned = apply_logit_bias(logits, SamplingParams(logit_bias={10: -100, 11: -100.0}).logit_bias)
    assert torch.isneginf(banned[:, 10:12]).all() and torch.equal(banned[:, 12:], logits[:, 12:])
    with pytest.raises(ValueError, match="outside the vocabulary of 500"):
        apply_logit_bias(logits, ((VOCAB, 1.0),))


def test_a_banned_token_is_never_drawn():
    """Even where -100 alone would not ban (T=1000 makes it -0.1), and for greedy rows."""
    logits = random_logits(13, batch=1).expand(3000, -1)
    best = int(logits[0].argmax())
    ban = {best: -100, best + 1: -100}
    hot = next_token(logits, SamplingParams(temperature=1000.0, logit_bias=ban), generator=torch.Generator())
    assert not set(hot.tolist()) & set(ban) and len(set(hot.tolist())) > 100
    assert int(next_token(logits[:1], SamplingParams(logit_bias=ban))[0]) not in ban


def test_nothing_to_choose_is_an_error():
    logits = random_logits(14, batch=2)
    with pytest.raises(ValueError, match="every token's score is -inf"):
        next_token(logits, SamplingParams(temperature=0.7, logit_bias=dict.fromkeys(range(VOCAB), -100)))
    logits[1, 5] = float("nan")
    with pytest.raises(ValueError, match="not finite"):
        next_token(logits, SamplingParams())


def transformers_chain(params: SamplingParams, padding: torch.Tensor | None) -> LogitsProcessorList:
    """The processors transformers' generate builds for these settings, in its order."""
    chain = LogitsProcessorList()
    if params.logit_bias:
        chain.append(SequenceBiasLogitsProcessor({(t,): b for t, b in params.logit_bias}))
    if params.repetition_penalty not in (None, 1.0):
        chain.append(
            RepetitionPenaltyLogitsProcessor(params.repetition_penalty, prompt_ignore_length=padding)
        )
    if not params.greedy:
        if params.temperature != 1.0:
            chain.append(TemperatureLogitsWarper(params.temperature))
        if params.top_k:
            chain.append(TopKLogitsWarper(params.top_k))
        if params.top_p is not None and params.top_p < 1.0:
            chain.append(TopPLogitsWarper(params.top_p))
        if params.min_p is not None:
            chain.append(MinPLogitsWarper(params.min_p))
    return chain


CHAINS = [
    SamplingParams(temperature=0.0),
    SamplingParams(temperature=0.0, repetition_penalty=1.3),
    SamplingParams(temperature=1.0, top_k=64, top_p=0.95),  # Gemma 4's defaults
    SamplingParams(temperature=0.7, top_k=20, top_p=0.8, min_p=0.05, repetition_penalty=1.2),
    SamplingParams(temperature=1.5, min_p=0.1),
    SamplingParams(temperature=0.5, top_k=0, top_p=1.0),
    SamplingParams(temperature=0.8, top_k=20, repetition_penalty=1.3, logit_bias={5: 3.0, 17: -2.0}),
    SamplingParams(temperature=0.0, repetition_penalty=1.3, logit_bias={5: 30.0, 17: -2.0}),
]


@pytest.mark.parametrize("params", CHAINS, ids=str)
def test_processing_chain_and_draws(params):
    logits, ids = random_logits(7), history(7)
    padding = torch.tensor([0, 2, 5, 0])
    mask = torch.arange(ids.shape[1])[None, :] >= padding[:, None]
    theirs = transformers_chain(params, padding)(ids, logits.clone())
    assert_same(process_logits(logits, params, ids, mask), theirs)

    # Draws: the same generator state gives the same tokens as transformers' multinomial.
    torch.manual_seed(11)
    if params.greedy:
        expected = theirs.argmax(-1)
    else:
        expected = torch.multinomial(theirs.softmax(-1), 1).squeeze(1)
    drawn = next_token(
        logits, params, generator=torch.Generator().manual_seed(11), history=ids, history_mask=mask
    )
    assert torch.equal(drawn, expected)


def test_filtered_tokens_are_never_drawn():
    logits = random_logits(8, batch=1).expand(2000, -1)
    params = SamplingParams(temperature=1.0, top_k=5)
    allowed = set(torch.topk(logits[0], 5).indices.tolist())
    drawn = next_token(logits, params, generator=torch.Generator().manual_seed(0))
    assert set(drawn.tolist()) <= allowed and len(set(drawn.tolist())) > 1


def test_seeded_draws_are_reproducible():
    logits = random_logits(9)
    params = SamplingParams(temperature=1.0)
    draw = [next_token(logits, params, generator=torch.Generator().manual_seed(s)) for s in (1, 1, 2)]
    assert torch.equal(draw[0], draw[1])
    many = [next_token(logits, params, generator=torch.Generator().manual_seed(s)) for s in range(2, 6)]
    assert any(not torch.equal(draw[0], d) for d in many)


def test_logits_are_processed_in_float32():
    logits = random_logits(10).to(torch.bfloat16)
    out = process_logits(logits, SamplingParams(temperature=0.7, top_k=5))
    assert out.dtype == torch.float32


def test_repetition_penalty_needs_history():
    with pytest.raises(ValueError, match="history"):
        process_logits(random_logits(0), SamplingParams(repetition_penalty=1.2))


@pytest.mark.parametrize(
    "kwargs",
    [
        {"temperature": -0.1},
        {"top_k": -1},
        {"top_k": 2.5},
        {"top_p": 0.0},
        {"top_p": 1.5},
        {"min_p": -0.1},
        {"min_p": 1.1},
        {"repetition_penalty": 0.0},
        {"repetition_penalty": 1e-40},
        {"repetition_penalty": float("inf")},
        {"temperature": float("inf")},
        {"temperature": float("nan")},
        {"logit_bias": {1: 100.1}},
        {"logit_bias": {1: "x"}},
        {"logit_bias": {-1: 0.0}},
        {"logit_bias": {True: 0.0}},
    ],
)
def test_invalid_params(kwargs):
    with pytest.raises(ValueError):
        SamplingParams(**kwargs)


# ---- generation_config.json defaults ------------------------------------------------------------


def test_generation_config_defaults_apply_when_unset():
    config = GenerationConfig.from_dict(
        {"do_sample": True, "temperature": 1.0, "top_k": 64, "top_p": 0.95, "eos_token_id": [1, 106, 50]}
    )
    assert config.eos_token_ids == (1, 106, 50)
    assert config.sampling() == SamplingParams(temperature=1.0, top_k=64, top_p=0.95)
    assert config.sampling(temperature=0.5, top_k=10) == SamplingParams(temperature=0.5, top_k=10, top_p=0.95)
    assert config.sampling(temperature=0).greedy


def test_generation_config_without_sampling_is_greedy():
    # transformers' defaults: do_sample False (greedy), top_k 50, top_p 1.0 when sampling is asked for.
    config = GenerationConfig.from_dict({"eos_token_id": 1, "top_k": None})
    assert config.eos_token_ids == (1,)
    assert config.sampling().greedy
    assert config.sampling(temperature=0.8) == SamplingParams(temperature=0.8, top_k=50, top_p=1.0)


def test_generation_config_ids_fall_back_to_model_config(text_checkpoints):
    model_config = ModelConfig.from_file(text_checkpoints["e2b"]).text
    config = GenerationConfig.from_dict({}, model_config)
    assert config.eos_token_ids == model_config.eos_token_id == (1, 106)
    assert config.pad_token_id == 0 and config.bos_token_id == 2
    assert GenerationConfig.from_folder(text_checkpoints["e2b"], model_config).eos_token_ids == (1, 106)


def test_presence_and_frequency_penalties_by_hand():
    """OpenAI's formula on a row worked out by hand: token 1 generated twice, token 3 once."""
    from torchgemma.generation.sampling import apply_occurrence_penalties

    logits = torch.tensor([[1.0, 2.0, 3.0, 4.0]])
    generated = torch.tensor([[1, 3, 1]])
    out = apply_occurrence_penalties(logits, generated, presence=0.5, frequency=0.25)
    assert out.tolist() == [[1.0, 2.0 - 0.5 - 2 * 0.25, 3.0, 4.0 - 0.5 - 0.25]]
    for name in ("presence_penalty", "frequency_penalty"):
        with pytest.raises(ValueError, match=name):
            SamplingParams(**{name: 2.5})
