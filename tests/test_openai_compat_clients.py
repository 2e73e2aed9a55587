"""The server driven by two more clients users run against OpenAI-compatible servers, where they add
coverage beyond the official ``openai`` client's tests: litellm (its mapping of a context overflow to
``ContextWindowExceededError``, which reads the error's wording) and langchain-openai
(``with_structured_output``, whose default method sends a strict ``json_schema`` and parses the reply).
"""

from __future__ import annotations

import os
from typing import Literal

# litellm fetches a price table from the network at import unless told to use its own copy.
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")

import litellm  # noqa: E402
import pytest  # noqa: E402
from langchain_openai import ChatOpenAI  # noqa: E402
from pydantic import BaseModel  # noqa: E402

from serving_fixtures import running_server  # noqa: E402
from torchgemma.llm import LLM  # noqa: E402
from torchgemma.serving.app import create_app  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

MODEL = "tiny-gemma"
MAX_LEN = 256


@pytest.fixture(scope="module")
def server(llm_checkpoint):  # noqa: F811
    app = create_app(LLM(llm_checkpoint), model_name=MODEL, max_batch_size=2, max_len=MAX_LEN)
    with running_server(app) as url:
        yield url


def test_litellm_completes_and_maps_a_context_overflow(server):
    """A plain chat completion through litellm's OpenAI-compatible route; a prompt past the context is
    litellm's ContextWindowExceededError (it recognises OpenAI's wording), not a bare BadRequestError."""
    common = dict(model=f"openai/{MODEL}", api_base=f"{server}/v1", api_key="unused", num_retries=0)
    reply = litellm.completion(
        messages=[{"role": "user", "content": "Hi"}], max_tokens=4, temperature=0, **common
    )
    assert reply.choices[0].message.content is not None and reply.usage.completion_tokens >= 1
    long = [{"role": "user", "content": "sea " * 600}]
    with pytest.raises(litellm.ContextWindowExceededError):
        litellm.completion(messages=long, max_tokens=4, **common)


class Verdict(BaseModel):
    ok: bool
    colour: Literal["blue", "green", "grey"]


def test_langchain_structured_output_parses(server):
    """langchain's ``with_structured_output`` (strict json_schema by default) returns the pydantic
    object: the constraint makes even a random model's reply valid against the schema (fields of
    bounded length: a random model may write an integer's digits or blanks up to the token limit)."""
    chat = ChatOpenAI(
        model=MODEL, base_url=f"{server}/v1", api_key="unused", max_retries=0, temperature=0, max_tokens=120
    )
    verdict = chat.with_structured_output(Verdict).invoke("Is the sea blue?")
    assert isinstance(verdict, Verdict)
