"""The audio tower alone against transformers 5.23's Gemma4AudioModel (eager, its only kernel)."""

import numpy as np
import pytest
import torch

from checkpoints import ON_DEVICE_AUDIO, randomize_, tighten_clip_bounds_
from torchgemma import process_audio
from torchgemma.config import _audio_config_from_hf
from torchgemma.model.audio import AudioTower

DTYPES = [torch.float32, torch.bfloat16]

# The transformers test suite's tiny tower (reference notes §7.5): 16 mel bins, small chunks.
SMALL_CHUNKS = dict(
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    subsampling_conv_channels=[16, 8],
    conv_kernel_size=3,
    attention_chunk_size=4,
    attention_context_left=5,
    attention_context_right=0,
    output_proj_dims=24,
    use_clipped_linears=True,
)


def tower_pair(settings: dict, dtype, tmp_path, seed=0):
    """The reference tower (saved, then loaded in ``dtype`` as from_pretrained does) and ours."""
    from transformers import Gemma4AudioConfig, Gemma4AudioModel

    config = Gemma4AudioConfig(**settings)
    torch.manual_seed(seed)
    reference = Gemma4AudioModel(config)
    randomize_(reference, seed)
    if settings.get("use_clipped_linears"):
        tighten_clip_bounds_(reference, seed)
    reference.save_pretrained(tmp_path)
    reference = Gemma4AudioModel.from_pretrained(tmp_path, dtype=dtype).eval()
    ours = AudioTower(_audio_config_from_hf(config.to_dict()))
    # Our module paths are the checkpoint's names: the reference state dict loads as is.
    ours.load_state_dict(reference.state_dict(), strict=True)
    return reference, ours.to(dtype).eval()


def compare(reference, ours, features, mask, dtype):
    with torch.no_grad():
        theirs = reference(features, mask)
        frames, valid = ours(features, mask)
    assert torch.equal(valid, theirs.attention_mask)
    expected = theirs.last_hidden_state
    assert frames.dtype == expected.dtype == dtype and frames.shape == expected.shape
    diff = (frames.float() - expected.float()).abs().max().item()
    if dtype == torch.bfloat16:
        assert torch.equal(frames, expected), f"bf16 differs: max |Δ| = {diff}"
    else:
        assert diff <= 1e-5
    return valid


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_published_geometry_on_processed_clips(dtype, tmp_path):
    """Chunks of 12, 12 keys back; 128 mel bins from our processor; clips of three lengths."""
    reference, ours = tower_pair(ON_DEVICE_AUDIO, dtype, tmp_path)
    rng = np.random.default_rng(2)
    clips = [0.1 * rng.standard_normal(n).astype(np.float32) for n in (8000, 16000, 5000)]
    inputs = process_audio(clips)
    valid = compare(reference, ours, inputs["input_features"], inputs["input_features_mask"], dtype)
    # The soft tokens per clip are the valid mel frames at indices divisible by 4.
    assert valid.sum(-1).tolist() == inputs["input_features_mask"][:, ::4].sum(-1).tolist()


def hand_built(lengths, frames, bins=16, seed=0):
    gen = torch.Generator().manual_seed(seed)
    mask = torch.arange(frames)[None] < torch.tensor(lengths)[:, None]
    features = torch.randn(len(lengths), frames, bins, generator=gen) * mask[..., None]
    return features, mask


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("right", [0, 2], ids=["causal", "lookahead"])
def test_small_chunks(dtype, right, tmp_path):
    """Chunks of 4 frames (several per clip), with and without right context."""
    settings = {**SMALL_CHUNKS, "attention_context_right": right}
    reference, ours = tower_pair(settings, dtype, tmp_path, seed=1)
    features, mask = hand_built([57, 30, 9], frames=57, seed=3)
    compare(reference, ours, features, mask, dtype)
