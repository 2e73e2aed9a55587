"""Videos -> frame patch tensors for the Gemma 4 vision tower, and the timestamps of their prompt.

Matches transformers' ``Gemma4VideoProcessor`` (5.23, video_processing_gemma4.py) on CPU:

1. frames sampled uniformly, ``index = i * total // num_frames`` for i < ``num_frames`` (32);
2. each frame resized to the largest size that keeps the aspect ratio, fits the per-frame budget of
   soft tokens (70) and is a multiple of 48 px (the image rule), bicubic with antialiasing on uint8
   pixels, as torchvision's ``resize`` does on CPU (``interpolate`` on the uint8 tensor);
3. rescaled as ``float32(x) / 255`` (the reference folds 1/255 into a normalisation by std 255);
4. cut into 16x16 patches, each frame padded to ``max_soft_tokens * 9`` patches.

A video is a file (decoded with PyAV, the optional ``video`` extra, as transformers' PyAV loader
does), a list of frames (PIL images or HWC / CHW uint8 arrays), a (frames, H, W, C) or
(frames, C, H, W) uint8 array, or ``Video(frames, fps)``. The prompt gives each sampled frame its
time, ``mm:ss`` = frame index / fps (24 fps when the frames come without a rate, as the reference
assumes).

One difference from the reference, where it would fail: a video with fewer frames than
``num_frames`` keeps all its frames (the reference raises unless sampling is turned off, which
keeps them all too).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

from .image import PATCH_SIZE, POOLING_KERNEL, _check_budget, _pil_to_rgb, image_resize_target

DEFAULT_NUM_FRAMES = 32
DEFAULT_VIDEO_SOFT_TOKENS = 70  # per frame
DEFAULT_FPS = 24.0  # the reference's rate for frames given without one
# Pixels of all the frames a video file keeps, decoded (3 bytes each): 2**28 holds 32 frames of
# 3840x2160 (~0.8 GB). A file of a few MB can state 8K frames that would decode to many GB; the
# header's size is checked before any frame is decoded.
MAX_VIDEO_PIXELS = 1 << 28
VIDEO_EXTRA_HINT = 'pip install "torchgemma[video]"'


@dataclass(frozen=True)
class Video:
    """Frames of a video and, when known, its frame rate (which only sets the prompt's timestamps).

    ``frames``: a list of PIL images or HWC / CHW uint8 arrays, or one uint8 array or tensor of shape
    (frames, H, W, C) or (frames, C, H, W), C being 1 or 3. ``fps`` None means 24, as in the reference.
    """

    frames: Any
    fps: float | None = None


VideoInput = str | Path | Video | Sequence[Any] | np.ndarray | torch.Tensor


@dataclass(frozen=True)
class SampledVideo:
    """The frames kept, (n, 3, H, W) uint8, their indices in the whole video, and its frame rate."""

    frames: torch.Tensor
    indices: list[int]
    fps: float

    @property
    def timestamps(self) -> list[float]:
        """Seconds from the start of each kept frame."""
        return [index / self.fps for index in self.indices]


def sample_frame_indices(total_frames: int, num_frames: int | None = DEFAULT_NUM_FRAMES) -> np.ndarray:
    """Indices of the frames kept: ``i * total // num_frames`` (transformers' ``default_sample_indices_fn``),
    or every frame when ``num_frames`` is None or more than the video has."""
    if total_frames < 1:
        raise ValueError("a video needs at least one frame")
    if num_frames is not None and num_frames < 1:
        raise ValueError(f"num_frames must be at least 1, got {num_frames}")
    if num_frames is None or num_frames > total_frames:
        return np.arange(total_frames, dtype=np.int64)
    return np.arange(num_frames, dtype=np.int64) * total_frames // num_frames


def format_timestamp(seconds: float) -> str:
    """``mm:ss`` as the processor writes it before each frame (seconds truncated, minutes unbounded)."""
    return f"{int(seconds // 60):02d}:{int(seconds % 60):02d}"


def process_videos(
    videos: Sequence[VideoInput],
    num_frames: int | None = DEFAULT_NUM_FRAMES,
    max_soft_tokens: int = DEFAULT_VIDEO_SOFT_TOKENS,
    *,
    patch_size: int = PATCH_SIZE,
    pooling_kernel_size: int = POOLING_KERNEL,
) -> dict[str, Any]:
    """Preprocess a list of videos for the vision tower (each item one video, see the module doc).

    gemma4_unified's frames are k x k merged patches, which equal patches of the merged size taken
    straight (processing/unified.py): ``patch_size=k*p, pooling_kernel_size=1`` gives them.

    Returns ``pixel_values_videos`` (total frames, max_patches, 768) float32 and
    ``video_position_ids`` (total frames, max_patches, 2) int64 — the frames of all videos one after
    the other — ``num_frames_per_video`` (n_videos,) int64, as transformers' processor returns them;
    and for the prompt, per video, ``num_soft_tokens`` (soft tokens of each of its frames) and
    ``timestamps`` (seconds of each kept frame).
    """
    _check_budget(max_soft_tokens)
    if isinstance(videos, (str, Path, Video, np.ndarray, torch.Tensor)):
        raise TypeError("process_videos takes a list of videos (one item per video)")
    if not videos:
        raise ValueError("process_videos needs at least one video")
    max_patches = max_soft_tokens * pooling_kernel_size**2
    pixels, positions, counts, soft_tokens, timestamps = [], [], [], [], []
    for video in videos:
        sampled = sample_video(video, num_frames)
        frame_pixels, frame_positions = _frames_to_patches(
            sampled.frames, max_soft_tokens, patch_size, patch_size * pooling_kernel_size
        )
        pixels.append(_pad(frame_pixels, max_patches, 0))
        positions.append(_pad(frame_positions, max_patches, -1))
        counts.append(len(sampled.indices))
        soft_tokens.append(frame_pixels.shape[1] // pooling_kernel_size**2)
        timestamps.append(sampled.timestamps)
    return {
        "pixel_values_videos": torch.cat(pixels),
        "video_position_ids": torch.cat(positions),
        "num_frames_per_video": torch.tensor(counts, dtype=torch.int64),
        "num_soft_tokens": soft_tokens,
        "timestamps": timestamps,
    }


def sample_video(video: VideoInput, num_frames: int | None = DEFAULT_NUM_FRAMES) -> SampledVideo:
    """One video's kept frames as (n, 3, H, W) uint8, with their indices and the frame rate."""
    if isinstance(video, SampledVideo):  # decoded already (``load_video``; the server does)
        return video
    if isinstance(video, (str, Path)):
        return load_video(video, num_frames)
    fps = None
    if isinstance(video, Video):
        video, fps = video.frames, video.fps
    if fps is not None and not (np.isfinite(fps) and fps > 0):
        raise ValueError(f"fps must be a positive number, got {fps!r}")
    frames = _frames_array(video)
    indices = sample_frame_indices(len(frames), num_frames)
    chosen = _channels_first(frames[indices])
    return SampledVideo(chosen, indices.tolist(), DEFAULT_FPS if fps is None else float(fps))


def load_video(
    path: str | Path,
    num_frames: int | None = DEFAULT_NUM_FRAMES,
    max_pixels: int | None = MAX_VIDEO_PIXELS,
    timeout: float | None = None,
) -> SampledVideo:
    """Decode a video file with PyAV, keeping the sampled frames, as transformers' ``read_video_pyav``:
    the frame count and rate are the stream's (``frames``, ``average_rate``), frames are decoded in
    order and converted to RGB by FFmpeg (``rgb24``). A stream that does not state its frame count is
    decoded once to count them; one without a rate gets 24 fps.

    The kept frames may hold at most ``max_pixels`` pixels together (None: no limit): checked on the
    stream's stated frame size before anything is decoded, and on each frame as it is decoded.
    Decoding that takes more than ``timeout`` seconds (None: no limit) stops with a ValueError."""
    path, av = _video_file(path)
    deadline = None if timeout is None else time.monotonic() + timeout

    def decoded(container):
        for frame in container.decode(video=0):
            if deadline is not None and time.monotonic() > deadline:
                raise ValueError(f"decoding took more than {timeout:g} s")
            yield frame

    try:
        with av.open(str(path)) as container:
            stream = _video_stream(container)
            width, height = stream.codec_context.width, stream.codec_context.height
            _check_video_pixels(path, 1, width, height, max_pixels)
            total = stream.frames or sum(1 for _ in decoded(container))
            rate = stream.average_rate
            indices = sample_frame_indices(total, num_frames)
            _check_video_pixels(path, len(indices), width, height, max_pixels)
            wanted, last = set(indices.tolist()), int(indices[-1])
            container.seek(0)
            kept: np.ndarray | None = None  # (n, H, W, 3), filled in place (no second copy to stack)
            count = 0
            for index, frame in enumerate(decoded(container)):
                if index > last:
                    break
                if index not in wanted:
                    continue
                # The header may understate the frames' size: check each before converting it.
                _check_video_pixels(path, len(indices), frame.width, frame.height, max_pixels)
                if kept is None:
                    kept = np.empty((len(indices), frame.height, frame.width, 3), dtype=np.uint8)
                if (frame.height, frame.width) != kept.shape[1:3]:
                    raise ValueError(
                        f"frame {index} is {frame.width}x{frame.height}, the first kept one "
                        f"{kept.shape[2]}x{kept.shape[1]}: the frames of a video must all have one size"
                    )
                kept[count] = frame.to_ndarray(format="rgb24")
                count += 1
    except (av.FFmpegError, ValueError, OSError) as error:
        raise ValueError(f"cannot read video file {str(path)!r}: {error}") from error
    if count != len(indices):
        raise ValueError(
            f"cannot read video file {str(path)!r}: its stream states {total} frames but only "
            f"{count} of the {len(indices)} sampled ones decoded"
        )
    fps = float(rate) if rate else DEFAULT_FPS
    return SampledVideo(_channels_first(kept), indices.tolist(), fps)


def _check_video_pixels(path: Path, frames: int, width: int, height: int, max_pixels: int | None) -> None:
    if max_pixels is not None and frames * width * height > max_pixels:
        raise ValueError(
            f"{frames} frame(s) of {width}x{height} would decode to {frames * width * height:,} pixels, "
            f"more than the {max_pixels:,} allowed (load_video's max_pixels)"
        )


def probe_video(path: str | Path) -> tuple[int, float | None]:
    """A video file's frame count (0 when its header does not state it) and frame rate, from its
    header only; raises what ``load_video`` would for a missing file, PyAV or stream."""
    path, av = _video_file(path)
    try:
        with av.open(str(path)) as container:
            stream = _video_stream(container)
            return stream.frames, float(stream.average_rate) if stream.average_rate else None
    except (av.FFmpegError, ValueError, OSError) as error:
        raise ValueError(f"cannot read video file {str(path)!r}: {error}") from error


def video_seconds(path: str | Path) -> float | None:
    """A video file's length in seconds from its header (the stream's duration, else the
    container's, else frames over rate), or None when the header does not say."""
    path, av = _video_file(path)
    try:
        with av.open(str(path)) as container:
            stream = _video_stream(container)
            if stream.duration is not None and stream.time_base is not None:
                return float(stream.duration * stream.time_base)
            if container.duration is not None:
                return container.duration / av.time_base
            if stream.frames and stream.average_rate:
                return stream.frames / float(stream.average_rate)
            return None
    except (av.FFmpegError, ValueError, OSError) as error:
        raise ValueError(f"cannot read video file {str(path)!r}: {error}") from error


def _video_file(path: str | Path) -> tuple[Path, Any]:
    """The file's path, checked, and the ``av`` module (ImportError naming the extra without it)."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise FileNotFoundError(f"video file not found: {str(path)!r}")
    try:
        import av
    except ImportError as error:
        raise ImportError(
            f"decoding the video file {str(path)!r} needs PyAV: {VIDEO_EXTRA_HINT} "
            "(or pass the frames: a list of PIL images or a (frames, H, W, 3) uint8 array)"
        ) from error
    return path, av


def _video_stream(container: Any) -> Any:
    if not container.streams.video:
        raise ValueError("it has no video stream")
    return container.streams.video[0]


# --- Any input -> (T, H, W, C) or (T, C, H, W) uint8 --------------------------------------------------


def _frames_array(video: Any) -> np.ndarray | torch.Tensor:
    if isinstance(video, torch.Tensor):
        video = video.detach().cpu()
    if isinstance(video, (np.ndarray, torch.Tensor)):
        if video.ndim != 4:
            raise ValueError(
                f"a video array must be (frames, H, W, C) or (frames, C, H, W), got shape {tuple(video.shape)}"
            )
        return _check_uint8(video)
    if isinstance(video, Image.Image) or not isinstance(video, Sequence) or isinstance(video, str):
        raise TypeError(
            f"unsupported video type {type(video).__name__}: expected a file path, a list of frames, "
            "a 4-D uint8 array or a Video"
        )
    if not video:
        raise ValueError("a video needs at least one frame")
    frames = [_frame_array(frame) for frame in video]
    shapes = {frame.shape for frame in frames}
    if len(shapes) > 1:
        raise ValueError(f"the frames of a video must all have one size, got shapes {sorted(shapes)}")
    return np.stack(frames)


def _frame_array(frame: Any) -> np.ndarray:
    if isinstance(frame, Image.Image):
        # The reference takes np.array(frame): only RGB frames work there; others are made RGB here.
        return np.asarray(frame if frame.mode == "RGB" else _pil_to_rgb(frame))
    if isinstance(frame, torch.Tensor):
        frame = frame.detach().cpu().numpy()
    if not isinstance(frame, np.ndarray) or frame.ndim not in (2, 3):
        raise TypeError(
            "a video frame must be a PIL image or an HW / HWC / CHW uint8 array, "
            f"got {type(frame).__name__}{'' if not hasattr(frame, 'shape') else f' of shape {frame.shape}'}"
        )
    return _check_uint8(frame[..., None] if frame.ndim == 2 else frame)


def _check_uint8(array: np.ndarray | torch.Tensor) -> np.ndarray | torch.Tensor:
    # The reference divides whatever it gets by 255: float frames in [0, 1] would come out near 0.
    if array.dtype not in (np.uint8, torch.uint8):
        raise ValueError(f"video frames must be uint8 (0..255), got {array.dtype}")
    if 0 in array.shape:
        raise ValueError(f"empty video of shape {tuple(array.shape)}")
    return array


def _channels_first(frames: np.ndarray | torch.Tensor) -> torch.Tensor:
    """(T, H, W, C) or (T, C, H, W) -> contiguous (T, 3, H, W) uint8.

    The layout is guessed as the reference guesses it: channels first when dimension 1 is 1 or 3,
    else last when dimension 3 is. One channel is repeated to three.
    """
    frames = torch.from_numpy(np.ascontiguousarray(frames)) if isinstance(frames, np.ndarray) else frames
    if frames.shape[1] in (1, 3):
        pass
    elif frames.shape[3] in (1, 3):
        frames = frames.permute(0, 3, 1, 2)
    else:
        raise ValueError(
            f"video frames must have 1 or 3 channels (first or last), got shape {tuple(frames.shape)}"
        )
    if frames.shape[1] == 1:
        frames = frames.repeat(1, 3, 1, 1)
    return frames.contiguous()


# --- Resize, rescale, patchify ----------------------------------------------------------------------


def _frames_to_patches(
    frames: torch.Tensor,
    max_soft_tokens: int,
    patch: int = PATCH_SIZE,
    side: int = PATCH_SIZE * POOLING_KERNEL,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(T, 3, H, W) uint8 -> patches (T, Hp*Wp, 3·patch²) float32 and their (x, y) positions
    (T, Hp*Wp, 2); frames resized to multiples of ``side`` px (one soft token)."""
    height, width = frames.shape[-2:]
    target_h, target_w, _ = image_resize_target(height, width, max_soft_tokens, side_multiple=side)
    if (target_h, target_w) != (height, width):
        # torchvision's resize on a uint8 CPU tensor: torch's own uint8 bicubic kernel, antialiased.
        frames = torch.nn.functional.interpolate(
            frames, size=[target_h, target_w], mode="bicubic", align_corners=False, antialias=True
        )
    # The reference normalises with mean 0 and std 255 (1/255 folded in): a float32 division.
    pixels = frames.to(torch.float32) / torch.full((3, 1, 1), 255.0)
    # Row-major patches, each flattened as [py][px][c]; positions (x, y) = (column, row).
    count, rows, cols = len(pixels), target_h // patch, target_w // patch
    patches = pixels.reshape(count, 3, rows, patch, cols, patch).permute(0, 2, 4, 3, 5, 1)
    patches = patches.reshape(count, rows * cols, patch * patch * 3)
    index = torch.arange(rows * cols)
    positions = torch.stack((index % cols, index // cols), dim=-1).expand(count, -1, -1)
    return patches, positions


def _pad(values: torch.Tensor, length: int, fill: int) -> torch.Tensor:
    padded = values.new_full((values.shape[0], length, values.shape[2]), fill)
    padded[:, : values.shape[1]] = values
    return padded
