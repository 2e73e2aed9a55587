"""The processor: one request in (a prompt or messages, media, tools, thinking), one unpadded
sequence of ids and its media out; without loading a model."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from llm_fixtures import build_media_llm_checkpoint
from torchgemma.config import ModelConfig
from torchgemma.model.inputs import MediaInputs
from torchgemma.processing.processor import ProcessedPrompt, Processor
from torchgemma.replies import forced_call_prefix
from torchgemma.tokenizer import load_tokenizer

MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "What is the weather like in Paris?"},
]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}


def processor_of(folder) -> Processor:
    return Processor(load_tokenizer(folder), ModelConfig.from_file(folder), folder)


@pytest.fixture(scope="module")
def text_processor(llm_checkpoint) -> Processor:
    return processor_of(llm_checkpoint)


@pytest.fixture(scope="module")
def hf_tokenizer(llm_checkpoint):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(llm_checkpoint)


@pytest.fixture(scope="module")
def media_processor(tmp_path_factory) -> Processor:
    return processor_of(build_media_llm_checkpoint(tmp_path_factory.mktemp("proc") / "e2b-mm", False, 5))


def image(seed: int, size=(40, 56)) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (*size, 3), dtype=np.uint8)


def test_chat_request_is_the_templates_ids(text_processor, hf_tokenizer):
    for thinking in (False, True):
        expected = hf_tokenizer.apply_chat_template(
            MESSAGES, tools=[WEATHER], add_generation_prompt=True, enable_thinking=thinking
        )["input_ids"]
        prompt = text_processor.chat(MESSAGES, enable_thinking=thinking, tools=[WEATHER])
        assert prompt == ProcessedPrompt(expected, MediaInputs())
        assert not prompt.media


def test_raw_prompt_gets_bos_once(text_processor, hf_tokenizer):
    expected = [2, *hf_tokenizer("The quick brown fox")["input_ids"]]
    assert text_processor("The quick brown fox").input_ids == expected
    assert text_processor("<bos>The quick brown fox").input_ids == expected
    assert text_processor(expected).input_ids == expected  # ids pass as they are


def test_forced_reply_prefix_follows_the_generation_prompt(text_processor, hf_tokenizer):
    template = hf_tokenizer.apply_chat_template(MESSAGES, tools=[WEATHER], add_generation_prompt=True)
    for name in (None, "get_weather"):
        prefix = forced_call_prefix(name)
        ids = text_processor.render_chat(MESSAGES, tools=[WEATHER], reply_prefix=prefix)
        assert ids[: len(template["input_ids"])] == template["input_ids"]
        assert text_processor.tokenizer.decode(ids[len(template["input_ids"]) :]) == prefix
    assert forced_call_prefix() == "<|tool_call>call:"
    assert forced_call_prefix("get_weather") == "<|tool_call>call:get_weather{"


def test_a_text_model_refuses_media_by_name(text_processor):
    with pytest.raises(ValueError, match="no vision tower torchgemma builds"):
        text_processor("<|image|>A photo of", images=[image(0)])
    with pytest.raises(ValueError, match="no audio tower"):
        text_processor("<|audio|>", audio=[np.zeros(1600, np.float32)])
    assert not text_processor.takes_audio


def test_media_request_is_unpadded_and_equals_its_row_of_a_batch(media_processor):
    """One request: placeholders expanded, mm_token_type_ids (1, L), no padding; the same as its row
    when several prompts are expanded together (as generate batches them)."""
    short = media_processor("<|image|>A")
    long = media_processor("<|image|>A photo of a cat, said the long prompt")
    one = media_processor(short.input_ids, images=[image(1)])
    two = media_processor(long.input_ids, images=[image(2, (64, 32))])
    assert media_processor.takes_audio
    for single in (one, two):
        types = single.media.mm_token_type_ids
        assert types.shape == (1, len(single.input_ids)) and types.dtype == torch.long
        image_id = media_processor.tokenizer.image_id
        assert types[0].tolist() == [int(t == image_id) for t in single.input_ids]
        assert 0 < single.input_ids.count(image_id) <= media_processor.max_soft_tokens
    batch = media_processor.expand([short.input_ids, long.input_ids], [image(1), image(2, (64, 32))])
    assert batch.input_ids == [one.input_ids, two.input_ids]  # unpadded rows
    assert batch.mm_token_type_ids == [p.media.mm_token_type_ids[0].tolist() for p in (one, two)]
    for name in ("pixel_values", "image_position_ids"):
        assert torch.equal(batch.media[name], torch.cat([getattr(one.media, name), getattr(two.media, name)]))


def test_chat_media_come_from_the_content_items(media_processor):
    content = [{"type": "image", "image": image(3)}, {"type": "text", "text": "What?"}]
    messages = [{"role": "user", "content": content}]
    prompt = media_processor.chat(messages)
    ids = media_processor.chat_ids(messages)  # one placeholder per item, not expanded
    assert ids.count(media_processor.tokenizer.image_id) == 1
    expected = media_processor.process(ids, images=[image(3)])
    assert prompt.input_ids == expected.input_ids
    assert torch.equal(prompt.media.pixel_values, expected.media.pixel_values)
    with pytest.raises(ValueError, match="1 image placeholder"):
        media_processor.process(ids, images=[image(3), image(4)])


def test_placeholder_is_the_token_the_prompt_expands(media_processor):
    """Gemma 4's placeholders are the tokenizer's image/audio/video tokens; other kinds are refused."""
    tokenizer = media_processor.tokenizer
    assert media_processor.placeholder("image") == tokenizer.id_to_token(tokenizer.image_id) == "<|image|>"
    assert media_processor.placeholder("audio") == tokenizer.id_to_token(tokenizer.audio_id)
    with pytest.raises(ValueError, match="kind must be 'image', 'audio' or 'video', got 'pdf'"):
        media_processor.placeholder("pdf")
