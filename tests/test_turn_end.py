"""A chat reply ends at the end-of-turn token in every family: Gemma 4's `<turn|>`, Gemma 1-3n's
`<end_of_turn>`, whatever the checkpoint's eos list says.

The real Gemma 3 270M GGUF states one eos id (`<eos>` = 1) and no generation config, so the chat stop
set must add `<end_of_turn>` (106) itself: `LLM.chat`, `LLM.stream_chat`, `torchgemma chat` and the
server's chat completions all take it from `Tokenizer.turn_end_id`. The file is a base model: it has
no chat template (the tests give it Gemma 3's published one, as `--chat-template` does) and, greedy,
never ends a turn on its own (`<end_of_turn>` ranks in the thousands after a chat prompt). So the
tests load their own copy and make its head pick `<end_of_turn>` at the third step of a reply; the
first two tokens are the model's own greedy ones. Without 106 in the stop set the reply runs on.
"""

from __future__ import annotations

import io
import sys

import pytest
import torch

from published_files import gemma3_template

GEMMA3_CHAT_TEMPLATE = gemma3_template("<start_of_image>")  # Gemma 3's published template
END_OF_TURN = 106  # "<end_of_turn>" in Gemma 3's vocabulary
MESSAGES = [{"role": "user", "content": "Name a colour."}]
NATURAL_STEPS = 2  # tokens the model picks itself before the turn ends
MAX_NEW_TOKENS = 8


class EndTurnAt:
    """Wraps a text model's `logits` (the greedy paths of `generate` and the engine both call it):
    at the `step`-th call after `arm()`, <end_of_turn> gets the highest logit; every other call is
    the model's own."""

    def __init__(self, language_model: torch.nn.Module) -> None:
        self.original = language_model.logits
        self.calls = 0
        self.step: int | None = None
        language_model.logits = self  # an instance attribute: found before the class's method

    def arm(self, step: int | None) -> None:
        self.calls, self.step = 0, step

    def __call__(self, normed: torch.Tensor) -> torch.Tensor:
        logits = self.original(normed)
        self.calls += 1
        if self.calls == self.step:
            logits = logits.clone()
            logits[..., END_OF_TURN] = logits.amax(dim=-1) + 1.0
        return logits


@pytest.fixture(scope="module")
def gemma3_chat(real_270m_file):
    """Our own float32 LLM of the real 270M GGUF (the shared one must not be hooked), with Gemma 3's
    chat template, its head wrapped; and the model's own first greedy tokens of the reply."""
    from torchgemma.llm import LLM

    llm = LLM("gemma3-270m", dtype=torch.float32, attention="eager", quantize=None, progress=False)
    assert llm.generation_config.eos_token_ids == (1,)  # the file names only <eos>
    llm.tokenizer.chat_template = GEMMA3_CHAT_TEMPLATE
    language_model = next(m for m in llm.model.modules() if hasattr(type(m), "greedy"))
    hook = EndTurnAt(language_model)
    hook.arm(None)
    natural = llm.generate_ids([llm.chat_ids(MESSAGES)], max_new_tokens=NATURAL_STEPS + 1, temperature=0)[0]
    assert END_OF_TURN not in natural  # the base model does not end the turn by itself
    return llm, hook, natural[:NATURAL_STEPS]


def test_gemma3_gguf_tokenizer_knows_its_turn_tokens(gemma3_chat) -> None:
    tokenizer = gemma3_chat[0].tokenizer  # the GGUF's own (load_tokenizer of the file)
    assert tokenizer.turn_end_id == tokenizer.token_id("<end_of_turn>") == END_OF_TURN
    assert tokenizer.turn_start_id == tokenizer.token_id("<start_of_turn>") == 105


def test_llm_chat_stops_at_end_of_turn(gemma3_chat) -> None:
    llm, hook, natural = gemma3_chat
    hook.arm(NATURAL_STEPS + 1)
    reply = llm.chat(MESSAGES, temperature=0, max_new_tokens=MAX_NEW_TOKENS)
    assert reply.token_ids == (*natural, END_OF_TURN)
    assert reply.finish_reason == "stop"
    assert reply.text == llm.tokenizer.decode(natural).strip()
    hook.arm(NATURAL_STEPS + 1)
    pieces = [chunk.text for chunk in llm.stream_chat(MESSAGES, temperature=0, max_new_tokens=MAX_NEW_TOKENS)]
    assert hook.calls == NATURAL_STEPS + 1  # no step after <end_of_turn>
    assert "".join(pieces) == reply.text


def test_torchgemma_chat_stops_at_end_of_turn(gemma3_chat, monkeypatch, capsys) -> None:
    from torchgemma.cli import main

    llm, hook, natural = gemma3_chat
    monkeypatch.setattr("torchgemma.cli.chat.load_llm", lambda args: llm)
    # The fixture's chat template is set on its LLM, not in the GGUF file the check before loading reads.
    monkeypatch.setattr("torchgemma.cli.chat.check_chat_template", lambda args: None)
    monkeypatch.setattr(sys, "stdin", io.StringIO("Name a colour.\n"))
    hook.arm(NATURAL_STEPS + 1)
    argv = ["chat", "--model", "gemma3-270m", "--temperature", "0", "--max-new-tokens", str(MAX_NEW_TOKENS)]
    assert main(argv) == 0
    assert hook.calls == NATURAL_STEPS + 1
    assert capsys.readouterr().out == llm.tokenizer.decode(natural).strip() + "\n"


def test_server_chat_stops_at_end_of_turn(gemma3_chat) -> None:
    openai = pytest.importorskip("openai")
    from serving_fixtures import running_server
    from torchgemma.serving.app import create_app

    llm, hook, natural = gemma3_chat
    hook.arm(NATURAL_STEPS + 1)
    with running_server(create_app(llm, model_name="gemma3-270m", max_batch_size=1, max_len=128)) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        reply = client.chat.completions.create(
            model="gemma3-270m", messages=MESSAGES, temperature=0, max_tokens=MAX_NEW_TOKENS
        )
    choice = reply.choices[0]
    assert choice.finish_reason == "stop"
    assert choice.message.content == llm.tokenizer.decode(natural).strip()
    assert reply.usage.completion_tokens == NATURAL_STEPS + 1
