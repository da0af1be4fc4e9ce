"""The vLLM peer's pieces that do not need vLLM: the speculative configs it asks vLLM for, the
statistics it derives from vLLM's counters, the environment vLLM's CPU documentation asks for, and
what happens without vLLM's venv. With the venv (benchmarks/vllm_env.sh), a slow test runs vLLM
on a tiny Llama and checks its greedy output against verispec's."""

from __future__ import annotations

import json

import pytest
import torch

from verispec.bench import vllm_peer as V


def test_speculative_configs(tmp_path):
    assert V.speculative_config("vllm", 5, []) is None
    assert V.speculative_config("vllm-ngram", 5, []) == {"method": "ngram", "num_speculative_tokens": 5,
                                                         "prompt_lookup_max": 3, "prompt_lookup_min": 1}
    assert V.speculative_config("vllm-ngram:7", 5, [])["num_speculative_tokens"] == 7
    d = tmp_path / "head"
    assert V.speculative_config("vllm-eagle3", 4, [str(d)]) == {"method": "eagle3", "model": str(d.resolve()),
                                                                "num_speculative_tokens": 4}
    assert V.speculative_config(f"vllm-eagle3:{d}", 4, ["other"])["model"] == str(d.resolve())
    with pytest.raises(ValueError, match="needs a drafter folder"):
        V.speculative_config("vllm-eagle3", 4, [])


def _reply(drafts, draft_tokens, accepted, per_pos, steps=11, tokens=20, first=1):
    return {"tokens": list(range(tokens)), "steps": steps, "first_tokens": first,
            "spec": {"drafts": drafts, "draft_tokens": draft_tokens, "accepted": accepted, "accepted_per_pos": per_pos}}


def test_spec_stats_from_vllm_counters():
    st = V.spec_stats(_reply(10, 30, 9, [5, 3, 1]))
    assert (st.forwards, st.emitted) == (10, 19)  # the prefill step and its first token are not counted
    assert st.tau == pytest.approx(1.9) and st.acceptance_rate == pytest.approx(0.3)
    assert st.acceptance_unconditional == pytest.approx([0.5, 0.3, 0.1])
    # every draft had 3 tokens: position k was reached by the drafts that accepted k - 1 tokens
    assert st.acceptance_conditional == pytest.approx([5 / 10, 3 / 5, 1 / 3])
    short = V.spec_stats(_reply(10, 25, 9, [5, 3, 1]))  # some drafts were shorter: reach unknown
    assert short.acceptance_unconditional == pytest.approx([0.5, 0.3, 0.1]) and short.acceptance_conditional == []


def test_runtime_env_follows_vllms_cpu_documentation(tmp_path, monkeypatch):
    venv = tmp_path / "venv"
    (venv / "lib").mkdir(parents=True)
    (venv / "lib" / "libiomp5.so").write_bytes(b"")
    tc = tmp_path / "libtcmalloc_minimal.so.4"
    tc.write_bytes(b"")
    monkeypatch.setenv("VERISPEC_VLLM_VENV", str(venv))
    monkeypatch.setattr(V, "TCMALLOC", (str(tmp_path / "absent.so"), str(tc)))
    cores = sorted(__import__("os").sched_getaffinity(0))
    env = V.runtime_env(2, base={"LD_PRELOAD": "/x/libfoo.so"})
    assert env["LD_PRELOAD"] == f"{tc}:/x/libfoo.so:{venv}/lib/libiomp5.so"  # TCMalloc first, Intel OpenMP
    bind = cores[:2]
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == ",".join(map(str, bind)) and env["VLLM_CPU_KVCACHE_SPACE"] == "1"
    # one process, its Intel OpenMP threads bound as vLLM binds them in its multi-process path
    assert env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0" and env["OMP_NUM_THREADS"] == str(len(bind))
    assert env["KMP_AFFINITY"] == f"granularity=fine,explicit,proclist=[{','.join(map(str, bind))}]"
    assert V.cpu_ids("0-2,5") == [0, 1, 2, 5] and V.cpu_ids("3") == [3]
    # what the user set is kept, and nothing is preloaded twice
    mine = {"LD_PRELOAD": f"/opt/libtcmalloc.so:/opt/libiomp5.so", "VLLM_CPU_OMP_THREADS_BIND": "0",
            "VLLM_CPU_KVCACHE_SPACE": "8"}
    env = V.runtime_env(2, base=mine)
    assert {k: env[k] for k in mine} == mine


