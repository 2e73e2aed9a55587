"""GGUF's block types: dequantized to floats (``dequantize``), or kept as our grouped integers
(``grouped_ints``, read by torchgemma.quantization) where a type's blocks map onto them exactly.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize as _gguf_dequantize

from .reader import GGUFError
from .slices import BlockRows

_T = GGMLQuantizationType
# Types whose dequantization is checked bit for bit against ggml's reference loops (tests/test_gguf.py).
_VERIFIED_TYPES = (
    _T.F32, _T.F16, _T.BF16, _T.Q4_0, _T.Q4_1, _T.Q5_0, _T.Q5_1, _T.Q8_0,
    _T.Q2_K, _T.Q3_K, _T.Q4_K, _T.Q5_K, _T.Q6_K,
)  # fmt: skip
# Further types the gguf package dequantizes (the same code transformers uses); checked against it only.
_EXTRA_TYPES = tuple(
    getattr(_T, name)
    for name in ("IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "IQ4_NL", "IQ4_XS",
                 "TQ1_0", "TQ2_0", "MXFP4")
    if hasattr(_T, name)
)  # fmt: skip
SUPPORTED_TYPES: frozenset[GGMLQuantizationType] = frozenset(_VERIFIED_TYPES + _EXTRA_TYPES)

# --------------------------------------------------------------------------------------------------
# Non-finite weights
#
# A NaN or infinite weight makes every logit it reaches NaN, and NaN logits sample token 0 forever
# (llama.cpp decodes such a file the same way). The float types are checked value by value; a block
# type's values are small integers times its float16 fields (scale d, and minimum dmin where it has
# one), finite whenever those fields are (|d * q| stays far below float32's range), so its fields are
# what is checked: one or two float16 per 18-210 bytes. Both readers below check each chunk of blocks
# as they decode it, while it is in cache (a separate pass over the 270M's 171 MB token table cost
# 40-70 ms): dequantize tests the fields' bits (~150-200 ms over the 270M's float32 load of ~6 s),
# grouped_ints the float32 scales and offsets it computes from them anyway (~15 ms).


class NonFiniteWeights(GGUFError):
    """A tensor's data holds a NaN or an infinity (the reader names the tensor)."""


# Byte offsets of each block type's float16 fields (ggml-common.h's block layouts).
_HALF_FIELDS = {
    _T.Q8_0: (0,), _T.Q4_0: (0,), _T.Q5_0: (0,), _T.Q4_1: (0, 2), _T.Q5_1: (0, 2),
    _T.Q2_K: (80, 82), _T.Q3_K: (108,), _T.Q4_K: (0, 2), _T.Q5_K: (0, 2), _T.Q6_K: (208,),
}  # fmt: skip
# Each float type as an unsigned integer of its width, and the magnitude bits from which it is NaN or
# infinite (exponent all ones): |bits| >= that.
_FLOAT_LIMITS = {_T.F32: (np.uint32, 0x7F800000), _T.F16: (np.uint16, 0x7C00), _T.BF16: (np.uint16, 0x7F80)}


def _check_finite(
    blocks: np.ndarray, qtype: GGMLQuantizationType, first_block: int | Callable[[int], int]
) -> None:
    """Raise NonFiniteWeights if ``blocks`` ((n, type_size) bytes, block ``first_block`` on, or the
    tensor's block ``first_block(i)`` for block i of a piece: slices.BlockRows) hold a NaN
    or an infinite value (float types) or block field (block types). Bits are tested, not floats (no
    warnings): a value is NaN or infinite where its bits less the sign reach the exponent's all-ones
    pattern. ~20 us per 4096 Q8_0 blocks. The IQ and ternary types (decoded by the gguf package) are
    not checked."""
    if qtype in _FLOAT_LIMITS:
        kind, limit = _FLOAT_LIMITS[qtype]
        fields, what = [blocks.view(kind)], "value"
    else:  # each float16 field gathered first (a strided mask of it takes 4x longer)
        kind, limit, what = np.uint16, 0x7C00, "block scale"
        fields = [
            np.ascontiguousarray(blocks[:, at : at + 2].view(kind)) for at in _HALF_FIELDS.get(qtype, ())
        ]
    unsigned = kind(np.iinfo(kind).max >> 1)
    for field in fields:
        magnitude = field & unsigned
        if magnitude.size and magnitude.max() >= limit:
            index = int(np.argmax((magnitude >= limit).reshape(len(blocks), -1).any(axis=1)))
            where = first_block(index) if callable(first_block) else first_block + index
            raise NonFiniteWeights(f"a NaN or infinite {what} in block {where}")


