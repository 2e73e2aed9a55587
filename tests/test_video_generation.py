"""Video in the prompt, against transformers 5.23's Gemma4Processor, forward and generate().

Tiny random ``gemma4`` checkpoints with the test tokenizer (as in test_multimodal_generation.py)
and a processor config whose video processor keeps 4 frames. The reference inputs are built by
transformers' ``Gemma4Processor`` with its own ``Gemma4VideoProcessor`` (on a torchvision stand-in
where torchvision is missing, see video_reference.py); logits come from
``Gemma4ForConditionalGeneration`` (eager attention) and greedy tokens from its ``generate``.
"""

from __future__ import annotations

import functools
import io
import json
import sys
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from checkpoints import build_media_chat_checkpoint, reference_model
from llm_fixtures import GEMMA4_GENERATION_CONFIG, image_processor, media_token_ids
from tokenizer_fixtures import VOCAB_SIZE, write_gemma4_tokenizer
from torchgemma import Video
from torchgemma.cli import main
from torchgemma.llm import LLM
from video_reference import decode_with_pyav, moving_frames, reference_video_processor_class, write_video

DTYPES = [torch.float32, torch.bfloat16]
NEW = 10
NUM_FRAMES = 4

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def video_processor_class():
    with pytest.MonkeyPatch.context() as patch:
        yield reference_video_processor_class(patch)


def build_checkpoint(folder: Path, large: bool, seed: int, video_processor) -> Path:
    from transformers import Gemma4AudioFeatureExtractor

    build_media_chat_checkpoint(
        folder, vocab_size=VOCAB_SIZE, media_token_ids=media_token_ids(), large=large, seed=seed
    )
    write_gemma4_tokenizer(folder)
    (folder / "generation_config.json").write_text(json.dumps(GEMMA4_GENERATION_CONFIG))
    # As Gemma4Processor.save_pretrained writes it, with a video processor that keeps 4 frames.
    processor_config = {
        "processor_class": "Gemma4Processor",
        "image_processor": image_processor().to_dict(),
        "feature_extractor": Gemma4AudioFeatureExtractor().to_dict(),
        "video_processor": video_processor.to_dict(),
        "image_seq_length": 280,
        "audio_seq_length": 750,
    }
    (folder / "processor_config.json").write_text(json.dumps(processor_config, default=str))
    return folder


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, video_processor_class) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("video-llm")
    video = video_processor_class(num_frames=NUM_FRAMES)
    return {
        "e2b": build_checkpoint(root / "e2b-omni-it", large=False, seed=41, video_processor=video),
        "31b": build_checkpoint(root / "31b-vision-it", large=True, seed=42, video_processor=video),
    }


@pytest.fixture(scope="module")
def processor(checkpoints, video_processor_class):
    from transformers import AutoTokenizer, Gemma4AudioFeatureExtractor, Gemma4Processor

    class Processor(Gemma4Processor):
        # transformers' registry of video processors needs torchvision; the instance is checked below.
        def check_argument_for_proper_class(self, name, arg):
            if name != "video_processor":
                return super().check_argument_for_proper_class(name, arg)

    video = video_processor_class(num_frames=NUM_FRAMES)
    assert type(video).__name__ == "Gemma4VideoProcessor"
    decode_with_pyav(video)
    return Processor(
        feature_extractor=Gemma4AudioFeatureExtractor(),
        image_processor=image_processor(),
        tokenizer=AutoTokenizer.from_pretrained(checkpoints["e2b"]),
        video_processor=video,
    )


@functools.cache
def load_llm(folder: Path, dtype: torch.dtype = torch.float32) -> LLM:
    return LLM(folder, dtype=dtype, attention="eager")


# Two clips: 10 PIL frames of 100x150 at the assumed 24 fps, and 30 frames of 64x48 at 5 fps.
CLIP = [Image.fromarray(frame) for frame in moving_frames(10, 100, 150, seed=1)]
SLOW_FRAMES = moving_frames(30, 64, 48, seed=2)
SLOW = Video(SLOW_FRAMES, fps=5)
SLOW_METADATA = {"total_num_frames": 30, "fps": 5.0}
IMAGE = Image.fromarray(np.random.default_rng(3).integers(0, 256, (60, 90, 3), dtype=np.uint8))


