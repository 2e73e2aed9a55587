"""Gemma 3n's vision tower: MobileNet-V5, a convolutional network with attention in its late stages.

    image (B, 3, 768, 768) ─ stem: 3x3 conv stride 2 ─ RMSNorm ─ GELU                      384 px
    ─ stage 0: edge residuals (full 3x3 conv, 1x1 projection)                              192 px
    ─ stage 1: universal inverted residuals (depthwise ─ 1x1 expand ─ depthwise ─ 1x1)       96 px
    ─ stage 2: inverted residuals, then multi-query attention (keys, values at 1/2 grid)    48 px ─┐
    ─ stage 3: inverted residual, then multi-query attention                                24 px ─┤
    ┌──────────────────────────────────────────────────────────────────────────────────────────────┘
    └ multi-scale fusion adapter: 24 px upsampled to 48 (nearest), concatenated, 1x1 expand ─ GELU
      ─ 1x1 project to 2048 ─ RMSNorm ─ 3x3 average pool to 16 px ─ RMSNorm
      ─ 256 soft tokens of 2048 ─ x √2048 ─ embed_vision (soft tokens) ─ text width

Every norm is an RMS norm over channels (no mean, learned scale), in the input's dtype; every
activation GELU (tanh); every residual block but the edge residuals scales its output per channel
(layer scale) before the shortcut. A strided convolution pads as TensorFlow's "SAME" (the extra pixel
after, not before); a stride-1 convolution pads evenly.

Checkpoint prefix ``model.vision_tower.timm_model.``. The reference is timm 1.0's
``mobilenetv5_300m_enc`` (``timm/models/mobilenetv5.py``, with its blocks from
``_efficientnet_blocks.py`` and ``layers/attention2d.py``), which transformers wraps
(``TimmWrapperModel``); each step keeps its order of floating-point operations, so that bf16 outputs
agree to the bit. The block list is data (config/gemma3n_vision.py).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ..config.gemma3n_vision import Gemma3nVisionConfig, MobileNetBlock, make_divisible

# ── small parts: norm, convolution, layer scale ──────────────────────────────────────────────────


class RMSNorm2d(nn.Module):
    """RMS norm over the channels of (B, C, H, W), computed in the input's dtype (as timm's
    ``rms_norm2d``); then GELU (tanh) if ``act``."""

    def __init__(self, channels: int, eps: float = 1e-6, act: bool = False):
        super().__init__()
        self.eps = eps
        self.act = act
        self.weight = nn.Parameter(torch.ones(channels))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x * torch.rsqrt(torch.mean(x.pow(2), dim=1, keepdim=True) + self.eps)
        x = x * self.weight.reshape(1, -1, 1, 1)
        return F.gelu(x, approximate="tanh") if self.act else x


def same_padding(size: int, kernel: int, stride: int) -> tuple[int, int]:
    """TensorFlow's "SAME" padding of one side: (before, after), the odd pixel after."""
    total = max((math.ceil(size / stride) - 1) * stride + kernel - size, 0)
    return total // 2, total - total // 2


