"""gemma4_unified (12B Unified) through ``LLM``, chat and the CLI, against transformers 5.23.

A tiny random ``gemma4_unified`` checkpoint with the test tokenizer's vocabulary (media tokens at the
end, as in the real layout), 4 px patches merged 2x2 and 640-sample audio frames. transformers' own
``Gemma4UnifiedProcessor`` (fixture tokenizer + ``Gemma4UnifiedImageProcessor`` with the torchvision
stand-in of unified_reference.py + ``Gemma4UnifiedAudioFeatureExtractor``) builds the reference
inputs; ``generate(do_sample=False)`` of ``Gemma4UnifiedForConditionalGeneration`` (eager attention)
is the reference output.
"""

from __future__ import annotations

import functools
import json
import wave
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from checkpoints import COMMON, UNIFIED_STYLES, randomize_
from llm_fixtures import GEMMA4_GENERATION_CONFIG, media_token_ids
from llm_fixtures import run_cli as run
from tokenizer_fixtures import VOCAB_SIZE, write_gemma4_tokenizer
from torchgemma.llm import LLM
from unified_reference import reference_image_processor_class, reference_video_processor_class
from video_reference import moving_frames

pytestmark = pytest.mark.usefixtures("one_thread")

DTYPES = [torch.float32, torch.bfloat16]
NEW = 12
SOFT_TOKENS = 70
NUM_FRAMES = 4  # frames kept per video
VISION = dict(patch_size=4, pooling_kernel_size=2, mm_embed_dim=40, mm_posemb_size=32, output_proj_dims=40)


def build_checkpoint(folder: Path, seed: int) -> Path:
    from transformers import (
        Gemma4UnifiedAudioConfig,
        Gemma4UnifiedAudioFeatureExtractor,
        Gemma4UnifiedConfig,
        Gemma4UnifiedForConditionalGeneration,
        Gemma4UnifiedTextConfig,
        Gemma4UnifiedVisionConfig,
    )

    text = Gemma4UnifiedTextConfig(**{**COMMON, **UNIFIED_STYLES["12b"], "vocab_size": VOCAB_SIZE})
    config = Gemma4UnifiedConfig(
        text_config=text.to_dict(),
        vision_config=Gemma4UnifiedVisionConfig(**VISION).to_dict(),
        audio_config=Gemma4UnifiedAudioConfig(audio_embed_dim=640).to_dict(),
        **media_token_ids(),
    )
    torch.manual_seed(seed)
    model = Gemma4UnifiedForConditionalGeneration(config)
    randomize_(model, seed)
    with torch.no_grad():  # small embeddings, so that greedy continuations vary
        model.model.language_model.embed_tokens.weight.mul_(0.05)
    model.save_pretrained(folder)
    write_gemma4_tokenizer(folder)
    (folder / "generation_config.json").write_text(json.dumps(GEMMA4_GENERATION_CONFIG))
    # What Gemma4UnifiedProcessor.save_pretrained writes (it cannot save here: no torchvision).
    processor_config = {
        "processor_class": "Gemma4UnifiedProcessor",
        "image_processor": {"max_soft_tokens": SOFT_TOKENS, "patch_size": 4, "pooling_kernel_size": 2},
        "feature_extractor": Gemma4UnifiedAudioFeatureExtractor().to_dict(),
        "video_processor": {"max_soft_tokens": SOFT_TOKENS, "num_frames": NUM_FRAMES},
    }
    (folder / "processor_config.json").write_text(json.dumps(processor_config, default=str))
    return folder


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return build_checkpoint(tmp_path_factory.mktemp("unified-llm") / "unified-it", seed=91)


@pytest.fixture(scope="module")
def processor(checkpoint):
    from transformers import AutoTokenizer, Gemma4UnifiedAudioFeatureExtractor, Gemma4UnifiedProcessor

    class Processor(Gemma4UnifiedProcessor):
        # Its video processor is loaded outside transformers' registry (unified_reference.py).
        def check_argument_for_proper_class(self, name, arg):
            if name != "video_processor":
                return super().check_argument_for_proper_class(name, arg)

    with pytest.MonkeyPatch.context() as monkeypatch:
        image_processor = reference_image_processor_class(monkeypatch)(
            max_soft_tokens=SOFT_TOKENS, patch_size=4, pooling_kernel_size=2
        )
        yield Processor(
            feature_extractor=Gemma4UnifiedAudioFeatureExtractor(),
            image_processor=image_processor,
            tokenizer=AutoTokenizer.from_pretrained(checkpoint),
            video_processor=reference_video_processor_class(monkeypatch)(
                max_soft_tokens=SOFT_TOKENS, patch_size=4, pooling_kernel_size=2, num_frames=NUM_FRAMES
            ),
        )


@functools.cache
def load_llm(folder: Path, dtype: torch.dtype = torch.float32, attention: str = "eager") -> LLM:
    return LLM(folder, dtype=dtype, attention=attention)


