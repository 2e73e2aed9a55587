"""Gemma 3n's audio encoder: a USM-style conformer over log-mel frames.

    mel (B, T, 128) ─ 2 x [Conv2d stride 2 ─ cumulative GroupNorm ─ ReLU] ─ Linear ─┐
    ┌──────────────────────────────────────────────────────────────────────────────┘
    └ N x conformer block: ½ FFN ─ chunked local attention (relative positions, soft-capped)
                           ─ light depthwise conv ─ ½ FFN ─ RMSNorm
      ─ every 4th frame ─ padded frames zeroed ─ embed_audio (soft tokens) ─ text width

Checkpoint prefix ``model.audio_tower.``. The reference is transformers 5.23's
``Gemma3nAudioEncoder`` (``models/gemma3n/modeling_gemma3n.py``); each step keeps its order of
floating-point operations and its dtypes (norms and softmax in float32, the query scale a tensor of
the model's dtype), so that bf16 outputs agree to the bit. Masks here are True for valid frames.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ..config import Gemma3nAudioConfig
from .layers import RMSNorm, rounded_scales

# ── subsampling ─────────────────────────────────────────────────────────────────────────────────


class CumulativeGroupNorm(nn.Module):
    """GroupNorm with one group whose mean and variance accumulate over time: frame t is
    normalised by the statistics of frames 0..t (all frequencies and channels), in float32."""

    def __init__(self, channels: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(channels))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, T, F, C)
        xf = x.float()
        per_frame = x.shape[2] * x.shape[3]
        count = torch.cumsum(torch.full_like(xf[:, :, :1, :1], float(per_frame)), dim=1)
        mean = torch.cumsum(xf.sum(dim=(2, 3), keepdim=True), dim=1) / count.clamp(min=1.0)
        variance = torch.cumsum((xf - mean).pow(2).sum(dim=(2, 3), keepdim=True), dim=1) / count.clamp(
            min=1.0
        )
        normed = (xf - mean) * torch.rsqrt(variance + self.eps) * self.weight.float()
        return normed.to(x.dtype)


class SubsampleConvBlock(nn.Module):
    """Conv2d over (time, frequency), padded by (0, k - 1) in time and (1, 1) in frequency; then
    cumulative GroupNorm and ReLU."""

    def __init__(
        self, in_channels: int, out_channels: int, kernel: tuple[int, int], stride: tuple[int, int], eps
    ):
        super().__init__()
        self.padding = (1, 1, 0, kernel[0] - 1)  # (freq left, freq right, time top, time bottom)
        self.conv = nn.Conv2d(in_channels, out_channels, kernel, stride, bias=False)
        self.norm = CumulativeGroupNorm(out_channels, eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, C, T, F)
        x = self.conv(F.pad(x, self.padding).to(self.conv.weight.dtype))
        x = self.norm(x.permute(0, 2, 3, 1).contiguous())  # (B, T', F', C')
        return F.relu(x.permute(0, 3, 1, 2).contiguous())


class SubsampleConvProjection(nn.Module):
    def __init__(self, config: Gemma3nAudioConfig):
        super().__init__()
        width, channels = config.input_feat_size, 1
        blocks = []
        for out_channels, kernel, stride in zip(
            config.conv_channels, config.conv_kernels, config.conv_strides
        ):
            blocks.append(
                SubsampleConvBlock(channels, out_channels, kernel, stride, config.conv_group_norm_eps)
            )
            width, channels = (width + 2 - kernel[1]) // stride[1] + 1, out_channels
        self.conv_0, self.conv_1 = blocks
        self.input_proj_linear = nn.Linear(width * channels, config.hidden_size, bias=False)

    def forward(self, mel: torch.Tensor) -> torch.Tensor:
        x = self.conv_1(self.conv_0(mel.unsqueeze(1)))  # (B, C, T', F')
        b, c, t, f = x.shape
        return self.input_proj_linear(x.permute(0, 2, 3, 1).contiguous().view(b, t, f * c))


# ── attention ───────────────────────────────────────────────────────────────────────────────────


class RelativePositionEmbedding(nn.Module):
    """Query-key logits plus query-position logits, the positions sinusoids of the distances
    L-1, ..., -R projected per head and shifted into each key's column (Transformer-XL)."""

    def __init__(self, config: Gemma3nAudioConfig):
        super().__init__()
        self.num_heads, self.head_dim = config.num_attention_heads, config.head_dim
        self.max_backward, self.max_forward = config.max_past_horizon, config.context_right
        self.pos_proj = nn.Linear(config.hidden_size, config.hidden_size, bias=False)
        self.timescales = config.hidden_size // 2

    def inv_timescales(self, device: torch.device) -> torch.Tensor:
        """1e4^(-i / (n - 1)) for i < n, in float32 (computed per call: a few values, no buffer to keep)."""
        increment = math.log(1.0e4) / max(self.timescales - 1, 1)
        return torch.exp(torch.arange(self.timescales, device=device) * -increment).float()

    def forward(self, queries: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        # queries (B, U, W, N, D), keys (B, U, C, N, D) -> logits (B, N, U, W, C)
        b, u, w, n, d = queries.shape
        context = keys.shape[2]
        distances = torch.arange(self.max_backward, -self.max_forward - 1, -1, device=queries.device)
        angles = distances.float()[:, None] * self.inv_timescales(queries.device)
        timing = torch.cat([torch.sin(angles), torch.cos(angles)], dim=-1).to(queries.dtype)
        span = distances.numel()
        positions = self.pos_proj(timing[None]).reshape(span, n, d)  # (F, N, D)

        content = torch.matmul(queries.permute(0, 3, 1, 2, 4), keys.permute(0, 3, 1, 4, 2))
        by_position = torch.matmul(
            queries.permute(0, 3, 1, 2, 4).reshape(b, n, u * w, d), positions.permute(1, 2, 0)
        ).reshape(b, n, u, w, span)
        # The relative shift: pad each row to C + 1, flatten, cut, so row i moves i columns right.
        shifted = F.pad(by_position, (0, context + 1 - span)).reshape(b, n, u, w * (context + 1))
        shifted = shifted[..., : w * context].reshape(b, n, u, w, context)
        return content + shifted


class AudioAttention(nn.Module):
    """Chunked local self-attention: chunks of W frames attend to themselves, the L - 1 frames
    before and R after (keys outside the clip's valid frames masked), logits soft-capped."""

    def __init__(self, config: Gemma3nAudioConfig):
        super().__init__()
        self.num_heads, self.head_dim = config.num_attention_heads, config.head_dim
        self.chunk = config.attention_chunk_size
        self.past, self.future = config.max_past_horizon, config.context_right
        self.context = self.chunk + self.past + self.future
        self.logit_cap = config.attention_logit_cap
        self.relative_position_embedding = RelativePositionEmbedding(config)
        self.per_dim_scale = nn.Parameter(torch.zeros(self.head_dim))
        hidden = config.hidden_size
        self.q_proj = nn.Linear(hidden, hidden, bias=False)
        self.k_proj = nn.Linear(hidden, hidden, bias=False)
        self.v_proj = nn.Linear(hidden, hidden, bias=False)
        # D^-1/2 / softplus(0) (softplus(per_dim_scale) is 1 at init), a tensor of the model's dtype there.
        value = float(self.head_dim**-0.5 * (1.0 / F.softplus(torch.tensor(0.0, device="cpu"))))
        self.q_scale = rounded_scales(value)

    def local_mask(self, device: torch.device) -> torch.Tensor:
        """(W, C): query i of a chunk sees context columns i .. i + L - 1 + R."""
        rows, cols = (
            torch.arange(self.chunk, device=device)[:, None],
            torch.arange(self.context, device=device),
        )
        return (cols >= rows) & (cols <= rows + self.past + self.future)

    def blocks(self, x: torch.Tensor) -> torch.Tensor:
        """(B, T, ...) -> (B, U, W, ...), zero-padded to whole chunks."""
        u = -(-x.shape[1] // self.chunk)
        x = torch.cat([x, x.new_zeros((x.shape[0], u * self.chunk - x.shape[1], *x.shape[2:]))], dim=1)
        return x.reshape(x.shape[0], u, self.chunk, *x.shape[2:]).contiguous()

    def block_context(self, x: torch.Tensor) -> torch.Tensor:
        """(B, T, ...) -> (B, U, C, ...): each chunk's frames with L - 1 before and R after, zero-padded."""
        left = x.new_zeros((x.shape[0], self.past, *x.shape[2:]))
        right = x.new_zeros((x.shape[0], self.future + self.chunk - 1, *x.shape[2:]))
        x = torch.cat([left, x, right], dim=1).unfold(1, self.context, self.chunk)
        if x.ndim > 3:
            x = torch.movedim(x, -1, 2)  # (B, U, N, D, C) -> (B, U, C, N, D)
        return x.contiguous()

    def forward(self, x: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        shape = (*x.shape[:-1], self.num_heads, self.head_dim)  # (B, T, N, D)
        query = self.q_proj(x).reshape(shape).contiguous()
        key = self.k_proj(x).reshape(shape).contiguous()
        value = self.v_proj(x).reshape(shape).contiguous()
        query = query * self.q_scale[query.dtype] * F.softplus(self.per_dim_scale).view(1, 1, 1, -1)
        b, t = query.shape[:2]

        query_blocks = self.blocks(query)  # (B, U, W, N, D)
        key_blocks, value_blocks = self.block_context(key), self.block_context(value)  # (B, U, C, N, D)
        u = query_blocks.shape[1]
        allowed = self.block_context(valid)[:, None, :, None, :] & self.local_mask(
            x.device
        )  # (B, 1, U, W, C)

        logits = self.relative_position_embedding(query_blocks, key_blocks)  # (B, N, U, W, C)
        logits = torch.tanh(logits / self.logit_cap) * self.logit_cap
        logits = torch.where(allowed, logits, torch.finfo(logits.dtype).min)
        probs = F.softmax(logits, dim=-1, dtype=torch.float32).to(value_blocks.dtype)

        n, w, c, d = self.num_heads, self.chunk, self.context, self.head_dim
        out = torch.bmm(
            probs.permute(0, 2, 1, 3, 4).reshape(-1, w, c),
            value_blocks.permute(0, 1, 3, 2, 4).reshape(-1, c, d),
        )
        out = out.reshape(b, u, n, w, d).permute(0, 1, 3, 2, 4).reshape(b, u * w, n, d)
        return out[:, :t]  # (B, T, N, D)


# ── the conformer block ─────────────────────────────────────────────────────────────────────────


class ConformerAttention(nn.Module):
    def __init__(self, config: Gemma3nAudioConfig):
        super().__init__()
        self.clip = config.gradient_clipping
        self.pre_attn_norm = RMSNorm(config.hidden_size)
        self.attn = AudioAttention(config)
        self.post = nn.Linear(config.hidden_size, config.hidden_size, bias=False)
        self.post_norm = RMSNorm(config.hidden_size)

    def forward(self, x: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        out = self.attn(self.pre_attn_norm(x.clamp(-self.clip, self.clip)), valid)
        out = self.post(out.reshape(*out.shape[:2], -1)).clamp(-self.clip, self.clip)
        return x + self.post_norm(out)


class ConformerFeedForward(nn.Module):
    """Half-step feed-forward: ``x + 0.5 * norm(W2 silu(W1 norm(x)))``."""

    def __init__(self, config: Gemma3nAudioConfig):
        super().__init__()
        self.clip = config.gradient_clipping
        self.residual_weight = config.residual_weight
        self.pre_layer_norm = RMSNorm(config.hidden_size)
        self.ffw_layer_1 = nn.Linear(config.hidden_size, config.hidden_size * 4, bias=False)
        self.ffw_layer_2 = nn.Linear(config.hidden_size * 4, config.hidden_size, bias=False)
        self.post_layer_norm = RMSNorm(config.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.ffw_layer_1(self.pre_layer_norm(x.clamp(-self.clip, self.clip)))
        out = self.ffw_layer_2(F.silu(out)).clamp(-self.clip, self.clip)
        return x + self.post_layer_norm(out) * self.residual_weight


class ConformerLightConv(nn.Module):
    """GLU, then a causal depthwise convolution over time, norm, SiLU, projection; residual."""

    def __init__(self, config: Gemma3nAudioConfig):
        super().__init__()
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.clip = config.gradient_clipping
        self.pre_layer_norm = RMSNorm(hidden, eps)
        self.linear_start = nn.Linear(hidden, hidden * 2, bias=False)
        self.depthwise_conv1d = nn.Conv1d(hidden, hidden, config.conv_kernel_size, groups=hidden, bias=False)
        self.conv_norm = RMSNorm(hidden, eps)
        self.linear_end = nn.Linear(hidden, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.glu(self.linear_start(self.pre_layer_norm(x)), dim=-1).permute(0, 2, 1)  # (B, H, T)
        out = self.depthwise_conv1d(F.pad(out, (self.depthwise_conv1d.kernel_size[0] - 1, 0)))
        out = out.permute(0, 2, 1).clamp(-self.clip, self.clip)
        return self.linear_end(F.silu(self.conv_norm(out))) + x


class ConformerBlock(nn.Module):
    def __init__(self, config: Gemma3nAudioConfig):
        super().__init__()
        self.clip = config.gradient_clipping
        self.ffw_layer_start = ConformerFeedForward(config)
        self.attention = ConformerAttention(config)
        self.lconv1d = ConformerLightConv(config)
        self.ffw_layer_end = ConformerFeedForward(config)
        self.norm = RMSNorm(config.hidden_size)

    def forward(self, x: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        x = self.attention(self.ffw_layer_start(x), valid)
        x = self.lconv1d(x * valid[..., None].to(x.dtype))  # padded frames zeroed before the conv
        return self.norm(self.ffw_layer_end(x).clamp(-self.clip, self.clip))


# ── the encoder ─────────────────────────────────────────────────────────────────────────────────


class Gemma3nAudioEncoder(nn.Module):
    """Log-mel frames (B, T, F) and their mask (B, T, True = valid) -> encodings (B, T'', H) with
    padded ones zeroed, and their mask (B, T''); T'' is T subsampled by the convolutions' time
    strides, then by the reduction factor."""

    def __init__(self, config: Gemma3nAudioConfig):
        super().__init__()
        self.config = config
        self.subsample_conv_projection = SubsampleConvProjection(config)
        self.conformer = nn.ModuleList(ConformerBlock(config) for _ in range(config.num_hidden_layers))

    def forward(self, mel: torch.Tensor, valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if mel.dim() != 3 or mel.shape[-1] != self.config.input_feat_size:
            raise ValueError(
                f"audio features must be (clips, frames, {self.config.input_feat_size}), got {tuple(mel.shape)}"
            )
        if valid.shape != mel.shape[:2]:
            raise ValueError(f"audio mask has shape {tuple(valid.shape)}, features {tuple(mel.shape)}")
        x = self.subsample_conv_projection(mel)  # (B, T', H)
        # A subsampled frame is valid when the first mel frame of its receptive field is.
        stride = math.prod(s[0] for s in self.config.conv_strides)
        index = (torch.arange(x.shape[1], device=valid.device) * stride).clamp(max=valid.shape[1] - 1)
        valid = valid.bool()[:, index]
        for block in self.conformer:
            x = block(x, valid)
        x, valid = x[:, :: self.config.reduction_factor], valid[:, :: self.config.reduction_factor]
        return x.masked_fill(~valid[..., None], 0.0), valid
