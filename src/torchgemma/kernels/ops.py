"""The quantized matrix product as torch operators, and the C++ kernels behind them on the CPU.

Two operators, defined here with ``torch.library`` so that ``torch.compile`` sees one opaque node
per quantized layer (their shapes come from the fake kernels below):

    torch.ops.torchgemma.qlinear(x, qweight, scales, mins, bits, group_size)   # x @ W.T, float32
    torch.ops.torchgemma.dequantize(qweight, scales, mins, bits, group_size)   # W, float32 (N, K)

with ``W[n, k] = scales[n, k // G] * q[n, k] + mins[n, k // G]`` (layout: ``csrc/qlinear.cpp``);
scales and mins are float32 or float16 (both the same), the values they hold always taken as float32.

Every device gets a pure-PyTorch kernel (dequantize, then ``F.linear``): correct everywhere, but it
reads float32 weights, so it is no faster than the unquantized model. On the CPU the C++ kernels
(``csrc/qlinear.cpp``: AVX2/FMA where the CPU has them, with AVX-512 where it has that too, the
same bits; portable loops otherwise) read only the
quantized bytes. They are built on first use with ``torch.utils.cpp_extension`` (a C++ compiler and
ninja; about a minute, cached under ``~/.cache/torch_extensions``). Without a compiler the
pure-PyTorch kernel is used and ``kernel_status()`` says why.
"""

from __future__ import annotations

import functools
import hashlib
import os
import shutil
import sys
import threading
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F

_SOURCE = Path(__file__).parent / "csrc" / "qlinear.cpp"

_LIBRARY = torch.library.Library("torchgemma", "DEF")
_LIBRARY.define(
    "qlinear(Tensor x, Tensor qweight, Tensor scales, Tensor? mins, int bits, int group_size) -> Tensor"
)
_LIBRARY.define("dequantize(Tensor qweight, Tensor scales, Tensor? mins, int bits, int group_size) -> Tensor")
# x @ W.T for many rows (prefill): the float32 BLAS on W dequantized a slab of rows at a time.
_LIBRARY.define(
    "qlinear_dense(Tensor x, Tensor qweight, Tensor scales, Tensor? mins, int bits, int group_size) -> Tensor"
)
# x @ W.T with x rounded to x_bits-bit integers (8 or 16) per 32 values, for calls of many rows
# (QuantizedWeight.activation_bits; csrc/qlinear.cpp defines the arithmetic).
_LIBRARY.define(
    "qlinear_int(Tensor x, Tensor qweight, Tensor scales, Tensor? mins, int bits, int group_size, int x_bits) "
    "-> Tensor"
)
# The greedy head's two helpers (CPU kernels only; see QuantizedWeight.argmax): scores of every row
# with int8-rounded activations and a bound on their distance from qlinear's, and the rows' norms.
_LIBRARY.define(
    "qlinear_bounds(Tensor x, Tensor qweight, Tensor scales, Tensor? mins, int bits, int group_size, "
    "Tensor row_norms) -> (Tensor, Tensor)"
)
_LIBRARY.define("row_norms(Tensor qweight, Tensor scales, int bits, int group_size) -> Tensor")
_LIBRARY.define("bounded_candidates(Tensor approx, Tensor bound) -> (Tensor, Tensor)")
# RMSNorm in one call (float32, CPU): what a quantized model's norms run (FusedRMSNorm).
_LIBRARY.define("rms_norm(Tensor x, Tensor? weight, float eps, bool plus_one) -> Tensor")
# RoPE in one call (float32, CPU), the bits of layers.apply_rope: a quantized model's (fused_rope).
_LIBRARY.define("rope(Tensor x, Tensor cos, Tensor sin) -> Tensor")
# One new token's attention over all its keys, no mask (float32, CPU): a quantized model's decode.
_LIBRARY.define("decode_attention(Tensor q, Tensor k, Tensor v, float scale) -> Tensor")


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


