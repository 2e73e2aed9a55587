"""generate / stream against transformers 5.23's generate() on tiny random checkpoints of every style."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

import torchgemma
from checkpoints import NEW, STYLES, WIDTH, padded_prompts, reference_model, transformers_generate_alone
from torchgemma.generation import (
    GenerationConfig,
    GenerationStats,
    SamplingParams,
    decode_step,
    generate,
    prefill,
    stream,
)
from torchgemma.generation.invariance import RowProbe

DTYPES = [torch.float32, torch.bfloat16]


# Step-by-step decoding of tiny models: one thread (see conftest.one_thread).
pytestmark = pytest.mark.usefixtures("one_thread")


reference_generate = transformers_generate_alone


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("style", list(STYLES))
def test_greedy_matches_transformers(gen_checkpoints, style, dtype):
    folder = gen_checkpoints[style]
    ref = reference_model(folder, dtype)
    model = torchgemma.load(folder, dtype=dtype, attention="eager")
    ids, mask = padded_prompts(seed=list(STYLES).index(style))

    # Batched with left padding, no stop token: NEW tokens for every row.
    greedy = SamplingParams(temperature=0)
    free = generate(model, ids, attention_mask=mask, max_new_tokens=NEW, sampling=greedy, stop_token_ids=[])
    theirs = reference_generate(ref, ids, mask, max_new_tokens=NEW, do_sample=False, eos_token_id=None)
    assert free.shape == (3, WIDTH + NEW)
    assert torch.equal(free, theirs), f"\nours   {free[:, WIDTH:]}\ntheirs {theirs[:, WIDTH:]}"
    assert all(len(set(row)) >= 5 for row in free[:, WIDTH:].tolist()), "degenerate continuation"

    # Single rows, shorter and longer than the sliding window, without a mask.
    for prompt in (ids[1:2, -3:], ids[:1]):
        ours = generate(model, prompt, max_new_tokens=NEW, stop_token_ids=[])
        theirs = reference_generate(ref, prompt, max_new_tokens=NEW, do_sample=False, eos_token_id=None)
        assert torch.equal(ours, theirs), f"\nours   {ours}\ntheirs {theirs}"

    # Stopping: the token row 0 produces at step 4 ends it there; it is padded, the others go on.
    stop = int(free[0, WIDTH + 4])
    ours = generate(model, ids, attention_mask=mask, max_new_tokens=NEW, stop_token_ids=[stop])
    theirs = reference_generate(ref, ids, mask, max_new_tokens=NEW, do_sample=False, eos_token_id=stop)
    assert torch.equal(ours, theirs), f"\nours   {ours[:, WIDTH:]}\ntheirs {theirs[:, WIDTH:]}"
    row = ours[0, WIDTH:].tolist()
    end = row.index(stop)
    assert end <= 4 and all(t == 0 for t in row[end + 1 :])


def transformers_step_logits(ref, ids, mask, steps: int):
    with torch.no_grad():
        out = ref.generate(
            ids, attention_mask=mask, max_new_tokens=steps, do_sample=False, eos_token_id=None,
            output_logits=True, return_dict_in_generate=True,
        )  # fmt: skip
    return out.sequences, out.logits


@pytest.mark.parametrize("style", ["e2b", "e4b", "26b"])
def test_step_logits_match_transformers(gen_checkpoints, style):
    """prefill and decode_step give transformers' generate() next-token logits to the bit (bf16),
    for each prompt alone."""
    folder = gen_checkpoints[style]
    ref = reference_model(folder, torch.bfloat16)
    model = torchgemma.load(folder, dtype=torch.bfloat16, attention="eager")
    ids, mask = padded_prompts(seed=31)
    for row in range(ids.shape[0]):
        prompt = ids[row : row + 1][:, mask[row].bool()]
        sequences, expected_logits = transformers_step_logits(ref, prompt, None, 8)
        cache = model.make_cache(1, WIDTH + 8)
        logits = prefill(model, prompt, None, cache)
        for step, expected in enumerate(expected_logits):
            assert torch.equal(logits, expected), (
                f"row {row} step {step}: max |Δ| {(logits - expected).abs().max()}"
            )
            logits = decode_step(model, sequences[:, prompt.shape[1] + step], cache)


@pytest.mark.parametrize("style", ["e2b", "26b"])
def test_padded_batch_step_logits_match_transformers(gen_checkpoints, style):
    """A left-padded batch through prefill and decode_step equals transformers' batched generate()
    to the bit (bf16), where this machine's kernels round a row alike in any call (``RowProbe``
    finds no row-count boundary). Where they do not (bf16 on AVX-512 CPUs), transformers' batched
    rows are not its rows alone, while ours attend row by row as alone: the comparison has no
    reference there, and the per-prompt test above is the check."""
    folder = gen_checkpoints[style]
    model = torchgemma.load(folder, dtype=torch.bfloat16, attention="eager")
    probe = RowProbe.run(model.language_model, 3 * WIDTH, torch.bfloat16)
    if probe.first is not None:
        pytest.skip(f"this machine's bf16 products change a row's bits at {probe.first} rows")
    ref = reference_model(folder, torch.bfloat16)
    ids, mask = padded_prompts(seed=31)
    sequences, expected_logits = transformers_step_logits(ref, ids, mask, 8)
    cache = model.make_cache(3, WIDTH + 8)
    logits = prefill(model, ids, mask, cache)
    for step, expected in enumerate(expected_logits):
        assert torch.equal(logits, expected), f"step {step}: max |Δ| {(logits - expected).abs().max()}"
        logits = decode_step(model, sequences[:, WIDTH + step], cache)


def test_default_stop_tokens_match_transformers(gen_checkpoints):
    """stop_token_ids=None: the generation config's eos list (here the model config's [1, 106])."""
    folder = gen_checkpoints["e2b"]
    ref = reference_model(folder, torch.bfloat16)
    model = torchgemma.load(folder, dtype=torch.bfloat16, attention="eager")
    ids, mask = padded_prompts(seed=21)
    for eos in ([1, 106], None):
        config = None if eos is None else {"eos_token_id": eos, "pad_token_id": 0}
        ours = generate(model, ids, attention_mask=mask, max_new_tokens=NEW, generation_config=config)
        theirs = reference_generate(ref, ids, mask, max_new_tokens=NEW, do_sample=False)
        assert torch.equal(ours, theirs)


SAMPLED = dict(temperature=0.8, top_k=40, top_p=0.9, min_p=0.02, repetition_penalty=1.1)


@pytest.mark.parametrize("style", ["e2b", "26b"])
def test_seeded_sampling_matches_transformers(gen_checkpoints, style):
    """Each row samples with its own generator seeded `seed`: it draws exactly what transformers
    draws for that prompt alone after torch.manual_seed(seed) (bf16 logits are bit-identical), so
    a row's tokens do not depend on the other rows."""
    folder = gen_checkpoints[style]
    ref = reference_model(folder, torch.bfloat16)
    model = torchgemma.load(folder, dtype=torch.bfloat16, attention="eager")
    ids, mask = padded_prompts(seed=7)
    ours = generate(
        model,
        ids,
        attention_mask=mask,
        max_new_tokens=NEW,
        sampling=SamplingParams(**SAMPLED, seed=1234),
        stop_token_ids=[],
    )
    for row in range(ids.shape[0]):
        prompt = ids[row : row + 1][:, mask[row].bool()]
        torch.manual_seed(1234)
        theirs = reference_generate(
            ref, prompt, max_new_tokens=NEW, do_sample=True, eos_token_id=None, **SAMPLED
        )
        assert torch.equal(ours[row, WIDTH:], theirs[0, prompt.shape[1] :]), f"row {row}"


