"""The engine: requests join and leave a running batch, and each gets what it would get alone."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

import torchgemma
from checkpoints import STYLES, reference_model
from torchgemma import Engine, MediaInputs, SamplingParams
from torchgemma.generation import generate, stream

pytestmark = pytest.mark.usefixtures("one_thread")

# Prompt lengths shorter and longer than the prefill chunk (4) and the sliding window (5).
PROMPTS = {"a": 9, "b": 3, "c": 14, "d": 6}
NEW = {"a": 20, "b": 5, "c": 12, "d": 16}  # "a" decodes through four wrap-arounds of the window
JOINS = {"a": 0, "b": 0, "d": 0, "c": 4}  # "c" is added at step 4, and waits for "b"'s slot
GREEDY = dict(sampling=SamplingParams(temperature=0), stop_token_ids=[])


class RecordingEngine(Engine):
    """Keeps every request's logits, to compare runs beyond their tokens (so greedy requests get
    their logits too: no greedy head)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, greedy_head=False, **kwargs)
        self.logits: dict = {}

    def _emit(self, request, logits):
        self.logits.setdefault(request.request_id, []).append(logits[0].clone())
        return super()._emit(request, logits)


def finish_reasons(outputs) -> dict:
    """Why each request that finished in these step outputs ended."""
    return {o.request_id: o.finish_reason for o in outputs if o.finished}


