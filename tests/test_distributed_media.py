"""Tensor parallelism with images, audio and constraints (gloo on the CPU): an E2B-like checkpoint
with both towers, split over 2 (and, slow, 4) ranks, against one process. tests/tp_media_worker.py
says what runs: ``LLM`` calls made alike on every rank, and an ``Engine`` batch led by rank 0 (the
server's way) with an image, a clip and a video, a JSON schema, a regex, seeded sampling,
log-probabilities and a constraint that allows nothing.

fp32: the row-parallel sums run in another order than one device's, so logits and
log-probabilities are equal to one process within float32 rounding (measured 6e-6 and 7e-6 on
logits of magnitude ~1), not to the bit; every token and finish reason must be the same.
"""

import base64
import contextlib
import io
import json
import re
import signal
import subprocess
import sys

import httpx
import numpy as np
import pytest
import torch

from distributed_fixtures import Ranks, free_port, kill, rank_env, wait_healthy
from tp_media_worker import SCHEMA, run

REASONS = ["stop", "length", "error"]


def compare(tmp_path, folder, size: int) -> dict[str, torch.Tensor]:
    with Ranks(tmp_path, size, [str(folder)], timeout=300, worker="tp_media_worker.py") as ranks:
        ref = run(folder)  # one process, while the ranks run
        got = ranks.results()
    assert sorted(got) == sorted(ref)
    for key, value in ref.items():
        if key.endswith(("logits", "logprobs")):
            assert got[key].shape == value.shape, key
            assert torch.allclose(got[key], value, rtol=0, atol=5e-5), key
        else:
            assert torch.equal(got[key], value), (key, got[key].tolist(), value.tolist())
    return got


def test_media_and_constraints_on_two_ranks_match_one_process(media_llm_checkpoints, tmp_path, one_thread):
    from torchgemma.tokenizer import load_tokenizer

    got = compare(tmp_path, media_llm_checkpoints["e2b"], 2)
    # What the comparison alone would not show: the constraints held over the whole vocabulary
    # (rank 0 masks the gathered logits), and the refused request failed without stalling the
    # ranks' batch.
    tokenizer = load_tokenizer(media_llm_checkpoints["e2b"])
    regex = got["engine.regex.tokens"].tolist()
    assert REASONS[int(got["engine.regex.reason"])] == "stop"
    assert re.fullmatch(r"[a-z]{2,5} [0-9]{1,3}!", tokenizer.decode(regex[:-1])), tokenizer.decode(regex)
    assert REASONS[int(got["engine.refused.reason"])] == "error"
    assert got["engine.refused.tokens"].numel() == 0
    assert got["engine.json.tokens"].numel() > 0 and got["engine.media.tokens"].numel() == 10


@pytest.mark.slow
def test_media_and_constraints_on_four_ranks_match_one_process(media_llm_checkpoints, tmp_path, one_thread):
    compare(tmp_path, media_llm_checkpoints["e2b"], 4)


# ── the server under torchrun ───────────────────────────────────────────────────────────────


