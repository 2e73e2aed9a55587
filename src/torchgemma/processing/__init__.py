"""Image, audio and video preprocessing for Gemma 4, as pure functions matching transformers 5.23.

``processor.py`` puts them behind one request path: ``Processor`` (a prompt or chat messages with
their media in; one unpadded id sequence and its ``MediaInputs`` out). It is imported from its
module, so that preprocessing alone does not load the tokenizer.
"""

from .audio import num_audio_tokens, process_audio
from .image import ImageResizeTarget, image_resize_target, process_images
from .prompt import (
    MediaTokens,
    VideoTokens,
    audio_soft_token_counts,
    collect_media,
    collect_videos,
    expand_placeholders,
    prepare_media_prompts,
)
from .video import Video, load_video, process_videos

__all__ = [
    "ImageResizeTarget",
    "MediaTokens",
    "Video",
    "VideoTokens",
    "audio_soft_token_counts",
    "collect_media",
    "collect_videos",
    "expand_placeholders",
    "image_resize_target",
    "load_video",
    "num_audio_tokens",
    "prepare_media_prompts",
    "process_audio",
    "process_images",
    "process_videos",
]
