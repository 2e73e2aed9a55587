"""Every ``torchgemma::*`` operator in one table: its schema, its fake (meta) kernel and its
pure-PyTorch reference.

The operators are defined with ``torch.library``, so that ``torch.compile`` sees one opaque node per
call (its shapes from the fake). The reference is each operator's kernel on every device; on the CPU
the C++ kernels (``csrc/``, loaded by ``library.py``) take precedence once loaded. A reference
computes what its C++ kernel computes, step for step where torch's operators allow; where the C++
sums in another order (or in float32 where the reference uses float64), the two differ by float
rounding, and the tests say where and how much.

A quantized weight W (N rows of K values) is stored as integers q with one scale per group of G
consecutive values of a row, and optionally one offset ("min") per group:
``W[n, k] = scales[n, k // G] * q[n, k] + mins[n, k // G]`` (the byte layout: ``pack``, and
``csrc/common.h``); scales and mins are float32 or float16 (both the same), their values always
taken as float32.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

# ── the storage layout ─────────────────────────────────────────────────────────────────────────


def packed_width(features: int, bits: int) -> int:
    """Bytes a row of ``features`` values takes: 1 per value (8 bits), 16 (4 bits) or 20 (5 bits)
    per 32 values."""
    return {8: features, 4: features // 2, 5: features // 32 * 20}[bits]


def features_of(width: int, bits: int) -> int:
    """``packed_width``'s inverse."""
    return {8: width, 4: width * 2, 5: width // 20 * 32}[bits]


def unpack(qweight: torch.Tensor, bits: int) -> torch.Tensor:
    """The integers of a quantized weight, one per value: int8 (bits 8), 0..15 (bits 4) or 0..31
    (bits 5), (N, K)."""
    if bits == 8:
        return qweight
    n, width = qweight.shape
    step = 16 if bits == 4 else 20
    blocks = qweight.view(n, width // step, step)  # per 32 values: 16 bytes of nibbles, low first
    q = torch.cat((blocks[..., :16] & 0x0F, blocks[..., :16] >> 4), dim=-1)
    if bits == 5:  # then 4 bytes: bit j (little-endian) is bit 4 of value j
        shifts = torch.arange(8, dtype=torch.uint8, device=qweight.device)
        high = (blocks[..., 16:, None] >> shifts) & 1
        q = q | (high.reshape(q.shape) << 4)
    return q.reshape(n, features_of(width, bits))


def pack(q: torch.Tensor, bits: int) -> torch.Tensor:
    """``unpack``'s inverse: (N, K) integers -> the stored layout."""
    if bits == 8:
        return q.to(torch.int8).contiguous()
    n, k = q.shape
    blocks = q.to(torch.uint8).view(n, k // 32, 32)
    nibbles = (blocks[..., :16] & 0x0F) | ((blocks[..., 16:] & 0x0F) << 4)
    if bits == 4:
        return nibbles.reshape(n, k // 2).contiguous()
    weights = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8, device=q.device)
    high = ((blocks >> 4) & 1).view(n, k // 32, 4, 8)
    high = (high * weights).sum(-1, dtype=torch.uint8)  # distinct bits: the sum is their OR
    return torch.cat((nibbles, high), dim=-1).reshape(n, k // 32 * 20).contiguous()


# ── references: each operator's arithmetic in torch ─────────────────────────────────────────────


def _dequantize_reference(qweight, scales, mins, bits: int, group_size: int) -> torch.Tensor:
    """Float32 weights on any device: scales * q, then + mins (never fused), as GGML's dequantizers."""
    _check("dequantize", qweight, scales, mins, bits, group_size)
    return _dequantized(qweight, scales, mins, bits, group_size)


def _dequantized(qweight, scales, mins, bits: int, group_size: int) -> torch.Tensor:
    q = unpack(qweight, bits).to(torch.float32)
    n, k = q.shape
    w = q.view(n, k // group_size, group_size) * scales.to(torch.float32)[..., None]
    if mins is not None:
        w = w + mins.to(torch.float32)[..., None]
    return w.view(n, k)


def _product(op: str, x, qweight, scales, mins, bits: int, group_size: int) -> torch.Tensor:
    _check_x(op, x, _check(op, qweight, scales, mins, bits, group_size))
    return F.linear(x.to(torch.float32), _dequantized(qweight, scales, mins, bits, group_size))


def _qlinear_reference(x, qweight, scales, mins, bits: int, group_size: int) -> torch.Tensor:
    return _product("qlinear", x, qweight, scales, mins, bits, group_size)


def _qlinear_dense_reference(x, qweight, scales, mins, bits: int, group_size: int) -> torch.Tensor:
    return _product("qlinear_dense", x, qweight, scales, mins, bits, group_size)


def round_to_ints(x: torch.Tensor, x_bits: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """(..., K) float32 -> (xq (..., K) int8 or int16, d (..., K / 32) float32) with x ~ d * xq per 32
    values: d = max |x| / L over the block (L = 127 or 32767), xq = x / d rounded to nearest (ties to
    even)."""
    levels, dtype = {8: (127, torch.int8), 16: (32767, torch.int16)}[x_bits]
    blocks = x.to(torch.float32).unflatten(-1, (-1, 32))
    d = blocks.abs().amax(-1) / levels
    safe = torch.where(d > 0, d, torch.ones_like(d))
    xq = torch.where(d[..., None] > 0, torch.round(blocks / safe[..., None]), 0.0).clamp(-levels, levels)
    return xq.flatten(-2).to(dtype), d


def int_span(group_size: int, features: int) -> int:
    """qlinear_int's span for a weight (values under one activation scale and one weight scale): 32,
    or the group where it divides 32; 0 where there is none (the group neither divides 32 nor is a
    multiple of it, or the rows are not whole blocks of 32)."""
    if features % 32:
        return 0
    return 32 if group_size % 32 == 0 else group_size if 32 % group_size == 0 else 0


def _qlinear_int_reference(x, qweight, scales, mins, bits: int, group_size: int, x_bits: int) -> torch.Tensor:
    """qlinear_int's arithmetic in float64 (csrc/qlinear.cpp): each span's integer sums are exact, the
    scales applied in float64, so this differs from the C++ kernels by their float32 rounding."""
    k = _check("qlinear_int", qweight, scales, mins, bits, group_size)
    _check_x("qlinear_int", x, k)
    span = int_span(group_size, k)
    if not span:
        raise ValueError(f"qlinear_int: groups of {group_size} over {k} features have no spans")
    if x_bits not in (8, 16):
        raise ValueError(f"qlinear_int: x_bits must be 8 or 16, got {x_bits}")
    rows = x.reshape(-1, k).to(torch.float32)
    xq, d = round_to_ints(rows, x_bits)
    q = unpack(qweight, bits).to(torch.float64).unflatten(-1, (-1, span))  # (N, S, F)
    xs = xq.to(torch.float64).unflatten(-1, (-1, span))  # (M, S, F)
    dots = torch.einsum("msf,nsf->mns", xs, q)  # exact: integers far below 2^53
    group_of_span = torch.arange(k // span) * span // group_size
    s = scales.to(torch.float64)[:, group_of_span]  # (N, S)
    terms = dots * s
    if mins is not None:
        terms = terms + xs.sum(-1)[:, None, :] * mins.to(torch.float64)[:, group_of_span]
    d_span = d.to(torch.float64)[:, torch.arange(k // span) * span // 32]  # (M, S)
    out = (terms * d_span[:, None, :]).sum(-1)
    finite = torch.isfinite(rows).all(-1, keepdim=True)
    out = torch.where(finite, out, torch.nan).to(torch.float32)
    return out.view(*x.shape[:-1], qweight.shape[0])


def _check(op: str, qweight, scales, mins, bits: int, group_size: int) -> int:
    """The weight layout's checks (csrc/common.h's check_layout, the same conditions), before anything
    is sized or divided by it; each error names the operator and the argument. Returns K, the input
    features (at least one whole group)."""
    if bits not in (4, 5, 8):
        raise ValueError(f"{op}: bits must be 4, 5 or 8, got {bits}")
    if qweight.dim() != 2:
        raise ValueError(f"{op}: qweight must be a 2-D tensor, got {list(qweight.shape)}")
    wanted = torch.int8 if bits == 8 else torch.uint8
    if qweight.dtype != wanted:
        raise ValueError(f"{op}: qweight of bits {bits} must be {wanted}, got {qweight.dtype}")
    if bits == 5 and qweight.shape[1] % 20:
        raise ValueError(f"{op}: 5-bit rows take 20 bytes per 32 values, got qweight {list(qweight.shape)}")
    k = features_of(qweight.shape[1], bits)
    if k == 0:
        raise ValueError(f"{op}: qweight {list(qweight.shape)} has no input features")
    block = 8 if bits == 8 else 32
    if group_size <= 0 or k % group_size or group_size % block:
        raise ValueError(
            f"{op}: group size {group_size} does not divide {k} values into whole blocks of {block}"
        )
    n = qweight.shape[0]
    if scales.dtype not in (torch.float32, torch.float16) or tuple(scales.shape) != (n, k // group_size):
        raise ValueError(
            f"{op}: scales must be float32 or float16 ({n}, {k // group_size}), got {scales.dtype} "
            f"{list(scales.shape)}"
        )
    if mins is not None and (mins.dtype != scales.dtype or mins.shape != scales.shape):
        raise ValueError(
            f"{op}: mins must be of the scales' dtype and shape {list(scales.shape)}, got {mins.dtype} "
            f"{list(mins.shape)}"
        )
    return k


def _check_x(op: str, x, k: int) -> None:
    if x.dim() < 1 or x.shape[-1] != k:
        raise ValueError(f"{op}: input x {list(x.shape)} must end in the {k} features the weight takes")


def _row_norms_reference(qweight, scales, bits: int, group_size: int) -> torch.Tensor:
    """||(s q)[n]|| per row, float32 rounded up (by 2^-20): per group the integers' squares (exact),
    times s * s in float64, summed over the groups in the C++'s order (``cumsum``: one sequential
    sum), the square root then rounded to float32."""
    k = _check("row_norms", qweight, scales, None, bits, group_size)
    q = unpack(qweight, bits).to(torch.int64)
    n = q.shape[0]
    squares = (q * q).view(n, k // group_size, group_size).sum(-1)  # (N, groups), exact
    s = scales.to(torch.float32).to(torch.float64)
    total = (s * s * squares.to(torch.float64)).cumsum(-1)[:, -1]
    return (total.sqrt() * (1.0 + 1.0 / 1048576)).to(torch.float32)


def _group_sums(rows: torch.Tensor, group_size: int) -> torch.Tensor:
    """(M, K) float32 -> (M, K / G): each group's sum accumulated in float64 and rounded once."""
    return rows.to(torch.float64).unflatten(-1, (-1, group_size)).sum(-1).to(torch.float32)


_UNIT = 2.0**-24  # float32's unit roundoff


def _qlinear_bounds_reference(
    x, qweight, scales, mins, bits: int, group_size: int, row_norms
) -> tuple[torch.Tensor, torch.Tensor]:
    """(approx, bound) with |qlinear(x) - approx| <= bound (csrc/greedy_head.cpp derives it): approx
    scores every row with x rounded to int8 per 32 values, its sum_b (s d)_b * dot(q_b, xq_b) taken in
    float64 here where the C++ sums in float32 (so the two differ by float32 rounding, which the bound's
    slack covers); the bound's terms are the C++'s, in the same float32 operations."""
    k = _check("qlinear_bounds", qweight, scales, mins, bits, group_size)
    _check_x("qlinear_bounds", x, k)
    if bits not in (8, 4):
        raise ValueError(f"qlinear_bounds: bits must be 8 or 4, got {bits}")
    if k % 32 or group_size % 32:
        raise ValueError("qlinear_bounds: needs groups of a multiple of 32 values")
    n = qweight.shape[0]
    if row_norms.dtype != torch.float32 or row_norms.shape != (n,):
        raise ValueError(
            f"qlinear_bounds: row_norms must be float32 ({n}), got {row_norms.dtype} {list(row_norms.shape)}"
        )
    rows = x.reshape(-1, k).to(torch.float32)
    xq, d = round_to_ints(rows, 8)  # (M, K) int8, (M, K / 32)
    blocks = k // 32
    dots = torch.einsum(
        "mbf,nbf->mnb",
        xq.to(torch.float64).view(-1, blocks, 32),
        unpack(qweight, bits).to(torch.float64).view(n, blocks, 32),
    )  # exact integers
    block_scales = scales.to(torch.float32)[:, torch.arange(blocks) * 32 // group_size]  # (N, B)
    sd = block_scales[None] * d[:, None, :]  # float32 products, as the C++ forms s * d
    approx = (sd.to(torch.float64) * dots).sum(-1)
    if mins is not None:
        approx = approx + _group_sums(rows, group_size).to(torch.float64) @ mins.to(torch.float64).T
    approx = approx.to(torch.float32)
    back = xq.to(torch.float64) * d.to(torch.float64).repeat_interleave(32, -1)
    err = (rows.to(torch.float64) - back).norm(dim=-1)
    norm, norm_approx = rows.to(torch.float64).norm(dim=-1), back.norm(dim=-1)
    gamma = (k + 64) * _UNIT / (1 - (k + 64) * _UNIT)
    beta = ((err + 2 * gamma * (norm + norm_approx)) * (1.0 + 1.0 / 1048576)).to(torch.float32)
    b = row_norms[None, :] * beta[:, None]
    bound = b + (approx.abs() + b) * (1.0 / 2097152)
    finite = torch.isfinite(rows).all(-1, keepdim=True)  # else every row in doubt
    approx = torch.where(finite, approx, 0.0)
    bound = torch.where(finite, bound, torch.inf)
    shape = (*x.shape[:-1], n)
    return approx.view(shape), bound.view(shape)


def _qlinear_bounds_into_reference(
    x, qweight, scales, mins, bits: int, group_size: int, row_norms, approx, bound
):
    """``qlinear_bounds`` written into ``approx`` and ``bound`` (float32, contiguous, x's shape with N last)."""
    values = _qlinear_bounds_reference(x, qweight, scales, mins, bits, group_size, row_norms)
    for out, value in zip((approx, bound), values):
        if (
            out.dtype != torch.float32
            or not out.is_contiguous()
            or out.numel() != value.numel()
            or (out.dim() < 1 or out.shape[-1] != value.shape[-1])
        ):
            raise ValueError(
                f"qlinear_bounds: approx and bound must be contiguous float32 tensors of {value.numel() // value.shape[-1]} "
                f"x {value.shape[-1]} values (x's rows by the weight's), got {out.dtype} {list(out.shape)}"
            )
        out.copy_(value.view(out.shape))


def _bounded_candidates_reference(approx, bound) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows that may hold each row's maximum, n with approx + bound >= max(approx - bound) in
    float32 (a bound of one column, the same for its whole row: approx >= max(approx) - 2 bound):
    their indices, row after row, ascending, and how many each row has. Exactly the C++'s."""
    if (
        approx.dtype != torch.float32
        or bound.dtype != torch.float32
        or approx.dim() != 2
        or bound.dim() != 2
        or bound.shape[0] != approx.shape[0]
        or bound.shape[1] not in (approx.shape[1], 1)
    ):
        raise ValueError(
            "bounded_candidates: approx must be a float32 (M, N) tensor and bound one of (M, N) or (M, 1), "
            f"got {approx.dtype} {list(approx.shape)} and {bound.dtype} {list(bound.shape)}"
        )
    if approx.shape[1] == 0 and approx.shape[0] > 0:
        raise ValueError(f"bounded_candidates: approx {list(approx.shape)} has no columns to pick from")
    if bound.shape[1] == 1 and approx.shape[1] != 1:
        keep = approx >= approx.amax(-1, keepdim=True) - 2 * bound
    else:
        keep = approx + bound >= (approx - bound).amax(-1, keepdim=True)
    columns = torch.arange(keep.shape[1], device=keep.device).expand_as(keep)
    return columns[keep], keep.sum(-1)  # (indices row after row, a tensor of its own)


def _rms_norm_reference(x, weight, eps: float, plus_one: bool) -> torch.Tensor:
    """x * (mean(x^2) + eps)^-1/2 * scale over the last dimension (scale: 1 + w, w or 1), float32: the
    C++'s operations in its order (the squares summed in float64 as eight interleaved sums, value k
    into sum k % 8, added pairwise; the mean rounded to float32 once), so its bits."""
    if x.dtype != torch.float32:
        raise ValueError(f"rms_norm: float32 input expected, got {x.dtype}")
    if x.dim() < 1 or x.shape[-1] == 0:  # the mean of no values is 0 / 0
        raise ValueError(f"rms_norm: x {list(x.shape)} has no features to normalize")
    k = x.shape[-1]
    if weight is not None and (weight.dim() != 1 or weight.numel() != k):
        raise ValueError(f"rms_norm: weight {list(weight.shape)} for {k} features (one value each)")
    squares = x.to(torch.float64).square()
    squares = F.pad(squares, (0, -k % 8)).unflatten(-1, (-1, 8))  # zeros add nothing to these sums
    part = squares.cumsum(-2)[..., -1, :]  # (..., 8): sum j is values j, j + 8, ... in order
    total = ((part[..., 0] + part[..., 1]) + (part[..., 2] + part[..., 3])) + (
        (part[..., 4] + part[..., 5]) + (part[..., 6] + part[..., 7])
    )
    mean = (total / k).to(torch.float32)
    r = (1.0 / (mean.to(torch.float64) + eps).sqrt()).to(torch.float32)[..., None]
    out = x * r
    if weight is not None:
        w = weight.to(torch.float32)
        out = out * (1.0 + w if plus_one else w)
    return out.contiguous()


def _rope_reference(x, cos, sin) -> torch.Tensor:
    """x (B, T, H, D) rotated by tables (B, T, D), half-split pairs: x * cos + r * sin with
    r = (-x[D/2:], x[:D/2]), unfused float32: layers.apply_rope's operators, the C++'s bits."""
    if (
        x.dim() != 4
        or cos.dim() != 3
        or cos.shape != (x.shape[0], x.shape[1], x.shape[3])
        or sin.shape != cos.shape
        or x.shape[3] % 2
    ):
        raise ValueError(
            f"rope: x (B, T, H, D) and tables (B, T, D) expected, D even, got {list(x.shape)} and "
            f"{list(cos.shape)}, {list(sin.shape)}"
        )
    first, second = x.chunk(2, dim=-1)
    rotated = torch.cat((-second, first), dim=-1)
    return (x * cos[:, :, None] + rotated * sin[:, :, None]).contiguous()


_F32 = torch.float32
# exp_ieee's constants (csrc/common.h), as float32.
_LOG2E, _LN2_HIGH, _LN2_LOW = (
    torch.tensor(v, dtype=_F32) for v in (1.44269504088896341, 0.693359375, -2.12194440e-4)
)
_EXP_POLY = [
    torch.tensor(v, dtype=_F32)
    for v in (
        1.9875691500e-4,
        1.3981999507e-3,
        8.3334519073e-3,
        4.1665795894e-2,
        1.6666665459e-1,
        5.0000001201e-1,
    )
]
_EXP_HIGH, _EXP_LOW = 88.0, -87.0
_GELU_BETA, _GELU_KAPPA = torch.tensor(0.7978845608028654, dtype=_F32), torch.tensor(0.044715, dtype=_F32)


def _exp_ieee(y: torch.Tensor) -> torch.Tensor:
    """e^y, float32, the C++'s exp_ieee step for step (IEEE operations, no fused multiply-add: its bits):
    n = round(y log2 e), r = (y - n ln2_high) - n ln2_low, Cephes' polynomial, times 2^n; infinity
    above 88, 0 below -87, NaN for NaN."""
    c = y.clamp(_EXP_LOW, _EXP_HIGH)
    n = torch.round(c * _LOG2E)  # ties to even
    r = (c - n * _LN2_HIGH) - n * _LN2_LOW
    p = _EXP_POLY[0].expand_as(r)
    for coefficient in _EXP_POLY[1:]:
        p = p * r + coefficient
    p = (p * (r * r) + r) + 1.0
    two_n = ((n.nan_to_num().to(torch.int32) + 127) << 23).view(_F32)
    e = p * two_n
    e = torch.where(y > _EXP_HIGH, torch.inf, e)
    e = torch.where(y < _EXP_LOW, 0.0, e)
    return torch.where(y.isnan(), y, e)


def _gelu_mul_reference(gate, up) -> torch.Tensor:
    """gelu_tanh(gate) * up as the C++ computes it (csrc/norms_rope.cpp): gate / (1 + e^(-2u)) * up with
    u = sqrt(2 / pi) (gate + 0.044715 gate^3), float32 operators, its bits."""
    if gate.dtype != _F32 or up.dtype != _F32:
        raise ValueError(f"gelu_mul: float32 tensors expected, got {gate.dtype} and {up.dtype}")
    if gate.shape != up.shape:
        raise ValueError(f"gelu_mul: gate {list(gate.shape)} and up {list(up.shape)} differ in shape")
    u = _GELU_BETA * (gate + _GELU_KAPPA * ((gate * gate) * gate))
    return (gate / (1.0 + _exp_ieee(u * -2.0)) * up).contiguous()


def _decode_layer_lists(op: str, products, formats, count: int, norms, eps, plus_one, norm_counts) -> None:
    if len(products) != 3 * count or len(formats) != 2 * count:
        raise ValueError(
            f"{op}: expected {count} products ({3 * count} tensors, {2 * count} formats), got "
            f"{len(products)} tensors and {len(formats)} formats"
        )
    if len(norms) not in norm_counts or len(eps) != len(norms) or len(plus_one) != len(norms):
        raise ValueError(
            f"{op}: expected {min(norm_counts)}-{max(norm_counts)} norms with an eps and a plus_one each, got "
            f"{len(norms)} norms, {len(eps)} eps and {len(plus_one)} plus_one"
        )


def _layer_product(x, products, formats, i: int) -> torch.Tensor:
    return _qlinear_reference(x, *products[3 * i : 3 * i + 3], *formats[2 * i : 2 * i + 2])


def _layer_norm(x, norms, eps, plus_one, i: int) -> torch.Tensor:
    return _rms_norm_reference(x, norms[i], eps[i], bool(plus_one[i]))


def _decode_layer_qkv_reference(x, cos, sin, products, formats, norms, eps, plus_one, head_dim: int):
    """Attention's inputs for a decode step (csrc/decode_layer.cpp): x normed, projected by q, k and v
    (products; v None: the keys' projection), each normed (norms: input, q, k, v's where there is one),
    q and k rotated; (B, H, T, D), (B, Hkv, T, D) twice, as transposed views. The references of the
    kernels the C++ calls, in its order."""
    _decode_layer_lists("decode_layer_qkv", products, formats, 3, norms, eps, plus_one, (3, 4))
    b, t = x.shape[:2]
    normed = _layer_norm(x, norms, eps, plus_one, 0)
    query = _layer_norm(
        _layer_product(normed, products, formats, 0).view(b, t, -1, head_dim), norms, eps, plus_one, 1
    )
    projected = _layer_product(normed, products, formats, 1).view(b, t, -1, head_dim)
    value = (
        projected
        if products[6] is None
        else _layer_product(normed, products, formats, 2).view(b, t, -1, head_dim)
    )
    key = _rope_reference(_layer_norm(projected, norms, eps, plus_one, 2), cos, sin)
    if len(norms) == 4:
        value = _layer_norm(value, norms, eps, plus_one, 3)
    return _rope_reference(query, cos, sin).transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)


def _decode_layer_output_reference(x, attended, products, formats, norms, eps, plus_one) -> torch.Tensor:
    """The layer after attention for a decode step (csrc/decode_layer.cpp): h = x + post_attn(o(attended)),
    then h + post_ffw(down(gelu_tanh(gate(m)) * up(m))) with m = pre_ffw(h); products o, gate, up,
    down; norms post-attention, pre-feedforward, post-feedforward."""
    _decode_layer_lists("decode_layer_output", products, formats, 4, norms, eps, plus_one, (3,))
    out = _layer_product(attended.reshape(*attended.shape[:2], -1), products, formats, 0)
    h = x + _layer_norm(out, norms, eps, plus_one, 0)
    m = _layer_norm(h, norms, eps, plus_one, 1)
    gated = _gelu_mul_reference(
        _layer_product(m, products, formats, 1), _layer_product(m, products, formats, 2)
    )
    return h + _layer_norm(_layer_product(gated, products, formats, 3), norms, eps, plus_one, 2)


def _decode_attention_reference(q, k, v, scale: float, visible=None) -> torch.Tensor:
    """softmax(scale * q k^T) v for each query of each head over its keys, q (B, H, T, D) and k, v
    (B, Hkv, S, D) -> (B, T, H, D), float32; ``visible`` (B, S) (T = 1) or (B, T, S) bool: the keys
    each query sees (None: all). The C++'s steps (scores times scale, exp of each minus the largest,
    the weighted values summed, then divided by the weights' sum), in torch's float32 operations;
    the C++ sums in its own order, takes exp from a polynomial good to ~1 ulp and splits contexts
    longer than 1024 keys into pieces combined at the end, so the two differ by float32 rounding."""
    if (
        q.dim() != 4
        or k.dim() != 4
        or k.shape != v.shape
        or q.shape[2] == 0
        or k.shape[0] != q.shape[0]
        or k.shape[3] != q.shape[3]
        or k.shape[1] == 0  # no KV heads to share the query heads between
        or q.shape[1] % k.shape[1]
        or k.shape[2] == 0  # a softmax over no keys is 0 / 0
    ):
        raise ValueError(
            "decode_attention: q (B, H, T, D) and k, v (B, Hkv, S, D) expected (Hkv dividing H, S at least 1), "
            f"got {list(q.shape)}, {list(k.shape)}, {list(v.shape)}"
        )
    b, h, t, d = q.shape
    s, kv_heads = k.shape[2], k.shape[1]
    query = q.reshape(b, kv_heads, h // kv_heads * t, d)  # each KV head's group of query heads
    scores = (query @ k.transpose(-1, -2) * scale).view(b, kv_heads, h // kv_heads, t, s)
    if visible is not None:
        if not (visible.shape == (b, t, s) or (t == 1 and visible.shape == (b, s))):
            raise ValueError(
                f"decode_attention: visible must be (B, S) = {(b, s)} or (B, T, S) = {(b, t, s)}, "
                f"got {list(visible.shape)}"
            )
        seen = visible.bool().view(b, 1, 1, t, s)
        if not bool(seen.any(-1).all()):
            raise ValueError("decode_attention: a query sees no key (a softmax over none is 0 / 0)")
        scores = scores.masked_fill(~seen, float("-inf"))
    weights = (scores - scores.amax(-1, keepdim=True)).exp()
    out = (weights @ v[:, :, None]) / weights.sum(-1, keepdim=True)  # (B, Hkv, G, T, D)
    return out.reshape(b, h, t, d).transpose(1, 2).contiguous()


def _ring_columns(k: torch.Tensor, visible, slots, offsets):
    """decode_attention_ring's arguments checked; each row's keys' columns (B, S)."""
    b, s = visible.shape[0], visible.shape[-1]
    if k.dim() != 4 or visible.dim() != 2 or slots.shape != (b,) or offsets.shape != (b,):
        raise ValueError(
            "decode_attention_ring: rings (N, Hkv, R, D), visible (B, S), slots and offsets (B,) expected, got "
            f"{list(k.shape)}, {list(visible.shape)}, {list(slots.shape)}, {list(offsets.shape)}"
        )
    if s > k.shape[2]:
        raise ValueError(f"decode_attention_ring: {s} keys per row do not fit a ring of {k.shape[2]}")
    if b and not bool(((slots >= 0) & (slots < k.shape[0])).all()):
        raise ValueError(f"decode_attention_ring: slots {slots.tolist()} must lie in 0..{k.shape[0] - 1}")
    return (offsets.long()[:, None] + torch.arange(s, device=k.device)) % k.shape[2]


def _decode_attention_ring_reference(q, k, v, scale: float, visible, slots, offsets) -> torch.Tensor:
    """decode_attention over ring buffers k, v (N, Hkv, R, D): row b's S keys (visible (B, S)) are
    sequence ``slots[b]``'s columns ``(offsets[b] + j) % R``, j = 0..S-1, gathered in that order."""
    columns = _ring_columns(k, visible, slots, offsets)
    rows = slots.long()[:, None]
    keys, values = k[rows, :, columns].transpose(1, 2), v[rows, :, columns].transpose(1, 2)
    return _decode_attention_reference(q, keys, values, scale, visible)


# ── fakes: the output shapes and dtypes, for torch.compile ──────────────────────────────────────


def _product_fake(op, x, qweight, scales, mins, bits, group_size):
    _check_x(op, x, _check(op, qweight, scales, mins, bits, group_size))
    return x.new_empty((*x.shape[:-1], qweight.shape[0]), dtype=torch.float32)


def _qlinear_fake(x, qweight, scales, mins, bits, group_size):
    return _product_fake("qlinear", x, qweight, scales, mins, bits, group_size)


def _qlinear_dense_fake(x, qweight, scales, mins, bits, group_size):
    return _product_fake("qlinear_dense", x, qweight, scales, mins, bits, group_size)


def _qlinear_int_fake(x, qweight, scales, mins, bits, group_size, x_bits):
    return _product_fake("qlinear_int", x, qweight, scales, mins, bits, group_size)


def _dequantize_fake(qweight, scales, mins, bits, group_size):
    k = _check("dequantize", qweight, scales, mins, bits, group_size)
    return scales.new_empty((qweight.shape[0], k), dtype=torch.float32)


def _qlinear_bounds_fake(x, qweight, scales, mins, bits, group_size, row_norms):
    out = _product_fake("qlinear_bounds", x, qweight, scales, mins, bits, group_size)
    return out, torch.empty_like(out)


def _qlinear_bounds_into_fake(x, qweight, scales, mins, bits, group_size, row_norms, approx, bound):
    return None


def _row_norms_fake(qweight, scales, bits, group_size):
    _check("row_norms", qweight, scales, None, bits, group_size)
    return scales.new_empty((qweight.shape[0],), dtype=torch.float32)


def _bounded_candidates_fake(approx, bound):
    picked = torch.library.get_ctx().new_dynamic_size()  # how many rows are kept depends on the values
    counts = approx.new_empty((approx.shape[0],), dtype=torch.int64)
    return approx.new_empty((picked,), dtype=torch.int64), counts


def _decode_layer_qkv_fake(x, cos, sin, products, formats, norms, eps, plus_one, head_dim):
    b, t = x.shape[:2]

    def heads(qweight):
        return x.new_empty((b, t, qweight.shape[0] // head_dim, head_dim)).transpose(1, 2)

    value = products[3] if products[6] is None else products[6]
    return heads(products[0]), heads(products[3]), heads(value)


def _decode_layer_output_fake(x, attended, products, formats, norms, eps, plus_one):
    return x.new_empty(x.shape)


def _rms_norm_fake(x, weight, eps, plus_one):
    return x.new_empty(x.shape)  # contiguous, whatever x's strides (as the C++ returns it)


def _rope_fake(x, cos, sin):
    return x.new_empty(x.shape)  # contiguous, as the C++ returns it


def _gelu_mul_fake(gate, up):
    return gate.new_empty(gate.shape)  # contiguous, as the C++ returns it


def _decode_attention_fake(q, k, v, scale, visible=None):
    return q.new_empty((q.shape[0], q.shape[2], q.shape[1], q.shape[3]))


def _decode_attention_ring_fake(q, k, v, scale, visible, slots, offsets):
    return q.new_empty((q.shape[0], 1, q.shape[1], q.shape[3]))


# ── the table ──────────────────────────────────────────────────────────────────────────────────


@dataclass(frozen=True)
class Operator:
    """One operator: ``torch.ops.torchgemma.<name>``."""

    schema: str  # "name(arguments) -> returns"
    fake: Callable
    reference: Callable

    @property
    def name(self) -> str:
        return self.schema.split("(", 1)[0]


_PRODUCT = "Tensor x, Tensor qweight, Tensor scales, Tensor? mins, int bits, int group_size"
OPERATORS: tuple[Operator, ...] = (
    # x @ W.T, float32 (a few rows: the C++ reads the integers, never the float weight).
    Operator(f"qlinear({_PRODUCT}) -> Tensor", _qlinear_fake, _qlinear_reference),
    # W, float32 (N, K).
    Operator(
        "dequantize(Tensor qweight, Tensor scales, Tensor? mins, int bits, int group_size) -> Tensor",
        _dequantize_fake,
        _dequantize_reference,
    ),
    # x @ W.T for many rows (prefill): the float32 BLAS on W dequantized a slab of rows at a time.
    Operator(f"qlinear_dense({_PRODUCT}) -> Tensor", _qlinear_dense_fake, _qlinear_dense_reference),
    # x @ W.T with x rounded to x_bits-bit integers (8 or 16) per 32 values, for calls of many rows
    # (QuantizedWeight.activation_bits; csrc/int_products.cpp defines the arithmetic).
    Operator(f"qlinear_int({_PRODUCT}, int x_bits) -> Tensor", _qlinear_int_fake, _qlinear_int_reference),
    # The greedy head's helpers (QuantizedWeight.argmax): scores of every row with int8-rounded
    # activations and a bound on their distance from qlinear's, the rows' norms, and the rows left.
    Operator(
        f"qlinear_bounds({_PRODUCT}, Tensor row_norms) -> (Tensor, Tensor)",
        _qlinear_bounds_fake,
        _qlinear_bounds_reference,
    ),
    # The same into given tensors (a decode loop's, kept between steps).
    Operator(
        f"qlinear_bounds_into({_PRODUCT}, Tensor row_norms, Tensor(a!) approx, Tensor(b!) bound) -> ()",
        _qlinear_bounds_into_fake,
        _qlinear_bounds_into_reference,
    ),
    Operator(
        "row_norms(Tensor qweight, Tensor scales, int bits, int group_size) -> Tensor",
        _row_norms_fake,
        _row_norms_reference,
    ),
    Operator(
        "bounded_candidates(Tensor approx, Tensor bound) -> (Tensor, Tensor)",
        _bounded_candidates_fake,
        _bounded_candidates_reference,
    ),
    # RMSNorm in one call (float32): what a quantized model's norms run (FusedRMSNorm).
    Operator(
        "rms_norm(Tensor x, Tensor? weight, float eps, bool plus_one) -> Tensor",
        _rms_norm_fake,
        _rms_norm_reference,
    ),
    # RoPE in one call (float32), the bits of layers.apply_rope (fused_rope).
    Operator("rope(Tensor x, Tensor cos, Tensor sin) -> Tensor", _rope_fake, _rope_reference),
    # GeGLU's gelu_tanh(gate) * up in one call (float32): what a quantized model's MLPs run.
    Operator("gelu_mul(Tensor gate, Tensor up) -> Tensor", _gelu_mul_fake, _gelu_mul_reference),
    # Each query's attention over its keys (all, or those `visible` marks), float32, as a decode step's
    # one new token attends: a decode step's, and a prompt's on the CPU (fused_cpu_ops).
    Operator(
        "decode_attention(Tensor q, Tensor k, Tensor v, float scale, Tensor? visible=None) -> Tensor",
        _decode_attention_fake,
        _decode_attention_reference,
    ),
    # The same over ring buffers read in place (a decode step's sliding layers: cache.RingKeys).
    Operator(
        "decode_attention_ring(Tensor q, Tensor k, Tensor v, float scale, Tensor visible, Tensor slots, "
        "Tensor offsets) -> Tensor",
        _decode_attention_ring_fake,
        _decode_attention_ring_reference,
    ),
    # A decoder layer's decode step in two calls around its attention (FusedDecoderLayer): the
    # kernels above, in the Python path's order (csrc/decode_layer.cpp).
    Operator(
        "decode_layer_qkv(Tensor x, Tensor cos, Tensor sin, Tensor?[] products, int[] formats, Tensor?[] norms, "
        "float[] eps, int[] plus_one, int head_dim) -> (Tensor, Tensor, Tensor)",
        _decode_layer_qkv_fake,
        _decode_layer_qkv_reference,
    ),
    Operator(
        "decode_layer_output(Tensor x, Tensor attended, Tensor?[] products, int[] formats, Tensor?[] norms, "
        "float[] eps, int[] plus_one) -> Tensor",
        _decode_layer_output_fake,
        _decode_layer_output_reference,
    ),
)

_LIBRARY = torch.library.Library("torchgemma", "DEF")
for _op in OPERATORS:
    _LIBRARY.define(_op.schema)
    torch.library.register_fake(f"torchgemma::{_op.name}", _op.fake, lib=_LIBRARY)
    # Every backend's default; the C++ library, once loaded, registers CPU kernels that take precedence.
    _LIBRARY.impl(_op.name, _op.reference, "CompositeExplicitAutograd")
