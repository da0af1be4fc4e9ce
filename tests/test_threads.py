"""Thread defaults for a shared machine (verispec/threads.py): one thread per idle core, passive
OpenMP waits set before torch loads, and explicit choices always win."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from verispec import threads as T


@pytest.mark.parametrize("cores,idle,want", [(2, 2.0, 2), (2, 1.6, 2), (2, 1.2, 1), (2, 0.9, 1), (2, 0.05, 1),
                                             (8, 3.4, 3), (8, 11.0, 8), (4, None, 4)])
def test_choose_threads(cores, idle, want):
    assert T.choose_threads(cores, idle) == want


def test_idle_cpus_sees_a_busy_core():
    n = len(os.sched_getaffinity(0))
    idle = T.idle_cpus(0.2)
    assert idle is not None and 0.0 <= idle <= n + 1e-6
    busy = subprocess.Popen([sys.executable, "-c", "while 1: pass"])
    try:
        loaded = T.idle_cpus(0.5)
    finally:
        busy.kill()
        busy.wait()
    assert loaded <= n - 0.7  # the busy loop holds most of one core


def test_explicit_threads_and_omp_num_threads_win(monkeypatch):
    before = torch.get_num_threads()
    try:
        monkeypatch.setattr(T, "idle_cpus", lambda *a: 0.0)
        assert T.setup_threads(2) == 2
        monkeypatch.setenv("OMP_NUM_THREADS", "2")
        assert T.setup_threads(None) == 2  # not lowered to the 1 that 0 idle cores would give
        monkeypatch.delenv("OMP_NUM_THREADS")
        assert T.setup_threads(None) == 1
    finally:
        torch.set_num_threads(before)


CHILD = """
import os, sys
import verispec.cli as cli
torch_loaded = []
setup = cli.prefer_passive_waits
cli.prefer_passive_waits = lambda: (torch_loaded.append("torch" in sys.modules), setup())
rc = cli.main(["generate", ""])  # refused (empty prompt) after main's setup
print(rc, os.environ.get("OMP_WAIT_POLICY"), torch_loaded)
"""


@pytest.mark.parametrize("env,want", [({}, "PASSIVE"), ({"OMP_WAIT_POLICY": "ACTIVE"}, "ACTIVE")])
def test_cli_asks_for_passive_waits_before_torch_loads(env, want):
    e = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"} | env
    r = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, env=e, timeout=120)
    assert r.stdout.split() == ["2", want, "[False]"], r.stderr  # set once, before torch was imported
