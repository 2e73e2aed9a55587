"""Constrained decoding (generation/constraints.py, replies/tool_grammar.py): JSON Schema, JSON
objects, regexes and Gemma's tool-call syntax, per request, batched.

The tiny random checkpoint writes junk on its own, which is what a constraint must fix: every
constrained reply here must parse and validate against its schema (``jsonschema``, the reference
validator), or be a well-formed call of a declared tool whose arguments validate. The schemas bound
their strings and numbers so that a random model's reply ends within the token budget.
"""

from __future__ import annotations

import json
import re
import sys

import jsonschema
import openai
import pydantic
import pytest
import torch

import torchgemma
from serving_fixtures import running_server
from torchgemma import Engine, Grammar, SamplingParams
from torchgemma.llm import LLM
from torchgemma.replies import parse_reply
from torchgemma.serving.app import create_app

pytestmark = pytest.mark.usefixtures("one_thread")

GREEDY = SamplingParams(temperature=0)
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 99},
        "member": {"type": "boolean"},
        "color": {"type": "string", "enum": ["red", "green", "blue"]},
    },
    "required": ["name", "age", "member", "color"],
    "additionalProperties": False,
}
WEATHER = {
    "name": "get_weather",
    "description": "Weather in a city",
    "parameters": {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 8},
            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            "days": {"type": "integer", "enum": [1, 2, 3]},
        },
        "required": ["city", "unit"],
    },
}
ADD = {
    "name": "add",
    "parameters": {
        "type": "object",
        "properties": {"a": {"type": "boolean"}, "b": {"type": "string", "enum": ["x", "y"]}},
        "required": ["a", "b"],
    },
}
TOOLS = [{"type": "function", "function": WEATHER}, {"type": "function", "function": ADD}]
SCHEMAS = {tool["function"]["name"]: tool["function"]["parameters"] for tool in TOOLS}


@pytest.fixture(scope="module")
def llm(llm_checkpoint) -> LLM:
    return LLM(llm_checkpoint)


def feed(grammar: Grammar, ids: list[int], stop: int) -> tuple[bool, bool]:
    """Whether every id is allowed in turn, and then whether ``stop`` is."""
    constraint = grammar.start([stop])
    for token in ids:
        if not constraint.allowed_mask(grammar.lltokenizer.vocab_size)[token]:
            return False, False
        constraint.advance(token)
    return True, bool(constraint.allowed_mask(grammar.lltokenizer.vocab_size)[stop])


def test_json_schema_mask_allows_valid_text_and_stop_only_at_the_end(llm):
    tokenizer, stop = llm.tokenizer, llm.tokenizer.turn_end_id
    grammar = Grammar.json_schema(tokenizer, PERSON)
    valid = '{"name": "Ann", "age": 42, "member": true, "color": "red"}'
    ids = tokenizer.encode(valid, add_special_tokens=False)
    assert feed(grammar, ids, stop) == (True, True)
    assert feed(grammar, ids[:-1], stop) == (True, False)  # not closed: no stop yet
    for invalid in (
        '{"name": "Ann", "age": 420',  # above maximum
        '{"name": "Annabelle"',  # longer than maxLength
        '{"age": 1',  # out of order is fine in JSON, but "name" is missing before... any key but these
        '{"name": "A", "age": 1, "member": true, "color": "pink"}',
    ):
        allowed, _ = feed(grammar, tokenizer.encode(invalid, add_special_tokens=False), stop)
        assert not allowed or not json_valid(invalid), invalid
    with pytest.raises(ValueError, match="cannot be enforced|JSON schema"):
        Grammar.json_schema(tokenizer, {"type": "object", "properties": {"a": {"type": "no-such-type"}}})


def test_without_llguidance_the_error_says_what_to_install(llm, monkeypatch):
    monkeypatch.setitem(sys.modules, "llguidance", None)  # as if not installed
    with pytest.raises(ImportError, match=r"needs llguidance: pip install 'torchgemma\[constraints\]'"):
        Grammar.json_object(llm.tokenizer)


def json_valid(text: str) -> bool:
    try:
        jsonschema.validate(json.loads(text), PERSON)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


