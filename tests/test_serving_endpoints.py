"""The server's smaller endpoints and headers, driven by the official ``openai`` client where it has a
call for them: GET /v1/models/{id}, x-request-id, CORS (--allowed-origins), transcription formats,
and ``serve --chat-template``. (Token-id input to /v1/embeddings: test_embedding.py, beside the
sentence-transformers reference it is checked against.)
"""

from __future__ import annotations

import logging
import re
import time

import httpx
import numpy as np
import openai
import pytest

from serving_fixtures import ScriptedEngine, running_server, wav_bytes
from torchgemma.llm import LLM
from torchgemma.serving.app import create_app
from torchgemma.serving.audio import TRANSCRIBE_PROMPT, TRANSCRIPTION_MAX_TOKENS
from torchgemma.serving.limits import Limits

pytestmark = pytest.mark.usefixtures("one_thread")

# A served name with a '/', as a checkpoint's folder or a hub id gives one.
MODEL = "org/tiny-gemma"
ORIGIN = "https://app.example"


@pytest.fixture(scope="module")
def llm(llm_checkpoint) -> LLM:  # noqa: F811
    return LLM(llm_checkpoint)


@pytest.fixture(scope="module")
def server(llm):
    limits = Limits(max_request_bytes=4096)
    app = create_app(llm, model_name=MODEL, max_batch_size=2, max_len=96, api_key="secret", limits=limits)
    with running_server(app) as url:
        yield url


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server}/v1", api_key="secret", max_retries=0)


KEY = {"Authorization": "Bearer secret"}


def test_models_retrieve_and_an_unknown_id_is_a_404(client):
    model = client.models.retrieve(MODEL)
    assert (model.id, model.object, model.owned_by) == (MODEL, "model", "torchgemma")
    assert model.created == client.models.list().data[0].created
    with pytest.raises(openai.NotFoundError) as error:
        client.models.retrieve("gpt-4o")
    body = error.value.body
    assert body["code"] == "model_not_found" and body["param"] == "model" and "'gpt-4o'" in body["message"]


