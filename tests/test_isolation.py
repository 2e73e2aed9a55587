"""One request cannot take down the others (issue 24, item 2): its failure is its own, a client that
went away frees its slot promptly, and a constrained request's cost per step is bounded.

Each case runs a request that fails (bad sampling values, NaN logits, a constraint that raises,
a client whose event loop has closed) beside neighbours, and checks both sides: the failing request
gets a clear error, and every neighbour gets exactly the tokens it gets alone.
"""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest
import torch

import torchgemma
from serving_fixtures import ScriptedEngine, running_server
from torchgemma import Engine, SamplingParams
from torchgemma.generation import EmbeddedPrompt, NonFiniteLogits, generate
from torchgemma.llm import LLM
from torchgemma.serving.app import create_app
from torchgemma.serving.chat import create_chat_completion
from torchgemma.serving.completions import create_completion
from torchgemma.serving.errors import APIError
from torchgemma.serving.protocol import ChatCompletionRequest, CompletionRequest
from torchgemma.serving.runner import EngineRunner
from torchgemma.serving.state import ServerState

pytestmark = pytest.mark.usefixtures("one_thread")

GREEDY = SamplingParams(temperature=0)
NEW = 8


@pytest.fixture(scope="module")
def model(gen_checkpoints):
    return torchgemma.load(gen_checkpoints["31b"], dtype=torch.float32)


def prompt(seed: int, length: int = 6) -> list[int]:
    return torch.randint(3, 300, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def alone(model, ids, sampling=GREEDY, new=NEW) -> list[int]:
    engine = Engine(model, max_batch_size=1, max_len=40)
    engine.add_request("alone", ids, sampling=sampling, max_new_tokens=new, stop_token_ids=[])
    tokens = []
    while engine.has_unfinished_requests():
        tokens += [output.token_id for output in engine.step()]
    return tokens


class RaisesAt:
    """A constraint that allows every token, and raises when asked for its ``at``-th token."""

    def __init__(self, at: int):
        self.at, self.seen = at, 0

    def allowed_mask(self, vocab: int) -> torch.Tensor:
        if self.seen == self.at:
            raise RuntimeError("the constraint broke")
        return torch.ones(vocab, dtype=torch.bool)

    def advance(self, token: int) -> None:
        self.seen += 1


# ── the engine ───────────────────────────────────────────────────────────────────────────────


def test_a_requests_failure_ends_it_alone(model):
    """Five requests in flight: NaN logits (a NaN in its embedded prompt), a constraint that raises
    at its third token, logit_bias banning every token, and two neighbours (one greedy at
    temperature 1e-40, which is greedy; one sampled with a seed). The three fail with their reason
    at the step they fail; the neighbours' tokens equal their runs alone; every slot is freed."""
    vocab = model.config.text.vocab_size
    ids = {name: prompt(seed) for seed, name in enumerate(["tiny", "sampled", "nan", "raises", "banned"])}
    sampled = SamplingParams(temperature=0.9, top_k=40, seed=5)
    engine = Engine(model, max_batch_size=5, max_len=40)
    common = dict(max_new_tokens=NEW, stop_token_ids=[])
    engine.add_request("tiny", ids["tiny"], sampling=SamplingParams(temperature=1e-40), **common)
    engine.add_request("sampled", ids["sampled"], sampling=sampled, **common)
    with torch.no_grad():
        embeds = model.language_model.embed(torch.tensor([ids["nan"]]))
    embeds[0, 2] = float("nan")
    nan_prompt = EmbeddedPrompt(embeds, model.text_ids(torch.tensor([ids["nan"]])))
    engine.add_request("nan", ids["nan"], sampling=GREEDY, embedded=nan_prompt, **common)
    engine.add_request("raises", ids["raises"], sampling=GREEDY, constraint=RaisesAt(2), **common)
    ban_all = SamplingParams(temperature=0.8, logit_bias={t: -100 for t in range(vocab)})
    engine.add_request("banned", ids["banned"], sampling=ban_all, **common)

    tokens: dict[str, list[int]] = {}
    errors: dict[str, tuple[int, Exception]] = {}
    step = 0
    while engine.has_unfinished_requests():
        step += 1
        for output in engine.step():
            if output.error is not None:
                assert output.finished and output.finish_reason == "error" and output.token_id is None
                errors[output.request_id] = (step, output.error)
            else:
                tokens.setdefault(output.request_id, []).append(output.token_id)
    assert set(errors) == {"nan", "raises", "banned"}
    at, error = errors["nan"]
    assert isinstance(error, NonFiniteLogits) and "non-finite logits" in str(error) and at == 1
    at, error = errors["raises"]
    assert str(error) == "the constraint broke" and at == 3 and len(tokens["raises"]) == 2
    at, error = errors["banned"]
    assert isinstance(error, ValueError) and "every token" in str(error) and at == 1
    assert tokens["tiny"] == alone(model, ids["tiny"])
    assert tokens["sampled"] == alone(model, ids["sampled"], sampled)
    assert engine.cache.lengths == [0] * 5 and not engine.requests


def test_generate_refuses_nan_logits_instead_of_token_zero(gen_checkpoints):
    """A checkpoint with NaN weights: the argmax of NaN logits is token 0, forever; generate raises
    the reason instead, on the greedy head's path and on the logits path."""
    model = torchgemma.load(gen_checkpoints["31b"], dtype=torch.float32)
    with torch.no_grad():
        model.language_model.layers[0].mlp.down_proj.weight[0, 0] = float("nan")
    for sampling in (GREEDY, SamplingParams(temperature=0.7, seed=1)):
        with pytest.raises(NonFiniteLogits, match="non-finite logits"):
            generate(model, [prompt(9)], max_new_tokens=4, sampling=sampling, stop_token_ids=[])


def test_tiny_temperatures_are_greedy_and_nan_making_values_are_refused():
    assert SamplingParams(temperature=1e-40).greedy and SamplingParams(temperature=0.009).greedy
    assert not SamplingParams(temperature=0.01).greedy
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0)) * 30
    from torchgemma.generation import next_token

    assert torch.equal(next_token(logits, SamplingParams(temperature=1e-40)), logits.argmax(-1))
    for field, value in [
        ("temperature", float("inf")),
        ("temperature", float("nan")),
        ("repetition_penalty", 1e-40),
        ("repetition_penalty", float("inf")),
        ("logit_bias", {3: 100.5}),
        ("logit_bias", {3: float("nan")}),
        ("logit_bias", {-1: 1.0}),
    ]:
        with pytest.raises(ValueError, match=field):
            SamplingParams(**{"temperature": 1.0, field: value})