@contextlib.contextmanager
def torchrun_server(folder, tmp_path, size: int, *flags: str):
    """``torchgemma serve`` on ``size`` ranks under torchrun (and ``flags``); yields its base URL."""
    port = free_port()
    argv = ["serve", "--model", str(folder), "--port", str(port), "--max-len", "512", *flags]
    argv += ["--served-model-name", "m", "--tensor-parallel-size", str(size)]
    launcher = [
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        str(size),
        "--master-port",
        str(free_port()),
    ]
    log = tmp_path / "serve.log"
    with open(log, "w") as handle:
        process = subprocess.Popen(
            [sys.executable, *launcher, "-m", "torchgemma.cli", *argv],
            env=rank_env(0, 1, 0),
            stdout=handle,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        wait_healthy(port, process, log)
        yield f"http://127.0.0.1:{port}"
    finally:
        process.send_signal(signal.SIGTERM)  # torchrun passes it to the ranks
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(timeout=60)
        kill([process])


def _requests(png: bytes, wav: bytes) -> list[tuple[str, dict]]:
    image = {
        "type": "image_url",
        "image_url": {"url": "data:image/png;base64," + base64.b64encode(png).decode()},
    }
    audio = {"type": "input_audio", "input_audio": {"data": base64.b64encode(wav).decode(), "format": "wav"}}
    media = [{"role": "user", "content": [image, audio, {"type": "text", "text": "Describe both."}]}]
    text = [{"role": "user", "content": "Give me a thing."}]
    json_format = {"type": "json_schema", "json_schema": {"name": "thing", "schema": SCHEMA}}
    return [
        (
            "chat/completions",
            dict(messages=media, temperature=0, max_tokens=8, logprobs=True, top_logprobs=2),
        ),
        (
            "chat/completions",
            dict(messages=text, temperature=0.9, seed=4, max_tokens=40, response_format=json_format),
        ),
        ("chat/completions", dict(messages=media, temperature=0.8, seed=7, max_tokens=8)),
        ("completions", dict(prompt="The cat sat on", temperature=0, max_tokens=12, logprobs=2)),
    ]


def _ask(url: str, path: str, body: dict) -> dict:
    reply = httpx.post(f"{url}/v1/{path}", json={"model": "m", **body}, timeout=120)
    assert reply.status_code == 200, reply.text
    reply = reply.json()
    reply.pop("id"), reply.pop("created")
    return reply


def _same(got: dict, want: dict, where: str) -> None:
    """Equal replies, log-probabilities within float32 rounding."""
    if isinstance(want, dict):
        assert isinstance(got, dict) and sorted(got) == sorted(want), where
        for key in want:
            _same(got[key], want[key], f"{where}.{key}")
    elif isinstance(want, list):
        assert isinstance(got, list) and len(got) == len(want), where
        for i, (a, b) in enumerate(zip(got, want)):
            _same(a, b, f"{where}[{i}]")
    elif isinstance(want, float):
        assert abs(got - want) <= 5e-5, (where, got, want)
    else:
        assert got == want, (where, got, want)


@pytest.mark.slow
def test_server_under_torchrun_answers_media_and_formats_as_one_process(media_llm_checkpoints, tmp_path):
    """An image and a clip (greedy with log-probabilities, and seeded), a JSON schema, a completion
    with log-probabilities, and one cut by a stop string, from `serve --tensor-parallel-size 2`
    and from one process's server: the same replies."""
    from PIL import Image

    from serving_fixtures import running_server, wav_bytes
    from torchgemma.llm import LLM
    from torchgemma.serving.app import create_app

    folder = media_llm_checkpoints["e2b"]
    rng = np.random.default_rng(3)
    png = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (60, 90, 3), dtype=np.uint8)).save(png, format="PNG")
    wav = wav_bytes(0.1 * np.sin(np.arange(8000) / 10.0))
    requests = _requests(png.getvalue(), wav)
    with running_server(create_app(LLM(folder), model_name="m", max_len=512)) as url:
        want = [_ask(url, path, body) for path, body in requests]
        # A stop string from the middle of the greedy completion: the reply ends before it.
        text = want[-1]["choices"][0]["text"]
        stop = text[len(text) // 2 : len(text) // 2 + 3]
        requests.append(
            ("completions", dict(prompt="The cat sat on", temperature=0, max_tokens=12, stop=[stop]))
        )
        want.append(_ask(url, *requests[-1]))
    assert want[-1]["choices"][0]["finish_reason"] == "stop" and stop not in want[-1]["choices"][0]["text"]
    assert json.loads(want[1]["choices"][0]["message"]["content"]).keys() == {"name", "ok"}
    with torchrun_server(folder, tmp_path, 2) as url:
        got = [_ask(url, path, body) for path, body in requests]
    for i, (a, b) in enumerate(zip(got, want)):
        _same(a, b, f"request {i}")


@pytest.mark.slow
def test_server_under_torchrun_speculates_as_one_process(media_llm_checkpoints, tmp_path):
    """`serve --tensor-parallel-size 2 --speculative ngram` drafts (its /metrics count draft tokens)
    and answers a greedy completion that quotes its prompt as one process without speculation does
    (the server's engine is built in one place, speculation included, on every rank)."""
    from serving_fixtures import running_server
    from torchgemma.llm import LLM
    from torchgemma.serving.app import create_app

    folder = media_llm_checkpoints["e2b"]
    body = dict(prompt="one two three four one two three four one two", temperature=0, max_tokens=24)
    with running_server(create_app(LLM(folder), model_name="m", max_len=512)) as url:
        want = _ask(url, "completions", body)
    with torchrun_server(folder, tmp_path, 2, "--speculative", "ngram") as url:
        got = _ask(url, "completions", body)
        metrics = httpx.get(f"{url}/metrics", timeout=60).text
    assert got["choices"][0]["text"] == want["choices"][0]["text"]
    drafted = [
        line for line in metrics.splitlines() if line.startswith("torchgemma_speculative_draft_tokens")
    ]
    assert drafted and float(drafted[0].split()[-1]) > 0, drafted


def _counter(metrics: str, name: str) -> float:
    lines = [line for line in metrics.splitlines() if line.startswith(name + " ")]
    assert lines, f"{name} not in /metrics"
    return float(lines[0].split()[-1])


@pytest.mark.slow
def test_server_under_torchrun_drafts_with_mtp_as_one_process(tmp_path):
    """`serve --tensor-parallel-size 2 --speculative mtp:DRAFTER`: on an E2B-like pair (a single KV
    head, which every rank holds whole) each rank runs the whole drafter on the same state, so the
    ranks draft alike: drafts are accepted and rejected, and the greedy completion is one process's
    without speculation. On an E4B-like pair (2 KV heads, one per rank) the drafter is refused,
    naming the flags (generation/mtp.py's check_split)."""
    from assistant_checkpoints import build_drafter, make_echo_pair
    from llm_fixtures import build_llm_checkpoint
    from tokenizer_fixtures import VOCAB_SIZE
    from torchgemma.llm import LLM

    def pair(style: str):
        target = build_llm_checkpoint(tmp_path / f"{style}-target", style)
        drafter = build_drafter(
            tmp_path / f"{style}-drafter", style, text_overrides={"vocab_size": VOCAB_SIZE}
        )
        # Drafts accepted now and then, and rejected (11 of 20 accepted in one process).
        make_echo_pair(target, drafter, embed_scale=2.5)
        return target, drafter

    target, drafter = pair("e2b")
    prompt = "Hello there"
    want = LLM(target, prefix_cache_gb=0).generate(prompt, temperature=0, max_new_tokens=24)
    with torchrun_server(target, tmp_path, 2, "--speculative", f"mtp:{drafter}") as url:
        got = _ask(url, "completions", dict(prompt=prompt, temperature=0, max_tokens=24))
        metrics = httpx.get(f"{url}/metrics", timeout=60).text
    assert got["choices"][0]["text"] == want
    accepted = _counter(metrics, "torchgemma_speculative_accepted_tokens_total")
    assert 0 < accepted < _counter(metrics, "torchgemma_speculative_draft_tokens_total")

    target, drafter = pair("e4b")
    argv = ["generate", "--model", str(target), "--max-new-tokens", "4", "-q", prompt]
    argv += ["--speculative", f"mtp:{drafter}", "--tensor-parallel-size", "2"]
    launcher = ["-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port())]
    refused = subprocess.run(
        [sys.executable, *launcher, "-m", "torchgemma.cli", *argv],
        env=rank_env(0, 1, 0),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert refused.returncode != 0
    assert "cannot run on a model split over 2 ranks (--tensor-parallel-size 2)" in refused.stderr, (
        refused.stderr[-3000:]
    )
    assert "Use --speculative ngram" in refused.stderr
