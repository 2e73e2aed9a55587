"""The operator table and the C++ kernels' instruction sets.

Every operator in ``kernels.OPERATORS`` passes ``torch.library.opcheck`` on its C++ kernel and on its
pure-PyTorch reference; each reference gives what its C++ kernel gives, under every instruction set
this CPU runs (to the bit where both do the same float operations in the same order; to float32
rounding where the C++ sums in an order of its own, each case saying so); the AVX-512 set gives the
AVX2 set's bits; the set is chosen in-process (``kernels.using_isa``) or by ``$TORCHGEMMA_ISA``.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from torchgemma import kernels
from torchgemma.kernels import ensure_kernels
from torchgemma.kernels import ops as kernel_ops

pytestmark = pytest.mark.usefixtures("one_thread")

OPS = {op.name: op for op in kernels.OPERATORS}


def _ints(rows: int, cols: int, bits: int, gen: torch.Generator) -> torch.Tensor:
    if bits == 8:
        return torch.randint(-128, 128, (rows, cols), generator=gen, dtype=torch.int8)
    return torch.randint(0, 1 << bits, (rows, cols), generator=gen, dtype=torch.uint8)


def _weight(bits, group, mins, scale_dtype, n=40, k=128, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = kernels.pack(_ints(n, k, bits, gen), bits)
    scales = (torch.rand(n, k // group, generator=gen) * 0.02 + 0.001).to(scale_dtype)
    offsets = (torch.randn(n, k // group, generator=gen) * 0.05).to(scale_dtype) if mins else None
    return q, scales, offsets


WEIGHTS = [  # (bits, group, mins, scale dtype)
    (8, 32, False, torch.float16),
    (8, 64, True, torch.float32),
    (4, 32, True, torch.float32),
    (5, 32, True, torch.float16),
]


def samples(name: str) -> list[tuple]:
    """Arguments for one operator: the layouts and shapes its callers use."""
    gen = torch.Generator().manual_seed(1)
    out = []
    if name in ("qlinear", "qlinear_dense", "qlinear_int", "dequantize"):
        for bits, group, mins, dtype in WEIGHTS:
            weight = _weight(bits, group, mins, dtype)
            rest = (bits, group) + ((16,) if name == "qlinear_int" else ())
            x = torch.randn(2, 3, 128, generator=gen)
            out.append(weight + rest if name == "dequantize" else (x, *weight, *rest))
    elif name in ("qlinear_bounds", "row_norms"):
        for bits, group, mins, dtype in [(8, 32, False, torch.float16), (4, 32, True, torch.float32)]:
            q, scales, offsets = _weight(bits, group, mins, dtype)
            norms = OPS["row_norms"].reference(q, scales, bits, group)
            x = torch.randn(3, 128, generator=gen)
            if name == "row_norms":
                out.append((q, scales, bits, group))
            else:
                out.append((x, q, scales, offsets, bits, group, norms))
    elif name == "qlinear_bounds_into":
        for args in samples("qlinear_bounds"):
            shape = (args[0].shape[0], args[1].shape[0])
            out.append((*args, torch.empty(shape), torch.empty(shape)))
    elif name == "bounded_candidates":
        approx = torch.randn(3, 50, generator=gen)
        out.append((approx, torch.rand(3, 50, generator=gen) * 0.5))
        out.append((approx, torch.full((3, 50), float("inf"))))  # a row in doubt: every index
        out.append((approx, torch.rand(3, 1, generator=gen) * 0.5))  # one bound per row (int8_bounds)
    elif name == "rms_norm":
        x = torch.randn(2, 3, 100, generator=gen) * 3  # 100: not a multiple of 8 (the C++'s sums)
        weight = torch.randn(100, generator=gen) * 0.3
        out += [(x, weight, 1e-6, True), (x, weight, 1e-6, False), (x.transpose(0, 1), None, 1e-6, False)]
    elif name == "rope":
        x = torch.randn(2, 4, 5, 64, generator=gen).transpose(1, 2)  # (B, T, H, D), not contiguous
        angles = torch.rand(2, 5, 32, generator=gen) * 100
        cos, sin = angles.cos().repeat(1, 1, 2), angles.sin().repeat(1, 1, 2)
        out.append((x, cos, sin))
    elif name == "gelu_mul":
        gate = torch.randn(3, 2, 133, generator=gen) * 4  # 798 values: every set's vector loop and its tail
        # e^(-2u) past both ends, zeros of both signs (non-finite values: their own test, as opcheck's
        # comparisons take no NaN)
        gate[0, 0, :8] = torch.tensor([100.0, -9.5, 1e-30, -200.0, 0.0, -0.0, -60.0, 3e4])
        up = torch.randn(3, 2, 133, generator=gen)
        out += [(gate, up), (gate.transpose(0, 2), up.transpose(0, 2))]  # and views, not contiguous
    elif name == "decode_attention":
        for heads, kv_heads, keys, dim in [(4, 1, 37, 64), (8, 2, 20, 32), (2, 2, 1, 24)]:
            q = torch.randn(2, 1, heads, dim, generator=gen).transpose(1, 2)  # (B, H, 1, D), a view
            ring = torch.randn(2, kv_heads, keys + 5, dim, generator=gen) * 3
            out.append((q, ring[:, :, 2 : 2 + keys], ring.flip(2)[:, :, 1 : 1 + keys], 0.125))
        # The keys each row sees (a batch of rows with their own ranges), and a context long enough to
        # be split into pieces of 1024 keys.
        q = torch.randn(3, 4, 1, 64, generator=gen)
        k, v = torch.randn(2, 3, 2, 2500, 64, generator=gen).unbind(0)
        visible = torch.rand(3, 2500, generator=gen) < 0.8
        visible[1, :] = False
        visible[1, 7] = True  # one key alone
        out += [(q, k, v, 0.125, visible), (q, k, v, 0.125)]
    elif name == "decode_attention_ring":
        # Rings of 3 sequences read by 2 rows from their own offsets (one wrapping), of 40 columns.
        q = torch.randn(2, 4, 1, 32, generator=gen)
        k, v = torch.randn(2, 3, 2, 40, 32, generator=gen).unbind(0)
        visible = torch.rand(2, 33, generator=gen) < 0.8
        visible[:, -1] = True
        out.append((q, k, v, 0.125, visible, torch.tensor([2, 0]), torch.tensor([30, 4])))
    elif name in ("decode_layer_qkv", "decode_layer_output"):
        out += _layer_samples(name, gen)
    return out


def _layer_product(bits, group, mins, dtype, n, k, seed) -> tuple[list, list]:
    return list(_weight(bits, group, mins, dtype, n=n, k=k, seed=seed)), [bits, group]


def _layer_samples(name: str, gen: torch.Generator) -> list[tuple]:
    """decode_layer_*'s arguments: 2 rows of one token, hidden 128, 4 query heads and 2 KV heads of 32
    values, products of mixed formats (float16 and float32 scales, with and without mins)."""
    x = torch.randn(2, 1, 128, generator=gen)
    norm = torch.randn(128, generator=gen) * 0.3
    head_norm = torch.randn(32, generator=gen) * 0.3
    if name == "decode_layer_output":
        formats = [(8, 32, False, torch.float16, 128, 128), (4, 32, True, torch.float32, 256, 128)]
        formats += [(8, 16, False, torch.float32, 256, 128), (8, 32, False, torch.float16, 128, 256)]
        products, shapes = [], []
        for i, case in enumerate(formats):
            tensors, fmt = _layer_product(*case, seed=10 + i)
            products += tensors
            shapes += fmt
        attended = torch.randn(2, 1, 4, 32, generator=gen)
        norms = [norm, torch.randn(128, generator=gen) * 0.3, norm.flip(0)]
        return [(x, attended, products, shapes, norms, [1e-6, 1e-5, 1e-6], [1, 0, 1])]
    angles = torch.rand(2, 1, 16, generator=gen) * 100
    cos, sin = angles.cos().repeat(1, 1, 2), angles.sin().repeat(1, 1, 2)
    q, qf = _layer_product(8, 32, False, torch.float16, 128, 128, seed=20)
    k, kf = _layer_product(4, 32, True, torch.float32, 64, 128, seed=21)
    v, vf = _layer_product(8, 16, False, torch.float32, 64, 128, seed=22)
    norms = [norm, head_norm, head_norm.flip(0)]
    return [
        # q, k and v with a norm each but v's (Gemma 3)
        (x, cos, sin, q + k + v, qf + kf + vf, norms, [1e-6] * 3, [1, 1, 1], 32),
        # values that are the keys' projection, then a value norm without a weight (Gemma 4's K=V layers)
        (x, cos, sin, q + k + [None] * 3, qf + kf + [0, 0], norms + [None], [1e-6] * 4, [0, 0, 0, 0], 32),
    ]


def test_the_table_holds_every_operator():
    """One table: every torchgemma operator has its schema, fake and reference there (and nothing
    else defines one)."""
    assert set(OPS) == {
        "qlinear", "dequantize", "qlinear_dense", "qlinear_int", "qlinear_bounds", "qlinear_bounds_into", "row_norms",
        "bounded_candidates", "rms_norm", "rope", "gelu_mul", "decode_attention", "decode_attention_ring",
        "decode_layer_qkv", "decode_layer_output",
    }  # fmt: skip
    for name, op in OPS.items():
        assert callable(op.fake) and callable(op.reference)
        assert str(getattr(torch.ops.torchgemma, name).default._schema).startswith(f"torchgemma::{name}(")
        assert samples(name)


@pytest.mark.parametrize("name", list(OPS))
def test_every_operator_passes_opcheck(name):
    """Schema, fake (meta) kernel and the C++ kernel agree (where they are loaded), so torch.compile
    traces every operator."""
    ensure_kernels()
    for args in samples(name):
        torch.library.opcheck(getattr(torch.ops.torchgemma, name).default, args)


def test_every_reference_passes_opcheck():
    """The same with no C++ loaded (``TORCHGEMMA_ISA=reference``): the references are the kernels."""
    script = textwrap.dedent(
        """
        import sys, torch
        sys.path.insert(0, sys.argv[1])
        from test_kernels import OPS, samples
        from torchgemma import kernels
        assert not kernels.ensure_kernels() and "reference" in kernels.kernel_status()
        for name in OPS:
            for args in samples(name):
                torch.library.opcheck(getattr(torch.ops.torchgemma, name).default, args)
        print("references ok")
        """
    )
    env = {**os.environ, "TORCHGEMMA_ISA": "reference"}
    done = subprocess.run(
        [sys.executable, "-c", script, str(Path(__file__).parent)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    assert "references ok" in done.stdout


@pytest.fixture(params=kernels.ISAS)
def isa(request):
    """Each instruction set this CPU runs, chosen in-process for the test."""
    if not ensure_kernels():
        pytest.skip(kernels.kernel_status())
    if request.param not in kernels.available_isas():
        pytest.skip(f"this CPU has no {request.param}")
    with kernels.using_isa(request.param):
        yield request.param


def _close(ours: torch.Tensor, reference: torch.Tensor, size: torch.Tensor, rel: float) -> bool:
    """|ours - reference| within rel times size (the sum of the terms' magnitudes) per value."""
    return bool(((ours.double() - reference.double()).abs() <= rel * size.double() + 1e-30).all())


@pytest.mark.parametrize("name", list(OPS))
def test_each_reference_computes_what_its_kernel_computes(isa, name):
    op = OPS[name]
    cpp = getattr(torch.ops.torchgemma, name)
    for args in samples(name):
        if name == "qlinear_bounds_into":
            # qlinear_bounds' values (the kernel's bits; the reference's), written where it is told.
            *inputs, approx, bound = args
            cpp(*inputs, approx, bound)
            for given, value in zip((approx, bound), torch.ops.torchgemma.qlinear_bounds(*inputs)):
                assert torch.equal(given, value)
            op.reference(*inputs, approx, bound)
            for given, value in zip((approx, bound), OPS["qlinear_bounds"].reference(*inputs)):
                assert torch.equal(given, value)
            continue
        ours, reference = cpp(*args), op.reference(*args)
        if name in ("dequantize", "row_norms", "bounded_candidates", "rms_norm", "rope", "gelu_mul"):
            # The same float operations in the same order (row_norms' and rms_norm's float64 sums in
            # the C++'s order): the same bits.
            for a, b in zip(ours, reference) if isinstance(ours, tuple) else [(ours, reference)]:
                assert torch.equal(a, b), name
        elif name in ("qlinear", "qlinear_dense", "qlinear_int"):
            # Float32 dot products summed in the kernel's order (chains of 8, groups, spans) against
            # the BLAS's or float64: float32 rounding of the sum of |terms|.
            x, q, scales, offsets, bits, group = args[:6]
            weight = kernels._dequantize_reference(q, scales, offsets, bits, group).double()
            size = x.double().abs() @ weight.abs().T
            assert _close(ours, reference, size, 2e-6), (name, bits, group)
        elif name == "qlinear_bounds":
            # approx: the kernel's float32 sums against float64, within the bound (which allows for
            # them); the bound's terms are the same float32 operations on that approx.
            (approx, bound), (ref_approx, ref_bound) = ours, reference
            assert ((approx - ref_approx).abs() <= bound).all()
            assert torch.allclose(bound, ref_bound, rtol=1e-6, atol=0)
        elif name in ("decode_attention", "decode_attention_ring"):
            # A polynomial exp and the kernel's own sum orders: both within float32 rounding of the
            # float64 softmax.
            q, k, v, scale, *visible = args
            if name == "decode_attention_ring":  # the rows' keys gathered from the rings
                visible, slots, offsets = visible
                columns = (offsets[:, None] + torch.arange(visible.shape[1])) % k.shape[2]
                k, v = (t[slots[:, None], :, columns].transpose(1, 2) for t in (k, v))
                visible = [visible]
            mask = visible[0][:, None, None, :] if visible else None
            exact = F.scaled_dot_product_attention(
                q.double(), k.double(), v.double(), attn_mask=mask, scale=scale, enable_gqa=True
            ).transpose(1, 2)
            assert (ours.double() - exact).abs().max() <= 2e-6 * exact.abs().max()
            assert (reference.double() - exact).abs().max() <= 2e-6 * exact.abs().max()
        elif name in ("decode_layer_qkv", "decode_layer_output"):
            # The kernels above, called one by one in the reference's order: their bits. The
            # reference (its products through the BLAS) within float32 rounding of them.
            separately = _layer_by_operators(name, args)
            triples = (
                zip(ours, separately, reference)
                if isinstance(ours, tuple)
                else [(ours, separately, reference)]
            )
            for a, b, c in triples:
                assert torch.equal(a, b), name
                assert a.shape == c.shape and a.stride() == c.stride()
                assert torch.allclose(a, c, rtol=1e-4, atol=1e-4 * c.abs().max().item()), name


def test_gelu_mul_is_the_function_to_a_few_roundings(isa):
    """gelu_mul against the function in float64, g / (1 + e^(-2u)) (the tanh form's value without
    its cancellation where 1 + tanh(u) is small): within (8 + 8 |u|) float32 ulps wherever the result
    is above 2^-120 (u's own float32 rounding moves e^(-2u) by |2u| ulps), at most 2^-119 where it is
    below; ATen's tanh form misses that bound on a fifth of these gates. Non-finite gates give what ATen's
    GELU gives (inf: inf, -inf and NaN: NaN), and every value is the reference's."""
    gen = torch.Generator().manual_seed(7)
    gate = torch.cat((torch.linspace(-30, 30, 600_001), torch.randn(100_000, generator=gen) * 5))
    ours = torch.ops.torchgemma.gelu_mul(gate, torch.ones_like(gate)).double()
    g = gate.double()
    u = (2 / torch.pi) ** 0.5 * (g + 0.044715 * g**3)
    exact = g / (1 + torch.exp(-2 * u))
    normal = exact.abs() >= 2.0**-120
    error = (ours - exact).abs()
    assert (error[normal] <= ((8 + 8 * u.abs()) * 2.0**-24 * exact.abs())[normal]).all()
    assert (ours[~normal].abs() <= 2.0**-119).all() and (~normal).any() and normal.sum() > 450_000
    aten = F.gelu(gate, approximate="tanh").double()
    missed = ((aten - exact).abs() > (8 + 8 * u.abs()) * 2.0**-24 * exact.abs()) & normal
    assert missed.sum() > 0.1 * normal.sum()  # (the bound is not a loose one)

    odd = torch.tensor([float("inf"), -float("inf"), float("nan"), 2.0])
    up = torch.tensor([2.0, 1.0, 1.0, float("nan")])
    result = torch.ops.torchgemma.gelu_mul(odd, up)
    assert result[0] == float("inf") and result[1:].isnan().all()
    assert F.gelu(odd[:3], approximate="tanh")[1:].isnan().all()  # ATen's: the same
    reference = kernel_ops._gelu_mul_reference(odd, up)
    assert reference[0] == float("inf") and reference[1:].isnan().all()
    assert torch.equal(
        torch.ops.torchgemma.gelu_mul(gate, gate.flip(0)), kernel_ops._gelu_mul_reference(gate, gate.flip(0))
    )


def _layer_by_operators(name: str, args: tuple):
    """decode_layer_*'s reference with the references of its kernels swapped for the C++ kernels."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(kernel_ops, "_qlinear_reference", torch.ops.torchgemma.qlinear)
        patch.setattr(kernel_ops, "_rms_norm_reference", torch.ops.torchgemma.rms_norm)
        patch.setattr(kernel_ops, "_rope_reference", torch.ops.torchgemma.rope)
        patch.setattr(kernel_ops, "_gelu_mul_reference", torch.ops.torchgemma.gelu_mul)
        return OPS[name].reference(*args)


_PRODUCT_CASES = [(8, 32, False), (8, 16, False), (8, 64, True), (4, 32, True), (5, 32, True)]


def _products() -> dict[str, torch.Tensor]:
    """Every product path's results on one input set: row kernels of 1-5 rows, integer activations
    (VNNI where the CPU has it, else the portable loop), and the other operators."""
    gen = torch.Generator().manual_seed(5)
    out = {}
    for bits, group, mins in _PRODUCT_CASES:
        for scale_dtype in (torch.float32, torch.float16):
            width = kernels.packed_width(320, bits)
            if bits == 8:
                q = torch.randint(-128, 128, (37, width), generator=gen, dtype=torch.int8)
            else:
                q = torch.randint(0, 256, (37, width), generator=gen, dtype=torch.uint8)
            scales = (torch.rand(37, 320 // group, generator=gen) * 0.02).to(scale_dtype)
            offsets = (torch.randn(37, 320 // group, generator=gen) * 0.05).to(scale_dtype) if mins else None
            args = (q, scales, offsets, bits, group)
            for rows in (1, 2, 3, 4, 5):
                x = torch.randn(rows, 320, generator=gen)
                out[f"{bits}/{group}/{scale_dtype}/{rows}"] = torch.ops.torchgemma.qlinear(x, *args)
            for rows in (1, 6, 17):
                x = torch.randn(rows, 320, generator=gen)
                for x_bits in (8, 16):
                    key = f"int{x_bits}/{bits}/{group}/{scale_dtype}/{rows}"
                    out[key] = torch.ops.torchgemma.qlinear_int(x, *args, x_bits)
            out[f"dequantize/{bits}/{group}/{scale_dtype}"] = torch.ops.torchgemma.dequantize(*args)
    for name in (
        "qlinear_bounds", "row_norms", "bounded_candidates", "rms_norm", "rope", "gelu_mul", "decode_attention",
        "decode_attention_ring", "decode_layer_qkv", "decode_layer_output",
    ):  # fmt: skip
        for i, call in enumerate(samples(name)):
            result = getattr(torch.ops.torchgemma, name)(*call)
            for j, tensor in enumerate(result if isinstance(result, tuple) else [result]):
                out[f"{name}/{i}/{j}"] = tensor
    return out


def test_avx512_gives_the_avx2_bits():
    """The AVX-512 set's results are the AVX2 set's to the bit (its 512-bit lanes hold the AVX2
    code's two chains), integer-activation products (VNNI where the CPU has it) included."""
    if not ensure_kernels():
        pytest.skip(kernels.kernel_status())
    if "avx512" not in kernels.available_isas():
        pytest.skip("this CPU has no AVX-512: the AVX2 set is the widest it runs")
    runs = {}
    for name in ("avx512", "avx2"):
        with kernels.using_isa(name):
            runs[name] = _products()
    assert runs["avx512"].keys() == runs["avx2"].keys()
    for case, values in runs["avx512"].items():
        assert torch.equal(values, runs["avx2"][case]), case


_IN_A_PROCESS = textwrap.dedent(
    """
    import sys, torch
    from safetensors.torch import save_file
    sys.path.insert(0, sys.argv[1])
    from test_kernels import _products
    from torchgemma import kernels
    print(kernels.kernel_status())
    save_file(_products(), sys.argv[2])
    """
)


def _run_with(isa: str, tmp_path: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "TORCHGEMMA_ISA": isa}
    script = [sys.executable, "-c", _IN_A_PROCESS, str(Path(__file__).parent), str(tmp_path / f"{isa}.st")]
    return subprocess.run(script, env=env, capture_output=True, text=True, timeout=300)


def test_the_environment_chooses_the_instruction_set(tmp_path):
    """``TORCHGEMMA_ISA=portable`` in a fresh process runs the portable set: the bits of the same set
    chosen in-process."""
    from safetensors.torch import load_file

    if not ensure_kernels():
        pytest.skip(kernels.kernel_status())
    done = _run_with("portable", tmp_path)
    assert done.returncode == 0, done.stderr
    assert "C++ CPU kernels loaded (portable)" in done.stdout
    theirs = load_file(tmp_path / "portable.st")
    with kernels.using_isa("portable"):
        ours = _products()
    assert ours.keys() == theirs.keys()
    for case, values in ours.items():
        assert torch.equal(values, theirs[case]), case


def test_an_instruction_set_the_cpu_lacks_is_a_clear_error(tmp_path):
    if not ensure_kernels():
        pytest.skip(kernels.kernel_status())
    with pytest.raises(ValueError, match="no instruction set 'sse9'"):
        kernels.set_isa("sse9")
    lacking = [name for name in kernels.ISAS if name not in kernels.available_isas()]
    if not lacking:
        pytest.skip("this CPU runs every instruction set")
    with pytest.raises(RuntimeError, match=f"this CPU has no {lacking[-1]}"):
        kernels.set_isa(lacking[-1])
    assert kernels.isa() == kernels.available_isas()[-1]  # the choice stands
    done = _run_with(lacking[-1], tmp_path)
    assert done.returncode != 0
    assert f"TORCHGEMMA_ISA: this CPU has no {lacking[-1]} (it runs" in done.stderr


def test_the_widest_set_the_cpu_runs_is_the_default():
    if not ensure_kernels():
        pytest.skip(kernels.kernel_status())
    assert os.environ.get("TORCHGEMMA_ISA") or kernels.isa() == kernels.available_isas()[-1]
    assert kernels.available_isas()[0] == "portable"
    assert f"({kernels.isa()})" in kernels.kernel_status()