@pytest.mark.parametrize("style", ["e4b", "31b"])
def test_greedy_repetition_penalty_matches_transformers(gen_checkpoints, style):
    """The penalty applies to greedy decoding too, and skips each row's left padding."""
    folder = gen_checkpoints[style]
    ref = reference_model(folder, torch.bfloat16)
    model = torchgemma.load(folder, dtype=torch.bfloat16, attention="eager")
    ids, mask = padded_prompts(seed=8)
    # Pad with the tokens the padded rows pick first: counting padding as history would penalise them.
    first = reference_generate(
        ref, ids, mask, max_new_tokens=1, do_sample=False, repetition_penalty=1.4, eos_token_id=None
    )[:, WIDTH]
    ids = torch.where(mask == 1, ids, first[:, None])
    penalised = SamplingParams(repetition_penalty=1.4)  # greedy
    ours = generate(
        model, ids, attention_mask=mask, max_new_tokens=NEW, sampling=penalised, stop_token_ids=[]
    )
    theirs = reference_generate(
        ref, ids, mask, max_new_tokens=NEW, do_sample=False, repetition_penalty=1.4, eos_token_id=None
    )
    assert torch.equal(ours, theirs)
    plain = generate(model, ids, attention_mask=mask, max_new_tokens=NEW, stop_token_ids=[])
    assert not torch.equal(ours, plain)


