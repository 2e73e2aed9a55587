"""The server's prefix cache (``serve --prefix-cache-gb``), its usage and metrics, and the defaults of
issue 29: text completions' max_tokens, chat's, and the per-request log line.

A request whose prompt begins as an earlier one did reports the prompt tokens it took from the store
in ``usage.prompt_tokens_details.cached_tokens`` (streamed usage too) and answers the same text as
the run that computed them; with the store off (0 GiB) nothing is cached. The tiny E2B-like
checkpoint (sliding and KV-shared layers) serves with a 32-token prefill chunk, so that a prompt of
a hundred tokens spans several chunks (reuse starts at chunk boundaries).
"""

from __future__ import annotations

import asyncio
import inspect
import json
import logging
import re

import httpx
import pytest

from serving_fixtures import ScriptedEngine, running_server
from torchgemma.cli import build_parser
from torchgemma.generation.engine import DEFAULT_PREFILL_CHUNK
from torchgemma.llm import LLM
from torchgemma.serving.app import create_app
from torchgemma.serving.chat import create_chat_completion
from torchgemma.serving.completions import DEFAULT_MAX_TOKENS, create_completion
from torchgemma.serving.protocol import ChatCompletionRequest, CompletionRequest
from torchgemma.serving.state import ServerState

pytestmark = pytest.mark.usefixtures("one_thread")

CHUNK = 32
COMPLETIONS = "/v1/completions"


@pytest.fixture(scope="module")
def llm(llm_checkpoint) -> LLM:  # noqa: F811
    return LLM(llm_checkpoint, prefix_cache_gb=0)


def serve(llm, prefix_cache_gb: float):
    app = create_app(
        llm,
        model_name="m",
        max_batch_size=2,
        max_len=256,
        prefill_chunk=CHUNK,
        prefix_cache_gb=prefix_cache_gb,
    )
    return running_server(app)


def prompt_ids(llm, tail: str) -> list[int]:
    """About a hundred tokens: a long shared beginning (two chunks and more), then ``tail``."""
    shared = "The lighthouse keeper wrote down the weather every morning, the ships every evening. " * 2
    return llm.processor.encode(shared + tail)


def complete(url: str, ids: list[int], *, stream: bool = False) -> tuple[str, dict]:
    body = {"prompt": ids, "max_tokens": 6, "temperature": 0}
    if not stream:
        reply = httpx.post(f"{url}{COMPLETIONS}", json=body, timeout=120).json()
        return reply["choices"][0]["text"], reply["usage"]
    body |= {"stream": True, "stream_options": {"include_usage": True}}
    text, usage = [], None
    with httpx.stream("POST", f"{url}{COMPLETIONS}", json=body, timeout=120) as response:
        for line in response.iter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[len("data: ") :])
                if chunk["choices"]:
                    text.append(chunk["choices"][0]["text"])
                usage = chunk.get("usage") or usage
    return "".join(text), usage


def metric(url: str, name: str) -> float:
    found = re.search(rf"^{name} (\S+)$", httpx.get(f"{url}/metrics").text, re.MULTILINE)
    assert found, name
    return float(found.group(1))


def test_a_shared_beginning_is_taken_from_the_store_with_the_same_text(llm):
    first_ids = prompt_ids(llm, "Today the sea was")
    second_ids = prompt_ids(llm, "Yesterday a storm came and")
    shared = next(i for i, (a, b) in enumerate(zip(first_ids, second_ids)) if a != b)
    assert shared >= 2 * CHUNK
    with serve(llm, prefix_cache_gb=0.01) as url:
        fresh_text, fresh = complete(url, second_ids)  # computes the second prompt's beginning...
        assert fresh["prompt_tokens_details"] == {"cached_tokens": 0}
        _, first = complete(url, first_ids)  # (its beginning from the second's chunks)
        again_text, again = complete(url, second_ids)  # ... which is then in the store
        streamed_text, streamed = complete(url, second_ids, stream=True)
        assert metric(url, "torchgemma_prefix_cache_hits_total") >= 2
        assert metric(url, "torchgemma_prefix_cache_queries_total") == 4
        assert metric(url, "torchgemma_prefix_cache_bytes") > 0
        held = metric(url, "torchgemma_prefix_cache_cached_tokens_total")
    cached = again["prompt_tokens_details"]["cached_tokens"]
    # The same prompt again: all of it, from its end stored by the first request (its last chunk
    # and the state that chose its first token: no prefill at all).
    assert cached == len(second_ids), cached
    assert again["prompt_tokens"] == len(second_ids)  # cached tokens count as prompt tokens (OpenAI)
    # The other prompt: whole chunks of the beginning they share.
    shared_cached = first["prompt_tokens_details"]["cached_tokens"]
    assert 0 < shared_cached <= shared and shared_cached % CHUNK == 0, shared_cached
    assert again_text == fresh_text
    assert streamed_text == fresh_text and streamed["prompt_tokens_details"]["cached_tokens"] == cached
    assert held >= 2 * cached


