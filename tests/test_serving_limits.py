"""Hostile requests are refused before the work they would cost, and the requests around them go on.

Each case asserts the status and the error, that the costly step never ran (the body was never
sent, the tokenizer or the image decoder was never called), and, where it matters, that a stream
in flight at the same time finished with its whole reply. Engine doubles (serving_fixtures) stand
in for the model: no case here needs a forward pass.
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import logging
import socket
import struct
import threading
import time
from contextlib import contextmanager
from urllib.parse import urlparse

import httpx
import numpy as np
import pytest
from PIL import Image, ImageFile

from serving_fixtures import ScriptedEngine, running_server
from torchgemma.cli.common import CLIError
from torchgemma.cli.serve import allowed_host_names, read_api_key
from torchgemma.llm import LLM
from torchgemma.serving import media
from torchgemma.serving.app import LOOPBACK_HOSTS, _host_allowed, create_app
from torchgemma.serving.connections import header_timeout_protocol
from torchgemma.serving.limits import Limits

pytestmark = pytest.mark.usefixtures("one_thread")

MODEL = "tiny-gemma"
CHAT = "/v1/chat/completions"
NEIGHBOUR_REPLY = "The sea is calm today and the sky is a clear blue over the bay."


@pytest.fixture(scope="module")
def llm(llm_checkpoint) -> LLM:  # a text-only checkpoint: no vision or audio tower
    return LLM(llm_checkpoint)


@pytest.fixture(scope="module")
def media_llm(media_llm_checkpoints) -> LLM:  # image and audio towers
    return LLM(media_llm_checkpoints["e2b"])


@contextmanager
def scripted_server(llm, **app_args):
    """A server over an engine double whose first reply is NEIGHBOUR_REPLY, a token per 20 ms;
    yields (base URL, engine)."""
    engine = ScriptedEngine(llm.tokenizer, [NEIGHBOUR_REPLY], stop_id=llm.tokenizer.turn_end_id, max_len=512)
    engine.step_delay = 0.02
    with running_server(create_app(llm, model_name=MODEL, engine=engine, **app_args)) as url:
        yield url, engine


@contextmanager
def neighbour(url: str):
    """A streamed chat in flight while the block runs; afterwards, checks it got its whole reply."""
    result: dict = {}

    def run():
        body = {"messages": [{"role": "user", "content": "Hi"}], "stream": True}
        with httpx.stream("POST", f"{url}{CHAT}", json=body, timeout=60) as response:
            result["status"] = response.status_code
            text = []
            for line in response.iter_lines():
                if line.startswith("data: {"):
                    chunk = json.loads(line[6:])
                    text.append(chunk["choices"][0]["delta"].get("content") or "")
            result["text"] = "".join(text)

    thread = threading.Thread(target=run)
    thread.start()
    deadline = time.monotonic() + 30
    while "status" not in result and thread.is_alive() and time.monotonic() < deadline:
        time.sleep(0.01)  # the stream has begun: its first chunk came back
    yield
    thread.join(timeout=60)
    assert result.get("status") == 200 and result["text"].strip() == NEIGHBOUR_REPLY, result


def error_of(response) -> dict:
    body = response.json() if hasattr(response, "json") else json.loads(response[2])
    assert set(body) == {"error"} and {"message", "type", "param", "code"} <= set(body["error"])
    return body["error"]


def raw_request(url: str, head: str, body: bytes = b"") -> tuple[int, dict[str, str], bytes]:
    """Send ``head`` (request line and headers, no blank line) and ``body`` on a socket; the
    response's status, headers and body. Lets a test send a Content-Length and not the body."""
    address = urlparse(url)
    with socket.create_connection((address.hostname, address.port), timeout=30) as sock:
        sock.sendall(head.encode() + b"\r\n\r\n" + body)
        data = b""
        while b"\r\n\r\n" not in data:
            chunk = sock.recv(65536)
            assert chunk, f"the connection closed before a response: {data!r}"
            data += chunk
        top, rest = data.split(b"\r\n\r\n", 1)
        lines = top.decode("latin-1").split("\r\n")
        headers = {k.lower(): v.strip() for k, v in (line.split(":", 1) for line in lines[1:])}
        while len(rest) < int(headers.get("content-length", 0)):
            chunk = sock.recv(65536)
            if not chunk:
                break
            rest += chunk
        return int(lines[0].split()[1]), headers, rest


