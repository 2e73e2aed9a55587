"""The server lets OpenMP workers go where the engine thread does not run the model
(serving/openmp.py): in a fresh process, the worker that a parallel region on the main thread
started ends when that thread releases it, as does a pool thread's after ``released(work)``; the
next parallel region still computes the same result."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent(
    """
    import os, time, torch
    from concurrent.futures import ThreadPoolExecutor
    from torchgemma.serving.openmp import release_openmp_workers, released

    def threads_after(started):  # a worker thread exits asynchronously
        for _ in range(200):
            if len(os.listdir("/proc/self/task")) < started:
                break
            time.sleep(0.01)
        return len(os.listdir("/proc/self/task"))

    torch.set_num_threads(2)
    x = torch.arange(1 << 22, dtype=torch.float32)
    before = (x * 2).sum().item()  # a parallel region: libgomp starts this thread's worker
    started = len(os.listdir("/proc/self/task"))
    ok = release_openmp_workers()
    main = (started, threads_after(started))
    pool = ThreadPoolExecutor(1)
    pool.submit(len, []).result()  # the pool's thread, before it runs torch
    started = len(os.listdir("/proc/self/task"))
    same = pool.submit(released(lambda: (x * 2).sum().item())).result() == before
    print(ok, *main, started, threads_after(started), same, (x * 2).sum().item() == before)
    """
)


def test_released_threads_openmp_workers_end():
    import torch

    if "OpenMP" not in torch.__config__.parallel_info():
        pytest.skip("torch is not built with OpenMP here")
    run = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    ok, main_before, main_after, pool_before, pool_after, same_pool, same_main = run.stdout.split()
    if ok != "True":
        pytest.skip("this OpenMP runtime has no omp_pause_resource_all (OpenMP 5)")
    assert int(main_after) == int(main_before) - 1  # the one worker of 2 threads has ended
    assert int(pool_after) == int(pool_before)  # the pool thread's worker came and went
    assert same_pool == same_main == "True"
