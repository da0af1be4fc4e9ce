"""CPU threads for the commands, on a machine that other work may share.

torch starts one OpenMP thread per core. Decoding a small model is a long series of short
parallel regions, each ending in a barrier; when another process holds one of the cores, every
barrier waits for the thread that lost its core, and the waiting threads spin. On a 2-core
machine with both cores busy that made plain decoding about 6x slower than one thread (issue 14).

So the commands (not the Python API, whose process the caller owns) pick the thread count from
the cores that are idle when they start, measured over a fraction of a second from /proc/stat,
and ask OpenMP to sleep rather than spin while it waits (OMP_WAIT_POLICY=PASSIVE, which must be
set before torch is imported). An explicit --threads, or OMP_NUM_THREADS / OMP_WAIT_POLICY in
the environment, always wins. README.md ("Threads on a shared machine") has the measurements.
"""

from __future__ import annotations

import os
import time

SAMPLE_SECONDS = 0.3


def prefer_passive_waits() -> None:
    """OpenMP threads sleep at barriers instead of spinning (unless the user chose a policy).
    Only effective before torch (and its OpenMP runtime) is loaded."""
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def _cpu_times(cpus: set[int]) -> dict[int, tuple[int, int]]:
    """(idle, total) jiffies per CPU in `cpus`; idle counts iowait, total counts steal."""
    out = {}
    with open("/proc/stat") as f:
        for line in f:
            name, *vals = line.split()
            if not name.startswith("cpu") or name == "cpu":
                continue
            i = int(name[3:])
            if i in cpus:
                v = [int(x) for x in vals[:8]]
                out[i] = (v[3] + v[4], sum(v))
    return out


def idle_cpus(interval: float = SAMPLE_SECONDS) -> float | None:
    """How many of this process's CPUs were idle over `interval` seconds; None where /proc/stat is
    not readable (not Linux)."""
    try:
        cpus = os.sched_getaffinity(0)
        a = _cpu_times(cpus)
        time.sleep(interval)
        b = _cpu_times(cpus)
    except (OSError, AttributeError, ValueError):
        return None
    idle = 0.0
    for i, (idle1, total1) in b.items():
        idle0, total0 = a.get(i, (idle1, total1))
        if total1 > total0:
            idle += (idle1 - idle0) / (total1 - total0)
    return idle


def choose_threads(cores: int, idle: float | None) -> int:
    """All `cores` on an idle machine; one per idle core (at least one) when others are busy."""
    if idle is None:
        return cores
    return max(1, min(cores, int(idle + 0.5)))


def setup_threads(requested: int | None) -> int:
    """Set torch's thread count: `requested`, else OMP_NUM_THREADS, else from the idle cores.
    Returns the count in use."""
    import torch

    if requested is not None:
        torch.set_num_threads(requested)
    elif "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(choose_threads(torch.get_num_threads(), idle_cpus()))
    return torch.get_num_threads()