def prompts(seed: int = 0) -> dict[str, list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return {r: torch.randint(3, 300, (n,), generator=gen).tolist() for r, n in PROMPTS.items()}


def run(engine: Engine, requests: dict, joins: dict, **sampling) -> dict[str, list[int]]:
    """Add each request at its step; step until done; tokens per request."""
    out: dict[str, list[int]] = {}
    done: set[str] = set()
    step = 0
    while True:
        for request, at in joins.items():
            if at == step:
                engine.add_request(request, requests[request], max_new_tokens=NEW[request], **sampling)
        for output in engine.step():
            request = output.request_id
            assert request not in done, f"{request} produced a token after it finished"
            out.setdefault(request, []).append(output.token_id)
            if output.finished:
                done.add(request)
        step += 1
        if not engine.has_unfinished_requests() and step > max(joins.values()):
            return out


@pytest.mark.parametrize("backend", ["eager", "sdpa"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("style", list(STYLES))
def test_a_request_gets_what_it_gets_alone(gen_checkpoints, style, dtype, backend):
    """Three slots, four requests joining at different steps and finishing at different steps, with
    chunked prefill: each request's tokens equal its run alone; float64 logits equal (the same
    math), bf16 logits to the bit."""
    model = torchgemma.load(gen_checkpoints[style], dtype=dtype, attention=backend)
    requests = prompts()
    batched = RecordingEngine(model, max_batch_size=3, max_len=40, prefill_chunk=4)
    together = run(batched, requests, JOINS, **GREEDY)
    assert {r: len(t) for r, t in together.items()} == NEW
    for request in requests:
        alone_engine = RecordingEngine(model, max_batch_size=1, max_len=40, prefill_chunk=4)
        alone = run(alone_engine, requests, {request: 0}, **GREEDY)
        assert together[request] == alone[request], request
        ours, theirs = torch.stack(batched.logits[request]), torch.stack(alone_engine.logits[request])
        difference = (ours - theirs).abs().max()
        if dtype == torch.bfloat16:
            assert torch.equal(ours, theirs), f"{request}: max |Δ| {difference}"
        elif dtype == torch.float64:
            assert difference <= 1e-12, request
        else:
            # MKL's float32 GEMM rounds a row differently with the number of rows beside it (one
            # alone, three in the batch). Measured up to 3.2e-4 on these random checkpoints, whose
            # own float32 error against float64 is up to 2.4e-4 (logits of magnitude below 2).
            assert difference <= 5e-4, request


def logits_alone_and_batched(model, **engine_args) -> tuple[dict, dict]:
    """Every request's logits (stacked) in the staggered, ragged batch of JOINS and alone."""
    requests = prompts()
    batched = RecordingEngine(model, max_batch_size=3, max_len=40, prefill_chunk=4, **engine_args)
    run(batched, requests, JOINS, **GREEDY)
    alone = {}
    for request in requests:
        engine = RecordingEngine(model, max_batch_size=1, max_len=40, prefill_chunk=4, **engine_args)
        run(engine, requests, {request: 0}, **GREEDY)
        alone[request] = torch.stack(engine.logits[request])
    return {r: torch.stack(v) for r, v in batched.logits.items()}, alone


# One case in the default run (the emulation's per-product Python costs ~5x); the others are slow.
EMULATED_CASES = [
    pytest.param(
        style,
        backend,
        marks=[] if (style, backend) == ("e2b", "eager") else pytest.mark.slow,
    )
    for style in STYLES
    for backend in ("eager", "sdpa")
]


@pytest.mark.parametrize(("style", "backend"), EMULATED_CASES)
def test_bf16_batches_are_invariant_on_both_cpu_classes(gen_checkpoints, style, backend, avx512_dispatch):
    """bf16, oneDNN in its default state, on the AVX-512 CPUs' dispatch (emulated here: large bf16
    products take another kernel, tests/row_kernels.py): each request of a staggered, ragged batch
    gets its logits alone to the bit. (The native dispatch is test_a_request_gets_what_it_gets_alone.)
    Without batch invariance the same batch changes every request's bits, so the check can fail."""
    model = torchgemma.load(gen_checkpoints[style], dtype=torch.bfloat16, attention=backend)
    batched, alone = logits_alone_and_batched(model)
    for request in alone:
        assert torch.equal(batched[request], alone[request]), request
    if style == "e2b" and backend == "eager":
        batched, alone = logits_alone_and_batched(model, batch_invariant=False)
        assert any(not torch.equal(batched[r], alone[r]) for r in alone), "the emulation changed nothing"


def test_float32_batch_invariance_is_exact(gen_checkpoints):
    """float32: batch_invariant=True gives each request its logits alone exactly (MKL rounds 1, 2-3
    and 4+ rows three ways; the engine then runs requests apart where a batch reaches such a
    boundary). Off (the float32 default), they differ by rounding only."""
    model = torchgemma.load(gen_checkpoints["31b"], dtype=torch.float32, attention="sdpa")
    batched, alone = logits_alone_and_batched(model, batch_invariant=True)
    for request in alone:
        assert torch.equal(batched[request], alone[request]), request
    batched, alone = logits_alone_and_batched(model)
    for request in alone:
        assert (batched[request] - alone[request]).abs().max() <= 5e-4, request


@pytest.mark.parametrize("style", ["e2b", "26b"])
def test_batched_requests_match_transformers(gen_checkpoints, style):
    """bf16 greedy: every request of a changing batch equals transformers' generate of its prompt."""
    folder = gen_checkpoints[style]
    model = torchgemma.load(folder, dtype=torch.bfloat16, attention="eager")
    ref = reference_model(folder, torch.bfloat16)
    requests = prompts(seed=1)
    together = run(Engine(model, max_batch_size=3, max_len=40), requests, JOINS, **GREEDY)
    for request, prompt in requests.items():
        with torch.no_grad():
            theirs = ref.generate(
                torch.tensor([prompt]), max_new_tokens=NEW[request], do_sample=False, eos_token_id=None
            )
        assert together[request] == theirs[0, len(prompt) :].tolist(), request


def test_seeded_sampling_does_not_depend_on_neighbours(gen_checkpoints):
    model = torchgemma.load(gen_checkpoints["e4b"], dtype=torch.bfloat16)
    requests = prompts(seed=2)
    params = SamplingParams(temperature=0.9, top_k=50, top_p=0.95, repetition_penalty=1.1)
    seeded = dict(sampling=replace(params, seed=7), stop_token_ids=[])
    engine = Engine(model, max_batch_size=4, max_len=40)
    for request in requests:  # neighbours: seeded and unseeded samplers, and a greedy one
        engine.add_request(
            request, requests[request], max_new_tokens=NEW[request], sampling=params, stop_token_ids=[]
        )
    engine.add_request("x", requests["a"], max_new_tokens=12, **seeded)
    engine.add_request("greedy", requests["c"], max_new_tokens=12, sampling=SamplingParams(temperature=0))
    together: dict = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            together.setdefault(output.request_id, []).append(output.token_id)
    alone = Engine(model, max_batch_size=1, max_len=40)
    alone.add_request("x", requests["a"], max_new_tokens=12, **seeded)
    tokens = []
    while alone.has_unfinished_requests():
        tokens += [output.token_id for output in alone.step()]
    assert together["x"] == tokens
    other = replace(params, seed=8)
    other_seed = generate(model, [requests["a"]], max_new_tokens=12, sampling=other, stop_token_ids=[])[0]
    assert other_seed[len(requests["a"]) :] != tokens


def test_waiting_abort_and_finish_reasons(gen_checkpoints):
    model = torchgemma.load(gen_checkpoints["31b"], dtype=torch.float32)
    requests = prompts(seed=3)
    free = generate(model, [requests["b"]], max_new_tokens=10, **GREEDY)[0][len(requests["b"]) :]
    # b stops at the first token of its continuation not seen before it, after at least two steps.
    at = next(i for i in range(2, 10) if free[i] not in free[:i])
    stop = free[at]
    engine = Engine(model, max_batch_size=2, max_len=40)
    engine.add_request("a", requests["a"], max_new_tokens=30, **GREEDY)
    greedy = SamplingParams(temperature=0)
    engine.add_request("b", requests["b"], max_new_tokens=30, stop_token_ids=[stop], sampling=greedy)
    engine.add_request("c", requests["c"], max_new_tokens=2, **GREEDY)
    engine.add_request("d", requests["d"], max_new_tokens=2, **GREEDY)
    with pytest.raises(ValueError, match="already queued or running"):
        engine.add_request("a", requests["a"])
    seen = [{o.request_id for o in engine.step()} for _ in range(at)]
    assert seen == [{"a", "b"}] * at  # two slots: c and d wait
    engine.abort_request("d")  # a waiting request never runs
    outputs = engine.step()  # b produces its stop token
    assert ("b", stop, True) in [(o.request_id, o.token_id, o.finished) for o in outputs]
    assert finish_reasons(outputs) == {"b": "stop"}
    assert {o.request_id for o in engine.step()} == {"a", "c"}  # c took b's slot at once
    outputs = engine.step()
    assert {o.request_id for o in outputs} == {"a", "c"} and finish_reasons(outputs) == {"c": "length"}
    engine.abort_request("a")  # a running request: its slot is freed
    assert not engine.has_unfinished_requests() and engine.step() == []
    assert engine.cache.lengths == [0, 0]
    engine.abort_request("unknown")  # nothing to do


def test_bad_requests_are_refused_with_the_reason(gen_checkpoints):
    model = torchgemma.load(gen_checkpoints["31b"])
    engine = Engine(model, max_batch_size=1, max_len=10)
    with pytest.raises(ValueError, match="at least one prompt token"):
        engine.add_request("empty", [])
    with pytest.raises(ValueError, match=r"prompt token 1 is 300: token ids are ints in \[0, 300\)"):
        engine.add_request("vocab", [5, 300])
    with pytest.raises(ValueError, match="leaves no room to generate"):
        engine.add_request("long", list(range(3, 13)))
    with pytest.raises(ValueError, match="max_new_tokens must be >= 1"):
        engine.add_request("zero", [5, 6], max_new_tokens=0)
    with pytest.raises(ValueError, match="temperature"):
        engine.add_request("hot", [5, 6], sampling=SamplingParams(temperature=-1))
    # The budget is cut to the slot's room: 10 - 4 prompt tokens.
    engine.add_request("cut", [5, 6, 7, 8], max_new_tokens=100, **GREEDY)
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    assert len(outputs) == 6 and finish_reasons(outputs) == {"cut": "length"}
    assert [o.finish_reason for o in outputs] == [None] * 5 + ["length"]


def test_generate_and_stream_take_prompts_of_any_length(gen_checkpoints):
    """A list of id lists: each row its own sequence, no padding; generate returns lists."""
    model = torchgemma.load(gen_checkpoints["e2b"], dtype=torch.bfloat16)
    requests = prompts(seed=4)
    rows = [requests["a"], requests["b"], requests["c"]]
    out = generate(model, rows, max_new_tokens=7, **GREEDY)
    assert [len(r) for r in out] == [len(p) + 7 for p in rows]
    for row, prompt in zip(out, rows):
        assert row == generate(model, [prompt], max_new_tokens=7, **GREEDY)[0]
    # The same prompts left-padded in a tensor batch give the same tokens.
    padded = torch.zeros(3, 14, dtype=torch.long)
    mask = torch.zeros_like(padded)
    for i, prompt in enumerate(rows):
        padded[i, 14 - len(prompt) :] = torch.tensor(prompt)
        mask[i, 14 - len(prompt) :] = 1
    tensor_out = generate(model, padded, attention_mask=mask, max_new_tokens=7, **GREEDY)
    assert [r[len(p) :] for r, p in zip(out, rows)] == tensor_out[:, 14:].tolist()
    steps = list(stream(model, rows, max_new_tokens=7, **GREEDY))
    assert torch.stack(steps, 1).tolist() == tensor_out[:, 14:].tolist()
    with pytest.raises(ValueError, match="at least one token"):
        generate(model, [[5], []], max_new_tokens=2)


def test_stop_tokens_end_rows_of_a_list_batch(gen_checkpoints):
    model = torchgemma.load(gen_checkpoints["e4b"], dtype=torch.float32)
    requests = prompts(seed=5)
    free = generate(model, [requests["a"], requests["d"]], max_new_tokens=8, **GREEDY)
    stop = free[0][len(requests["a"]) + 2]
    greedy = SamplingParams(temperature=0)
    rows = [requests["a"], requests["d"]]
    out = generate(model, rows, max_new_tokens=8, sampling=greedy, stop_token_ids=[stop])
    assert out[0] == free[0][: len(requests["a"]) + 3]  # cut after its stop token
    first_stop = next((i for i, t in enumerate(free[1][len(requests["d"]) :]) if t == stop), None)
    expected = free[1] if first_stop is None else free[1][: len(requests["d"]) + first_stop + 1]
    assert out[1] == expected


def test_prefill_chunks_of_one_length_share_a_forward(gen_checkpoints, monkeypatch):
    """Three prompts of 6 tokens and one of 3, chunks of 4: the first step runs two forward passes
    (three 4-token chunks together, the 3-token prompt alone), the second one (three 2-token chunks);
    each request still gets what it gets alone. (float32, where the engine batches without asking
    the kernels: a bf16 engine on a CPU whose products round rows by count runs groups request by
    request, test_bf16_batches_are_invariant_on_both_cpu_classes.)"""
    model = torchgemma.load(gen_checkpoints["e4b"], dtype=torch.float32)
    gen = torch.Generator().manual_seed(9)
    requests = {r: torch.randint(3, 300, (n,), generator=gen).tolist() for r, n in zip("abcd", (6, 6, 3, 6))}
    shapes = []
    forward = model.language_model.forward

    def spy(input_ids, *args, **kwargs):
        shapes.append(tuple(input_ids.shape))
        return forward(input_ids, *args, **kwargs)

    monkeypatch.setattr(model.language_model, "forward", spy)
    engine = Engine(model, max_batch_size=4, max_len=20, prefill_chunk=4)
    for request, prompt in requests.items():
        engine.add_request(request, prompt, max_new_tokens=3, **GREEDY)
    first = engine.step()
    assert sorted(shapes) == [(1, 3), (3, 4)] and [o.request_id for o in first] == ["c"]
    shapes.clear()
    second = engine.step()
    assert shapes == [(3, 2), (1, 1)]  # the grouped chunks, then c's first decode step
    assert sorted(o.request_id for o in second) == ["a", "b", "c", "d"]
    together: dict = {r: [] for r in requests}
    for output in first + second:
        together[output.request_id].append(output.token_id)
    while engine.has_unfinished_requests():
        for output in engine.step():
            together[output.request_id].append(output.token_id)
    monkeypatch.undo()
    for request, prompt in requests.items():
        assert together[request] == generate(model, [prompt], max_new_tokens=3, **GREEDY)[0][len(prompt) :]


def test_a_request_whose_media_fail_fails_alone(gen_checkpoints, multimodal_checkpoint):
    """Media that do not fit their prompt fail that request at its prefill; the others go on."""
    model = torchgemma.load(multimodal_checkpoint, dtype=torch.float32)
    vision = model.config.vision_config
    patches = torch.rand(1, 16, 3 * vision.patch_size**2)
    positions = torch.stack(torch.meshgrid(torch.arange(4), torch.arange(4), indexing="xy"), -1).reshape(
        1, 16, 2
    )
    engine = Engine(model, max_batch_size=2, max_len=40)
    engine.add_request("good", [5, 6, 7, 8], max_new_tokens=3, **GREEDY)
    # An image but no image placeholders in the prompt: the soft tokens have nowhere to go.
    media = MediaInputs(pixel_values=patches, image_position_ids=positions)
    engine.add_request("bad", [5, 6, 7], max_new_tokens=3, media=media, **GREEDY)
    first = engine.step()
    failed = {o.request_id: o.error for o in first if o.error is not None}
    produced = [o for o in first if o.error is None]
    assert [o.request_id for o in produced] == ["good"] and set(failed) == {"bad"}
    assert "placeholder" in str(failed["bad"])
    bad = next(o for o in first if o.request_id == "bad")
    assert bad.finished and bad.finish_reason == "error" and bad.token_id is None
    tokens = [o.token_id for o in produced]
    while engine.has_unfinished_requests():
        tokens += [o.token_id for o in engine.step()]
    assert tokens == generate(model, [[5, 6, 7, 8]], max_new_tokens=3, **GREEDY)[0][4:]
    assert engine.cache.lengths == [0, 0]
