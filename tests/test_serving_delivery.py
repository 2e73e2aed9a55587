"""How the engine thread's tokens reach the handlers: one event-loop wakeup per engine step whatever
the batch (the loop's Python holds the GIL the engine needs between torch's operations), and tokens
that arrived together handled in one pass, their text sent as one chunk, the same text."""

from __future__ import annotations

import asyncio
import json
import time

import pytest

from serving_fixtures import ScriptedEngine
from torchgemma.llm import LLM
from torchgemma.serving.completions import create_completion
from torchgemma.serving.protocol import CompletionRequest
from torchgemma.serving.state import ServerState

pytestmark = pytest.mark.usefixtures("one_thread")

REPLIES = ["one two three four five six", "seven eight nine ten", "eleven twelve thirteen fourteen fifteen"]


@pytest.fixture(scope="module")
def llm(llm_checkpoint) -> LLM:  # noqa: F811
    return LLM(llm_checkpoint, prefix_cache_gb=0)


def scripted(llm, replies) -> tuple[ServerState, ScriptedEngine]:
    engine = ScriptedEngine(llm.tokenizer, list(replies), stop_id=llm.tokenizer.eos_id, max_batch_size=4)
    return ServerState.build(llm, model_name="m", engine=engine), engine


def test_one_wakeup_per_step_for_the_whole_batch(llm):
    state, engine = scripted(llm, REPLIES)
    engine.step_delay = 0.002
    loop = asyncio.new_event_loop()
    calls = 0
    threadsafe = loop.call_soon_threadsafe

    def counted(*args, **kwargs):
        nonlocal calls
        calls += 1
        return threadsafe(*args, **kwargs)

    loop.call_soon_threadsafe = counted
    try:

        async def all_three():
            # Submitted together, so that they join the same step (the engine takes them in one drain).
            queues = [state.runner.submit([2, 5, 6])[1] for _ in REPLIES]
            received = []
            for tokens in queues:
                ids = []
                while (token := await tokens.get()) is not None:
                    ids.append(token.token_id)
                received.append(ids)
            return received

        received = loop.run_until_complete(asyncio.wait_for(all_three(), 60))
    finally:
        state.close()
        loop.close()
    expected = [llm.tokenizer.encode(r, add_special_tokens=False) + [llm.tokenizer.eos_id] for r in REPLIES]
    assert received == expected
    # One call per step (the steps of the longest reply), not one per token of every reply.
    tokens = sum(len(ids) for ids in expected)
    assert calls <= engine._steps + 1 < tokens, (calls, engine._steps, tokens)


def test_tokens_that_arrived_together_leave_as_one_chunk_with_the_same_text(llm):
    """The loop is kept busy while the engine produces the rest of the reply: the stream then sends
    that rest in one content chunk instead of one per token, and the text is the reply. (The first
    token's text is taken before the response begins, so that a refusal is a plain error.)"""
    reply = "alpha beta gamma delta epsilon zeta eta theta"
    state, engine = scripted(llm, [reply, reply])
    engine.step_delay = 0.01  # slower than the loop, so that a loop that keeps up gets a token at a time
    loop = asyncio.new_event_loop()
    try:

        async def stream(stall: bool) -> list[str]:
            body = CompletionRequest(prompt=[2, 5, 6], stream=True, max_tokens=64)
            response = await create_completion(state, body)
            chunks = response.body_iterator
            texts = []
            first = await anext(chunks)  # the opening chunk: the first token has come
            if stall:
                while engine.requests:  # the event loop holds still until the reply is all generated
                    time.sleep(0.01)
            for data in [first] + [c async for c in chunks]:
                if data.startswith("data: {"):
                    choices = json.loads(data[len("data: ") :])["choices"]
                    if choices and choices[0]["text"]:
                        texts.append(choices[0]["text"])
            return texts

        apart = loop.run_until_complete(asyncio.wait_for(stream(stall=False), 60))
        together = loop.run_until_complete(asyncio.wait_for(stream(stall=True), 60))
    finally:
        state.close()
        loop.close()
    assert "".join(apart) == "".join(together) == reply
    assert len(together) == 2 and len(apart) > 4, (apart, together)
