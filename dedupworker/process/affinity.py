"""Pinning a worker process to one CPU (`--cpu`).

A worker's handler threads take turns on the GIL, and every libpq call that lets go of it
(each statement sent, each wait for a reply) can hand it to another thread. When that thread
sleeps on another CPU, the hand-off wakes that CPU and moves the GIL across cores; on one CPU
the releasing thread usually takes the GIL back before the woken one runs, and the hand-off
costs nearly nothing. Measured in bench/README.md: 25-45 % less worker CPU per message.
The price: code that runs outside the GIL (numpy, compression, hashing in C) no longer spreads
over several cores, so this is for handlers that are mostly Python and I/O.
"""

from __future__ import annotations

import os

from dedupworker.errors import ConfigurationError


def pin_process(cpu: int) -> None:
    """Run every thread of this process, and the threads it starts later, on `cpu`."""
    getter = getattr(os, "sched_getaffinity", None)
    setter = getattr(os, "sched_setaffinity", None)
    if getter is None or setter is None:
        raise ConfigurationError("--cpu needs Linux (sched_setaffinity); leave it out here")
    allowed = sorted(getter(0))
    if cpu not in allowed:
        raise ConfigurationError(
            f"--cpu {cpu}: this process may only run on CPUs {_ranges(allowed)} (its affinity "
            "or the container's cpuset); pick one of those or leave --cpu out"
        )
    # Affinity is per thread on Linux: threads started later inherit it from the main thread;
    # those that already run (a library's, say) are pinned one by one.
    for thread_id in _threads():
        try:
            setter(thread_id, {cpu})
        except ProcessLookupError:
            continue  # it ended meanwhile


def _threads() -> list[int]:
    try:
        return [int(name) for name in os.listdir("/proc/self/task")]
    except OSError:
        return [0]  # no /proc: the calling thread only


def _ranges(cpus: list[int]) -> str:
    spans: list[list[int]] = []
    for cpu in cpus:
        if spans and cpu == spans[-1][1] + 1:
            spans[-1][1] = cpu
        else:
            spans.append([cpu, cpu])
    return ",".join(f"{a}" if a == b else f"{a}-{b}" for a, b in spans)
