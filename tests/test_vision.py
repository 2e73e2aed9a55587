"""The vision tower alone against transformers 5.23's Gemma4VisionModel (eager attention)."""

import numpy as np
import pytest
import torch

from checkpoints import LARGE_VISION, ON_DEVICE_VISION, randomize_, tighten_clip_bounds_
from torchgemma import process_images
from torchgemma.config import _vision_config_from_hf
from torchgemma.model.vision import VisionTower

DTYPES = [torch.float32, torch.bfloat16]


def tower_pair(settings: dict, dtype, tmp_path, seed=0):
    """The reference tower (saved, then loaded in ``dtype`` as from_pretrained does) and ours."""
    from transformers import Gemma4VisionConfig, Gemma4VisionModel

    config = Gemma4VisionConfig(**settings)
    torch.manual_seed(seed)
    reference = Gemma4VisionModel(config)
    randomize_(reference, seed)
    if settings.get("use_clipped_linears"):
        tighten_clip_bounds_(reference, seed)
    reference.save_pretrained(tmp_path)
    reference = Gemma4VisionModel.from_pretrained(tmp_path, dtype=dtype, attn_implementation="eager").eval()
    ours = VisionTower(_vision_config_from_hf(config.to_dict()), attention="eager")
    # Our module paths are the checkpoint's names: the reference state dict loads as is.
    ours.load_state_dict(reference.state_dict(), strict=True)
    return reference, ours.to(dtype).eval()


def compare(reference, ours, pixels, positions, dtype):
    with torch.no_grad():
        theirs = reference(pixel_values=pixels, pixel_position_ids=positions).last_hidden_state
        mine = ours(pixels, positions)
    assert mine.dtype == theirs.dtype == dtype and mine.shape == theirs.shape
    diff = (mine.float() - theirs.float()).abs().max().item()
    if dtype == torch.bfloat16:
        assert torch.equal(mine, theirs), f"bf16 differs: max |Δ| = {diff}"
    else:
        assert diff <= 1e-5
    return mine


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_on_device_tower_on_processed_images(dtype, tmp_path):
    """Clipped linears, 16 px patches pooled 3x3, images of three sizes from our processor."""
    reference, ours = tower_pair(ON_DEVICE_VISION, dtype, tmp_path)
    rng = np.random.default_rng(1)
    images = [rng.integers(0, 256, size, dtype=np.uint8) for size in [(60, 90, 3), (100, 40, 3), (48, 48, 3)]]
    inputs = process_images(images, max_soft_tokens=70)
    out = compare(reference, ours, inputs["pixel_values"], inputs["image_position_ids"], dtype)
    assert out.shape == (sum(inputs["num_soft_tokens"]), ON_DEVICE_VISION["hidden_size"])


def hand_built(grids, max_patches, patch, seed):
    gen = torch.Generator().manual_seed(seed)
    pixels = torch.zeros(len(grids), max_patches, 3 * patch * patch)
    positions = torch.full((len(grids), max_patches, 2), -1, dtype=torch.long)
    for i, (rows, cols) in enumerate(grids):
        y, x = torch.meshgrid(torch.arange(rows), torch.arange(cols), indexing="ij")
        pixels[i, : rows * cols] = torch.rand(rows * cols, 3 * patch * patch, generator=gen)
        positions[i, : rows * cols] = torch.stack((x.flatten(), y.flatten()), -1)
    return pixels, positions


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kv_heads", [4, 2])
def test_large_tower_standardize(dtype, kv_heads, tmp_path):
    """Standardised soft tokens, head_dim 12 (not a power of two), with and without grouped KV heads."""
    reference, ours = tower_pair({**LARGE_VISION, "num_key_value_heads": kv_heads}, dtype, tmp_path, seed=2)
    pixels, positions = hand_built([(4, 6), (8, 8), (2, 10)], 64, LARGE_VISION["patch_size"], seed=5)
    compare(reference, ours, pixels, positions, dtype)
    # One image filling its budget exactly: no padding, so no attention mask at all.
    compare(reference, ours, pixels[1:2], positions[1:2], dtype)


def test_padding_patches_do_not_change_an_image(tmp_path):
    """The same image with more padding patches gives the same soft tokens (keys are masked)."""
    _, ours = tower_pair(LARGE_VISION, torch.float32, tmp_path, seed=3)
    pixels, positions = hand_built([(4, 6)], 24, LARGE_VISION["patch_size"], seed=6)
    padded_pixels = torch.cat((pixels, torch.rand(1, 40, pixels.shape[-1])), 1)
    padded_positions = torch.cat((positions, torch.full((1, 40, 2), -1)), 1)
    with torch.no_grad():
        torch.testing.assert_close(ours(padded_pixels, padded_positions), ours(pixels, positions))
