"""CPU threads for the commands, on a machine that other work may share.

torch runs one OpenMP thread per core. Decoding a small model is a long series of short parallel
regions, each ending in a barrier, and by default a thread that reaches the barrier first spins
for a while. When other processes hold the cores, the spinning threads burn the time slices the
late thread needs, and every barrier waits for a thread that has no core: on 2 cores with 2 busy
processes, plain decoding ran at 0.51 tok/s with 2 threads against 0.80 with one (issue 14).

The commands therefore ask OpenMP to sleep at barriers instead (OMP_WAIT_POLICY=PASSIVE). Then
all cores remain the better choice even when the machine is busy, since the scheduler gives each
thread its share: 1.12 tok/s with 2 threads against 0.81 with one, in the same run
(README.md, "Threads on a shared machine", has the measurements). The policy must be set before
torch is imported; the commands do it first thing. An explicit --threads, OMP_NUM_THREADS or
OMP_WAIT_POLICY always wins. The Python API leaves both to the caller, whose process it is.
"""

from __future__ import annotations

import os


def prefer_passive_waits() -> None:
    """OpenMP threads sleep at barriers instead of spinning (unless the user chose a policy).
    Only effective before torch (and its OpenMP runtime) is loaded."""
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def setup_threads(requested: int | None) -> int:
    """Set torch's thread count to `requested` (None: torch's own choice, one per core, or
    OMP_NUM_THREADS). Returns the count in use."""
    import torch

    if requested is not None:
        torch.set_num_threads(requested)
    return torch.get_num_threads()
