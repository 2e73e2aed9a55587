"""Weight-only quantization: the operators and their C++ kernels, the transform, loading and saving.

The kernels are checked against the pure-PyTorch operator (dequantize, then a float64 product); the
transform against the full-precision model it came from; GGUF-native loading against the file's
dequantized tensors (equal to the bit); saving by a round trip that must give the same bits.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import torchgemma
from checkpoints import STYLES
from torchgemma import kernels
from torchgemma.config import ConfigError
from torchgemma.model.text import Embedding
from torchgemma.quantization import (
    Format,
    QuantizedEmbedding,
    QuantizedLinear,
    QuantizedStack,
    ensure_kernels,
    quantize,
    quantize_rtn,
)
from torchgemma.quantization.modules import BOUNDED_ROWS, DENSE_ROWS, INT_BOUNDED_ROWS

pytestmark = pytest.mark.usefixtures("one_thread")


@contextlib.contextmanager
def _threads(count: int):
    """The body on ``count`` torch threads under inference mode (its tensors made on the workers),
    then the thread count before it again."""
    before = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        with torch.inference_mode():
            yield
    finally:
        torch.set_num_threads(before)


def random_ints(rows: int, cols: int, bits: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    if bits == 8:
        return torch.randint(-128, 128, (rows, cols), generator=gen, dtype=torch.int8)
    return torch.randint(0, 1 << bits, (rows, cols), generator=gen, dtype=torch.uint8)


@pytest.mark.parametrize("bits", [8, 4, 5])
def test_pack_round_trip(bits):
    q = random_ints(5, 64, bits)
    packed = kernels.pack(q, bits)
    assert packed.shape == (5, {8: 64, 4: 32, 5: 40}[bits])
    assert torch.equal(kernels.unpack(packed, bits), q)
    if bits != 8:  # byte j of each 32 values: value j low, value j + 16 high (GGML's Q4 packing)
        assert packed[0, 0] == q[0, 0] & 15 | ((q[0, 16] & 15) << 4)
    if bits == 5:  # then 4 bytes: bit j of the little-endian word is bit 4 of value j (GGML's qh)
        word = int.from_bytes(bytes(packed[0, 16:20].tolist()), "little")
        assert [(word >> j) & 1 for j in range(32)] == (q[0, :32] >> 4).tolist()


CASES = [
    (8, 16, False),
    (8, 32, False),
    (8, 64, True),
    (8, 96, False),
    (4, 32, True),
    (4, 96, True),
    (5, 32, True),
    (5, 64, True),
]


@pytest.mark.parametrize("scale_dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(("bits", "group", "mins"), CASES)
@pytest.mark.parametrize("rows", [1, 3, 4, 9])
def test_cpu_kernels_equal_the_reference_operator(bits, group, mins, rows, scale_dtype):
    if not ensure_kernels():
        pytest.skip(kernels.kernel_status())
    n, k = 37, 192
    q = kernels.pack(random_ints(n, k, bits, seed=rows), bits)
    gen = torch.Generator().manual_seed(bits * group)
    scales = (torch.rand(n, k // group, generator=gen) * 0.02).to(scale_dtype)
    offsets = (torch.randn(n, k // group, generator=gen) * 0.05).to(scale_dtype) if mins else None
    weight = kernels._dequantize_reference(q, scales, offsets, bits, group)
    # The C++ dequantizer computes scale * q, then + min, unfused: the reference's bits.
    assert torch.equal(torch.ops.torchgemma.dequantize(q, scales, offsets, bits, group), weight)
    x = torch.randn(2, rows, k, generator=gen)
    out = torch.ops.torchgemma.qlinear(x, q, scales, offsets, bits, group)
    exact = x.double() @ weight.double().T
    assert out.shape == (2, rows, n) and out.dtype == torch.float32
    assert (out.double() - exact).abs().max() <= 2e-5 * exact.abs().max()


@pytest.mark.parametrize(
    ("bits", "group", "mins"), [(8, 32, False), (8, 16, True), (4, 32, True), (5, 64, True)]
)
def test_dense_product_is_the_float32_product_of_the_dequantized_weight(bits, group, mins):
    """Prefill's path (16 rows or more): slabs of dequantized rows through the BLAS, over a weight
    whose rows are not a whole number of slabs (1000 rows of 320: slabs of 819)."""
    if not ensure_kernels():
        pytest.skip(kernels.kernel_status())
    n, k = 1000, 320
    q = kernels.pack(random_ints(n, k, bits, seed=9), bits)
    gen = torch.Generator().manual_seed(3)
    scales = torch.rand(n, k // group, generator=gen) * 0.02
    offsets = torch.randn(n, k // group, generator=gen) * 0.05 if mins else None
    x = torch.randn(2, 17, k, generator=gen)
    out = torch.ops.torchgemma.qlinear_dense(x, q, scales, offsets, bits, group)
    weight = kernels._dequantize_reference(q, scales, offsets, bits, group)
    exact = x.double() @ weight.double().T
    assert out.shape == (2, 17, n) and out.dtype == torch.float32
    assert (out.double() - exact).abs().max() <= 2e-5 * exact.abs().max()
    # Two threads, each with slabs of its own, under inference mode (its tensors made on the workers)
    with _threads(2):
        threaded = torch.ops.torchgemma.qlinear_dense(x, q, scales, offsets, bits, group)
    assert (threaded.double() - exact).abs().max() <= 2e-5 * exact.abs().max()


@pytest.mark.parametrize(
    ("bits", "group", "mins", "scale_dtype"),
    [
        (8, 32, False, torch.float32),
        (8, 192, False, torch.float32),
        (8, 16, True, torch.float32),
        (4, 32, True, torch.float32),
        (8, 32, False, torch.float16),
        (4, 32, True, torch.float16),
        (5, 32, True, torch.float16),
        (5, 64, True, torch.float32),
    ],
)
def test_a_rows_result_does_not_depend_on_the_rows_beside_it(bits, group, mins, scale_dtype):
    """Decode batches of 1 to 15 rows: each row's products equal, to the bit, that row alone (the
    engine promises a request what it would get alone). 389 weight rows: the kernel's tiles of
    weight rows (~32 KB each) end inside the weight, and at an odd row."""
    if not ensure_kernels():
        pytest.skip(kernels.kernel_status())
    n, k = 389, 192
    q = kernels.pack(random_ints(n, k, bits, seed=5), bits)
    gen = torch.Generator().manual_seed(2)
    scales = torch.rand(n, k // group, generator=gen).to(scale_dtype)
    offsets = torch.randn(n, k // group, generator=gen).to(scale_dtype) if mins else None
    x = torch.randn(15, k, generator=gen)
    alone = torch.cat(
        [torch.ops.torchgemma.qlinear(x[i : i + 1], q, scales, offsets, bits, group) for i in range(15)]
    )
    for rows in (2, 3, 4, 5, 8, 15):
        together = torch.ops.torchgemma.qlinear(x[:rows], q, scales, offsets, bits, group)
        assert torch.equal(together, alone[:rows]), rows


@pytest.mark.parametrize("threads", [1, 2])
def test_a_long_weight_read_in_streams_gives_each_rows_bits(threads):
    """One activation row against an 8-bit weight of 8 MiB or more (an LM head) reads the weight
    rows as several streams side by side (qlinear.cpp, kLongStreams): every row is computed once and
    equals, to the bit, the product of a shorter weight holding it (the tiles' path), rows past the
    last whole set of streams included (16,385 rows)."""
    if not ensure_kernels():
        pytest.skip(kernels.kernel_status())
    n, k = 16385, 640  # 10.5 MB of int8; its pieces below stay under 8 MiB
    q = random_ints(n, k, 8, seed=11)
    gen = torch.Generator().manual_seed(12)
    scales = (torch.rand(n, k // 32, generator=gen) * 0.02).half()
    x = torch.randn(1, k, generator=gen)
    with _threads(threads):
        whole = torch.ops.torchgemma.qlinear(x, q, scales, None, 8, 32)
    cuts = (0, 5000, 10000, n)
    pieces = torch.cat(
        [torch.ops.torchgemma.qlinear(x, q[a:b], scales[a:b], None, 8, 32) for a, b in zip(cuts, cuts[1:])],
        dim=1,
    )
    assert torch.equal(whole, pieces)


def test_operators_check_their_inputs():
    q = kernels.pack(random_ints(4, 64, 8), 8)
    scales = torch.ones(4, 2)
    with pytest.raises((RuntimeError, ValueError), match="features"):
        torch.ops.torchgemma.qlinear(torch.randn(1, 63), q, scales, None, 8, 32)
    with pytest.raises((RuntimeError, ValueError), match="group size"):
        torch.ops.torchgemma.qlinear(torch.randn(1, 64), q, torch.ones(4, 3), None, 8, 24)
    q5 = kernels.pack(random_ints(4, 64, 5), 5)
    with pytest.raises((RuntimeError, ValueError), match="mins"):  # mins of another dtype than scales
        torch.ops.torchgemma.qlinear(torch.randn(1, 64), q5, scales.half(), torch.ones(4, 2), 5, 32)
    with pytest.raises((RuntimeError, ValueError), match="20 bytes"):
        torch.ops.torchgemma.qlinear(torch.randn(1, 64), q5[:, :30].contiguous(), scales, scales, 5, 32)


@pytest.mark.parametrize(
    ("bits", "group", "mins", "scale_dtype"),
    [
        (8, 64, False, "float32"),
        (8, 32, True, "float32"),
        (4, 32, True, "float32"),
        (4, 64, True, "float32"),
        (5, 32, True, "float32"),
        (8, 32, False, "float16"),
        (5, 32, True, "float16"),
    ],
)
def test_round_to_nearest_is_within_half_a_step(bits, group, mins, scale_dtype):
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(16, 128, generator=gen)
    weight[3] = 0.0  # an all-zero row must not divide by zero
    fmt = Format(bits, group, mins, scale_dtype)
    qweight, scales, offsets = quantize_rtn(weight, fmt)
    assert scales.dtype == getattr(torch, scale_dtype)
    back = kernels._dequantize_reference(qweight, scales, offsets, bits, group)
    step = scales.float().repeat_interleave(group, dim=1)
    assert torch.all((back - weight).abs() <= step / 2 + 1e-6)
    assert torch.equal(back[3], torch.zeros(128))


def test_missing_compiler_falls_back_with_a_clear_message(tmp_path):
    """No compiler on PATH: a warning naming the problem, and the layers still compute (slowly)."""
    script = textwrap.dedent(
        """
        import warnings, torch
        from torchgemma import kernels
        kernels.library.PACKAGE_DIR = kernels.library.Path("/nonexistent")  # no library from the install
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert kernels.ensure_kernels() is False
        print(caught[0].message)
        q = kernels.pack(torch.randint(-9, 9, (4, 32), dtype=torch.int8), 8)
        w = kernels._dequantize_reference(q, torch.ones(4, 1), None, 8, 32)
        x = torch.randn(2, 32)
        assert torch.allclose(torch.ops.torchgemma.qlinear(x, q, torch.ones(4, 1), None, 8, 32), x @ w.T)
        q5 = kernels.pack(torch.randint(0, 32, (4, 32), dtype=torch.uint8), 5)
        s, m = torch.full((4, 1), 0.5, dtype=torch.float16), torch.full((4, 1), -8.0, dtype=torch.float16)
        w5 = kernels.unpack(q5, 5).float() * 0.5 - 8
        assert torch.equal(torch.ops.torchgemma.dequantize(q5, s, m, 5, 32), w5)
        assert torch.allclose(torch.ops.torchgemma.qlinear(x, q5, s, m, 5, 32), x @ w5.T)
        print("fallback ok")
        """
    )
    env = {k: v for k, v in os.environ.items() if k != "CXX"}
    env["PATH"] = str(tmp_path)  # nothing to compile with
    env["TORCH_EXTENSIONS_DIR"] = str(tmp_path / "ext")  # and no earlier build to load
    done = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert "no C++ compiler found" in done.stdout and "pure-PyTorch" in done.stdout
    assert "fallback ok" in done.stdout


# ── integer activations (qlinear_int) ───────────────────────────────────────────────────────────

I8_CASES = [
    (8, 8, False),
    (8, 16, False),
    (8, 32, False),
    (8, 64, True),
    (8, None, False),  # one scale per row
    (4, 32, True),
    (4, 64, False),
    (5, 32, True),
]
I8_SHAPES = [(1, 16, 64), (5, 40, 96), (17, 100, 320), (9, 33, 640)]  # 96: a 32-value tail past 64


def _i8_inputs(bits, group, mins, scale_dtype, rows, n, k, seed=0):
    gen = torch.Generator().manual_seed(seed)
    group = group or k
    q = kernels.pack(random_ints(n, k, bits, seed), bits)
    scales = (torch.rand(n, k // group, generator=gen) * 0.02).to(scale_dtype)
    offsets = (torch.randn(n, k // group, generator=gen) * 0.05).to(scale_dtype) if mins else None
    x = torch.randn(rows, k, generator=gen) * torch.rand(1, k, generator=gen) * 4  # uneven blocks
    return x, q, scales, offsets, bits, group


@pytest.mark.parametrize("x_bits", [8, 16])
@pytest.mark.parametrize("scale_dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(
    ("bits", "group", "mins", "rows", "n", "k"),
    [(*case, *shape) for case in I8_CASES for shape in I8_SHAPES if shape[2] % (case[1] or 1) == 0],
)
def test_integer_activation_product_is_its_stated_arithmetic(
    bits, group, mins, scale_dtype, rows, n, k, x_bits
):
    """The C++ kernel (VNNI where the CPU has it) against the float64 reference of what the kernel
    says it computes (exact integer sums per span, then the scales): equal to float32 rounding. One
    int8 activation rounded one step the other way, or a wrong offset or span, is ~1e-4 of the scale."""
    ensure_kernels()
    args = _i8_inputs(bits, group, mins, scale_dtype, rows, n, k)
    ours = torch.ops.torchgemma.qlinear_int(*args, x_bits)
    reference = kernels._qlinear_int_reference(*args, x_bits)
    x, q, scales, offsets, _, g = args
    weight = kernels._dequantize_reference(q, scales, offsets, bits, g).double()
    size = x.double().abs() @ weight.abs().T  # the sum of |terms|: what float32 rounding scales with
    assert ours.shape == (rows, n) and ours.dtype == torch.float32
    assert ((ours.double() - reference.double()).abs() <= 2e-6 * size + 1e-30).all()


@pytest.mark.parametrize(("x_bits", "levels"), [(8, 127), (16, 32767)])
def test_integer_activations_are_rounded_per_32_values(x_bits, levels):
    """xq = round(x / d), d = max |x| / L per block of 32, ties to even, zero blocks zero; and the
    product's error from the float32 product is what that rounding allows (Cauchy-Schwarz per row):
    for int16, ~258 times less than for int8."""
    x = torch.tensor([[0.0] * 32 + [levels, -63.5, 0.5, 1.5] + [0.0] * 28])
    xq, d = kernels.round_to_ints(x, x_bits)
    assert d.tolist() == [[0.0, 1.0]]
    assert xq[0, 32:36].tolist() == [levels, -64, 0, 2]  # -63.5 and 0.5 to even, 1.5 up to 2
    ensure_kernels()
    x, q, scales, offsets, bits, group = _i8_inputs(8, 32, True, torch.float32, 7, 48, 256, seed=3)
    ours = torch.ops.torchgemma.qlinear_int(x, q, scales, offsets, bits, group, x_bits).double()
    weight = kernels._dequantize_reference(q, scales, offsets, bits, group).double()
    exact = x.double() @ weight.T
    xq, d = kernels.round_to_ints(x, x_bits)
    rounding = (x.double() - xq.double() * d.double().repeat_interleave(32, -1)).norm(dim=-1)
    allowed = rounding[:, None] * weight.norm(dim=-1)[None, :] + 1e-5 * (x.double().abs() @ weight.abs().T)
    error = (ours - exact).abs()
    assert (error <= allowed).all()
    assert error.max() > 0.1 / levels * exact.abs().max()  # the activations were rounded


def test_integer_activation_products_do_not_depend_on_the_thread_count():
    ensure_kernels()
    args = _i8_inputs(5, 32, True, torch.float16, 37, 200, 320, seed=4)
    for x_bits in (8, 16):
        one = torch.ops.torchgemma.qlinear_int(*args, x_bits)
        with _threads(2):
            two = torch.ops.torchgemma.qlinear_int(*args, x_bits)
        assert torch.equal(one, two)


@pytest.mark.parametrize("threads", [2, 3, 5])
def test_products_do_not_depend_on_how_the_threads_share_the_rows(threads):
    """The row kernel, the greedy head's bounds and both integer products hand out tasks of rows per
    thread (each thread's own share first, then what is left of the others'): over rows that split
    unevenly into tasks and shares, more threads than cores included (so threads take others'
    tasks), every row is computed once and gives one thread's bits."""
    ensure_kernels()
    x, q, scales, offsets, bits, group = _i8_inputs(8, 32, False, torch.float16, 16, 3001, 256, seed=6)
    norms = torch.ops.torchgemma.row_norms(q, scales, bits, group)
    ops = torch.ops.torchgemma

    def products():
        return [
            ops.qlinear(x[:1], q, scales, offsets, bits, group),
            ops.qlinear(x[:3], q, scales, offsets, bits, group),
            *ops.qlinear_bounds(x[:1], q, scales, offsets, bits, group, norms),
            ops.qlinear_int(x, q, scales, offsets, bits, group, 8),
            ops.qlinear_int(x[:2], q, scales, offsets, bits, group, 16),
        ]

    one = products()
    with _threads(threads):
        many = products()
    for a, b in zip(one, many):
        assert torch.equal(a, b)


# The weight formats of the GGUF loader (Q8_0, Q6_K as 8-bit groups of 16, Q4_K, Q5_K/Q5_0 as 5-bit) and a
# group of 64, with the scale dtypes the loader stores.
FEW_ROW_CASES = [
    (8, 32, False, torch.float16),
    (8, 16, False, torch.float32),
    (4, 32, True, torch.float16),
    (5, 32, True, torch.float16),
    (5, 32, False, torch.float32),
    (8, 64, True, torch.float32),
]


@pytest.mark.parametrize("x_bits", [16, 8])
@pytest.mark.parametrize(("bits", "group", "mins", "scale_dtype"), FEW_ROW_CASES)
def test_few_row_integer_products_give_the_bits_of_a_many_row_call(bits, group, mins, scale_dtype, x_bits):
    """Where the CPU has AVX-512 VNNI, int16 calls of up to 7 rows (decode steps) read the stored
    integers in place, calls of 8-11 rows interleave the weight's, calls of 12 and more the
    activations' (lane groups of 16, the last one partial here); elsewhere the portable loop. Each
    row's product is the same bits every way, in every instruction set's build: 70 weight rows (a
    partial block of 16), 1-40 activation rows, 96 features for int8 (a row of 96 bytes: one 64-byte
    transpose and a tail)."""
    ensure_kernels()
    k = 96 if x_bits == 8 and group in (16, 32) else 320
    x, *rest = _i8_inputs(bits, group, mins, scale_dtype, 40, 70, k, seed=5)
    runs = {}
    for isa in kernels.available_isas():
        with kernels.using_isa(isa):
            many = torch.ops.torchgemma.qlinear_int(x, *rest, x_bits)
            for m in (1, 2, 3, 4, 7, 8, 11, 12, 16, 17):
                few = torch.ops.torchgemma.qlinear_int(x[:m].clone(), *rest, x_bits)
                assert torch.equal(few, many[:m]), (isa, m)
            runs[isa] = many
    first = next(iter(runs.values()))
    for isa, out in runs.items():
        assert torch.equal(out, first), isa


def test_integer_activation_rows_that_are_not_finite_give_nan():
    ensure_kernels()
    x, q, scales, offsets, bits, group = _i8_inputs(4, 32, True, torch.float32, 3, 16, 64)
    clean = torch.ops.torchgemma.qlinear_int(x, q, scales, offsets, bits, group, 16)
    x[1, 5] = float("inf")
    out = torch.ops.torchgemma.qlinear_int(x, q, scales, offsets, bits, group, 16)
    assert out[1].isnan().all()
    assert torch.equal(out[[0, 2]], clean[[0, 2]])


def test_projections_take_integer_activations_from_int_rows(text_checkpoints):
    """With integer activations a decoder's projections switch to qlinear_int at INT_ROWS rows (batched
    decode steps) and the LM head at DENSE_ROWS; ``integer_rows`` tells verify passes where."""
    from torchgemma.quantization import QuantizedLinear, QuantizedWeight, set_activations, vnni_available
    from torchgemma.quantization.modules import INT_ROWS, integer_rows

    model = torchgemma.load(text_checkpoints["e2b"], quantize="int8", activations=None)
    assert integer_rows(model) is None
    with pytest.warns(RuntimeWarning) if not vnni_available() else contextlib.nullcontext():
        set_activations(model, "int16")
    first = INT_ROWS if vnni_available() else DENSE_ROWS  # without VNNI: portable loops, prefill only
    assert integer_rows(model) == (INT_ROWS if vnni_available() else None)
    weights = [m for m in model.modules() if isinstance(m, QuantizedWeight)]
    assert {m.int_rows for m in weights if type(m) is QuantizedLinear and m.activation_bits} == {first}
    assert {m.int_rows for m in weights if type(m) is not QuantizedLinear} == {DENSE_ROWS}
    proj = model.language_model.layers[0].mlp.up_proj
    f = proj.format
    args = (proj.qweight, proj.scales, proj.mins, f.bits, f.group_size)
    gen = torch.Generator().manual_seed(3)
    for rows, integer in (
        (INT_ROWS - 1, False),
        (INT_ROWS, first == INT_ROWS),
        (DENSE_ROWS - 1, first == INT_ROWS),
    ):
        x = torch.randn(rows, proj.weight_shape[1], generator=gen)
        if integer:
            expected = torch.ops.torchgemma.qlinear_int(x, *args, 16)
        else:
            expected = torch.ops.torchgemma.qlinear(x, *args)
        assert torch.equal(proj(x), expected), rows
    set_activations(model, None)
    assert integer_rows(model) is None and {m.int_rows for m in weights} == {DENSE_ROWS}


def test_integer_activations_on_a_model(text_checkpoints):
    """Products of DENSE_ROWS rows or more (prefill) round activations; one-token steps keep their
    bits; None restores the float products; "auto" is int16 with VNNI, else None; refused where it
    cannot run."""
    from torchgemma.quantization import QuantizedWeight, set_activations, vnni_available

    folder = text_checkpoints["e2b"]
    model = torchgemma.load(folder, quantize="int8", activations=None)
    weights = [m for m in model.modules() if isinstance(m, QuantizedWeight)]
    assert weights and not any(m.activation_bits for m in weights)
    ids = torch.cat([IDS, IDS[:, :6]], dim=1)  # 2 x 17 tokens: 34 rows per product
    assert ids.numel() >= DENSE_ROWS
    with torch.inference_mode():
        prefill, step = model(ids), model(ids[:, :1])
        errors = {}
        for name, bits in (("int8", 8), ("int16", 16)):
            assert set_activations(model, name) is model
            # every weight whose rows split into blocks of 32 (the per-layer table's 80 do not)
            assert [m.activation_bits for m in weights] == [
                bits * (m.weight_shape[-1] % 32 == 0) for m in weights
            ]
            assert sum(bool(m.activation_bits) for m in weights) > len(weights) / 2
            rounded = model(ids)
            assert torch.equal(model(ids[:, :1]), step)  # 2 rows: the float kernels
            assert not torch.equal(rounded, prefill)
            errors[name] = _relative_rms(rounded.double(), prefill.double())
        assert errors["int16"] < errors["int8"] / 50 and errors["int8"] < 0.05
        set_activations(model, None)
        assert torch.equal(model(ids), prefill)
    auto = torchgemma.load(folder, quantize="int8")
    assert auto.language_model.layers[0].self_attn.q_proj.activation_bits == (16 if vnni_available() else 0)
    assert (
        torchgemma.load(folder, quantize="int8", activations="int8")
        .language_model.layers[0]
        .mlp.up_proj.activation_bits
        == 8
    )
    assert (
        quantize(torchgemma.load(folder, quantize=None), "int4", activations="int8")
        .language_model.layers[0]
        .mlp.up_proj.activation_bits
        == 8
    )
    from torchgemma.cli.common import quantization_note  # what --verbose says of the model

    assert quantization_note(set_activations(auto, "int8")).startswith(
        " activations (int8 in prefill products), int8 weights"
    )
    assert quantization_note(set_activations(auto, None)).startswith(" activations, int8 weights")
    with pytest.raises(ValueError, match="needs a quantized model"):
        set_activations(torchgemma.load(folder, quantize=None), "int8")
    with pytest.raises(ValueError, match="unknown activations 'int4'"):
        torchgemma.load(folder, quantize="int8", activations="int4")


def test_integer_activations_without_vnni(text_checkpoints, monkeypatch):
    """Without VNNI "auto" keeps float activations, and asking for integer ones says what it costs."""
    from torchgemma.quantization import set_activations

    monkeypatch.setattr(torchgemma.quantization.transform, "vnni_available", lambda: False)
    model = torchgemma.load(text_checkpoints["31b"], quantize="int4")
    up = model.language_model.layers[0].mlp.up_proj
    assert up.activation_bits == 0
    with pytest.warns(RuntimeWarning, match='activations="int8" without AVX-512 VNNI .* slower than float'):
        set_activations(model, "int8")
    assert up.activation_bits == 8


# ── the transform on tiny checkpoints ───────────────────────────────────────────────────────────


def _logits(model, ids):
    with torch.inference_mode():
        return model(ids).double()


IDS = torch.randint(3, 250, (2, 11), generator=torch.Generator().manual_seed(7))


def _relative_rms(ours: torch.Tensor, reference: torch.Tensor) -> float:
    return float((ours - reference).pow(2).mean().sqrt() / reference.pow(2).mean().sqrt())


@pytest.mark.parametrize("style", list(STYLES))
@pytest.mark.parametrize(
    ("mode", "group", "tolerance"), [("int8", None, 0.03), ("int8", 32, 0.03), ("int4", 32, 0.3)]
)
def test_quantized_model_stays_close_to_full_precision(text_checkpoints, style, mode, group, tolerance):
    """Every style: the decoder's linear layers and token tables quantized; logits within a relative
    RMS error of the float model's (another model is ~1.4 away), the same top-1 token nearly always."""
    full = torchgemma.load(text_checkpoints[style])
    model = quantize(torchgemma.load(text_checkpoints[style]), mode, group_size=group)
    kinds = {type(m) for m in model.modules()}
    assert QuantizedLinear in kinds and QuantizedEmbedding in kinds
    plain = {
        n
        for n, m in model.named_modules()
        if type(m) in (torch.nn.Linear, Embedding) and n.startswith("language_model.") and "router" not in n
    }
    plain |= {
        n for n, p in model.named_parameters() if n.endswith(("experts.gate_up_proj", "experts.down_proj"))
    }
    assert plain == set(model.quantization["kept"])  # only what the format cannot hold stays float
    assert set(model.quantization["layers"]).isdisjoint(plain)
    assert isinstance(model.language_model.embed_tokens, QuantizedEmbedding)
    if model.config.text.has_per_layer_inputs and group is None:
        assert isinstance(model.language_model.embed_tokens_per_layer, QuantizedEmbedding)
    if model.config.text.enable_moe_block:
        assert isinstance(model.language_model.layers[0].experts.gate_up_proj, QuantizedStack)
    reference, ours = _logits(full, IDS), _logits(model, IDS)
    assert _relative_rms(ours, reference) < tolerance
    assert (ours.argmax(-1) == reference.argmax(-1)).float().mean() >= 0.9
    other = _logits(torchgemma.load(text_checkpoints["e2b" if style != "e2b" else "e4b"]), IDS)
    assert _relative_rms(other, reference) > 1.0


def test_quantize_at_load_equals_quantize_after_load(text_checkpoints):
    folder = text_checkpoints["e2b"]
    after = quantize(torchgemma.load(folder), "int4")
    during = torchgemma.load(folder, quantize="int4")
    assert after.quantization == during.quantization
    ours, theirs = after.state_dict(), during.state_dict()
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[k], theirs[k]) for k in ours)


