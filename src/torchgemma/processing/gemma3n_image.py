"""Images -> pixels for Gemma 3n's vision tower, and the text its processor writes for each image.

Gemma 3n's processor uses SigLIP's image processor: every image resized (PIL) to one square size
(768 x 768 as published), rescaled by 1/255, optionally normalised by a mean and standard deviation,
channels first. This matches transformers' ``SiglipImageProcessorPil`` (5.23) with the checkpoint's
settings (``preprocessor_config.json``, or ``processor_config.json``'s ``image_processor``) to the bit;
no torchvision. Images are read as for Gemma 4 (processing/image.py: files with EXIF orientation,
transparency onto white). A float image (intensities in [0, 1]) is quantised to uint8 first, as
transformers' resize quantises it; transformers would then rescale its result by 1/255 a second time
(it warns of that), which is not done here: the tests compare uint8 images.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

from .image import ImageInput, _to_rgb_array, _to_uint8

# SiglipImageProcessor's defaults, at the size Gemma 3n's published processor gives (768 x 768).
DEFAULT_SETTINGS: dict[str, Any] = {
    "do_resize": True,
    "size": {"height": 768, "width": 768},
    "resample": int(Image.Resampling.BICUBIC),
    "do_rescale": True,
    "rescale_factor": 1 / 255,
    "do_normalize": True,
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
}
# Settings SigLIP's processor has that torchgemma does not implement, and their only accepted value.
FIXED_SETTINGS: dict[str, Any] = {"do_center_crop": False, "do_pad": False, "do_convert_rgb": True}


def process_images_gemma3n(
    images: ImageInput | Sequence[ImageInput], settings: dict[str, Any] | None = None
) -> dict[str, torch.Tensor]:
    """One image or a list of images (paths, PIL images, HWC / CHW / HW arrays) -> ``pixel_values``
    (n, 3, height, width) float32, with ``settings`` (``image_settings``) or SigLIP's defaults at 768 px."""
    s = {**DEFAULT_SETTINGS, **(settings or {})}
    is_array_batch = isinstance(images, (np.ndarray, torch.Tensor)) and images.ndim == 4
    items = list(images) if isinstance(images, (list, tuple)) or is_array_batch else [images]
    if not items:
        raise ValueError("process_images_gemma3n needs at least one image")
    pixels = []
    for item in items:
        rgb = _to_uint8(_to_rgb_array(item))  # (H, W, 3) uint8
        if s["do_resize"]:
            size = (s["size"]["width"], s["size"]["height"])
            rgb = np.asarray(Image.fromarray(rgb).resize(size, Image.Resampling(s["resample"])))
        image = np.moveaxis(rgb, -1, 0)  # (3, H, W)
        if s["do_rescale"]:
            image = (image.astype(np.float64) * s["rescale_factor"]).astype(np.float32)
        image = image.astype(np.float32)
        if s["do_normalize"]:
            mean = np.array(s["image_mean"], dtype=np.float32)
            std = np.array(s["image_std"], dtype=np.float32)
            image = ((image.T - mean) / std).T
        pixels.append(image)
    shapes = {p.shape for p in pixels}
    if len(shapes) > 1:
        raise ValueError(f"images of different sizes cannot be batched without resizing: {sorted(shapes)}")
    return {"pixel_values": torch.from_numpy(np.stack(pixels))}


def image_settings(folder: Path | None) -> dict[str, Any]:
    """The checkpoint's image processor settings (SigLIP's keys), checked; ``{}`` without any."""
    found: dict[str, Any] = {}
    if folder is not None:
        nested, alone = folder / "processor_config.json", folder / "preprocessor_config.json"
        if nested.is_file():
            found = json.loads(nested.read_text(encoding="utf-8")).get("image_processor") or {}
        if not found and alone.is_file():
            found = json.loads(alone.read_text(encoding="utf-8"))
    for key, value in FIXED_SETTINGS.items():
        if found.get(key) not in (None, value):
            raise ValueError(
                f"{folder}: the image processor's {key} is {found[key]!r}; torchgemma supports {value!r}"
            )
    settings = {key: found[key] for key in DEFAULT_SETTINGS if found.get(key) is not None}
    size = settings.get("size", DEFAULT_SETTINGS["size"])
    if (
        not isinstance(size, dict)
        or set(size) != {"height", "width"}
        or not all(isinstance(v, int) and 0 < v <= 8192 for v in size.values())
    ):
        raise ValueError(
            f"{folder}: the image processor's size must be {{'height', 'width'}} in pixels, got {size!r}"
        )
    if int(settings.get("resample", 0)) not in {int(m) for m in Image.Resampling}:
        raise ValueError(
            f"{folder}: the image processor's resample {settings['resample']!r} is not a PIL filter"
        )
    return settings


def image_sequence(tokenizer: Any, soft_tokens: int) -> str:
    """The text Gemma3nProcessor puts in place of each image placeholder: ``"\\n\\n"`` + the
    start-of-image token + ``soft_tokens`` placeholders + the end-of-image token + ``"\\n\\n"``."""
    image, start, end = (
        tokenizer.backend.id_to_token(i)
        for i in (tokenizer.image_id, tokenizer.image_start_id, tokenizer.image_end_id)
    )
    return f"\n\n{start}{image * soft_tokens}{end}\n\n"


def expand_image_text(text: str, tokenizer: Any, soft_tokens: int) -> str:
    """A raw prompt with every image placeholder expanded as Gemma3nProcessor does."""
    image = tokenizer.backend.id_to_token(tokenizer.image_id)
    return text.replace(image, image_sequence(tokenizer, soft_tokens))


def expand_image_in_template(template: str, tokenizer: Any, soft_tokens: int) -> str:
    """A chat template whose own image placeholder literal (as Gemma 3n's template writes an image
    item) renders expanded (see gemma3n_audio.expand_audio_in_template)."""
    image = tokenizer.backend.id_to_token(tokenizer.image_id)
    literal = json.dumps(image_sequence(tokenizer, soft_tokens))
    expanded = template
    for quote in ("'", '"'):
        expanded = expanded.replace(f"{quote}{image}{quote}", literal)
    if expanded == template:
        raise ValueError(f"the chat template writes no {image!r} for image items: cannot place images")
    return expanded