def test_greedy_reads_the_mask_bits_only_when_they_decide(llm):
    """Greedy, a constraint takes the unconstrained argmax when its mask bits allow it, and else the
    argmax over the allowed tokens: the same tokens as masking the whole vocabulary every step,
    stop ids and ids sharing their bytes with others included."""
    from torchgemma.generation.constraints import constrained_token

    tokenizer, stop = llm.tokenizer, llm.tokenizer.turn_end_id
    grammar = Grammar.json_schema(tokenizer, PERSON)
    fast, full = grammar.start([stop]), grammar.start([stop])
    generator = torch.Generator().manual_seed(0)
    valid = tokenizer.encode(
        '{"name": "Bo", "age": 7, "member": false, "color": "blue"}', add_special_tokens=False
    )
    vocab = tokenizer.vocab_size
    for step in range(400):
        logits = torch.randn(1, vocab, generator=generator)
        if step % 2 == 0 and step < len(valid):  # the model follows the format half the time
            logits[0, valid[step]] = 50.0
        if step >= len(valid):
            logits[0, stop] = 40.0
        expected = int(torch.where(full.allowed_mask(vocab), logits, float("-inf"))[0].argmax())
        full.advance(expected)
        fast.fill()
        token, _ = constrained_token(fast, logits, GREEDY, None, None)
        assert token == expected, step
        if token == stop:
            break
    assert token == stop


def test_tool_call_grammar_is_gemmas_syntax_over_the_declared_schemas(llm):
    """Well-formed calls of declared tools with schema-valid arguments are accepted token by token
    and parse back to those arguments; an undeclared tool, a value outside an enum, a missing
    required argument, JSON quotes and a second call when parallel calls are off are refused."""
    tokenizer, stop = llm.tokenizer, llm.tokenizer.turn_end_id
    grammar = Grammar.tool_calls(tokenizer, TOOLS)
    single = Grammar.tool_calls(tokenizer, TOOLS, parallel=False)
    named = Grammar.tool_calls(tokenizer, TOOLS, name="add")
    q = '<|"|>'
    weather = f"<|tool_call>call:get_weather{{city:{q}Paris{q},days:2,unit:{q}celsius{q}}}<tool_call|>"
    add = f"<|tool_call>call:add{{a:true,b:{q}y{q}}}<tool_call|>"
    for g, text, expected in (
        (grammar, weather, [("get_weather", {"city": "Paris", "days": 2, "unit": "celsius"})]),
        (
            grammar,
            weather + add,
            [
                ("get_weather", {"city": "Paris", "days": 2, "unit": "celsius"}),
                ("add", {"a": True, "b": "y"}),
            ],
        ),
        (single, add, [("add", {"a": True, "b": "y"})]),
        (named, add, [("add", {"a": True, "b": "y"})]),
    ):
        assert feed(g, tokenizer.encode(text, add_special_tokens=False), stop) == (True, True), text
        assert [(c.name, c.arguments) for c in parse_reply(text).tool_calls] == expected
    for g, text in (
        (grammar, f"<|tool_call>call:remove{{a:true,b:{q}y{q}}}<tool_call|>"),
        (grammar, f"<|tool_call>call:get_weather{{city:{q}Paris{q},unit:{q}kelvin{q}}}<tool_call|>"),
        (grammar, f"<|tool_call>call:get_weather{{city:{q}Paris{q}}}<tool_call|>"),
        (grammar, '<|tool_call>call:add{a:true,b:"y"}<tool_call|>'),
        (grammar, "Sure! " + add),
        (single, add + add),
        (named, weather),
    ):
        assert feed(g, tokenizer.encode(text, add_special_tokens=False), stop)[0] is False, text
    # The reply may not end before its call.
    assert feed(grammar, [], stop) == (True, False)


def test_tool_call_grammar_with_a_thought_first_or_optional_calls(llm):
    """thinking: a thought may come before the call (not after it); optional (auto with
    parallel_tool_calls false): text, a call, or text then a call, never two calls."""
    tokenizer, stop = llm.tokenizer, llm.tokenizer.turn_end_id
    q = '<|"|>'
    add = f"<|tool_call>call:add{{a:false,b:{q}x{q}}}<tool_call|>"
    thought = "<|channel>thought\nThe user wants a sum.<channel|>"
    thinking = Grammar.tool_calls(tokenizer, TOOLS, thinking=True)
    optional = Grammar.tool_calls(tokenizer, TOOLS, parallel=False, optional=True)
    for grammar, text, ok in (
        (thinking, thought + add, True),
        (thinking, add, True),
        (thinking, add + thought, False),
        (thinking, thought, False),
        (optional, "Hello there.", True),
        (optional, "Let me add. " + add, True),
        (optional, add, True),
        (optional, add + add, False),
        (optional, add + "Done.", False),
    ):
        allowed, may_stop = feed(grammar, tokenizer.encode(text, add_special_tokens=False), stop)
        assert (allowed and may_stop) == ok, text