def test_root_cause_is_the_workers_own_error():
    log = "\n".join([
        "(EngineCore pid=7) INFO 11-30 23:44:01 [core.py:133] Initializing a V1 LLM engine (v0.32.0)",
        "(Worker pid=9) ERROR 11-30 23:44:05 [multiproc_executor.py:953] Traceback (most recent call last):",
        "(Worker pid=9) ERROR 11-30 23:44:05 [multiproc_executor.py:953] RuntimeError: Model does not support EAGLE3 "
        "interface but aux_hidden_state_outputs was requested",
        "(EngineCore pid=7) ERROR 11-30 23:44:08 [core.py:1510] Exception: WorkerProc initialization failed due to "
        "an exception in a background process. See stack trace for root cause.",
        "RuntimeError: Engine core initialization failed. See root cause above."])
    assert V.root_cause(log) == ("RuntimeError: Model does not support EAGLE3 interface but aux_hidden_state_outputs "
                                 "was requested")
    assert V.root_cause("all fine\n") is None


def test_without_vllms_venv_the_peer_is_skipped_with_a_note(tmp_path, monkeypatch):
    monkeypatch.setenv("VERISPEC_VLLM_VENV", str(tmp_path / "none"))
    notes = []
    assert V.vllm_methods(tmp_path, ["vllm", "vllm-ngram"], 5, "bfloat16", 64, 1, [], notes) == []
    assert "vLLM skipped" in notes[0] and "benchmarks/vllm_env.sh" in notes[0]
    with pytest.raises(V.VllmError, match="does not exist; create it with bash benchmarks/vllm_env.sh"):
        V.VllmWorker(tmp_path, "bfloat16", 64, 1)


def test_a_worker_that_dies_is_reported_with_its_last_words(tmp_path, monkeypatch):
    """A stand-in interpreter that fails like a vLLM start: the error carries its last log lines."""
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    py = venv / "bin" / "python"
    py.write_text("#!/bin/sh\necho 'ValueError: Model does not support EAGLE3 interface' >&2\nexit 1\n")
    py.chmod(0o755)
    monkeypatch.setenv("VERISPEC_VLLM_VENV", str(venv))
    notes = []
    methods = V.vllm_methods(tmp_path, ["vllm-eagle3:x"], 3, "bf16", 64, 1, [], notes)
    assert methods == []
    assert "plain decoding failed to start" in notes[-1] and "does not support EAGLE3 interface" in notes[-1]


# ---- with vLLM itself ----------------------------------------------------------------------------
needs_vllm = pytest.mark.skipif(V.venv_python() is None,
                                reason=f"vLLM's venv {V.venv_dir()} is absent (bash benchmarks/vllm_env.sh makes it)")


def tiny_llama_folder(path):
    """A random Llama small enough to start in vLLM in seconds (head_dim 64: vLLM's CPU attention)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from conftest import _randomize

    cfg = LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=64, max_position_embeddings=512,
                      bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False)
    torch.manual_seed(0)
    hf = LlamaForCausalLM(cfg)
    _randomize(hf, 0)
    hf.save_pretrained(str(path))
    return hf


@pytest.mark.slow
@needs_vllm
def test_vllm_greedy_equals_verispec_on_a_tiny_llama(tmp_path):
    from verispec.engine import Engine, EngineConfig
    from verispec.models import load_model
    from verispec.sampling import SamplingParams

    tiny_llama_folder(tmp_path / "llama")
    prompts = [[1, 5, 9, 33, 7, 5, 9, 33], [1, 200, 17, 17, 42, 99, 3]]
    ours = load_model(str(tmp_path / "llama"), dtype=torch.float32)
    eng = Engine(ours, None, EngineConfig(max_batch_size=1, max_model_len=128))
    want = []
    for ids in prompts:
        s = eng.add_request(ids, SamplingParams(max_tokens=24, ignore_eos=True))
        while eng.has_work:
            eng.step()
        want.append(s.output_ids)
    for spec in (None, {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}):
        w = V.VllmWorker(tmp_path / "llama", "float32", 128, 1, spec,
                         llm_kwargs={"skip_tokenizer_init": True, "enforce_eager": True})
        try:
            got = [w.generate(ids, 24) for ids in prompts]
        finally:
            w.close()
        assert [g["tokens"] for g in got] == want, json.dumps(spec)
        assert all(g["steps"] >= 1 and g["seconds"] > 0 for g in got)
