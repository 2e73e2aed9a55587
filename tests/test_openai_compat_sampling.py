"""OpenAI compatibility of the sampling and completion fields (issue 25, items 2 and 4), driven by the
official `openai` client: n > 1, lists of prompts, logit_bias, suffix/best_of, OpenAI's ranges,
logprobs in the chunk that carries their text, text_offset, echo with the prompt's logprobs,
ignore_eos, special tokens kept out of replies, the context-overflow wording, aborted requests in
/metrics.

A tiny random chat checkpoint serves where the model's choices do not matter; an engine double
(``ScriptedEngine``) where they do; the real Gemma 3 270M's vocabulary for the special tokens.
"""

from __future__ import annotations

import asyncio
import json
import math
import re
import time
from collections import deque
from types import SimpleNamespace

import httpx
import openai
import pytest

from serving_fixtures import ScriptedEngine, running_server
from torchgemma.generation import SamplingParams, generate
from torchgemma.generation.constraints import Grammar
from torchgemma.llm import LLM
from torchgemma.replies.grammar import CALL_START, CHANNEL_END, CHANNEL_START, QUOTE, STOP_MARKERS
from torchgemma.serving.app import create_app
from torchgemma.serving.metrics import Metrics
from torchgemma.serving.runner import Token
from torchgemma.serving.sequences import Run, hidden_token_ids
from torchgemma.serving.sequences import generate as generate_sequence
from torchgemma.serving.streaming import Prepared

pytestmark = pytest.mark.usefixtures("one_thread")

MODEL = "tiny-gemma"
MAX_LEN = 160
HI = [{"role": "user", "content": "Tell me about the sea."}]
SAMPLED = dict(temperature=1.0, max_tokens=8, extra_body={"top_k": 50})


@pytest.fixture(scope="module")
def llm(llm_checkpoint) -> LLM:  # noqa: F811
    return LLM(llm_checkpoint)


@pytest.fixture(scope="module")
def app(llm):
    return create_app(llm, model_name=MODEL, max_batch_size=4, max_len=MAX_LEN)


@pytest.fixture(scope="module")
def server(app):
    with running_server(app) as url:
        yield url


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0)


@pytest.fixture
def scripted(llm):
    """A server whose model says what the test scripts; yields (client, engine, base URL)."""
    engine = ScriptedEngine(llm.tokenizer, [], stop_id=llm.tokenizer.turn_end_id, max_len=512)
    with running_server(create_app(llm, model_name=MODEL, engine=engine)) as url:
        yield openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0), engine, url


def by_index(chunks) -> dict[int, str]:
    """A stream's text per choice index (chat deltas' content, or completions' text)."""
    texts: dict[int, str] = {}
    for chunk in chunks:
        for choice in chunk.choices:
            piece = choice.delta.content if hasattr(choice, "delta") else choice.text
            texts[choice.index] = texts.get(choice.index, "") + (piece or "")
    return texts


# ── n > 1 ────────────────────────────────────────────────────────────────────────────────────