def test_engine_follows_a_token_constraint_greedy_and_sampled(gen_checkpoints):
    """Any object with allowed_mask/advance is a constraint: one allowing a fixed sequence forces
    exactly that output, greedy or sampled, and the stop token only once it is allowed."""
    model = torchgemma.load(gen_checkpoints["31b"], dtype=torch.float32)

    class Script:
        def __init__(self, ids, stop):
            self.ids, self.stop, self.at = ids, stop, 0

        def allowed_mask(self, vocab):
            allowed = torch.zeros(vocab, dtype=torch.bool)
            allowed[self.ids[self.at] if self.at < len(self.ids) else self.stop] = True
            return allowed

        def advance(self, token):
            self.at += token != self.stop

    for sampling in (dict(temperature=0), dict(temperature=1.0, seed=4)):
        engine = Engine(model, max_batch_size=1, max_len=40)
        engine.add_request(
            "r",
            [5, 6, 7],
            max_new_tokens=10,
            stop_token_ids=[1],
            constraint=Script([42, 43, 44], 1),
            sampling=engine.generation_config.sampling(**sampling),
        )
        tokens = []
        while engine.has_unfinished_requests():
            tokens += [output.token_id for output in engine.step()]
        assert tokens == [42, 43, 44, 1]


def run(engine: Engine) -> dict:
    tokens: dict = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            assert output.error is None, output.error
            tokens.setdefault(output.request_id, []).append(output.token_id)
    return tokens


def test_greedy_constrained_output_equals_unconstrained_when_the_model_follows_it(llm):
    """Masking leaves the allowed logits alone: a grammar that allows exactly the text the model
    writes unconstrained (a regex of it) gives the same tokens, token for token."""
    tokenizer = llm.tokenizer
    prompt = tokenizer.encode("The quick brown fox")
    engine = Engine(llm.model, max_batch_size=1, max_len=64)
    engine.add_request("free", prompt, sampling=GREEDY, max_new_tokens=12, stop_token_ids=[])
    free = run(engine)["free"]
    assert not set(free) & tokenizer.special_ids
    text = tokenizer.decode(free)
    grammar = Grammar.regex(tokenizer, re.escape(text) + "(?s:.*)")
    engine.add_request(
        "constrained", prompt, sampling=GREEDY, max_new_tokens=12, stop_token_ids=[], constraint=grammar
    )
    assert run(engine)["constrained"] == free


def test_mixed_batch_unconstrained_rows_equal_their_solo_runs(llm):
    """Four requests in one batch: two follow the schema (their replies validate), two are free,
    one greedy and one sampled; the free ones get exactly their solo tokens."""
    tokenizer, stop = llm.tokenizer, llm.tokenizer.turn_end_id
    grammar = Grammar.json_schema(tokenizer, PERSON)
    prompts = {name: tokenizer.encode(f"Record {name}:") for name in ("a", "b", "c", "d")}
    sampled = SamplingParams(temperature=1.0, seed=7)
    free = {"c": GREEDY, "d": sampled}
    solo = {}
    for name, sampling in free.items():
        engine = Engine(llm.model, max_batch_size=1, max_len=400)
        engine.add_request(name, prompts[name], sampling=sampling, max_new_tokens=20, stop_token_ids=[stop])
        solo[name] = run(engine)[name]
    engine = Engine(llm.model, max_batch_size=4, max_len=400)
    for name in ("a", "b"):
        engine.add_request(
            name,
            prompts[name],
            sampling=SamplingParams(temperature=1.0, seed=ord(name)),
            max_new_tokens=300,
            stop_token_ids=[stop],
            constraint=grammar,
        )
    for name, sampling in free.items():
        engine.add_request(name, prompts[name], sampling=sampling, max_new_tokens=20, stop_token_ids=[stop])
    tokens = run(engine)
    assert {name: tokens[name] for name in free} == solo
    for name in ("a", "b"):
        assert tokens[name][-1] == stop
        jsonschema.validate(json.loads(tokenizer.decode(tokens[name][:-1])), PERSON)