def test_bf16_model_quantized_computes_in_bf16(text_checkpoints):
    model = torchgemma.load(text_checkpoints["31b"], dtype=torch.bfloat16, quantize="int8")
    assert model.dtype == torch.bfloat16
    assert model.language_model.layers[0].mlp.up_proj.scales.dtype == torch.float32
    with torch.inference_mode():
        logits = model(IDS)
    assert logits.dtype == torch.bfloat16 and torch.isfinite(logits).all()


def test_cached_decode_of_a_quantized_model_equals_its_full_forward(text_checkpoints):
    """The cache and the quantized layers compose: decode step by step = one forward (float32, float
    activations: integer ones round calls of INT_ROWS rows or more, as the 11-token forward)."""
    model = torchgemma.load(text_checkpoints["e2b"], quantize="int8", activations=None)
    ids = IDS[:1]
    cache = model.make_cache(1, 16)
    with torch.inference_mode():
        full = model(ids)
        steps = [model(ids[:, :4], cache=cache)] + [
            model(ids[:, t : t + 1], cache=cache) for t in range(4, 11)
        ]
    assert (torch.cat(steps, 1) - full).abs().max() < 1e-4


def test_save_and_load_round_trip_to_the_bit(text_checkpoints, tmp_path):
    model = torchgemma.load(text_checkpoints["26b"], quantize="int4")
    torchgemma.save(model, tmp_path / "q", copy_from=text_checkpoints["26b"])
    config = json.loads((tmp_path / "q" / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == "torchgemma"
    assert config["quantization_config"]["mode"] == "int4"
    from safetensors import safe_open

    with safe_open(tmp_path / "q" / "model.safetensors", "pt") as f:
        names = set(f.keys())
    assert "model.layers.0.mlp.up_proj.qweight" in names and "model.layers.0.mlp.up_proj.weight" not in names
    assert "model.layers.0.router.proj.weight" in names  # the router stays in full precision
    back = torchgemma.load(tmp_path / "q")
    assert back.quantization == model.quantization
    assert torch.equal(_logits(back, IDS), _logits(model, IDS))
    with pytest.raises(ValueError, match="already quantized"):
        torchgemma.load(tmp_path / "q", quantize="int8")


def test_unquantized_save_round_trip(text_checkpoints, tmp_path):
    model = torchgemma.load(text_checkpoints["e4b"])
    torchgemma.save(model, tmp_path / "f")
    assert torch.equal(_logits(torchgemma.load(tmp_path / "f"), IDS), _logits(model, IDS))


def test_bad_modes_and_foreign_quantization_configs_are_refused(text_checkpoints, tmp_path):
    folder = text_checkpoints["31b"]
    with pytest.raises(ValueError, match="unknown quantization 'int3'"):
        torchgemma.load(folder, quantize="int3")
    with pytest.raises(ValueError, match="not a .gguf file"):
        torchgemma.load(folder, quantize="gguf")
    with pytest.raises(ValueError, match="load-only|GGUF"):
        quantize(torchgemma.load(folder), "gguf")
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "bitsandbytes", "load_in_4bit": True}
    bad = tmp_path / "bnb"
    bad.mkdir()
    (bad / "config.json").write_text(json.dumps(config))
    (bad / "model.safetensors").symlink_to(folder / "model.safetensors")
    with pytest.raises(ConfigError, match="quant_method 'bitsandbytes' is not supported"):
        torchgemma.load(bad)


def test_layers_the_group_size_cannot_hold_are_an_error(text_checkpoints):
    with pytest.raises(ValueError, match="no layer can be quantized.*group size 48"):
        quantize(torchgemma.load(text_checkpoints["31b"]), "int4", group_size=48)


# ── the per-layer-embedding table off the accelerator ────────────────────────────────────────────


@pytest.mark.parametrize("quantized", [None, "int8"])
def test_per_layer_table_on_the_host_gives_the_same_bits(text_checkpoints, quantized):
    """The table kept in host memory: only the looked-up rows move, and logits are bit-identical."""
    from torchgemma.placement import HostPlacement

    folder = text_checkpoints["e2b"]
    plain = torchgemma.load(folder, quantize=quantized, per_layer_table="device")
    host = torchgemma.load(folder, quantize=quantized, per_layer_table="host")
    table = host.language_model.embed_tokens_per_layer
    assert isinstance(table, HostPlacement) and not isinstance(
        plain.language_model.embed_tokens_per_layer, HostPlacement
    )
    assert torch.equal(_logits(host, IDS), _logits(plain, IDS))
    cache_host, cache_plain = host.make_cache(2, 16), plain.make_cache(2, 16)
    with torch.inference_mode():
        for t in range(0, 11, 5):
            a = host(IDS[:, t : t + 5], cache=cache_host)
            b = plain(IDS[:, t : t + 5], cache=cache_plain)
            assert torch.equal(a, b)
    # A lookup returns the rows of the call's tokens only: (B, T, layers * P).
    cfg = host.config.text
    rows = table(IDS)
    assert rows.shape == (*IDS.shape, cfg.num_hidden_layers * cfg.hidden_size_per_layer_input)


def test_per_layer_table_stays_on_the_host_when_the_model_moves(text_checkpoints):
    """A stand-in for a GPU (no GPU here): moving the model to the meta device moves every tensor
    but the table, whose lookups then deliver there; a dtype cast casts the table on the host."""
    model = torchgemma.load(text_checkpoints["e4b"], per_layer_table="host")
    table = model.language_model.embed_tokens_per_layer
    model.to(torch.bfloat16)
    assert table.weight.dtype == torch.bfloat16 and table.weight.device.type == "cpu"
    model.to("meta")
    assert model.language_model.norm.weight.device.type == "meta"
    assert table.weight.device.type == "cpu" and not table.weight.is_meta
    assert table.output_device.type == "meta"
    assert table(IDS).device.type == "meta"


@pytest.mark.gpu
def test_per_layer_table_on_the_host_with_a_cuda_model(text_checkpoints):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    folder = text_checkpoints["e2b"]
    host = torchgemma.load(folder, device="cuda", dtype=torch.bfloat16)  # "auto": host on CUDA
    on_gpu = torchgemma.load(folder, device="cuda", dtype=torch.bfloat16, per_layer_table="device")
    table = host.language_model.embed_tokens_per_layer
    assert table.weight.device.type == "cpu" and table.weight.is_pinned()
    ids = IDS.cuda()
    assert torch.equal(_logits(host, ids), _logits(on_gpu, ids))


def test_quantized_experts_grouped_and_gathered_paths_agree(text_checkpoints):
    """The eager expert loop multiplies quantized stacks in place; the static-shape (compiled) path
    dequantizes the experts it gathers: the same sums up to float32 rounding."""
    model = torchgemma.load(text_checkpoints["26b"], quantize="int8")
    layer = model.language_model.layers[0]
    x = torch.randn(5, model.config.text.hidden_size, generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        weights, experts = layer.router(x)
        grouped = layer.experts.grouped(x, weights, experts)
        gathered = layer.experts.gathered(x, weights, experts)
    assert (grouped - gathered).abs().max() <= 1e-5 * grouped.abs().max()
    # A prefill's worth of rows: experts with 16 rows or more take the dense product (float32: the
    # same sums to rounding), or with integer activations the integer one (the activations rounded).
    from torchgemma.quantization import set_activations

    x = torch.randn(96, model.config.text.hidden_size, generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        weights, experts = layer.router(x)
        assert torch.bincount(experts.flatten()).max() >= 16
        set_activations(model, None)
        grouped = layer.experts.grouped(x, weights, experts)
        gathered = layer.experts.gathered(x, weights, experts)
        assert (grouped - gathered).abs().max() <= 1e-5 * grouped.abs().max()
        set_activations(model, "int8")
        rounded = layer.experts.grouped(x, weights, experts)
    assert 1e-5 * grouped.abs().max() < (rounded - gathered).abs().max() <= 0.05 * grouped.abs().max()


@pytest.mark.parametrize(("style", "mode"), [("e2b", "int8"), ("31b", "int4"), ("26b", "int8")])
def test_info_weight_bytes_are_what_quantize_stores(text_checkpoints, style, mode):
    """`torchgemma info`'s int8/int4 figures, from the config alone, equal the bytes of the model
    quantize builds (its float tensors in bf16)."""
    from torchgemma.info import describe

    folder = text_checkpoints[style]
    model = torchgemma.load(folder, dtype=torch.bfloat16, quantize=mode)
    assert not model.quantization["kept"]
    stored = sum(t.nbytes for t in model.state_dict().values())
    assert describe(model.config)["weights_bytes"][mode] == stored


# ── the greedy head: int8-rounded scores with bounds, then the few possible winners exactly ────


def _activations(rows: int, k: int, seed: int) -> torch.Tensor:
    """Hidden-state-like rows: mostly small values, a few large ones (Gemma's residual stream has
    outliers hundreds of times the typical size, the hard case for per-block rounding)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=gen)
    x[:, torch.randint(0, k, (3,), generator=gen)] *= 300
    return x


def _rounding_error(x: torch.Tensor) -> torch.Tensor:
    """x - d * xq for the kernel's rounding: per 32 values, d = max|x| / 127, xq = round(x / d)."""
    blocks = x.view(-1, 32)
    d = blocks.abs().amax(-1, keepdim=True) / 127
    return (blocks - d * torch.round(blocks / d).clamp(-127, 127)).view_as(x)


BOUNDED = [
    (8, 32, False, torch.float16),
    (8, 32, False, torch.float32),
    (8, 192, False, torch.float32),
    (8, 64, True, torch.float32),
    (4, 32, True, torch.float32),
    (4, 32, True, torch.float16),
    (4, 96, True, torch.float32),
]


@pytest.mark.parametrize(("bits", "group", "mins", "scale_dtype"), BOUNDED)
def test_greedy_head_bounds_hold_and_are_reached(bits, group, mins, scale_dtype):
    """|qlinear(x) - approx| <= bound for every row, -128 weights included; 8-bit rows that point
    along the activations' rounding error use over 90% of the bound, so a bound too small by a
    tenth (a wrong derivation) fails."""
    if not ensure_kernels():
        pytest.skip(kernels.kernel_status())
    n, k = 300, 192
    q = random_ints(n, k, bits, seed=3)
    x = _activations(2, k, seed=bits + group)
    # The last rows follow each activation row's rounding error (its sign pattern, at full scale).
    err = _rounding_error(x)
    if bits == 8:
        q[-2:] = torch.round(err / err.abs().amax(-1, keepdim=True) * 127).to(torch.int8)
    else:
        q[-2:] = torch.round((err / err.abs().amax(-1, keepdim=True) + 1) * 7.5).to(torch.uint8)
    gen = torch.Generator().manual_seed(7)
    scales = (torch.rand(n, k // group, generator=gen) * 0.02 + 0.001).to(scale_dtype)
    scales[-2:] = 0.01  # one scale: the aligned rows' weights stay parallel to the error
    offsets = (torch.randn(n, k // group, generator=gen) * 0.05).to(scale_dtype) if mins else None
    packed = kernels.pack(q, bits)
    norms = torch.ops.torchgemma.row_norms(packed, scales, bits, group)
    expected = kernels.unpack(packed, bits).double().view(n, -1, group) * scales.double()[..., None]
    assert torch.all(norms.double() >= expected.view(n, k).norm(dim=-1))
    assert torch.allclose(norms.double(), expected.view(n, k).norm(dim=-1), rtol=1e-5)
    approx, bound = torch.ops.torchgemma.qlinear_bounds(x, packed, scales, offsets, bits, group, norms)
    exact = torch.ops.torchgemma.qlinear(x, packed, scales, offsets, bits, group)
    distance = (exact - approx).abs()
    assert torch.all(distance <= bound)
    if bits == 8:  # (4-bit rows are unsigned: their norm counts the offset too, the bound is looser)
        for m, row in enumerate((n - 2, n - 1)):
            assert distance[m, row] >= 0.9 * bound[m, row], (distance[m, row], bound[m, row])
    assert distance.max() > 0  # the scores are approximations, not the exact values


@pytest.mark.parametrize(("bits", "mins"), [(8, False), (4, True)])
def test_greedy_head_bounds_of_a_row_do_not_depend_on_the_rows_beside_it(bits, mins):
    """qlinear_bounds reads each weight row once for every activation row: each row's approx and
    bound equal, to the bit, that row's alone, a non-finite row among them included."""
    if not ensure_kernels():
        pytest.skip(kernels.kernel_status())
    n, k, group = 301, 192, 32
    q = kernels.pack(random_ints(n, k, bits, seed=9), bits)
    gen = torch.Generator().manual_seed(4)
    scales = (torch.rand(n, k // group, generator=gen) * 0.02 + 0.001).to(torch.float16)
    offsets = (torch.randn(n, k // group, generator=gen) * 0.05).to(torch.float16) if mins else None
    norms = torch.ops.torchgemma.row_norms(q, scales, bits, group)
    x = _activations(9, k, seed=3)
    x[4, 10] = float("nan")

    def bounds(rows):
        return torch.ops.torchgemma.qlinear_bounds(rows, q, scales, offsets, bits, group, norms)

    alone = [torch.cat(parts) for parts in zip(*(bounds(x[i : i + 1]) for i in range(9)))]
    for rows in (2, 3, 4, 5, 9):
        together = bounds(x[:rows])
        for part, whole in zip(together, alone):
            assert torch.equal(part, whole[:rows]), rows
    assert torch.isinf(alone[1][4]).all()  # the NaN row: every weight row in doubt


def _head(bits: int, n: int = 4000, k: int = 256, seed: int = 0) -> QuantizedLinear:
    fmt = Format(bits=bits, group_size=32, has_mins=bits == 4, scale_dtype="float16")
    layer = QuantizedLinear(k, n, fmt)
    gen = torch.Generator().manual_seed(seed)
    layer.set_weight(torch.randn(n, k, generator=gen) * 0.05)
    return layer


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("rows", [1, 3])
def test_greedy_head_argmax_equals_the_full_heads(bits, rows):
    """The token equals argmax of the full product, through a bf16 cast and a soft-cap too, and
    where several rows tie exactly the first wins, as in torch.argmax."""
    if not ensure_kernels():
        pytest.skip(kernels.kernel_status())
    layer = _head(bits)
    for seed in range(6):
        x = _activations(rows, 256, seed=seed)
        assert layer._bounded(x)  # the bounded path runs, not the fallback
        full = layer.matmul(x)
        assert torch.equal(layer.argmax(x), full.argmax(-1))

        def capped(v):
            return (torch.tanh(v.to(torch.bfloat16) / 30.0) * 30.0).float()

        assert torch.equal(layer.argmax(x, capped), capped(full).argmax(-1))
    # Exact ties: rows 10, 20 and 30 made copies of the winner for x (their norms are recomputed:
    # the buffers changed in place).
    x = _activations(1, 256, seed=11)
    winner = int(layer.matmul(x).argmax(-1))
    for name in ("qweight", "scales", "mins"):
        buffer = getattr(layer, name)
        if buffer is not None:
            buffer[[10, 20, 30]] = buffer[winner].clone()
    assert layer.matmul(x)[0, [10, 20, 30, winner]].unique().numel() == 1
    assert layer.argmax(x).tolist() == [10] == layer.matmul(x).argmax(-1).tolist()


def test_greedy_head_keeps_its_scores_tensors_between_calls():
    """Successive argmax calls of one shape score into the same two tensors (a decode loop allocates
    no 2 x 1 MB per step for a 262144-row head), and still give the full head's tokens; a call while
    they are taken (another thread's) makes its own. Tensors of the wrong size are refused by name."""
    if not ensure_kernels():
        pytest.skip(kernels.kernel_status())
    layer = _head(8)
    x = _activations(1, 256, seed=3)
    assert torch.equal(layer.argmax(x), layer.matmul(x).argmax(-1))
    kept = layer.__dict__["_bounds_out"]
    pointers = [t.data_ptr() for t in kept]
    for seed in range(4, 8):
        x = _activations(1, 256, seed=seed)
        assert torch.equal(layer.argmax(x), layer.matmul(x).argmax(-1))
        assert [t.data_ptr() for t in layer.__dict__["_bounds_out"]] == pointers
    taken = layer._bounds(x)  # in use: the next call may not write into them
    assert "_bounds_out" not in layer.__dict__
    other = layer._bounds(_activations(1, 256, seed=9))
    assert all(a.data_ptr() != b.data_ptr() for a, b in zip(taken, other))
    f = layer.format
    args = (x, layer.qweight, layer.scales, layer.mins, f.bits, f.group_size, layer._norms())
    for into in (torch.ops.torchgemma.qlinear_bounds_into, kernels.ops._qlinear_bounds_into_reference):
        with pytest.raises((RuntimeError, ValueError), match="approx and bound must be contiguous float32"):
            into(*args, torch.empty(1, layer.qweight.shape[0] - 1), torch.empty(1, layer.qweight.shape[0]))


@pytest.mark.parametrize("rows", [INT_BOUNDED_ROWS, 16])
def test_greedy_head_int8_scores_give_the_full_heads_tokens(rows, monkeypatch):
    """Calls of INT_BOUNDED_ROWS or more rows score with qlinear_int's int8 products (on machines
    without VNNI its portable loop, the same bits, is forced here): every exact score lies within the
    row's bound of its approximation, and the token equals argmax of the full product, through a
    soft-cap, on exact ties, and for a non-finite row."""
    from torchgemma.quantization import modules

    if not ensure_kernels():
        pytest.skip(kernels.kernel_status())
    monkeypatch.setattr(modules, "vnni_available", lambda: True)
    layer = _head(8)
    for seed in range(4):
        x = _activations(rows, 256, seed=seed)
        assert layer._int_bounded(x) and layer._bounded(x)
        full = layer.matmul(x)
        approx, bound = layer._bounds(x)
        assert bound.shape == (rows, 1)
        assert ((full - approx).abs() <= bound).all()
        assert torch.equal(layer.argmax(x), full.argmax(-1))
        assert torch.equal(layer.argmax(x, torch.tanh), torch.tanh(full).argmax(-1))
    # Exact ties: weight rows 10, 20, 30 copies of row 0's winner: the first of them wins.
    x = _activations(rows, 256, seed=11)
    winner = int(layer.matmul(x[:1]).argmax(-1))
    layer.qweight[[10, 20, 30]] = layer.qweight[winner].clone()
    layer.scales[[10, 20, 30]] = layer.scales[winner].clone()
    assert layer.argmax(x)[0] == 10
    assert torch.equal(layer.argmax(x), layer.matmul(x).argmax(-1))
    x[2, 5] = float("nan")
    assert torch.equal(layer.argmax(x), layer.matmul(x).argmax(-1))
    # A head with offsets (4-bit with mins) keeps the full product.
    assert not _head(4)._int_bounded(x)


def test_greedy_head_falls_back_where_it_cannot_bound():
    """A non-finite input leaves every row in doubt (the full product decides, NaN as argmax takes
    it); more than BOUNDED_ROWS rows take the full product (the row kernel's, from DENSE_ROWS on the
    BLAS's)."""
    layer = _head(8)
    x = _activations(2, 256, seed=1)
    x[0, 5] = float("nan")
    x[1, 7] = float("inf")
    approx, bound = torch.ops.torchgemma.qlinear_bounds(
        x, layer.qweight, layer.scales, None, 8, 32, layer._norms()
    )
    assert torch.isinf(bound).all()
    assert torch.equal(layer.argmax(x), layer.matmul(x).argmax(-1))
    assert torch.equal(layer.argmax(x, torch.tanh), torch.tanh(layer.matmul(x)).argmax(-1))
    for rows in (BOUNDED_ROWS + 1, DENSE_ROWS):  # the row kernel's full product, then the BLAS's
        many = _activations(rows, 256, seed=2)
        assert not layer._bounded(many)
        assert torch.equal(layer.argmax(many), layer.matmul(many).argmax(-1))


@pytest.mark.parametrize(("style", "mode"), [("e2b", "int8"), ("31b", "int4"), ("26b", "int8")])
def test_engine_greedy_head_gives_the_full_heads_tokens(gen_checkpoints, style, mode, monkeypatch):
    """Greedy requests through a quantized (soft-capped, Gemma 4) head: the same tokens with the
    greedy head as with full logits, and the bounded path is what ran."""
    from torchgemma.generation import Engine, SamplingParams

    if not ensure_kernels():
        pytest.skip(kernels.kernel_status())
    model = torchgemma.load(gen_checkpoints[style], quantize=mode)
    assert model.config.text.final_logit_softcapping is not None
    calls = []
    bounds = torch.ops.torchgemma.qlinear_bounds_into

    def counting(*args):
        calls.append(1)
        return bounds(*args)

    monkeypatch.setattr(torch.ops.torchgemma, "qlinear_bounds_into", counting)
    prompts = {"a": [5, 17, 42, 9], "b": [100, 3, 77], "c": [8, 8, 250, 31, 2, 64]}
    runs = {}
    for greedy_head in (True, False):
        engine = Engine(model, max_batch_size=3, max_len=40, greedy_head=greedy_head)
        for name, ids in prompts.items():
            engine.add_request(
                name, ids, max_new_tokens=12, sampling=SamplingParams(temperature=0.0), stop_token_ids=[]
            )
        out = {name: [] for name in prompts}
        while engine.has_unfinished_requests():
            for output in engine.step():
                out[output.request_id].append(output.token_id)
        runs[greedy_head] = out
        if greedy_head:
            assert calls  # the bounded scores were used
            calls.clear()
        else:
            assert not calls
    assert runs[True] == runs[False]


@pytest.mark.parametrize(
    ("heads", "kv_heads", "keys", "dim"), [(4, 1, 190, 256), (8, 2, 37, 64), (2, 2, 1, 24)]
)
def test_decode_attention_is_the_softmax_to_rounding(heads, kv_heads, keys, dim):
    """One query per head over every key (grouped KV heads, keys and values read through strided
    views as the cache hands them out): the float64 softmax's result to float32 rounding, as
    close as sdpa's own float32 result."""
    import torch.nn.functional as F

    if not ensure_kernels():
        pytest.skip(kernels.kernel_status())
    gen = torch.Generator().manual_seed(heads * keys)
    q = torch.randn(2, 1, heads, dim, generator=gen).transpose(1, 2)  # (B, H, 1, D), a view
    ring = torch.randn(2, kv_heads, keys + 7, dim, generator=gen) * 3
    k, v = ring[:, :, 3 : 3 + keys], ring.flip(2)[:, :, 2 : 2 + keys]  # strided, as cache slices
    exact = F.scaled_dot_product_attention(
        q.double(), k.double(), v.double(), scale=0.0625, enable_gqa=heads != kv_heads
    ).transpose(1, 2)
    ours = torch.ops.torchgemma.decode_attention(q, k, v, 0.0625)
    sdpa = F.scaled_dot_product_attention(q, k, v, scale=0.0625, enable_gqa=heads != kv_heads).transpose(1, 2)
    assert ours.shape == (2, 1, heads, dim) and ours.dtype == torch.float32
    tolerance = max(2e-6, 2 * (sdpa.double() - exact).abs().max().item())
    assert (ours.double() - exact).abs().max() <= tolerance


def test_quantized_models_fuse_their_decoder_norms_and_rope(text_checkpoints):
    """quantize() and a quantized load both fuse the text decoder's norms and rotations; a float
    model does not."""
    from torchgemma.acceleration.cpu_fusions import FUSED_ATTENTION, FusedRMSNorm, fused_rope
    from torchgemma.model.attention import ATTENTION
    from torchgemma.model.layers import RMSNorm, apply_rope
    from torchgemma.model.text import Attention

    if not ensure_kernels():
        pytest.skip(kernels.kernel_status())
    folder = text_checkpoints["e2b"]
    plain = torchgemma.load(folder)
    for model in (quantize(torchgemma.load(folder), "int8"), torchgemma.load(folder, quantize="int4")):
        norms = [type(m) for m in model.language_model.modules() if isinstance(m, RMSNorm)]
        assert norms and set(norms) == {FusedRMSNorm}
        ropes = [m.rope for m in model.language_model.modules() if isinstance(m, Attention)]
        assert ropes and set(ropes) == {fused_rope}
        backends = [m.backends for m in model.language_model.modules() if isinstance(m, Attention)]
        assert all(b is FUSED_ATTENTION for b in backends)
    assert FusedRMSNorm not in {type(m) for m in plain.modules()}
    assert {m.rope for m in plain.modules() if isinstance(m, Attention)} == {apply_rope}
    assert all(m.backends is ATTENTION for m in plain.modules() if isinstance(m, Attention))
