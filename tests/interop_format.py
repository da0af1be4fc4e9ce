"""The fingerprint of what `verispec export` writes for each drafter family that vLLM is run on:
the key paths of config.json (not their values) and the names of the saved tensors. The committed
vLLM interop results (benchmarks/results/vllm-interop) record it, so a change to the export format
makes them stale, and test_vllm_interop_results.py says to run the interop again."""

from __future__ import annotations

import hashlib
import json


def _paths(obj, prefix: str = "") -> list[str]:
    if isinstance(obj, dict):
        return sum((_paths(v, f"{prefix}.{k}" if prefix else k) for k, v in obj.items()), [prefix] if prefix else [])
    if isinstance(obj, list) and obj and isinstance(obj[0], dict):
        return sum((_paths(v, f"{prefix}[]") for v in obj), [])
    return [prefix]


def tiny_drafters() -> dict:
    """One small model of each exported family (shapes do not enter the fingerprint)."""
    from verispec.drafters.dflash import DFlashConfig, DFlashModel
    from verispec.drafters.dspark import DSparkConfig, DSparkModel
    from verispec.drafters.eagle3 import Eagle3Config, Eagle3Model
    from verispec.drafters.peagle import PEagleConfig, PEagleModel

    common = dict(hidden_size=32, vocab_size=40, draft_vocab_size=20, aux_layers=[0, 1, 2], num_heads=2, num_kv_heads=1,
                  head_dim=16, intermediate_size=32, num_layers=1)
    return {
        "eagle3": Eagle3Model(Eagle3Config(**common, fc_norm=True, norm_output=True)),
        "peagle": PEagleModel(PEagleConfig(**common)),
        "dflash": DFlashModel(DFlashConfig(**common, block_size=4)),
        "dspark": DSparkModel(DSparkConfig(**common, block_size=4, markov_rank=8)),
    }


def export_format() -> dict:
    """family -> 12 hex digits of sha256 over its sorted config.json key paths and tensor names."""
    out = {}
    for name, model in tiny_drafters().items():
        desc = {"config": sorted(set(_paths(model.config_json("bfloat16")))), "tensors": sorted(model.state_dict())}
        out[name] = hashlib.sha256(json.dumps(desc, sort_keys=True).encode()).hexdigest()[:12]
    return out
