"""The hostile inputs of issue 24 at full size, against the server's default limits (slow: the bombs
take seconds to build). test_serving_limits.py has the same cases at small limits in the default run.
"""

from __future__ import annotations

import base64
import io
import json

import httpx
import numpy as np
import pytest
from PIL import Image

from test_serving_limits import (  # noqa: F401 - fixtures
    CHAT,
    decoded_images,
    error_of,
    llm,
    media_llm,
    neighbour,
    raw_request,
    scripted_server,
)

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]


def test_sixteen_image_bombs_are_refused_on_their_headers(media_llm, decoded_images):  # noqa: F811
    """16 PNGs of 8000x8000 (~200 KB each, 192 MB each once decoded): the first header is over the
    default 4096x4096, and nothing is decoded."""
    buffer = io.BytesIO()
    Image.new("RGB", (8000, 8000), (10, 20, 30)).save(buffer, format="PNG")
    part = {
        "type": "image_url",
        "image_url": {"url": "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()},
    }
    body = {"messages": [{"role": "user", "content": [part] * 16 + [{"type": "text", "text": "Hi"}]}]}
    with scripted_server(media_llm) as (url, engine):
        with neighbour(url):
            response = httpx.post(f"{url}{CHAT}", json=body, timeout=120)
            error = error_of(response)
            assert response.status_code == 400 and error["code"] == "image_too_large"
            assert "8000x8000 = 64,000,000 pixels" in error["message"]
        assert decoded_images["load"] == [] and len(decoded_images["open"]) == 1
        assert len(engine.prompts) == 1


def test_large_prompts_and_bodies_at_the_default_limits(llm, monkeypatch):  # noqa: F811
    tokenized = []
    encode = llm.processor.encode
    monkeypatch.setattr(llm.processor, "encode", lambda *a, **k: tokenized.append(1) or encode(*a, **k))
    with scripted_server(llm) as (url, engine):
        with neighbour(url):
            tokenized.clear()
            # 5 MB of text: fits the 8 MiB body, cannot fit 512 tokens.
            response = httpx.post(f"{url}/v1/completions", json={"prompt": "word " * 1_000_000}, timeout=120)
            assert response.status_code == 400 and error_of(response)["code"] == "context_length_exceeded"
            assert tokenized == []
            # 100 MB of prompt: refused on its Content-Length, the body never sent.
            body = json.dumps({"prompt": "word " * 20_000_000}).encode()
            status, _, answer = raw_request(
                url,
                "POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(body)}",
            )
            assert status == 413 and "8,388,608 bytes" in error_of((status, {}, answer))["message"]
        assert len(engine.prompts) == 1


def test_an_8k_video_bomb_is_refused_before_decoding(tmp_path):
    """A small H.264 file of 10 black 7680x4320 frames, which would decode to 1 GB."""
    av = pytest.importorskip("av")
    from torchgemma.processing.video import MAX_VIDEO_PIXELS, load_video

    path = tmp_path / "bomb.mp4"
    with av.open(str(path), "w") as container:
        stream = container.add_stream("libx264", rate=10)
        stream.width, stream.height, stream.pix_fmt = 7680, 4320, "yuv420p"
        stream.options = {"preset": "ultrafast"}
        black = av.VideoFrame.from_ndarray(np.zeros((4320, 7680, 3), dtype=np.uint8), format="rgb24")
        for _ in range(10):
            container.mux(stream.encode(black))
        container.mux(stream.encode())
    assert path.stat().st_size < 1 << 20
    with pytest.raises(
        ValueError, match=rf"10 frame\(s\) of 7680x4320 .* more than the {MAX_VIDEO_PIXELS:,}"
    ):
        load_video(path)