def test_n_choices_are_seeded_sequences_of_one_prefill(app, client, monkeypatch):
    """n=3 with seed 11: choice i is what n=1 with seed 11 + i gives (distinct, reproducible
    streams), indexed 0..2, streamed with their index; usage counts the prompt once and every
    choice's tokens; the prompt was prefilled once (the engine forked it)."""
    engine = app.state.runner.engine
    prefilled = []
    original = engine._prefill

    def counting(group):
        prefilled.extend(request.request_id for request in group)
        return original(group)

    monkeypatch.setattr(engine, "_prefill", counting)
    many = client.chat.completions.create(model=MODEL, messages=HI, n=3, seed=11, **SAMPLED)
    assert len(prefilled) == 1  # one prompt chunk, one request: the two others were forked
    monkeypatch.undo()
    assert [c.index for c in many.choices] == [0, 1, 2]
    alone = [
        client.chat.completions.create(model=MODEL, messages=HI, seed=11 + i, **SAMPLED) for i in range(3)
    ]
    assert [c.message.content for c in many.choices] == [a.choices[0].message.content for a in alone]
    assert len({c.message.content for c in many.choices}) > 1
    assert many.usage.prompt_tokens == alone[0].usage.prompt_tokens
    assert many.usage.completion_tokens == sum(a.usage.completion_tokens for a in alone)
    assert many.usage.total_tokens == many.usage.prompt_tokens + many.usage.completion_tokens

    stream = list(
        client.chat.completions.create(
            model=MODEL,
            messages=HI,
            n=3,
            seed=11,
            stream=True,
            stream_options={"include_usage": True},
            **SAMPLED,
        )
    )
    assert by_index(stream) == {i: c.message.content for i, c in enumerate(many.choices)}
    finishes = {c.index: c.finish_reason for chunk in stream for c in chunk.choices if c.finish_reason}
    assert finishes == {i: c.finish_reason for i, c in enumerate(many.choices)}
    roles = [c.index for chunk in stream for c in chunk.choices if c.delta.role == "assistant"]
    assert sorted(roles) == [0, 1, 2]
    assert stream[-1].usage.completion_tokens == many.usage.completion_tokens


def test_completions_take_a_list_of_prompts_times_n(llm, client):
    """Four prompt forms: a list of texts and a list of token-id lists, each prompt with n=2,
    indexed prompt by prompt; each choice equals its prompt alone (greedy)."""
    prompts = ["The quick brown fox", "Once upon a time"]
    alone = [
        client.completions.create(model=MODEL, prompt=p, temperature=0, max_tokens=5).choices[0].text
        for p in prompts
    ]
    ids = [llm.encode(p) for p in prompts]
    for prompt in (prompts, ids):
        reply = client.completions.create(model=MODEL, prompt=prompt, n=2, temperature=0, max_tokens=5)
        assert [c.index for c in reply.choices] == [0, 1, 2, 3]
        assert [c.text for c in reply.choices] == [alone[0], alone[0], alone[1], alone[1]]
        assert reply.usage.prompt_tokens == len(ids[0]) + len(ids[1])
        assert reply.usage.completion_tokens == 4 * 5
        streamed = client.completions.create(
            model=MODEL, prompt=prompt, n=2, temperature=0, max_tokens=5, stream=True
        )
        assert by_index(streamed) == {i: c.text for i, c in enumerate(reply.choices)}
    with pytest.raises(openai.BadRequestError) as error:
        client.completions.create(model=MODEL, prompt=[[5, 6], [10**7]], max_tokens=2)
    assert error.value.param == "prompt.1"


def test_best_of_equal_to_n_and_refusals(client):
    reply = client.completions.create(model=MODEL, prompt="Hi", n=2, best_of=2, max_tokens=2, seed=1)
    assert len(reply.choices) == 2
    for fields, param, needle in (
        (dict(best_of=3), "best_of", "best_of=3 is not supported"),
        (dict(suffix=" the end"), "suffix", "fill-in-the-middle"),
        (dict(n=5), "n", "5 sequences run at once"),
    ):
        with pytest.raises(openai.BadRequestError) as error:
            client.completions.create(model=MODEL, prompt="Hi", max_tokens=2, **fields)
        assert error.value.param == param and needle in error.value.message, fields


# ── logit_bias ───────────────────────────────────────────────────────────────────────────────