class Lines(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def test_x_request_id_is_echoed_or_made_on_every_response(server, client):
    given = {**KEY, "x-request-id": "trace-42/abc"}
    log, lines = logging.getLogger("torchgemma.serving"), Lines()
    level = log.level
    log.setLevel(logging.INFO)
    log.addHandler(lines)
    try:
        assert httpx.get(f"{server}/v1/models", headers=given).headers["x-request-id"] == "trace-42/abc"
        deadline = time.monotonic() + 10  # the line is written once the response has been sent
        while not lines.lines and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        log.removeHandler(lines)
        log.setLevel(level)
    assert lines.lines[0].startswith("GET /v1/models 200 ") and lines.lines[0].endswith(
        " request_id=trace-42/abc"
    )
    made = {httpx.get(f"{server}/health").headers["x-request-id"] for _ in range(2)}
    assert len(made) == 2 and all(re.fullmatch(r"req_[0-9a-f]{32}", value) for value in made)
    # Refusals (401, 404, 413) and streams carry it too.
    assert httpx.get(f"{server}/v1/models", headers={"x-request-id": "r1"}).headers["x-request-id"] == "r1"
    assert httpx.get(f"{server}/v1/nothing", headers=given).headers["x-request-id"] == "trace-42/abc"
    huge = httpx.post(f"{server}/v1/completions", headers=given, content=b" " * 5000)
    assert huge.status_code == 413 and huge.headers["x-request-id"] == "trace-42/abc"
    stream = client.chat.completions.with_raw_response.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=2,
        stream=True,
        extra_headers={"x-request-id": "stream-1"},
    )
    assert stream.headers["x-request-id"] == "stream-1"
    # The SDK reads it into every object it returns.
    reply = client.completions.create(
        model=MODEL, prompt="Hi", max_tokens=1, extra_headers={"x-request-id": "c-7"}
    )
    assert reply._request_id == "c-7"
    bad = httpx.get(f"{server}/v1/models", headers={**KEY, "x-request-id": "has space"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "x-request-id"
    assert re.fullmatch(r"req_[0-9a-f]{32}", bad.headers["x-request-id"])


def test_no_cors_headers_unless_origins_are_allowed(server):
    answer = httpx.get(f"{server}/v1/models", headers={**KEY, "Origin": ORIGIN})
    assert answer.status_code == 200
    assert not any(name.startswith("access-control-") for name in answer.headers)
    preflight = httpx.options(
        f"{server}/v1/chat/completions", headers={"Origin": ORIGIN, "Access-Control-Request-Method": "POST"}
    )
    assert "access-control-allow-origin" not in preflight.headers


def test_cors_preflight_and_answers(llm):
    app = create_app(llm, model_name=MODEL, max_len=64, api_key="secret", allowed_origins=[ORIGIN])
    with running_server(app) as url:
        asked = {
            "Origin": ORIGIN,
            "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization, content-type, x-stainless-os",
        }
        # A browser's preflight carries no API key: answered before the key is checked.
        preflight = httpx.options(f"{url}/v1/chat/completions", headers=asked)
        assert preflight.status_code == 200, preflight.text
        assert preflight.headers["access-control-allow-origin"] == ORIGIN
        assert "POST" in preflight.headers["access-control-allow-methods"]
        assert "x-stainless-os" in preflight.headers["access-control-allow-headers"].lower()
        assert preflight.headers["x-request-id"]
        body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
        reply = httpx.post(f"{url}/v1/chat/completions", json=body, headers={**KEY, "Origin": ORIGIN})
        assert reply.status_code == 200 and reply.headers["access-control-allow-origin"] == ORIGIN
        assert "x-request-id" in reply.headers["access-control-expose-headers"].lower()
        # A refusal is readable by the page too (its message, not an opaque CORS failure).
        refused = httpx.post(f"{url}/v1/chat/completions", json=body, headers={"Origin": ORIGIN})
        assert refused.status_code == 401 and refused.headers["access-control-allow-origin"] == ORIGIN
        other = httpx.options(
            f"{url}/v1/chat/completions", headers={**asked, "Origin": "https://evil.example"}
        )
        assert other.status_code == 400 and "access-control-allow-origin" not in other.headers
        stranger = httpx.post(
            f"{url}/v1/chat/completions", json=body, headers={**KEY, "Origin": "https://evil.example"}
        )
        assert "access-control-allow-origin" not in stranger.headers


# ── transcription formats ───────────────────────────────────────────────────────────────────


@pytest.fixture(scope="module")
def audio_llm(media_llm_checkpoints) -> LLM:
    return LLM(media_llm_checkpoints["e2b"])


def test_verbose_json_is_the_model_s_transcript_with_its_logprobs(audio_llm):
    """verbose_json's text is json's, its avg_logprob the mean of the logprobs the chat endpoint
    gives for the same clip and instruction, its segment the heard part of the clip."""
    clip = wav_bytes(0.1 * np.sin(np.arange(12_000) / 7.0))  # 0.75 s
    # A short context: below TRANSCRIPTION_MAX_TOKENS, the transcript and chat's default reply both
    # run to its end (or to the model's own), so they are the same length.
    context = 112
    assert context < TRANSCRIPTION_MAX_TOKENS
    with running_server(create_app(audio_llm, model_name=MODEL, max_len=context)) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        plain = client.audio.transcriptions.create(model=MODEL, file=("a.wav", clip, "audio/wav"))
        verbose = client.audio.transcriptions.create(
            model=MODEL, file=("a.wav", clip, "audio/wav"), response_format="verbose_json"
        )
        (segment,) = verbose.segments
        assert verbose.text == segment.text == plain.text
        assert verbose.duration == segment.end == 0.75 and segment.start == 0.0 and verbose.language is None
        assert segment.tokens == audio_llm.tokenizer.encode(plain.text, add_special_tokens=False)
        import base64

        content = [
            {
                "type": "input_audio",
                "input_audio": {"data": base64.b64encode(clip).decode(), "format": "wav"},
            },
            {"type": "text", "text": TRANSCRIBE_PROMPT},
        ]
        chat = client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": content}],
            temperature=0,
            logprobs=True,
        )
        logprobs = [entry.logprob for entry in chat.choices[0].logprobs.content]
        assert chat.choices[0].message.content == plain.text and len(logprobs) > 1
        assert segment.avg_logprob == pytest.approx(sum(logprobs) / len(logprobs), abs=1e-6)
        words = httpx.post(
            f"{url}/v1/audio/transcriptions",
            files={"file": ("a.wav", clip)},
            data={"timestamp_granularities[]": "word", "response_format": "verbose_json"},
        )
        assert words.status_code == 400 and "word timestamps" in words.json()["error"]["message"]


def test_text_srt_and_vtt(audio_llm):
    """Formats on a scripted transcript; a 40 s clip: the model hears 30 s, the duration is 40."""
    engine = ScriptedEngine(audio_llm.tokenizer, [], stop_id=audio_llm.tokenizer.turn_end_id, max_len=1024)
    clip = wav_bytes(0.1 * np.sin(np.arange(40 * 16_000) / 7.0))
    with running_server(create_app(audio_llm, model_name=MODEL, engine=engine)) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)

        def transcribe(response_format: str, reply: str = "Hello world."):
            engine.replies.append(reply)
            return client.audio.transcriptions.create(
                model=MODEL, file=("a.wav", clip, "audio/wav"), response_format=response_format
            )

        assert transcribe("text") == "Hello world."
        assert transcribe("srt") == "1\n00:00:00,000 --> 00:00:30,000\nHello world.\n"
        assert transcribe("vtt") == "WEBVTT\n\n00:00:00.000 --> 00:00:30.000\nHello world.\n"
        assert transcribe("vtt", "") == "WEBVTT\n\n"
        engine.replies.append("Hallo.")
        verbose = client.audio.transcriptions.create(
            model=MODEL, file=("a.wav", clip, "audio/wav"), response_format="verbose_json", language="de"
        )
        assert verbose.duration == 40.0 and verbose.segments[0].end == 30.0 and verbose.language == "de"
        assert verbose.text == "Hallo."
        unknown = httpx.post(
            f"{url}/v1/audio/transcriptions", files={"file": ("a.wav", clip)}, data={"response_format": "tsv"}
        )
        assert unknown.status_code == 400 and "verbose_json, srt, vtt" in unknown.json()["error"]["message"]


