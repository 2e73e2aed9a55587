"""Image and audio preprocessing for Gemma 4, as pure functions matching transformers 5.23."""

from .audio import num_audio_tokens, process_audio
from .image import ImageResizeTarget, image_resize_target, process_images

__all__ = ["ImageResizeTarget", "image_resize_target", "num_audio_tokens", "process_audio", "process_images"]
