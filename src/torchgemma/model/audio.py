"""The Gemma 4 audio tower (E2B/E4B), in reading order: a USM-style conformer.

    log-mel features (B, T, F), frame mask (B, T)
      ─ subsampling: 2 × [zero invalid frames, conv 3×3 stride 2, LayerNorm, ReLU]   (B, C1, T/4, F/4)
      ─ flatten (frequency-major, channel fastest), input_proj_linear                  (B, T/4, D)
      ─ conformer layers:  ½·FFN  →  chunked local self-attention  →  light conv  →  ½·FFN  →  norm
      ─ output_proj (with bias)                                                        (B, T/4, D_out)
    and the subsampled frame mask (B, T/4); ``embed_audio`` (multimodal.py) takes the frames to the
    text width and the model keeps the valid ones.

Checkpoint prefix ``model.audio_tower.``. The reference (transformers 5.23, ``Gemma4AudioModel``)
runs attention in float32 and only eagerly; every op below follows its order and dtypes.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ..config import AudioConfig
from .layers import RMSNorm
from .multimodal import ClippableLinear

# ── subsampling ──────────────────────────────────────────────────────────────────────────────


class SubsampleLayer(nn.Module):
    """Conv 3×3 stride 2 over (time, frequency), LayerNorm over channels (no bias), ReLU."""

    def __init__(self, in_channels: int, out_channels: int, eps: float):
        super().__init__()
        self.conv = nn.Conv2d(in_channels, out_channels, kernel_size=3, stride=2, padding=1, bias=False)
        self.norm = nn.LayerNorm(out_channels, eps=eps, bias=False)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x (B, C, T, F), mask (B, T) -> (B, C', ceil(T/2), ceil(F/2)), mask (B, ceil(T/2))."""
        x = x * mask[:, None, :, None]  # invalid frames contribute nothing to the convolution
        x = self.conv(x.to(self.conv.weight.dtype))
        x = F.relu(self.norm(x.permute(0, 2, 3, 1)).permute(0, 3, 1, 2).contiguous())
        return x, mask[:, ::2]


