"""Images and audio from Python and the CLI, against transformers 5.23's processor and generate().

Tiny random ``gemma4`` checkpoints whose vocabulary is the test tokenizer's (media tokens at the
end, as in the real layout), with tokenizer files, generation_config.json and processor_config.json.
transformers' own ``Gemma4Processor`` (fixture tokenizer + ``Gemma4ImageProcessorPil`` +
``Gemma4AudioFeatureExtractor``) builds the reference inputs; ``generate(do_sample=False)`` of
``Gemma4ForConditionalGeneration`` (eager attention) is the reference output.
"""

from __future__ import annotations

import functools
import wave
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from checkpoints import reference_model
from llm_fixtures import SOFT_TOKENS, image_processor
from llm_fixtures import run_cli as run
from torchgemma.cli import main
from torchgemma.llm import LLM

DTYPES = [torch.float32, torch.bfloat16]
NEW = 12


# Step-by-step decoding of tiny models: one thread (see conftest.one_thread).
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def checkpoints(media_llm_checkpoints) -> dict[str, Path]:
    return media_llm_checkpoints  # E2B-like with image and audio towers; 31B-like with vision alone


@pytest.fixture(scope="module")
def processor(checkpoints):
    from transformers import AutoTokenizer, Gemma4AudioFeatureExtractor, Gemma4Processor

    class Processor(Gemma4Processor):
        # The video processor needs torchvision, absent here; videos are not used.
        def check_argument_for_proper_class(self, name, arg):
            if name != "video_processor":
                return super().check_argument_for_proper_class(name, arg)

    return Processor(
        feature_extractor=Gemma4AudioFeatureExtractor(),
        image_processor=image_processor(),
        tokenizer=AutoTokenizer.from_pretrained(checkpoints["e2b"]),
        video_processor=None,
    )


@functools.cache
def load_llm(folder: Path, dtype: torch.dtype = torch.float32) -> LLM:
    return LLM(folder, dtype=dtype, attention="eager")


RNG = np.random.default_rng(5)
IMAGES = [
    Image.fromarray(RNG.integers(0, 256, (100, 150, 3), dtype=np.uint8)),
    Image.fromarray(RNG.integers(0, 256, (120, 50, 3), dtype=np.uint8)),
]
# 0.5 s and 0.3 s: the shorter clip is padded in the batch, so counts come from its mask.
CLIPS = [0.1 * RNG.standard_normal(n).astype(np.float32) for n in (8000, 4800)]


def user(*items, text="Describe this in detail.") -> list[dict]:
    return [{"role": "user", "content": [*items, {"type": "text", "text": text}]}]


def reference_inputs(processor, llm, messages, images, audio):
    text = llm.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return processor(
        text=[text], images=[images] if images else None, audio=audio or None, return_tensors="pt"
    )


def test_llm_settings_from_processor_config(checkpoints):
    assert load_llm(checkpoints["31b"]).max_soft_tokens == SOFT_TOKENS


def test_expansion_matches_processor(checkpoints, processor):
    llm = load_llm(checkpoints["e2b"])
    messages = user(
        {"type": "image", "image": IMAGES[0]},
        {"type": "audio", "audio": CLIPS[0]},
        {"type": "text", "text": "and"},
        {"type": "image", "image": np.asarray(IMAGES[1])},
        {"type": "audio", "audio": CLIPS[1]},
    )
    ours = llm.chat_inputs(messages)
    theirs = reference_inputs(processor, llm, messages, IMAGES, CLIPS)
    assert set(ours) == set(theirs)
    for name, value in theirs.items():
        assert torch.equal(ours[name], value), name
    types = ours["mm_token_type_ids"][0]
    assert (types == 1).sum() > 0 and (types == 3).sum() > 0 and set(types.tolist()) == {0, 1, 3}