@pytest.fixture(scope="module")
def small_model(gen_checkpoints):
    return torchgemma.load(gen_checkpoints["31b"], dtype=torch.float32, attention="eager")


def test_seeded_sampling_is_reproducible(small_model):
    ids, mask = padded_prompts(seed=3)
    runs = [
        generate(
            small_model,
            ids,
            attention_mask=mask,
            max_new_tokens=10,
            # transformers' defaults (top_k 50) for what is not set, as generate takes without a config
            sampling=GenerationConfig().sampling(temperature=1.0, seed=s),
            stop_token_ids=[],
        )
        for s in (5, 5, 6)
    ]
    assert torch.equal(runs[0], runs[1])
    assert not torch.equal(runs[0], runs[2])


def test_generation_config_supplies_defaults(small_model):
    """Unset sampling parameters and stop ids come from a generation_config.json dict."""
    ids, mask = padded_prompts(seed=4)
    params = SamplingParams(temperature=1.0, top_k=64, top_p=0.95, seed=9)
    explicit = generate(
        small_model, ids, attention_mask=mask, max_new_tokens=10, sampling=params, stop_token_ids=[],
    )  # fmt: skip
    config = {"do_sample": True, "temperature": 1.0, "top_k": 64, "top_p": 0.95, "eos_token_id": []}
    defaults = GenerationConfig.from_dict(config)
    from_config = generate(
        small_model, ids, attention_mask=mask, max_new_tokens=10, sampling=defaults.sampling(seed=9),
        generation_config=config,
    )  # fmt: skip
    assert torch.equal(explicit, from_config)
    # Without sampling parameters generate takes the config's itself (unseeded: torch's global RNG).
    torch.manual_seed(9)
    unseeded = generate(
        small_model, ids, attention_mask=mask, max_new_tokens=10, sampling=replace(params, seed=None),
        stop_token_ids=[],
    )  # fmt: skip
    torch.manual_seed(9)
    unset = generate(small_model, ids, attention_mask=mask, max_new_tokens=10, generation_config=config)
    assert torch.equal(unseeded, unset)
    # Gemma 4's defaults sample: not the greedy continuation.
    greedy = generate(small_model, ids, attention_mask=mask, max_new_tokens=10, stop_token_ids=[])
    assert not torch.equal(from_config, greedy)
    # An explicit temperature=0 overrides the config: greedy.
    forced = generate(
        small_model, ids, attention_mask=mask, max_new_tokens=10, sampling=defaults.sampling(temperature=0),
        generation_config=config,
    )  # fmt: skip
    assert torch.equal(forced, greedy)
    # The config's eos list stops rows.
    stop = int(explicit[2, WIDTH + 2])
    stopped = generate(
        small_model, ids, attention_mask=mask, max_new_tokens=10, sampling=defaults.sampling(seed=9),
        generation_config={**config, "eos_token_id": [stop], "pad_token_id": 7},
    )  # fmt: skip
    row = stopped[2, WIDTH:].tolist()
    end = row.index(stop)
    assert end <= 2 and all(t == 7 for t in row[end + 1 :])