# --------------------------------------------------------------------------------------------------
# Dequantization


def dequantize(
    data: np.ndarray,
    qtype: GGMLQuantizationType,
    shape: tuple[int, ...],
    dtype: torch.dtype = torch.float32,
    *,
    finite: bool = False,
) -> torch.Tensor:
    """A ``dtype`` tensor of ``shape`` (outermost dimension first) from a tensor's raw GGUF data.

    The types ggml's reference loops are checked against (``_VERIFIED_TYPES``) are decoded here, a
    whole tensor at a time in chunks of blocks, with the float32 operations of ``dequantize_row_*``
    in their order, which are also those of ``gguf.quants.dequantize`` (what transformers' GGUF
    loader uses): the values are the same to the bit (tests compare all three). Each float32 chunk is
    written straight into the result, or cast into it once for another ``dtype``. The further types go
    through ``gguf.quants.dequantize``. ``finite``: raise ``NonFiniteWeights`` where a value or block
    scale is NaN or infinite (the verified types; ggml itself decodes them as they are).
    """
    if qtype not in SUPPORTED_TYPES:
        raise GGUFError(f"GGML type {qtype.name} is not supported")
    decode = _DECODERS.get(qtype)
    if decode is None:
        return torch.from_numpy(np.asarray(_gguf_dequantize(data, qtype)).reshape(shape)).to(dtype)
    block, type_size = GGML_QUANT_SIZES[qtype]
    n_values = math.prod(shape)
    raw = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
    if n_values % block or raw.size != n_values // block * type_size:
        raise GGUFError(f"{raw.size} bytes of {qtype.name} data do not hold a tensor of shape {list(shape)}")
    blocks = raw.reshape(-1, type_size)
    # Allocated by numpy, which asks for 2 MB pages (MADV_HUGEPAGE) on large arrays: the 671 MB Gemma 3
    # embedding then faults in about 4x faster than in torch's 4 KB pages.
    itemsize = torch.empty((), dtype=dtype).element_size()
    out = torch.from_numpy(np.empty(n_values * itemsize, np.uint8)).view(dtype).view(shape)
    rows = out.view(-1, block)  # (n_blocks, block)
    step = max(1, _CHUNK_VALUES // block)
    direct = rows.numpy() if dtype == torch.float32 else None
    scratch = np.empty((min(step, len(blocks)), block), np.float32)
    # NaN or infinite scales decode as ggml decodes them, without numpy's warnings.
    with np.errstate(invalid="ignore", over="ignore"):
        for start in range(0, len(blocks), step):
            part = blocks[start : start + step]
            if finite:
                _check_finite(part, qtype, start)
            if direct is not None:
                decode(part, direct[start : start + len(part)])
            else:
                decode(part, scratch[: len(part)])
                rows[start : start + len(part)].copy_(torch.from_numpy(scratch[: len(part)]))
    return out


# Values decoded per step: one step's float32 values and byte-sized temporaries stay in the cache.
_CHUNK_VALUES = 1 << 17

# Each decoder turns (n, type_size) bytes, n blocks of one type (layouts: ggml-common.h), into
# (n, block) float32 values in `out`. Integers are exact in float32, so only the float operations'
# order matters: d * q, then +/- the block minimum, never fused.


def _half(blocks: np.ndarray, at: int) -> np.ndarray:
    """The fp16 field at byte `at` of each block, as float32, (n, 1)."""
    return blocks[:, at : at + 2].view(np.float16).astype(np.float32)


def _nibbles(packed: np.ndarray) -> np.ndarray:
    """(n, k) bytes -> (n, 2k) 4-bit values: every low nibble, then every high one."""
    n, k = packed.shape
    q = np.empty((n, 2 * k), np.uint8)
    np.bitwise_and(packed, 0x0F, out=q[:, :k])
    np.right_shift(packed, 4, out=q[:, k:])
    return q


def _fifth_bits(qh: np.ndarray, qs: np.ndarray) -> np.ndarray:
    """Q5_0/Q5_1: value j is nibble j with bit j of the 32-bit qh as its fifth bit."""
    q = _nibbles(qs)
    q |= np.unpackbits(qh, axis=1, bitorder="little") << np.uint8(4)
    return q


def _decode_f32(blocks: np.ndarray, out: np.ndarray) -> None:
    out[...] = blocks.view(np.float32)


def _decode_f16(blocks: np.ndarray, out: np.ndarray) -> None:
    out[...] = blocks.view(np.float16)


def _decode_bf16(blocks: np.ndarray, out: np.ndarray) -> None:
    np.left_shift(blocks.view(np.uint16), 16, out=out.view(np.uint32), dtype=np.uint32)


def _decode_q8_0(blocks: np.ndarray, out: np.ndarray) -> None:
    np.multiply(blocks[:, 2:].view(np.int8), _half(blocks, 0), out=out)


def _decode_q4_0(blocks: np.ndarray, out: np.ndarray) -> None:
    np.subtract(_nibbles(blocks[:, 2:]), np.float32(8), out=out)
    np.multiply(_half(blocks, 0), out, out=out)


def _decode_q4_1(blocks: np.ndarray, out: np.ndarray) -> None:
    np.multiply(_half(blocks, 0), _nibbles(blocks[:, 4:]), out=out)
    np.add(out, _half(blocks, 2), out=out)


def _decode_q5_0(blocks: np.ndarray, out: np.ndarray) -> None:
    np.subtract(_fifth_bits(blocks[:, 2:6], blocks[:, 6:]), np.float32(16), out=out)
    np.multiply(_half(blocks, 0), out, out=out)


def _decode_q5_1(blocks: np.ndarray, out: np.ndarray) -> None:
    np.multiply(_half(blocks, 0), _fifth_bits(blocks[:, 4:8], blocks[:, 8:]), out=out)
    np.add(out, _half(blocks, 2), out=out)


# K-quants: 256 values in sub-blocks of 16 or 32, each with its own 4- or 6-bit scale (and minimum).
_SHIFT_2 = np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1)
_SHIFT_1 = np.arange(8, dtype=np.uint8).reshape(1, 1, 8, 1)