class SameConv2d(nn.Conv2d):
    """A convolution padded as TensorFlow's "SAME" (timm's ``padding='same'``): evenly, fixed, at
    stride 1; by the input's size at stride 2 (``Conv2dSame``)."""

    def __init__(self, in_ch: int, out_ch: int, kernel: int, stride: int = 1, groups: int = 1, bias=False):
        fixed = (kernel - 1) // 2 if stride == 1 else 0
        super().__init__(in_ch, out_ch, kernel, stride, padding=fixed, groups=groups, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.stride[0] > 1:
            kernel, stride = self.kernel_size[0], self.stride[0]
            top, bottom = same_padding(x.shape[-2], kernel, stride)
            left, right = same_padding(x.shape[-1], kernel, stride)
            x = F.pad(x, (left, right, top, bottom))
        return super().forward(x)


class ConvNorm(nn.Module):
    """Convolution ─ RMS norm (─ GELU). Checkpoint names ``conv``, ``bn`` (timm's ConvNormAct)."""

    def __init__(self, in_ch, out_ch, kernel, stride=1, groups=1, act=True, bias=False):
        super().__init__()
        self.conv = SameConv2d(in_ch, out_ch, kernel, stride, groups, bias)
        self.bn = RMSNorm2d(out_ch, act=act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.bn(self.conv(x))


class LayerScale2d(nn.Module):
    def __init__(self, channels: int):
        super().__init__()
        self.gamma = nn.Parameter(torch.ones(channels))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.gamma.view(1, -1, 1, 1)


# ── blocks ────────────────────────────────────────────────────────────────────────────────────


class EdgeResidual(nn.Module):
    """k x k conv to ``expansion`` x the channels ─ norm ─ GELU ─ 1x1 projection ─ norm (─ + input)."""

    def __init__(self, in_ch: int, block: MobileNetBlock):
        super().__init__()
        mid = make_divisible(in_ch * block.expansion)
        self.has_skip = in_ch == block.out_channels and block.stride == 1 and not block.noskip
        self.conv_exp = SameConv2d(in_ch, mid, block.kernel, block.stride)
        self.bn1 = RMSNorm2d(mid, act=True)
        self.conv_pwl = SameConv2d(mid, block.out_channels, 1)
        self.bn2 = RMSNorm2d(block.out_channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.bn2(self.conv_pwl(self.bn1(self.conv_exp(x))))
        return out + x if self.has_skip else out


class UniversalInvertedResidual(nn.Module):
    """[depthwise start] ─ 1x1 expand ─ GELU ─ [depthwise middle ─ GELU] ─ 1x1 project ─ [depthwise
    end] ─ layer scale (─ + input); each conv followed by a norm. The stride goes to the first
    depthwise conv of the middle, start, end. The adapter's has no depthwise convs, no layer scale."""

    def __init__(self, in_ch: int, block: MobileNetBlock, layer_scale: bool = True):
        super().__init__()
        out, stride = block.out_channels, block.stride
        mid = make_divisible(in_ch * block.expansion)
        self.has_skip = in_ch == out and stride == 1 and not block.noskip
        start_stride = stride if not block.kernel else 1
        end_stride = stride if not block.kernel and not block.start_kernel else 1
        self.dw_start = (
            ConvNorm(in_ch, in_ch, block.start_kernel, start_stride, groups=in_ch, act=False)
            if block.start_kernel
            else nn.Identity()
        )
        self.pw_exp = ConvNorm(in_ch, mid, 1)
        self.dw_mid = ConvNorm(mid, mid, block.kernel, stride, groups=mid) if block.kernel else nn.Identity()
        self.pw_proj = ConvNorm(mid, out, 1, act=False)
        self.dw_end = (
            ConvNorm(out, out, block.end_kernel, end_stride, groups=out, act=False)
            if block.end_kernel
            else nn.Identity()
        )
        self.layer_scale = LayerScale2d(out) if layer_scale else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.dw_end(self.pw_proj(self.dw_mid(self.pw_exp(self.dw_start(x)))))
        out = self.layer_scale(out)
        return out + x if self.has_skip else out


class KeyValueProjection(nn.Module):
    """[strided depthwise conv ─ norm] ─ 1x1 to one head's width (shared by all query heads)."""

    def __init__(self, channels: int, width: int, kernel: int, stride: int):
        super().__init__()
        if stride > 1:
            self.down_conv = SameConv2d(channels, channels, kernel, stride, groups=channels)
            self.norm = RMSNorm2d(channels)
        self.proj = SameConv2d(channels, width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if hasattr(self, "down_conv"):
            x = self.norm(self.down_conv(x))
        return self.proj(x)


class MultiQueryAttention2d(nn.Module):
    """Attention over the pixels: ``num_heads`` query heads, one key and one value head, keys and
    values on a grid ``kv_stride`` times coarser. Checkpoint names ``query.proj``, ``key.*``,
    ``value.*``, ``output.proj``."""

    def __init__(self, channels: int, block: MobileNetBlock):
        super().__init__()
        self.num_heads, self.key_dim = block.num_heads, block.key_dim
        self.query = nn.Module()
        self.query.proj = SameConv2d(channels, block.num_heads * block.key_dim, 1)
        self.key = KeyValueProjection(channels, block.key_dim, block.kernel, block.kv_stride)
        self.value = KeyValueProjection(channels, block.key_dim, block.kernel, block.kv_stride)
        self.output = nn.Module()
        self.output.proj = SameConv2d(block.num_heads * block.key_dim, block.out_channels, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, _, height, width = x.shape
        query = self.query.proj(x).reshape(batch, self.num_heads, self.key_dim, -1)
        query = query.transpose(-1, -2).contiguous()  # (B, heads, HW, d)
        key = self.key(x).reshape(batch, self.key_dim, -1).transpose(1, 2).unsqueeze(1).contiguous()
        value = self.value(x).reshape(batch, self.key_dim, -1).transpose(1, 2).unsqueeze(1).contiguous()
        # timm's default path (fused attention); transformers' attn_implementation does not reach it.
        out = F.scaled_dot_product_attention(query, key, value)  # (B, heads, HW, d); keys (B, 1, hw, d)
        out = out.transpose(1, 2).reshape(batch, height, width, -1).permute(0, 3, 1, 2).contiguous()
        return self.output.proj(out)


class MobileAttention(nn.Module):
    """norm ─ multi-query attention ─ layer scale (─ + input)."""

    def __init__(self, in_ch: int, block: MobileNetBlock):
        super().__init__()
        self.has_skip = in_ch == block.out_channels and block.stride == 1 and not block.noskip
        self.norm = RMSNorm2d(in_ch)
        self.attn = MultiQueryAttention2d(in_ch, block)
        self.layer_scale = LayerScale2d(block.out_channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.layer_scale(self.attn(self.norm(x)))
        return out + x if self.has_skip else out


BLOCKS = {"er": EdgeResidual, "uir": UniversalInvertedResidual, "mqa": MobileAttention}

# ── the multi-scale fusion adapter ───────────────────────────────────────────────────────────────


class MultiScaleFusionAdapter(nn.Module):
    """The last two stages' maps, the coarser upsampled (nearest) to the finer, concatenated over
    channels ─ an inverted residual without depthwise convs or shortcut to ``hidden_size`` ─ resized
    to the output grid (average pooling when it divides, else bilinear) ─ norm."""

    def __init__(self, in_ch: int, config: Gemma3nVisionConfig):
        super().__init__()
        self.output_resolution = config.msfa_output_resolution
        ffn = MobileNetBlock("uir", config.hidden_size, 1, expansion=2.0, noskip=True)
        self.ffn = UniversalInvertedResidual(in_ch, ffn, layer_scale=False)
        self.norm = RMSNorm2d(config.hidden_size)

    def forward(self, maps: list[torch.Tensor]) -> torch.Tensor:
        size = maps[0].shape[-2:]
        resized = [
            F.interpolate(m, size=size, mode="nearest")
            if m.shape[-2] < size[0] or m.shape[-1] < size[1]
            else m
            for m in maps
        ]
        x = self.ffn(torch.cat(resized, dim=1))
        side = self.output_resolution
        if tuple(size) != (side, side):
            if size[0] % side or size[1] % side:
                x = F.interpolate(x, size=(side, side), mode="bilinear")
            else:
                kernel = (size[0] // side, size[1] // side)
                x = F.avg_pool2d(x, kernel_size=kernel, stride=kernel)
        return self.norm(x)


# ── the encoder ─────────────────────────────────────────────────────────────────────────────────


class MobileNetV5Encoder(nn.Module):
    """Pixels (B, 3, H, W) -> the adapter's map (B, hidden_size, side, side)."""

    def __init__(self, config: Gemma3nVisionConfig):
        super().__init__()
        self.conv_stem = ConvNorm(3, config.stem_channels, 3, stride=2, bias=True)
        channels, stages, taps = config.stem_channels, [], []
        for stage in config.stages:
            blocks = []
            for block in stage:
                blocks.append(BLOCKS[block.kind](channels, block))
                channels = block.out_channels
            stages.append(nn.Sequential(*blocks))
            taps.append(channels)
        self.blocks = nn.Sequential(*stages)
        self.msfa_stages = config.msfa_stages
        self.msfa = MultiScaleFusionAdapter(sum(taps[s] for s in self.msfa_stages), config)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        x = self.conv_stem(pixel_values)
        maps = []
        for index, stage in enumerate(self.blocks):
            x = stage(x)
            if index in self.msfa_stages:
                maps.append(x)
        return self.msfa(maps)


class Gemma3nVisionTower(nn.Module):
    """transformers' ``TimmWrapperModel`` around MobileNet-V5: the pixels cast to the model's dtype,
    then the encoder (checkpoint prefix ``vision_tower.timm_model.``)."""

    def __init__(self, config: Gemma3nVisionConfig):
        super().__init__()
        self.config = config
        self.timm_model = MobileNetV5Encoder(config)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """(B, 3, H, W) -> soft tokens (B, side², hidden_size), scaled by √hidden_size as the
        reference does before the embedder."""
        if pixel_values.dim() != 4 or pixel_values.shape[1] != 3:
            raise ValueError(
                f"Gemma 3n's pixel values must be (images, 3, height, width), got {tuple(pixel_values.shape)}"
            )
        weight = self.timm_model.conv_stem.conv.weight
        features = self.timm_model(pixel_values.to(weight.device, weight.dtype))
        batch, hidden = features.shape[:2]
        tokens = features.reshape(batch, hidden, -1).permute(0, 2, 1)
        return tokens * self.config.hidden_size**0.5