class SubsampleConvProjection(nn.Module):
    def __init__(self, config: AudioConfig):
        super().__init__()
        c0, c1 = config.subsampling_conv_channels
        self.layer0 = SubsampleLayer(1, c0, config.rms_norm_eps)
        self.layer1 = SubsampleLayer(c0, c1, config.rms_norm_eps)
        # The reference sizes this from the channels: it assumes F/4 == c0/4 (128 mel bins, c0 = 128).
        self.input_proj_linear = nn.Linear((c0 // 4) * c1, config.hidden_size, bias=False)

    def forward(self, features: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """features (B, T, F), mask (B, T) -> (B, T', D), mask (B, T') with T' = ceil(ceil(T/2)/2)."""
        x, mask = self.layer0(features[:, None], mask)
        x, mask = self.layer1(x, mask)
        batch, _, frames, _ = x.shape
        x = x.permute(0, 2, 3, 1).contiguous().reshape(batch, frames, -1)  # (B, T', F/4 · C1)
        return self.input_proj_linear(x), mask


# ── conformer parts ──────────────────────────────────────────────────────────────────────────


def clip_value(config: AudioConfig, dtype: torch.dtype) -> float:
    # The trained bound (1e10) or, for narrow dtypes, the largest finite value.
    return min(config.gradient_clipping, torch.finfo(dtype).max)


class FeedForward(nn.Module):
    """Macaron half-step: ``x + residual_weight · post_norm(W2 silu(W1 pre_norm(x)))``."""

    def __init__(self, config: AudioConfig):
        super().__init__()
        self.config = config
        d, clipped = config.hidden_size, config.use_clipped_linears
        self.ffw_layer_1 = ClippableLinear(d, 4 * d, clipped)
        self.ffw_layer_2 = ClippableLinear(4 * d, d, clipped)
        self.pre_layer_norm = RMSNorm(d, config.rms_norm_eps)
        self.post_layer_norm = RMSNorm(d, config.rms_norm_eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        clip = clip_value(self.config, x.dtype)
        h = self.pre_layer_norm(torch.clamp(x, -clip, clip))
        h = self.ffw_layer_2(F.silu(self.ffw_layer_1(h)))
        h = self.post_layer_norm(torch.clamp(h, -clip, clip))
        return h * self.config.residual_weight + x


def relative_position_embedding(config: AudioConfig, dtype: torch.dtype, device) -> torch.Tensor:
    """Sinusoids (1, R, D) for relative distances R-1, ..., 1, 0 (sin half, then cos half).

    The reference keeps the timescales as a buffer in the model dtype, so in a bf16 model the
    angles and their sin/cos are computed in bf16 (float32 here would move the features).
    """
    context = config.attention_chunk_size + config.attention_context_left - 1 + config.attention_context_right
    num_timescales = config.hidden_size // 2
    increment = math.log(10_000.0) / max(num_timescales - 1, 1)
    inv_timescales = torch.exp(torch.arange(num_timescales, device=device) * -increment).to(dtype)
    distances = torch.arange(context // 2, -1, -1, device=device)[:, None]
    angles = distances * inv_timescales[None, None]  # (1, R, D/2)
    return torch.cat((torch.sin(angles), torch.cos(angles)), dim=-1).to(dtype)


class AudioAttention(nn.Module):
    """Chunked local self-attention with a learned relative-position term, all in float32.

    Queries are cut into chunks of C frames; each chunk attends to a context of C + P + F frames
    (P = context_left − 1 past, F = context_right future), of which a query may use the keys at
    distance 0 ≤ q − k < P (F = 0 for the published models): 12 keys including itself.
    """

    def __init__(self, config: AudioConfig):
        super().__init__()
        self.config = config
        d, heads, clipped = config.hidden_size, config.num_attention_heads, config.use_clipped_linears
        self.num_heads, self.head_dim = heads, config.head_dim
        self.chunk = config.attention_chunk_size
        self.past = config.attention_context_left - 1
        self.future = config.attention_context_right
        self.context = self.chunk + self.past + self.future
        self.q_proj = ClippableLinear(d, d, clipped)
        self.k_proj = ClippableLinear(d, d, clipped)
        self.v_proj = ClippableLinear(d, d, clipped)
        self.post = ClippableLinear(d, d, clipped)
        self.relative_k_proj = nn.Linear(d, d, bias=False)
        self.per_dim_scale = nn.Parameter(torch.zeros(self.head_dim))

    def _chunks(self, x: torch.Tensor) -> torch.Tensor:
        """(B, T, H, d) -> (B, nb, C, H, d): queries, zero-padded to whole chunks."""
        batch, length, heads, dim = x.shape
        blocks = -(-length // self.chunk)
        x = F.pad(x, (0, 0, 0, 0, 0, blocks * self.chunk - length))
        return x.reshape(batch, blocks, self.chunk, heads, dim).contiguous()

    def _contexts(self, x: torch.Tensor) -> torch.Tensor:
        """(B, T, H, d) -> (B, nb, K, H, d): chunk b sees frames b·C − P ... b·C + C + F − 1."""
        x = F.pad(x, (0, 0, 0, 0, self.past, self.future + self.chunk - 1))
        x = x.unfold(1, self.context, self.chunk)  # (B, nb, H, d, K)
        return torch.movedim(x, -1, 2).contiguous()

    def _rel_shift(self, x: torch.Tensor) -> torch.Tensor:
        """(B, H, nb, C, R) scores by distance -> (B, H, nb, C, K) by context slot (Transformer-XL)."""
        batch, heads, blocks, chunk, num_distances = x.shape
        x = F.pad(x, (0, self.context + 1 - num_distances))
        x = x.view(batch, heads, blocks, chunk * (self.context + 1))[..., : chunk * self.context]
        return x.view(batch, heads, blocks, chunk, self.context)

    def forward(self, x: torch.Tensor, position: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
        """x (B, T, D), position (1, R, D), allowed (B, 1, nb, C, K) -> (B, T, D)."""
        batch, length, _ = x.shape
        shape = (batch, length, self.num_heads, self.head_dim)
        query = self.q_proj(x).float().view(shape)
        key = self.k_proj(x).float().view(shape)
        value = self.v_proj(x).float().view(shape)
        # A learned per-channel temperature (softplus(0) · 1/ln2 = 1 gives plain 1/√d), and keys
        # scaled by softplus(1)/ln2, as trained.
        query = query * (self.head_dim**-0.5 / math.log(2)) * F.softplus(self.per_dim_scale)
        key = key * (math.log(1 + math.e) / math.log(2))

        query = self._chunks(query).permute(0, 3, 1, 2, 4)  # (B, H, nb, C, d)
        key = self._contexts(key)  # (B, nb, K, H, d)
        value = self._contexts(value)
        blocks = query.shape[2]
        relative = self.relative_k_proj(position).view(-1, self.num_heads, self.head_dim).float()  # (R, H, d)

        content = query @ key.permute(0, 3, 1, 4, 2)  # (B, H, nb, C, K)
        by_distance = query.reshape(batch, self.num_heads, -1, self.head_dim) @ relative.permute(1, 2, 0)
        by_distance = by_distance.reshape(batch, self.num_heads, blocks, self.chunk, -1)  # (B, H, nb, C, R)
        scores = content + self._rel_shift(by_distance)
        cap = self.config.attention_logit_cap
        scores = torch.tanh(scores / cap) * cap
        # A large finite value rather than -inf, as trained; rows with no valid key stay finite.
        scores = scores.masked_fill(~allowed, self.config.attention_invalid_logits_value)
        probs = F.softmax(scores, dim=-1, dtype=torch.float32)
        out = probs @ value.permute(0, 3, 1, 2, 4)  # (B, H, nb, C, d)
        out = out.permute(0, 2, 3, 1, 4).reshape(batch, blocks * self.chunk, -1)[:, :length]
        return self.post(out.contiguous().to(x.dtype))


class LightConv(nn.Module):
    """GLU, causal depthwise conv over time, norm, SiLU, projection; with a residual."""

    def __init__(self, config: AudioConfig):
        super().__init__()
        self.config = config
        d, clipped = config.hidden_size, config.use_clipped_linears
        self.pre_layer_norm = RMSNorm(d, config.rms_norm_eps)
        self.linear_start = ClippableLinear(d, 2 * d, clipped)
        self.depthwise_conv1d = nn.Conv1d(d, d, config.conv_kernel_size, groups=d, bias=False)
        self.conv_norm = RMSNorm(d, config.rms_norm_eps)
        self.linear_end = ClippableLinear(d, d, clipped)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.glu(self.linear_start(self.pre_layer_norm(x)), dim=-1)  # (B, T, D)
        # Causal: pad kernel − 1 frames on the left only.
        h = F.pad(h.transpose(1, 2), (self.config.conv_kernel_size - 1, 0))
        h = self.depthwise_conv1d(h).transpose(1, 2)
        clip = clip_value(self.config, h.dtype)
        h = self.conv_norm(torch.clamp(h, -clip, clip))
        return self.linear_end(F.silu(h)) + x


class ConformerLayer(nn.Module):
    def __init__(self, config: AudioConfig):
        super().__init__()
        self.config = config
        d = config.hidden_size
        self.feed_forward1 = FeedForward(config)
        self.norm_pre_attn = RMSNorm(d, config.rms_norm_eps)
        self.self_attn = AudioAttention(config)
        self.norm_post_attn = RMSNorm(d, config.rms_norm_eps)
        self.lconv1d = LightConv(config)
        self.feed_forward2 = FeedForward(config)
        self.norm_out = RMSNorm(d, config.rms_norm_eps)

    def forward(self, x: torch.Tensor, position: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
        clip = clip_value(self.config, self.norm_pre_attn.weight.dtype)
        x = self.feed_forward1(x)
        attn = self.self_attn(self.norm_pre_attn(torch.clamp(x, -clip, clip)), position, allowed)
        x = self.norm_post_attn(torch.clamp(attn, -clip, clip)) + x
        x = self.feed_forward2(self.lconv1d(x))
        return self.norm_out(torch.clamp(x, -clip, clip))


def chunked_attention_mask(config: AudioConfig, valid: torch.Tensor) -> torch.Tensor:
    """(B, 1, nb, C, K) True where query frame q may attend to context slot k of its chunk.

    Slot o of chunk b is frame b·C + o − P. Allowed: that frame exists and is valid, the query is
    a real frame, and 0 ≤ q − k < P (or 0 < k − q < F for look-ahead).
    """
    batch, length = valid.shape
    chunk, past, future = (
        config.attention_chunk_size,
        config.attention_context_left - 1,
        config.attention_context_right,
    )
    blocks = -(-length // chunk)
    device = valid.device
    query = (torch.arange(blocks, device=device)[:, None] * chunk + torch.arange(chunk, device=device))[
        :, :, None
    ]  # (nb, C, 1)
    key = (
        torch.arange(blocks, device=device)[:, None] * chunk
        + torch.arange(chunk + past + future, device=device)
        - past
    )[:, None, :]  # (nb, 1, K)
    distance = query - key
    window = ((distance >= 0) & (distance < past)) | ((distance < 0) & (-distance < future))
    in_range = (key >= 0) & (key < length) & (query < length)  # (nb, C, K)
    key_valid = valid[:, key.clamp(0, length - 1)]  # (B, nb, 1, K)
    return (window & in_range)[None, None] & key_valid[:, None]


class AudioTower(nn.Module):
    """Log-mel features -> frames (B, T', D_out) and their validity (B, T')."""

    def __init__(self, config: AudioConfig):
        super().__init__()
        self.config = config
        self.subsample_conv_projection = SubsampleConvProjection(config)
        self.layers = nn.ModuleList(ConformerLayer(config) for _ in range(config.num_hidden_layers))
        self.output_proj = nn.Linear(config.hidden_size, config.output_proj_dims, bias=True)

    def forward(self, features: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """features (B, T, F) float32 from the processor, mask (B, T) True = real frame."""
        x, valid = self.subsample_conv_projection(features, mask.to(torch.bool))
        position = relative_position_embedding(self.config, x.dtype, x.device)
        allowed = chunked_attention_mask(self.config, valid)
        for layer in self.layers:
            x = layer(x, position, allowed)
        return self.output_proj(x), valid
