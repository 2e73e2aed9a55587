"""The AVX-512 CPUs' dispatch of bf16 products, emulated on any CPU (fixture ``avx512_dispatch``).

On CPUs with AVX-512, torch hands a bf16/fp16 matrix product of more than 16^3 multiply-adds to
oneDNN and a smaller one to its own kernel (aten/src/ATen/native/mkldnn/Matmul.cpp, checksize:
M x K x N for mm/addmm, batch x M x K x N for bmm). The two sum in different orders, so a row's
bits depend on how many rows share the call. CPUs without AVX-512 take torch's kernel at every
size, so a test there cannot see that effect.

This mode makes any machine behave like the AVX-512 one in the respect that matters: products
above the threshold come out of "another kernel" (the same sums, then the last bit of every value
flipped: one unit in the last place up or down, as often one as the other, so the model computes
the same function, only rounded otherwise), products at or below it are untouched. What
depends on row counts on AVX-512 then depends on them here, far more visibly; transformers runs
under the same mode, so a comparison with it sees the same machine. Not emulated: the products
inside ``scaled_dot_product_attention``'s CPU kernel (one op to the mode), so comparing our sdpa with
transformers' eager attention means nothing under it (tests/test_llm.py's sampling test does that).
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

ONEDNN_MIN_PRODUCT = 16 * 16 * 16
REDUCED = (torch.bfloat16, torch.float16)


def _rows(t: torch.Tensor) -> int:
    return t.numel() // t.shape[-1] if t.dim() else 1


def _size(func, args) -> int | None:
    """Multiply-adds of the product as torch's dispatch counts them; None if not a product we
    emulate (or not reduced precision on the CPU)."""
    a, b = args[0], args[1]
    if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
        return None
    if a.dtype not in REDUCED or b.dtype not in REDUCED or a.device.type != "cpu":
        return None
    if func is F.linear:  # (..., K) @ (N, K).T: folded to one (rows, K) x (K, N) product
        return _rows(a) * a.shape[-1] * b.shape[0]
    if a.dim() < 2 or b.dim() < 2:
        return None
    # matmul/bmm: batch x M x K x N, the batch dims folded
    batch = a.numel() // (a.shape[-2] * a.shape[-1]) if a.dim() > 2 else 1
    return batch * a.shape[-2] * a.shape[-1] * b.shape[-1]


def other_rounding(out: torch.Tensor) -> torch.Tensor:
    """The product as another kernel might round it: each value's last bit flipped (bf16/fp16)."""
    return (out.view(torch.int16) ^ 1).view(out.dtype)


class EmulatedAVX512Dispatch(TorchFunctionMode):
    PRODUCTS = (F.linear, torch.matmul, torch.bmm, torch.mm, torch.Tensor.matmul, torch.Tensor.__matmul__)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func in self.PRODUCTS:
            size = _size(func, args)
            if size is not None and size > ONEDNN_MIN_PRODUCT:
                out = other_rounding(out)
        elif func is torch._grouped_mm:  # F.grouped_mm (transformers' default MoE experts)
            out = _grouped_mm_dispatch(args, kwargs, out)
        return out


def _grouped_mm_dispatch(args, kwargs, out: torch.Tensor) -> torch.Tensor:
    """torch's CPU grouped_mm is one ``mm`` per group (aten's _grouped_mm_fallback: mm_out on each
    group's rows), each dispatched by its own size: the rows of a group above the threshold come
    out of the other kernel."""
    a, b, offs = args[0], args[1], kwargs.get("offs")
    if a.dtype not in REDUCED or a.device.type != "cpu" or offs is None or a.dim() != 2 or b.dim() != 3:
        return out
    out, start = out.clone(), 0
    for end in offs.tolist():
        if (end - start) * a.shape[-1] * b.shape[-1] > ONEDNN_MIN_PRODUCT:
            out[start:end] = other_rounding(out[start:end])
        start = end
    return out


class RowByRowProducts(TorchFunctionMode):
    """The other CPU class emulated: every reduced-precision product computed one row at a time, so
    a row's bits do not depend on the rows beside it, as on CPUs without AVX-512 (torch's own bf16
    kernel at every size). oneDNN stays as the machine has it: each row's product is the one a
    1-row call makes here."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in EmulatedAVX512Dispatch.PRODUCTS and _size(func, args) is not None:
            a, rest = args[0], args[1:]
            if func is F.linear:
                rows = a.reshape(-1, a.shape[-1])
                out = torch.cat([func(rows[r : r + 1], *rest, **kwargs) for r in range(rows.shape[0])])
                return out.reshape(*a.shape[:-1], out.shape[-1])
            if a.shape[-2] > 1:
                return torch.cat([func(row, *rest, **kwargs) for row in a.split(1, dim=-2)], dim=-2)
        return func(*args, **kwargs)


EVERYWHERE = os.environ.get("TORCHGEMMA_TEST_AVX512_DISPATCH") == "1"


@pytest.fixture
def avx512_dispatch():
    """Run the test as on a CPU where large bf16 products take another kernel (see module doc).
    (Under TORCHGEMMA_TEST_AVX512_DISPATCH=1 the mode is already on: two would undo each other.)"""
    if EVERYWHERE:
        yield
    else:
        with EmulatedAVX512Dispatch():
            yield


@pytest.fixture(autouse=True)
def _emulate_avx512_everywhere():
    """TORCHGEMMA_TEST_AVX512_DISPATCH=1 runs every test under the emulated dispatch: the way to
    check on an AVX2 machine that the exactness tests hold on the other CPU class too."""
    if EVERYWHERE:
        with EmulatedAVX512Dispatch():
            yield
    else:
        yield
