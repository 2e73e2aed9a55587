"""Images, audio and prompts for Gemma 4 12B Unified (``gemma4_unified``), as transformers 5.23's
``Gemma4UnifiedProcessor`` prepares them.

Audio: each soft token is ``samples_per_token`` consecutive 16 kHz samples (640 = 40 ms). As
``Gemma4UnifiedAudioFeatureExtractor``: a clip's last frame is zero-padded to full length (all its
frames are valid), and a batch is padded with zero frames to its longest clip (those are invalid).

Images (``Gemma4UnifiedImageProcessor``, a torchvision-backend processor): RGB uint8, resized with
torch's antialiased bicubic on uint8 (what torchvision's ``resize`` runs for uint8 CPU tensors) to
the largest aspect-preserving size that fits ``max_soft_tokens`` model patches and is a multiple of
the model patch (``patch_size * pooling_kernel_size`` px, 48 on the 12B), rescaled by 1/255, cut into
teacher patches and merged k x k. That merge keeps each merged patch's pixels in row-major
[row][column][channel] order and the merged patches in row-major order, so it equals cutting the
image straight into model patches (what ``_patchify`` does), positions (x, y) in model patches;
padding to ``max_soft_tokens`` with zeros at (-1, -1). Videos: ``Gemma4UnifiedVideoProcessor`` is
gemma4's video processor plus that merge, so ``process_videos`` at the merged patch size gives them.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

from .audio import SAMPLING_RATE, AudioInput, load_audio, resample
from .image import ImageInput, _check_budget, _load_image_file, _patchify, _pil_to_rgb, image_resize_target
from .prompt import MediaTokens, media_prompts
from .video import DEFAULT_NUM_FRAMES, DEFAULT_VIDEO_SOFT_TOKENS, VideoInput, process_videos


def frame_audio(
    waveforms: Sequence[np.ndarray | torch.Tensor | Sequence[float]] | np.ndarray | torch.Tensor,
    samples_per_token: int = 640,
) -> dict[str, torch.Tensor]:
    """Mono 16 kHz clips -> ``input_features`` (n_clips, frames, samples_per_token) float32 and
    ``input_features_mask`` (n_clips, frames) bool, as the model's ``forward`` takes them."""
    if isinstance(waveforms, np.ndarray | torch.Tensor) and waveforms.ndim == 1:
        waveforms = [waveforms]
    clips = []
    for clip in waveforms:
        clip = clip.detach().cpu().numpy() if isinstance(clip, torch.Tensor) else np.asarray(clip)
        if clip.ndim != 1:
            raise ValueError(f"each audio clip must be 1-D (mono samples), got shape {clip.shape}")
        clip = np.pad(clip, (0, (-len(clip)) % samples_per_token))
        clips.append(clip.reshape(-1, samples_per_token).astype(np.float32))
    frames = max((len(c) for c in clips), default=0)
    features = torch.zeros(len(clips), frames, samples_per_token)
    mask = torch.zeros(len(clips), frames, dtype=torch.bool)
    for i, clip in enumerate(clips):
        features[i, : len(clip)] = torch.from_numpy(clip)
        mask[i, : len(clip)] = True
    return {"input_features": features, "input_features_mask": mask}


def process_unified_images(
    images: ImageInput | Sequence[ImageInput],
    max_soft_tokens: int = 280,
    *,
    patch_size: int = 16,
    pooling_kernel_size: int = 3,
) -> dict[str, torch.Tensor | list[int]]:
    """One image or a list -> ``pixel_values`` (n, max_soft_tokens, 3·(p·k)²) float32,
    ``image_position_ids`` (n, max_soft_tokens, 2) int64 ((x, y) per merged patch, (-1, -1) for
    padding) and ``num_soft_tokens`` (list of int).

    An image is a path, a PIL image, or a uint8 array / tensor (HW, CHW or HWC; with 1, 3 or 4
    channels, CHW when both ends could be channels, as the reference guesses). Other dtypes are
    refused: the reference would rescale floats in [0, 1] by 1/255 a second time.
    """
    _check_budget(max_soft_tokens)
    for name, value in (("patch_size", patch_size), ("pooling_kernel_size", pooling_kernel_size)):
        if not isinstance(value, int | np.integer) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    side = patch_size * pooling_kernel_size
    batch = isinstance(images, np.ndarray | torch.Tensor) and images.ndim == 4
    items = list(images) if isinstance(images, list | tuple) or batch else [images]
    if not items:
        raise ValueError("process_unified_images needs at least one image")
    pixel_values = torch.zeros(len(items), max_soft_tokens, 3 * side * side)
    position_ids = torch.full((len(items), max_soft_tokens, 2), -1, dtype=torch.long)
    num_soft_tokens = []
    for i, item in enumerate(items):
        rgb = _rgb_uint8_chw(item)
        height, width = rgb.shape[-2:]
        target_h, target_w, count = image_resize_target(height, width, max_soft_tokens, side_multiple=side)
        if (target_h, target_w) != (height, width):
            rgb = torch.nn.functional.interpolate(
                rgb[None], size=(target_h, target_w), mode="bicubic", align_corners=False, antialias=True
            )[0]
        # uint8 times a Python float: float32 arithmetic, the reference's rescale exactly.
        pixels = rgb * (1 / 255)
        patches, positions = _patchify(pixels.permute(1, 2, 0).numpy(), side)
        pixel_values[i, :count] = torch.from_numpy(patches)
        position_ids[i, :count] = torch.from_numpy(positions)
        num_soft_tokens.append(count)
    return {
        "pixel_values": pixel_values,
        "image_position_ids": position_ids,
        "num_soft_tokens": num_soft_tokens,
    }


