"""CPU threads for the commands, on a machine that other work may share.

torch runs one OpenMP thread per core. Decoding a small model is a long series of short parallel
regions, each ending in a barrier, and by default a thread that reaches the barrier first spins
for a while (libgomp: 300,000 times) before it sleeps. When other processes hold the cores, the
spinning threads burn the time slices the late thread needs, and every barrier waits for a thread
that has no core: on 2 cores with 2 busy processes, plain decoding ran at 0.51 tok/s with 2
threads against 0.80 with one (issue 14), and 1.12 with 2 threads that sleep at barriers
(OMP_WAIT_POLICY=PASSIVE). On an idle machine it is the other way round: a thread that sleeps at
every barrier is woken up again a few microseconds later, and with native layers a step is 150
barriers; plain int8 decoding ran at 83 tok/s passive against 150 with the default spins
(README.md, "Threads on a shared machine").

So the commands look before they choose: `choose_wait_policy` reads how busy the cores are for a
tenth of a second (/proc/stat) and asks for passive waits only when other work keeps at least
half a core busy, or where it cannot tell. The policy must be set before torch is imported; the
commands do it first thing. An explicit --threads, OMP_NUM_THREADS or OMP_WAIT_POLICY always
wins. The Python API leaves both to the caller, whose process it is.
"""

from __future__ import annotations

import logging
import os
import time

log = logging.getLogger(__name__)


BUSY_CORES = 0.5  # other work keeping this much of the machine's cores busy makes the waits passive
PROBE_SECONDS = 0.1


def read_cpu_times() -> tuple[int, int] | None:
    """(busy, total) jiffies of all cores since boot, from /proc/stat's first line; None where
    there is no such file (not Linux)."""
    try:
        with open("/proc/stat") as f:
            fields = [int(v) for v in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return sum(fields[:8]) - idle, sum(fields[:8])  # user .. steal (guest time is inside user)


def busy_cores(seconds: float = PROBE_SECONDS) -> float | None:
    """How many cores other work kept busy over the next `seconds` (this process sleeps through
    them); None where it cannot be read."""
    before = read_cpu_times()
    time.sleep(seconds)
    after = read_cpu_times()
    if before is None or after is None or after[1] <= before[1]:
        return None
    return (after[0] - before[0]) / (after[1] - before[1]) * (os.cpu_count() or 1)


def choose_wait_policy() -> str | None:
    """Set OMP_WAIT_POLICY=PASSIVE when the machine is busy (or its load cannot be read), leave
    OpenMP's default spinning on an idle one, and say which (logged: a server's log tells what its
    threads do). Returns the policy set, None if the default stays or the user already chose.
    Only effective before torch (and its OpenMP runtime) is loaded."""
    if "OMP_WAIT_POLICY" in os.environ:
        log.info("OpenMP waits: %s (OMP_WAIT_POLICY)", os.environ["OMP_WAIT_POLICY"])
        return None
    busy = busy_cores()
    seen = "the load could not be read" if busy is None else f"other work kept {busy:.2f} cores busy"
    if busy is not None and busy < BUSY_CORES:
        log.info("OpenMP waits: default spins (%s)", seen)
        return None
    os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
    log.info("OpenMP waits: passive (%s)", seen)
    return "PASSIVE"


def setup_threads(requested: int | None) -> int:
    """Set torch's thread count to `requested` (None: torch's own choice, one per core, or
    OMP_NUM_THREADS). Returns the count in use. Every command calls it first, so it also keeps
    the process's freed memory (memory.py: large temporaries without page faults)."""
    import torch

    from .memory import keep_freed_memory

    keep_freed_memory()

    if requested is not None:
        torch.set_num_threads(requested)
    return torch.get_num_threads()
