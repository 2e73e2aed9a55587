"""Gemma 3's mmproj GGUF (llama.cpp's file for the SigLIP tower and projector) against the checkpoint
it was converted from: tests/data/gemma3_mmproj/ holds llama.cpp's own conversion of a tiny
checkpoint (see make_fixture.py there) and the checkpoint's vision tensors."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from torchgemma import ModelConfig
from torchgemma.model.gemma import Gemma
from torchgemma.weights.gguf.gemma3_mmproj import module_path, read_gemma3_mmproj
from torchgemma.weights.gguf.reader import GGUFError

DATA = Path(__file__).parent / "data" / "gemma3_mmproj"


def test_mmproj_reads_as_the_checkpoint():
    from safetensors.torch import load_file

    config = ModelConfig.from_file(DATA / "config.json")
    tower_config, tensors = read_gemma3_mmproj(DATA / "mmproj.gguf")
    assert tower_config == config.siglip_vision
    expected = {config.module_path(k): v for k, v in load_file(DATA / "vision.safetensors").items()}
    assert sorted(tensors) == sorted(expected)
    for name, tensor in tensors.items():
        assert torch.equal(tensor, expected[name]), name


@pytest.mark.slow
def test_mmproj_tower_gives_transformers_soft_tokens():
    """The tower loaded from the mmproj file turns images into transformers' soft tokens."""
    from safetensors.torch import load_file
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    config = ModelConfig.from_file(DATA / "config.json")
    _, tensors = read_gemma3_mmproj(DATA / "mmproj.gguf")
    model = Gemma(config, attention="eager")
    state = {
        k: v
        for k, v in model.state_dict().items()
        if not k.startswith(("vision_tower.", "multi_modal_projector."))
    }
    model.load_state_dict({**state, **tensors}, strict=True)
    reference_config = Gemma3Config.from_pretrained(DATA)
    reference = Gemma3ForConditionalGeneration._from_config(
        reference_config, attn_implementation="eager"
    ).eval()
    # The fixture holds the tower and projector alone: each loads strictly into its module.
    vision = load_file(DATA / "vision.safetensors")
    for name in ("vision_tower", "multi_modal_projector"):
        part = {k.removeprefix(f"{name}."): v for k, v in vision.items() if k.startswith(f"{name}.")}
        getattr(reference.model, name).load_state_dict(part, strict=True)
    assert all(k.startswith(("vision_tower.", "multi_modal_projector.")) for k in vision)
    pixels = torch.randn(2, 3, 42, 42, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = model.image_features(pixels, None)
        theirs = reference.model.get_image_features(pixels).pooler_output
    assert torch.equal(ours, theirs.reshape(-1, theirs.shape[-1]))


def test_names_outside_the_tower_are_refused():
    assert module_path("v.blk.3.ffn_down.bias") == "vision_tower.encoder.layers.3.mlp.fc2.bias"
    with pytest.raises(GGUFError, match="not part of Gemma 3's vision tower"):
        module_path("v.blk.0.ffn_gate.weight")
