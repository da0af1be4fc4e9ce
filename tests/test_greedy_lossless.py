"""Invariant 1: greedy output with any drafter == greedy output of the target alone, token for token."""

from __future__ import annotations

import copy

import pytest
import torch

from conftest import FAMILIES, build_hf, ours_from_hf, random_ids
from verispec.drafters import ModelDrafter, NgramDrafter
from verispec.drafters.hybrid import HybridDrafter
from verispec.engine import Engine, EngineConfig
from verispec.sampling import SamplingParams

pytestmark = pytest.mark.usefixtures("single_torch_thread")


def run(target, drafter_factory, prompts, k=4, max_tokens=24, max_batch=3, exact=False, per_request_k=None):
    cfg = EngineConfig(model="unused", drafter=None, draft_policy="fixed", num_draft_tokens=k, dtype="float32", max_batch_size=max_batch,
                       max_model_len=96, exact=exact)
    drafter = drafter_factory(target, max_batch, 96 + k + 1) if drafter_factory else None
    eng = Engine(target, None, cfg, drafter)
    sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    seqs = [eng.add_request(p, sp, None if per_request_k is None else per_request_k[i]) for i, p in enumerate(prompts)]
    while eng.has_work:
        eng.step()
    assert eng.cache.num_free == max_batch, "every KV slot is returned"
    return [s.output_ids for s in seqs], seqs