@functools.cache
def reference_model(folder: Path, dtype: torch.dtype, attention: str = "eager"):
    from transformers import Gemma4UnifiedForConditionalGeneration

    model = Gemma4UnifiedForConditionalGeneration.from_pretrained(
        folder, dtype=dtype, attn_implementation=attention
    )
    return model.eval()


RNG = np.random.default_rng(6)
IMAGES = [
    Image.fromarray(RNG.integers(0, 256, (100, 150, 3), dtype=np.uint8)),
    RNG.integers(0, 256, (120, 50, 3), dtype=np.uint8),
]
# 0.5 s and 0.3 s (13 and 8 frames of 640 samples): the shorter clip is padded in the batch.
CLIPS = [0.1 * RNG.standard_normal(n).astype(np.float32) for n in (8000, 4800)]
# 10 frames of 60x90, given without a rate (24 fps assumed by both): 4 kept.
VIDEO = moving_frames(10, 60, 90, seed=3)


def user(*items, text="Describe this in detail.") -> list[dict]:
    return [{"role": "user", "content": [*items, {"type": "text", "text": text}]}]


def reference_inputs(processor, llm, messages, images=(), audio=(), videos=()):
    text = llm.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    inputs = processor(
        text=[text],
        images=[list(images)] if images else None,
        audio=list(audio) or None,
        videos=list(videos) or None,
        return_tensors="pt",
    )
    inputs.pop("video_metadata", None)
    return inputs


def test_llm_reads_the_processor_config(checkpoint):
    assert load_llm(checkpoint).max_soft_tokens == SOFT_TOKENS


def test_chat_inputs_match_processor(checkpoint, processor):
    llm = load_llm(checkpoint)
    messages = user(
        {"type": "image", "image": IMAGES[0]},
        {"type": "audio", "audio": CLIPS[0]},
        {"type": "text", "text": "and"},
        {"type": "image", "image": IMAGES[1]},
        {"type": "audio", "audio": CLIPS[1]},
        {"type": "video", "video": VIDEO},
    )
    ours = llm.chat_inputs(messages)
    theirs = dict(reference_inputs(processor, llm, messages, IMAGES, CLIPS, [VIDEO]))
    assert set(ours) == set(theirs)
    for name, value in theirs.items():
        assert ours[name].dtype == value.dtype, name
        assert torch.equal(ours[name], value), name
    types = ours["mm_token_type_ids"][0]
    assert (types == 3).sum() == 13 + 8
    assert (types == 1).sum() == (ours["image_position_ids"][..., 0] != -1).sum() > 0
    assert set(types.tolist()) == {0, 1, 2, 3}
    assert ours["num_frames_per_video"].tolist() == [NUM_FRAMES]


def test_text_only_chat_matches_transformers(checkpoint, processor):
    llm = load_llm(checkpoint)
    messages = [{"role": "user", "content": "Write a short poem about the sea."}]
    ours = llm.chat_inputs(messages)
    theirs = reference_inputs(processor, llm, messages)
    assert torch.equal(ours["input_ids"], theirs["input_ids"])
    ref = reference_model(checkpoint, torch.float32)
    with torch.no_grad():
        expected = ref.generate(
            theirs["input_ids"],
            attention_mask=theirs["attention_mask"],
            max_new_tokens=NEW,
            do_sample=False,
            eos_token_id=None,
        )[0, theirs["input_ids"].shape[1] :].tolist()
    reply = llm.chat(messages, temperature=0, max_new_tokens=NEW, stop_token_ids=[])
    assert list(reply.token_ids) == expected
    assert len(set(expected)) >= 4, f"degenerate continuation {expected}"


CASES = {
    "image": [{"type": "image", "image": IMAGES[0]}],
    "audio": [{"type": "audio", "audio": CLIPS[0]}],
    "both": [{"type": "image", "image": IMAGES[1]}, {"type": "audio", "audio": CLIPS[1]}],
    "video": [{"type": "video", "video": VIDEO}],
}


