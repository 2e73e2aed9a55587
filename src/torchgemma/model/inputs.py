"""A prompt's media tensors as one object: what the processor makes and ``Gemma.forward``,
``generate``, ``stream`` and ``Engine.add_request`` take.

The names are transformers' Gemma 4 processor outputs; every field is optional (a text prompt has
none). Shapes as ``Gemma.forward`` documents them.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch


@dataclass(frozen=True)
class MediaInputs:
    pixel_values: torch.Tensor | None = None  # (n_images, N, 3p²)
    image_position_ids: torch.Tensor | None = None  # (n_images, N, 2)
    input_features: torch.Tensor | None = None  # (n_clips, frames, mel)
    input_features_mask: torch.Tensor | None = None  # (n_clips, frames)
    mm_token_type_ids: torch.Tensor | None = None  # (B, T): 1 image, 2 video, 3 audio, 0 text
    pixel_values_videos: torch.Tensor | None = None  # every frame of every video, concatenated
    video_position_ids: torch.Tensor | None = None
    num_frames_per_video: torch.Tensor | None = None

    @classmethod
    def from_dict(cls, values: dict[str, torch.Tensor | None]) -> MediaInputs:
        """From a mapping of processor output names; a name that is not a media input is an error."""
        names = {field.name for field in fields(cls)}
        unknown = sorted(set(values) - names)
        if unknown:
            raise TypeError(f"not media inputs: {', '.join(unknown)} (known: {', '.join(sorted(names))})")
        return cls(**values)

    def as_dict(self) -> dict[str, torch.Tensor]:
        """The inputs that are set, by name (keyword arguments for ``Gemma.forward``)."""
        return {
            field.name: value for field in fields(self) if (value := getattr(self, field.name)) is not None
        }

    def __bool__(self) -> bool:
        return bool(self.as_dict())
