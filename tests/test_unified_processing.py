"""gemma4_unified preprocessing against transformers 5.23's own code (tests/unified_reference.py):
``Gemma4UnifiedImageProcessor`` and ``Gemma4UnifiedVideoProcessor`` (torch.equal on every output)
and their resize rule."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from torchgemma.processing import image_resize_target
from torchgemma.processing.unified import process_unified_images
from unified_reference import reference_image_processor_class, reference_video_processor_class
from video_reference import moving_frames

pytestmark = pytest.mark.usefixtures("one_thread")

BUDGETS = (70, 140, 280, 560, 1120)
# (patch_size, pooling_kernel_size): the 12B's, and the tiny test checkpoints'.
GEOMETRIES = [(16, 3), (4, 2)]


@pytest.fixture(scope="module")
def reference_class():
    with pytest.MonkeyPatch.context() as monkeypatch:
        yield reference_image_processor_class(monkeypatch)


def noise(shape, seed=0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, shape, dtype=np.uint8)


def assert_same(ours: dict, theirs) -> None:
    assert ours["pixel_values"].dtype == theirs["pixel_values"].dtype == torch.float32
    assert ours["image_position_ids"].dtype == theirs["image_position_ids"].dtype
    assert torch.equal(ours["pixel_values"], theirs["pixel_values"])
    assert torch.equal(ours["image_position_ids"], theirs["image_position_ids"])
    assert ours["num_soft_tokens"] == theirs["num_soft_tokens_per_image"].tolist()


@pytest.mark.parametrize("geometry", GEOMETRIES, ids=str)
def test_resize_target_matches_reference(geometry):
    from transformers.models.gemma4_unified.processing_gemma4_unified import get_aspect_ratio_preserving_size

    patch, k = geometry
    rng = np.random.default_rng(1)
    sizes = [(int(h), int(w)) for h, w in rng.integers(1, 5000, (300, 2))]
    sizes += [(1, 1), (3, 7), (10, 10000), (5000, 12), (1, 60000), (48, 48), (768, 1024)]
    for budget in BUDGETS:
        for h, w in sizes:
            ours = image_resize_target(h, w, budget, side_multiple=patch * k)
            ref = get_aspect_ratio_preserving_size(h, w, patch, budget * k * k, k)
            assert (ours.height, ours.width) == ref, (h, w, budget)


@pytest.mark.parametrize("geometry", GEOMETRIES, ids=str)
@pytest.mark.parametrize("budget", [70, 280])
def test_pixels_match_reference(reference_class, geometry, budget):
    patch, k = geometry
    reference = reference_class(patch_size=patch, pooling_kernel_size=k, max_soft_tokens=budget)
    # Upscaled, downscaled, already a multiple of the model patch (no resize), elongated.
    side = patch * k
    shapes = [(100, 150, 3), (37, 23, 3), (3 * side, 2 * side, 3), (20, 900, 3), (700, 500, 3)]
    images = [noise(shape, seed=i) for i, shape in enumerate(shapes)]
    ours = process_unified_images(images, budget, patch_size=patch, pooling_kernel_size=k)
    theirs = reference(images=images, return_tensors="pt")
    assert_same(ours, theirs)
    assert len(set(ours["num_soft_tokens"])) > 2


def test_input_layouts_match_reference(reference_class):
    """PIL modes (RGBA / LA / P with transparency over white, L), arrays HW, CHW, HWC 1/3/4 channels,
    HW, an ambiguous (3, H, 3) array (read as CHW), a tensor, a 4-D batch."""
    reference = reference_class(patch_size=4, pooling_kernel_size=2, max_soft_tokens=70)
    rgba = noise((30, 41, 4), seed=1)
    palette = Image.fromarray(noise((25, 33), seed=2), mode="L").convert("P")
    palette.info["transparency"] = 7
    images = [
        Image.fromarray(rgba, mode="RGBA"),
        Image.fromarray(noise((30, 41, 2), seed=3), mode="LA"),
        palette,
        Image.fromarray(noise((19, 64), seed=4), mode="L"),
        noise((1, 26, 18), seed=5),
        noise((3, 40, 28), seed=6),
        noise((40, 28, 1), seed=7),
        rgba,
        noise((4, 30, 50), seed=8),
        noise((3, 44, 3), seed=9),
        torch.from_numpy(noise((3, 50, 31), seed=10)),
    ]
    for image in images:
        ours = process_unified_images(image, 70, patch_size=4, pooling_kernel_size=2)
        assert_same(ours, reference(images=[image], return_tensors="pt"))
    # A 2-D array is one grey channel (the reference's list handling wants 3-D arrays).
    gray = noise((26, 18), seed=5)
    ours = process_unified_images(gray, 70, patch_size=4, pooling_kernel_size=2)
    assert_same(ours, reference(images=[gray[None]], return_tensors="pt"))
    batch = noise((2, 30, 45, 3), seed=11)
    ours = process_unified_images(batch, 70, patch_size=4, pooling_kernel_size=2)
    assert_same(ours, reference(images=list(batch), return_tensors="pt"))


def test_files_decode_as_pil(tmp_path):
    path = tmp_path / "image.png"
    array = noise((33, 50, 3), seed=12)
    Image.fromarray(array).save(path)
    ours = process_unified_images(path, 70, patch_size=4, pooling_kernel_size=2)
    from_array = process_unified_images(array, 70, patch_size=4, pooling_kernel_size=2)
    assert torch.equal(ours["pixel_values"], from_array["pixel_values"])


def test_bad_images_are_named():
    with pytest.raises(ValueError, match="uint8"):
        process_unified_images(np.zeros((20, 20, 3), dtype=np.float32))
    with pytest.raises(ValueError, match="1, 3 or 4 channels"):
        process_unified_images(noise((20, 20, 2)))
    with pytest.raises(ValueError, match="max_soft_tokens"):
        process_unified_images(noise((20, 20, 3)), 100)
    with pytest.raises(ValueError, match="empty"):
        process_unified_images(noise((0, 20, 3)))
    with pytest.raises(FileNotFoundError):
        process_unified_images("/no/such/image.png")


@pytest.mark.parametrize("geometry", GEOMETRIES, ids=str)
def test_video_frames_match_reference(geometry):
    from torchgemma.processing.video import process_videos

    patch, k = geometry
    with pytest.MonkeyPatch.context() as monkeypatch:
        reference = reference_video_processor_class(monkeypatch)(
            patch_size=patch, pooling_kernel_size=k, max_soft_tokens=70, num_frames=4
        )
        videos = [moving_frames(10, 100, 150, seed=1), moving_frames(6, 40, 200, seed=2)]
        theirs = reference(videos=videos, return_tensors="pt")
    ours = process_videos(
        videos, num_frames=4, max_soft_tokens=70, patch_size=patch * k, pooling_kernel_size=1
    )
    for name in ("pixel_values_videos", "video_position_ids", "num_frames_per_video"):
        assert ours[name].dtype == theirs[name].dtype, name
        assert torch.equal(ours[name], theirs[name]), name
    assert ours["num_soft_tokens"] == theirs["num_soft_tokens_per_video"].tolist()