def _rgb_uint8_chw(image: ImageInput) -> torch.Tensor:
    """Any image input -> (3, H, W) uint8, as the reference's torchvision backend converts it."""
    if isinstance(image, str | Path):
        image = _load_image_file(Path(image))
    if isinstance(image, Image.Image):
        # transparency composited on white, as for gemma4 (transformers' convert_to_rgb for PIL)
        return torch.from_numpy(np.array(_pil_to_rgb(image))).permute(2, 0, 1).contiguous()
    if isinstance(image, np.ndarray):
        image = torch.from_numpy(np.ascontiguousarray(image))
    if not isinstance(image, torch.Tensor):
        raise TypeError(f"unsupported image type {type(image).__name__}: expected a path, PIL image or array")
    if image.dtype != torch.uint8:
        raise ValueError(
            f"gemma4_unified images must be uint8 arrays (or PIL images / files), got dtype {image.dtype}"
        )
    image = image.detach().cpu()
    if image.ndim == 2:
        image = image[None]
    elif image.ndim == 3 and image.shape[0] not in (1, 3, 4) and image.shape[-1] in (1, 3, 4):
        image = image.permute(2, 0, 1)
    if image.ndim != 3 or image.shape[0] not in (1, 3, 4):
        raise ValueError(
            f"image array must be HW, CHW or HWC with 1, 3 or 4 channels, got shape {tuple(image.shape)}"
        )
    if image.shape[1] == 0 or image.shape[2] == 0:
        raise ValueError(f"empty image of shape {tuple(image.shape)}")
    if image.shape[0] == 1:
        image = image.repeat(3, 1, 1)
    elif image.shape[0] == 4:
        # Over white in float32, back to uint8 by torchvision's to_dtype (x * 255.999, truncated).
        rgba = image.to(torch.float32).mul_(1 / 255)
        alpha = rgba[3:]
        image = (rgba[:3] * alpha + (1 - alpha)).mul(255 + 1.0 - 1e-3).to(torch.uint8)
    return image.contiguous()


def load_unified_audio(clip: AudioInput, index: int = 0) -> np.ndarray:
    """A path (read, mixed to mono, resampled to 16 kHz) or 16 kHz samples -> a 1-D float array."""
    name = f"audio clip {index}"
    if isinstance(clip, str | Path):
        wave, rate = load_audio(clip)
        name += f" (file {str(clip)!r})"
        if rate != SAMPLING_RATE:
            wave = resample(wave, rate, SAMPLING_RATE)
    else:
        if isinstance(clip, torch.Tensor):
            clip = clip.detach().cpu()
            clip = clip.float() if clip.dtype in (torch.bfloat16, torch.float16) else clip
        wave = np.asarray(clip)
        if wave.ndim != 1:
            raise ValueError(f"{name} must be 1-D (16 kHz mono samples), got shape {wave.shape}")
        if not (np.issubdtype(wave.dtype, np.floating) or np.issubdtype(wave.dtype, np.integer)):
            raise ValueError(f"{name} must hold real numbers, got dtype {wave.dtype}")
    if wave.size == 0:
        raise ValueError(f"{name} is empty")
    if not np.isfinite(wave).all():
        raise ValueError(f"{name} contains NaN or infinite samples")
    return wave


def prepare_unified_prompts(
    rows: Sequence[Sequence[int]],
    tokens: MediaTokens,
    images: Sequence[ImageInput] = (),
    audio: Sequence[AudioInput] = (),
    max_soft_tokens: int = 280,
    *,
    patch_size: int = 16,
    pooling_kernel_size: int = 3,
    samples_per_token: int = 640,
    videos: Sequence[VideoInput] = (),
    tokenizer: Any = None,
    video_soft_tokens: int = DEFAULT_VIDEO_SOFT_TOKENS,
    num_frames: int | None = DEFAULT_NUM_FRAMES,
) -> dict[str, Any]:
    """``prepare_media_prompts`` for gemma4_unified: each ``<|image|>`` becomes ``<|image>`` + one
    ``<|image|>`` per merged patch + ``<image|>``, each ``<|audio|>`` ``<|audio>`` + one ``<|audio|>``
    per valid frame (no subsampling) + ``<audio|>``, each ``<|video|>`` its frames as for gemma4 (a
    timestamp, then ``<|image>`` + one ``<|video|>`` per merged patch + ``<image|>``; this needs the
    ``tokenizer``) (processing_gemma4_unified.py ``replace_*_token``). Returns unpadded ``input_ids``
    / ``mm_token_type_ids`` rows and the media tensors."""

    def audio_fn(clips):
        processed = frame_audio(
            [load_unified_audio(clip, i) for i, clip in enumerate(clips)], samples_per_token
        )
        return processed, [int(mask.sum()) for mask in processed["input_features_mask"]]

    # Gemma4UnifiedVideoProcessor = Gemma4VideoProcessor + the k x k merge (= merged-size patches).
    side = patch_size * pooling_kernel_size
    return media_prompts(
        rows,
        tokens,
        tokenizer,
        images=images,
        audio=audio,
        videos=videos,
        image_fn=lambda batch: process_unified_images(
            batch, max_soft_tokens, patch_size=patch_size, pooling_kernel_size=pooling_kernel_size
        ),
        audio_fn=audio_fn,
        video_fn=lambda batch: process_videos(
            batch, num_frames, video_soft_tokens, patch_size=side, pooling_kernel_size=1
        ),
    )