# Both attention backends, each against transformers' own (sdpa is the default of both).
@pytest.mark.parametrize("attention", ["eager", "sdpa"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", list(CASES))
def test_greedy_with_media_matches_transformers(checkpoint, processor, case, dtype, attention):
    llm = load_llm(checkpoint, dtype, attention)
    items = CASES[case]
    messages = user(*items)
    images = [item["image"] for item in items if item["type"] == "image"]
    audio = [item["audio"] for item in items if item["type"] == "audio"]
    videos = [item["video"] for item in items if item["type"] == "video"]
    inputs = reference_inputs(processor, llm, messages, images, audio, videos)
    with torch.no_grad():
        theirs = reference_model(checkpoint, dtype, attention).generate(
            **inputs, max_new_tokens=NEW, do_sample=False, eos_token_id=None
        )
    theirs = theirs[0, inputs["input_ids"].shape[1] :].tolist()
    reply = llm.chat(messages, temperature=0, max_new_tokens=NEW, stop_token_ids=[])
    assert list(reply.token_ids) == theirs, f"\nours   {list(reply.token_ids)}\ntheirs {theirs}"
    assert len(set(theirs)) >= 4, f"degenerate continuation {theirs}"


def test_media_change_the_reply(checkpoint):
    llm = load_llm(checkpoint)
    greedy = dict(temperature=0, max_new_tokens=NEW, stop_token_ids=[])
    replies = {llm.chat(user(*items), **greedy).token_ids for items in CASES.values()}
    assert len(replies | {llm.chat(user(), **greedy).token_ids}) == 5


def test_clear_errors(checkpoint):
    llm = load_llm(checkpoint)
    with pytest.raises(ValueError, match="video frames must be uint8"):
        llm.chat(user({"type": "video", "video": np.zeros((4, 8, 8, 3), np.float32)}), max_new_tokens=1)
    with pytest.raises(ValueError, match="uint8"):
        llm.chat(user({"type": "image", "image": np.zeros((8, 8, 3), np.float32)}), max_new_tokens=1)
    with pytest.raises(ValueError, match="audio clip 0 is empty"):
        llm.chat(user({"type": "audio", "audio": np.zeros(0, np.float32)}), max_new_tokens=1)
    with pytest.raises(ValueError, match="1 image placeholder"):
        llm.generate("<|image|>", images=[IMAGES[0], IMAGES[0]], max_new_tokens=1)


def test_cli_generate_with_media(checkpoint, tmp_path, capsys, monkeypatch):
    IMAGES[0].save(tmp_path / "cat.png")
    with wave.open(str(tmp_path / "clip.wav"), "wb") as out:
        out.setnchannels(1)
        out.setsampwidth(2)
        out.setframerate(16000)
        out.writeframes((np.clip(CLIPS[0], -1, 1) * 32767).astype("<i2").tobytes())
    image, audio = str(tmp_path / "cat.png"), str(tmp_path / "clip.wav")
    flags = ["--model", str(checkpoint), "--temperature", "0", "--max-new-tokens", "8"]
    code, out, err = run(
        ["generate", *flags, "--image", image, "--audio", audio, "Describe:"], capsys, monkeypatch
    )
    assert code == 0, err
    llm = load_llm(checkpoint)
    expected = llm.generate(
        "Describe:<|image|><|audio|>", images=[image], audio=[audio], temperature=0, max_new_tokens=8
    )
    assert out == expected + "\n"
    # The file decodes to the array's samples (16-bit), so the reply is that of the array as well.
    samples = (np.clip(CLIPS[0], -1, 1) * 32767).astype("<i2") / 32768
    assert expected == llm.generate(
        "Describe:<|image|><|audio|>", images=[IMAGES[0]], audio=[samples], temperature=0, max_new_tokens=8
    )


def test_server_takes_images_and_audio(checkpoint):
    """The OpenAI-compatible server with an image (PNG data URL) and a WAV clip replies what
    LLM.chat replies to the same conversation; transcription works through the audio embedder."""
    import base64
    import io
    import wave

    import openai

    from serving_fixtures import content_of, running_server
    from torchgemma.serving.app import create_app
    from torchgemma.serving.audio import TRANSCRIBE_PROMPT

    llm = load_llm(checkpoint)
    png = io.BytesIO()
    IMAGES[0].save(png, format="PNG")
    samples = (CLIPS[0].clip(-1, 1) * 32767).astype("<i2")
    wav = io.BytesIO()
    with wave.open(wav, "wb") as out:
        out.setnchannels(1)
        out.setsampwidth(2)
        out.setframerate(16000)
        out.writeframes(samples.tobytes())
    heard = samples / 32768.0
    with running_server(create_app(llm, model_name="u", max_len=1024)) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        content = [
            {"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(png.getvalue()).decode()}},
            {"type": "input_audio", "input_audio": {"data": base64.b64encode(wav.getvalue()).decode(), "format": "wav"}},
            {"type": "text", "text": "Describe both."},
        ]  # fmt: skip
        reply = client.chat.completions.create(
            model="u", messages=[{"role": "user", "content": content}], temperature=0, max_tokens=NEW
        )
        expected = llm.chat(
            [{"role": "user", "content": [
                {"type": "image", "image": Image.open(io.BytesIO(png.getvalue()))},
                {"type": "audio", "audio": heard},
                {"type": "text", "text": "Describe both."},
            ]}],
            temperature=0,
            max_new_tokens=NEW,
        )  # fmt: skip
        assert reply.choices[0].message.content == content_of(llm, expected.token_ids)
        transcript = client.audio.transcriptions.create(
            model="u", file=("clip.wav", wav.getvalue(), "audio/wav")
        )
        messages = [
            {
                "role": "user",
                "content": [{"type": "audio", "audio": heard}, {"type": "text", "text": TRANSCRIBE_PROMPT}],
            }
        ]
        prompt = int(llm.chat_inputs(messages)["attention_mask"].sum())
        spoken = llm.chat(messages, temperature=0, max_new_tokens=min(448, 1024 - prompt))
        assert transcript.text == content_of(llm, spoken.token_ids)
