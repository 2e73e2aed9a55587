"""The Gemma 4 vision tower, in reading order.

    pixel patches (B, N, 3·p²) in [0, 1], positions (B, N, 2) as (x, y), (-1, -1) = padding
      ─ 2·(x − 0.5) ─ input_proj ─ + table[0][x] + table[1][y]                (B, N, D)
      ─ encoder layers: x + post_attn_norm(attention(input_norm(x)))      bidirectional, padding
                        x + post_ffw_norm(MLP(pre_ffw_norm(x)))           keys masked, 2-D RoPE
      ─ pooler: average of each k×k block of patches, · √D                  (B, N/k², D)
      ─ keep the real soft tokens, (26B/31B) standardise                     (n_soft, D)
    then ``embed_vision`` (multimodal.py) takes them to the text width.

Checkpoint prefix ``model.vision_tower.``. Numerics follow transformers 5.23
(``Gemma4VisionModel`` and its parts) so that bf16 soft tokens agree to the bit.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..config import VisionConfig
from .attention import ATTENTION_BACKENDS, sdpa_attention
from .layers import RMSNorm, apply_rope, eager_attention, gelu_tanh
from .multimodal import ClippableLinear

# ── patch embedding ──────────────────────────────────────────────────────────────────────────


class PatchEmbedder(nn.Module):
    def __init__(self, config: VisionConfig):
        super().__init__()
        d = config.hidden_size
        self.input_proj = nn.Linear(3 * config.patch_size**2, d, bias=False)
        # Row x of table 0 plus row y of table 1 is the position of patch (x, y).
        self.position_embedding_table = nn.Parameter(torch.ones(2, config.position_embedding_size, d))

    def forward(
        self, pixel_values: torch.Tensor, positions: torch.Tensor, padding: torch.Tensor
    ) -> torch.Tensor:
        """pixel_values (B, N, 3p²), positions (B, N, 2), padding (B, N) -> (B, N, D)."""
        # The processor gives [0, 1]; the model rescales to [-1, 1] in the input's own dtype
        # (float32 from the processor) and only then casts to the weights' dtype, as the reference.
        pixels = 2 * (pixel_values - 0.5)
        weight = self.input_proj.weight
        if weight.dtype.is_floating_point:
            pixels = pixels.to(weight.dtype)
        x = self.input_proj(pixels)
        # Padding patches carry (-1, -1): look up row 0, then zero their position embedding.
        where = positions.clamp(min=0)
        table = self.position_embedding_table
        position = F.embedding(where[..., 0], table[0]) + F.embedding(where[..., 1], table[1])
        position = torch.where(padding[..., None], 0.0, position)
        return x + position


# ── 2-D rotary embedding ─────────────────────────────────────────────────────────────────────


def axial_rope_cos_sin(
    positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin (B, N, head_dim) for patch positions (B, N, 2).

    Each half of the head is an ordinary half-split RoPE over head_dim/2 channels: the first half
    turns with x, the second with y, both with the frequencies ``theta^(-2j/(head_dim/2))``.
    Angles in float32, rounded to the model dtype at the end.
    """
    half = head_dim // 2
    inv_freq = 1.0 / (theta ** (torch.arange(0, half, 2, dtype=torch.float, device=positions.device) / half))
    angles = positions[..., None].float() * inv_freq  # (B, N, 2, head_dim/4)
    x_angles, y_angles = angles[:, :, 0], angles[:, :, 1]
    cos = torch.cat((x_angles.cos(), x_angles.cos(), y_angles.cos(), y_angles.cos()), dim=-1)
    sin = torch.cat((x_angles.sin(), x_angles.sin(), y_angles.sin(), y_angles.sin()), dim=-1)
    return cos.to(dtype), sin.to(dtype)