def _crumbs(packed: np.ndarray) -> np.ndarray:
    """(n, 64) bytes -> (n, 16, 16) 2-bit values: per 32 bytes, bits 0-1 of each, then 2-3, 4-5, 6-7."""
    n = len(packed)
    return ((packed.reshape(n, 2, 1, 32) >> _SHIFT_2) & 3).reshape(n, 16, 16)


def _bits(packed: np.ndarray, groups: int) -> np.ndarray:
    """(n, 32) bytes -> (n, groups, 256 // groups) bits: bit 0 of every byte, then bit 1, ... bit 7."""
    n = len(packed)
    return ((packed.reshape(n, 1, 1, 32) >> _SHIFT_1) & 1).reshape(n, groups, -1)


def _decode_q2_k(blocks: np.ndarray, out: np.ndarray) -> None:
    n = len(blocks)
    scales = blocks[:, :16]
    dl = (_half(blocks, 80) * (scales & 0x0F)).reshape(n, 16, 1)
    ml = (_half(blocks, 82) * (scales >> 4)).reshape(n, 16, 1)
    values = out.reshape(n, 16, 16)
    np.multiply(dl, _crumbs(blocks[:, 16:80]), out=values)
    np.subtract(values, ml, out=values)


def _decode_q3_k(blocks: np.ndarray, out: np.ndarray) -> None:
    n = len(blocks)
    packed = blocks[:, 96:108]  # 16 6-bit scales: low 4 bits in bytes 0-7, high 2 bits in bytes 8-11
    low = np.concatenate([packed[:, :8] & 0x0F, packed[:, :8] >> 4], axis=1)
    high = ((packed[:, 8:].reshape(n, 1, 4) >> _SHIFT_2.reshape(1, 4, 1)) & 3).reshape(n, 16)
    scales = (low | (high << np.uint8(4))).view(np.int8) - np.int8(32)
    dl = (_half(blocks, 108) * scales).reshape(n, 16, 1)
    # A value is its 2 low bits, less 4 where its bit in the high mask is clear.
    q = _crumbs(blocks[:, 32:96]).view(np.int8)
    q -= ((_bits(blocks[:, :32], 16) ^ 1) << np.uint8(2)).view(np.int8)
    np.multiply(dl, q, out=out.reshape(n, 16, 16))


def _k_nibbles(packed: np.ndarray) -> np.ndarray:
    """Q4_K/Q5_K: (n, 128) bytes -> (n, 8, 32): per 32 bytes, their low nibbles, then their high ones."""
    n = len(packed)
    q = np.empty((n, 4, 2, 32), np.uint8)
    packed = packed.reshape(n, 4, 32)
    np.bitwise_and(packed, 0x0F, out=q[:, :, 0])
    np.right_shift(packed, 4, out=q[:, :, 1])
    return q.reshape(n, 8, 32)


