"""Thread defaults for a shared machine (verispec/threads.py): passive OpenMP waits where other
work keeps the cores busy, OpenMP's default spins on an idle machine, set before torch loads, and
explicit choices always win."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from verispec import threads as T


def test_explicit_threads_win_and_none_keeps_torchs_count():
    before = torch.get_num_threads()
    try:
        assert T.setup_threads(1) == 1 == torch.get_num_threads()
        assert T.setup_threads(None) == 1  # None changes nothing
    finally:
        torch.set_num_threads(before)


def _cli_spincount(env: dict, times: list) -> tuple[str, str]:
    """The spin count libgomp read in a `verispec generate` process (OMP_DISPLAY_ENV makes it print
    what it read), with /proc/stat's readings replaced by `times` (successive (busy, total))."""
    e = {k: v for k, v in os.environ.items() if not k.startswith(("OMP_", "GOMP_"))} | env | {"OMP_DISPLAY_ENV": "VERBOSE"}
    code = ("import os, verispec.threads as T\n"
            "os.cpu_count = lambda: 2\n"  # the readings mean the same cores busy on any machine
            f"readings = iter({times!r})\n"
            "T.read_cpu_times = lambda: next(readings)\n"
            "from verispec.cli import main; main(['generate', ''])")  # torch loads, then the empty prompt is refused
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=e, timeout=120)
    assert "prompt 1 is empty" in r.stderr, r.stderr
    spins = next(ln for ln in r.stderr.splitlines() if "GOMP_SPINCOUNT" in ln)
    return spins.split("'")[1], r.stderr


# libgomp's default spins 300000 times at a barrier; PASSIVE spins 0 times, ACTIVE 3e10 times.
# /proc/stat readings (busy, total jiffies over all cores): over the probe, other work kept 90% of
# every core busy (BUSY: 1.8 of 2 cores), or 2% (IDLE: 0.04 of 2).
BUSY, IDLE = [(1000, 5000), (1090, 5100)], [(1000, 5000), (1002, 5100)]


@pytest.mark.parametrize("env,times,spins", [
    ({}, BUSY, "0"), ({}, IDLE, "300000"), ({}, [None, None], "0"),
    ({"OMP_WAIT_POLICY": "ACTIVE"}, BUSY, "30000000000"), ({"OMP_WAIT_POLICY": "PASSIVE"}, IDLE, "0"),
])
def test_the_cli_waits_passively_only_on_a_busy_machine(env, times, spins):
    """The command sets PASSIVE early enough when others keep the cores busy or the load cannot be
    read, keeps libgomp's default spins on an idle machine, and a user's own policy wins."""
    got, err = _cli_spincount(env, times)
    assert got == spins, err


def test_the_probe_counts_the_cores_others_keep_busy(monkeypatch):
    monkeypatch.setattr(T.os, "cpu_count", lambda: 2)
    for times, cores in [(BUSY, 1.8), (IDLE, 0.04)]:
        readings = iter(times)
        monkeypatch.setattr(T, "read_cpu_times", lambda: next(readings))
        assert T.busy_cores(0) == pytest.approx(cores)
    monkeypatch.setattr(T, "read_cpu_times", lambda: None)
    assert T.busy_cores(0) is None


def test_the_real_proc_stat_reads_as_busy_and_total_jiffies():
    if not os.path.exists("/proc/stat"):
        pytest.skip("no /proc/stat here")
    busy, total = T.read_cpu_times()
    assert 0 <= busy <= total
    assert 0 <= T.busy_cores(0.05) <= os.cpu_count()


def test_bench_keeps_openmps_default_waits():
    """On the idle machine a benchmark wants, passive waits cost every engine about half its speed
    (verispec plain 20.4 against 9.8 tok/s, llama.cpp plain 31.0 against 11.0, same command), so
    `bench` leaves libgomp's default spin count."""
    e = {k: v for k, v in os.environ.items() if not k.startswith(("OMP_", "GOMP_"))} | {"OMP_DISPLAY_ENV": "VERBOSE"}
    code = "from verispec.cli import main; main(['bench', '--datasets', 'nosuchset'])"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=e, timeout=120)
    assert "GOMP_SPINCOUNT = '300000'" in r.stderr, r.stderr
