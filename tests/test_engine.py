"""Continuous batching: requests join and leave at any step, long prompts are prefilled in chunks
beside running decodes, a failing drafter degrades one request to plain decoding, aborts free
their KV slot at once."""

from __future__ import annotations

import pytest
import torch

from conftest import build_hf, ours_from_hf, random_ids
from verispec.drafters import Draft, ModelDrafter, NgramDrafter
from verispec.engine import Engine, EngineConfig
from verispec.sampling import SamplingParams

pytestmark = pytest.mark.usefixtures("single_torch_thread")


@pytest.fixture(scope="module")
def target():
    return ours_from_hf(build_hf("qwen3"))


def engine(target, drafter=None, **kw):
    cfg = EngineConfig(model="unused", drafter=None, draft_policy="fixed", num_draft_tokens=4, dtype="float32",
                       **{"max_batch_size": 4, "max_model_len": 128, **kw})
    return Engine(target, None, cfg, drafter)


def alone(target, prompt, sp):
    eng = engine(target)
    s = eng.add_request(prompt, sp)
    while eng.has_work:
        eng.step()
    return s.output_ids


def test_long_prompt_is_chunked_beside_running_decodes(target):
    sp = SamplingParams(max_tokens=20, ignore_eos=True)
    short = random_ids(5, 160, seed=1)[0].tolist()
    long = random_ids(60, 160, seed=2)[0].tolist()
    eng = engine(target, NgramDrafter(), prefill_chunk=8)
    a = eng.add_request(short, sp)
    eng.step()  # a is prefilled and decoding
    b = eng.add_request(long, sp)
    progress = []
    while b.num_output == 0:
        before = a.num_output
        eng.step()
        progress.append(a.num_output - before)
    assert len(progress) >= 60 // 8  # b took several steps of prefill ...
    assert all(p > 0 for p in progress[:-1] if not a.finished)  # ... and a kept decoding during them
    while eng.has_work:
        eng.step()
    assert a.output_ids == alone(target, short, sp) and b.output_ids == alone(target, long, sp)


class FlakyDrafter(NgramDrafter):
    """Raises whenever the batch contains the request it is allergic to."""

    def __init__(self, bad_id):
        super().__init__()
        self.bad_id = bad_id

    def propose(self, seqs, ks):
        if any(s.id == self.bad_id for s in seqs):
            raise RuntimeError("drafter bug")
        return super().propose(seqs, ks)


def test_drafter_failure_falls_back_to_plain_for_that_request_only(target):
    sp = SamplingParams(max_tokens=16, ignore_eos=True)
    prompts = [random_ids(6, 160, seed=i)[0].tolist() * 2 for i in range(3)]
    eng = engine(target, FlakyDrafter(bad_id=1))
    seqs = [eng.add_request(p, sp) for p in prompts]
    while eng.has_work:
        eng.step()
    assert [s.output_ids for s in seqs] == [alone(target, p, sp) for p in prompts]
    assert eng.drafter_errors == 1
    assert seqs[1].stats.drafts == 0 and seqs[1].num_draft_tokens == 0
    assert seqs[0].stats.drafts > 0 and seqs[2].stats.drafts > 0


def test_abort_frees_the_slot_and_admits_the_next(target):
    sp = SamplingParams(max_tokens=30, ignore_eos=True)
    eng = engine(target, ModelDrafter(target, 1, 128 + 5, num_layers=1), max_batch_size=1)
    a = eng.add_request([5, 6, 7], sp)
    b = eng.add_request([8, 9], sp)
    eng.step()
    assert eng.cache.num_free == 0 and b in eng.waiting
    eng.abort(a)
    assert a.finish_reason == "abort" and eng.cache.num_free == 1
    eng.step()
    assert b.slot >= 0 and b.num_output >= 1
    while eng.has_work:
        eng.step()
    assert b.output_ids == alone(target, [8, 9], sp)


def test_logprobs_are_the_targets(target):
    sp = SamplingParams(max_tokens=6, ignore_eos=True, logprobs=3)
    prompt = [3, 4, 5, 6]
    eng = engine(target, NgramDrafter())
    s = eng.add_request(prompt, sp)
    while eng.has_work:
        eng.step()
    ids = torch.tensor([prompt + s.output_ids])
    with torch.inference_mode():
        ref = target(ids, target.new_cache(1, 16), [0], torch.tensor([0])).logits[0].log_softmax(-1)
    for i, (tok, lp, top) in enumerate(s.logprobs):
        row = ref[len(prompt) - 1 + i]
        assert tok == s.output_ids[i] and lp == pytest.approx(float(row[tok]), abs=1e-4)
        assert len(top) == 3 and max(top.values()) == pytest.approx(float(row.max()), abs=1e-4)