def png_url(width: int, height: int) -> str:
    buffer = io.BytesIO()
    Image.new("RGB", (width, height), (200, 30, 30)).save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def image_part(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


def wav_part(seconds: float, rate: int = 16_000) -> dict:
    samples = (0.1 * np.sin(np.arange(int(seconds * rate)) / 10.0) * 32767).astype("<i2").tobytes()
    fmt = struct.pack("<HHIIHH", 1, 1, rate, rate * 2, 2, 16)
    wav = b"RIFF" + struct.pack("<I", 36 + len(samples)) + b"WAVEfmt " + struct.pack("<I", 16) + fmt
    wav += b"data" + struct.pack("<I", len(samples)) + samples
    return {"type": "input_audio", "input_audio": {"data": base64.b64encode(wav).decode(), "format": "wav"}}


def chat_with(*parts) -> dict:
    return {"messages": [{"role": "user", "content": [*parts, {"type": "text", "text": "What is it?"}]}]}


@pytest.fixture
def decoded_images(monkeypatch) -> list:
    """Every image PIL decodes (``ImageFile.load``), and every one it opens (reads a header of)."""
    calls: dict[str, list] = {"load": [], "open": []}
    load, open_ = ImageFile.ImageFile.load, Image.open

    def counted_load(self):
        calls["load"].append(self.size)
        return load(self)

    def counted_open(*args, **kwargs):
        calls["open"].append(args)
        return open_(*args, **kwargs)

    monkeypatch.setattr(ImageFile.ImageFile, "load", counted_load)
    monkeypatch.setattr(Image, "open", counted_open)
    return calls


@pytest.fixture
def decoded_audio(monkeypatch) -> list:
    """Every WAV file the server decodes."""
    calls = []
    decode = media.decode_wav

    def counted(data):
        calls.append(len(data))
        return decode(data)

    monkeypatch.setattr(media, "decode_wav", counted)
    return calls


# ── the body ─────────────────────────────────────────────────────────────────────────────────


def test_an_oversized_body_is_413_before_it_is_read(llm):
    with scripted_server(llm, limits=Limits(max_request_bytes=64 * 1024)) as (url, engine):
        with neighbour(url):
            # Content-Length says 100 MB and nothing follows: the answer comes without the body.
            status, headers, body = raw_request(
                url,
                f"POST {CHAT} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                "Content-Length: 100000000",
            )
            error = error_of((status, headers, body))
            assert status == 413 and error["code"] == "request_too_large"
            assert "100,000,000 bytes" in error["message"] and "65,536" in error["message"]
            assert headers["connection"] == "close"
            # A chunked body states no length: counted as it arrives, refused once over the cap
            # (here after 80 KiB of a body that would never end).
            chunk = b"x" * 8192
            chunks = (b"%x\r\n" % len(chunk) + chunk + b"\r\n") * 10
            status, _, body = raw_request(
                url,
                f"POST {CHAT} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                "Transfer-Encoding: chunked",
                chunks,
            )
            assert status == 413 and error_of((status, {}, body))["code"] == "request_too_large"
        # Neither reached a handler; under the cap, requests are served as before.
        assert len(engine.prompts) == 1
        fits = httpx.post(f"{url}{CHAT}", json={"messages": [{"role": "user", "content": "Hi"}]}, timeout=60)
        assert fits.status_code == 200


def test_a_prompt_that_cannot_fit_is_refused_before_tokenizing(llm, monkeypatch):
    tokenized = []
    for name in ("encode", "render_chat"):
        original = getattr(llm.processor, name)
        monkeypatch.setattr(
            llm.processor, name, lambda *a, _f=original, _n=name, **k: tokenized.append(_n) or _f(*a, **k)
        )
    with scripted_server(llm) as (url, engine):
        with neighbour(url):
            tokenized.clear()  # (the neighbour's own prompt)
            # 2 MB of text: far more characters than 512 tokens can hold whatever the tokens.
            huge = "word " * 400_000
            response = httpx.post(f"{url}/v1/completions", json={"prompt": huge}, timeout=60)
            error = error_of(response)
            assert response.status_code == 400 and error["code"] == "context_length_exceeded"
            assert "2,000,000 characters" in error["message"] and "before tokenizing" in error["message"]
            chat = httpx.post(
                f"{url}{CHAT}", json={"messages": [{"role": "user", "content": huge}]}, timeout=60
            )
            assert chat.status_code == 400 and error_of(chat)["param"] == "messages"
            assert tokenized == []
        assert len(engine.prompts) == 1


@contextmanager
def a_held_completion(llm, monkeypatch, **server):
    """A server (``scripted_server(llm, **server)``) whose completion of the prompt "held" is
    stopped inside the tokenizer: yields the server's url and ``finish``, which lets the held
    request go on and checks that it ends with 200."""
    entered, release = threading.Event(), threading.Event()
    encode = llm.processor.encode

    def held_encode(prompt, *args, **kwargs):
        if prompt == "held":
            entered.set()
            release.wait(30)
        return encode(prompt, *args, **kwargs)

    monkeypatch.setattr(llm.processor, "encode", held_encode)
    with scripted_server(llm, **server) as (url, _):
        held: dict = {}
        thread = threading.Thread(
            target=lambda: held.update(
                response=httpx.post(
                    f"{url}/v1/completions", json={"prompt": "held", "max_tokens": 4}, timeout=60
                )
            )
        )

        def finish() -> None:
            release.set()
            thread.join(timeout=60)
            assert held["response"].status_code == 200

        thread.start()
        try:
            assert entered.wait(30)
            yield url, finish
        finally:
            release.set()
            thread.join(timeout=60)


def test_tokenizing_runs_off_the_event_loop(llm, monkeypatch):
    """A request held inside the tokenizer leaves /health and other streams answering."""
    with a_held_completion(llm, monkeypatch) as (url, finish):
        # Were the tokenizer on the event loop, these would wait for it (and time out).
        assert httpx.get(f"{url}/health", timeout=10).status_code == 200
        with neighbour(url):
            pass
        finish()


def test_requests_queued_for_preparation_are_bounded(llm, monkeypatch):
    """One preparation thread and no waiting room: a request arriving while another is being
    tokenized is a 503 at once (not a queue that grows with each client); then requests go on."""
    server = dict(limits=Limits(prepare_threads=1), max_waiting=0)
    with a_held_completion(llm, monkeypatch, **server) as (url, finish):
        busy = httpx.post(f"{url}/v1/completions", json={"prompt": "Hi", "max_tokens": 4}, timeout=10)
        assert busy.status_code == 503 and "being prepared" in error_of(busy)["message"]
        assert busy.headers["retry-after"] == "2"
        finish()
        after = httpx.post(f"{url}/v1/completions", json={"prompt": "Hi", "max_tokens": 4}, timeout=60)
        assert after.status_code == 200


# ── media ────────────────────────────────────────────────────────────────────────────────────


def test_media_are_refused_up_front_by_a_model_without_towers(llm, decoded_images, decoded_audio):
    with scripted_server(llm) as (url, engine):
        with neighbour(url):
            image = httpx.post(f"{url}{CHAT}", json=chat_with(image_part(png_url(50, 40))), timeout=60)
            error = error_of(image)
            assert image.status_code == 400 and "no vision tower" in error["message"]
            assert error["param"] == "messages.0.content.0"
            audio = httpx.post(f"{url}{CHAT}", json=chat_with(wav_part(1.0)), timeout=60)
            assert audio.status_code == 400 and "no audio tower" in error_of(audio)["message"]
            # Transcription and embeddings: answered before the upload is read (none is sent).
            for path in ("/v1/audio/transcriptions", "/v1/embeddings"):
                status, _, body = raw_request(
                    url,
                    f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                    "Content-Type: multipart/form-data; boundary=x\r\nContent-Length: 5000000",
                )
                assert status == 404 and error_of((status, {}, body))["param"] == "model", path
        assert decoded_images == {"load": [], "open": []} and decoded_audio == []
        assert len(engine.prompts) == 1


def test_image_limits_are_checked_on_headers_before_decoding(media_llm, decoded_images):
    limits = Limits(max_image_pixels=64 * 64, max_request_pixels=3 * 64 * 64, max_media_per_request=4)
    with scripted_server(media_llm, limits=limits) as (url, engine):
        with neighbour(url):
            big = httpx.post(f"{url}{CHAT}", json=chat_with(image_part(png_url(80, 80))), timeout=60)
            error = error_of(big)
            assert big.status_code == 400 and error["code"] == "image_too_large"
            assert "80x80 = 6,400 pixels" in error["message"] and "--max-image-pixels" in error["message"]
            # Each under the per-image limit, four together over the request's: refused at the
            # fourth header, before the first image is decoded.
            parts = [image_part(png_url(60, 60)) for _ in range(4)]
            many = httpx.post(f"{url}{CHAT}", json=chat_with(*parts), timeout=60)
            error = error_of(many)
            assert many.status_code == 400 and "--max-request-pixels" in error["message"]
            assert error["param"] == "messages.0.content.3"
            assert decoded_images["load"] == [] and len(decoded_images["open"]) == 5
            # More parts than a request may hold: refused before any is even opened.
            parts = [image_part(png_url(8, 8)) for _ in range(5)]
            count = httpx.post(f"{url}{CHAT}", json=chat_with(*parts), timeout=60)
            assert count.status_code == 400 and error_of(count)["code"] == "too_many_media"
            assert len(decoded_images["open"]) == 5
            for url_text, needle in (
                ("data:image/png;base64,aGVsbG8=", "cannot read the image"),
                ("https://example.com/cat.png", "data URLs"),
            ):
                bad = httpx.post(f"{url}{CHAT}", json=chat_with(image_part(url_text)), timeout=60)
                assert bad.status_code == 400 and needle in error_of(bad)["message"]
        assert len(engine.prompts) == 1
        # Within the limits, an image is decoded and served.
        fits = httpx.post(f"{url}{CHAT}", json=chat_with(image_part(png_url(60, 60))), timeout=60)
        assert fits.status_code == 200, fits.text
        assert set(decoded_images["load"]) == {(60, 60)}  # (load is called again on a loaded image)


def test_audio_seconds_are_counted_from_wav_headers_before_decoding(media_llm, decoded_audio):
    with scripted_server(media_llm, limits=Limits(max_audio_seconds=50)) as (url, engine):
        with neighbour(url):
            # Two clips of 40 s: each counts the 30 s the model hears, 60 s in all.
            response = httpx.post(f"{url}{CHAT}", json=chat_with(wav_part(40), wav_part(40)), timeout=60)
            error = error_of(response)
            assert response.status_code == 400 and error["code"] == "audio_too_long"
            assert "60.0 s" in error["message"] and "--max-audio-seconds" in error["message"]
            assert error["param"] == "messages.0.content.1"
        assert decoded_audio == [] and len(engine.prompts) == 1


def test_wav_seconds_reads_the_header():
    part = wav_part(2.5, rate=8000)
    data = base64.b64decode(part["input_audio"]["data"])
    assert media.wav_seconds(data) == 2.5
    # A data chunk that claims more than the file holds counts what is there.
    assert media.wav_seconds(data[:-8000]) == 2.0  # 16,000 bytes a second
    assert media.wav_seconds(b"not a wav") is None


def test_video_pixels_are_checked_on_the_header_before_decoding(tmp_path):
    pytest.importorskip("av")
    from torchgemma.processing.video import load_video
    from video_reference import moving_frames, write_video

    path = write_video(tmp_path / "clip.avi", moving_frames(6, 48, 64), 10)
    with pytest.raises(ValueError, match=r"4 frame\(s\) of 64x48 would decode to 12,288 pixels"):
        load_video(path, num_frames=4, max_pixels=4 * 64 * 48 - 1)
    assert load_video(path, num_frames=4, max_pixels=4 * 64 * 48).frames.shape == (4, 3, 48, 64)


# ── hosts, keys, connections, logs ───────────────────────────────────────────────────────────


def test_host_header_is_checked(llm):
    with scripted_server(llm, allowed_hosts=list(LOOPBACK_HOSTS)) as (url, engine):
        port = urlparse(url).port
        for host in ("127.0.0.1", f"127.0.0.1:{port}", "localhost:8000", "LOCALHOST", "[::1]:80"):
            assert httpx.get(f"{url}/health", headers={"Host": host}).status_code == 200, host
        for host in ("evil.example.com", "127.0.0.1.evil.example.com:80", "localhost.evil"):
            refused = httpx.post(
                f"{url}{CHAT}", headers={"Host": host}, json={"messages": [{"role": "user", "content": "Hi"}]}
            )
            error = error_of(refused)
            assert refused.status_code == 400 and error["code"] == "host_not_allowed", host
            assert host in error["message"] and "--allowed-hosts" in error["message"]
        assert engine.prompts == []
    assert _host_allowed("api.example.com:443", ["*.example.com"])
    assert not _host_allowed("example.com.evil:443", ["*.example.com"])
    assert not _host_allowed("", ["localhost"])


def test_serve_flags_for_hosts_and_keys(tmp_path, monkeypatch):
    def args(**given):
        return argparse.Namespace(
            **{"host": "127.0.0.1", "allowed_hosts": None, "api_key": None, "api_key_file": None, **given}
        )

    assert allowed_host_names(args()) == list(LOOPBACK_HOSTS)
    assert allowed_host_names(args(host="::1")) == list(LOOPBACK_HOSTS)
    assert allowed_host_names(args(host="0.0.0.0")) is None
    assert allowed_host_names(args(allowed_hosts="*")) is None
    assert allowed_host_names(args(host="0.0.0.0", allowed_hosts="a.example, b.example")) == [
        "a.example",
        "b.example",
    ]

    monkeypatch.delenv("TORCHGEMMA_API_KEY", raising=False)
    assert read_api_key(args()) is None
    monkeypatch.setenv("TORCHGEMMA_API_KEY", "from-env")
    assert read_api_key(args()) == "from-env"
    key_file = tmp_path / "key"
    key_file.write_text("from-file\n")
    assert read_api_key(args(api_key_file=key_file)) == "from-file"
    assert read_api_key(args(api_key="from-flag")) == "from-flag"
    with pytest.raises(CLIError, match="not both"):
        read_api_key(args(api_key="a", api_key_file=key_file))
    with pytest.raises(CLIError, match="cannot read --api-key-file"):
        read_api_key(args(api_key_file=tmp_path / "missing"))
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(CLIError, match="is empty"):
        read_api_key(args(api_key_file=tmp_path / "empty"))


def test_the_api_key_is_checked_before_the_body_is_read(llm):
    with scripted_server(llm, api_key="secret") as (url, _):
        status, _, body = raw_request(
            url,
            f"POST {CHAT} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: 5000000",
        )
        assert status == 401 and error_of((status, {}, body))["type"] == "authentication_error"


@contextmanager
def uvicorn_server(app, **config):
    import uvicorn

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", **config))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.02)
    try:
        yield sock.getsockname()
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        sock.close()


def closed_by_server(sock: socket.socket) -> bool:
    """Whether the server closes this connection (within 20 s: the tests' deadlines are < 1 s)."""
    sock.settimeout(20)
    try:
        return sock.recv(1024) == b""
    except ConnectionResetError:
        return True


def test_slow_connections_are_closed_and_the_connection_cap_answers_503(llm):
    engine = ScriptedEngine(llm.tokenizer, [], stop_id=llm.tokenizer.turn_end_id)
    app = create_app(llm, model_name=MODEL, engine=engine)
    with uvicorn_server(app, http=header_timeout_protocol(0.3), limit_concurrency=3) as address:
        url = f"http://{address[0]}:{address[1]}"
        idle = [socket.create_connection(address) for _ in range(3)]
        trickle = idle[0]
        trickle.sendall(b"GET /health HTTP/1.1\r\n")  # headers begun, never finished
        # While they are open, the cap is reached: a connection beyond it gets a clean 503 as it
        # opens and is closed (its descriptor freed), not a hang.
        with httpx.Client() as client:
            busy = client.get(f"{url}/health")
        assert busy.status_code == 503 and busy.headers["retry-after"] == "2"
        assert error_of(busy)["type"] == "server_busy" and "--max-connections" in error_of(busy)["message"]
        status, headers, _ = raw_request(url, "GET /health HTTP/1.1\r\nHost: 127.0.0.1")
        assert status == 503 and headers["connection"] == "close"
        # The silent and the trickling connections are closed at the header deadline.
        assert all(closed_by_server(sock) for sock in idle)
        for sock in idle:
            sock.close()
        # Once they are closed, requests are served; a kept-alive connection keeps working.
        with httpx.Client() as client:
            assert client.get(f"{url}/health").status_code == 200
            assert client.get(f"{url}/health").status_code == 200


def test_each_request_is_logged_without_its_prompt(llm, caplog):
    secret = "zebra quartz"
    body = {"messages": [{"role": "user", "content": f"My code is {secret}."}]}
    with caplog.at_level(logging.INFO, logger="torchgemma.serving"):
        with scripted_server(llm) as (url, _):
            assert httpx.post(f"{url}{CHAT}", json=body, timeout=60).status_code == 200
            assert httpx.get(f"{url}/nothing").status_code == 404
        with scripted_server(llm, log_prompts=True) as (url, _):
            assert httpx.post(f"{url}{CHAT}", json=body, timeout=60).status_code == 200
    lines = [r.getMessage() for r in caplog.records if r.name == "torchgemma.serving"]
    chat = [line for line in lines if line.startswith(f"POST {CHAT} 200 ")]
    assert len(chat) == 2, lines
    tokens = f"completion_tokens={len(llm.tokenizer.encode(NEIGHBOUR_REPLY, add_special_tokens=False)) + 1}"
    assert all("prompt_tokens=" in line and tokens in line and "client=127.0.0.1:" in line for line in chat)
    assert secret not in chat[0] and secret in chat[1]
    assert any(line.startswith("GET /nothing 404 ") for line in lines)