def test_logit_bias_bans_and_forces(llm, client):
    ids = llm.encode("The quick brown fox")
    greedy = SamplingParams(temperature=0)
    first = generate(llm.model, [ids], max_new_tokens=1, sampling=greedy, stop_token_ids=[])[0][-1]
    plain = client.completions.create(model=MODEL, prompt=ids, temperature=0, max_tokens=1, logprobs=0)
    assert plain.choices[0].logprobs.tokens == [llm.tokenizer.decode([first])]
    banned = client.completions.create(
        model=MODEL, prompt=ids, temperature=0, max_tokens=1, logprobs=0, logit_bias={str(first): -100}
    )
    assert banned.choices[0].logprobs.tokens != plain.choices[0].logprobs.tokens
    forced_id = ids[-1]
    for temperature in (0, 1.0):
        forced = client.completions.create(
            model=MODEL,
            prompt=ids,
            temperature=temperature,
            max_tokens=4,
            seed=3,
            logit_bias={str(forced_id): 100},
        )
        assert forced.choices[0].text == llm.tokenizer.decode([forced_id] * 4)
    for bias, needle in (({str(10**7): 1}, "outside the vocabulary"), ({"5": 101}, "[-100, 100]")):
        with pytest.raises(openai.BadRequestError) as error:
            client.completions.create(model=MODEL, prompt=ids, max_tokens=1, logit_bias=bias)
        assert error.value.param == "logit_bias" and needle in error.value.message


# ── ranges ───────────────────────────────────────────────────────────────────────────────────


CHAT_OUT_OF_RANGE = [
    ("temperature", 2.5),
    ("temperature", -0.1),
    ("top_p", 1.5),
    ("top_p", -0.1),
    ("presence_penalty", 2.5),
    ("presence_penalty", -3),
    ("frequency_penalty", 3),
    ("top_logprobs", 21),
    ("n", 0),
    ("max_tokens", -1),
    ("max_completion_tokens", 0),
    ("min_p", 1.5),
]


@pytest.mark.parametrize(("field", "value"), CHAT_OUT_OF_RANGE)
def test_out_of_range_fields_are_refused_by_name(client, field, value):
    with pytest.raises(openai.BadRequestError) as error:
        client.chat.completions.create(model=MODEL, messages=HI, extra_body={field: value})
    assert error.value.param == field and error.value.type == "invalid_request_error"


def test_ranges_edges_and_field_pairs(client):
    """OpenAI's edges are accepted (temperature 2, top_p 0 and 1, penalties 0 and 2); pairs it refuses are
    refused: top_logprobs without logprobs, max_tokens 0 without echo; completions' logprobs <= 20."""
    for fields in (
        dict(temperature=2.0, seed=1),
        dict(top_p=0, temperature=1.0),
        dict(top_p=1),
        dict(presence_penalty=0),
        dict(presence_penalty=2, frequency_penalty=-2),
    ):
        assert client.chat.completions.create(model=MODEL, messages=HI, max_tokens=2, **fields).choices
    top_p_zero = client.chat.completions.create(
        model=MODEL, messages=HI, max_tokens=6, top_p=0, temperature=1.5, seed=4
    )
    greedy = client.chat.completions.create(model=MODEL, messages=HI, max_tokens=6, temperature=0)
    assert top_p_zero.choices[0].message.content == greedy.choices[0].message.content
    refusals = (
        (dict(top_logprobs=2), "top_logprobs", "needs logprobs"),
        (dict(max_tokens=0), "max_tokens", "at least 1"),
    )
    for fields, param, needle in refusals:
        with pytest.raises(openai.BadRequestError) as error:
            client.chat.completions.create(model=MODEL, messages=HI, **fields)
        assert error.value.param == param and needle in error.value.message, fields
    with pytest.raises(openai.BadRequestError) as error:
        client.completions.create(model=MODEL, prompt="Hi", logprobs=21)
    assert error.value.param == "logprobs"


# ── logprobs ─────────────────────────────────────────────────────────────────────────────────


