"""The compiled decode step: one graph, no graph breaks, no recompiles, same tokens as eager."""

from __future__ import annotations

import pytest
import torch

import torchgemma
from torchgemma import Engine, SamplingParams
from torchgemma.acceleration import decode_step

pytestmark = pytest.mark.usefixtures("one_thread")

# Tracing with dynamo costs seconds of CPU per model: the default run traces one case of each test
# (the cheapest), the others run with -m slow.
slow = pytest.mark.slow


@pytest.fixture(autouse=True)
def fresh_dynamo():
    # Compiled code is cached per function across models: start every test from nothing.
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.mark.parametrize(
    "style, backend",
    [
        pytest.param("e2b", "sdpa", marks=slow),
        pytest.param("26b", "sdpa", marks=slow),
        ("31b", "sdpa"),
        pytest.param("e2b", "eager", marks=slow),
    ],
)
def test_decode_step_has_no_graph_breaks(text_checkpoints, style, backend):
    """E2B (PLE, KV sharing), 26B (MoE: the gathered expert path) and 31B (K=V): one graph, with
    either attention backend (E4B has no part E2B lacks)."""
    model = torchgemma.load(text_checkpoints[style], dtype=torch.bfloat16, attention=backend)
    cache = model.make_cache(4, 32)
    tokens = torch.tensor([[5], [6], [7], [8]])
    positions = torch.tensor([3, 0, 7, 31])  # slot 3 is full: idle, it must not write past the end
    active = torch.tensor([True, False, True, False])
    explained = torch._dynamo.explain(decode_step)(model, cache, tokens, positions, active)
    assert explained.graph_break_count == 0, explained.break_reasons
    assert explained.graph_count == 1


def counting_backend(graphs: list):
    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    return backend


def run(engine: Engine, requests: dict[str, list[int]], joins: dict[str, int], new: int) -> dict:
    out: dict[str, list[int]] = {}
    step = 0
    while engine.has_unfinished_requests() or step <= max(joins.values()):
        for request, at in joins.items():
            if at == step:
                engine.add_request(
                    request,
                    requests[request],
                    max_new_tokens=new,
                    sampling=SamplingParams(temperature=0),
                    stop_token_ids=[],
                )
        for output in engine.step():
            assert output.error is None, f"request {output.request_id}: {output.error!r}"
            out.setdefault(output.request_id, []).append(output.token_id)
        step += 1
    return out


@pytest.mark.parametrize("style", [pytest.param("e2b", marks=slow), pytest.param("26b", marks=slow), "31b"])
def test_compiled_engine_never_recompiles(gen_checkpoints, style):
    """Requests join and leave (occupancy 1 to 3 of 3 slots, slots reused): the step is traced once,
    and gives the eager engine's greedy tokens."""
    gen = torch.Generator().manual_seed(0)
    requests = {
        r: torch.randint(3, 300, (n,), generator=gen).tolist() for r, n in zip("abcde", (7, 3, 9, 4, 6))
    }
    joins = {"a": 0, "b": 1, "c": 1, "d": 6, "e": 9}
    eager = torchgemma.load(gen_checkpoints[style], dtype=torch.float32)
    expected = run(Engine(eager, max_batch_size=3, max_len=32), requests, joins, new=8)

    graphs: list = []
    model = torchgemma.compile(
        torchgemma.load(gen_checkpoints[style], dtype=torch.float32), backend=counting_backend(graphs)
    )
    engine = Engine(model, max_batch_size=3, max_len=32)
    assert run(engine, requests, joins, new=8) == expected
    assert len(graphs) == 1
    # A second batch of requests through the same engine: still the one graph.
    assert run(engine, requests, {"a": 0, "e": 2}, new=5) == {r: expected[r][:5] for r in "ae"}
    assert len(graphs) == 1


