"""The server's endpoint handlers called as plain functions, without a socket or an HTTP client.

The same tiny chat checkpoint as test_server.py: its real engine for replies equal to the library's,
an engine double (scripted model outputs) for the streamed chunk sequence and for requests that
must be refused before any work reaches the engine.
"""

from __future__ import annotations

import asyncio
import json

import pytest
from fastapi.responses import StreamingResponse

from serving_fixtures import ScriptedEngine
from torchgemma.llm import LLM
from torchgemma.serving.audio import create_transcription
from torchgemma.serving.chat import create_chat_completion
from torchgemma.serving.completions import create_completion
from torchgemma.serving.embeddings import create_embedding
from torchgemma.serving.errors import APIError
from torchgemma.serving.protocol import ChatCompletionRequest, CompletionRequest, EmbeddingRequest
from torchgemma.serving.state import ServerState

pytestmark = pytest.mark.usefixtures("one_thread")

MODEL = "tiny-gemma"


@pytest.fixture(scope="module")
def llm(llm_checkpoint) -> LLM:
    return LLM(llm_checkpoint)


@pytest.fixture
def run():
    """Runs a handler's coroutine on one event loop that outlives the test's requests (the engine
    thread hands tokens to the loop a request came from, as it does in the server)."""
    loop = asyncio.new_event_loop()
    yield loop.run_until_complete
    loop.close()


@pytest.fixture
def state(llm, run):
    state = ServerState.build(llm, model_name=MODEL, max_batch_size=2, max_len=160)
    yield state
    state.close()


@pytest.fixture
def scripted(llm, run):
    """A state whose model says whatever the test scripts; yields (state, engine)."""
    engine = ScriptedEngine(llm.tokenizer, [], stop_id=llm.tokenizer.turn_end_id, max_len=512)
    state = ServerState.build(llm, model_name=MODEL, engine=engine)
    yield state, engine
    state.close()


