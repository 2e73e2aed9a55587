"""Images -> patch tensors for the Gemma 4 vision tower.

Matches transformers' ``Gemma4ImageProcessorPil`` exactly (5.23): convert to RGB, resize with PIL
bicubic to the largest size that keeps the aspect ratio, fits the soft-token budget and is a multiple
of 48 px, rescale by 1/255, cut into 16x16 patches, pad to a fixed number of patches.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch
from PIL import Image, ImageOps, UnidentifiedImageError

PATCH_SIZE = 16
POOLING_KERNEL = 3  # the vision tower averages 3x3 patches into one soft token
SIDE_MULTIPLE = PATCH_SIZE * POOLING_KERNEL  # 48 px
SUPPORTED_SOFT_TOKENS = (70, 140, 280, 560, 1120)

ImageInput = str | Path | Image.Image | np.ndarray | torch.Tensor


class ImageResizeTarget(NamedTuple):
    height: int
    width: int
    num_soft_tokens: int


def image_resize_target(
    height: int, width: int, max_soft_tokens: int = 280, *, side_multiple: int = SIDE_MULTIPLE
) -> ImageResizeTarget:
    """The size an image of (height, width) is resized to, and how many soft tokens it becomes.

    The same float arithmetic as transformers' ``get_aspect_ratio_preserving_size``, so the result
    is identical for every size (it decides the patch grid, so it must be). ``side_multiple``: pixels
    per side of one soft token (patch size x pooling kernel; gemma4_unified's processor takes both).
    """
    _check_budget(max_soft_tokens)
    if height < 1 or width < 1:
        raise ValueError(f"image size must be positive, got {height}x{width}")
    target_pixels = max_soft_tokens * side_multiple**2  # = max_patches * patch_size**2, exactly
    factor = math.sqrt(target_pixels / (height * width))
    target_h = math.floor(factor * height / side_multiple) * side_multiple
    target_w = math.floor(factor * width / side_multiple) * side_multiple
    if target_h == 0 and target_w == 0:  # unreachable for the supported budgets; kept as a guard
        raise ValueError(f"cannot resize a {height}x{width} image to a non-empty size")
    # Very elongated images: the short side gets one 48 px row/column, the long side keeps the
    # integer aspect ratio, capped so the whole budget is a single row of soft tokens.
    max_side = max_soft_tokens * side_multiple
    if target_h == 0:
        target_h, target_w = side_multiple, min(math.floor(width / height) * side_multiple, max_side)
    elif target_w == 0:
        target_h, target_w = min(math.floor(height / width) * side_multiple, max_side), side_multiple
    num_soft_tokens = (target_h // side_multiple) * (target_w // side_multiple)
    return ImageResizeTarget(target_h, target_w, num_soft_tokens)


def process_images(
    images: ImageInput | Sequence[ImageInput], max_soft_tokens: int = 280
) -> dict[str, torch.Tensor | list[int]]:
    """Preprocess one image or a list of images for the vision tower.

    Each item is a path, a PIL image, or an array / tensor: HWC (or CHW when unambiguous) or HW,
    uint8 (or integers in [0, 255]) or floats in [0, 1]; a 4-D array is a batch. Returns
    ``pixel_values`` (n, max_patches, 768) float32, ``image_position_ids`` (n, max_patches, 2) int64
    holding (x, y) per patch and (-1, -1) for padding, and ``num_soft_tokens`` (list of int),
    with ``max_patches = max_soft_tokens * 9``.
    """
    _check_budget(max_soft_tokens)
    is_array_batch = isinstance(images, (np.ndarray, torch.Tensor)) and images.ndim == 4
    items = list(images) if isinstance(images, (list, tuple)) or is_array_batch else [images]
    if not items:
        raise ValueError("process_images needs at least one image")

    max_patches = max_soft_tokens * POOLING_KERNEL**2
    pixel_values = np.zeros((len(items), max_patches, PATCH_SIZE * PATCH_SIZE * 3), dtype=np.float32)
    position_ids = np.full((len(items), max_patches, 2), -1, dtype=np.int64)
    num_soft_tokens = []
    for i, item in enumerate(items):
        pixels = _resize_and_rescale(_to_rgb_array(item), max_soft_tokens)  # (H, W, 3) float32
        patches, positions = _patchify(pixels)
        pixel_values[i, : len(patches)] = patches
        position_ids[i, : len(patches)] = positions
        num_soft_tokens.append(len(patches) // POOLING_KERNEL**2)
    return {
        "pixel_values": torch.from_numpy(pixel_values),
        "image_position_ids": torch.from_numpy(position_ids),
        "num_soft_tokens": num_soft_tokens,
    }


def processor_config_section(folder: Path | None, section: str, alone: str) -> dict:
    """One processor's settings from a checkpoint folder, as transformers saves them: the ``section``
    of ``processor_config.json`` (``"image_processor"``, ...), else the file ``alone``
    (``preprocessor_config.json``, ...); empty when neither is there."""
    found: dict = {}
    if folder is not None:
        nested = folder / "processor_config.json"
        if nested.is_file():
            found = json.loads(nested.read_text(encoding="utf-8")).get(section) or {}
        if not found and (folder / alone).is_file():
            found = json.loads((folder / alone).read_text(encoding="utf-8"))
    return found


def _check_budget(max_soft_tokens: int) -> None:
    if not isinstance(max_soft_tokens, (int, np.integer)) or max_soft_tokens not in SUPPORTED_SOFT_TOKENS:
        raise ValueError(f"max_soft_tokens must be one of {SUPPORTED_SOFT_TOKENS}, got {max_soft_tokens!r}")


# --- Any input -> (H, W, 3) array, uint8 or float in [0, 1] -----------------------------------------


def _to_rgb_array(image: ImageInput) -> np.ndarray:
    if isinstance(image, (str, Path)):
        # Both steps, as in the reference: an RGB image converted from a palette can still carry a
        # transparent colour, and pixels of that colour then go white.
        return np.asarray(_pil_to_rgb(_load_image_file(Path(image))))
    if isinstance(image, Image.Image):
        return np.asarray(_pil_to_rgb(image))
    if isinstance(image, torch.Tensor):
        image = image.detach().cpu()
        image = (image.float() if image.dtype == torch.bfloat16 else image).numpy()
    if isinstance(image, np.ndarray):
        return _array_to_rgb(image)
    raise TypeError(f"unsupported image type {type(image).__name__}: expected a path, PIL image or array")


def _load_image_file(path: Path) -> Image.Image:
    """Open an image file as transformers' ``load_image`` does for a path.

    That means EXIF orientation applied and a plain ``convert("RGB")``: an alpha channel is
    *dropped*, not composited on white as for in-memory PIL images (the reference's own asymmetry).
    """
    if not path.is_file():
        raise FileNotFoundError(f"image file not found: {str(path)!r}")
    try:
        with Image.open(path) as image:
            return ImageOps.exif_transpose(image).convert("RGB")
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as error:
        raise ValueError(f"cannot read image file {str(path)!r}: {error}") from error


def _pil_to_rgb(image: Image.Image) -> Image.Image:
    """RGB conversion of an in-memory PIL image: anything with transparency goes onto white."""
    if image.width == 0 or image.height == 0:
        raise ValueError(f"empty image of size {image.width}x{image.height}")
    has_alpha = "A" in image.getbands() or image.info.get("transparency") is not None
    if not has_alpha:
        return image.convert("RGB")
    white = Image.new("RGBA", image.size, (255, 255, 255, 255))
    return Image.alpha_composite(white, image.convert("RGBA")).convert("RGB")


def _array_to_rgb(array: np.ndarray) -> np.ndarray:
    if array.ndim == 2:
        array = array[:, :, None]
    elif array.ndim == 3 and array.shape[-1] not in (1, 3, 4) and array.shape[0] in (1, 3, 4):
        array = np.moveaxis(array, 0, -1)  # CHW; an ambiguous shape like (3, H, 3) is read as HWC
    if array.ndim != 3 or array.shape[-1] not in (1, 3, 4):
        raise ValueError(
            f"image array must be HW, HWC or CHW with 1, 3 or 4 channels, got shape {array.shape}"
        )
    if array.shape[0] == 0 or array.shape[1] == 0:
        raise ValueError(f"empty image array of shape {array.shape}")
    array = _check_range(array)
    channels = array.shape[-1]
    if channels == 1:
        return np.repeat(array, 3, axis=-1)
    if channels == 4:
        return _composite_on_white(array)
    return array


def _check_range(array: np.ndarray) -> np.ndarray:
    """uint8 as is; other integers must lie in [0, 255]; floats are intensities in [0, 1]."""
    if array.dtype == np.uint8:
        return array
    if np.issubdtype(array.dtype, np.integer):
        if array.min() < 0 or array.max() > 255:
            raise ValueError(
                f"integer image values must lie in [0, 255], got [{array.min()}, {array.max()}] ({array.dtype})"
            )
        return array.astype(np.uint8)
    if np.issubdtype(array.dtype, np.floating):
        if not np.isfinite(array).all() or array.min() < 0 or array.max() > 1:
            raise ValueError(f"float image values must lie in [0, 1], got [{array.min()}, {array.max()}]")
        return array
    raise ValueError(f"unsupported image dtype {array.dtype}: use uint8 or floats in [0, 1]")


def _composite_on_white(rgba: np.ndarray) -> np.ndarray:
    """RGBA array -> RGB over a white background, with the reference's numpy arithmetic and rounding."""
    white = 255 if rgba.dtype == np.uint8 else 1.0
    alpha = rgba[..., 3:4] / white
    rgb = alpha * rgba[..., :3] + (1 - alpha) * white
    return np.round(rgb).astype(np.uint8) if white == 255 else rgb.astype(rgba.dtype)


# --- Resize, rescale, patchify --------------------------------------------------------------------


def _resize_and_rescale(rgb: np.ndarray, max_soft_tokens: int) -> np.ndarray:
    height, width = rgb.shape[:2]
    target_h, target_w, _ = image_resize_target(height, width, max_soft_tokens)
    if (target_h, target_w) != (height, width):
        # PIL resizes uint8 only; floats are quantised the way transformers' to_pil_image does it.
        resized = Image.fromarray(_to_uint8(rgb)).resize((target_w, target_h), Image.Resampling.BICUBIC)
        rgb = np.asarray(resized)
    elif rgb.dtype != np.uint8:
        return rgb.astype(np.float32)  # already in [0, 1] and already the right size
    # The reference rescales in float64 and rounds to float32 once.
    return (rgb.astype(np.float64) * (1 / 255)).astype(np.float32)


def _to_uint8(rgb: np.ndarray) -> np.ndarray:
    if rgb.dtype == np.uint8:
        return rgb
    # x * 255 rounded to float32, then truncated (not rounded) to uint8, as in the reference.
    return (rgb.astype(np.float64) * 255).astype(np.float32).astype(np.uint8)


def _patchify(pixels: np.ndarray, size: int = PATCH_SIZE) -> tuple[np.ndarray, np.ndarray]:
    """(H, W, 3) -> patches (Hp*Wp, size*size*3) in row-major order, each flattened as [py][px][c],
    and their (x, y) = (column, row) positions."""
    rows, cols = pixels.shape[0] // size, pixels.shape[1] // size
    patches = pixels.reshape(rows, size, cols, size, 3).transpose(0, 2, 1, 3, 4)
    patches = patches.reshape(rows * cols, size * size * 3)
    y, x = np.divmod(np.arange(rows * cols), cols)
    return patches, np.stack([x, y], axis=-1)
