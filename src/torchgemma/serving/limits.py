"""What one request may ask of the server, checked before the work it would cost.

Every limit is checked on what is cheap to know: the body's size from its header and while it is
read, a prompt's length in characters before it is tokenized, images' sizes from their headers and
WAV clips' lengths from theirs before anything is decoded, and the model's towers before any media
is looked at. A request over a limit is refused with a 400 (413 for the body) that names the limit.
"""

from __future__ import annotations

from dataclasses import dataclass

from .errors import bad_request

MiB = 1 << 20


@dataclass(frozen=True)
class Limits:
    """The server's limits (``torchgemma serve`` flags in parentheses)."""

    # A request body larger than this is refused with 413 before it is read (--max-request-bytes).
    # 8 MiB holds a context's worth of text many times over, or a few photos as data URLs.
    max_request_bytes: int = 8 * MiB
    # Images and audio clips in one request, together (--max-media-per-request).
    max_media_per_request: int = 16
    # Pixels of one image, as its header states them (--max-image-pixels): 4096 x 4096. Images are
    # shrunk to at most ~0.65 MP for the tower anyway; a larger one only costs memory to decode.
    max_image_pixels: int = 4096 * 4096
    # Pixels of all the images of one request together (--max-request-pixels): four at the maximum.
    max_request_pixels: int = 4 * 4096 * 4096
    # Seconds of audio in one request, each clip counted as the part the model hears (its first
    # 30 s) (--max-audio-seconds).
    max_audio_seconds: float = 120.0
    # Videos (video_url data URLs): the bytes of one file (--max-video-bytes), its length as its
    # header states it (--max-video-seconds: decoding reads the whole stream up to the last sampled
    # frame), the pixels of its sampled frames once decoded (--max-video-pixels: 32 frames of
    # 1920x1080 fit) and the time its decoding may take (--video-decode-timeout).
    max_video_bytes: int = 64 * MiB
    max_video_seconds: float = 600.0
    max_video_pixels: int = 1 << 26
    video_decode_timeout: float = 60.0
    # Requests prepared (template, tokenizer, media decoding) at once, off the event loop. Decoded
    # media are dropped once a request is prepared, so the server never holds more than this many
    # requests' worth (this x max_request_pixels) at once (--prepare-threads).
    prepare_threads: int = 2

    def __post_init__(self) -> None:
        positive = ("max_request_bytes", "max_image_pixels", "max_request_pixels", "prepare_threads")
        for name in (*positive, "max_video_bytes", "max_video_pixels"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.max_media_per_request < 0 or self.max_audio_seconds < 0 or self.max_video_seconds < 0:
            raise ValueError(
                "max_media_per_request, max_audio_seconds and max_video_seconds cannot be negative"
            )
        if self.video_decode_timeout <= 0:
            raise ValueError(f"video_decode_timeout must be positive, got {self.video_decode_timeout}")


class MediaBudget:
    """One request's media, counted and sized from their headers as they are opened."""

    def __init__(self, limits: Limits):
        self.limits = limits
        self.items = 0
        self.pixels = 0
        self.audio_seconds = 0.0

    def count(self, where: str) -> None:
        self.items += 1
        if self.items > self.limits.max_media_per_request:
            raise bad_request(
                f"more than {self.limits.max_media_per_request} images, audio clips and videos in one request "
                "(the server's --max-media-per-request)",
                where,
                "too_many_media",
            )

    def add_image(self, width: int, height: int, where: str) -> None:
        pixels = width * height
        if pixels > self.limits.max_image_pixels:
            raise bad_request(
                f"the image is {width}x{height} = {pixels:,} pixels; this server takes at most "
                f"{self.limits.max_image_pixels:,} per image (--max-image-pixels)",
                where,
                "image_too_large",
            )
        self.pixels += pixels
        if self.pixels > self.limits.max_request_pixels:
            raise bad_request(
                f"the request's images have {self.pixels:,} pixels so far; this server takes at most "
                f"{self.limits.max_request_pixels:,} per request (--max-request-pixels)",
                where,
                "image_too_large",
            )

    def add_audio(self, seconds: float, where: str) -> None:
        self.audio_seconds += seconds
        if self.audio_seconds > self.limits.max_audio_seconds:
            raise bad_request(
                f"the request's audio lasts {self.audio_seconds:.1f} s so far (each clip counted up to "
                f"the 30 s the model hears); this server takes at most {self.limits.max_audio_seconds:g} s "
                "per request (--max-audio-seconds)",
                where,
                "audio_too_long",
            )