def _dequantize_reference(qweight, scales, mins, bits: int, group_size: int) -> torch.Tensor:
    """Float32 weights on any device: scales * q, then + mins (never fused), as GGML's dequantizers."""
    q = unpack(qweight, bits).to(torch.float32)
    n, k = q.shape
    w = q.view(n, k // group_size, group_size) * scales.to(torch.float32)[..., None]
    if mins is not None:
        w = w + mins.to(torch.float32)[..., None]
    return w.view(n, k)


def _qlinear_reference(x, qweight, scales, mins, bits: int, group_size: int) -> torch.Tensor:
    return F.linear(x.to(torch.float32), _dequantize_reference(qweight, scales, mins, bits, group_size))


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
    k = _check(qweight, scales, mins, bits, group_size)
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


def _check(qweight, scales, mins, bits: int, group_size: int) -> int:
    if bits not in (4, 5, 8):
        raise ValueError(f"bits must be 4, 5 or 8, got {bits}")
    if bits == 5 and qweight.shape[1] % 20:
        raise ValueError(f"5-bit rows take 20 bytes per 32 values, got {qweight.shape[1]} bytes")
    if scales.dtype not in (torch.float32, torch.float16) or (
        mins is not None and mins.dtype != scales.dtype
    ):
        raise ValueError("scales (and mins) must be float32 or float16, both the same")
    k = features_of(qweight.shape[1], bits)
    if k % group_size:
        raise ValueError(f"group size {group_size} does not divide the {k} input features")
    return k


@torch.library.register_fake("torchgemma::qlinear")
def _qlinear_fake(x, qweight, scales, mins, bits, group_size):
    k = _check(qweight, scales, mins, bits, group_size)
    if x.shape[-1] != k:
        raise ValueError(f"qlinear: input has {x.shape[-1]} features, the weight takes {k}")
    return x.new_empty((*x.shape[:-1], qweight.shape[0]), dtype=torch.float32)


@torch.library.register_fake("torchgemma::qlinear_dense")
def _qlinear_dense_fake(x, qweight, scales, mins, bits, group_size):
    return _qlinear_fake(x, qweight, scales, mins, bits, group_size)


@torch.library.register_fake("torchgemma::qlinear_int")
def _qlinear_int_fake(x, qweight, scales, mins, bits, group_size, x_bits):
    return _qlinear_fake(x, qweight, scales, mins, bits, group_size)


@torch.library.register_fake("torchgemma::rms_norm")
def _rms_norm_fake(x, weight, eps, plus_one):
    return torch.empty_like(x)


@torch.library.register_fake("torchgemma::rope")
def _rope_fake(x, cos, sin):
    return torch.empty_like(x)


@torch.library.register_fake("torchgemma::decode_attention")
def _decode_attention_fake(q, k, v, scale):
    return q.new_empty((q.shape[0], 1, q.shape[1], q.shape[3]))


@torch.library.register_fake("torchgemma::dequantize")
def _dequantize_fake(qweight, scales, mins, bits, group_size):
    k = _check(qweight, scales, mins, bits, group_size)
    return scales.new_empty((qweight.shape[0], k), dtype=torch.float32)


# Every backend's default; the C++ library, once loaded, registers CPU kernels that take precedence.
_LIBRARY.impl("qlinear", _qlinear_reference, "CompositeExplicitAutograd")
_LIBRARY.impl("dequantize", _dequantize_reference, "CompositeExplicitAutograd")
_LIBRARY.impl("qlinear_dense", _qlinear_reference, "CompositeExplicitAutograd")
_LIBRARY.impl("qlinear_int", _qlinear_int_reference, "CompositeExplicitAutograd")


# ── building the C++ kernels ───────────────────────────────────────────────────────────────────

_lock = threading.Lock()
_status: str | None = None  # None: not tried yet
_built = False


def _cpu_flags() -> list[str]:
    """Compiler flags for the instruction sets this CPU has (the build is cached per flag set)."""
    capability = torch.backends.cpu.get_cpu_capability()  # "DEFAULT", "AVX2", "AVX512", ...
    avx2 = ["-mavx2", "-mfma", "-mf16c"]
    if capability == "AVX512":  # ATen's test: AVX-512 F, BW, VL and DQ
        return avx2 + ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq"]
    return avx2 if capability == "AVX2" else []


def _compiler() -> str | None:
    return shutil.which(os.environ.get("CXX", "c++")) or shutil.which("g++") or shutil.which("clang++")


def ensure_kernels() -> bool:
    """Build (once per machine and flag set) and load the C++ CPU kernels; False if they cannot be.

    The reason for a False is in ``kernel_status()``, and is warned about once.
    """
    global _status, _built
    if _status is not None:
        return _built
    with _lock:
        if _status is not None:
            return _built
        flags = " ".join(_cpu_flags()) or "portable loops"
        library = _library_path()
        if library.exists() and not (library.parent / "lock").exists():
            # Built before for this source, flag set, torch and Python: loaded without importing
            # torch.utils.cpp_extension (and setuptools: ~40 MB and half a second).
            torch.ops.load_library(str(library))
            _built = True
            _status = f"C++ CPU kernels loaded ({flags})"
        elif _compiler() is None:
            _status = (
                "no C++ compiler found (looked for $CXX, c++, g++, clang++): quantized layers run on the "
                "pure-PyTorch kernel, which dequantizes every weight on every call; install one (e.g. "
                "`apt-get install g++`, or Xcode's command line tools) for the fast CPU kernels"
            )
        elif shutil.which("ninja") is None:
            _status = (
                "ninja is not installed (`pip install ninja`): the C++ kernels cannot be built; quantized "
                "layers run on the pure-PyTorch kernel"
            )
        else:
            try:
                _build(library)
                _built = True
                _status = f"C++ CPU kernels loaded ({flags})"
            except Exception as err:  # a failed build leaves the reference kernel working
                first = str(err).strip().splitlines()
                _status = (
                    "building the C++ kernels failed, quantized layers run on the pure-PyTorch kernel: "
                    + (first[-1] if first else type(err).__name__)
                )
        if not _built:
            warnings.warn(f"torchgemma: {_status}", RuntimeWarning, stacklevel=3)
        return _built


def _library_path() -> Path:
    """Where the built library lives: ``$TORCH_EXTENSIONS_DIR`` (else ``~/.cache/torch_extensions``)
    / a name that carries a digest of the source, the compiler flags, torch's and Python's versions.
    A cache shared by machines of different CPUs keeps one build per flag set, and an edited source
    or another torch never loads a stale build."""
    flags = _cpu_flags()
    digest = hashlib.sha256(
        b"\0".join(
            [_SOURCE.read_bytes(), " ".join(flags).encode(), torch.__version__.encode(), sys.version.encode()]
        )
    ).hexdigest()[:12]
    isa = "avx512" if "-mavx512f" in flags else "avx2" if flags else "portable"
    name = f"torchgemma_qlinear_{isa}_{digest}"
    root = os.environ.get("TORCH_EXTENSIONS_DIR") or Path(
        os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache", "torch_extensions"
    )
    return Path(root) / name / f"{name}.so"


def _build(library: Path) -> None:
    from torch.utils.cpp_extension import load

    library.parent.mkdir(parents=True, exist_ok=True)
    load(
        name=library.stem,
        sources=[str(_SOURCE)],
        # -ffp-contract=off: dequantize computes scale * q, then + min, as GGML does, never fused.
        extra_cflags=["-O3", "-fopenmp", "-ffp-contract=off", *_cpu_flags()],
        extra_ldflags=["-fopenmp"],
        build_directory=str(library.parent),
        is_python_module=False,
        verbose=False,
    )


def vnni_available() -> bool:
    """Whether the C++ kernels run integer products with AVX-512 VNNI here (qlinear_int's fast path):
    built for AVX-512, on a CPU that reports avx512_vnni (Linux's /proc/cpuinfo; elsewhere False)."""
    return "-mavx512f" in _cpu_flags() and _cpu_reports_vnni() and ensure_kernels()


@functools.cache
def _cpu_reports_vnni() -> bool:
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            return any(line.startswith("flags") and " avx512_vnni" in line for line in cpuinfo)
    except OSError:
        return False


def kernel_status() -> str:
    """What runs quantized products on the CPU: the C++ kernels, or why the fallback is used."""
    ensure_kernels()
    return _status or ""
