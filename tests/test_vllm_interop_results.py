"""The committed vLLM interop results (benchmarks/results/vllm-interop/results.json, written by
benchmarks/run_vllm_interop.sh from tests/test_vllm_interop.py) hold for the export format as it is
now: CI machines have no vLLM, so this is what every CI run checks of issue 13's promise that vLLM
serves verispec's drafters with verispec's outputs and acceptance."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from interop_format import export_format

RESULTS = Path(__file__).resolve().parent.parent / "benchmarks" / "results" / "vllm-interop" / "results.json"
SLACK = 0.03  # per position, the bound
CASES = ("eagle3-llama", "eagle3-qwen3", "peagle", "dflash", "dspark")


@pytest.fixture(scope="module")
def results() -> dict:
    assert RESULTS.is_file(), f"{RESULTS} is missing: run benchmarks/run_vllm_interop.sh"
    return json.loads(RESULTS.read_text())


def test_results_were_measured_on_the_current_export_format(results):
    now = export_format()
    stale = {k: (results["export_format"].get(k), v) for k, v in now.items() if results["export_format"].get(k) != v}
    assert not stale, (f"the export format changed since {RESULTS} was measured (recorded, now: {stale}); rerun "
                       "benchmarks/run_vllm_interop.sh and commit its results")


@pytest.mark.parametrize("case", CASES)
def test_vllm_serves_each_family_with_verispecs_outputs_and_acceptance(results, case):
    r = results["cases"].get(case)
    assert r is not None, f"{case} is not in {RESULTS}; rerun benchmarks/run_vllm_interop.sh"
    if case == "dspark":  # vLLM's CPU build does not serve DSpark: its own error is the result
        assert "does not support: dspark" in r["refused"]
        return
    assert r["identical"] == r["prompts"] >= 8
    assert min(r["acceptance_verispec"]) > 0 and r["acceptance_verispec"][0] > 0.3  # a drafter that works
    assert all(abs(a - b) <= SLACK for a, b in zip(r["acceptance_verispec"], r["acceptance_vllm"])), r
    if case.startswith("eagle3"):
        assert r["requests_alike"] == r["prompts"] and r["drafts"][0] == r["drafts"][1]


def test_the_fingerprint_follows_the_export_format(monkeypatch):
    """A new config.json field or a renamed tensor changes the fingerprint (values do not)."""
    from verispec.drafters.eagle3 import Eagle3Config

    before = export_format()
    to_speculators = Eagle3Config.to_speculators
    monkeypatch.setattr(Eagle3Config, "to_speculators", lambda self, dtype="bfloat16": {**to_speculators(self, dtype), "new_field": 1})
    after = export_format()
    assert after["eagle3"] != before["eagle3"] and after["dflash"] == before["dflash"]
    monkeypatch.setattr(Eagle3Config, "to_speculators", lambda self, dtype="bfloat16": {**to_speculators(self, dtype), "draft_vocab_size": 7})
    assert export_format()["eagle3"] == before["eagle3"]