def test_with_the_store_off_nothing_is_cached(llm):
    ids = prompt_ids(llm, "Today the sea was")
    with serve(llm, prefix_cache_gb=0) as url:
        first_text, first = complete(url, ids)
        second_text, second = complete(url, ids, stream=True)
        assert "torchgemma_prefix_cache" not in httpx.get(f"{url}/metrics").text
    assert first["prompt_tokens_details"] == second["prompt_tokens_details"] == {"cached_tokens": 0}
    assert first_text == second_text


def test_chat_reports_cached_tokens_for_a_repeated_system_prompt(llm):
    system = {"role": "system", "content": "You answer in one short sentence about the sea. " * 8}
    with serve(llm, prefix_cache_gb=0.01) as url:
        usages = []
        for question in ("Why is it blue?", "Why is it salty?"):
            body = {
                "messages": [system, {"role": "user", "content": question}],
                "max_tokens": 4,
                "temperature": 0,
            }
            usages.append(httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120).json()["usage"])
    assert usages[0]["prompt_tokens_details"]["cached_tokens"] == 0
    assert usages[1]["prompt_tokens_details"]["cached_tokens"] >= CHUNK


def test_the_serve_flag(llm):
    parser = build_parser()
    assert parser.parse_args(["serve", "--model", "m"]).prefix_cache_gb == 1.0
    # Reuse comes at multiples of the prefill chunk: unless told, the engine picks it for the model.
    assert parser.parse_args(["serve", "--model", "m"]).prefill_chunk is None
    for build in (ServerState.build, create_app):
        assert inspect.signature(build).parameters["prefill_chunk"].default is None
    state = ServerState.build(llm, model_name="m")
    try:
        assert state.runner.engine.prefill_chunk == DEFAULT_PREFILL_CHUNK == 256  # a float model
    finally:
        state.close()
    assert parser.parse_args(["serve", "--model", "m", "--prefix-cache-gb", "0"]).prefix_cache_gb == 0
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--model", "m", "--prefix-cache-gb", "-1"])
    with pytest.raises(ValueError, match="prefix_cache_gb must be >= 0"):
        ServerState.build(llm, model_name="m", prefix_cache_gb=-1)


# ── defaults ─────────────────────────────────────────────────────────────────────────────────


def scripted_state(llm) -> tuple[ServerState, ScriptedEngine]:
    engine = ScriptedEngine(
        llm.tokenizer, ["Hello there."] * 4, stop_id=llm.tokenizer.turn_end_id, max_len=200
    )
    return ServerState.build(llm, model_name="m", engine=engine), engine


def test_max_tokens_defaults(llm):
    """Text completions without max_tokens generate at most 16 tokens (OpenAI's default; a raw prompt
    has no end of turn, and ran to the context's end); chat runs to the context left, as OpenAI's."""
    state, engine = scripted_state(llm)
    loop = asyncio.new_event_loop()
    try:
        ids = llm.processor.encode("Once upon a time")
        loop.run_until_complete(create_completion(state, CompletionRequest(prompt=ids)))
        loop.run_until_complete(create_completion(state, CompletionRequest(prompt=ids, max_tokens=40)))
        # A prompt that leaves fewer than 16 tokens of room gets what is left, not a refusal.
        long = ids * (190 // len(ids)) + ids[: 190 % len(ids)] + [ids[-1]] * 5
        loop.run_until_complete(create_completion(state, CompletionRequest(prompt=long)))
        chat = ChatCompletionRequest(messages=[{"role": "user", "content": "Hi"}])
        loop.run_until_complete(create_chat_completion(state, chat))
    finally:
        state.close()
        loop.close()
    limits = [arguments["max_new_tokens"] for arguments in engine.arguments]
    assert DEFAULT_MAX_TOKENS == 16
    assert limits[:3] == [16, 40, 200 - len(long)]
    assert limits[3] == 200 - len(engine.prompts[3])


def test_the_request_log_line(llm, caplog):
    ids = prompt_ids(llm, "Today the sea was")
    with caplog.at_level(logging.INFO, logger="torchgemma.serving"), serve(llm, prefix_cache_gb=0.01) as url:
        complete(url, ids)
        _, usage = complete(url, ids, stream=True)
    lines = [r.getMessage() for r in caplog.records if r.name == "torchgemma.serving"]
    posts = [line for line in lines if line.startswith(f"POST {COMPLETIONS} 200 ")]
    assert len(posts) == 2, lines
    pattern = (
        r" id=cmpl-[0-9a-f]{32} prompt_tokens=(\d+) cached_tokens=(\d+) completion_tokens=(\d+) "
        r"ttft=(\d+\.\d+)s tok/s=(\d+\.\d) finish=(\w+) client=127\.0\.0\.1:"
    )
    fields = [re.search(pattern, line) for line in posts]
    assert all(fields), posts
    assert [int(f.group(1)) for f in fields] == [len(ids)] * 2
    assert [int(f.group(2)) for f in fields] == [0, usage["prompt_tokens_details"]["cached_tokens"]]
    assert all(int(f.group(3)) == 6 and f.group(6) == "length" for f in fields)
    total = [float(re.match(r"POST \S+ 200 (\d+\.\d+)s", line).group(1)) for line in posts]
    assert all(0 < float(f.group(4)) <= t for f, t in zip(fields, total))