def test_generate_and_llm_generate_take_a_constraint(llm):
    """torchgemma.generate: every row of a batch follows the grammar with its own state; with no
    stop ids a row ends with the tokenizer's eos once its grammar is complete. LLM.generate takes
    response_format."""
    tokenizer = llm.tokenizer
    grammar = Grammar.json_schema(tokenizer, PERSON)
    prompts = [tokenizer.encode("One:"), tokenizer.encode("And another one:")]
    sampling = SamplingParams(temperature=1.0, seed=9)
    rows = torchgemma.generate(
        llm.model, prompts, max_new_tokens=300, sampling=sampling, stop_token_ids=[], constraint=grammar
    )
    eos = tokenizer.named_id("eos_token")
    for prompt, row in zip(prompts, rows):
        reply = row[len(prompt) :]
        end = reply.index(eos)  # (a batch's finished rows are padded after it)
        jsonschema.validate(json.loads(tokenizer.decode(reply[:end])), PERSON)
    text = llm.generate("A person:", response_format=Person, temperature=1.0, seed=4, max_new_tokens=300)
    Person.model_validate_json(text)
    with pytest.raises(TypeError, match="Grammar"):
        torchgemma.generate(llm.model, prompts, max_new_tokens=4, constraint=grammar.start())


class Person(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=6)
    age: int = pydantic.Field(ge=0, le=99)
    member: bool


def test_llm_chat_response_format_and_tool_choice(llm):
    messages = [{"role": "user", "content": "Tell me about someone."}]
    for response_format in (
        Person,
        {"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON, "strict": True}},
    ):
        reply = llm.chat(
            messages, response_format=response_format, temperature=1.0, seed=3, max_new_tokens=300
        )
        assert reply.finish_reason == "stop"
        schema = Person.model_json_schema() if response_format is Person else PERSON
        jsonschema.validate(json.loads(reply.text), schema)
    # A temperature that flattens the distribution over the whole vocabulary: still the schema.
    reply = llm.chat(messages, response_format=Person, temperature=50.0, seed=2, max_new_tokens=400)
    assert reply.finish_reason == "stop"
    Person.model_validate_json(reply.text)
    reply = llm.chat(messages, response_format={"type": "json_object"}, temperature=0, max_new_tokens=40)
    assert reply.text.startswith("{")
    for choice, parallel, names in (
        ("required", False, {"get_weather", "add"}),
        ({"type": "function", "function": {"name": "add"}}, None, {"add"}),
    ):
        reply = llm.chat(
            messages,
            tools=TOOLS,
            tool_choice=choice,
            parallel_tool_calls=parallel,
            temperature=1.0,
            seed=1,
            max_new_tokens=120,
        )
        assert reply.finish_reason == "stop" and reply.tool_calls, reply
        if parallel is False:
            assert len(reply.tool_calls) == 1
        for call in reply.tool_calls:
            assert call.name in names
            jsonschema.validate(call.arguments, SCHEMAS[call.name])
    with pytest.raises(ValueError, match="response_format"):
        llm.chat(messages, tools=TOOLS, tool_choice="required", response_format={"type": "json_object"})
    with pytest.raises(ValueError, match="needs tools"):
        llm.chat(messages, tool_choice="required")
    with pytest.raises(ValueError, match="no tool named 'remove'"):
        llm.chat(messages, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "remove"}})


# ── the server, through the official client ──────────────────────────────────────────────────


@pytest.fixture(scope="module")
def client(llm):
    with running_server(create_app(llm, model_name="tiny", max_batch_size=4, max_len=1024)) as url:
        yield openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)


def ask(client, **kwargs):
    kwargs.setdefault("messages", [{"role": "user", "content": "Who is it?"}])
    kwargs.setdefault("max_tokens", 300)
    return client.chat.completions.create(model="tiny", **kwargs)