@pytest.mark.slow
@pytest.mark.parametrize("style", ["e2b", "26b"])
def test_inductor_compiled_engine_matches_eager(gen_checkpoints, style):
    """The real thing: torch.compile with inductor on CPU (minutes to compile on 2 cores)."""
    gen = torch.Generator().manual_seed(1)
    requests = {r: torch.randint(3, 300, (n,), generator=gen).tolist() for r, n in zip("abc", (7, 3, 9))}
    joins = {"a": 0, "b": 0, "c": 3}
    eager = torchgemma.load(gen_checkpoints[style], dtype=torch.float32)
    expected = run(Engine(eager, max_batch_size=2, max_len=32), requests, joins, new=8)
    model = torchgemma.compile(torchgemma.load(gen_checkpoints[style], dtype=torch.float32))
    assert run(Engine(model, max_batch_size=2, max_len=32), requests, joins, new=8) == expected


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize(
    "style",
    [
        pytest.param(
            "e2b",
            marks=pytest.mark.xfail(
                reason="H200, 2026-11-27: the CUDA-graph step of an E2B-like model (its per-layer table in "
                "host memory) failed every request after its first token; the error was not captured",
                strict=False,
            ),
        ),
        "26b",
        "31b",
    ],
)
def test_cuda_graph_engine_matches_eager(gen_checkpoints, style):
    """On CUDA: the compiled step captured in CUDA graphs gives the eager engine's greedy tokens."""
    gen = torch.Generator().manual_seed(2)
    requests = {r: torch.randint(3, 300, (n,), generator=gen).tolist() for r, n in zip("abcd", (7, 3, 9, 5))}
    joins = {"a": 0, "b": 0, "c": 3, "d": 5}
    eager = torchgemma.load(gen_checkpoints[style], dtype=torch.float32, device="cuda")
    expected = run(Engine(eager, max_batch_size=3, max_len=32), requests, joins, new=8)
    model = torchgemma.compile(torchgemma.load(gen_checkpoints[style], dtype=torch.float32, device="cuda"))
    assert model.compiled_decode.cuda_graphs
    assert run(Engine(model, max_batch_size=3, max_len=32), requests, joins, new=8) == expected


def _requantized(model, fmt):
    """``model`` with every quantizable layer in ``fmt`` (the formats GGUF blocks load as)."""
    from torchgemma.quantization import float_weight, quantizable, quantized_shell, replace_module

    done = 0
    for name, item in list(quantizable(model)):
        if float_weight(item).shape[-1] % fmt.group_size:
            continue  # as quantize does: a width the groups cannot hold stays in full precision
        shell = quantized_shell(item, fmt, model.dtype)
        with torch.no_grad():
            shell.set_weight(float_weight(item))
        replace_module(model, name, shell)
        done += 1
    assert done, "no layer in this format"
    return model


@pytest.mark.parametrize(
    "style, fmt",
    [
        pytest.param("e2b", None, marks=slow, id="e2b-None"),
        pytest.param("e2b", (5, 32, True, "float16"), marks=slow, id="e2b-fmt1"),
        pytest.param("e2b", (8, 32, False, "float16"), marks=slow, id="e2b-fmt2"),
        pytest.param("26b", None, id="26b-None"),
        pytest.param("26b", (5, 32, True, "float16"), marks=slow, id="26b-fmt1"),
        pytest.param("26b", (8, 32, False, "float16"), marks=slow, id="26b-fmt2"),
    ],
)
def test_quantized_decode_step_is_one_graph(text_checkpoints, style, fmt):
    """Quantized layers are torch.library operators with fake kernels: the static decode step of a
    quantized model (E2B: tables and PLE; 26B: expert stacks, gathered) still traces as one graph,
    int8 or in the 5-bit and float16-scale formats of GGUF blocks."""
    from torchgemma.quantization import Format

    if fmt is None:
        model = torchgemma.load(text_checkpoints[style], quantize="int8")
    else:
        model = _requantized(torchgemma.load(text_checkpoints[style]), Format(*fmt))
    cache = model.make_cache(2, 16)
    tokens, positions, active = torch.tensor([[5], [6]]), torch.tensor([3, 0]), torch.tensor([True, False])
    explained = torch._dynamo.explain(decode_step)(model, cache, tokens, positions, active)
    assert explained.graph_break_count == 0, explained.break_reasons
    assert explained.graph_count == 1
    compiled = torch.compile(decode_step, backend="eager", fullgraph=True)
    with torch.inference_mode():
        expected = decode_step(model, cache, tokens, positions, active)
        got = compiled(model, cache, tokens, positions, active)
    # 26B: the eager step multiplies quantized expert stacks, the traced one dequantizes gathers.
    assert (got - expected).abs().max() <= 1e-5 * expected.abs().max()
