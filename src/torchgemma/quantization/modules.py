"""Quantized stand-ins for ``nn.Linear`` and the token tables, and round-to-nearest quantizers.

A quantized weight is three buffers, named so that a saved model reads like the checkpoint it came
from (``...q_proj.qweight``, ``...q_proj.scales``, ``...q_proj.mins``):

    qweight  int8 (N, K) for 8 bits; uint8 (N, K / 2) for 4 bits, (N, K / 32 * 20) for 5 bits
             (layout: ``csrc/qlinear.cpp``)
    scales   float32 or float16 (N, K / G), one per group of G values of a row
    mins     as scales, or absent: W = scales * q + mins

The modules only hold the buffers and call ``torch.ops.torchgemma``; where the integers come from
(round-to-nearest here, a GGUF file's own blocks in ``weights.gguf``) is the loader's business.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch import nn

from ..kernels import _dequantize_reference, ensure_kernels, features_of, pack, packed_width, vnni_available

# Calls with at least this many rows use the float32 BLAS on the weight dequantized a slab of rows at a
# time (qlinear_dense): from here on it beats the row kernel, which converts each weight group once per
# block of (4 or 8) rows. Measured on AVX2 (AMD EPYC, one thread, row kernel / BLAS): the 262144 x 640
# Q8_0 head 110 / 149 ms at 16 rows, 148 / 178 at 24, 217 / 212 at 32; the 270M's layers 68 / 86 ms at
# 16, 102 / 104 at 24, 176 / 180 at 32. So a decode step of up to 31 requests reads each weight once
# through the row kernel. With integer activations (QuantizedWeight.activation_bits) these calls round
# their activations to int16 or int8 instead (qlinear_int); calls of fewer rows never do.
DENSE_ROWS = 32
# The greedy head (QuantizedWeight.argmax) bounds calls of at most this many rows. qlinear_bounds reads
# the weight once for all rows, but its int8 products cost about what the row kernel's float products
# do on AVX2 (both bound by the multiply units once more than a few rows share a pass): on the real
# 262144 x 640 head (one thread, AMD EPYC) bounds / full product took 29 / 30 ms for 1 row, 35-47 / 39-51
# for 2, 49-63 / 46-62 for 3, 80-93 / 56-59 for 8, and the bounded rows still need their candidates.
# More rows take the full product (the same kernel as matmul), whose argmax is the same token.
BOUNDED_ROWS = 3
# From this many rows (and below DENSE_ROWS), where the CPU has AVX-512 VNNI, the greedy head scores the
# rows with qlinear_int's int8 products instead (vpdpbusd, 16 weight rows per instruction, the weight
# read once for all rows) and bounds them as qlinear_bounds does (``int8_bounds``): the same tokens.
# Real 262144 x 640 head, one thread, Zen 4 (thread CPU time, medians of 5): int8 products / full
# product 23 / 23 ms at 4 rows, 28 / 46 at 8, 39 / 89 at 16. Heads with offsets (mins) keep the full
# product: the bound below does not cover the offsets' share of the activations' rounding.
INT_BOUNDED_ROWS = 6
# A decoder's projections with integer activations (activation_bits; set_activations gives them
# ``int_rows``) take qlinear_int from this many rows on, below DENSE_ROWS too: there its integer products
# beat the float row kernel. Gemma 3 270M's 126 layer weights per decode step (Zen 4 with VNNI, thread
# CPU time, int16 / float row kernel): 1 thread 29.5 / 29.5 ms at 6 rows, 30.1 / 34.7 at 8, 34.4 / 48.8
# at 12, 44.9 / 67.0 at 16; 2 threads 21.6 / 20.6 at 8, 22.8 / 33.2 at 16. Fewer rows (single-stream
# decode) keep the float row kernel (int16 through the interleaved tiles 23.6 / 10.0 ms at 1 row; in
# place, see INT16_DECODE). The greedy head keeps DENSE_ROWS: its candidates are the row kernel's values.
INT_ROWS = 8
# Off by default (an experiment, issue 29): True sends calls of fewer than ``int_rows`` float32 rows
# (decode steps) through qlinear_int with int16 activations instead of the float row kernel, for
# weights that take integer activations (activation_bits set). Where the CPU has AVX-512 VNNI, calls of
# up to 7 rows read the stored integers in place (int_products.cpp). On the 270M's layers at 1 row, 1
# thread (Zen 4), its author measured 7.3 / 9.8 ms per step against the row kernel; the lead, each
# weight read once per call, 11.8 / 9.0 (the 8-bit 2048 x 640 weights 6.6 / 4.2). Elsewhere they
# interleave the weight per call, slower than the row kernel. Decode through it ran at 26-31 tok/s
# against 35-40 (1 thread).
INT16_DECODE = False


_QLINEAR = torch.ops.torchgemma.qlinear.default
_QLINEAR_INT = torch.ops.torchgemma.qlinear_int.default


@dataclass(frozen=True)
class Format:
    """How one weight is stored: integer width, values per scale, whether groups have offsets, and
    the dtype of scales and offsets ("float16" only where that holds them exactly, as GGML's fp16
    block scales)."""

    bits: int
    group_size: int
    has_mins: bool
    scale_dtype: str = "float32"

    def check(self, in_features: int, name: str = "weight") -> None:
        block = 8 if self.bits == 8 else 32
        if self.bits not in (4, 5, 8):
            raise ValueError(f"{name}: bits must be 4, 5 or 8, got {self.bits}")
        if self.scale_dtype not in SCALE_DTYPES:
            raise ValueError(f"{name}: scale_dtype must be float32 or float16, got {self.scale_dtype}")
        if self.group_size % block or in_features % self.group_size:
            raise ValueError(
                f"{name}: group size {self.group_size} must be a multiple of {block} that divides its "
                f"{in_features} input features"
            )

    def as_dict(self) -> dict:
        spec = {"bits": self.bits, "group_size": self.group_size, "has_mins": self.has_mins}
        if self.scale_dtype != "float32":  # configs saved before float16 scales read as they were
            spec["scale_dtype"] = self.scale_dtype
        return spec


SCALE_DTYPES = {"float32": torch.float32, "float16": torch.float16}


class QuantizedWeight(nn.Module):
    """The buffers of one quantized (N, K) weight and the two ways to use them."""

    # Products of `int_rows` rows or more round x to integers of this many bits per 32 values, 8 or 16;
    # 0: they take x as it is (set_activations, which sets both).
    activation_bits = 0
    int_rows = DENSE_ROWS

    def __init__(self, rows: int, features: int, fmt: Format, dtype: torch.dtype):
        super().__init__()
        fmt.check(features)
        self.format = fmt
        self.compute_dtype = dtype  # what forward returns (the model's dtype)
        groups = features // fmt.group_size
        packed = packed_width(features, fmt.bits)
        sdtype = SCALE_DTYPES[fmt.scale_dtype]
        self.register_buffer(
            "qweight", torch.empty(rows, packed, dtype=torch.int8 if fmt.bits == 8 else torch.uint8)
        )
        self.register_buffer("scales", torch.empty(rows, groups, dtype=sdtype))
        self.register_buffer("mins", torch.empty(rows, groups, dtype=sdtype) if fmt.has_mins else None)

    @property
    def weight_shape(self) -> tuple[int, int]:
        return (self.qweight.shape[0], features_of(self.qweight.shape[1], self.format.bits))

    def _apply(self, fn, recurse=True):
        # A dtype cast (model.to(torch.bfloat16)) changes what forward returns, never the stored
        # integers, scales and mins; device moves and allocations apply as usual.
        def convert(t: torch.Tensor) -> torch.Tensor:
            out = fn(t)
            if out.dtype == t.dtype:
                return out
            if out.is_floating_point():
                self.compute_dtype = out.dtype
            return t.to(out.device)

        return super()._apply(convert, recurse)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x (..., K) -> x @ W.T (..., N), in the model's dtype."""
        # (The buffers read from _buffers: this runs ~130 times per decoded token.)
        buffers = self._buffers
        if x.dtype is torch.float32 and x.numel() < self.int_rows * x.shape[-1]:
            # A decode step's float32 rows: _product's row kernel, called directly (what _product
            # would call, with the same float32 result, for a few microseconds less per call).
            f = self.format
            if INT16_DECODE and self.activation_bits:
                return _QLINEAR_INT(
                    x, buffers["qweight"], buffers["scales"], buffers["mins"], f.bits, f.group_size, 16
                )
            return _QLINEAR(x, buffers["qweight"], buffers["scales"], buffers["mins"], f.bits, f.group_size)
        return self._product(x, buffers["qweight"], buffers["scales"], buffers["mins"])

    def _product(self, x: torch.Tensor, qweight, scales, mins) -> torch.Tensor:
        """x @ W.T for these buffers (all of this weight's, or an expert's rows): the row kernel below
        ``int_rows`` rows (DENSE_ROWS, or INT_ROWS with integer activations), else the dense or
        integer-activation product."""
        f = self.format
        args = (x, qweight, scales, mins, f.bits, f.group_size)
        if x.numel() >= self.int_rows * x.shape[-1] and not torch.compiler.is_compiling():
            if self.activation_bits:
                out = torch.ops.torchgemma.qlinear_int.default(*args, self.activation_bits)
            else:
                out = torch.ops.torchgemma.qlinear_dense.default(*args)
        else:
            out = torch.ops.torchgemma.qlinear.default(*args)
        dtype = self._out_dtype(x)
        return out if out.dtype == dtype else out.to(dtype)

    def _out_dtype(self, x: torch.Tensor) -> torch.dtype:
        """What products return: the input's dtype (the model's), or the model's for integer input."""
        return x.dtype if x.is_floating_point() else self.compute_dtype

    def argmax(self, x: torch.Tensor, transform=None) -> torch.Tensor:
        """x (M, K) -> (M,) int64: ``transform(self.matmul(x)).argmax(-1)``, the same tokens, read
        at int8 speed where the C++ kernels can (greedy decoding through a quantized LM head).

        Every row is scored with x rounded to int8 (``qlinear_bounds``), which brackets the value
        ``matmul`` would give: ``approx - bound <= value <= approx + bound``. Rows whose upper end lies
        below the best lower end cannot win; the rest (a few dozen of 262144 on a real head) are
        computed exactly by ``matmul`` itself, row for row the same arithmetic as the full product,
        and the first of the largest wins, as in ``argmax``. ``transform`` (what the caller applies
        to the logits before choosing: a cast, a soft-cap; None: nothing) must be elementwise and
        non-decreasing.
        """
        f = self.format
        if not self._bounded(x):
            values = self.matmul(x)
            return (values if transform is None else transform(values)).argmax(-1)
        approx, bound = self._bounds(x)
        if transform is None:  # (bound (M, 1): one per row, int8_bounds')
            candidates, counts = torch.ops.torchgemma.bounded_candidates(approx, bound)
            per_row = candidates.split(counts.tolist())
        else:
            lower, upper = transform(approx - bound), transform(approx + bound)
            best = lower.amax(-1, keepdim=True)
            per_row = [row.nonzero().squeeze(1) for row in upper >= best]
        if x.shape[0] <= BOUNDED_ROWS:
            self.__dict__["_bounds_out"] = (approx, bound)  # for the next call (_bounds)
        tokens = []
        for m, candidates in enumerate(per_row):
            if candidates.numel() > self.qweight.shape[0] // 16:
                # Activations too far from their int8 rounding (one huge outlier in a block) leave
                # too many rows in doubt: the full product is faster than gathering them.
                values = self.matmul(x[m : m + 1])[0]
                tokens.append((values if transform is None else transform(values)).argmax())
                continue
            mins = None if self.mins is None else self.mins[candidates]
            values = torch.ops.torchgemma.qlinear(
                x[m : m + 1], self.qweight[candidates], self.scales[candidates], mins, f.bits, f.group_size
            ).to(self._out_dtype(x))[0]
            if transform is not None:
                # Padded to whole vectors: elementwise kernels take a tensor's tail by a scalar
                # loop, which need not round as their vector loop does (tanh).
                padded = torch.cat((values, values[-1:].expand(-values.numel() % 64)))
                values = transform(padded)[: candidates.numel()]
            tokens.append(candidates[values.argmax()])
        return torch.stack(tokens)

    def _bounded(self, x: torch.Tensor) -> bool:
        """Whether ``argmax`` brackets this call: CPU kernels loaded, 8- or 4-bit groups of 32, at
        most BOUNDED_ROWS rows (more cost as much to bound as to compute, see BOUNDED_ROWS; from
        DENSE_ROWS on the product is the dequantized BLAS's, whose rounding the candidates' row
        kernel would not reproduce). (A row with a non-finite value leaves every weight row in
        doubt: ``argmax`` then computes them all.)"""
        f = self.format
        return (
            self.qweight.device.type == "cpu"
            and f.bits in (8, 4)
            and f.group_size % 32 == 0
            and x.dim() == 2
            and (0 < x.shape[0] <= min(BOUNDED_ROWS, DENSE_ROWS - 1) or self._int_bounded(x))
            and not torch.compiler.is_compiling()
            and ensure_kernels()
        )

    def _int_bounded(self, x: torch.Tensor) -> bool:
        """Whether ``argmax`` scores this call with int8 products (``int8_bounds``; see INT_BOUNDED_ROWS)."""
        return INT_BOUNDED_ROWS <= x.shape[0] < DENSE_ROWS and self.mins is None and vnni_available()

    def _bounds(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Every row's approximate score and its bound (``argmax``)."""
        f = self.format
        if x.shape[0] > BOUNDED_ROWS:
            return int8_bounds(x, self.qweight, self.scales, f.bits, f.group_size, self._norms())
        # Into the pair of tensors the last call gave back (argmax), taken while in use (a call in
        # another thread meanwhile makes its own): a fresh pair per decode step (2 MB for a
        # 262144-row head) left freed memory that small allocations split, and the next pair then
        # came from new heap pages, up to ~1 MB more resident memory a step (Gemma 3 270M, 64
        # greedy tokens: peak RSS 544-579 MiB from run to run; kept: 544-547). What stays between
        # calls is at most BOUNDED_ROWS rows of scores: 6 MB for a 262144-row head.
        shape = (x.shape[0], self.qweight.shape[0])
        kept = self.__dict__.pop("_bounds_out", None)
        if kept is None or kept[0].shape != shape:
            # (float32 on the weight's device whatever torch's defaults: the kernel writes float32)
            new = {"dtype": torch.float32, "device": self.qweight.device}
            kept = (torch.empty(shape, **new), torch.empty(shape, **new))
        torch.ops.torchgemma.qlinear_bounds_into(
            x, self.qweight, self.scales, self.mins, f.bits, f.group_size, self._norms(), *kept
        )
        return kept

    def _norms(self) -> torch.Tensor:
        """||(scales * q)[n]|| per row, for ``qlinear_bounds``: computed once per set of buffers
        (new buffers, or the same ones changed in place, e.g. by ``load_state_dict``, are new)."""
        key = tuple((t.data_ptr(), t._version) for t in (self.qweight, self.scales))
        cached = self.__dict__.get("_row_norms")
        if cached is None or cached[0] != key:
            f = self.format
            cached = (key, torch.ops.torchgemma.row_norms(self.qweight, self.scales, f.bits, f.group_size))
            self.__dict__["_row_norms"] = cached
        return cached[1]

    def dequantize(self) -> torch.Tensor:
        """The float32 weight (N, K)."""
        f = self.format
        return torch.ops.torchgemma.dequantize(self.qweight, self.scales, self.mins, f.bits, f.group_size)

    def rows(self, index: torch.Tensor) -> torch.Tensor:
        """The float32 weight rows ``index`` (any shape) -> (*index.shape, K): a token table lookup."""
        f = self.format
        flat = index.reshape(-1)
        mins = None if self.mins is None else self.mins[flat]
        values = _dequantize_reference(self.qweight[flat], self.scales[flat], mins, f.bits, f.group_size)
        return values.view(*index.shape, -1)

    def set_weight(self, weight: torch.Tensor) -> None:
        """Fill the buffers by round-to-nearest quantization of a float (N, K) weight, in place (no
        second copy of the quantized weight while it is made)."""
        if weight.dim() != 2 or (weight.shape[0], weight.shape[1]) != (
            self.qweight.shape[0],
            self.weight_shape[-1],
        ):
            raise ValueError(
                f"a weight of shape {list(weight.shape)} for a quantized {list(self.weight_shape)}"
            )
        quantize_rtn(weight, self.format, out=(self.qweight, self.scales, self.mins))

    def set_quantized(self, qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None) -> None:
        """Adopt already-quantized buffers (e.g. a GGUF file's blocks, converted). Scales and mins
        may come in the other scale dtype than the format's (a GGUF tensor's is known only once
        converted): the format then follows them."""
        scale_dtype = {v: k for k, v in SCALE_DTYPES.items()}.get(scales.dtype)
        if scale_dtype is None or (mins is not None and mins.dtype != scales.dtype):
            raise ValueError(
                f"scales (and mins) must be float32 or float16, both the same, got {scales.dtype}"
            )
        for name, value in (("qweight", qweight), ("scales", scales), ("mins", mins)):
            current = getattr(self, name)
            if (value is None) != (current is None):
                raise ValueError(f"{name}: this weight's format {self.format} does not match the data given")
            if value is None:
                continue
            dtype = current.dtype if name == "qweight" else scales.dtype
            if value.shape != current.shape or value.dtype != dtype:
                raise ValueError(
                    f"{name}: expected {dtype} {list(current.shape)}, got {value.dtype} {list(value.shape)}"
                )
        # (The format follows the scales' dtype; the buffers are replaced, never converted: a
        # conversion would touch and then free memory the size of the scales, 10 MB for a 262144-row
        # token table, for nothing.)
        if scale_dtype != self.format.scale_dtype:
            self.format = replace(self.format, scale_dtype=scale_dtype)
        for name, value in (("qweight", qweight), ("scales", scales), ("mins", mins)):
            if value is not None:
                setattr(self, name, value.to(getattr(self, name).device).contiguous())

    def extra_repr(self) -> str:
        f = self.format
        shape = "x".join(str(d) for d in self.weight_shape)
        scales = "" if f.scale_dtype == "float32" else f", scales={f.scale_dtype}"
        return f"{shape}, bits={f.bits}, group_size={f.group_size}, mins={f.has_mins}{scales}"


class QuantizedLinear(QuantizedWeight):
    """``nn.Linear`` without bias, its weight quantized."""

    def __init__(self, in_features: int, out_features: int, fmt: Format, dtype: torch.dtype = torch.float32):
        super().__init__(out_features, in_features, fmt, dtype)
        self.in_features, self.out_features = in_features, out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.matmul(x)

    def decode_product(self, rows: int, reads=None) -> tuple | None:
        """(qweight, scales, mins, bits, group size): what ``matmul`` hands the row kernel (qlinear)
        for ``rows`` float32 rows, for callers that call it themselves (``decode_layer_*``, CPU
        fusions); None where those rows take another product. ``reads`` (a caller's record of what
        an answer depends on: ``acceleration.cpu_fusions.Reads``) is told everything read here."""
        if reads is not None:
            reads.attributes(self, "format", "int_rows", "activation_bits")
            reads.keys(self._buffers, "qweight", "scales", "mins")
            reads.keys(globals(), "INT16_DECODE")
        if rows >= self.int_rows or (INT16_DECODE and self.activation_bits):
            return None
        buffers, f = self._buffers, self.format
        return buffers["qweight"], buffers["scales"], buffers["mins"], f.bits, f.group_size


class QuantizedEmbedding(QuantizedWeight):
    """A token table with quantized rows: a lookup dequantizes only the rows it reads, and
    ``as_linear`` makes it the tied LM head."""

    def __init__(
        self, num_embeddings: int, embedding_dim: int, fmt: Format, dtype: torch.dtype = torch.float32
    ):
        super().__init__(num_embeddings, embedding_dim, fmt, dtype)
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.rows(input_ids).to(self.compute_dtype)

    def as_linear(self, x: torch.Tensor) -> torch.Tensor:
        return self.matmul(x)


class QuantizedStack(QuantizedWeight):
    """The stacked weights of a mixture of experts, (E, N, K), quantized: ``linear(e, x)`` is expert
    ``e``'s product, and indexing dequantizes the experts a static-shape (compiled) step gathers."""

    def __init__(
        self, experts: int, rows: int, features: int, fmt: Format, dtype: torch.dtype = torch.float32
    ):
        super().__init__(experts * rows, features, fmt, dtype)
        self.experts, self.expert_rows = experts, rows

    @property
    def weight_shape(self) -> tuple[int, int, int]:
        return (self.experts, self.expert_rows, super().weight_shape[1])

    def _part(self, name: str, expert: int) -> torch.Tensor | None:
        buffer, n = getattr(self, name), self.expert_rows
        return None if buffer is None else buffer[expert * n : (expert + 1) * n]

    def linear(self, expert: int, x: torch.Tensor) -> torch.Tensor:
        """Expert ``expert``'s x @ W.T: as ``matmul``, so that an expert's many rows in a prefill take
        the dense or integer-activation product."""
        parts = [self._part(name, expert) for name in ("qweight", "scales", "mins")]
        return self._product(x, *parts).to(x.dtype)

    def __getitem__(self, experts: torch.Tensor) -> torch.Tensor:
        """Experts ``experts`` (any shape) dequantized: (*experts.shape, N, K) in the model's dtype."""
        n = self.expert_rows
        rows = (experts.reshape(-1, 1) * n + torch.arange(n, device=experts.device)).reshape(-1)
        return self.rows(rows).view(*experts.shape, n, -1).to(self.compute_dtype)

    def set_weight(self, weight: torch.Tensor) -> None:
        super().set_weight(weight.reshape(-1, weight.shape[-1]))

    def set_quantized(self, qweight, scales, mins) -> None:
        flat = [None if t is None else t.reshape(-1, t.shape[-1]) for t in (qweight, scales, mins)]
        super().set_quantized(*flat)


# ── round-to-nearest quantization ───────────────────────────────────────────────────────────────


def quantize_rtn(
    weight: torch.Tensor,
    fmt: Format,
    out: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(N, K) float -> (qweight, scales, mins) by round-to-nearest per group.

    8 bits without mins: symmetric, scale = max|w| / 127. With mins (any width): the group's
    [min, max] mapped onto [0, 2^bits - 1], scale = (max - min) / (2^bits - 1), min = the group's min.
    Float16 scales and mins are rounded to float16 before the integers are chosen against them.
    Computed in float32 a few rows at a time into ``out`` (allocated if not given): memory beyond
    the result stays bounded whatever the weight's size.
    """
    n, k = weight.shape
    fmt.check(k)
    g = fmt.group_size
    levels = (1 << fmt.bits) - 1
    if fmt.bits != 8 and not fmt.has_mins:
        raise ValueError(f"{fmt.bits}-bit weights are stored with mins (has_mins=True)")
    sdtype = SCALE_DTYPES[fmt.scale_dtype]
    if out is None:
        qdtype = torch.int8 if fmt.bits == 8 else torch.uint8
        device = weight.device
        out = (
            torch.empty(n, packed_width(k, fmt.bits), dtype=qdtype, device=device),
            torch.empty(n, k // g, dtype=sdtype, device=device),
            torch.empty(n, k // g, dtype=sdtype, device=device) if fmt.has_mins else None,
        )
    qweight, scales, mins = out
    # Divisors as tensors on the weight's device: CUDA divides by a Python number as a multiply by its
    # reciprocal, which rounds differently (a model quantized on the GPU would differ from the CPU's).
    levels_t = torch.full((), float(levels), device=scales.device)
    max_int = torch.full((), 127.0, device=scales.device)
    for start in range(0, n, 4096):
        rows = slice(start, start + 4096)
        w = weight[rows].to(device=scales.device, dtype=torch.float32).view(-1, k // g, g)
        if fmt.has_mins:
            lo, hi = w.amin(-1), w.amax(-1)
            scale = ((hi - lo) / levels_t).to(sdtype).float()
            lo = lo.to(sdtype).float()
            safe = torch.where(scale > 0, scale, torch.ones_like(scale))
            q = torch.round((w - lo[..., None]) / safe[..., None]).clamp_(0, levels)
            if fmt.bits == 8:
                q = q - 128  # int8 storage: offset folded into the mins
                lo = lo + 128 * scale
            mins[rows] = lo
        else:
            scale = (w.abs().amax(-1) / max_int).to(sdtype).float()
            safe = torch.where(scale > 0, scale, torch.ones_like(scale))
            q = torch.round(w / safe[..., None]).clamp_(-127, 127)
        qweight[rows] = pack(q.view(-1, k), fmt.bits)
        scales[rows] = scale
    return qweight, scales, mins


def integer_rows(model: nn.Module) -> int | None:
    """The fewest rows from which one of ``model``'s quantized products rounds its activations to
    integers below DENSE_ROWS (INT_ROWS, for a decoder's projections with ``activation_bits``): calls
    of fewer rows get a one-row call's bits. None: no product switches below DENSE_ROWS."""
    rows = [m.int_rows for m in model.modules() if isinstance(m, QuantizedWeight) and m.int_rows < DENSE_ROWS]
    return min(rows, default=None)


def int8_bounds(
    x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, bits: int, group: int, norms: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``qlinear_bounds``' (approx, bound) for a weight without offsets, scored by ``qlinear_int``
    (x rounded to int8 per 32 values exactly as ``qlinear_bounds`` rounds it; integer sums, then one
    float32 step per span). The bound is qlinear_bounds' own: the rounding of x moves a row's product
    by at most ``||(s q)[n]|| ||x - d xq||`` (Cauchy-Schwarz), and either float32 computation by at
    most ``gamma ||(s q)[n]|| ||x||`` (gamma = (K + 64) 2^-24: a sum of K products in any order; the
    integer sums here are exact), plus 2^-21 of ``|approx| + bound`` for the final additions. A row
    with a non-finite value leaves every weight row in doubt (bound inf). The bound is per row (M, 1):
    the largest over the weight's rows, so that choosing candidates is two passes over the scores
    (``bounded_candidates`` with one bound per row)."""
    x = x.float()
    rows, features = x.shape
    approx = torch.ops.torchgemma.qlinear_int(x, qweight, scales, None, bits, group, 8)
    blocks = x.view(rows, features // 32, 32)
    d = blocks.abs().amax(-1, keepdim=True) / 127.0  # float32, as the kernel divides
    xq = torch.where(d > 0, torch.round(blocks / d).clamp(-127, 127), torch.zeros_like(blocks))
    back = d.double() * xq.double()
    err = (blocks.double() - back).square().sum((1, 2)).sqrt()
    norm, norm_back = blocks.double().square().sum((1, 2)).sqrt(), back.square().sum((1, 2)).sqrt()
    unit = (features + 64) * 2.0**-24
    gamma = unit / (1.0 - unit)
    beta = ((err + 2 * gamma * (norm + norm_back)) * (1.0 + 2.0**-20)).float()
    # One bound per row, for all its weight rows: the largest row norm's, with twice the slack (it also
    # covers the caller's one float32 rounding of ``max(approx) - 2 bound``).
    spread = norms.max() * beta
    largest = torch.maximum(approx.amax(-1).abs(), approx.amin(-1).abs())  # max |approx| per row
    # (amax and amin: 1.2 + 0.5 ms on 16 x 262144 scores, one thread; torch.aminmax took 9.6)
    bound = spread + (largest + spread) * 2.0**-20
    finite = torch.isfinite(x).all(-1)
    if not bool(finite.all()):
        approx[~finite], bound[~finite] = 0.0, float("inf")
    return approx, bound[:, None]
    return approx, bound
