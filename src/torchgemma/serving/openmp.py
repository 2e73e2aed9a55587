"""Handing the engine thread the cores: the loading thread's OpenMP workers are let go.

torch's CPU kernels (and ours, through ``at::parallel_for``) run on OpenMP. GNU OpenMP (libgomp,
what torch's Linux wheels ship) keeps a team of workers per thread that ever ran a parallel region,
and its workers wait for the next region by spinning, unless the process holds more OpenMP threads
than it has cores: then they spin only briefly (``gomp_throttled_spin_count_var``) and sleep in the
kernel, and every parallel region of a decode step (about 190 of them for Gemma 3 270M) wakes them
with a system call. A server loads the model on its main thread (which leaves that thread a team)
and steps the engine on another (a second team), so at 2 threads on 2 cores it held 3 OpenMP
threads and its engine's worker slept and woke ~180 times per token: at 2 threads the server
decoded no faster than at 1, against the library's 1.5x.

``release_openmp_workers()`` ends the calling thread's team (OpenMP 5's ``omp_pause_resource_all``,
soft: the next parallel region of that thread starts a new one) where the process's OpenMP runtime
has it, and does nothing elsewhere. The server calls it on the loading thread before the engine
thread starts, and ``released(work)`` ends the workers of a thread that ran a forward for a request
besides the engine (prompt log-probabilities, embeddings, media): a pool thread keeps its team
otherwise.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")

OMP_PAUSE_SOFT = 1  # omp_pause_resource_t: the threads end, the runtime's settings stay


@functools.cache
def _pause_functions() -> tuple[Any, ...]:
    """``omp_pause_resource_all`` of each OpenMP runtime loaded (torch has loaded its own by now)."""
    found = []
    for path in _loaded_runtimes():
        try:  # RTLD_NOLOAD: the copy already loaded, never a second one
            runtime = ctypes.CDLL(path, mode=os.RTLD_NOLOAD | os.RTLD_LOCAL)
            pause = runtime.omp_pause_resource_all
        except (OSError, AttributeError):  # not loaded after all, or older than OpenMP 5
            continue
        pause.argtypes, pause.restype = [ctypes.c_int], ctypes.c_int
        found.append(pause)
    return tuple(found)


def _loaded_runtimes() -> list[str]:
    """The paths of the OpenMP runtimes this process has loaded (libgomp, libiomp5, libomp)."""
    names = ("libgomp", "libiomp5", "libomp")
    paths = []
    with contextlib.suppress(OSError), open("/proc/self/maps", encoding="utf-8") as maps:
        for line in maps:
            path = line.rstrip("\n").split(maxsplit=5)[-1]
            base = os.path.basename(path)
            if base.startswith(names) and ".so" in base and path not in paths:
                paths.append(path)
    return paths


def release_openmp_workers() -> bool:
    """End the calling thread's OpenMP workers (see the module docstring); whether a runtime did."""
    released = False
    for pause in _pause_functions():
        released |= pause(OMP_PAUSE_SOFT) == 0
    return released


def released(work: Callable[..., T]) -> Callable[..., T]:
    """``work``, then the calling thread's OpenMP workers ended (for pool threads' work)."""

    @functools.wraps(work)
    def run(*args: Any) -> T:
        try:
            return work(*args)
        finally:
            release_openmp_workers()

    return run
