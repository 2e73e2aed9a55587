"""Images -> pixel values for Gemma 3's SigLIP tower, and the text that stands for each image.

Matches transformers' ``Gemma3ImageProcessorPil`` and ``Gemma3Processor`` (5.23): convert to RGB,
optionally cut pan-and-scan crops from a long image (kept after the image itself), resize each to the
tower's square size with PIL (bilinear by default), rescale by 1/255, normalise with mean and std 0.5.
In the prompt each image's ``<start_of_image>`` becomes ``"\\n\\n<start_of_image>"`` + 256 image
tokens + ``"<end_of_image>\\n\\n"`` (with crops: the image and each crop so, in one sentence), and the
whole text is then tokenized at once, so the newlines merge with their neighbours as there.

Reading images (paths, PIL, arrays) is Gemma 4's (``processing/image.py``); float arrays in [0, 1]
are quantised to 8 bits for PIL and rescaled once (transformers rescales them twice, with a warning).
"""

from __future__ import annotations

import itertools
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

from .image import ImageInput, _to_rgb_array, _to_uint8, processor_config_section

CROPS_INTRO = "Here is the original image {image} and here are some crops to help you see better "


@dataclass(frozen=True)
class Gemma3ImageSettings:
    """The image processor's settings, as ``preprocessor_config.json`` saves them (transformers'
    defaults where it writes null; the size defaults to the tower's)."""

    size: int = 896
    resample: int = 2  # PIL's BILINEAR
    rescale_factor: float = 1 / 255
    image_mean: tuple[float, float, float] = (0.5, 0.5, 0.5)
    image_std: tuple[float, float, float] = (0.5, 0.5, 0.5)
    do_rescale: bool = True
    do_normalize: bool = True
    do_pan_and_scan: bool = False
    pan_and_scan_min_crop_size: int = 256
    pan_and_scan_max_num_crops: int = 4
    pan_and_scan_min_ratio_to_activate: float = 1.2
    image_seq_length: int = 256

    @classmethod
    def from_folder(cls, folder: Path | None, image_size: int, tokens_per_image: int) -> Gemma3ImageSettings:
        """From a checkpoint folder's ``preprocessor_config.json`` (or ``processor_config.json``'s
        ``image_processor``); a size other than the tower's, or no resizing, is refused by name."""
        found = processor_config_section(folder, "image_processor", "preprocessor_config.json")
        known = {f.name for f in fields(cls)} - {"size", "image_seq_length"}
        values: dict[str, Any] = {k: v for k, v in found.items() if k in known and v is not None}
        for key in ("image_mean", "image_std"):
            if key in values:
                value = values[key]
                values[key] = tuple(float(x) for x in (value if isinstance(value, list) else [value] * 3))
        size = found.get("size") or {"height": image_size, "width": image_size}
        if (size.get("height"), size.get("width")) != (image_size, image_size):
            raise ValueError(
                f"{folder}: the image processor's size {size} is not the vision tower's {image_size}px"
            )
        if found.get("do_resize") is False:
            raise ValueError(f"{folder}: do_resize false: the vision tower takes {image_size}px images only")
        return cls(size=image_size, image_seq_length=tokens_per_image, **values)

    # ── the prompt ───────────────────────────────────────────────────────────────────────────

    def image_text(self, tokens: tuple[str, str, str], num_crops: int) -> str:
        """The text of one image (``tokens``: boi, image token, eoi) with its ``num_crops`` crops."""
        boi, image, eoi = tokens
        sequence = f"\n\n{boi}{image * self.image_seq_length}{eoi}\n\n"
        if not num_crops:
            return sequence
        return CROPS_INTRO.format(image=sequence) + " ".join([sequence] * num_crops)

    def crop_counts(self, images: Sequence[ImageInput]) -> list[int]:
        """How many pan-and-scan crops each image gets (0 each when pan-and-scan is off)."""
        if not self.do_pan_and_scan:
            return [0] * len(images)
        return [len(self.crops(_to_rgb_array(image))) for image in images]

    # ── pixels ───────────────────────────────────────────────────────────────────────────────

    def crops(self, rgb: np.ndarray) -> list[np.ndarray]:
        """Pan-and-scan: a long image (aspect ratio at least ``min_ratio_to_activate``) cut along its
        long side into 2 to ``max_num_crops`` crops of about its aspect ratio, none narrower than
        ``min_crop_size`` (else none). The last crop may be narrower (the reference's slicing)."""
        height, width = rgb.shape[:2]
        long, short = max(width, height), min(width, height)
        if long / short < self.pan_and_scan_min_ratio_to_activate:
            return []
        count = int(math.floor(long / short + 0.5))  # half rounds up
        count = min(int(math.floor(long / self.pan_and_scan_min_crop_size)), count)
        count = min(self.pan_and_scan_max_num_crops, max(2, count))
        across, down = (count, 1) if width >= height else (1, count)
        crop_w, crop_h = int(math.ceil(width / across)), int(math.ceil(height / down))
        if min(crop_w, crop_h) < self.pan_and_scan_min_crop_size:
            return []
        return [
            rgb[y : y + crop_h, x : x + crop_w]
            for y, x in itertools.product(range(0, crop_h * down, crop_h), range(0, crop_w * across, crop_w))
        ]

    def pixels(self, rgb: np.ndarray) -> np.ndarray:
        """(H, W, 3) -> (3, S, S) float32: PIL resize, rescale (float64, rounded once), normalise."""
        mode = Image.Resampling(self.resample)
        resized = np.asarray(Image.fromarray(_to_uint8(rgb)).resize((self.size, self.size), mode))
        if self.do_rescale:
            image = (resized.astype(np.float64) * self.rescale_factor).astype(np.float32)
        else:
            image = resized.astype(np.float32)
        if self.do_normalize:
            mean = np.array(self.image_mean, dtype=np.float32)
            std = np.array(self.image_std, dtype=np.float32)
            image = (image - mean) / std
        return np.ascontiguousarray(image.transpose(2, 0, 1))


