"""Batch invariance: a request gets the same bits alone and in any batch, on this machine's kernels.

Everything the decoder does row by row (norms, RoPE, activations, sampling) cannot see its
neighbours, and the attention backends attend row by row when rows read different keys. What can
is a matrix product: the kernel a product runs on, and so the order it sums in, may depend on how
many rows share the call. Seen on the machines we run on:

* torch hands a bf16 (or fp16) product to oneDNN on CPUs with AVX-512 only above 16^3
  multiply-adds (M x N x K > 4096) and to its own kernel below: a small layer's rows change bits
  when a batch pushes the call past the threshold (tiny models; Gemma 3n's AltUp 4x4 products);
* MKL's float32 GEMM runs one row (gemv), 2-3 rows and 4+ rows three different ways;
* the quantized products switch kernels at ``quantization.modules.DENSE_ROWS`` rows (a decoder's
  projections with integer activations at ``INT_ROWS``).

Rather than trust a table of such rules, ``RowProbe`` asks the kernels: once per model and
engine, it multiplies random rows by each distinct weight of the decoder (and the head), alone and
in calls of several row counts, and records the first row count whose rows differ from the same
rows alone. A forward pass over several requests is then split into one pass per request when
its row count reaches that boundary for any weight (``RowProbe.split``): each request's products
are then exactly the ones it makes alone. Where no boundary is found (bf16 on AVX2: torch's own
kernel sums each row the same way at any row count) batches cost nothing extra. One rule is taken
as known rather than probed: on the AVX-512 dispatch a reduced-precision product that crosses
oneDNN's threshold is a boundary, since the two kernels' bits differ too rarely (about 1 output in
25,000) for random rows to show it. On a GPU every forward over several requests runs request by
request: there the probe let requests batch, and an H200 then moved their bf16 bits.

The probe proves what it tries: the row counts up to ``max_rows`` (the batch size, or 16), the
oneDNN threshold of each small weight, and 2-4 positions of a row in the call. Larger prefill
groups than that are assumed to stay in the regime of ``max_rows`` (kernels block rows in fixed
tiles; no kernel we know changes its summation order past a handful of rows).
"""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed
import torch.nn.functional as F
from torch import nn

from ..model.text import Experts, TextModel, expert_linear
from ..notices import slow_notice

# torch's rule (aten/src/ATen/native/mkldnn/Matmul.cpp, checksize): oneDNN takes a reduced-precision
# product of more than this many multiply-adds on CPUs where it supports the type.
ONEDNN_MIN_PRODUCT = 16 * 16 * 16
PROBE_ROWS = (2, 3, 4, 5, 8, 16, 32)  # 8, 32: quantization.modules.INT_ROWS, DENSE_ROWS
HEAD_ROWS = 16384
# Probes already run, per model (weights change in place only through load paths that build a model).
_PROBES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


@dataclass
class RowProbe:
    """For each distinct product of a model: the first row count (> 1) at which a call's rows
    differ from the same rows computed alone; None when no probed count differs."""

    boundaries: dict[str, int | None] = field(default_factory=dict)

    @property
    def first(self) -> int | None:
        """The smallest boundary over every product: calls of fewer rows are safe to batch."""
        found = [b for b in self.boundaries.values() if b is not None]
        return min(found) if found else None

    def split(self, rows_alone: list[int]) -> bool:
        """Whether a forward over requests with these row counts must run request by request: the
        batch's rows reach a boundary that some request alone does not."""
        first = self.first
        if first is None or len(rows_alone) < 2:
            return False
        return sum(rows_alone) >= first

    @classmethod
    def run(cls, model: TextModel, max_rows: int, dtype: torch.dtype) -> RowProbe:
        """Probe ``model``'s products (decoder weights, experts and the LM head) on ``dtype`` rows
        (the model's compute dtype); remembered per model (the LM head's probe of a 262k vocabulary
        takes ~1-2 s on 2 cores)."""
        max_rows = max(max_rows, 2)
        known = _PROBES.setdefault(model, {})
        if (max_rows, dtype) not in known:
            with slow_notice(
                "torchgemma: checking at which batch size this CPU's kernels change a row's bits "
                "(once per model: Engine(batch_invariant=...))..."
            ):
                known[max_rows, dtype] = cls._run(model, max_rows, dtype)
            if getattr(model, "process_group", False) is not False:  # tensor parallel: one choice
                known[max_rows, dtype] = known[max_rows, dtype].agreed(model.process_group)
        return known[max_rows, dtype]

    def agreed(self, group) -> RowProbe:
        """The smallest boundary of every rank of a tensor-parallel model (each probed its own
        slices): a split forward is one more set of collective calls, so every rank must split alike."""
        first = torch.tensor(self.first or 2**31 - 1)
        torch.distributed.all_reduce(first, op=torch.distributed.ReduceOp.MIN, group=group)
        return RowProbe({"the ranks' smallest": None if first == 2**31 - 1 else int(first)})

    @classmethod
    def _run(cls, model: TextModel, max_rows: int, dtype: torch.dtype) -> RowProbe:
        probe = cls()
        if next(itertools.chain(model.parameters(), model.buffers())).device.type != "cpu":
            # cuBLAS picks its kernels by row count: on an H200 the probe let requests batch and a
            # request's bf16 logits then moved in the batch (tests/test_gpu.py). Every forward over
            # several requests runs request by request.
            probe.boundaries["every call (not on the CPU)"] = 2
            return probe
        generator = torch.Generator().manual_seed(0)
        for name, features, product in _products(model):
            counts = {m for m in PROBE_ROWS if m <= max_rows} | {max_rows}
            small = product_size(product, features)
            switch = None
            if small is not None and small <= ONEDNN_MIN_PRODUCT:
                switch = ONEDNN_MIN_PRODUCT // small + 1  # the first call oneDNN would take
                counts.add(switch)
            boundary = _boundary(product, features, sorted(counts), dtype, generator)
            if (
                switch is not None
                and dtype in (torch.bfloat16, torch.float16)
                and onednn_takes_reduced_precision()
            ):
                # oneDNN and torch's own kernel sum in other orders, which shows in the bits of about
                # 1 output in 25,000 random ones (an AMD Zen 4, a 64 x 64 bf16 weight): too rare for
                # the probe's rows to prove the kernels alike, common enough for a real decode step.
                boundary = switch if boundary is None else min(boundary, switch)
            probe.boundaries[name] = boundary
        return probe