def test_streamed_logprobs_ride_with_their_text(llm, client):
    """Chat and completions: no chunk carries logprobs without text, and the streamed entries are
    the whole reply's; completions' text_offset points at each token's text."""
    kwargs = dict(model=MODEL, messages=HI, temperature=0, max_tokens=10, logprobs=True, top_logprobs=2)
    whole = client.chat.completions.create(**kwargs)
    entries = []
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for choice in chunk.choices:
            if choice.logprobs and choice.logprobs.content:
                assert choice.delta.content, chunk  # never a delta {} of its own
                entries += choice.logprobs.content
    assert [(e.token, e.logprob) for e in entries] == [
        (e.token, e.logprob) for e in whole.choices[0].logprobs.content
    ]
    assert entries and all(len(e.top_logprobs) == 2 for e in entries)

    # Whole pieces only (a byte piece's text is a character that later bytes complete), in the
    # model's own order among them: every other token is held off by logit_bias.
    words = set(llm.tokenizer.encode("The quick brown fox jumps over the lazy dog", add_special_tokens=False))
    bias = {str(i): 100 for i in words - set(llm.tokenizer.byte_ids)}
    kwargs = dict(
        model=MODEL, prompt="The quick brown fox", temperature=0, max_tokens=10, logprobs=1, logit_bias=bias
    )
    whole = client.completions.create(**kwargs).choices[0]
    offsets = whole.logprobs.text_offset
    assert offsets[0] == 0 and len(offsets) == len(whole.logprobs.tokens) == 10
    for offset, token in zip(offsets, whole.logprobs.tokens):
        assert whole.text[offset : offset + len(token)] == token, (whole.text, whole.logprobs)
    echoed = client.completions.create(echo=True, **kwargs).choices[0]
    assert echoed.logprobs.text_offset[-10:] == [o + len("The quick brown fox") for o in offsets]
    tokens, streamed_offsets = [], []
    for chunk in client.completions.create(stream=True, **kwargs):
        choice = chunk.choices[0]
        if choice.logprobs and choice.logprobs.tokens:
            assert choice.text
            tokens += choice.logprobs.tokens
            streamed_offsets += choice.logprobs.text_offset
    assert tokens == whole.logprobs.tokens and streamed_offsets == offsets


def test_echo_with_logprobs_gives_the_prompts(llm, client):
    """echo + logprobs: every prompt token's entry, the first None (OpenAI's null); each equals the
    logprob the engine reports for that token generated after the tokens before it (forced with
    logit_bias, which the reported logprobs do not see); max_tokens 0 generates nothing."""
    ids = llm.encode("The quick brown fox jumps")
    echo = client.completions.create(model=MODEL, prompt=ids, echo=True, logprobs=2, max_tokens=0).choices[0]
    assert echo.text == llm.tokenizer.decode(ids) and echo.finish_reason == "length"
    streamed = list(
        client.completions.create(model=MODEL, prompt=ids, echo=True, logprobs=2, max_tokens=0, stream=True)
    )
    assert "".join(c.choices[0].text for c in streamed) == echo.text
    assert streamed[0].choices[0].logprobs.token_logprobs == echo.logprobs.token_logprobs
    lp = echo.logprobs
    assert len(lp.tokens) == len(ids) and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    for k in range(1, len(ids)):
        forced = client.completions.create(
            model=MODEL,
            prompt=ids[:k],
            max_tokens=1,
            temperature=0,
            logprobs=0,
            logit_bias={str(ids[k]): 100},
        ).choices[0]
        assert math.isclose(lp.token_logprobs[k], forced.logprobs.token_logprobs[0], abs_tol=1e-4), k
        assert len(lp.top_logprobs[k]) == 2 and max(lp.top_logprobs[k].values()) >= lp.token_logprobs[k]
    text = "The quick brown fox"
    both = client.completions.create(
        model=MODEL, prompt=text, echo=True, logprobs=0, max_tokens=3, temperature=0
    )
    choice = both.choices[0]
    assert choice.text.startswith(text) and len(choice.logprobs.tokens) == len(llm.encode(text)) + 3
    assert choice.logprobs.text_offset[0] == 0 and choice.logprobs.text_offset[-3] == len(text)
    assert both.usage.completion_tokens == 3
    streamed = list(
        client.completions.create(
            model=MODEL, prompt=text, echo=True, logprobs=0, max_tokens=3, temperature=0, stream=True
        )
    )
    assert streamed[0].choices[0].logprobs.token_logprobs[0] is None
    assert "".join(c.choices[0].text for c in streamed) == choice.text


