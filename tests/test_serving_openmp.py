"""The server's loading thread lets its OpenMP workers go before the engine thread takes the model
(serving/openmp.py): in a fresh process, after a parallel region on the main thread, the worker
thread it started ends, and the next parallel region still computes the same result."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent(
    """
    import os, time, torch
    from torchgemma.serving.openmp import release_openmp_workers
    torch.set_num_threads(2)
    x = torch.arange(1 << 22, dtype=torch.float32)
    before = (x * 2).sum().item()  # a parallel region: libgomp starts this thread's worker
    started = len(os.listdir("/proc/self/task"))
    released = release_openmp_workers()
    for _ in range(200):  # the worker thread exits asynchronously
        if len(os.listdir("/proc/self/task")) < started:
            break
        time.sleep(0.01)
    print(released, started, len(os.listdir("/proc/self/task")), (x * 2).sum().item() == before)
    """
)


def test_release_ends_the_calling_threads_openmp_workers():
    import torch

    if "OpenMP" not in torch.__config__.parallel_info():
        pytest.skip("torch is not built with OpenMP here")
    run = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    released, started, after, same = run.stdout.split()
    if released != "True":
        pytest.skip("this OpenMP runtime has no omp_pause_resource_all (OpenMP 5)")
    assert int(after) == int(started) - 1  # the one worker of 2 threads has ended
    assert same == "True"