def user(*items, text="What happens?") -> list[dict]:
    return [{"role": "user", "content": [*items, {"type": "text", "text": text}]}]


def reference_inputs(processor, llm, messages, videos, metadata=None, images=None):
    text = llm.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return processor(
        text=[text],
        videos=videos,
        video_metadata=metadata,
        images=[images] if images else None,
        return_tensors="pt",
    )


def assert_same_inputs(ours, theirs) -> None:
    assert set(ours) == set(theirs) - {"video_metadata"}
    for name in ours:
        assert torch.equal(ours[name], theirs[name]), name


def test_video_settings_from_processor_config(checkpoints):
    llm = load_llm(checkpoints["e2b"])
    assert (llm.video_num_frames, llm.video_soft_tokens) == (NUM_FRAMES, 70)


def test_expansion_matches_processor(checkpoints, processor):
    llm = load_llm(checkpoints["e2b"])
    # Text right before a video: its first timestamp is tokenized together with that text.
    messages = user(
        {"type": "text", "text": "First clip, at 10:30 sharp:"},
        {"type": "video", "video": CLIP},
        {"type": "image", "image": IMAGE},
        {"type": "video", "video": SLOW},
        text="What changed?",
    )
    metadata = [{"total_num_frames": len(CLIP), "fps": None}, SLOW_METADATA]
    theirs = reference_inputs(processor, llm, messages, [CLIP, SLOW_FRAMES], metadata, images=[IMAGE])
    ours = llm.chat_inputs(messages)
    assert_same_inputs(ours, theirs)
    types = ours["mm_token_type_ids"][0]
    assert set(types.tolist()) == {0, 1, 2}
    assert ours["num_frames_per_video"].tolist() == [NUM_FRAMES, NUM_FRAMES]
    # Timestamps: the 24 fps clip stays within its first second; the 5 fps one reaches 00:04.
    text = llm.tokenizer.decode(ours["input_ids"][0].tolist())
    assert "00:00 <|image>" in text and " 00:04 <|image>" in text


# bf16 (~15 CPU-s for the two styles) runs with -m slow: the default run keeps float32 here and
# bf16 video logits through test_sdpa_media (the default attention, both dtypes, to the bit).
LOGITS_DTYPES = [torch.float32, pytest.param(torch.bfloat16, marks=pytest.mark.slow)]


@pytest.mark.parametrize("dtype", LOGITS_DTYPES, ids=str)
@pytest.mark.parametrize("style", ["e2b", "31b"])
def test_logits_match_transformers(checkpoints, processor, style, dtype):
    """The whole prompt's logits, from the processor's own inputs (31b: a bidirectional block per frame)."""
    llm = load_llm(checkpoints[style], dtype)
    messages = user({"type": "video", "video": CLIP}, {"type": "video", "video": SLOW})
    metadata = [{"total_num_frames": len(CLIP), "fps": None}, SLOW_METADATA]
    inputs = reference_inputs(processor, llm, messages, [CLIP, SLOW_FRAMES], metadata)
    inputs.pop("video_metadata", None)
    ref = reference_model(checkpoints[style], dtype)
    with torch.no_grad():
        theirs = ref(**inputs).logits
        ours = llm.model(**inputs)
        last = llm.model(**inputs, logits_to_keep=1)
        theirs_last = ref(**inputs, logits_to_keep=1).logits
    assert ours.dtype == theirs.dtype == dtype
    diff = (ours.float() - theirs.float()).abs().max().item()
    print(f"{style} video logits {dtype}: max |Δ| = {diff:.3g}")
    if dtype == torch.bfloat16:
        assert torch.equal(ours, theirs) and torch.equal(last, theirs_last)
    else:
        assert diff <= 1e-5
        assert (last.float() - theirs_last.float()).abs().max().item() <= 1e-5
    # The frames are not a no-op: other frames, other logits.
    other = {**inputs, "pixel_values_videos": inputs["pixel_values_videos"].flip(0)}
    with torch.no_grad():
        assert (llm.model(**other).float() - ours.float()).abs().max() > 1e-3