def apply_axial_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x (B, N, H, D): channels [0, D/2) by the x angles, [D/2, D) by the y angles."""
    part = 2 * (x.shape[-1] // 4)
    rotated = [
        apply_rope(x_part, cos_part, sin_part)
        for x_part, cos_part, sin_part in zip(
            x.split(part, dim=-1), cos.split(part, dim=-1), sin.split(part, dim=-1)
        )
    ]
    return torch.cat(rotated, dim=-1)


# ── attention and MLP ────────────────────────────────────────────────────────────────────────


class VisionAttention(nn.Module):
    """Bidirectional attention with QK norms, a scale-free V norm and scale 1 (no 1/√d).

    ``backend`` as the text decoder's: ``"eager"`` takes an additive mask, ``"sdpa"`` a
    True-to-attend one (``Encoder.padding_mask`` makes both), as transformers' tower does.
    """

    def __init__(self, config: VisionConfig, backend: str = "sdpa"):
        super().__init__()
        self.backend = backend
        d, heads, kv, dim = (
            config.hidden_size,
            config.num_attention_heads,
            config.num_key_value_heads,
            config.head_dim,
        )
        clipped = config.use_clipped_linears
        self.head_dim = dim
        self.q_proj = ClippableLinear(d, heads * dim, clipped)
        self.k_proj = ClippableLinear(d, kv * dim, clipped)
        self.v_proj = ClippableLinear(d, kv * dim, clipped)
        self.o_proj = ClippableLinear(heads * dim, d, clipped)
        self.q_norm = RMSNorm(dim, config.rms_norm_eps)
        self.k_norm = RMSNorm(dim, config.rms_norm_eps)
        self.v_norm = RMSNorm(dim, config.rms_norm_eps, with_scale=False)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor | None
    ) -> torch.Tensor:
        batch, length, _ = x.shape
        shape = (batch, length, -1, self.head_dim)
        query = apply_axial_rope(self.q_norm(self.q_proj(x).view(shape)), cos, sin).transpose(1, 2)
        key = apply_axial_rope(self.k_norm(self.k_proj(x).view(shape)), cos, sin).transpose(1, 2)
        value = self.v_norm(self.v_proj(x).view(shape)).transpose(1, 2)  # (B, H, N, d)
        if self.backend == "sdpa":
            out = sdpa_attention(query, key, value, mask, causal=False, scale=1.0)  # (B, N, H, d)
        else:
            out = eager_attention(query, key, value, mask)
        return self.o_proj(out.reshape(batch, length, -1))


class VisionMLP(nn.Module):
    """GeGLU with clippable linears: ``down(gelu_tanh(gate(x)) * up(x))``."""

    def __init__(self, config: VisionConfig):
        super().__init__()
        d, i, clipped = config.hidden_size, config.intermediate_size, config.use_clipped_linears
        self.gate_proj = ClippableLinear(d, i, clipped)
        self.up_proj = ClippableLinear(d, i, clipped)
        self.down_proj = ClippableLinear(i, d, clipped)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(gelu_tanh(self.gate_proj(x)) * self.up_proj(x))


class EncoderLayer(nn.Module):
    def __init__(self, config: VisionConfig, attention: str):
        super().__init__()
        d, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = RMSNorm(d, eps)
        self.self_attn = VisionAttention(config, attention)
        self.post_attention_layernorm = RMSNorm(d, eps)
        self.pre_feedforward_layernorm = RMSNorm(d, eps)
        self.mlp = VisionMLP(config)
        self.post_feedforward_layernorm = RMSNorm(d, eps)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor | None
    ) -> torch.Tensor:
        x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), cos, sin, mask))
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class Encoder(nn.Module):
    def __init__(self, config: VisionConfig, attention: str = "sdpa"):
        super().__init__()
        self.config = config
        self.layers = nn.ModuleList(EncoderLayer(config, attention) for _ in range(config.num_hidden_layers))

    @property
    def attention(self) -> str:
        return self.layers[0].self_attn.backend

    def padding_mask(self, padding: torch.Tensor, dtype: torch.dtype) -> torch.Tensor | None:
        """Padding patches (B, N) hidden from every query as keys, (B, 1, 1, N) in the form the
        backend takes: None without padding (as transformers' ``create_bidirectional_mask``);
        sdpa: True-to-attend; eager: additive. (transformers' sdpa mask is (B, 1, N, N); the
        kernel gives the same bits with the broadcast row, without N² memory.)"""
        if not padding.any():
            return None
        keys = padding[:, None, None, :]
        if self.attention == "sdpa":
            return ~keys
        zero = torch.zeros((), dtype=dtype, device=padding.device)
        return torch.where(keys, torch.finfo(dtype).min, zero)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, padding: torch.Tensor) -> torch.Tensor:
        cfg = self.config
        mask = self.padding_mask(padding, x.dtype)
        # Padding positions (-1, -1) go into the angles unclamped; their rows are dropped later.
        cos, sin = axial_rope_cos_sin(positions, cfg.head_dim, cfg.rope_theta, x.dtype)
        for layer in self.layers:
            x = layer(x, cos, sin, mask)
        return x


# ── pooling into soft tokens ─────────────────────────────────────────────────────────────────


def pool(
    x: torch.Tensor, positions: torch.Tensor, padding: torch.Tensor, kernel: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Average each kernel×kernel block of patches: (B, N, D) -> (B, N/k², D) float32, and which are real.

    The average is a float32 matmul with weights 1/k², rounded to the model dtype, then scaled by √D
    in float32, exactly as the reference (its sum order is what bf16 parity needs).
    """
    batch, num_patches, d = x.shape
    if num_patches % kernel**2:
        raise ValueError(f"{num_patches} patches per image cannot be pooled {kernel}x{kernel}")
    length = num_patches // kernel**2
    x = x.masked_fill(padding[..., None], 0.0)
    where = positions.clamp(min=0)
    grid_width = where[..., 0].max(dim=-1, keepdim=True)[0] + 1  # patches per row, per image
    cell = torch.div(where, kernel, rounding_mode="floor")
    index = cell[..., 0] + (grid_width // kernel) * cell[..., 1]  # soft token of each patch, raster order
    weights = F.one_hot(index.long(), length).float() / kernel**2  # (B, N, N/k²)
    pooled = (weights.transpose(1, 2) @ x.float()).to(x.dtype)  # (B, N/k², D)
    real = torch.logical_not((weights == 0).all(dim=1))  # (B, N/k²): cells that got any patch
    return pooled.float() * d**0.5, real


class VisionTower(nn.Module):
    """Patches -> soft tokens (n_soft, D) in the model dtype, concatenated over images in order.

    ``attention``: the encoder's backend (``"sdpa"`` or ``"eager"``), as the text decoder's.
    """

    def __init__(self, config: VisionConfig, attention: str = "sdpa"):
        super().__init__()
        if attention not in ATTENTION_BACKENDS:
            raise ValueError(
                f"unknown attention backend {attention!r}; use one of {', '.join(ATTENTION_BACKENDS)}"
            )
        self.config = config
        self.patch_embedder = PatchEmbedder(config)
        self.encoder = Encoder(config, attention)
        if config.standardize:
            self.register_buffer("std_bias", torch.zeros(config.hidden_size))
            self.register_buffer("std_scale", torch.ones(config.hidden_size))

    def set_attention(self, backend: str) -> None:
        if backend not in ATTENTION_BACKENDS:
            raise ValueError(
                f"unknown attention backend {backend!r}; use one of {', '.join(ATTENTION_BACKENDS)}"
            )
        for layer in self.encoder.layers:
            layer.self_attn.backend = backend

    def forward(self, pixel_values: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """pixel_values (B, N, 3p²) in [0, 1], positions (B, N, 2) (x, y) -> (n_soft, D)."""
        padding = (positions == -1).all(dim=-1)  # (B, N)
        x = self.patch_embedder(pixel_values, positions, padding)
        dtype = x.dtype
        x = self.encoder(x, positions, padding)
        pooled, real = pool(x, positions, padding, self.config.pooling_kernel_size)
        soft = pooled[real]  # (n_soft, D) float32
        if self.config.standardize:
            # In float32: the bias cancels large values before the cast.
            soft = (soft - self.std_bias.float()) * self.std_scale.float()
        return soft.to(dtype)
