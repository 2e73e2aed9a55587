"""Image preprocessing against transformers' Gemma4ImageProcessorPil (torch.equal on every output)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from torchgemma.processing import image_resize_target, process_images

transformers = pytest.importorskip("transformers")
from transformers.models.gemma4.image_processing_pil_gemma4 import (  # noqa: E402
    Gemma4ImageProcessorPil,
    get_aspect_ratio_preserving_size,
)

transformers.logging.set_verbosity_error()  # the reference warns about ambiguous channel layouts
BUDGETS = (70, 140, 280, 560, 1120)


@pytest.fixture(scope="module")
def reference():
    return Gemma4ImageProcessorPil()


def noise(height: int, width: int, channels: int = 3, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    shape = (height, width, channels) if channels else (height, width)
    return rng.integers(0, 256, shape, dtype=np.uint8)


def photo(height: int, width: int, seed: int = 0) -> np.ndarray:
    """Smooth gradients plus mild noise: closer to a real photo than pure noise."""
    y, x = np.mgrid[0:height, 0:width].astype(np.float64)
    base = np.stack([x / max(width, 1), y / max(height, 1), 0.5 + 0.5 * np.sin(x / 7 + y / 11)], axis=-1)
    base += np.random.default_rng(seed).normal(0, 0.03, base.shape)
    return (np.clip(base, 0, 1) * 255).astype(np.uint8)


def assert_same(ours: dict, ref) -> None:
    assert torch.equal(ours["pixel_values"], torch.from_numpy(np.asarray(ref["pixel_values"])))
    assert torch.equal(ours["image_position_ids"], torch.from_numpy(np.asarray(ref["image_position_ids"])))
    assert ours["num_soft_tokens"] == list(ref["num_soft_tokens_per_image"])
    assert ours["pixel_values"].dtype == torch.float32
    assert ours["image_position_ids"].dtype == torch.int64


# --- Resize rule ------------------------------------------------------------------------------------


def test_resize_target_matches_reference_on_many_sizes():
    rng = np.random.default_rng(1)
    sizes = [(int(h), int(w)) for h, w in rng.integers(1, 6000, (400, 2))]
    sizes += [(1, 1), (3, 7), (20, 20), (10, 10000), (5000, 12), (1, 60000), (60000, 1), (768, 768)]
    for budget in BUDGETS:
        for h, w in sizes:
            ours = image_resize_target(h, w, budget)
            ref = get_aspect_ratio_preserving_size(
                h, w, patch_size=16, max_patches=budget * 9, pooling_kernel_size=3
            )
            assert (ours.height, ours.width) == ref, (h, w, budget)
            assert ours.num_soft_tokens == (ref[0] // 48) * (ref[1] // 48) <= budget


def test_resize_target_documented_examples():
    assert image_resize_target(768, 1024) == (672, 912, 266)
    assert image_resize_target(896, 896, 70) == (384, 384, 64)
    assert image_resize_target(896, 896, 1120) == (1584, 1584, 1089)
    assert image_resize_target(10, 10000) == (48, 13440, 280)


# --- Pixels: sizes, aspect ratios, budgets -----------------------------------------------------------

SIZES = [(1, 1), (3, 7), (20, 20), (10, 10000), (5000, 12), (480, 640), (768, 768), (1080, 1920), (47, 2000)]


@pytest.fixture(scope="module")
def sized_images() -> list[Image.Image]:
    return [
        Image.fromarray(photo(h, w, i) if h * w > 10_000 else noise(h, w, seed=i))
        for i, (h, w) in enumerate(SIZES)
    ]


@pytest.mark.parametrize("budget", BUDGETS)
def test_pil_images_match_reference(reference, sized_images, budget):
    for image in sized_images:
        assert_same(process_images(image, max_soft_tokens=budget), reference(image, max_soft_tokens=budget))


def test_batch_of_mixed_sizes_pads_each_image(reference):
    images = [Image.fromarray(noise(h, w, seed=h)) for h, w in [(300, 500), (17, 900), (768, 768)]]
    ours = process_images(images)
    assert_same(ours, reference(images))
    assert ours["pixel_values"].shape == (3, 2520, 768)
    n = ours["num_soft_tokens"][1] * 9
    assert (ours["image_position_ids"][1, n:] == -1).all() and (ours["pixel_values"][1, n:] == 0).all()


def test_patch_order_and_layout():
    # 336x480 is already the size for 70 soft tokens, so pixels are not resampled: 21x30 patches.
    rows, cols = np.mgrid[0:336, 0:480]
    pixels = np.stack([rows // 16, cols // 16, (rows % 16) * 16 + cols % 16], axis=-1).astype(np.uint8)
    out = process_images(pixels, max_soft_tokens=70)
    assert out["num_soft_tokens"] == [70]
    values = (out["pixel_values"][0] * 255).round().long().view(630, 16, 16, 3)  # (patch, py, px, c)
    positions = out["image_position_ids"][0]
    assert positions.tolist() == [[c, r] for r in range(21) for c in range(30)]  # row-major, (x, y)
    assert (values[..., 0] == positions[:, 1, None, None]).all()
    assert (values[..., 1] == positions[:, 0, None, None]).all()
    assert (values[..., 2] == torch.arange(256).view(1, 16, 16)).all()


# --- Input kinds and colour conversion ----------------------------------------------------------------


def test_numpy_inputs_match_reference(reference):
    hwc = noise(33, 71)
    assert_same(process_images(hwc), reference(hwc, input_data_format="channels_last"))
    ambiguous = noise(3, 7)  # (3, 7, 3): read as HWC here; the reference must be told
    assert_same(process_images(ambiguous), reference(ambiguous, input_data_format="channels_last"))
    gray = noise(40, 30, channels=0)  # HW: the reference only takes HW1
    assert_same(process_images(gray), reference(gray[..., None], input_data_format="channels_last"))
    rgba = noise(40, 30, channels=4)  # composited on white with numpy rounding
    assert_same(process_images(rgba), reference(rgba, input_data_format="channels_last"))
    ints = hwc.astype(np.int64)
    assert_same(process_images(ints), reference(ints, input_data_format="channels_last"))
    chw = np.ascontiguousarray(np.moveaxis(hwc, -1, 0))
    assert_same(process_images(chw), reference(chw, input_data_format="channels_first"))
    assert_same(process_images(torch.from_numpy(hwc)), reference(hwc, input_data_format="channels_last"))
    batch = np.stack([hwc, hwc[::-1]])  # a 4-D array is a batch of same-size images
    assert_same(process_images(batch), reference(batch, input_data_format="channels_last"))


@pytest.mark.parametrize("size", [(33, 71), (768, 768)])  # resized, and already at the target size
def test_float_arrays_match_reference_without_its_rescale(reference, size):
    # The reference would divide [0, 1] floats by 255 a second time; do_rescale=False is its
    # correct use for such input.
    image = np.random.default_rng(2).random((*size, 3), dtype=np.float32)
    ref = reference(image, do_rescale=False, input_data_format="channels_last")
    assert_same(process_images(image), ref)
    rgba = np.random.default_rng(3).random((*size, 4), dtype=np.float32)
    ref = reference(rgba, do_rescale=False, input_data_format="channels_last")
    assert_same(process_images(rgba), ref)


@pytest.mark.parametrize(
    "mode", ["L", "LA", "RGBA", "P", "PA", "CMYK", "I;16", "I", "F", "1", "YCbCr", "RGBX"]
)
def test_pil_modes_match_reference(reference, mode):
    rgba = Image.fromarray(noise(37, 53, channels=4, seed=5), "RGBA")
    if mode == "I;16":
        image = Image.fromarray(np.asarray(rgba)[..., 0].astype(np.uint16) * 257)
    else:
        image = rgba.convert(mode)
    if mode == "P":
        image.info["transparency"] = 3  # palette transparency counts as alpha too
    assert image.mode == mode
    assert_same(process_images(image), reference(image))


def _save(image: Image.Image, path, **kwargs) -> str:
    image.save(path, **kwargs)
    return str(path)


def test_files_match_reference(reference, tmp_path):
    rgba = Image.fromarray(noise(61, 45, channels=4, seed=6), "RGBA")
    palette = rgba.convert("P")
    palette.info["transparency"] = 0
    rotated = Image.fromarray(photo(120, 200))
    exif = rotated.getexif()
    exif[0x0112] = 6  # orientation: rotate 90 degrees on load
    paths = [
        _save(rgba, tmp_path / "alpha.png"),  # path loading drops alpha instead of compositing
        _save(Image.fromarray(photo(300, 500)), tmp_path / "photo.jpg", quality=90),
        _save(Image.fromarray(noise(50, 70, channels=0).astype(np.uint16) * 200), tmp_path / "deep.png"),
        _save(palette, tmp_path / "palette.png"),
        _save(Image.fromarray(photo(64, 96)).convert("CMYK"), tmp_path / "cmyk.jpg"),
        _save(rotated, tmp_path / "rotated.jpg", exif=exif),
        _save(Image.fromarray(noise(20, 30, channels=0)), tmp_path / "gray.bmp"),
    ]
    for path in paths:
        assert_same(process_images(path), reference(path))
    ours = process_images([tmp_path / "photo.jpg", Image.open(paths[0])])  # Path objects and a mixed list
    assert_same(ours, reference([paths[1], Image.open(paths[0])]))
    assert process_images(paths[5])["num_soft_tokens"] == [image_resize_target(200, 120).num_soft_tokens]


# --- Errors -----------------------------------------------------------------------------------------


def test_unsupported_budget_names_allowed_values():
    image = noise(10, 10)
    for call in (
        lambda: process_images(image, max_soft_tokens=100),
        lambda: image_resize_target(10, 10, 300),
    ):
        with pytest.raises(ValueError, match=r"70, 140, 280, 560, 1120"):
            call()
    with pytest.raises(ValueError, match="max_soft_tokens"):
        process_images(image, max_soft_tokens=280.0)


def test_bad_files(tmp_path):
    with pytest.raises(FileNotFoundError, match="missing.png"):
        process_images(tmp_path / "missing.png")
    corrupt = tmp_path / "corrupt.jpg"
    corrupt.write_bytes(b"not an image at all")
    with pytest.raises(ValueError, match="corrupt.jpg"):
        process_images(str(corrupt))
    truncated = tmp_path / "truncated.png"
    Image.fromarray(noise(64, 64)).save(truncated)
    truncated.write_bytes(truncated.read_bytes()[:200])
    with pytest.raises(ValueError, match="truncated.png"):
        process_images(truncated)


@pytest.mark.parametrize(
    "image, message",
    [
        (np.zeros((0, 5, 3), np.uint8), "empty"),
        (np.zeros((5, 0), np.uint8), "empty"),
        (np.zeros((5, 5, 2), np.uint8), "channels"),
        (np.zeros((2, 5, 5, 2), np.uint8), "channels"),
        (np.zeros((5, 5, 3, 1, 1), np.uint8), "channels"),
        (np.full((5, 5, 3), 300, np.int32), r"\[0, 255\]"),
        (np.full((5, 5, 3), 2.0, np.float32), r"\[0, 1\]"),
        (np.full((5, 5, 3), np.nan, np.float32), r"\[0, 1\]"),
        (np.zeros((5, 5, 3), bool), "dtype"),
        ([], "at least one"),
    ],
)
def test_bad_arrays(image, message):
    with pytest.raises(ValueError, match=message):
        process_images(image)


def test_unsupported_type():
    with pytest.raises(TypeError, match="int"):
        process_images(42)