def product_size(product: Callable, features: int) -> int | None:
    """N x K of a dense product (its multiply-adds per row), None for others."""
    weight = getattr(product, "weight", None)
    return None if weight is None else weight.shape[0] * features


class _Dense:
    """x @ weight.T, as ``F.linear`` (what nn.Linear and a dense tied head run)."""

    def __init__(self, weight: torch.Tensor):
        self.weight = weight

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


class _FirstExpert:
    """x @ stack[0].T for a stack of expert weights, dense or quantized (``expert_linear``)."""

    def __init__(self, stack):
        self.stack = stack
        self.device = (stack if isinstance(stack, torch.Tensor) else next(stack.buffers())).device

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return expert_linear(self.stack, 0, x)


def _products(model: TextModel) -> list[tuple[str, int, Callable]]:
    """One entry per distinct product (kind, shape, dtype): its name, input features, callable."""
    seen: dict[tuple, tuple[str, int, Callable]] = {}

    def add(key: tuple, name: str, features: int, product: Callable) -> None:
        seen.setdefault(key, (name, features, product))

    for name, module in model.named_modules():
        if isinstance(module, nn.Linear):
            w = module.weight
            add(("dense", *w.shape, w.dtype), name, w.shape[1], _Dense(w))
        elif isinstance(module, Experts):
            for part in ("gate_up_proj", "down_proj"):
                stack = getattr(module, part)
                shape = tuple(stack.weight_shape) if hasattr(stack, "weight_shape") else tuple(stack.shape)
                key = ("experts", type(stack).__name__, *shape, getattr(stack, "dtype", None))
                add(key, f"{name}.{part}", shape[-1], _FirstExpert(stack))
        elif hasattr(module, "matmul") and hasattr(module, "weight_shape"):  # quantized weights
            shape = tuple(module.weight_shape)
            key = ("quantized", type(module).__name__, *shape, str(module.format))
            add(key, name, shape[-1], module.matmul)
    head = model.embed_tokens
    # The tied head multiplies by the token table (a quantized table is listed above already). Its
    # first HEAD_ROWS rows stand for it: the same product above oneDNN's threshold at any row count,
    # at a fraction of the cost (a 262k-row head probed whole took ~5 s on 2 cores).
    if model.config.tie_word_embeddings and isinstance(head, nn.Embedding):
        w = head.weight[:HEAD_ROWS]
        add(("dense", *head.weight.shape, w.dtype), "embed_tokens", w.shape[1], _Dense(w))
    return list(seen.values())


def _boundary(
    product: Callable, features: int, counts: list[int], dtype: torch.dtype, generator: torch.Generator
) -> int | None:
    """The first of ``counts`` whose call gives some row other bits than that row alone."""
    weight = getattr(product, "weight", None)
    device = weight.device if weight is not None else getattr(product, "device", torch.device("cpu"))
    rows = max(counts) + 1
    x = torch.randn(rows, features, generator=generator).to(device=device, dtype=dtype)
    with torch.inference_mode():
        alone = [product(x[i : i + 1]) for i in range(rows)]
        for m in counts:
            # Also at an offset of one row: a row's position in the call may matter too.
            for start in (0, 1):
                together = product(x[start : start + m])
                if any(not torch.equal(together[i : i + 1], alone[start + i]) for i in range(m)):
                    return m
    return None


def onednn_takes_reduced_precision() -> bool:
    """Whether torch hands bf16/fp16 products above ``ONEDNN_MIN_PRODUCT`` to oneDNN on this CPU
    (its AVX-512 dispatch; ``$ATEN_CPU_CAPABILITY`` lowers it)."""
    return torch.backends.cpu.get_cpu_capability().startswith("AVX512")
