"""Prompts with media: placeholders expanded into soft-token runs, as transformers' Gemma 4 processor.

Each ``<|image|>`` of a prompt becomes ``<|image>`` + n × ``<|image|>`` + ``<image|>`` (n: that image's
soft tokens) and each ``<|audio|>`` becomes ``<|audio>`` + n × ``<|audio|>`` + ``<audio|>`` (n: from
that clip's frame mask), the i-th placeholder of a kind taking the i-th item of that kind, row after
row (processing_gemma4.py ``replace_*_token``, processing_utils.py ``get_text_with_replacements``).
Each ``<|video|>`` becomes, for each of its frames, ``"mm:ss "`` + ``<|image>`` + n × ``<|video|>`` +
``<image|>``, the frames joined by single spaces. ``mm_token_type_ids`` marks soft tokens: 1 image,
2 video, 3 audio, 0 otherwise.

Ids are expanded rather than text: the placeholders and the tokens around them are special tokens,
which the tokenizer never merges with their neighbours, so the ids come out the same. A video's
timestamps are text, though: the first one is encoded together with the plain text before it (back
to the previous added token), as encoding the expanded prompt would.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .audio import AudioInput, process_audio
from .image import ImageInput, process_images
from .video import (
    DEFAULT_NUM_FRAMES,
    DEFAULT_VIDEO_SOFT_TOKENS,
    VideoInput,
    format_timestamp,
    process_videos,
)

IMAGE_TYPE, VIDEO_TYPE, AUDIO_TYPE = 1, 2, 3  # processing_utils.py create_mm_token_type_ids


@dataclass(frozen=True)
class MediaTokens:
    """Ids of the placeholder and boundary tokens, as the tokenizer (and the processor) knows them."""

    image: int
    image_start: int
    image_end: int
    audio: int
    audio_start: int
    audio_end: int
    video: int | None = None

    @classmethod
    def from_tokenizer(cls, tokenizer: Any) -> MediaTokens:
        """From a ``torchgemma.Tokenizer`` (raises ``UnknownTokenError`` if one is missing)."""
        names = ("image", "image_start", "image_end", "audio", "audio_start", "audio_end")
        ids = {name: getattr(tokenizer, f"{name}_id") for name in names}
        try:
            video = tokenizer.video_id
        except KeyError:  # UnknownTokenError: an older vocabulary without <|video|>
            video = None
        return cls(**ids, video=video)


def audio_soft_token_counts(input_features_mask: torch.Tensor) -> list[int]:
    """Soft tokens per clip (n_clips, frames) mask: the valid frames kept by two stride-2 convolutions.

    The processor's own arithmetic (``replace_audio_token``), so padded batches count the same.
    """
    counts = []
    for mask in input_features_mask:
        for _ in range(2):
            length = (len(mask) + 2 - 3) // 2 + 1
            mask = mask[::2][:length]
        counts.append(int(mask.sum()))
    return counts


@dataclass(frozen=True)
class VideoTokens:
    """What a video's placeholder expands to: soft tokens per frame, and each frame's time in seconds."""

    soft_tokens_per_frame: int
    timestamps: Sequence[float]


def expand_placeholders(
    rows: Sequence[Sequence[int]],
    tokens: MediaTokens,
    image_soft_tokens: Sequence[int] = (),
    audio_soft_tokens: Sequence[int] = (),
    videos: Sequence[VideoTokens] = (),
    tokenizer: Any = None,
) -> tuple[list[list[int]], list[list[int]]]:
    """Expand every placeholder of every row; returns (expanded rows, their mm_token_type_ids).

    The number of ``<|image|>`` / ``<|audio|>`` / ``<|video|>`` placeholders over all rows must equal
    the number of images / clips / videos (ValueError otherwise, as the processor raises). Videos
    need the ``tokenizer`` (a ``torchgemma.Tokenizer``) for their timestamps.
    """
    kinds = [
        ("image", tokens.image, image_soft_tokens, "images"),
        ("audio", tokens.audio, audio_soft_tokens, "audio clips"),
    ]
    if tokens.video is not None:
        kinds.append(("video", tokens.video, videos, "videos"))
    elif videos:
        raise ValueError("videos were given, but the tokenizer has no <|video|> token")
    for kind, token, counts, items in kinds:
        found = sum(list(row).count(token) for row in rows)
        if found != len(counts):
            raise ValueError(
                f"the prompt has {found} {kind} placeholder(s) (<|{kind}|>) but {len(counts)} "
                f"{items} were given; each {kind} needs exactly one placeholder"
            )
    if videos and tokenizer is None:
        raise ValueError("expanding video placeholders needs the tokenizer (for the timestamps)")

    images, clips, each_video = iter(image_soft_tokens), iter(audio_soft_tokens), iter(videos)
    runs = {
        tokens.image: lambda: [tokens.image_start, *[tokens.image] * next(images), tokens.image_end],
        tokens.audio: lambda: [tokens.audio_start, *[tokens.audio] * next(clips), tokens.audio_end],
    }
    types = {tokens.image: IMAGE_TYPE, tokens.audio: AUDIO_TYPE}
    if tokens.video is not None:
        types[tokens.video] = VIDEO_TYPE
    expanded, type_rows = [], []
    for row in rows:
        ids: list[int] = []
        for token in row:
            if token == tokens.video:
                ids = _with_video(ids, next(each_video), tokens, tokenizer)
            else:
                ids.extend(runs[token]() if token in runs else (token,))
        expanded.append(ids)
        type_rows.append([types.get(token, 0) for token in ids])
    return expanded, type_rows


def _with_video(ids: list[int], video: VideoTokens, tokens: MediaTokens, tokenizer: Any) -> list[int]:
    """``ids`` followed by a video's frames: ``"mm:ss <|image>" + n × <|video|> + "<image|>"`` each,
    joined by spaces (processing_gemma4.py ``replace_video_token``)."""
    added = frozenset(tokenizer.backend.get_added_tokens_decoder())
    frame = [tokens.image_start, *[tokens.video] * video.soft_tokens_per_frame, tokens.image_end]
    for index, seconds in enumerate(video.timestamps):
        ids = _append_text(ids, f"{' ' if index else ''}{format_timestamp(seconds)} ", tokenizer, added)
        ids = ids + frame
    return ids


def _append_text(ids: list[int], text: str, tokenizer: Any, added: frozenset[int]) -> list[int]:
    """``ids`` followed by ``text``, tokenized as the processor's expanded prompt is.

    The tokenizer encodes the text between two added tokens as one piece, so ``text`` joins the
    plain-text ids at the end of ``ids``: they are decoded and encoded again together with it. Should
    those ids not be what their text encodes to (text sanitized piece by piece), they stay as they are.
    """
    start = len(ids)
    while start > 0 and ids[start - 1] not in added:
        start -= 1
    before = tokenizer.decode(ids[start:]) if start < len(ids) else ""
    if before and tokenizer.encode(before, add_special_tokens=False) != ids[start:]:
        start, before = len(ids), ""
    return ids[:start] + tokenizer.encode(before + text, add_special_tokens=False)


def prepare_media_prompts(
    rows: Sequence[Sequence[int]],
    tokens: MediaTokens,
    images: Sequence[ImageInput] = (),
    audio: Sequence[AudioInput] = (),
    max_soft_tokens: int = 280,
    *,
    videos: Sequence[VideoInput] = (),
    tokenizer: Any = None,
    video_soft_tokens: int = DEFAULT_VIDEO_SOFT_TOKENS,
    num_frames: int | None = DEFAULT_NUM_FRAMES,
) -> dict[str, Any]:
    """Token rows with placeholders plus their media -> what the model's prefill takes.

    Returns ``input_ids`` and ``mm_token_type_ids`` (lists of rows, unpadded), and the tensors of
    ``process_images`` (``pixel_values``, ``image_position_ids``), ``process_audio``
    (``input_features``, ``input_features_mask``) and ``process_videos`` (``pixel_values_videos``,
    ``video_position_ids``, ``num_frames_per_video``) for the kinds given. Videos need the
    ``tokenizer``; ``video_soft_tokens`` and ``num_frames`` are their soft tokens per frame and
    frames kept.
    """

    def audio_fn(clips):
        processed = process_audio(clips)
        return processed, audio_soft_token_counts(processed["input_features_mask"])

    return media_prompts(
        rows,
        tokens,
        tokenizer,
        images=images,
        audio=audio,
        videos=videos,
        image_fn=lambda batch: process_images(batch, max_soft_tokens=max_soft_tokens),
        audio_fn=audio_fn,
        video_fn=lambda batch: process_videos(
            batch, num_frames=num_frames, max_soft_tokens=video_soft_tokens
        ),
    )


def media_prompts(
    rows: Sequence[Sequence[int]],
    tokens: MediaTokens,
    tokenizer: Any,
    *,
    images: Sequence[Any],
    audio: Sequence[Any],
    videos: Sequence[Any],
    image_fn: Callable[[list], dict[str, Any]],
    audio_fn: Callable[[list], tuple[dict[str, Any], list[int]]],
    video_fn: Callable[[list], dict[str, Any]],
) -> dict[str, Any]:
    """What every model's prompt preparation shares: each kind given is preprocessed by its function
    (``image_fn`` and ``video_fn`` return their tensors with ``num_soft_tokens``, videos also
    ``timestamps``; ``audio_fn`` returns its tensors and each clip's soft-token count), then the
    placeholders of ``rows`` are expanded (``expand_placeholders``)."""
    out: dict[str, Any] = {}
    image_counts: list[int] = []
    audio_counts: list[int] = []
    video_tokens: list[VideoTokens] = []
    if images:
        processed = image_fn(list(images))
        image_counts = processed.pop("num_soft_tokens")
        out.update(processed)
    if audio:
        processed, audio_counts = audio_fn(list(audio))
        out.update(processed)
    if videos:
        processed = video_fn(list(videos))
        video_tokens = [
            VideoTokens(n, times)
            for n, times in zip(processed.pop("num_soft_tokens"), processed.pop("timestamps"))
        ]
        out.update(processed)
    out["input_ids"], out["mm_token_type_ids"] = expand_placeholders(
        rows, tokens, image_counts, audio_counts, video_tokens, tokenizer
    )
    return out


# Content-item keys that hold the media, in transformers' order (processing_utils.py, apply_chat_template).
_IMAGE_KEYS = ("image", "url", "path")
_AUDIO_KEYS = ("audio", "url", "path")
_VIDEO_KEYS = ("video", "url", "path")


def collect_media(messages: Sequence[Mapping[str, Any]]) -> tuple[list[Any], list[Any]]:
    """The images and audio clips of a conversation's content items, in the order the template
    writes their placeholders: ``{"type": "image", "image" | "url" | "path": ...}`` and
    ``{"type": "audio", "audio" | "url" | "path": ...}``. Videos: see ``collect_videos``."""
    images, audio = [], []
    for item in _content_items(messages):
        kind = item.get("type")
        if kind == "image":
            images.append(_media_source(item, _IMAGE_KEYS, kind))
        elif kind == "audio":
            audio.append(_media_source(item, _AUDIO_KEYS, kind))
    return images, audio


def collect_videos(messages: Sequence[Mapping[str, Any]]) -> list[Any]:
    """The videos of a conversation's ``{"type": "video", "video" | "url" | "path": ...}`` items
    (a path, a list of frames, a 4-D array or a ``Video``), in placeholder order."""
    items = _content_items(messages)
    return [_media_source(item, _VIDEO_KEYS, "video") for item in items if item.get("type") == "video"]


def _content_items(messages: Sequence[Mapping[str, Any]]):
    """The mapping items of the messages' list contents, in order (string contents hold none)."""
    for message in messages:
        content = message.get("content")
        if isinstance(content, str) or content is None:
            continue
        yield from (item for item in content if isinstance(item, Mapping))


def _media_source(item: Mapping[str, Any], keys: tuple[str, ...], kind: str) -> Any:
    value = next((item[key] for key in keys if item.get(key) is not None), None)
    if value is None:
        raise ValueError(f"{kind} content item without any of the keys {list(keys)}: {dict(item)!r}")
    if isinstance(value, str):
        if value.startswith(("http://", "https://")):
            raise ValueError(f"{kind} URLs are not fetched; download the file and pass its path: {value!r}")
        if value.startswith("file://"):
            value = value[len("file://") :]
        return Path(value)
    return value
