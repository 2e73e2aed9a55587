"""Running N ranks of tests/tp_worker.py on the CPU with gloo: torchrun's environment set by hand (one
Python process per rank, no launcher), or torchrun itself; every process killed on failure or timeout."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

HERE = Path(__file__).parent
SRC = HERE.parent / "src"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_env(rank: int, size: int, port: int) -> dict[str, str]:
    """What torchrun gives each rank (one thread each: the machine's cores are shared)."""
    return dict(
        os.environ,
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(size),
        LOCAL_WORLD_SIZE=str(size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        OMP_NUM_THREADS="1",
        PYTHONPATH=os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")]),
    )


def wait_all(procs: list[subprocess.Popen], logs: list[Path], timeout: float) -> None:
    """Wait for every process; on a failure or the timeout kill them all (their process groups) and
    fail with the logs' tails."""
    deadline = time.monotonic() + timeout
    try:
        while any(p.poll() is None for p in procs):
            if time.monotonic() > deadline:
                raise TimeoutError(f"ranks still running after {timeout} s")
            if any(p.returncode not in (None, 0) for p in procs):
                break
            time.sleep(0.05)
    except TimeoutError as err:
        kill(procs)
        pytest.fail(f"{err}\n" + tails(logs))
    if any(p.returncode != 0 for p in procs):
        kill(procs)
        pytest.fail(f"exit codes {[p.poll() for p in procs]}\n" + tails(logs))


def kill(procs: list[subprocess.Popen]) -> None:
    """Kill each process still running, its process group and every process below it (torchrun's
    workers have process groups of their own)."""
    for p in procs:
        if p.poll() is None:
            below = descendants(p.pid)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
            for pid in below:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
    for p in procs:
        p.wait()


def descendants(pid: int) -> list[int]:
    """The processes below ``pid`` (Linux: /proc's children lists)."""
    found, queue = [], [pid]
    while queue:
        parent = queue.pop()
        for task in Path(f"/proc/{parent}/task").glob("*"):
            with contextlib.suppress(OSError):
                children = [int(c) for c in (task / "children").read_text().split()]
                found += children
                queue += children
    return found


def run_command(command: list[str], env: dict, timeout: float) -> subprocess.CompletedProcess:
    """``subprocess.run`` that kills every process below on a timeout (torchrun's workers too)."""
    process = subprocess.Popen(
        command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True
    )
    try:
        out, err = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill([process])
        pytest.fail(f"{command} still running after {timeout} s")
    return subprocess.CompletedProcess(command, process.returncode, out, err)


def tails(logs: list[Path]) -> str:
    return "\n".join(f"--- {log.name}\n{log.read_text()[-3000:]}" for log in logs if log.exists())


class Ranks:
    """``tests/tp_worker.py OUT *args`` (or another ``worker`` script) started on ``size`` ranks;
    ``results()`` waits for them (the caller computes its references meanwhile) and returns rank 0's."""

    def __init__(
        self, tmp: Path, size: int, args: list[str], timeout: float = 120, worker: str = "tp_worker.py"
    ):
        self.out, self.timeout = tmp / f"tp{size}.safetensors", timeout
        self.procs, self.logs = start(self.out, tmp, size, args, worker)

    def results(self) -> dict[str, torch.Tensor]:
        wait_all(self.procs, self.logs, self.timeout)
        return load_file(self.out)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        kill(self.procs)  # nothing left running if the test failed before results()


def start(
    out: Path, tmp: Path, size: int, args: list[str], worker: str = "tp_worker.py"
) -> tuple[list, list]:
    port = free_port()
    procs, logs = [], []
    for rank in range(size):
        log = tmp / f"rank{rank}.log"
        logs.append(log)
        with open(log, "w") as handle:
            procs.append(
                subprocess.Popen(
                    [sys.executable, str(HERE / worker), str(out), *args],
                    env=rank_env(rank, size, port),
                    stdout=handle,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,  # its own process group: killed whole on failure
                )
            )
    return procs, logs


def wait_healthy(port: int, process: subprocess.Popen, log: Path, timeout: float = 180) -> None:
    """Wait until the server on ``port`` answers /health; fail with its log's end if it exits first
    or is not up within ``timeout`` seconds."""
    import httpx

    deadline = time.monotonic() + timeout
    while True:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200:
                return
        except httpx.TransportError:
            assert process.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.2)