def _decode_k4(blocks: np.ndarray, q: np.ndarray, out: np.ndarray) -> None:
    """Q4_K/Q5_K: d * scale * q - dmin * min over 8 sub-blocks of 32 (get_scale_min_k4's 6-bit fields)."""
    n = len(blocks)
    packed = blocks[:, 4:16].reshape(n, 3, 4)
    d, m, both = packed[:, 0], packed[:, 1], packed[:, 2]
    scale = np.concatenate([d & 0x3F, (both & 0x0F) | ((d >> 2) & 0x30)], axis=1)
    least = np.concatenate([m & 0x3F, (both >> 4) | ((m >> 2) & 0x30)], axis=1)
    dl = (_half(blocks, 0) * scale).reshape(n, 8, 1)
    ml = (_half(blocks, 2) * least).reshape(n, 8, 1)
    values = out.reshape(n, 8, 32)
    np.multiply(dl, q, out=values)
    np.subtract(values, ml, out=values)


def _decode_q4_k(blocks: np.ndarray, out: np.ndarray) -> None:
    _decode_k4(blocks, _k_nibbles(blocks[:, 16:144]), out)


def _decode_q5_k(blocks: np.ndarray, out: np.ndarray) -> None:
    q = _k_nibbles(blocks[:, 48:176])
    q |= _bits(blocks[:, 16:48], 8) << np.uint8(4)
    _decode_k4(blocks, q, out)


def _decode_q6_k(blocks: np.ndarray, out: np.ndarray) -> None:
    n = len(blocks)
    d = (_half(blocks, 208) * blocks[:, 192:208].view(np.int8)).reshape(n, 16, 1)
    # Per 128 values: low nibbles of 64 bytes, then their high nibbles, each with 2 more bits from qh.
    low = (blocks[:, :128].reshape(n, 2, 1, 64) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)) & 0x0F
    high = (blocks[:, 128:192].reshape(n, 2, 1, 32) >> _SHIFT_2) & 3
    q = (low.reshape(n, 8, 32) | (high.reshape(n, 8, 32) << np.uint8(4))).view(np.int8) - np.int8(32)
    np.multiply(d, q.reshape(n, 16, 16), out=out.reshape(n, 16, 16))


_DECODERS = {
    _T.F32: _decode_f32, _T.F16: _decode_f16, _T.BF16: _decode_bf16,
    _T.Q8_0: _decode_q8_0, _T.Q4_0: _decode_q4_0, _T.Q4_1: _decode_q4_1, _T.Q5_0: _decode_q5_0,
    _T.Q5_1: _decode_q5_1, _T.Q2_K: _decode_q2_k, _T.Q3_K: _decode_q3_k, _T.Q4_K: _decode_q4_k,
    _T.Q5_K: _decode_q5_k, _T.Q6_K: _decode_q6_k,
}  # fmt: skip


# --------------------------------------------------------------------------------------------------
# Blocks kept quantized: integers, a float32 scale per group and maybe a float32 offset per group, so
# that scale * q (+ offset) is, to the bit, what the decoders above compute (the same float32
# products, then the same sum: "- dmin * m" is "+ (-(dmin * m))"). torchgemma.quantization reads
# this layout: 8-bit values as int8; 4-bit values two per byte, within each 32 values byte j holding
# value j (low nibble) and value j + 16 (high nibble), which is Q4_0/Q4_1's own packing. Q5 values go
# in as 8-bit ones: the 5-bit layout (kernels.pack) reads 0.69 bytes per weight instead of 1.06 (with
# float16 scales), but its unpacking makes the one-thread AVX2 product slower than the 8-bit one (real 270M decode step, its Q5_0 layers in 5 bits:
# 32.8 ms, in 8 bits: 31.0 ms). Scales and offsets are stored as float16 where that holds every one
# exactly (the blocks' own fp16 fields, and -8 d unless it overflows), else as float32 (Q4_K/Q6_K's
# products d * scale).


@dataclass(frozen=True)
class GroupedInts:
    """A quantized (N, K) tensor: W = scales * q + mins, per group of ``group_size`` values of a row."""

    bits: int
    group_size: int
    qweight: torch.Tensor  # int8 (N, K) or uint8 (N, K / 2)
    scales: torch.Tensor  # float16 or float32 (N, K / group_size)
    mins: torch.Tensor | None  # as scales


