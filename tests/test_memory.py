"""keep_freed_memory: a process that frees a large temporary gets the same pages back next time,
without the kernel's page faults (memory.py). Counted in fresh processes (the setting is
process-wide): minor page faults while allocating and filling a 67 MB tensor, the fp32 LM head
output of a 64-request step, after the allocator has settled."""

import os
import subprocess
import sys

import pytest

SCRIPT = """
import resource, sys, threading, torch
if sys.argv[1] == "keep":
    from verispec.memory import keep_freed_memory
    assert keep_freed_memory()
def cycle():
    x = torch.empty(64, 262144, dtype=torch.float32)
    x.fill_(1.0)
    del x
def faults():
    for _ in range(10):
        cycle()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(3):
        cycle()
    print((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 3)
if sys.argv[2] == "thread":  # as the server's engine thread allocates
    t = threading.Thread(target=faults)
    t.start()
    t.join()
else:
    faults()
"""


def faults_per_cycle(mode: str, where: str) -> float:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    out = subprocess.run([sys.executable, "-c", SCRIPT, mode, where], capture_output=True, text=True, env=env, check=True)
    return float(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
@pytest.mark.parametrize("where", ["main", "thread"])
def test_kept_memory_is_reused_without_page_faults(where):
    kept, default = faults_per_cycle("keep", where), faults_per_cycle("default", where)
    assert kept < 100, kept  # the same heap pages every time
    assert default > 10 * max(kept, 1), (kept, default)  # the control: fresh pages, faulted in every time


def test_the_users_malloc_settings_win(monkeypatch):
    from verispec.memory import keep_freed_memory

    monkeypatch.setenv("MALLOC_TRIM_THRESHOLD_", "131072")
    assert keep_freed_memory() is False
