"""Thread defaults for a shared machine (verispec/threads.py): passive OpenMP waits, set before
torch loads, and explicit choices always win."""

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


# libgomp's default spins 300000 times at a barrier; PASSIVE spins 0 times, ACTIVE 3e10 times
@pytest.mark.parametrize("env,spins", [({}, "0"), ({"OMP_WAIT_POLICY": "ACTIVE"}, "30000000000")])
def test_the_openmp_runtime_gets_passive_waits_from_the_cli(env, spins):
    """libgomp reads its wait policy once, when torch loads it; OMP_DISPLAY_ENV makes it print what
    it read. The command sets PASSIVE early enough, and a user's own policy wins."""
    e = {k: v for k, v in os.environ.items() if not k.startswith(("OMP_", "GOMP_"))} | env | {"OMP_DISPLAY_ENV": "VERBOSE"}
    code = "from verispec.cli import main; main(['generate', ''])"  # torch loads, then the empty prompt is refused
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=e, timeout=120)
    assert f"GOMP_SPINCOUNT = '{spins}'" in r.stderr, r.stderr
    assert "prompt 1 is empty" in r.stderr


def test_bench_keeps_openmps_default_waits():
    """On the idle machine a benchmark wants, passive waits cost every engine about half its speed
    (verispec plain 20.4 against 9.8 tok/s, llama.cpp plain 31.0 against 11.0, same command), so
    `bench` leaves libgomp's default spin count."""
    e = {k: v for k, v in os.environ.items() if not k.startswith(("OMP_", "GOMP_"))} | {"OMP_DISPLAY_ENV": "VERBOSE"}
    code = "from verispec.cli import main; main(['bench', '--datasets', 'nosuchset'])"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=e, timeout=120)
    assert "GOMP_SPINCOUNT = '300000'" in r.stderr, r.stderr
