"""README.md's Python examples run as pasted (issue 28).

Every ```python block of README.md runs in a fresh interpreter (``python -c``), in an empty folder,
with the hub offline, as a reader pasting it would run it: a block that raises fails its test. The
marks, one HTML comment before a block, follow pytest-codeblocks (whose parser reads them; README's
Development section tells contributors):

    <!--pytest.mark.slow-->                                  run under -m slow only
    <!--pytest.mark.skip(reason="needs ... from the hub")--> never run; the reason is reported
    <!--pytest-codeblocks:cont-->                            continues the block before it (run as one)

Blocks without a mark run in the default run. Skipped blocks are still compiled, so a typo in an
example that cannot run here is caught too.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).parents[1] / "README.md"
# A block's wall-clock limit: generous for a loaded 2-core machine (the default ones take seconds).
TIMEOUT_SECONDS = {"default": 300, "slow": 900}
ALLOWED_MARKS = ("pytest.mark.slow", "pytest.mark.skip(", "pytest.mark.skipif(")


def python_blocks():
    codeblocks = pytest.importorskip(
        "pytest_codeblocks", reason="pytest-codeblocks (the test extra) parses README"
    )
    return [block for block in codeblocks.extract_from_file(README) if block.syntax == "python"]


def block_params():
    try:
        blocks = python_blocks()
    except pytest.skip.Exception:  # parametrizing at collection: skip the test, not the module
        return [pytest.param(None, marks=pytest.mark.skip(reason="pytest-codeblocks is not installed"))]
    return [
        pytest.param(
            block,
            marks=[eval(mark, {"pytest": pytest, "sys": sys}) for mark in block.marks],
            id=f"line-{block.lineno}",
        )
        for block in blocks
    ]


def test_readme_has_python_blocks_and_known_marks():
    blocks = python_blocks()
    assert len(blocks) >= 10
    for block in blocks:
        for mark in block.marks:
            assert mark.startswith(ALLOWED_MARKS), f"README line {block.lineno}: unknown mark {mark!r}"
            if mark.startswith("pytest.mark.skip"):
                assert "reason=" in mark, f"README line {block.lineno}: a skipped block says why"
        compile(block.code, f"README.md, the block at line {block.lineno}", "exec")


def test_continued_blocks_continue_python():
    """pytest-codeblocks appends a continued block to the code block before it, whatever its language:
    a python block continuing a bash one would be neither run nor compiled."""
    inside, previous, continued_at = False, None, None
    for number, line in enumerate(README.read_text(encoding="utf-8").splitlines(), 1):
        if line.strip() == "<!--pytest-codeblocks:cont-->":
            assert previous == "python", f"README line {number}: continues a {previous!r} block"
            continued_at = number
        elif line.startswith("```"):
            inside = not inside
            if inside:  # an opening fence: its language
                previous = line[3:].strip()
                if continued_at is not None:
                    assert previous == "python", (
                        f"README line {continued_at}: continued by a {previous!r} block"
                    )
                    continued_at = None


@pytest.mark.parametrize("block", block_params())
def test_readme_block_runs(block, tmp_path):
    slow = any(mark.startswith("pytest.mark.slow") for mark in block.marks)
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",  # a block that needs the hub fails at once, naming it
        "OMP_NUM_THREADS": "1",  # the default run's two workers share two cores
        "PYTHONPATH": os.pathsep.join([str(README.parent / "src"), os.environ.get("PYTHONPATH", "")]),
    }
    try:
        done = subprocess.run(
            [sys.executable, "-c", block.code],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=TIMEOUT_SECONDS["slow" if slow else "default"],
        )
    except subprocess.TimeoutExpired as err:
        pytest.fail(f"README.md's block at line {block.lineno} ran past {err.timeout} s:\n{block.code}")
    finally:
        shutil.rmtree(tmp_path, ignore_errors=True)  # what a block saved (a 1 GB float32 copy of the 270M)
    assert done.returncode == 0, (
        f"README.md's block at line {block.lineno} failed (exit {done.returncode}):\n{block.code}\n"
        f"--- stderr ---\n{done.stderr[-4000:]}"
    )