# ── serve --chat-template ───────────────────────────────────────────────────────────────────


def test_serve_chat_template_lets_a_base_model_chat(llm, llm_checkpoint, tmp_path, monkeypatch):  # noqa: F811
    """`serve --chat-template FILE` on a checkpoint without a template serves chat with that
    template; --allowed-origins and --responses-store reach the app."""
    import uvicorn

    from torchgemma import cli

    base = tmp_path / "base"
    base.mkdir()
    for f in llm_checkpoint.iterdir():
        if f.name != "chat_template.jinja":
            (base / f.name).symlink_to(f)
    served = {}
    monkeypatch.setattr(uvicorn, "run", lambda app, **kwargs: served.setdefault("app", app))
    template = str(llm_checkpoint / "chat_template.jinja")
    argv = [
        "serve",
        "--model",
        str(base),
        "--max-len",
        "64",
        "--allowed-origins",
        ORIGIN,
        "--responses-store",
        "0",
    ]
    assert cli.main([*argv, "--chat-template", template]) == 0
    with running_server(served["app"]) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        messages = [{"role": "user", "content": "Hello there"}]
        reply = client.chat.completions.create(
            model=str(base), messages=messages, temperature=0, max_tokens=4
        )
        # The template rendered the prompt, and the greedy reply is the library's (its tokens: the
        # server leaves special tokens out of the text).
        expected = llm.chat(messages, temperature=0, max_new_tokens=4)
        assert reply.usage.prompt_tokens == len(llm.chat_ids(messages))
        assert reply.usage.completion_tokens == len(expected.token_ids)
        assert reply.choices[0].finish_reason == expected.finish_reason
        preflight = httpx.options(
            f"{url}/v1/chat/completions", headers={"Origin": ORIGIN, "Access-Control-Request-Method": "POST"}
        )
        assert preflight.headers["access-control-allow-origin"] == ORIGIN
        kept = client.responses.create(model=str(base), input="Hi", max_output_tokens=2)
        with pytest.raises(openai.NotFoundError):
            client.responses.retrieve(kept.id)  # --responses-store 0 keeps none
    missing = tmp_path / "missing.jinja"
    assert cli.main([*argv, "--chat-template", str(missing)]) == 2
    assert cli.main(["serve", "--model", str(base), "--allowed-origins", " , "]) == 2


def test_serve_chat_template_that_is_not_utf8(llm_checkpoint, tmp_path, capsys):  # noqa: F811
    from torchgemma import cli

    bad = tmp_path / "bad.jinja"
    bad.write_bytes(b"\xff\xfe{{ x }}")
    assert cli.main(["serve", "--model", str(llm_checkpoint), "--chat-template", str(bad)]) == 2
    assert "is not UTF-8 text" in capsys.readouterr().err


def test_verbose_json_has_the_sdk_s_fields(audio_llm):
    """verbose_json's body has exactly the fields of the SDK's TranscriptionVerbose and segment."""
    engine = ScriptedEngine(
        audio_llm.tokenizer, ["Hi."] * 2, stop_id=audio_llm.tokenizer.turn_end_id, max_len=1024
    )
    clip = wav_bytes(0.1 * np.sin(np.arange(8000) / 7.0))
    with running_server(create_app(audio_llm, model_name=MODEL, engine=engine)) as url:
        body = httpx.post(
            f"{url}/v1/audio/transcriptions",
            files={"file": ("a.wav", clip)},
            data={"response_format": "verbose_json"},
        ).json()
    assert set(body) == {"task", "language", "duration", "text", "segments"}
    assert set(body["segments"][0]) == {
        "id", "seek", "start", "end", "text", "tokens", "temperature", "avg_logprob", "compression_ratio", "no_speech_prob",
    }  # fmt: skip
    assert body["segments"][0]["no_speech_prob"] is None