def _pack4(q: np.ndarray) -> np.ndarray:
    """(n, 32) values 0..15 -> (n, 16) bytes: value j low, value j + 16 high."""
    return q[:, :16] | (q[:, 16:] << np.uint8(4))


def _ints_q8_0(b):
    return 8, 32, b[:, 2:].view(np.int8), _half(b, 0), None


def _ints_q5_0(b):
    q = _fifth_bits(b[:, 2:6], b[:, 6:]).view(np.int8) - np.int8(16)
    return 8, 32, q, _half(b, 0), None


def _ints_q5_1(b):
    return 8, 32, _fifth_bits(b[:, 4:8], b[:, 8:]).view(np.int8), _half(b, 0), _half(b, 2)


def _ints_q4_0(b):
    # (q - 8) * d = d * q + (-8 d) exactly: both products fit float32's 24 bits (11-bit d, 4-bit q).
    d = _half(b, 0)
    return 4, 32, b[:, 2:], d, d * np.float32(-8)


def _ints_q4_1(b):
    return 4, 32, b[:, 4:], _half(b, 0), _half(b, 2)


def _k4_scales(b) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K: (n, 8) float32 scales d * scale and offsets -(dmin * min) (see _decode_k4)."""
    n = len(b)
    packed = b[:, 4:16].reshape(n, 3, 4)
    d, m, both = packed[:, 0], packed[:, 1], packed[:, 2]
    scale = np.concatenate([d & 0x3F, (both & 0x0F) | ((d >> 2) & 0x30)], axis=1)
    least = np.concatenate([m & 0x3F, (both >> 4) | ((m >> 2) & 0x30)], axis=1)
    return _half(b, 0) * scale, -(_half(b, 2) * least)


def _ints_q4_k(b):
    scales, mins = _k4_scales(b)
    return 4, 32, _pack4(_k_nibbles(b[:, 16:144]).reshape(-1, 32)), scales, mins


def _ints_q5_k(b):
    q = _k_nibbles(b[:, 48:176])
    q |= _bits(b[:, 16:48], 8) << np.uint8(4)
    scales, mins = _k4_scales(b)
    return 8, 32, q.view(np.int8), scales, mins


def _ints_q6_k(b):
    n = len(b)
    scales = _half(b, 208) * b[:, 192:208].view(np.int8)
    low = (b[:, :128].reshape(n, 2, 1, 64) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)) & 0x0F
    high = (b[:, 128:192].reshape(n, 2, 1, 32) >> _SHIFT_2) & 3
    q = (low.reshape(n, 8, 32) | (high.reshape(n, 8, 32) << np.uint8(4))).view(np.int8) - np.int8(32)
    return 8, 16, q, scales, None


_INTS = {
    _T.Q8_0: _ints_q8_0, _T.Q5_0: _ints_q5_0, _T.Q5_1: _ints_q5_1, _T.Q4_0: _ints_q4_0,
    _T.Q4_1: _ints_q4_1, _T.Q4_K: _ints_q4_k, _T.Q5_K: _ints_q5_k, _T.Q6_K: _ints_q6_k,
}  # fmt: skip
# The GGML types read as grouped integers, with (bits, group size, offsets?); the others (floats,
# Q2_K, Q3_K, the IQ types) are not.
INT_TYPES: dict[GGMLQuantizationType, tuple[int, int, bool]] = {
    _T.Q8_0: (8, 32, False), _T.Q5_0: (8, 32, False), _T.Q5_1: (8, 32, True), _T.Q4_0: (4, 32, True),
    _T.Q4_1: (4, 32, True), _T.Q4_K: (4, 32, True), _T.Q5_K: (8, 32, True), _T.Q6_K: (8, 16, False),
}  # fmt: skip


_SLAB_BYTES = 1 << 20  # file bytes converted at a time by grouped_ints


def grouped_ints(
    data: np.ndarray,
    qtype: GGMLQuantizationType,
    shape: tuple[int, ...],
    release: Callable[[int, int], None] | None = None,
    *,
    finite: bool = False,
    pieces: list[tuple[int, int, int]] | None = None,
) -> GroupedInts:
    """A tensor's raw GGUF blocks as ``GroupedInts`` (``qtype`` in ``INT_TYPES``), its leading
    dimensions flattened into rows (stacked experts: (E, N, K) -> E * N rows).

    Converted ~1 MB of file bytes (``_SLAB_BYTES``) at a time into the result, ``release(begin, end)`` called on each
    byte range of ``data`` once read: a large tensor (a 262144-row token table) is then never in
    memory twice, as file pages and as integers. ``finite``: as ``dequantize``'s. ``pieces``: only
    that piece of the tensor (``slices.piece_rows``; tensor parallelism), only its bytes read; cut
    along the columns, its ends must be whole groups."""
    if qtype not in _INTS or len(shape) < 2:
        raise GGUFError(f"{qtype.name} tensors of shape {list(shape)} are not read as grouped integers")
    reader = BlockRows(data, qtype, shape, pieces)
    bits, group, _ = INT_TYPES[qtype]
    if reader.lead % group or reader.width % group:
        raise GGUFError(
            f"columns {reader.first}..{reader.end} of a {qtype.name} tensor of shape {list(shape)} are not "
            f"whole groups of {group}"
        )
    rows = reader.n_rows
    step = max(1, _SLAB_BYTES // reader.row_bytes)
    q_all, parts, half = None, [], True  # parts: the scales (and mins), float16 while exact
    for start in range(0, rows, step):
        stop = min(rows, start + step)
        blocks = reader.take(start, stop)
        with np.errstate(invalid="ignore", over="ignore"):
            bits, group, q, *chunk = _INTS[qtype](blocks)
        q = np.ascontiguousarray(reader.cut(q.reshape(stop - start, -1), bits / 8))
        chunk = [
            np.ascontiguousarray(reader.cut(np.asarray(v, np.float32).reshape(stop - start, -1), 1 / group))
            for v in chunk
            if v is not None
        ]
        if finite and not all(np.isfinite(v).all() for v in chunk):
            # The scales and offsets are products of the blocks' float16 fields (a NaN or infinite
            # field makes one NaN or infinite, even times 0): checked here, where they already are.
            _check_finite(blocks, qtype, partial(reader.block_index, start))  # finds the block, raises
        if q_all is None:
            q_all = np.empty((rows, q.shape[1]), q.dtype)
            parts = [np.empty((rows, v.shape[1]), np.float16) for v in chunk]
        q_all[start:stop] = q
        if half and not all(_exact_in_half(v) for v in chunk):
            # Kept as float32 from here: the rows so far widen exactly (no float32 copy of a
            # tensor whose scales float16 holds, as the token table's: 21 MB freed again would
            # raise malloc's mmap threshold and grow the heap later).
            half = False
            parts = [
                np.concatenate(
                    (p[:start].astype(np.float32), np.empty((rows - start, p.shape[1]), np.float32))
                )
                for p in parts
            ]
        for part, v in zip(parts, chunk):
            part[start:stop] = v
        if release is not None:
            release(*reader.span(start, stop))
    scales, mins = [torch.from_numpy(v) for v in parts] + [None] * (2 - len(parts))
    return GroupedInts(bits, group, torch.from_numpy(q_all), scales, mins)


def dequantize_piece(
    data: np.ndarray,
    qtype: GGMLQuantizationType,
    shape: tuple[int, ...],
    pieces: list[tuple[int, int, int]],
    dtype: torch.dtype = torch.float32,
    release: Callable[[int, int], None] | None = None,
    *,
    finite: bool = False,
) -> torch.Tensor:
    """``pieces`` (``slices.piece_rows``) of the tensor ``dequantize`` would give, reading only their
    blocks, a few rows at a time: the same values (each block decoded by the same code, then cut to
    the piece's columns and cast as ``dequantize`` casts)."""
    reader = BlockRows(data, qtype, shape, pieces)
    itemsize = torch.empty((), dtype=dtype).element_size()
    out = torch.from_numpy(np.empty(math.prod(reader.shape) * itemsize, np.uint8)).view(dtype)
    rows = out.view(reader.n_rows, reader.width)
    step = max(1, _CHUNK_VALUES // reader.values)
    for start in range(0, reader.n_rows, step):
        stop = min(reader.n_rows, start + step)
        blocks = reader.take(start, stop)
        if finite and qtype in _DECODERS:
            _check_finite(blocks, qtype, partial(reader.block_index, start))
        values = dequantize(blocks, qtype, (stop - start, reader.values))
        rows[start:stop].copy_(torch.from_numpy(reader.cut(values.numpy())))
        if release is not None:
            release(*reader.span(start, stop))
    return out.view(reader.shape)


def _exact_in_half(values: np.ndarray) -> bool:
    """Whether float16 holds every one of the float32 ``values`` (bits compared: NaNs, -0 kept)."""
    back = values.astype(np.float16).astype(np.float32)
    return bool(np.array_equal(back.view(np.uint32), values.view(np.uint32)))