CASES = {
    "e2b-image": ("e2b", [{"type": "image", "image": IMAGES[0]}]),
    "e2b-audio": ("e2b", [{"type": "audio", "audio": CLIPS[0]}]),
    "e2b-both": ("e2b", [{"type": "image", "image": IMAGES[1]}, {"type": "audio", "audio": CLIPS[1]}]),
    # Bidirectional attention inside the image: mm_token_type_ids must reach the prefill.
    "31b-image": ("31b", [{"type": "image", "image": IMAGES[0]}]),
}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", list(CASES))
def test_greedy_with_media_matches_transformers(checkpoints, processor, case, dtype):
    style, items = CASES[case]
    llm = load_llm(checkpoints[style], dtype)
    messages = user(*items)
    images = [item["image"] for item in items if item["type"] == "image"]
    audio = [item["audio"] for item in items if item["type"] == "audio"]
    inputs = reference_inputs(processor, llm, messages, images, audio)
    ref = reference_model(checkpoints[style], dtype)
    with torch.no_grad():
        theirs = ref.generate(**inputs, max_new_tokens=NEW, do_sample=False, eos_token_id=None)
    theirs = theirs[0, inputs["input_ids"].shape[1] :].tolist()

    reply = llm.chat(messages, temperature=0, max_new_tokens=NEW, stop_token_ids=[])
    assert list(reply.token_ids) == theirs, f"\nours   {list(reply.token_ids)}\ntheirs {theirs}"
    assert len(theirs) == NEW and len(set(theirs)) >= 4, f"degenerate continuation {theirs}"
    streamed = "".join(
        c.text for c in llm.stream_chat(messages, temperature=0, max_new_tokens=NEW, stop_token_ids=[])
    )
    assert streamed == reply.text


def test_media_change_the_reply(checkpoints):
    llm = load_llm(checkpoints["e2b"])
    greedy = dict(temperature=0, max_new_tokens=NEW, stop_token_ids=[])
    replies = {llm.chat(user({"type": "image", "image": image}), **greedy).token_ids for image in IMAGES} | {
        llm.chat(user(), **greedy).token_ids
    }
    assert len(replies) == 3


def test_media_go_to_the_prefill_only(checkpoints, monkeypatch):
    """The towers run once, for the prompt; decode steps feed the text decoder one token each."""
    llm = load_llm(checkpoints["e2b"])
    model = llm.model
    towers, calls = [], []
    embed, forward = model.embed_multimodal, model.language_model.forward

    def spy_embed(input_ids, **media):
        towers.append({name for name, value in media.items() if value is not None})
        return embed(input_ids, **media)

    def spy_forward(input_ids, *args, **kwargs):
        calls.append((input_ids.shape[1], kwargs.get("inputs_embeds") is not None))
        return forward(input_ids, *args, **kwargs)

    monkeypatch.setattr(model, "embed_multimodal", spy_embed)
    monkeypatch.setattr(model.language_model, "forward", spy_forward)
    items = [{"type": "image", "image": IMAGES[0]}, {"type": "audio", "audio": CLIPS[0]}]
    llm.chat(user(*items), temperature=0, max_new_tokens=4, stop_token_ids=[])
    assert towers == [{"pixel_values", "image_position_ids", "input_features", "input_features_mask"}]
    assert calls[0][0] > 1 and calls[0][1]  # the prompt, with the soft tokens scattered in
    assert calls[1:] == [(1, False)] * 3


def test_raw_prompt_with_placeholders_and_batches(checkpoints):
    llm = load_llm(checkpoints["e2b"])
    greedy = dict(temperature=0, max_new_tokens=6, stop_token_ids=[])
    one = llm.generate("<|image|>A photo of", images=[IMAGES[0]], **greedy)
    two = llm.generate("Listen: <|audio|>", audio=[CLIPS[1]], **greedy)
    # A batch takes the media in placeholder order over its rows.
    both = llm.generate(
        ["<|image|>A photo of", "Listen: <|audio|>"], images=[IMAGES[0]], audio=[CLIPS[1]], **greedy
    )
    assert both == [one, two]
    assert "".join(llm.stream("<|image|>A photo of", images=[IMAGES[0]], **greedy)) == one