def process_images_gemma3(
    images: ImageInput | Sequence[ImageInput], settings: Gemma3ImageSettings | None = None
) -> dict[str, torch.Tensor | list[int]]:
    """One image or a list, as ``Gemma3ImageProcessor`` returns them: ``pixel_values``
    (n_images + n_crops, 3, S, S) float32, each image followed by its crops, and ``num_crops``
    (one int per image)."""
    settings = settings or Gemma3ImageSettings()
    items = list(images) if isinstance(images, (list, tuple)) else [images]
    if not items:
        raise ValueError("process_images_gemma3 needs at least one image")
    pixels, num_crops = [], []
    for item in items:
        rgb = _to_rgb_array(item)
        crops = settings.crops(rgb) if settings.do_pan_and_scan else []
        pixels += [settings.pixels(part) for part in (rgb, *crops)]
        num_crops.append(len(crops))
    return {"pixel_values": torch.from_numpy(np.stack(pixels)), "num_crops": num_crops}


def expand_image_text(text: str, tokens: tuple[str, str, str], image_texts: Sequence[str]) -> str:
    """A raw prompt with its i-th ``<start_of_image>`` replaced by ``image_texts[i]``."""
    parts = text.split(tokens[0])
    if len(parts) - 1 != len(image_texts):
        raise ValueError(
            f"the prompt has {len(parts) - 1} {tokens[0]} placeholders but {len(image_texts)} images were given"
        )
    return parts[0] + "".join(image + part for image, part in zip(image_texts, parts[1:]))


def expand_images_in_template(template: str, boi: str, image_texts: Sequence[str]) -> str:
    """A chat template whose own ``'<start_of_image>'`` literal (as Gemma 3's template writes an image
    item) renders the next image's text: the rendered text is then what the processor tokenizes, and
    a placeholder typed in a message stays what sanitizing makes of it."""
    literals = ", ".join(json.dumps(text) for text in image_texts)  # valid Jinja string literals
    expanded = template
    for quote in ("'", '"'):
        expanded = expanded.replace(f"{quote}{boi}{quote}", "__gemma3_images.next()")
    if expanded == template:
        raise ValueError(f"the chat template writes no {boi!r} for image items: cannot place images")
    return "{%- set __gemma3_images = cycler(" + literals + ") -%}" + expanded
