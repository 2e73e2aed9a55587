"""Loading the C++ CPU kernels: the library built at install, else one built here once; and the
choice of instruction set (portable, AVX2, AVX-512) they run with.

The library holds every kernel three times, once per instruction set, and registers the CPU kernels
of every operator in ``ops.OPERATORS`` as calls through the chosen set (``csrc/registration.cpp``).
The choice: ``$TORCHGEMMA_ISA`` (``portable``, ``avx2``, ``avx512``; ``reference``: load no C++ at all,
every operator runs its pure-PyTorch reference), else the widest set this CPU has. A set the CPU
lacks is an error, never a crash. ``set_isa`` switches in-process (tests run every set the machine
has, to the bit).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
import sys
import threading
import time
import warnings
from collections.abc import Iterator
from pathlib import Path

from . import build

ISAS = tuple(build.ISAS)  # ("portable", "avx2", "avx512"), narrowest first
# Where `pip install` puts the library (setup.py; an editable install: the source folder).
PACKAGE_DIR = Path(__file__).parent
# About what a build takes on 2 idle cores (38 s measured; 113 s while other work shared them): said
# before the wait.
BUILD_SECONDS = 40

_lock = threading.Lock()
_status: str | None = None  # None: not tried yet
_handle: ctypes.CDLL | None = None  # the loaded library, None where the references run


def ensure_kernels() -> bool:
    """Load (or build once, then load) the C++ CPU kernels; False if they cannot be (the reason is in
    ``kernel_status()``, and is warned about once). Raises if ``$TORCHGEMMA_ISA`` names a set this CPU
    lacks, or no set at all."""
    if _status is not None:
        return _handle is not None
    with _lock:
        if _status is None:
            _load()
    return _handle is not None


def kernel_status() -> str:
    """What runs the operators on the CPU: the C++ kernels and their instruction set, or why the
    pure-PyTorch references do."""
    ensure_kernels()
    return _status or ""


def isa() -> str | None:
    """The instruction set the C++ kernels run with now; None where they are not loaded."""
    if not ensure_kernels():
        return None
    return _handle.torchgemma_selected().decode()


def available_isas() -> tuple[str, ...]:
    """The sets this CPU runs (narrowest first); () where the C++ kernels are not loaded."""
    if not ensure_kernels():
        return ()
    return tuple(name for name in ISAS if _handle.torchgemma_cpu_supports(name.encode()))


def set_isa(name: str) -> None:
    """Run the C++ kernels with instruction set ``name`` from now on, in this process."""
    global _status
    if not ensure_kernels():
        raise RuntimeError(f"the C++ kernels are not loaded: {_status}")
    _select(_handle, name, "set_isa")
    _status = _loaded_status(_handle)


@contextlib.contextmanager
def using_isa(name: str) -> Iterator[None]:
    """``set_isa(name)`` for the body of a ``with``, then the set before it again."""
    before = isa()
    set_isa(name)
    try:
        yield
    finally:
        set_isa(before)


def vnni_available() -> bool:
    """Whether the C++ kernels run integer products with AVX-512 VNNI here (qlinear_int's fast path):
    the AVX-512 set chosen, on a CPU that has VNNI."""
    return ensure_kernels() and isa() == "avx512" and bool(_handle.torchgemma_cpu_supports(b"avx512vnni"))


# ── loading ────────────────────────────────────────────────────────────────────────────────────


def _load() -> None:
    global _status, _handle
    wanted = os.environ.get("TORCHGEMMA_ISA", "").strip().lower()
    if wanted == "reference":
        _status = "TORCHGEMMA_ISA=reference: every operator runs its pure-PyTorch reference"
        return
    if wanted and wanted not in ISAS:
        _status = ""  # tried: the error below stands for this process
        raise ValueError(f"TORCHGEMMA_ISA={wanted}: expected one of {', '.join(ISAS)} or reference")
    digest = build.digest()
    prebuilt = PACKAGE_DIR / build.LIBRARY_NAME
    path = prebuilt if prebuilt.exists() and _digest_of(prebuilt) == digest else _cached(digest)
    if path is None:
        warnings.warn(f"torchgemma: {_status}", RuntimeWarning, stacklevel=4)
        return
    handle = _open(path)
    if handle.torchgemma_digest().decode() != digest:
        _status = f"{path} is not the library of these sources (stale): the operators run their references"
        warnings.warn(f"torchgemma: {_status}", RuntimeWarning, stacklevel=4)
        return
    _select(handle, wanted or _widest(handle), "TORCHGEMMA_ISA")
    if handle.torchgemma_register() != 0:
        _status = f"registering the C++ kernels failed: {handle.torchgemma_error().decode()}"
        warnings.warn(f"torchgemma: {_status}", RuntimeWarning, stacklevel=4)
        return
    _handle = handle
    _status = _loaded_status(handle) + ("" if path == prebuilt else f" (built here: {path})")


def _open(path: Path) -> ctypes.CDLL:
    handle = ctypes.CDLL(str(path))
    for name in ("torchgemma_digest", "torchgemma_selected", "torchgemma_error"):
        getattr(handle, name).restype = ctypes.c_char_p
    for name in ("torchgemma_cpu_supports", "torchgemma_select"):
        getattr(handle, name).argtypes = [ctypes.c_char_p]
    return handle


def _digest_of(path: Path) -> str | None:
    """The digest a built library was made from, read before its kernels are registered."""
    try:
        return _open(path).torchgemma_digest().decode()
    except (OSError, AttributeError):  # not loadable here, or not this library
        return None


def _widest(handle: ctypes.CDLL) -> str:
    return [name for name in ISAS if handle.torchgemma_cpu_supports(name.encode())][-1]


def _select(handle: ctypes.CDLL, name: str, asked_by: str) -> None:
    done = handle.torchgemma_select(name.encode())
    if done == 1:
        raise ValueError(f"{asked_by}: no instruction set {name!r}; expected one of {', '.join(ISAS)}")
    if done == 2:
        runs = [isa for isa in ISAS if handle.torchgemma_cpu_supports(isa.encode())]
        raise RuntimeError(f"{asked_by}: this CPU has no {name} (it runs {', '.join(runs)})")


def _loaded_status(handle: ctypes.CDLL) -> str:
    return f"C++ CPU kernels loaded ({handle.torchgemma_selected().decode()})"


def _cached(digest: str) -> Path | None:
    """The library built on this machine for these sources: found, or built now (saying so on stderr);
    None where it cannot be (``_status`` says why)."""
    global _status
    root = os.environ.get("TORCH_EXTENSIONS_DIR") or Path(
        os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache", "torch_extensions"
    )
    path = Path(root) / f"torchgemma_kernels_{digest}" / build.LIBRARY_NAME
    if path.exists():
        return path
    if build.compiler() is None:
        _status = (
            "no C++ compiler found (looked for $CXX, c++, g++, clang++) and no kernels were built at "
            "install: quantized layers run on the pure-PyTorch kernel, which dequantizes every weight on "
            "every call; install one (e.g. `apt-get install g++`, or Xcode's command line tools) for the "
            "fast CPU kernels"
        )
        return None
    path.parent.mkdir(parents=True, exist_ok=True)
    with _file_lock(path.parent / "lock"):  # one build at a time per machine (test workers, servers)
        if path.exists():
            return path
        # Scratch folders of builds killed midway (build.build's, a few MB of objects each): only a
        # holder of the lock builds here, so any left now is no one's.
        for stale in path.parent.glob("torchgemma-build-*"):
            shutil.rmtree(stale, ignore_errors=True)
        print(
            f"torchgemma: building the C++ CPU kernels for this machine (one time, ~{BUILD_SECONDS} s)...",
            file=sys.stderr,
            flush=True,
        )
        try:
            seconds = build.build(path)
        except Exception as err:  # a failed build leaves the references working
            lines = str(err).strip().splitlines()
            _status = "building the C++ kernels failed, quantized layers run on the pure-PyTorch kernel: " + (
                lines[-1] if lines else type(err).__name__
            )
            return None
        print(f"torchgemma: built the C++ CPU kernels in {seconds:.0f} s ({path})", file=sys.stderr)
    return path


# How long a wait for the lock goes unannounced (another process's build takes ~BUILD_SECONDS).
LOCK_QUIET_SECONDS = 1.0


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    """An exclusive lock on ``path`` for the body of a ``with``: flock(2), which the kernel releases
    when its holder exits however it exits (a build killed with SIGKILL leaves the file, never the
    lock: the next process takes it at once). A file left by anything else (torch's JIT FileBaton of
    older versions used this very name) is only a file to flock. A wait past LOCK_QUIET_SECONDS is
    said on stderr, with the path."""
    try:
        import fcntl
    except ImportError:  # Windows: no lock (two first runs at once may both build; the last one wins)
        yield
        return
    with open(path, "a") as handle:
        start = time.monotonic()
        while True:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() - start >= LOCK_QUIET_SECONDS:
                    print(
                        f"torchgemma: waiting for another process's build of the C++ kernels (it holds the "
                        f"lock {path}; that process's exit releases it)...",
                        file=sys.stderr,
                        flush=True,
                    )
                    fcntl.flock(handle, fcntl.LOCK_EX)
                    break
                time.sleep(0.05)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
