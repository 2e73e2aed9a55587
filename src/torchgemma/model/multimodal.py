"""Where the towers meet the text decoder.

    vision / audio tower ─ embed_vision / embed_audio (scale-free RMSNorm, Linear to H) ─┐
    input_ids ─ placeholders (<|image|>, <|video|>, <|audio|>) → pad id ─ embed·√H ──────┴─ scatter
                                                                              in sequence order

Also here: the clippable linear both towers are built from, and the image-block ids that make
image tokens attend to each other bidirectionally on sliding layers (26B/31B).
Numerics follow transformers 5.23 (``Gemma4Model.forward``, ``Gemma4MultimodalEmbedder``).
"""

from __future__ import annotations

import torch
from torch import nn

from .layers import RMSNorm

# mm_token_type_ids values, as transformers' processor writes them (boi/eoi/boa/eoa are text, 0).
TEXT_TYPE, IMAGE_TYPE, VIDEO_TYPE, AUDIO_TYPE = 0, 1, 2, 3


class ClippableLinear(nn.Module):
    """A bias-free linear layer that clamps its input and its output to stored bounds.

    The E2B/E4B towers were trained with these bounds (buffers in the checkpoint, one scalar each);
    the large towers have plain linears. The weight lives at ``<name>.linear.weight`` either way.
    """

    def __init__(self, in_features: int, out_features: int, clipped: bool):
        super().__init__()
        self.clipped = clipped
        self.linear = nn.Linear(in_features, out_features, bias=False)
        if clipped:
            self.register_buffer("input_min", torch.tensor(-float("inf")))
            self.register_buffer("input_max", torch.tensor(float("inf")))
            self.register_buffer("output_min", torch.tensor(-float("inf")))
            self.register_buffer("output_max", torch.tensor(float("inf")))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.clipped:
            return self.linear(x)
        x = self.linear(torch.clamp(x, self.input_min, self.input_max))
        return torch.clamp(x, self.output_min, self.output_max)


class MultimodalEmbedder(nn.Module):
    """Soft tokens of a tower (width D) into the text width H: ``Linear(RMSNorm_without_scale(x))``."""

    def __init__(self, in_features: int, text_hidden_size: int, eps: float):
        super().__init__()
        self.embedding_pre_projection_norm = RMSNorm(in_features, eps, with_scale=False)
        self.embedding_projection = nn.Linear(in_features, text_hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.embedding_projection(self.embedding_pre_projection_norm(x))


def placeholder_masks(input_ids: torch.Tensor, token_ids: dict[str, int]) -> dict[str, torch.Tensor]:
    """(B, T) boolean masks of the image, video and audio placeholder tokens."""
    return {kind: input_ids == token_ids[f"{kind}_token_id"] for kind in ("image", "video", "audio")}


def scatter_soft_tokens(
    embeds: torch.Tensor, mask: torch.Tensor, features: torch.Tensor, kind: str
) -> torch.Tensor:
    """Write ``features`` (N, H) into the N placeholder positions of ``mask`` (B, T), in row-major order."""
    expected = int(mask.sum())
    if features.shape[0] != expected:
        raise ValueError(
            f"{kind} features and {kind} tokens do not match: the prompt has {expected} {kind} "
            f"placeholder tokens but the {kind} inputs give {features.shape[0]} soft tokens"
        )
    mask = mask.to(embeds.device)[..., None].expand_as(embeds)
    return embeds.masked_scatter(mask, features.to(embeds.device, embeds.dtype))


def vision_block_ids(mm_token_type_ids: torch.Tensor) -> torch.Tensor:
    """(B, T): 0, 1, 2, ... for each maximal run of image/video soft tokens in a row, -1 elsewhere.

    Tokens of one run (one image, or one video frame) attend to each other in both directions on
    sliding layers; boi/eoi and audio tokens are not part of a block.
    """
    is_vision = (mm_token_type_ids == IMAGE_TYPE) | (mm_token_type_ids == VIDEO_TYPE)
    starts = is_vision.clone()
    starts[:, 1:] &= ~is_vision[:, :-1]
    ids = torch.cumsum(starts.int(), dim=1) - 1
    return torch.where(is_vision, ids, -1)
