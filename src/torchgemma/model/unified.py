"""Gemma 4 12B "unified" (``gemma4_unified``): media go into the decoder without an encoder.

    image ─ 3x3-merged 48 px patches (3·48² values) ─ LayerNorm ─ Linear ─ LayerNorm
          ─ + pos_embedding[x, 0] + pos_embedding[y, 1] ─ LayerNorm ─┐
                                                                      ├─ embed_vision / embed_audio:
    audio ─ raw waveform frames of 640 samples (40 ms) ───────────────┘   scale-free RMSNorm, Linear to H

One soft token per merged patch and per frame; the decoder is the gemma4 one without PLE or MoE.
Numerics follow transformers 5.23 (``Gemma4UnifiedVisionEmbedder``, ``Gemma4UnifiedModel``).
Module names are the checkpoint's (``model.vision_embedder.*``, ``model.embed_vision.*``).
"""

from __future__ import annotations

import torch
from torch import nn

from ..config import UnifiedVisionConfig


class VisionEmbedder(nn.Module):
    """Merged patches (n_images, N, 3·(p·k)²) with (x, y) positions (n_images, N, 2), padding at
    (-1, -1) -> (n_images, N, mm_embed_dim), before the projection into the decoder."""

    def __init__(self, config: UnifiedVisionConfig):
        super().__init__()
        patch_dim = 3 * config.model_patch_size**2
        width = config.mm_embed_dim
        self.patch_ln1 = nn.LayerNorm(patch_dim)
        self.patch_dense = nn.Linear(patch_dim, width)
        self.patch_ln2 = nn.LayerNorm(width)
        # Factorised table: row i, column 0 is x = i, column 1 is y = i.
        self.pos_embedding = nn.Parameter(torch.zeros(config.mm_posemb_size, 2, width))
        self.pos_norm = nn.LayerNorm(width)

    def forward(self, pixel_values: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        dtype = self.patch_dense.weight.dtype
        # Pixels are cast to the model dtype first (unlike gemma4's tower, which rescales in float32).
        x = self.patch_ln2(self.patch_dense(self.patch_ln1(pixel_values.to(dtype))))
        valid = (position_ids != -1).to(dtype)[..., None]  # (n, N, 2, 1)
        axes = torch.arange(2, device=position_ids.device)
        table = self.pos_embedding[position_ids.clamp(min=0).long(), axes]  # (n, N, 2, D)
        # x and y rows are summed first, then added: the reference's order (one bf16 rounding each).
        x = x + (table * valid).sum(-2)
        return self.pos_norm(x)