CASES = {
    "e2b-frames": ("e2b", [{"type": "video", "video": CLIP}]),
    "e2b-video-and-image": ("e2b", [{"type": "image", "image": IMAGE}, {"type": "video", "video": CLIP}]),
    # Bidirectional attention inside each frame: mm_token_type_ids must reach the prefill.
    "31b-frames": ("31b", [{"type": "video", "video": CLIP}]),
}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", list(CASES))
def test_greedy_with_video_matches_transformers(checkpoints, processor, case, dtype):
    style, items = CASES[case]
    llm = load_llm(checkpoints[style], dtype)
    messages = user(*items)
    images = [item["image"] for item in items if item["type"] == "image"]
    inputs = reference_inputs(processor, llm, messages, [CLIP], images=images)
    inputs.pop("video_metadata", None)
    ref = reference_model(checkpoints[style], dtype)
    with torch.no_grad():
        theirs = ref.generate(**inputs, max_new_tokens=NEW, do_sample=False, eos_token_id=None)
    theirs = theirs[0, inputs["input_ids"].shape[1] :].tolist()
    reply = llm.chat(messages, temperature=0, max_new_tokens=NEW, stop_token_ids=[])
    assert list(reply.token_ids) == theirs, f"\nours   {list(reply.token_ids)}\ntheirs {theirs}"
    assert len(set(theirs)) >= 4, f"degenerate continuation {theirs}"


# ── Files ────────────────────────────────────────────────────────────────────────────────────────


@pytest.fixture(scope="module")
def video_file(tmp_path_factory) -> Path:
    pytest.importorskip("av")
    root = tmp_path_factory.mktemp("video-files")
    return write_video(root / "clip.avi", moving_frames(50, 72, 96, seed=4), Fraction(25, 2))


def test_greedy_with_video_file_matches_transformers(checkpoints, processor, video_file):
    llm = load_llm(checkpoints["e2b"])
    messages = user({"type": "video", "path": str(video_file)})
    inputs = reference_inputs(processor, llm, messages, [str(video_file)])
    inputs.pop("video_metadata", None)
    assert_same_inputs(llm.chat_inputs(messages), inputs)
    # Frames 0, 12, 25 and 37 of 50 at 12.5 fps: 0, 0.96, 2 and 2.96 s.
    assert " 00:02 <|image>" in llm.tokenizer.decode(inputs["input_ids"][0].tolist())
    ref = reference_model(checkpoints["e2b"])
    with torch.no_grad():
        theirs = ref.generate(**inputs, max_new_tokens=NEW, do_sample=False, eos_token_id=None)
    reply = llm.chat(messages, temperature=0, max_new_tokens=NEW, stop_token_ids=[])
    assert list(reply.token_ids) == theirs[0, inputs["input_ids"].shape[1] :].tolist()


def test_raw_prompts_match_transformers_and_batch(checkpoints, processor, video_file):
    llm = load_llm(checkpoints["e2b"])
    greedy = dict(temperature=0, max_new_tokens=6, stop_token_ids=[])
    prompt = "Clip:<|video|> In short,"
    inputs = processor(text=["<bos>" + prompt], videos=[CLIP], return_tensors="pt")
    ref = reference_model(checkpoints["e2b"])
    with torch.no_grad():
        theirs = ref.generate(**inputs, max_new_tokens=6, do_sample=False, eos_token_id=None)
    one = llm.generate_ids([llm.encode(prompt)], videos=[CLIP], **greedy)[0]
    assert one == theirs[0, inputs["input_ids"].shape[1] :].tolist()
    # A batch takes the videos in placeholder order over its rows; each row as alone.
    text = llm.generate(prompt, videos=[CLIP], **greedy)
    other = llm.generate("<|video|>Then", videos=[str(video_file)], **greedy)
    both = llm.generate([prompt, "<|video|>Then"], videos=[CLIP, str(video_file)], **greedy)
    assert both == [text, other]
    assert "".join(llm.stream(prompt, videos=[CLIP], **greedy)) == text