def test_stream_yields_each_step(small_model):
    ids, mask = padded_prompts(seed=5)
    stats = GenerationStats()
    steps = list(
        stream(small_model, ids, attention_mask=mask, max_new_tokens=7, stop_token_ids=[], stats=stats)
    )
    assert len(steps) == 7 and all(s.shape == (3,) and s.dtype == torch.long for s in steps)
    full = generate(small_model, ids, attention_mask=mask, max_new_tokens=7, stop_token_ids=[])
    assert torch.equal(torch.stack(steps, 1), full[:, WIDTH:])
    assert stats.batch == 3 and stats.steps == 7 and stats.prompt_tokens == int(mask.sum())
    assert stats.prefill_seconds > 0 and stats.decode_seconds > 0


def test_stream_stops_when_all_rows_stop(small_model):
    ids, mask = padded_prompts(seed=6)
    free = generate(small_model, ids, attention_mask=mask, max_new_tokens=NEW, stop_token_ids=[])[:, WIDTH:]
    # Each row's token at step 2 stops it by step 2 at the latest.
    stops = free[:, 2].tolist()
    out = generate(small_model, ids, attention_mask=mask, max_new_tokens=NEW, stop_token_ids=stops)
    assert out.shape[1] <= WIDTH + 3


def test_cache_reuse(small_model):
    ids, mask = padded_prompts(seed=2)
    fresh = generate(small_model, ids, attention_mask=mask, max_new_tokens=8, stop_token_ids=[])
    cache = small_model.make_cache(3, WIDTH + 8)
    for _ in range(2):  # reset between runs
        again = generate(
            small_model, ids, attention_mask=mask, max_new_tokens=8, stop_token_ids=[], cache=cache
        )
        assert torch.equal(again, fresh)
    with pytest.raises(ValueError, match="cannot hold"):
        generate(small_model, ids, attention_mask=mask, max_new_tokens=9, cache=cache)


def test_context_limit(gen_checkpoints, tmp_path):
    # The 31b checkpoint with its context cut to 40 tokens.
    folder = tmp_path / "short-context"
    folder.mkdir()
    for f in gen_checkpoints["31b"].iterdir():
        (folder / f.name).symlink_to(f)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").unlink()
    (folder / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 40}))
    model = torchgemma.load(folder, attention="eager")

    with pytest.raises(ValueError, match="does not fit"):
        stream(model, torch.full((1, 40), 5), max_new_tokens=1)  # raised at the call, before any step
    # New tokens are cut to what the context leaves; padding does not count (positions follow real tokens).
    ids = torch.randint(3, 300, (2, 37), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, :5] = 0
    out = generate(model, ids, attention_mask=mask, max_new_tokens=10, stop_token_ids=[])
    assert out.shape == (2, 40)
    out = generate(model, ids[1:, 5:], max_new_tokens=10, stop_token_ids=[])
    assert out.shape == (1, 32 + 8)


def test_zero_new_tokens_and_bad_input(small_model):
    ids, mask = padded_prompts(seed=1)
    assert torch.equal(generate(small_model, ids, attention_mask=mask, max_new_tokens=0), ids)
    with pytest.raises(ValueError, match="batch, length"):
        generate(small_model, ids[0], max_new_tokens=2)
    with pytest.raises(ValueError, match="attention_mask"):
        generate(small_model, ids, attention_mask=mask[:, 1:], max_new_tokens=2)
    empty = mask.clone()
    empty[1] = 0
    with pytest.raises(ValueError, match="at least one token"):
        generate(small_model, ids, attention_mask=empty, max_new_tokens=2)
    with pytest.raises(ValueError, match="temperature"):
        generate(small_model, ids, max_new_tokens=2, sampling=SamplingParams(temperature=-1))