# ── logit_bias ───────────────────────────────────────────────────────────────────────────────


def test_a_token_banned_with_minus_100_is_never_produced(model):
    """Greedy: the tokens the request produced alone, banned, never come back; sampled at a
    temperature that would flatten a mere -100 (T=1000), a banned token is never drawn."""
    ids = prompt(11)
    free = alone(model, ids)
    banned = {token: -100 for token in free}
    biased = alone(model, ids, SamplingParams(temperature=0, logit_bias=banned))
    assert not set(biased) & set(banned) and len(biased) == NEW
    hot = alone(model, ids, SamplingParams(temperature=1000.0, seed=3, logit_bias=banned), new=30)
    assert not set(hot) & set(banned) and len(set(hot)) > 5
    # +100 on one token makes it every greedy choice.
    assert alone(model, ids, SamplingParams(temperature=0, logit_bias={77: 100})) == [77] * NEW
    engine = Engine(model, max_batch_size=1, max_len=40)
    with pytest.raises(ValueError, match="logit_bias names token 300, outside the vocabulary"):
        engine.add_request("x", ids, sampling=SamplingParams(logit_bias={300: 1.0}))


# ── the runner ───────────────────────────────────────────────────────────────────────────────


async def _tokens(runner: EngineRunner, ids: list[int]) -> list[int]:
    _, queue = runner.submit(ids, sampling=GREEDY, max_new_tokens=NEW, stop_token_ids=[])
    tokens = []
    while (item := await queue.get()) is not None:
        if isinstance(item, Exception):
            raise item
        tokens.append(item.token_id)
    return tokens