def user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def test_invalid_requests_are_refused_before_the_engine(scripted, run):
    state, engine = scripted

    def refusal(coroutine) -> APIError:
        with pytest.raises(APIError) as error:
            run(coroutine)
        return error.value

    chat = lambda **fields: create_chat_completion(state, ChatCompletionRequest(**fields))  # noqa: E731
    hi = user("Hi")

    unknown = refusal(chat(model="gpt-4", messages=hi))
    assert (unknown.status, unknown.code, unknown.param) == (404, "model_not_found", "model")
    for fields, param, needle in (
        (dict(n=100), "n", "run at once"),
        (dict(response_format={"type": "json_schema"}), "response_format", "json_schema"),
        (dict(tool_choice="required"), "tool_choice", "needs tools"),
        (dict(stop=["x"] * 17), "stop", "at most 16"),
        (dict(max_tokens=10_000), "max_tokens", "maximum context length"),
        (dict(grammar='root ::= "yes"'), "grammar", "not supported"),
        (dict(guided_json={"type": "object"}), "guided_json", "json_object"),
    ):
        error = refusal(chat(messages=hi, **fields))
        assert (error.status, error.param) == (400, param) and needle in error.message, fields
    tool = {"type": "function", "function": {"name": "a b"}}
    assert refusal(chat(messages=hi, tools=[tool])).param == "tools"
    part = [{"role": "user", "content": [{"type": "file"}]}]
    assert refusal(chat(messages=part)).param == "messages.0.content.0"
    image = {"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}
    # A text-only model: refused for the tower first (URLs to a vision model: test_serving_limits.py).
    assert "no vision tower" in refusal(chat(messages=[{"role": "user", "content": [image]}])).message
    long = refusal(chat(messages=user("word " * 600)))
    assert long.code == "context_length_exceeded" and long.param == "messages"

    complete = lambda **fields: create_completion(state, CompletionRequest(**fields))  # noqa: E731
    assert refusal(complete(prompt=[])).param == "prompt"
    assert "outside the vocabulary" in refusal(complete(prompt=[1, 10**9])).message
    # Endpoints this checkpoint cannot serve say so.
    assert refusal(create_transcription(state, b"RIFF")).status == 404
    assert refusal(create_embedding(state, EmbeddingRequest(input="hi"))).status == 404

    assert engine.prompts == []
    engine.replies.append("ok")
    assert run(chat(messages=hi))["choices"][0]["message"]["content"] == "ok"
    assert len(engine.prompts) == 1


def test_chat_and_completion_equal_the_library(state, llm, run):
    messages = user("Tell me about the sea.")
    reply = llm.chat(messages, temperature=0, max_new_tokens=10)
    body = ChatCompletionRequest(model=MODEL, messages=messages, temperature=0, max_tokens=10)
    response = run(create_chat_completion(state, body))
    assert response["object"] == "chat.completion" and response["model"] == MODEL
    assert response["id"].startswith("chatcmpl-") and response["system_fingerprint"] == state.fingerprint
    (choice,) = response["choices"]
    assert choice["message"]["role"] == "assistant" and choice["message"]["content"].strip() == reply.text
    assert choice["finish_reason"] == reply.finish_reason == "length" and choice["logprobs"] is None
    prompt = len(llm.chat_ids(messages))
    assert response["usage"] == {
        "prompt_tokens": prompt,
        "completion_tokens": 10,
        "total_tokens": prompt + 10,
        "prompt_tokens_details": {"cached_tokens": 0},  # nothing of this prompt computed before
    }

    text = "The quick brown fox"
    body = CompletionRequest(prompt=text, temperature=0, max_tokens=8, echo=True)
    response = run(create_completion(state, body))
    assert response["object"] == "text_completion"
    assert response["choices"][0]["text"] == text + llm.generate(text, temperature=0, max_new_tokens=8)


def test_a_streamed_chat_is_its_chunk_sequence(scripted, llm, run):
    """Role first, then one chunk per delta (reasoning, content), the finish chunk, the usage
    chunk, [DONE]; every chunk of one response has the same id."""
    state, engine = scripted
    reply = "<|channel>thought\nThe sea is wide.<channel|>It is blue."
    engine.replies.append(reply)
    body = ChatCompletionRequest(
        model=MODEL, messages=user("The sea?"), stream=True, stream_options={"include_usage": True}
    )

    async def lines() -> list[str]:
        response = await create_chat_completion(state, body)
        assert isinstance(response, StreamingResponse) and response.media_type == "text/event-stream"
        return [line async for line in response.body_iterator]

    sent = run(lines())
    assert all(line.startswith("data: ") and line.endswith("\n\n") for line in sent)
    assert sent[-1] == "data: [DONE]\n\n"
    chunks = [json.loads(line[len("data: ") :]) for line in sent[:-1]]
    assert len({chunk["id"] for chunk in chunks}) == 1 and chunks[0]["id"].startswith("chatcmpl-")
    assert {chunk["object"] for chunk in chunks} == {"chat.completion.chunk"}
    first, *deltas, finish, usage = chunks
    assert first["choices"] == [{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                 "finish_reason": None}]  # fmt: skip
    pieces = [chunk["choices"][0]["delta"] for chunk in deltas]
    assert all(len(piece) == 1 and chunk["choices"][0]["finish_reason"] is None
               for piece, chunk in zip(pieces, deltas))  # fmt: skip
    assert "".join(p.get("reasoning_content", "") for p in pieces) == "The sea is wide."
    assert "".join(p.get("content", "") for p in pieces).strip() == "It is blue."
    # Reasoning comes before content, as the model wrote it.
    kinds = [next(iter(piece)) for piece in pieces]
    assert kinds == sorted(kinds, key=["reasoning_content", "content"].index)
    assert finish["choices"] == [{"index": 0, "delta": {}, "logprobs": None, "finish_reason": "stop"}]
    generated = len(llm.tokenizer.encode(reply, add_special_tokens=False)) + 1  # and the stop token
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == generated
    assert usage["usage"]["prompt_tokens"] == len(engine.prompts[-1])
