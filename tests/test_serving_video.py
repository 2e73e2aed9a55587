"""Video in the server: ``video_url`` content parts (vLLM's shape: ``{"type": "video_url",
"video_url": {"url": "data:video/...;base64,..."}}``) in chat completions, and ``input_video`` parts
in the Responses API, through the official openai client against a tiny Gemma 4 model.

The reply equals ``LLM.chat`` with the same video file (greedy): the server decodes the upload with
the same PyAV loader and the same frame sampling (the checkpoint's video processor config, 2
frames here). The limits (bytes, length from the header, decoded pixels, decoding time) and
undecodable files are 400s naming the limit.
"""

from __future__ import annotations

import base64
import json
from fractions import Fraction
from pathlib import Path

import httpx
import pytest

from serving_fixtures import running_server
from torchgemma.llm import LLM
from torchgemma.serving.app import create_app
from torchgemma.serving.limits import Limits
from video_reference import moving_frames, write_video

pytest.importorskip("av", reason="video decoding needs PyAV (the video extra)")
pytestmark = pytest.mark.usefixtures("one_thread")

CHAT = "/v1/chat/completions"
PROMPT = "What happens here?"
NEW = 6


@pytest.fixture(scope="module")
def video_llm(media_llm_checkpoints, tmp_path_factory) -> LLM:
    """The E2B-like media checkpoint whose video processor keeps 2 frames of 70 soft tokens."""
    source = media_llm_checkpoints["e2b"]
    folder = tmp_path_factory.mktemp("video-serving") / "e2b-video-it"
    folder.mkdir()
    for f in source.iterdir():
        if f.name != "processor_config.json":
            (folder / f.name).symlink_to(f)
    config = json.loads((source / "processor_config.json").read_text())
    config["video_processor"] = {"num_frames": 2, "max_soft_tokens": 70}
    (folder / "processor_config.json").write_text(json.dumps(config))
    return LLM(folder, progress=False)


@pytest.fixture(scope="module")
def clip(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("video-clips")
    return write_video(root / "clip.avi", moving_frames(12, 48, 64, seed=3), Fraction(6, 1))


def data_url(path: Path, kind: str = "video/x-msvideo") -> str:
    return f"data:{kind};base64,{base64.b64encode(path.read_bytes()).decode()}"


def video_part(url: str) -> dict:
    return {"type": "video_url", "video_url": {"url": url}}


def test_chat_and_responses_with_a_video_equal_llm_chat(video_llm, clip):
    import openai

    expected = video_llm.chat(
        [
            {
                "role": "user",
                "content": [{"type": "video", "path": str(clip)}, {"type": "text", "text": PROMPT}],
            }
        ],
        temperature=0,
        max_new_tokens=NEW,
        stop_token_ids=[],
    )
    with running_server(create_app(video_llm, model_name="m", max_batch_size=2, max_len=512)) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none")
        reply = client.chat.completions.create(
            model="m",
            messages=[
                {"role": "user", "content": [video_part(data_url(clip)), {"type": "text", "text": PROMPT}]}
            ],
            temperature=0,
            max_tokens=NEW,
            extra_body={"ignore_eos": True},
        )
        assert reply.choices[0].message.content == expected.text
        assert reply.usage.completion_tokens == NEW
        response = client.responses.create(
            model="m",
            input=[
                {
                    "role": "user",
                    "content": [
                        {"type": "input_video", "video_url": data_url(clip)},
                        {"type": "input_text", "text": PROMPT},
                    ],
                }
            ],
            temperature=0,
            max_output_tokens=NEW,
            extra_body={"ignore_eos": True},
        )
        assert response.output_text == expected.text


def error_of(answer: httpx.Response) -> dict:
    assert answer.status_code == 400, answer.text
    return answer.json()["error"]


def test_video_limits_and_bad_videos_are_400s(video_llm, llm_checkpoint, clip, tmp_path):
    long = write_video(tmp_path / "long.mkv", moving_frames(30, 48, 64, seed=5), Fraction(2, 1))  # 15 s
    big = write_video(tmp_path / "big.avi", moving_frames(2, 300, 400, seed=6), Fraction(1, 1))
    limits = Limits(max_video_bytes=2_000_000, max_video_seconds=10, max_video_pixels=100_000)
    app = create_app(video_llm, model_name="m", max_batch_size=2, max_len=512, limits=limits)

    def chat(*parts) -> httpx.Response:
        body = {"messages": [{"role": "user", "content": [*parts, {"type": "text", "text": PROMPT}]}]}
        return httpx.post(f"{url}{CHAT}", json={**body, "max_tokens": 2}, timeout=120)

    with running_server(app) as url:
        assert error_of(chat(video_part("https://example.com/a.mp4")))["message"].startswith(
            "videos are taken as data URLs"
        )
        garbage = "data:video/mp4;base64," + base64.b64encode(b"not a video at all" * 10).decode()
        assert "cannot read the video" in error_of(chat(video_part(garbage)))["message"]
        error = error_of(chat(video_part(data_url(long, "video/x-matroska"))))
        assert error["code"] == "video_too_long" and "--max-video-seconds" in error["message"]
        error = error_of(chat(video_part(data_url(big))))
        assert "--max-video-pixels" in error["message"]
        oversized = "data:video/mp4;base64," + base64.b64encode(bytes(2_000_001)).decode()
        error = error_of(chat(video_part(oversized)))
        assert error["code"] == "video_too_large" and "--max-video-bytes" in error["message"]
        assert error_of(chat(*[video_part(data_url(clip))] * 17))["code"] == "too_many_media"
        ok = chat(video_part(data_url(clip)))
        assert ok.status_code == 200, ok.text
    slow = create_app(
        video_llm, model_name="m", max_batch_size=2, max_len=512, limits=Limits(video_decode_timeout=1e-9)
    )
    with running_server(slow) as url:
        assert "decoding took more than" in error_of(chat(video_part(data_url(clip))))["message"]
    with running_server(create_app(LLM(llm_checkpoint, progress=False), model_name="m")) as url:
        assert "it cannot take videos" in error_of(chat(video_part(data_url(clip))))["message"]


def test_serve_flags_set_the_limits():
    from torchgemma.cli import build_parser
    from torchgemma.cli.serve import limits_of

    argv = ["serve", "--model", "m", "--max-video-bytes", "1000", "--max-video-seconds", "5"]
    argv += ["--max-video-pixels", "4096", "--video-decode-timeout", "2.5", "--max-audio-seconds", "7"]
    limits = limits_of(build_parser().parse_args(argv))
    assert (limits.max_video_bytes, limits.max_video_seconds, limits.max_video_pixels) == (1000, 5.0, 4096)
    assert (limits.video_decode_timeout, limits.max_audio_seconds) == (2.5, 7.0)
    assert limits_of(build_parser().parse_args(["serve", "--model", "m"])) == Limits()