def test_engine_request_with_video(checkpoints):
    """Video inputs through Engine.add_request: the same tokens as through LLM (the engine's prefill)."""
    from torchgemma import Engine, MediaInputs, SamplingParams

    llm = load_llm(checkpoints["31b"])
    inputs = llm.chat_inputs(user({"type": "video", "video": CLIP}))
    engine = Engine(llm.model, max_batch_size=2, max_len=2048)
    media = MediaInputs(
        pixel_values_videos=inputs["pixel_values_videos"],
        video_position_ids=inputs["video_position_ids"],
        num_frames_per_video=inputs["num_frames_per_video"],
        mm_token_type_ids=inputs["mm_token_type_ids"][0],
    )
    engine.add_request(
        "v",
        inputs["input_ids"][0],
        max_new_tokens=5,
        sampling=SamplingParams(temperature=0),
        stop_token_ids=[],
        media=media,
    )
    tokens = []
    while engine.has_unfinished_requests():
        tokens += [output.token_id for output in engine.step()]
    expected = llm.chat(
        user({"type": "video", "video": CLIP}), temperature=0, max_new_tokens=5, stop_token_ids=[]
    )
    assert tokens == list(expected.token_ids)


def test_clear_errors(checkpoints, llm_checkpoint, tmp_path):
    llm = load_llm(checkpoints["e2b"])
    with pytest.raises(ValueError, match=r"0 video placeholder\(s\) \(<\|video\|>\) but 1 videos"):
        llm.generate("No placeholder here", videos=[CLIP])
    with pytest.raises(ValueError, match=r"2 video placeholder\(s\).* but 1 videos"):
        llm.generate("<|video|> and <|video|>", videos=[CLIP])
    with pytest.raises(FileNotFoundError, match="video file not found"):
        llm.chat(user({"type": "video", "path": str(tmp_path / "missing.mp4")}))
    with pytest.raises(ValueError, match="URLs are not fetched"):
        llm.chat(user({"type": "video", "url": "https://example.com/clip.mp4"}))
    with pytest.raises(ValueError, match="must be uint8"):
        llm.chat(user({"type": "video", "video": SLOW_FRAMES / 255.0}))
    text_only = LLM(llm_checkpoint)
    with pytest.raises(ValueError, match="no vision tower.*cannot take videos"):
        text_only.generate("<|video|>", videos=[CLIP])


# ── CLI ──────────────────────────────────────────────────────────────────────────────────────


def run(argv, capsys, monkeypatch, stdin=None):
    if stdin is not None:
        monkeypatch.setattr(sys, "stdin", io.StringIO(stdin))
    code = main(argv)
    out, err = capsys.readouterr()
    return code, out, err


def test_cli_generate_and_chat_with_video(checkpoints, video_file, capsys, monkeypatch):
    llm = load_llm(checkpoints["e2b"])
    path = str(video_file)
    flags = ["--model", str(checkpoints["e2b"]), "--temperature", "0", "--max-new-tokens", "6"]
    code, out, err = run(["generate", *flags, "--video", path, "Describe:"], capsys, monkeypatch)
    assert code == 0, err
    assert out == llm.generate("Describe:<|video|>", videos=[path], temperature=0, max_new_tokens=6) + "\n"
    code, out, err = run(["chat", *flags, "--video", path], capsys, monkeypatch, stdin="What is it?\n")
    assert code == 0, err
    reply = llm.chat(
        user({"type": "video", "video": path}, text="What is it?"), temperature=0, max_new_tokens=6
    )
    assert out == reply.text + "\n"


def test_cli_video_errors(checkpoints, capsys, monkeypatch, tmp_path):
    argv = ["generate", "--model", str(checkpoints["31b"]), "--max-new-tokens", "2", "hi"]
    code, _, err = run([*argv, "--video", str(tmp_path / "nope.mp4")], capsys, monkeypatch)
    assert code == 2 and "video file not found" in err
    (tmp_path / "broken.mp4").write_bytes(b"not a video")
    monkeypatch.setitem(sys.modules, "av", None)  # PyAV missing: the error names the extra
    code, _, err = run([*argv, "--video", str(tmp_path / "broken.mp4")], capsys, monkeypatch)
    assert code == 2 and 'pip install "torchgemma[video]"' in err
    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    assert "--video PATH" in capsys.readouterr().out
