"""Checkpoints that `LLM` opens as a user's folder would be: weights, the fixture tokenizer,
Gemma 4's generation_config.json, and for media models a processor_config.json.

`llm_checkpoint` (a tiny E2B-like text checkpoint, built once per session and worker) is registered
for every test file by conftest.py; the builders below make the variants some tests need.
"""

from __future__ import annotations

import io
import json
import sys
from pathlib import Path

import pytest
import torch

from checkpoints import COMMON, STYLES, build_media_chat_checkpoint, randomize_
from tokenizer_fixtures import VOCAB_SIZE, gemma4_vocab, write_gemma4_tokenizer

# Gemma 4's published generation_config.json (reference §5.4).
GEMMA4_GENERATION_CONFIG = {
    "bos_token_id": 2,
    "pad_token_id": 0,
    "eos_token_id": [1, 106, 50],
    "do_sample": True,
    "temperature": 1.0,
    "top_k": 64,
    "top_p": 0.95,
}

# The smallest image budget keeps media prompts short.
SOFT_TOKENS = 70


def build_llm_checkpoint(folder: Path, style: str = "e2b", *, seed: int = 0, **overrides) -> Path:
    """A tiny checkpoint whose vocabulary covers the test tokenizer, with tokenizer files and
    Gemma 4's generation_config.json beside the weights."""
    from transformers import Gemma4ForCausalLM, Gemma4TextConfig

    fields = {**COMMON, **STYLES[style], "vocab_size": VOCAB_SIZE, **overrides}
    if fields.get("hidden_size_per_layer_input"):
        fields["vocab_size_per_layer_input"] = VOCAB_SIZE
    torch.manual_seed(seed)
    model = Gemma4ForCausalLM(Gemma4TextConfig(**fields))
    randomize_(model, seed)
    with torch.no_grad():
        # Large tied embeddings make every token predict itself; smaller ones give varied text.
        model.model.embed_tokens.weight.mul_(0.1)
    model.save_pretrained(folder)
    write_gemma4_tokenizer(folder)
    (folder / "generation_config.json").write_text(json.dumps(GEMMA4_GENERATION_CONFIG))
    return folder


@pytest.fixture(scope="session")
def llm_checkpoint(tmp_path_factory) -> Path:
    """`build_llm_checkpoint`'s default: E2B style, seed 0 (read-only: copy or link to change it)."""
    return build_llm_checkpoint(tmp_path_factory.mktemp("llm") / "tiny-e2b-it")


def config_variant(source: Path, folder: Path, **config_changes) -> Path:
    """A copy of a checkpoint folder (files linked) with config.json fields changed."""
    folder.mkdir()
    for f in source.iterdir():
        if f.name != "config.json":
            (folder / f.name).symlink_to(f)
    config = json.loads((source / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, **config_changes}))
    return folder


def media_token_ids() -> dict[str, int]:
    """The fixture tokenizer's media tokens, under transformers' Gemma4Config field names."""
    vocab, _ = gemma4_vocab()
    names = {
        "boi_token_id": "<|image>",
        "eoi_token_id": "<image|>",
        "image_token_id": "<|image|>",
        "audio_token_id": "<|audio|>",
        "boa_token_id": "<|audio>",
        "eoa_token_index": "<audio|>",  # sic: transformers' Gemma4Config field name
        "video_token_id": "<|video|>",
    }
    return {field: vocab[token] for field, token in names.items()}


def image_processor():
    """transformers' Gemma 4 image processor (the PIL one: no torchvision here) at SOFT_TOKENS."""
    from transformers.models.gemma4.image_processing_pil_gemma4 import Gemma4ImageProcessorPil

    return Gemma4ImageProcessorPil(max_soft_tokens=SOFT_TOKENS)


def build_media_llm_checkpoint(folder: Path, large: bool, seed: int) -> Path:
    """A tiny ``gemma4`` checkpoint with the fixture tokenizer's vocabulary (media tokens at its end,
    as in the real layout): E2B-like towers for images and audio, or (large) the 26B/31B-like vision
    tower alone; tokenizer, generation_config.json and processor_config.json beside the weights."""

    build_media_chat_checkpoint(
        folder, vocab_size=VOCAB_SIZE, media_token_ids=media_token_ids(), large=large, seed=seed
    )
    write_gemma4_tokenizer(folder)
    (folder / "generation_config.json").write_text(json.dumps(GEMMA4_GENERATION_CONFIG))
    (folder / "processor_config.json").write_text(json.dumps(processor_config(), default=str))
    return folder


def processor_config() -> dict:
    """What Gemma4Processor.save_pretrained writes (it cannot save here: no torchvision, no video processor)."""
    from transformers import Gemma4AudioFeatureExtractor

    return {
        "processor_class": "Gemma4Processor",
        "image_processor": image_processor().to_dict(),
        "feature_extractor": Gemma4AudioFeatureExtractor().to_dict(),
        "image_seq_length": 280,
        "audio_seq_length": 750,
    }


@pytest.fixture(scope="session")
def media_llm_checkpoints(tmp_path_factory) -> dict[str, Path]:
    """`build_media_llm_checkpoint`'s two: "e2b" with image and audio towers (seed 31), "31b" with
    the large vision tower alone (seed 32). Read-only."""
    root = tmp_path_factory.mktemp("media-llm")
    return {
        "e2b": build_media_llm_checkpoint(root / "e2b-omni-it", large=False, seed=31),
        "31b": build_media_llm_checkpoint(root / "31b-vision-it", large=True, seed=32),
    }


def run_cli(argv, capsys, monkeypatch, stdin=None) -> tuple[int, str, str]:
    """`torchgemma <argv>` in-process: exit code, stdout, stderr (stdin given as text if set)."""
    from torchgemma.cli import main

    if stdin is not None:
        monkeypatch.setattr(sys, "stdin", io.StringIO(stdin))
    code = main(argv)
    out, err = capsys.readouterr()
    return code, out, err