# ── ignore_eos, special tokens, context, metrics ──────────────────────────────────────────────


def test_ignore_eos_generates_to_max_tokens(llm, client):
    """With eos forced by logit_bias, a reply ends at its first token; with ignore_eos it runs to
    max_tokens."""
    eos = llm.generation_config.eos_token_ids[0]
    kwargs = dict(model=MODEL, prompt="Hi", max_tokens=6, temperature=0, logit_bias={str(eos): 100})
    ends = client.completions.create(**kwargs)
    assert ends.choices[0].finish_reason == "stop" and ends.usage.completion_tokens == 1
    runs = client.completions.create(extra_body={"ignore_eos": True}, **kwargs)
    assert runs.choices[0].finish_reason == "length" and runs.usage.completion_tokens == 6


def special_texts(tokenizer) -> list[str]:
    """Every special or control token of the vocabulary (and its unused slots), but the stop markers
    (they end a reply) and what opens a thinking block or a tool call."""
    ids = set(hidden_token_ids(tokenizer)) | set(tokenizer.special_ids)
    texts = {tokenizer.backend.id_to_token(i) for i in ids}
    return sorted(texts - {*STOP_MARKERS, CHANNEL_START, CALL_START, QUOTE})


class ScriptedIds(ScriptedEngine):
    """Replays scripted token ids (not text: a piece such as <unused7> is no single token as text)."""

    def add_request(self, request_id, input_ids, **kwargs) -> None:
        self.prompts.append(list(input_ids))
        self.arguments.append(kwargs)
        self.requests[request_id] = deque([*self.replies.popleft(), self.stop_id])
        self._queue.append(request_id)


@pytest.fixture
def scripted_ids(llm):
    engine = ScriptedIds(llm.tokenizer, [], stop_id=llm.tokenizer.turn_end_id, max_len=512)
    with running_server(create_app(llm, model_name=MODEL, engine=engine)) as url:
        yield openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0), engine, url


def test_special_tokens_never_reach_content_or_reasoning(llm, scripted_ids):
    """Each special token of the tiny vocabulary between two words, in the answer and in a thinking
    block: the client gets the words alone, whole and streamed."""
    client, engine, _ = scripted_ids
    tokenizer = llm.tokenizer
    texts = special_texts(tokenizer)
    assert {"<|image>", "<|audio>", "<|video|>", "<mask>", "<unused7>"} <= set(texts)
    x = tokenizer.encode("x", add_special_tokens=False)
    body = x + [i for text in texts for i in [tokenizer.backend.token_to_id(text), *x]]
    expected = "x" * (len(texts) + 1)
    channel = [tokenizer.token_id(CHANNEL_START), *tokenizer.encode("thought\n", add_special_tokens=False)]
    inside = [t for t in texts if t != CHANNEL_END]  # (which ends the block)
    thinking = x + [i for text in inside for i in [tokenizer.backend.token_to_id(text), *x]]
    thought = channel + thinking + tokenizer.encode("<channel|>done", add_special_tokens=False)
    engine.replies.extend([body, body, thought])
    reply = client.chat.completions.create(model=MODEL, messages=HI)
    assert reply.choices[0].message.content == expected
    streamed = client.chat.completions.create(model=MODEL, messages=HI, stream=True)
    assert by_index(streamed) == {0: expected}
    thought = client.chat.completions.create(model=MODEL, messages=HI)
    assert thought.choices[0].message.content == "done"
    assert thought.choices[0].message.reasoning_content == "x" * (len(inside) + 1)