def _settle(runner: EngineRunner) -> None:
    deadline = time.monotonic() + 30
    while (runner.running or runner.engine.requests) and time.monotonic() < deadline:
        time.sleep(0.02)


def test_a_closed_client_loop_is_dropped_and_the_engine_thread_goes_on(model):
    """A request whose event loop closed before its first token: the runner cannot hand it tokens
    (call_soon_threadsafe raises); it aborts that request, and the thread serves the next one."""
    runner = EngineRunner(Engine(model, max_batch_size=2, max_len=40))
    try:
        gone = asyncio.new_event_loop()

        async def submit():
            return runner.submit(prompt(1), sampling=GREEDY, max_new_tokens=30, stop_token_ids=[])

        gone.run_until_complete(submit())
        gone.close()
        live = asyncio.new_event_loop()
        tokens = live.run_until_complete(asyncio.wait_for(_tokens(runner, prompt(2)), 60))
        live.close()
        assert tokens == alone(model, prompt(2))
        _settle(runner)
        assert runner.running == 0 and not runner.engine.requests and runner._thread.is_alive()
        assert runner.engine.cache.lengths == [0, 0]
    finally:
        runner.close()


def test_an_error_in_the_runner_loop_fails_its_requests_not_the_thread(model):
    """A bug in the loop around the engine (here the metrics hook raising once) fails the requests
    in flight with the reason; the engine thread lives on and serves the next request."""

    class Metrics:
        calls = 0

        def first_token(self, seconds):
            pass

        def step(self, tokens, seconds):
            Metrics.calls += 1
            if Metrics.calls == 1:
                raise KeyError("broken metrics")

    runner = EngineRunner(Engine(model, max_batch_size=2, max_len=40), metrics=Metrics())
    try:
        loop = asyncio.new_event_loop()
        with pytest.raises(RuntimeError, match="generation failed: 'broken metrics'"):
            loop.run_until_complete(asyncio.wait_for(_tokens(runner, prompt(3)), 60))
        _settle(runner)
        assert runner.running == 0 and runner._thread.is_alive()
        assert loop.run_until_complete(asyncio.wait_for(_tokens(runner, prompt(3)), 60)) == alone(
            model, prompt(3)
        )
        loop.close()
    finally:
        runner.close()


# ── the server ───────────────────────────────────────────────────────────────────────────────


@pytest.fixture(scope="module")
def llm(llm_checkpoint) -> LLM:
    return LLM(llm_checkpoint)


def test_a_tiny_temperature_beside_three_neighbours(llm):
    """The issue's case: temperature=1e-40 with three neighbours in flight failed all four (HTTP 500).
    Now it is greedy, and every neighbour gets what it gets alone."""
    state = ServerState.build(llm, model_name="m", max_batch_size=4, max_len=160)
    loop = asyncio.new_event_loop()
    try:
        texts = ["The sea", "Hello there", "One two", "Stars at night"]

        async def complete(text, temperature):
            body = CompletionRequest(prompt=text, temperature=temperature, max_tokens=8, seed=1)
            return (await create_completion(state, body))["choices"][0]["text"]

        async def together():
            return await asyncio.gather(complete(texts[0], 1e-40), *(complete(t, 0.8) for t in texts[1:]))

        replies = loop.run_until_complete(together())
        assert replies[0] == llm.generate(texts[0], temperature=0, max_new_tokens=8)
        for text, reply in zip(texts[1:], replies[1:]):
            assert reply == llm.generate(text, temperature=0.8, seed=1, max_new_tokens=8)

        def refused(**fields):
            body = CompletionRequest(prompt="Hi", max_tokens=2, **fields)
            with pytest.raises(APIError) as caught:
                loop.run_until_complete(create_completion(state, body))
            return caught.value

        error = refused(logit_bias={"5000": -100})
        assert (
            error.status == 400 and error.param == "logit_bias" and "outside the vocabulary" in error.message
        )
        error = refused(logit_bias={"5": -101})
        assert error.status == 400 and error.param == "logit_bias"
        error = refused(repetition_penalty=1e-40)
        assert error.status == 400 and error.param == "repetition_penalty"
    finally:
        state.close()
        loop.close()