def prompts_for(vocab, lengths=(5, 11, 3, 17, 8)):
    # a repeated chunk inside each prompt gives the n-gram drafter something to find
    out = []
    for i, n in enumerate(lengths):
        ids = random_ids(n, vocab, seed=100 + i)[0].tolist()
        out.append(ids + ids[: max(2, n // 2)])
    return out


def noisy_copy(target, scale=0.3, seed=7):
    """A separate draft model: the target's weights plus noise, so it agrees often but not always."""
    draft = copy.deepcopy(target)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(torch.randn(p.shape, generator=g) * scale * p.std().nan_to_num(0.1))
    return draft


DRAFTERS = {
    "ngram": lambda t, b, L: NgramDrafter(max_n=3),
    "layerskip": lambda t, b, L: ModelDrafter(t, b, L, num_layers=t.config.num_layers - 1, name="layerskip"),
    "draft-model": lambda t, b, L: ModelDrafter(noisy_copy(t), b, L),
    "self-draft": lambda t, b, L: ModelDrafter(t, b, L),  # the target drafting for itself: everything accepted
    "hybrid": lambda t, b, L: HybridDrafter(ModelDrafter(noisy_copy(t), b, L), min_shared=2),
}

CASES = [(f, d) for f in FAMILIES for d in DRAFTERS]


@pytest.mark.parametrize("family,drafter", CASES)
def test_greedy_equals_plain(family, drafter):
    hf = build_hf(family)
    target = ours_from_hf(hf)
    prompts = prompts_for(hf.config.vocab_size)
    plain, _ = run(target, None, prompts)
    spec, seqs = run(target, DRAFTERS[drafter], prompts)
    assert spec == plain
    if drafter == "self-draft":  # all drafts accepted: exercises the bonus path every step
        for s in seqs:
            assert s.stats.accepted == s.stats.drafted > 0
    else:  # drafts were made and accepted (rejections are covered by test_stats_are_consistent)
        assert sum(s.stats.accepted for s in seqs) > 0


def test_plain_engine_matches_transformers_generate():
    """Our plain greedy decoding == transformers' greedy generate, for a batch of different prompt lengths."""
    for family in ("gemma3", "qwen3"):
        hf = build_hf(family)
        target = ours_from_hf(hf)
        prompts = prompts_for(hf.config.vocab_size, lengths=(4, 9))
        ours, _ = run(target, None, prompts, max_tokens=16)
        for p, o in zip(prompts, ours):
            ref = hf.generate(torch.tensor([p]), max_new_tokens=16, min_new_tokens=16, do_sample=False,
                              attention_mask=torch.ones(1, len(p), dtype=torch.long))
            assert ref[0, len(p):].tolist() == o


@pytest.mark.parametrize("k", [1, 2, 7])
def test_greedy_any_k_and_queueing(k):
    """More requests than KV slots (they queue), several draft lengths, per-request k overrides."""
    hf = build_hf("gemma3")
    target = ours_from_hf(hf)
    prompts = prompts_for(hf.config.vocab_size, lengths=(5, 11, 3, 17, 8, 6, 2))
    plain, _ = run(target, None, prompts, max_batch=2)
    spec, _ = run(target, DRAFTERS["layerskip"], prompts, k=k, max_batch=2,
                  per_request_k=[k, 0, 1, k, None, 2, k])
    assert spec == plain


def test_exact_mode_equals_plain_in_bf16():
    """In exact mode (and in bf16 decoding generally) a row's bits do not depend on the verify window."""
    hf = build_hf("gemma3")
    target = ours_from_hf(hf).to(torch.bfloat16)
    prompts = prompts_for(hf.config.vocab_size)
    plain, _ = run(target, None, prompts, exact=True)
    spec, _ = run(target, DRAFTERS["self-draft"], prompts, exact=True)
    assert spec == plain


@pytest.mark.parametrize("packed", [True, False])
def test_packed_and_padded_chains_equal_plain_in_bf16(packed):
    """Chains verify packed on the CPU (one entry per node, no padding to the longest window) and
    padded elsewhere; both give plain decoding's tokens and its logits' bits, with requests of
    different draft lengths side by side (k = 7, 0, 1, 3 per request, n-gram drafts of any length)."""
    hf = build_hf("gemma3")
    target = ours_from_hf(hf).to(torch.bfloat16)
    prompts = prompts_for(hf.config.vocab_size, lengths=(5, 11, 3, 17))

    def decode(drafter, ks):
        cfg = EngineConfig(model="unused", drafter=None, draft_policy="fixed", num_draft_tokens=7, dtype="bfloat16",
                           max_batch_size=4, max_model_len=96)
        eng = Engine(target, None, cfg, drafter(target, 4, 96 + 8) if drafter else None)
        eng.packs_chains = packed
        sp = SamplingParams(max_tokens=20, ignore_eos=True, logprobs=0)
        seqs = [eng.add_request(p, sp, k) for p, k in zip(prompts, ks)]
        while eng.has_work:
            eng.step()
        return seqs

    plain = decode(None, [None] * 4)
    for name in ("self-draft", "ngram"):
        spec = decode(DRAFTERS[name], [7, 0, 1, 3])
        assert [s.output_ids for s in spec] == [s.output_ids for s in plain]
        assert [[lp for _, lp, _ in s.logprobs] for s in spec] == [[lp for _, lp, _ in s.logprobs] for s in plain]
        assert sum(s.stats.accepted for s in spec) > 0


def test_exact_mode_cannot_drop_batch_invariance():
    with pytest.raises(ValueError, match="exact mode is batch-invariant"):
        EngineConfig(exact=True, batch_invariant=False)


def test_stats_are_consistent():
    hf = build_hf("llama")
    target = ours_from_hf(hf)
    prompts = prompts_for(hf.config.vocab_size)
    outs, seqs = run(target, DRAFTERS["draft-model"], prompts, k=3)
    for s, o in zip(seqs, outs):
        st = s.stats
        assert st.emitted == len(o) - 1  # the first token comes from prefill
        assert st.emitted == st.forwards + st.accepted
        assert sum(st.accepted_at) == st.accepted and sum(st.drafted_at) == st.drafted
        assert all(0 <= c <= 1 for c in st.acceptance_conditional)
        assert st.reached_at[0] == st.drafts
    assert 0 < sum(s.stats.accepted for s in seqs) < sum(s.stats.drafted for s in seqs)


def test_hybrid_uses_both_sources_and_stays_lossless():
    hf = build_hf("qwen3")
    target = ours_from_hf(hf)
    prompts = prompts_for(hf.config.vocab_size)
    plain, _ = run(target, None, prompts)
    made = []

    def factory(t, b, L):
        made.append(HybridDrafter(ModelDrafter(noisy_copy(t), b, L), min_shared=2))
        return made[-1]

    for tree_k in (4, 8):
        made.clear()
        spec, _ = run(target, factory, prompts, k=tree_k)
        assert spec == plain
        assert made[0].used["ngram"] > 0 and made[0].used["model"] > 0, made[0].used