def test_special_tokens_of_the_real_270m_vocabulary_never_reach_content(real_270m):
    """All 6,000-odd special tokens of Gemma 3 270M's vocabulary (<mask>, <unusedN>, <start_of_image>,
    ...), each between two words, through the server's detokenizer and reply parser."""
    tokenizer = real_270m.tokenizer
    texts = special_texts(tokenizer)
    assert len(texts) > 6000 and "<unused99>" in texts and "<start_of_image>" in texts
    word = tokenizer.encode("x", add_special_tokens=False)
    ids = word + [i for text in texts for i in [tokenizer.token_id(text), *word]]
    state = SimpleNamespace(
        tokenizer=tokenizer,
        runner=SimpleNamespace(abort=lambda _: None),
        metrics=Metrics(lambda: 0, lambda: 0),
    )

    async def content() -> str:
        tokens: asyncio.Queue = asyncio.Queue()
        for position, token in enumerate(ids):
            last = position == len(ids) - 1
            tokens.put_nowait(Token(token, last, "length" if last else None, None))
        run = Run(0, Prepared(word, {}, [], tools=True), "r", tokens)
        events = [event async for event in generate_sequence(state, run)]
        assert all(kind in ("content", "finish") for kind, _ in events)
        return "".join(value for kind, value in events if kind == "content")

    assert asyncio.run(content()) == tokenizer.decode(word) * (len(texts) + 1)


def test_context_overflow_in_openai_words(client):
    """The wording litellm maps to ContextWindowExceededError ("This model's maximum context length
    is" in its OpenAI-compatible exception mapping), with OpenAI's code."""
    head = f"This model's maximum context length is {MAX_LEN} tokens. However, "
    cases = (
        (
            lambda: client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "word " * 400}]
            ),
            "messages",
            "your messages resulted in",
        ),
        (
            lambda: client.completions.create(model=MODEL, prompt="word " * 400),
            "prompt",
            "your prompt resulted in",
        ),
        (
            lambda: client.chat.completions.create(model=MODEL, messages=HI, max_tokens=10_000),
            "max_tokens",
            "in the messages, 10000 in the completion",
        ),
        (lambda: client.completions.create(model=MODEL, prompt="x " * 10**5), "prompt", "characters"),
    )
    for call, param, needle in cases:
        with pytest.raises(openai.BadRequestError) as error:
            call()
        assert error.value.code == "context_length_exceeded" and error.value.param == param
        message = error.value.body["message"]
        assert message.startswith(head) and needle in message, message


def metric(url: str, endpoint: str, reason: str) -> float:
    text = httpx.get(f"{url}/metrics").text
    found = re.search(
        rf'torchgemma_requests_total{{endpoint="{endpoint}",finish_reason="{reason}"}} (\S+)', text
    )
    return float(found.group(1)) if found else 0.0


def test_aborted_requests_are_counted(scripted):
    """A stream closed by its client is counted in /metrics' request counter, as "abort"."""
    client, engine, url = scripted
    engine.step_delay = 0.02

    def abandon(n: int, counted: int) -> None:
        """Open a stream of n choices, read one chunk, close it; wait for the abort count."""
        engine.replies.extend(["word " * 200] * n)
        stream = client.chat.completions.create(model=MODEL, messages=HI, stream=True, n=n)
        next(iter(stream))
        stream.close()
        deadline = time.monotonic() + 20
        while metric(url, "chat", "abort") < counted and time.monotonic() < deadline:
            time.sleep(0.05)
        assert metric(url, "chat", "abort") == counted

    abandon(1, 1)
    abandon(2, 3)  # n=2: each choice counts
    engine.step_delay = 0
    engine.replies.append("fine")
    client.chat.completions.create(model=MODEL, messages=HI)
    assert metric(url, "chat", "stop") == 1 and metric(url, "chat", "abort") == 3


