"""`torchgemma generate` and `torchgemma chat` on a tiny checkpoint with tokenizer files."""

from __future__ import annotations

import io
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from llm_fixtures import config_variant
from torchgemma.cli import main
from torchgemma.generation import GenerationConfig
from torchgemma.llm import LLM, ChatChunk

# Step-by-step decoding of tiny models: one thread (see conftest.one_thread).
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def llm(llm_checkpoint) -> LLM:  # noqa: F811
    return LLM(llm_checkpoint)


PROMPT = "The quick brown fox"


def run(argv: list[str], capsys, stdin: str | None = None, monkeypatch=None) -> tuple[int, str, str]:
    if stdin is not None:
        monkeypatch.setattr(sys, "stdin", io.StringIO(stdin))
    code = main(argv)
    out, err = capsys.readouterr()
    return code, out, err


def test_generate_streams_text_and_reports_speed(llm, llm_checkpoint, capsys):  # noqa: F811
    argv = ["generate", "--model", str(llm_checkpoint), "--temperature", "0", "--max-new-tokens", "12"]
    code, out, err = run([*argv, PROMPT], capsys)
    assert code == 0
    assert out == llm.generate(PROMPT, temperature=0, max_new_tokens=12) + "\n"
    assert f"prompt: {len(llm.encode(PROMPT))} tokens" in err and "decode:" in err and err.count("tok/s") == 2


def test_generate_sampling_flags_and_stdin(llm, llm_checkpoint, capsys, monkeypatch):  # noqa: F811
    flags = ["--seed", "4", "--temperature", "0.7", "--top-k", "20", "--top-p", "0.9", "--min-p", "0.01"]
    flags += ["--repetition-penalty", "1.2", "--max-new-tokens", "10", "--dtype", "fp32", "--device", "cpu"]
    code, out, _ = run(["generate", "--model", str(llm_checkpoint), *flags], capsys, PROMPT, monkeypatch)
    assert code == 0
    expected = llm.generate(
        PROMPT, seed=4, temperature=0.7, top_k=20, top_p=0.9, min_p=0.01, repetition_penalty=1.2,
        max_new_tokens=10,
    )  # fmt: skip
    assert out == expected + "\n"
    greedy = llm.generate(PROMPT, temperature=0, max_new_tokens=10)
    assert out != greedy + "\n"


def test_generate_attention_and_compile_flags(llm_checkpoint, capsys, monkeypatch):  # noqa: F811
    """--attention eager loads the eager backend; --compile gives the model its compiled decode step
    (here with torch.compile's eager backend, so the test does not wait for inductor)."""
    import torch

    import torchgemma.acceleration as acceleration

    seen = {}
    real_compile = acceleration.compile

    def compile_spy(model, **kwargs):
        seen["attention"] = model.attention
        return real_compile(model, backend="eager")

    monkeypatch.setattr(acceleration, "compile", compile_spy)
    torch._dynamo.reset()
    argv = ["generate", "--model", str(llm_checkpoint), "--temperature", "0", "--max-new-tokens", "6"]
    code, out, _ = run([*argv, "--attention", "eager", "--compile", PROMPT], capsys)
    torch._dynamo.reset()
    assert code == 0 and seen == {"attention": "eager"}
    expected = LLM(llm_checkpoint, attention="eager").generate(PROMPT, temperature=0, max_new_tokens=6)
    assert out == expected + "\n"


def test_chat_keeps_history(llm, llm_checkpoint, capsys, monkeypatch):  # noqa: F811
    argv = ["chat", "--model", str(llm_checkpoint), "--system", "Be brief.", "--temperature", "0"]
    argv += ["--max-new-tokens", "8"]
    stdin = "Hello there\n\nHow are you?\n/exit\nnever read\n"
    code, out, _ = run(argv, capsys, stdin, monkeypatch)
    assert code == 0
    history = [{"role": "system", "content": "Be brief."}]
    expected = ""
    for line in ("Hello there", "How are you?"):
        history.append({"role": "user", "content": line})
        reply = llm.chat(history, temperature=0, max_new_tokens=8)
        history.append(reply.message)
        expected += reply.text + "\n"
    assert out == expected


def test_chat_think_flag_and_eof(llm, llm_checkpoint, capsys, monkeypatch):  # noqa: F811
    argv = ["chat", "--model", str(llm_checkpoint), "--think", "--seed", "1", "--max-new-tokens", "8"]
    code, out, _ = run(argv, capsys, "Hi\n", monkeypatch)  # EOF after one message
    assert code == 0
    reply = llm.chat([{"role": "user", "content": "Hi"}], enable_thinking=True, seed=1, max_new_tokens=8)
    assert out == reply.text + "\n"