def test_request_that_cannot_fit_is_refused_not_crashed(target):
    eng = engine(target, max_model_len=32)
    with pytest.raises(Exception, match="exceeds the context of 32 tokens"):
        eng.add_request(list(range(3, 30)), SamplingParams(max_tokens=10))
    assert not eng.has_work


def test_short_draft_and_stop_tokens_inside_accepted_run(target):
    """A stop token inside an accepted run ends the request there; nothing after it is kept."""
    sp = SamplingParams(max_tokens=30, ignore_eos=True)
    prompt = [7, 8, 9, 7, 8]
    ref = alone(target, prompt, sp)
    stop = ref[5]
    eng = engine(target, ModelDrafter(target, 4, 128 + 5))  # self-drafting: whole runs accepted
    s = eng.add_request(prompt, SamplingParams(max_tokens=30, ignore_eos=True, stop_token_ids=(stop,)))
    while eng.has_work:
        eng.step()
    assert s.output_ids == ref[: ref.index(stop) + 1] and s.finish_reason == "stop"


def test_drafts_longer_than_asked_are_cut(target):
    class Greedy(NgramDrafter):
        def propose(self, seqs, ks):
            return [Draft([3] * (k + 5)) for k in ks]

    sp = SamplingParams(max_tokens=12, ignore_eos=True)
    eng = engine(target, Greedy())
    s = eng.add_request([4, 5, 6], sp)
    while eng.has_work:
        eng.step()
    assert s.output_ids == alone(target, [4, 5, 6], sp)
    assert len(s.stats.drafted_at) == 4  # cut to k = 4 draft positions


def test_kv_memory_budget_is_enforced_up_front(target):
    from verispec.kv import CacheFullError

    with pytest.raises(CacheFullError, match="over the budget of 1 MiB"):
        engine(target, max_batch_size=64, kv_cache_mb=1)
    eng = engine(target, max_batch_size=2, kv_cache_mb=64)  # fits
    total = sum(t.numel() * t.element_size() for t in (*eng.cache.k, *eng.cache.v))
    assert total <= 64 * 2**20


class TapRecorder(NgramDrafter):
    """The n-gram drafter, also keeping every target hidden state the engine hands it."""

    target_taps = (0, -1)

    def __init__(self):
        super().__init__()
        self.seen: dict[int, dict[int, list[torch.Tensor]]] = {}

    def on_commit(self, seq, start, hidden):
        super().on_commit(seq, start, hidden)
        for tap, h in hidden.items():
            self.seen.setdefault(seq.id, {}).setdefault(tap, []).append(h.clone())


@pytest.mark.parametrize("family", ["gemma3", "qwen3"])
@pytest.mark.parametrize("riding", [False, True])
def test_packed_prefill_of_several_prompts_has_one_prompts_bits(family, riding):
    """Prompts admitted together are prefilled in one packed forward (several prompts' chunks, one
    cut across two steps), or, where requests are decoding already, ride in their verify forward:
    every token, every logprob of the first token and every hidden state the drafter receives must
    equal a prefill of that prompt alone, in bf16."""
    target = ours_from_hf(build_hf(family)).to(torch.bfloat16)
    prompts = [random_ids(n, 160, seed=n)[0].tolist() for n in (23, 9, 14, 40)]
    sp = SamplingParams(max_tokens=12, ignore_eos=True, logprobs=3)

    def run(ps, chunk, first=None):
        rec = TapRecorder()
        cfg = EngineConfig(model="unused", drafter=None, draft_policy="fixed", num_draft_tokens=3, dtype="bfloat16",
                           max_batch_size=5, max_model_len=128, prefill_chunk=chunk)
        eng = Engine(target, None, cfg, rec)
        if first is not None:  # decoding before the others arrive
            eng.add_request(first, sp)
            eng.step()
            eng.step()
        seqs = [eng.add_request(p, sp) for p in ps]
        decoding = [s.num_output for s in eng.running]
        eng.step()
        started = sum(s.num_output > 0 for s in seqs)
        assert all(s.num_output > n for s, n in zip(eng.running, decoding))  # the running ones decoded meanwhile
        while eng.has_work:
            eng.step()
        return seqs, rec, started

    # 23 + 9 + 14 in one forward, then 18 of the 40, then the rest
    seqs, rec, started = run(prompts, 64, random_ids(7, 160, seed=99)[0].tolist() if riding else None)
    assert started == 3
    for p, s in zip(prompts, seqs):
        [a], arec, _ = run([p], 4096)
        assert s.output_ids == a.output_ids
        assert s.logprobs[0] == a.logprobs[0]
        for tap in (0, -1):  # the prompt's rows, in whatever pieces they came
            got = torch.cat([h for h in rec.seen[s.id][tap]])[: len(p)]
            want = torch.cat([h for h in arec.seen[a.id][tap]])[: len(p)]
            assert torch.equal(got, want), tap