def test_clear_errors(checkpoints, llm_checkpoint, tmp_path):
    llm = load_llm(checkpoints["e2b"])
    with pytest.raises(ValueError, match=r"0 image placeholder\(s\) \(<\|image\|>\) but 1 images"):
        llm.generate("No placeholder here", images=[IMAGES[0]])
    with pytest.raises(ValueError, match=r"2 audio placeholder\(s\).* but 1 audio clips"):
        llm.generate("<|audio|> and <|audio|>", audio=[CLIPS[0]])
    with pytest.raises(FileNotFoundError, match="image file not found"):
        llm.chat(user({"type": "image", "path": str(tmp_path / "missing.png")}))
    (tmp_path / "broken.png").write_text("not an image")
    with pytest.raises(ValueError, match="cannot read image file"):
        llm.chat(user({"type": "image", "url": f"file://{tmp_path / 'broken.png'}"}))
    with pytest.raises(ValueError, match="URLs are not fetched"):
        llm.chat(user({"type": "image", "url": "https://example.com/cat.png"}))
    (tmp_path / "broken.wav").write_bytes(b"RIFF\0\0\0\0WAVEjunk")
    with pytest.raises(ValueError, match="cannot read WAV file"):
        llm.chat(user({"type": "audio", "audio": str(tmp_path / "broken.wav")}))
    with pytest.raises(ValueError, match="no audio tower"):
        load_llm(checkpoints["31b"]).chat(user({"type": "audio", "audio": CLIPS[0]}))
    text_only = LLM(llm_checkpoint)
    with pytest.raises(ValueError, match="no vision tower"):
        text_only.generate("<|image|>", images=[IMAGES[0]])


# ── CLI ──────────────────────────────────────────────────────────────────────────────────────


@pytest.fixture(scope="module")
def media_files(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("media-files")
    IMAGES[0].save(root / "cat.png")
    with wave.open(str(root / "clip.wav"), "wb") as out:
        out.setnchannels(1)
        out.setsampwidth(2)
        out.setframerate(16000)
        out.writeframes((np.clip(CLIPS[0], -1, 1) * 32767).astype("<i2").tobytes())
    return {"image": root / "cat.png", "audio": root / "clip.wav"}


def test_cli_generate_with_media(checkpoints, media_files, capsys, monkeypatch):
    llm = load_llm(checkpoints["e2b"])
    image, audio = str(media_files["image"]), str(media_files["audio"])
    flags = ["--model", str(checkpoints["e2b"]), "--temperature", "0", "--max-new-tokens", "8"]
    # No placeholders in the prompt: one per file is appended.
    code, out, err = run(
        ["generate", *flags, "--image", image, "--audio", audio, "Describe:"], capsys, monkeypatch
    )
    assert code == 0, err
    expected = llm.generate(
        "Describe:<|image|><|audio|>", images=[image], audio=[audio], temperature=0, max_new_tokens=8
    )
    assert out == expected + "\n"
    # Placeholders where the prompt puts them, the same image twice.
    prompt = "<|image|> left, <|image|> right:"
    code, out, _ = run(["generate", *flags, "--image", image, "--image", image, prompt], capsys, monkeypatch)
    assert code == 0
    assert out == llm.generate(prompt, images=[image, image], temperature=0, max_new_tokens=8) + "\n"


def test_cli_chat_attaches_media_to_first_message(checkpoints, media_files, capsys, monkeypatch):
    llm = load_llm(checkpoints["e2b"])
    image = str(media_files["image"])
    argv = ["chat", "--model", str(checkpoints["e2b"]), "--temperature", "0", "--max-new-tokens", "6"]
    code, out, err = run([*argv, "--image", image], capsys, monkeypatch, stdin="What is it?\nAnd now?\n")
    assert code == 0, err
    greedy = dict(temperature=0, max_new_tokens=6)
    messages = user({"type": "image", "image": image}, text="What is it?")
    first = llm.chat(messages, **greedy)
    messages += [first.message, {"role": "user", "content": "And now?"}]
    second = llm.chat(messages, **greedy)
    assert out == f"{first.text}\n{second.text}\n"


def test_cli_media_errors(checkpoints, media_files, capsys, monkeypatch, tmp_path):
    argv = ["generate", "--model", str(checkpoints["31b"]), "--max-new-tokens", "2", "hi"]
    code, _, err = run([*argv, "--image", str(tmp_path / "nope.png")], capsys, monkeypatch)
    assert code == 2 and "image file not found" in err
    code, _, err = run([*argv, "--audio", str(media_files["audio"])], capsys, monkeypatch)
    assert code == 2 and "no audio tower" in err
    code, _, err = run(
        ["chat", "--model", str(checkpoints["31b"]), "--audio", str(tmp_path / "x.wav")],
        capsys,
        monkeypatch,
        stdin="hi\n",
    )
    assert code == 2 and "audio file not found" in err


def test_cli_help_documents_media(capsys):
    for command, phrase in (("generate", "appended at its end"), ("chat", "first user message")):
        with pytest.raises(SystemExit):
            main([command, "--help"])
        help_text = " ".join(capsys.readouterr().out.split())
        assert "--image PATH" in help_text and "--audio PATH" in help_text and phrase in help_text
