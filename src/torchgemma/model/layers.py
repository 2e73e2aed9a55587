"""Parts shared by the towers: RMSNorm, rotary embeddings, the gated MLP, eager attention.

Each operation follows the reference's order of floating-point operations: the same formula computed
in another order differs in the last bit, and bf16 parity is bit-for-bit.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    """RMSNorm computed in float32; Gemma 4 stores the scale itself (no ``1 + w``).

    ``plus_one`` is the Gemma 1-3 variant: the checkpoint stores ``w`` and the scale is ``1 + w``,
    normalised with rsqrt, as in transformers' Gemma3RMSNorm.
    """

    def __init__(self, dim: int, eps: float = 1e-6, with_scale: bool = True, plus_one: bool = False):
        super().__init__()
        self.eps = eps
        self.with_scale = with_scale
        self.plus_one = plus_one
        if with_scale:
            self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # float32 for bf16/fp32 as the reference; a float64 model stays float64.
        xf = x.to(torch.promote_types(x.dtype, torch.float32))
        if self.plus_one:
            normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
            return (normed * (1.0 + self.weight.to(xf.dtype))).type_as(x)
        # pow(., -0.5) rather than rsqrt: the reference chose it to agree with JAX, and rsqrt can
        # differ in the last ulp.
        normed = xf * torch.pow(xf.pow(2).mean(-1, keepdim=True) + self.eps, -0.5)
        if self.with_scale:
            normed = normed * self.weight.to(xf.dtype)
        return normed.type_as(x)


def rounded_scales(value: float, rounded: bool = True) -> dict[torch.dtype, float]:
    """``value`` rounded to each float dtype: the reference keeps such scales as tensors of the
    model's dtype (``rounded=False``: a Python float, the same for every dtype). Computed once, so
    a forward pass reads a constant (no tensor-to-float sync)."""
    dtypes = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
    if not rounded:
        return dict.fromkeys(dtypes, float(value))
    # On the CPU explicitly: models are built under a meta-device context.
    scales = {dtype: float(torch.tensor(value, device="cpu").to(dtype)) for dtype in dtypes}
    scales[torch.float64] = float(value)  # a float64 model keeps the exact value
    return scales


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


def normal_quantile(p: float, dtype: torch.dtype = torch.float32) -> float:
    """The standard normal's ``p``-quantile, ``erfinv(2p - 1) * sqrt(2)``, computed in ``dtype``: in
    float32 it is ``torch.distributions.Normal(0, 1).icdf``'s value, as the reference computes it."""
    value = torch.tensor(p, dtype=dtype, device="cpu")  # CPU: models are built on meta
    return float(torch.erfinv(2 * value - 1) * math.sqrt(2))


def gaussian_topk(x: torch.Tensor, multiplier: float) -> torch.Tensor:
    """Keep what exceeds mean + ``multiplier`` std (over the last dimension), less that cutoff:
    of normally distributed values, the top ``1 - p`` for ``multiplier`` the p-quantile. In the
    activations' dtype (mean, std and cutoff included), as the reference."""
    mean = torch.mean(x, dim=-1, keepdim=True)
    std = torch.std(x, dim=-1, keepdim=True, unbiased=False)
    return F.relu(x - (mean + std * multiplier))


class GatedMLP(nn.Module):
    """GeGLU: ``down(gelu_tanh(gate(x)) * up(x))``.

    ``activation_sparsity`` p > 0 (Gemma 3n's first layers): the gate keeps only its activations
    above the p-quantile of a normal fit to them (``gaussian_topk``) before the GELU.
    """

    def __init__(self, hidden_size: int, intermediate_size: int, activation_sparsity: float = 0.0):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)
        self.activation_sparsity = activation_sparsity
        if activation_sparsity > 0:
            # The quantile is computed in float32 and rounded to the activations' dtype (a float64
            # model computes it in float64).
            self.std_multiplier = rounded_scales(normal_quantile(activation_sparsity))
            self.std_multiplier[torch.float64] = normal_quantile(activation_sparsity, torch.float64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate = self.gate_proj(x)
        if self.activation_sparsity > 0:
            gate = gaussian_topk(gate, self.std_multiplier[gate.dtype])
        return self.down_proj(self.activate(gate, self.up_proj(x)))

    def activate(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """The GeGLU gating: ``gelu_tanh(gate) * up``."""
        return gelu_tanh(gate) * up


def repeat_heads(x: torch.Tensor, groups: int) -> torch.Tensor:
    """(B, Hkv, S, D) -> (B, Hkv * groups, S, D): each key/value head for ``groups`` consecutive query
    heads, as transformers' ``repeat_kv``."""
    b, hkv, s, d = x.shape
    return x[:, :, None].expand(b, hkv, groups, s, d).reshape(b, hkv * groups, s, d)


def eager_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float = 1.0,
) -> torch.Tensor:
    """Softmax attention with an additive mask, in the reference's order of operations.

    query (B, H, T, D); key/value (B, Hkv, S, D); mask (B, 1, T, S) or None. Returns (B, T, H, D).
    """
    groups = query.shape[1] // key.shape[1]
    if groups > 1:
        key, value = repeat_heads(key, groups), repeat_heads(value, groups)
    scores = torch.matmul(query, key.transpose(2, 3))  # (B, H, T, S)
    if scale != 1.0:  # multiplying by 1.0 is exact: skip it
        scores = scores * scale
    if mask is not None:
        scores = scores + mask
    # Softmax in float32, then back to the model dtype before the product with V, as the reference
    # (float64 stays float64: its mask minimum would overflow float32 to -inf).
    probs = F.softmax(scores, dim=-1, dtype=torch.promote_types(scores.dtype, torch.float32)).to(query.dtype)
    return torch.matmul(probs, value).transpose(1, 2).contiguous()


def rope_cos_sin(
    inv_freq: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables ``(B, T, D)`` for integer ``positions`` ``(B, T)``.

    Angles are computed in float32 from float32 frequencies and only then rounded to the model
    dtype; the rotation itself runs in the model dtype, as in the reference. A float64 model
    computes them in float64 (from float64 frequencies).
    """
    compute = torch.promote_types(dtype, torch.float32)
    angles = positions[..., None].to(compute) * inv_freq.to(compute)  # (B, T, D/2)
    angles = torch.cat((angles, angles), dim=-1)  # (B, T, D)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    # Half-split pairing: dimension j rotates with j + D/2 (not interleaved pairs).
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` ``(B, T, H, D)`` by tables ``(B, T, D)``."""
    cos, sin = cos.unsqueeze(2), sin.unsqueeze(2)
    return (x * cos) + (rotate_half(x) * sin)