def test_logit_bias_reaches_the_engine(llm):
    """JSON's string keys become token ids in the request's SamplingParams, for chat and completions
    (the engine test above shows what the engine does with them)."""
    engine = ScriptedEngine(llm.tokenizer, ["ok", "ok"], stop_id=llm.tokenizer.turn_end_id)
    state = ServerState.build(llm, model_name="m", engine=engine)
    loop = asyncio.new_event_loop()
    try:
        bias = {"7": 2.5, "5": -100}
        loop.run_until_complete(create_completion(state, CompletionRequest(prompt="Hi", logit_bias=bias)))
        messages = [{"role": "user", "content": "Hi"}]
        loop.run_until_complete(
            create_chat_completion(state, ChatCompletionRequest(messages=messages, logit_bias=bias))
        )
        assert [a["sampling"].logit_bias for a in engine.arguments] == [((5, -100.0), (7, 2.5))] * 2
    finally:
        state.close()
        loop.close()


class Client:
    """A ``Request`` double: the connection is gone once ``gone`` is set."""

    def __init__(self):
        self.gone = False
        self.scope: dict = {}

    async def is_disconnected(self) -> bool:
        return self.gone

    async def receive(self) -> dict:
        """As a server's receive() once the body is read: returns when the connection is gone."""
        while not self.gone:
            await asyncio.sleep(0.005)
        return {"type": "http.disconnect"}


class GoesAway(ScriptedEngine):
    """Replies with many tokens; the client goes away at step ``leave_at``. Counts steps."""

    def __init__(self, tokenizer, client: Client, leave_at: int):
        super().__init__(tokenizer, ["word " * 600], stop_id=tokenizer.turn_end_id, max_len=512)
        self.client, self.leave_at, self.steps = client, leave_at, 0
        self.step_delay = 0.01

    def step(self):
        self.steps += 1
        if self.steps == self.leave_at:
            self.client.gone = True
        return super().step()


@pytest.mark.parametrize("stream", [False, True])
def test_a_client_that_went_away_is_aborted_within_a_few_steps(llm, stream):
    """Tokens keep coming (one each 10 ms), so a check made only after 0.5 s without a token never
    runs: the connection's end is waited for instead, whatever the token rate. The request is
    aborted within a bounded number of steps after its client left (60 of 10 ms allowed), not after
    its 600 tokens."""
    client = Client()
    engine = GoesAway(llm.tokenizer, client, leave_at=5)
    state = ServerState.build(llm, model_name="m", engine=engine)
    loop = asyncio.new_event_loop()
    try:
        body = ChatCompletionRequest(messages=[{"role": "user", "content": "Hi"}], stream=stream)

        async def run():
            response = await create_chat_completion(state, body, client)
            if stream:
                async for _ in response.body_iterator:
                    pass

        with pytest.raises(asyncio.CancelledError):
            loop.run_until_complete(asyncio.wait_for(run(), 60))
        deadline = time.monotonic() + 30
        while engine.requests and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not engine.requests, "the request still runs"
        assert engine.steps <= engine.leave_at + 60, engine.steps
        assert state.runner.running == 0
    finally:
        state.close()
        loop.close()


def test_a_non_streaming_client_that_gives_up_frees_its_slot(llm):
    """Over a socket: a client that gives up after 0.5 s (the issue's clients gave up after 2 s and
    their requests kept their slots) frees the slot long before its reply would have ended."""
    client = Client()  # never set: the real connection tells
    engine = GoesAway(llm.tokenizer, client, leave_at=-1)
    app = create_app(llm, model_name="m", engine=engine)
    with running_server(app) as url:
        body = {"messages": [{"role": "user", "content": "Hi"}]}
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{url}/v1/chat/completions", json=body, timeout=0.5)
        deadline = time.monotonic() + 20
        while engine.requests and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not engine.requests and engine.steps < 600
        assert app.state.runner.running == 0
