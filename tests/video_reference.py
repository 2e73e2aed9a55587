"""transformers' own ``Gemma4VideoProcessor``, runnable without torchvision, and a tiny video writer.

The reference video processor is built on torchvision (``BaseVideoProcessor`` is a torchvision
backend), which has no working CPU build next to this repository's torch. It calls three torchvision
functions; when torchvision cannot be imported, ``video_processing_gemma4.py`` is loaded from
transformers with a stand-in for them, written after torchvision 0.28's own code for CPU tensors:

* ``resize`` = ``transforms.v2.functional.resize_image``: uint8 and float tensors go to
  ``torch.nn.functional.interpolate(..., antialias=True)`` as they are (uint8 bicubic has a native
  CPU kernel), other dtypes through float32 and back with rounding;
* ``normalize`` = ``normalize_image``: ``(x - mean) / std`` with (C, 1, 1) tensors;
* ``grayscale_to_rgb``: one channel repeated three times.

Everything else — sampling, channel-layout guess, resize targets, rescale/normalise fusion, patches,
positions, padding, the processor's prompt expansion — is transformers' code. Where torchvision
imports, the processor is transformers' as it ships: test_processing_video.py and
test_video_generation.py also pass with torchvision 0.28's wheel unpacked beside this torch (its
C++ operators' registrations left out, which these functions do not use).
"""

from __future__ import annotations

import enum
import importlib.util
import sys
import types
from fractions import Fraction
from pathlib import Path

import numpy as np
import torch


class InterpolationMode(enum.Enum):
    NEAREST = "nearest"
    NEAREST_EXACT = "nearest-exact"
    BILINEAR = "bilinear"
    BICUBIC = "bicubic"
    BOX = "box"
    HAMMING = "hamming"
    LANCZOS = "lanczos"


# torchvision.transforms.functional._interpolation_modes_from_int
_MODES_FROM_INT = {0: InterpolationMode.NEAREST, 2: InterpolationMode.BILINEAR, 3: InterpolationMode.BICUBIC}


def _resize(image, size, interpolation=InterpolationMode.BILINEAR, max_size=None, antialias=True):
    if not isinstance(interpolation, InterpolationMode):
        interpolation = _MODES_FROM_INT[int(interpolation)]
    if (
        interpolation not in (InterpolationMode.BILINEAR, InterpolationMode.BICUBIC)
        or image.device.type != "cpu"
    ):
        raise NotImplementedError("the stand-in covers bilinear and bicubic resizes of CPU tensors")
    shape = image.shape
    channels, height, width = shape[-3:]
    new_height, new_width = size
    if (new_height, new_width) == (height, width):
        return image
    dtype = image.dtype
    image = image.reshape(-1, channels, height, width)
    need_cast = dtype not in (torch.float32, torch.float64, torch.uint8)
    if need_cast:
        image = image.to(torch.float32)
    image = torch.nn.functional.interpolate(
        image,
        size=[new_height, new_width],
        mode=interpolation.value,
        align_corners=False,
        antialias=antialias,
    )
    if need_cast:
        if not dtype.is_floating_point:
            image = image.round_()
        image = image.to(dtype)
    return image.reshape(shape[:-3] + (channels, new_height, new_width))


def _normalize(image, mean, std, inplace=False):
    mean = torch.as_tensor(mean, dtype=image.dtype, device=image.device).view(-1, 1, 1)
    std = torch.as_tensor(std, dtype=image.dtype, device=image.device).view(-1, 1, 1)
    image = image.sub_(mean) if inplace else image.sub(mean)
    return image.div_(std)


def _grayscale_to_rgb(image):
    return image if image.shape[-3] >= 3 else image.repeat_interleave(3, dim=-3)


TORCHVISION_STAND_IN = types.SimpleNamespace(
    InterpolationMode=InterpolationMode,
    resize=_resize,
    normalize=_normalize,
    grayscale_to_rgb=_grayscale_to_rgb,
)


def torchvision_available() -> bool:
    try:
        import torchvision.transforms.v2.functional  # noqa: F401
    except Exception:  # noqa: BLE001 - a broken install counts as absent
        return False
    return True


def reference_video_processor_class(monkeypatch):
    """transformers' ``Gemma4VideoProcessor`` class (see the module docstring)."""
    if torchvision_available():
        from transformers import Gemma4VideoProcessor

        return Gemma4VideoProcessor
    import transformers.image_processing_backends as backends
    import transformers.video_processing_utils as video_utils

    # The base classes look the functions up in their modules' globals, which lack them here.
    monkeypatch.setattr(backends, "tvF", TORCHVISION_STAND_IN, raising=False)
    monkeypatch.setattr(video_utils, "tvF", TORCHVISION_STAND_IN, raising=False)
    spec = importlib.util.find_spec("transformers.models.gemma4.video_processing_gemma4")
    module = importlib.util.module_from_spec(spec)
    module.tvF = TORCHVISION_STAND_IN  # its class body names tvF.InterpolationMode
    # Registered while it runs (its docstring decorator inspects the class's source file), not after.
    sys.modules[spec.name] = module
    try:
        spec.loader.exec_module(module)
    finally:
        del sys.modules[spec.name]
    return module.Gemma4VideoProcessor


def decode_with_pyav(processor) -> None:
    """Make the processor decode files with transformers' PyAV loader (its default, torchcodec, is
    not installed here; both hand back the frames FFmpeg decodes)."""
    from transformers.video_utils import load_video

    def fetch_videos(paths, sample_indices_fn=None):
        if isinstance(paths, list):
            return list(zip(*[fetch_videos(p, sample_indices_fn) for p in paths]))
        return load_video(paths, backend="pyav", sample_indices_fn=sample_indices_fn)

    processor.fetch_videos = fetch_videos


def moving_frames(count: int, height: int, width: int, seed: int = 0) -> np.ndarray:
    """(count, H, W, 3) uint8 frames of a smooth pattern that moves, with mild noise."""
    y, x = np.mgrid[0:height, 0:width].astype(np.float64)
    rng = np.random.default_rng(seed)
    frames = []
    for t in range(count):
        base = np.stack(
            [x / width, y / height, 0.5 + 0.5 * np.sin((x + 3 * t) / 7 + (y - 2 * t) / 11)], axis=-1
        )
        base = (base + t / count) % 1.0 + rng.normal(0, 0.04, base.shape)
        frames.append((np.clip(base, 0, 1) * 255).astype(np.uint8))
    return np.stack(frames)


def write_video(path: Path, frames: np.ndarray, fps: Fraction | int) -> Path:
    """A lossless video file (FFV1 in RGB, so decoding gives back exactly ``frames``): AVI, whose
    header states the frame count, or Matroska (``.mkv``), whose stream does not."""
    import av

    with av.open(str(path), "w") as container:
        stream = container.add_stream("ffv1", rate=fps)
        stream.width, stream.height = frames.shape[2], frames.shape[1]
        stream.pix_fmt = "bgr0"
        for frame in frames:
            container.mux(stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")))
        container.mux(stream.encode())
    return path
