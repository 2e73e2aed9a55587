"""Images, audio and videos sent by clients -> what the processor takes; a file we cannot read is
a 400.

Media are sized from their headers before they are decoded (``limits.MediaBudget``): an image's
pixels from ``PIL.Image.open``, which reads the header alone (``load`` decodes), a WAV clip's length
from its RIFF chunks, a video's bytes as sent. A request over a limit is refused before any of its
media is decoded. A video's length is read from its container's header before its frames are
decoded (with PyAV, as ``LLM.chat`` decodes a file), and decoding stops at the pixel and time limits.
"""

from __future__ import annotations

import base64
import binascii
import io
import struct
import tempfile
from pathlib import Path

from ..processing.audio import MAX_SAMPLES, SAMPLING_RATE, decode_wav
from .errors import bad_request
from .limits import Limits, MediaBudget

VIDEO_EXAMPLE = "data:video/mp4;base64,..."

# The part of a clip the model hears (longer clips are cut, as in the reference).
HEARD_SECONDS = MAX_SAMPLES / SAMPLING_RATE


def open_image(url: str, where: str, budget: MediaBudget | None = None):
    """A data URL's image, its header read and checked against ``budget``, its pixels not yet
    decoded (``load_image`` decodes them)."""
    from PIL import Image, UnidentifiedImageError

    if not url.startswith("data:"):
        raise bad_request(
            "images are taken as data URLs (data:image/png;base64,...); URLs are not fetched", where
        )
    try:
        header, payload = url.split(",", 1)
        if ";base64" not in header:
            raise ValueError("not base64")
        data = base64.b64decode(payload, validate=True)
        image = Image.open(io.BytesIO(data))  # the header only
    except (
        ValueError,
        binascii.Error,
        UnidentifiedImageError,
        OSError,
        Image.DecompressionBombError,
    ) as error:
        raise bad_request(f"cannot read the image: {error}", where) from error
    if budget is not None:
        budget.add_image(*image.size, where)
    return image


def data_url_bytes(url: str, what: str, example: str, where: str) -> bytes:
    """The bytes of a base64 data URL (``what``: "audio", "videos", ... for the errors)."""
    if not url.startswith("data:"):
        raise bad_request(f"{what} are taken as data URLs ({example}); URLs are not fetched", where)
    header, _, payload = url.partition(",")
    if ";base64" not in header:
        raise bad_request(f"the {what} data URL is not base64 ({example})", where)
    try:
        return base64.b64decode(payload, validate=True)
    except (ValueError, binascii.Error) as error:
        raise bad_request(f"the {what} data URL is not base64: {error}", where) from error


def load_image(image, where: str):
    """Decode an image ``open_image`` checked; a file that breaks while decoding is a 400."""
    from PIL import Image

    try:
        image.load()
    except (ValueError, OSError, Image.DecompressionBombError) as error:
        raise bad_request(f"cannot read the image: {error}", where) from error
    return image


def audio_bytes(payload: str, fmt: str, where: str) -> bytes:
    """An ``input_audio`` part's WAV file, base64-decoded (not yet parsed)."""
    if fmt != "wav":
        raise bad_request(f"input_audio format {fmt!r} is not supported; send wav", where)
    try:
        return base64.b64decode(payload, validate=True)
    except (ValueError, binascii.Error) as error:
        raise bad_request(f"input_audio data is not base64: {error}", where) from error


def check_wav(data: bytes, where: str, budget: MediaBudget | None = None) -> None:
    """Count a WAV file's heard seconds against ``budget`` from its header. A header this cannot
    read is left for ``decode_wav``, which says what is wrong with it."""
    seconds = wav_seconds(data)
    if budget is not None and seconds is not None:
        budget.add_audio(min(seconds, HEARD_SECONDS), where)


def decode_wav_upload(data: bytes, where: str = "file"):
    try:
        return decode_wav(data)
    except ValueError as error:
        raise bad_request(f"cannot read the audio: {error}", where) from error


def wav_seconds(data: bytes) -> float | None:
    """A WAV file's length in seconds from its RIFF chunks (the data chunk's size, capped at the
    bytes present, over the frame size and rate), or None when the header does not say."""
    if data[:4] != b"RIFF" or data[8:12] != b"WAVE":
        return None
    fmt, data_size, offset = None, None, 12
    while offset + 8 <= len(data) and (fmt is None or data_size is None):
        chunk_id, chunk_size = struct.unpack_from("<4sI", data, offset)
        if chunk_id == b"fmt ":
            fmt = data[offset + 8 : offset + 8 + min(chunk_size, 16)]
        elif chunk_id == b"data":
            data_size = min(chunk_size, len(data) - offset - 8)  # a streamed file may claim more
        offset += 8 + chunk_size + (chunk_size & 1)
    if fmt is None or len(fmt) < 16 or data_size is None:
        return None
    _, _, rate, _, block_align, _ = struct.unpack_from("<HHIIHH", fmt)
    if rate == 0 or block_align == 0:
        return None
    return data_size // block_align / rate


def video_bytes(url: str, where: str, limits: Limits) -> bytes:
    """A ``video_url`` part's file, base64-decoded (not yet parsed), within ``--max-video-bytes``."""
    data = data_url_bytes(url, "videos", VIDEO_EXAMPLE, where)
    if len(data) > limits.max_video_bytes:
        raise bad_request(
            f"the video is {len(data):,} bytes; this server takes at most {limits.max_video_bytes:,} "
            "per video (--max-video-bytes)",
            where,
            "video_too_large",
        )
    return data


def decode_video_upload(data: bytes, where: str, limits: Limits, num_frames: int | None):
    """A video file's sampled frames (``processing.video.SampledVideo``, ``num_frames`` of them as
    the processor samples them), within the server's length, pixel and time limits."""
    from ..processing.video import load_video, video_seconds

    with tempfile.TemporaryDirectory(prefix="torchgemma-video-") as folder:
        path = Path(folder) / "upload"
        path.write_bytes(data)
        try:
            seconds = video_seconds(path)
            if seconds is not None and seconds > limits.max_video_seconds:
                raise bad_request(
                    f"the video lasts {seconds:.1f} s; this server takes at most "
                    f"{limits.max_video_seconds:g} s per video (--max-video-seconds)",
                    where,
                    "video_too_long",
                )
            return load_video(path, num_frames, limits.max_video_pixels, limits.video_decode_timeout)
        except ImportError as error:  # the server was installed without the video extra
            raise bad_request(f"this server cannot decode videos: {error}", where) from error
        except (ValueError, OSError) as error:
            message = str(error).replace(f"video file {str(path)!r}", "the video")
            if "allowed" in message:
                message += " (the server's --max-video-pixels)"
            raise bad_request(message, where) from error
