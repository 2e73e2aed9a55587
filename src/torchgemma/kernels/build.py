"""Compiling the C++ CPU kernels into one shared library: every kernel source once per instruction set.

Used by ``setup.py`` at ``pip install`` (the library lands beside this file) and, where no built
library is there, by ``library.py`` at first use (the same build, cached per digest). Imports only the
standard library at the top: ``setup.py`` loads this file by its path, before the package is installed.

The compiler is called directly (two compilations at a time), with torch's include and library
paths and its C++ ABI define: what ``torch.utils.cpp_extension`` would pass, without needing ninja.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

CSRC = Path(__file__).parent / "csrc"
LIBRARY_NAME = "_C.so"

# Each instruction set's flags. AVX2 needs FMA and F16C too (the scales' float16 loads); AVX-512 is
# ATen's AVX512 (F, BW, VL, DQ). The integer-activation kernels build their VNNI code with a target
# attribute inside the AVX-512 set and call it only where the CPU has VNNI.
ISAS: dict[str, list[str]] = {
    "portable": [],
    "avx2": ["-mavx2", "-mfma", "-mf16c"],
    "avx512": ["-mavx2", "-mfma", "-mf16c", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq"],
}
# The kernel sources, one per operator family, each compiled once per set into namespace
# torchgemma::<set> (together, as variant.cpp: one translation unit per set); registration.cpp
# (compiled once, with no set's flags) dispatches between the sets.
FAMILIES = ("qlinear", "int_products", "greedy_head", "norms_rope", "decode_attention", "decode_layer")
# -ffp-contract=off: no multiply-add is fused unless the source says so (dequantize computes
# scale * q, then + min, as GGML does); the sets' bits are equal because their sums are the same
# operations in the same order.
CFLAGS = ["-std=c++20", "-O3", "-fPIC", "-fopenmp", "-ffp-contract=off"]


def digest() -> str:
    """What a built library must match: every source, the flags and torch's version (a library built
    against another torch, or from other sources, is not loaded)."""
    import torch

    h = hashlib.sha256()
    for path in sorted(CSRC.iterdir()):
        if path.suffix in (".cpp", ".h"):
            h.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    h.update(repr((ISAS, FAMILIES, CFLAGS, torch.__version__)).encode())
    return h.hexdigest()[:16]


def compiler() -> str | None:
    """``$CXX``, else the first of c++, g++, clang++ on PATH."""
    return shutil.which(os.environ.get("CXX", "c++")) or shutil.which("g++") or shutil.which("clang++")


def _torch_flags() -> tuple[list[str], list[str]]:
    import torch
    from torch.utils.cpp_extension import include_paths, library_paths

    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    includes = [flag for path in include_paths() for flag in ("-isystem", path)]
    libraries = [f"-L{path}" for path in library_paths()]
    return [*includes, f"-D_GLIBCXX_USE_CXX11_ABI={abi}"], [*libraries, "-lc10", "-ltorch_cpu", "-ltorch"]


def build(output: Path, jobs: int = 2) -> float:
    """Compiles and links the library to ``output`` (replaced atomically); returns the seconds taken.
    Raises RuntimeError with the compiler's message if a step fails."""
    start = time.perf_counter()
    cxx = compiler()
    if cxx is None:
        raise RuntimeError("no C++ compiler found (looked for $CXX, c++, g++, clang++)")
    compile_flags, link_flags = _torch_flags()
    output = Path(output)
    output.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="torchgemma-build-", dir=output.parent) as scratch:
        work = Path(scratch)
        objects = {name: work / f"{name}.o" for name in ("registration", *ISAS)}
        commands = [  # the longest first (the widest set's), so that the two workers finish together
            [cxx, *CFLAGS, *ISAS[isa], *compile_flags, f"-DTG_ISA={isa}", "-c", str(CSRC / "variant.cpp")]
            + ["-o", str(objects[isa])]
            for isa in reversed(ISAS)
        ]
        commands.append(
            [cxx, *CFLAGS, *compile_flags, f'-DTG_DIGEST="{digest()}"', "-c", str(CSRC / "registration.cpp")]
            + ["-o", str(objects["registration"])]
        )
        with ThreadPoolExecutor(max(1, jobs)) as pool:
            for done in pool.map(_run, commands):
                if done:
                    raise RuntimeError(done)
        partial = work / LIBRARY_NAME
        # registration.o first: the linker keeps the first copy of the inline code every object shares
        # (ATen's, the standard library's), and registration's is built for any CPU.
        link = [cxx, "-shared", "-fopenmp", *map(str, objects.values()), *link_flags, "-o", str(partial)]
        failed = _run(link)
        if failed:
            raise RuntimeError(failed)
        os.replace(partial, output)
    return time.perf_counter() - start


def _run(command: list[str]) -> str | None:
    """Runs one compiler command; None, or its message on failure."""
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode == 0:
        return None
    return f"{' '.join(command[:1] + command[-3:])} failed:\n{done.stderr.strip()}"


if __name__ == "__main__":  # python -m torchgemma.kernels.build [OUTPUT]: a build by hand, timed
    target = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).parent / LIBRARY_NAME
    print(f"built {target} in {build(target):.1f} s")