def test_ignore_eos_reaches_the_engine(scripted):
    client, engine, _ = scripted
    engine.replies.extend(["a", "b"])
    client.chat.completions.create(model=MODEL, messages=HI, extra_body={"ignore_eos": True})
    client.chat.completions.create(model=MODEL, messages=HI)
    assert engine.arguments[0]["stop_token_ids"] == [] and engine.arguments[1]["stop_token_ids"]


def test_n_choices_each_follow_their_own_constraint(client, llm):
    """response_format json_object with n=2 (sampled): each choice keeps its own constraint's state,
    so each is a JSON object (or a valid prefix of one, cut at max_tokens)."""
    reply = client.chat.completions.create(
        model=MODEL,
        messages=HI,
        n=2,
        seed=5,
        temperature=1.0,
        max_tokens=60,
        response_format={"type": "json_object"},
    )
    assert len(reply.choices) == 2
    grammar = Grammar.json_object(llm.tokenizer)
    for choice in reply.choices:
        ids = llm.tokenizer.encode(choice.message.content, add_special_tokens=False)
        # The text, tokenized again, is accepted by a fresh JSON-object grammar as far as it goes.
        assert grammar.start().matcher.validate_tokens(ids) == len(ids), choice.message.content
        if choice.finish_reason == "stop":
            assert isinstance(json.loads(choice.message.content), dict)


def test_one_sequences_events_for_endpoints_that_shape_their_own_reply(llm):
    """streaming.generate: a prepared request's events, submitted and watched in one call."""
    from torchgemma.serving.chat import prepare_chat
    from torchgemma.serving.protocol import ChatCompletionRequest
    from torchgemma.serving.state import ServerState
    from torchgemma.serving.streaming import generate as generate_events

    engine = ScriptedEngine(llm.tokenizer, ["Hello there"], stop_id=llm.tokenizer.turn_end_id)
    state = ServerState.build(llm, model_name=MODEL, engine=engine)
    try:
        prepared = prepare_chat(state, ChatCompletionRequest(messages=HI))

        async def events():
            return [event async for event in generate_events(state, None, prepared)]

        got = asyncio.run(events())
        assert "".join(v for k, v in got if k == "content") == "Hello there"
        count = len(llm.tokenizer.encode("Hello there", add_special_tokens=False)) + 1  # and the stop token
        assert got[-1] == ("finish", ("stop", count)) and prepared.completion_tokens == count
    finally:
        state.close()


def test_presence_and_frequency_penalties_follow_openais_formula(client, llm):
    """Greedy with penalties: each token is the argmax of the model's log-probabilities minus
    frequency x (times generated so far) minus presence x (generated at all), as OpenAI defines them
    (checked by token id against the 20 most likely tokens each step reports); the server passes
    both fields on, and they change the reply."""
    from torchgemma.generation import Engine

    presence, frequency = 0.7, 1.5
    engine = Engine(llm.model, max_batch_size=1, max_len=64)
    params = SamplingParams(temperature=0, presence_penalty=presence, frequency_penalty=frequency)
    engine.add_request(
        "p", list(range(5, 17)), sampling=params, max_new_tokens=24, stop_token_ids=[], logprobs=20
    )
    counts: dict[int, int] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            scored = {
                token: logprob - frequency * counts.get(token, 0) - presence * (token in counts)
                for token, logprob in out.logprobs.top
            }
            assert out.token_id in scored and scored[out.token_id] == max(scored.values()), out.token_id
            counts[out.token_id] = counts.get(out.token_id, 0) + 1
    assert max(counts.values()) < 24  # not one token over and over

    def reply(**fields):
        return (
            client.chat.completions.create(
                model=MODEL,
                messages=HI,
                max_tokens=24,
                temperature=0,
                extra_body={"ignore_eos": True},
                **fields,
            )
            .choices[0]
            .message.content
        )

    assert reply(presence_penalty=presence, frequency_penalty=frequency) != reply()