def test_server_json_schema_strict_and_not_and_parse(client):
    parsed = client.chat.completions.parse(
        model="tiny",
        messages=[{"role": "user", "content": "Who?"}],
        response_format=Person,
        temperature=1.0,
        seed=5,
        max_tokens=300,
    )
    person = parsed.choices[0].message.parsed
    assert isinstance(person, Person) and len(person.name) <= 6 and 0 <= person.age <= 99
    for strict in (True, False):
        response = ask(
            client,
            temperature=1.0,
            seed=11,
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "p", "schema": PERSON, "strict": strict},
            },
        )
        assert response.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(response.choices[0].message.content), PERSON)
    bad_schema = {"type": "json_schema", "json_schema": {"name": "p", "schema": {"type": 3}}}
    for fields, param in (
        (dict(response_format=bad_schema), "response_format"),
        # The deprecated function-calling fields are refused, not dropped.
        (dict(extra_body={"functions": [WEATHER]}), "functions"),
        (dict(extra_body={"function_call": {"name": "get_weather"}}, tools=TOOLS), "function_call"),
    ):
        with pytest.raises(openai.BadRequestError) as error:
            ask(client, **fields)
        assert error.value.body["param"] == param


def test_server_forced_tool_calls(client):
    """tool_choice required and named always give well-formed calls of declared tools with
    schema-valid arguments; parallel_tool_calls false gives exactly one."""
    for choice, parallel, names in (
        ("required", None, {"get_weather", "add"}),
        ("required", False, {"get_weather", "add"}),
        ({"type": "function", "function": {"name": "get_weather"}}, False, {"get_weather"}),
    ):
        extra = {} if parallel is None else {"parallel_tool_calls": parallel}
        response = ask(client, tools=TOOLS, tool_choice=choice, temperature=1.0, seed=2, **extra)
        message = response.choices[0].message
        assert response.choices[0].finish_reason == "tool_calls" and message.tool_calls, message
        if parallel is False:
            assert len(message.tool_calls) == 1
        for call in message.tool_calls:
            assert call.function.name in names
            jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    # auto with parallel_tool_calls false: text and at most one call.
    for seed in range(3):
        response = ask(
            client, tools=TOOLS, parallel_tool_calls=False, temperature=1.0, seed=seed, max_tokens=60
        )
        assert len(response.choices[0].message.tool_calls or ()) <= 1
    streamed = [
        chunk.choices[0].delta
        for chunk in client.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "Weather?"}],
            tools=TOOLS,
            tool_choice="required",
            parallel_tool_calls=False,
            temperature=0,
            max_tokens=120,
            stream=True,
        )
        if chunk.choices
    ]
    calls = [call for delta in streamed for call in delta.tool_calls or ()]
    assert len(calls) == 1 and calls[0].function.name in SCHEMAS


# ── the real 262K vocabulary ─────────────────────────────────────────────────────────────────


def test_real_270m_writes_schema_valid_json(real_270m):
    """The real Gemma 3 270M and its 262,144-token vocabulary (llguidance reading the GGUF's
    tokenizer): greedy, every row of a batch writes a document that validates; the same prompts
    unconstrained write no JSON at first."""
    model, tokenizer = real_270m
    schema = {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 20},
            "country": {"type": "string", "maxLength": 20},
            "population": {"type": "integer", "minimum": 0, "maximum": 100000000},
        },
        "required": ["city", "country", "population"],
        "additionalProperties": False,
    }
    grammar = Grammar.json_schema(tokenizer, schema)
    prompts = [tokenizer.encode(text) for text in ("The capital of France is", "Tokyo is a city in")]
    free = torchgemma.generate(model, prompts, max_new_tokens=1, sampling=GREEDY, stop_token_ids=[])
    assert all(not tokenizer.decode(row[len(p) :]).lstrip().startswith("{") for p, row in zip(prompts, free))
    stop = tokenizer.named_id("eos_token")
    rows = torchgemma.generate(
        model, prompts, max_new_tokens=80, sampling=GREEDY, stop_token_ids=[stop], constraint=grammar
    )
    for prompt, row in zip(prompts, rows):
        reply = row[len(prompt) :]
        assert reply[-1] == stop, tokenizer.decode(reply)
        jsonschema.validate(json.loads(tokenizer.decode(reply[:-1])), schema)