class ThinkingLLM:
    """Stands in for LLM: replies with a thought, then an answer, and records what it was asked."""

    generation_config = GenerationConfig(do_sample=True)
    context_length = 4096

    class tokenizer:  # noqa: N801
        chat_template = "{{ messages }}"

    def __init__(self):
        self.calls = []

    def chat_ids(self, messages, enable_thinking=False, sanitize_control_tokens=True):
        return [0] * 8

    def chat_inputs(self, messages, enable_thinking=False, sanitize_control_tokens=True):
        return {"input_ids": torch.zeros(1, 8, dtype=torch.long)}

    def stream_chat(
        self,
        messages,
        enable_thinking=False,
        sanitize_control_tokens=True,
        max_new_tokens=None,
        stats=None,
        **sampling,
    ):
        self.calls.append(([dict(m) for m in messages], enable_thinking, sampling))
        yield from (ChatChunk("Let me ", True), ChatChunk("think.", True), ChatChunk("Answer ", False))
        yield ChatChunk(f"{len(self.calls)}.", False)


def test_chat_routes_thinking_to_stderr(capsys, monkeypatch):
    stub = ThinkingLLM()
    monkeypatch.setattr("torchgemma.cli.chat.load_llm", lambda args: stub)
    monkeypatch.setattr("torchgemma.cli.chat.check_chat_template", lambda args: None)  # no files for "m"
    code, out, err = run(
        ["chat", "--model", "m", "--think", "--top-k", "5"], capsys, "one\ntwo\n", monkeypatch
    )
    assert code == 0
    assert out == "Answer 1.\nAnswer 2.\n"  # answers only
    assert err.count("[thinking] Let me think.\n") == 2
    history, thinking, sampling = stub.calls[1]
    # --top-k alone: one SamplingParams, the checkpoint's defaults for the rest
    assert thinking and sampling == {"sampling": ThinkingLLM.generation_config.sampling(top_k=5)}
    assert history == [
        {"role": "user", "content": "one"},
        {"role": "assistant", "content": "Answer 1."},  # the answer without its thinking
        {"role": "user", "content": "two"},
    ]


def test_chat_through_a_pipe(llm, llm_checkpoint):  # noqa: F811
    """The real thing: a subprocess reading a piped stdin."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).parents[1] / "src")}
    argv = [sys.executable, "-m", "torchgemma.cli", "chat", "--model", str(llm_checkpoint)]
    argv += ["--temperature", "0", "--max-new-tokens", "6"]
    done = subprocess.run(argv, input="Hi\n", capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    reply = llm.chat([{"role": "user", "content": "Hi"}], temperature=0, max_new_tokens=6)
    assert done.stdout == reply.text + "\n"


def test_missing_model(tmp_path, capsys):
    code, out, err = run(["generate", "--model", str(tmp_path / "nope"), PROMPT], capsys)
    assert code == 2 and out == ""
    assert "torchgemma generate: error:" in err and "nope" in err


def test_model_without_tokenizer(text_checkpoints, capsys):
    code, _, err = run(["chat", "--model", str(text_checkpoints["31b"])], capsys)
    assert code == 2 and "tokenizer" in err


def test_prompt_longer_than_context(llm_checkpoint, tmp_path, capsys):  # noqa: F811
    short = config_variant(llm_checkpoint, tmp_path / "short", max_position_embeddings=8)
    code, _, err = run(["generate", "--model", str(short), PROMPT * 3], capsys)
    assert code == 2 and "does not fit the model's context of 8 tokens" in err


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--top-p", "1.5"], "--top-p: must be in (0, 1]"),
        (["--temperature", "-1"], "--temperature: must be >= 0"),
        (["--dtype", "fp8"], "unknown dtype"),
    ],
)
def test_bad_values(llm_checkpoint, capsys, flags, message):  # noqa: F811
    with pytest.raises(SystemExit) as exit_info:
        main(["generate", "--model", str(llm_checkpoint), *flags, PROMPT])
    assert exit_info.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv",
    [
        ["generate", PROMPT],  # --model is required
        ["generate", "--model", "m", "--top-k", "many", PROMPT],
        ["chat", "--model", "m", "--no-such-flag"],
    ],
)
def test_bad_flags(argv, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    assert "error" in capsys.readouterr().err


def test_info_still_works(llm_checkpoint, capsys):  # noqa: F811
    assert main(["info", str(llm_checkpoint)]) == 0
    assert "parameters" in capsys.readouterr().out.lower()
