"""Gemma 3's vision tower (SigLIP) and its multimodal projector, in reading order.

    pixel_values (n, 3, S, S), normalised to [-1, 1]
      ─ patch_embedding: Conv2d p×p, stride p ─ + position_embedding          (n, P², D)
      ─ encoder layers: x + self_attn(layer_norm1(x))        bidirectional, no mask, 1/√d
                        x + mlp(layer_norm2(x))              fc1 ─ gelu_tanh ─ fc2
      ─ post_layernorm                                                         (n, P², D)
    multi_modal_projector:
      ─ average pool the P×P grid k×k into a √m×√m grid                        (n, m, D)
      ─ mm_soft_emb_norm (RMSNorm, 1 + w) ─ @ mm_input_projection_weight       (n, m, H)

Checkpoint prefixes ``vision_tower.`` (``vision_tower.vision_model.`` before transformers 5) and
``multi_modal_projector.``. Numerics follow transformers 5.23 (``SiglipVisionModel``,
``Gemma3MultiModalProjector``) so that bf16 soft tokens agree to the bit.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..config import SiglipVisionConfig
from .attention import ATTENTION_BACKENDS, sdpa_attention
from .layers import RMSNorm, eager_attention, gelu_tanh

# ── patch embedding ──────────────────────────────────────────────────────────────────────────


class Embeddings(nn.Module):
    def __init__(self, config: SiglipVisionConfig):
        super().__init__()
        d, p = config.hidden_size, config.patch_size
        self.patch_embedding = nn.Conv2d(3, d, kernel_size=p, stride=p)
        # One learned row per patch of the fixed grid, in raster order.
        self.position_embedding = nn.Embedding(config.patches_per_side**2, d)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """(n, 3, S, S) -> (n, P², D)."""
        weight = self.patch_embedding.weight
        patches = self.patch_embedding(pixel_values.to(weight.dtype))  # (n, D, P, P)
        return patches.flatten(2).transpose(1, 2) + self.position_embedding.weight


# ── attention and MLP ────────────────────────────────────────────────────────────────────────


class Attention(nn.Module):
    """Plain multi-head self-attention with biases, over all patches (no mask)."""

    def __init__(self, config: SiglipVisionConfig, backend: str):
        super().__init__()
        d = config.hidden_size
        self.backend = backend
        self.head_dim = config.head_dim
        self.scale = config.head_dim**-0.5
        self.q_proj = nn.Linear(d, d)
        self.k_proj = nn.Linear(d, d)
        self.v_proj = nn.Linear(d, d)
        self.out_proj = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, _ = x.shape
        shape = (batch, length, -1, self.head_dim)
        query, key, value = (
            proj(x).view(shape).transpose(1, 2) for proj in (self.q_proj, self.k_proj, self.v_proj)
        )
        if self.backend == "sdpa":
            out = sdpa_attention(query, key, value, None, causal=False, scale=self.scale)  # (n, N, h, d)
        else:
            out = eager_attention(query, key, value, None, self.scale)
        return self.out_proj(out.reshape(batch, length, -1))


class MLP(nn.Module):
    def __init__(self, config: SiglipVisionConfig):
        super().__init__()
        self.fc1 = nn.Linear(config.hidden_size, config.intermediate_size)
        self.fc2 = nn.Linear(config.intermediate_size, config.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(gelu_tanh(self.fc1(x)))


class EncoderLayer(nn.Module):
    def __init__(self, config: SiglipVisionConfig, backend: str):
        super().__init__()
        d, eps = config.hidden_size, config.layer_norm_eps
        self.layer_norm1 = nn.LayerNorm(d, eps=eps)
        self.self_attn = Attention(config, backend)
        self.layer_norm2 = nn.LayerNorm(d, eps=eps)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))


class Encoder(nn.Module):
    def __init__(self, config: SiglipVisionConfig, backend: str):
        super().__init__()
        self.layers = nn.ModuleList(EncoderLayer(config, backend) for _ in range(config.num_hidden_layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


class SiglipVisionTower(nn.Module):
    """Images (n, 3, S, S) -> patch states (n, P², D), as ``SiglipVisionModel``'s last hidden state.

    ``attention``: the encoder's backend (``"sdpa"`` or ``"eager"``), as the text decoder's.
    """

    def __init__(self, config: SiglipVisionConfig, attention: str = "sdpa"):
        super().__init__()
        check_backend(attention)
        self.config = config
        self.embeddings = Embeddings(config)
        self.encoder = Encoder(config, attention)
        self.post_layernorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def set_attention(self, backend: str) -> None:
        check_backend(backend)
        for layer in self.encoder.layers:
            layer.self_attn.backend = backend

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        side = self.config.image_size
        if pixel_values.dim() != 4 or tuple(pixel_values.shape[1:]) != (3, side, side):
            raise ValueError(
                f"pixel_values must be (images, 3, {side}, {side}) for this vision tower, "
                f"got {tuple(pixel_values.shape)}"
            )
        return self.post_layernorm(self.encoder(self.embeddings(pixel_values)))


def check_backend(backend: str) -> None:
    if backend not in ATTENTION_BACKENDS:
        raise ValueError(f"unknown attention backend {backend!r}; use one of {', '.join(ATTENTION_BACKENDS)}")


# ── into the text model ──────────────────────────────────────────────────────────────────────


class MultiModalProjector(nn.Module):
    """Patch states (n, P², D) -> soft tokens (n, m, H): a k×k average pool, a (1 + w) RMSNorm, and
    a product with a stored (D, H) matrix (a bare parameter, not a Linear: transposed)."""

    def __init__(self, config: SiglipVisionConfig, text_hidden_size: int):
        super().__init__()
        self.patches_per_side = config.patches_per_side
        self.kernel = config.patches_per_side // config.tokens_per_side
        self.mm_input_projection_weight = nn.Parameter(torch.zeros(config.hidden_size, text_hidden_size))
        self.mm_soft_emb_norm = RMSNorm(config.hidden_size, config.layer_norm_eps, plus_one=True)

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        n, _, d = patches.shape
        grid = patches.transpose(1, 2).reshape(n, d, self.patches_per_side, self.patches_per_side)
        pooled = (
            F.avg_pool2d(grid.contiguous(), self.kernel, self.kernel).flatten(2).transpose(1, 2)
        )  # (n, m, D)
        return torch.matmul(self.mm_soft_emb_norm(pooled), self.mm_input_projection_weight).type_as(patches)
