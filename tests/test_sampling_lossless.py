"""Sampling with speculation is distributed exactly as sampling from the target alone.

The statistical proof, end to end through `Engine`: a tiny random target with a 5-token
vocabulary, one fixed prompt, and max_tokens = 4, so the exact distribution of the whole output
(5^4 = 625 outcomes) is a product of target conditionals that we enumerate with a reference
forward (transformers). N requests, each with its own seed, go through the engine with a drafter;
the total variation (TV) between the empirical joint distribution and the exact one must be
below a threshold derived from the null: TV of N samples drawn from the exact distribution
itself, simulated `NULL_REPS` times (threshold = largest null TV + 2 null standard deviations,
about 5 standard deviations above the null mean).

Drafters: a different draft model (the target's weights + 15% noise: ~58% acceptance), so q != p
and both accepted chains and rejections with residual resampling are frequent;
the n-gram drafter (one-hot q); layer-skip (the target's first layer).
Sampling settings: plain temperature 1, and temperature 0.8 + top-k 3 + top-p 0.9.

With max_tokens = 4 and num_draft_tokens = 3, every path of the acceptance rule lands inside the
4 tokens: token 1 comes from prefill, the first verify step drafts up to 2 tokens (accepted
drafts, the recovered token at positions 2-3, the bonus at position 4), and after an early
rejection a second step drafts 1 token (recovered or bonus at 3-4).

The check has teeth: with a deliberately wrong acceptor (resample from p instead of the residual
norm(max(0, p - q)), or accept every draft) the same check fails.
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
import time

import pytest
import torch


from conftest import build_hf, ours_from_hf
from verispec.distcheck import NullTV, exact_distribution, null_counts, tv
from verispec.drafters import ModelDrafter, NgramDrafter
from verispec.drafters.hybrid import HybridDrafter
from verispec.engine import Engine, EngineConfig
from verispec.sequence import SpecStats
from verispec.sampling import SamplingParams, probs, sample
from verispec.verify import Verdict
from verispec.verify.chain import ChainVerifier

pytestmark = pytest.mark.usefixtures("single_torch_thread")

V = 5  # vocabulary
M = 4  # generated tokens per request (the joint has V**M outcomes)
K = 3  # num_draft_tokens
PROMPT = [1, 3, 4, 3, 0, 3]  # repeats, so the n-gram drafter proposes from the start
N = 3500  # requests per distribution check (~45 s for the file on 2 cores)
NULL_REPS = 200
BATCH = 512
MAX_LEN = 16

PLAIN = SamplingParams(max_tokens=M, temperature=1.0, ignore_eos=True)
PROCESSED = SamplingParams(max_tokens=M, temperature=0.8, top_k=3, top_p=0.9, ignore_eos=True)
SETTINGS = {"plain": PLAIN, "processed": PROCESSED}


# --------------------------------------------------------------------------------------------
# models and the exact distribution


@pytest.fixture(scope="module")
def models():
    """(target_hf, target, draft): a 2-layer random Llama with V = 5 and a perturbed copy as draft model.

    The LM head and embeddings are scaled x2 so the next-token distributions are far from uniform
    and depend on the prefix (seed 3 chosen for a joint entropy of ~6 bits at T = 1 and a support
    of 26 outcomes with the processed setting, neither degenerate).
    """
    hf, draft_hf = target_and_draft_hf()
    return hf, ours_from_hf(hf), ours_from_hf(draft_hf)


def target_and_draft_hf():
    """The transformers target of `models` and its perturbed copy (also used by test_quant.py)."""
    hf = build_hf("llama", seed=3, vocab_size=V, num_hidden_layers=2)
    with torch.no_grad():
        hf.model.embed_tokens.weight.mul_(2.0)
        hf.lm_head.weight.mul_(2.0)
    draft_hf = copy.deepcopy(hf)
    g = torch.Generator().manual_seed(99)
    with torch.no_grad():
        for p in draft_hf.parameters():
            p.add_(torch.randn(p.shape, generator=g) * p.std() * 0.15)
    return hf, draft_hf


_EXACT: dict = {}


@torch.no_grad()
def exact_joint(hf, sp: SamplingParams) -> torch.Tensor:
    """P(output = x_1..x_M) for every x in V^M, flattened (x_1 most significant), float64.

    One transformers forward over prompt + every x_1..x_{M-1} gives all the conditionals
    p(x_t | prompt, x_<t); each is processed with `probs(., sp)` exactly as the engine does.
    """
    key = (id(hf), sp)
    if key in _EXACT:
        return _EXACT[key]
    conts = torch.tensor(list(itertools.product(range(V), repeat=M - 1)))  # [V^(M-1), M-1]
    ids = torch.cat([torch.tensor(PROMPT).expand(len(conts), -1), conts], 1)
    logits = hf(input_ids=ids, use_cache=False).logits.float()[:, len(PROMPT) - 1 :]  # [C, M, V]
    flat = logits.reshape(-1, V)
    _assert_filters_not_borderline(flat, sp)
    P = probs(flat, sp).reshape(len(conts), M, V).double()
    # outcome (c, x): x_1..x_{M-1} = c, x_M = x; its probability is prod_t P[c, t, outcome_t]
    outcome = torch.cat([conts[:, None].expand(-1, V, -1), torch.arange(V)[None, :, None].expand(len(conts), -1, 1)], 2)
    joint = P[:, None].expand(-1, V, -1, -1).gather(3, outcome[..., None])[..., 0].prod(-1).flatten()
    assert abs(joint.sum().item() - 1) < 1e-6
    _EXACT[key] = joint
    return joint


def _assert_filters_not_borderline(logits: torch.Tensor, sp: SamplingParams) -> None:
    """Our forward and transformers' agree to ~1e-5; no top-k / top-p decision may hinge on that."""
    x = logits / sp.temperature
    if sp.top_k is not None:
        s = x.sort(-1, descending=True).values
        assert (s[:, sp.top_k - 1] - s[:, sp.top_k]).min() > 1e-4
        x = x.masked_fill(x < s[:, sp.top_k - 1 : sp.top_k], float("-inf"))
    if sp.top_p < 1:
        sp_sorted = x.softmax(-1).sort(-1, descending=True).values
        before = sp_sorted.cumsum(-1) - sp_sorted
        assert (before - sp.top_p).abs().min() > 1e-4


def marginals(dist: torch.Tensor) -> list[torch.Tensor]:
    """Per-position marginals of a flattened V^M distribution (or [R, V^M] batch of counts)."""
    d = dist.reshape(*dist.shape[:-1], *([V] * M))
    lead = dist.dim() - 1
    return [d.sum(dim=tuple(lead + j for j in range(M) if j != t)) for t in range(M)]


_NULL: dict = {}


def null_thresholds(exact: torch.Tensor, n: int) -> dict:
    """TV thresholds from the null: NULL_REPS sets of n samples drawn from `exact` itself.

    Returns {"joint": (threshold, null_mean, null_max), "marginal": [(threshold, mean, max) per position]}.
    threshold = max null TV + 2 sd (the null TV is concentrated: ~5 sd above its mean).
    """
    key = (exact.data_ptr(), n)
    if key in _NULL:
        return _NULL[key]
    counts = null_counts(exact, n, NULL_REPS, seed=12345)

    def summary(c, e):
        nul = NullTV.of(tv(c, e))
        return (nul.threshold, nul.mean, nul.max)

    out = {
        "joint": summary(counts, exact),
        "marginal": [summary(c, e) for c, e in zip(marginals(counts), marginals(exact))],
    }
    _NULL[key] = out
    return out


def test_enumeration_matches_the_reference_joint(models):
    """distcheck.exact_distribution (our forward, enumerating only the support) equals the joint
    computed here from transformers' forward over every V^M outcome."""
    hf, target, _ = models
    for sp in SETTINGS.values():
        ref = exact_joint(hf, sp)
        ours = exact_distribution(target, PROMPT, sp, M)
        assert ours.borderline is None
        got = torch.zeros_like(ref)
        for o, pr in zip(ours.outcomes, ours.probs):
            got[sum(x * V ** (M - 1 - j) for j, x in enumerate(o))] = pr
        assert len(ours.outcomes) == int((ref > 0).sum())
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-4)


# --------------------------------------------------------------------------------------------
# running the engine


def make_drafter(kind: str, models):
    hf, target, draft = models
    if kind == "none":
        return None
    if kind == "ngram":
        return NgramDrafter()
    if kind == "draft":
        return ModelDrafter(draft, BATCH, MAX_LEN + K + 1)
    if kind == "layerskip":
        return ModelDrafter(target, BATCH, MAX_LEN + K + 1, num_layers=1)
    if kind == "hybrid":  # n-gram (one-hot q) after a 2-token match, the draft model (sampled q) elsewhere
        return HybridDrafter(ModelDrafter(draft, BATCH, MAX_LEN + K + 1), min_shared=2)
    raise ValueError(kind)


def new_engine(target, drafter, max_batch_size: int = BATCH) -> Engine:
    cfg = EngineConfig(model="unused", drafter=None, draft_policy="fixed", num_draft_tokens=K, dtype="float32",
                       max_batch_size=max_batch_size, max_model_len=MAX_LEN)
    return Engine(target, None, cfg, drafter=drafter)


def run_to_end(eng: Engine, seqs):
    while eng.has_work:
        eng.step()
    assert all(s.finished for s in seqs)
    return [s.output_ids for s in seqs]


def drafter_tv(hf, target, drafter, sp: SamplingParams, n: int, seed0: int = 1000, tree: str | None = None,
               k: int = K) -> tuple[float, float, list]:
    """n seeded requests through one engine with `drafter` (fixed k, optionally a tree shape) ->
    (TV of the joint against the exact one, the null threshold, the sequences). Checks that drafts
    were made and accepted, so the verdict is about speculation."""
    cfg = EngineConfig(model="unused", drafter=None, draft_policy="fixed", num_draft_tokens=k, draft_tree=tree,
                       dtype="float32", max_batch_size=BATCH, max_model_len=MAX_LEN)
    eng = Engine(target, None, cfg, drafter=drafter)
    seqs = [eng.add_request(PROMPT, dataclasses.replace(sp, seed=seed0 + i)) for i in range(n)]
    outs = run_to_end(eng, seqs)
    codes = torch.tensor([sum(x * V ** (M - 1 - j) for j, x in enumerate(o)) for o in outs])
    counts = torch.bincount(codes, minlength=V**M).double()
    exact = exact_joint(hf, sp)
    assert sum(s.stats.drafted for s in seqs) > 0 and sum(s.stats.accepted for s in seqs) > 0
    return tv(counts, exact), null_thresholds(exact, n)["joint"][0], seqs


def sample_outputs(models, kind: str, sp: SamplingParams, n: int, seed0: int):
    """n requests with seeds seed0.. through one engine -> (counts over V^M outcomes, merged stats)."""
    eng = new_engine(models[1], make_drafter(kind, models))
    seqs = [eng.add_request(PROMPT, dataclasses.replace(sp, seed=seed0 + i)) for i in range(n)]
    outs = run_to_end(eng, seqs)
    assert all(len(o) == M for o in outs)
    codes = torch.tensor([sum(x * V ** (M - 1 - j) for j, x in enumerate(o)) for o in outs])
    counts = torch.bincount(codes, minlength=V**M).double()
    stats = SpecStats()
    for s in seqs:
        stats.merge(s.stats)
    return counts, stats


def check(models, kind: str, setting: str, seed0: int):
    """-> (joint TV, joint threshold, per-position marginal TVs and thresholds, stats, seconds)."""
    sp = SETTINGS[setting]
    exact = exact_joint(models[0], sp)
    t0 = time.perf_counter()
    counts, stats = sample_outputs(models, kind, sp, N, seed0)
    seconds = time.perf_counter() - t0
    nul = null_thresholds(exact, N)
    joint = (tv(counts, exact).item(), nul["joint"])
    marg = [(tv(c, e).item(), th) for c, e, th in zip(marginals(counts), marginals(exact), nul["marginal"])]
    print(f"\n[{kind}/{setting}] N={N} {seconds:.1f}s  TV={joint[0]:.4f} threshold={joint[1][0]:.4f} "
          f"(null mean {joint[1][1]:.4f}, max {joint[1][2]:.4f}); marginal TVs "
          + ", ".join(f"{t:.4f}<{th[0]:.4f}" for t, th in marg)
          + f"; acceptance {stats.acceptance_rate:.3f} ({stats.accepted}/{stats.drafted}), tau {stats.tau:.3f}")
    return joint, marg, stats


# --------------------------------------------------------------------------------------------
# the distribution checks


CASES = [(kind, setting) for kind in ("none", "ngram", "draft", "layerskip") for setting in ("plain", "processed")]
CASES += [("hybrid", "plain")]


@pytest.mark.parametrize("kind,setting", CASES)
def test_sampled_output_distribution_is_the_targets(models, kind, setting):
    seed0 = 1_000_000 * (CASES.index((kind, setting)) + 1)
    (t, (thr, _, _)), marg, stats = check(models, kind, setting, seed0)
    # the run exercised what it claims to
    if kind == "none":
        assert stats.drafted == 0
    else:
        assert stats.drafted > N // 2, "the drafter proposed almost nothing"
        assert 0 < stats.accepted < stats.drafted, "need both accepted and rejected drafts"
        if (kind, setting) != ("ngram", "processed"):  # there the step-1 n-gram draft is outside top-k/top-p
            assert len(stats.accepted_at) >= 2 and stats.accepted_at[1] > 0, "no fully accepted 2-token draft (bonus path)"
    assert t < thr, f"TV {t:.4f} >= threshold {thr:.4f}: speculative sampling is not distributed as the target"
    for pos, (tm, (thm, _, _)) in enumerate(marg):
        assert tm < thm, f"position {pos + 1}: marginal TV {tm:.4f} >= threshold {thm:.4f}"


def _accept_resample_from_p(p, draft, q, gen):
    """WRONG on purpose: on rejection, resample from p instead of the residual norm(max(0, p - q))."""
    k = len(draft)
    n = 0
    for i, d in enumerate(draft):
        qd = 1.0 if q is None else float(q[i, d])
        if float(torch.rand(1, generator=gen)) * qd < float(p[i, d]):
            n += 1
        else:
            break
    return Verdict(draft[:n] + [sample(p[n], gen)], n, list(range(n))) if n < k else \
        Verdict(draft + [sample(p[k], gen)], k, list(range(k)))


def _accept_everything(p, draft, q, gen):
    """WRONG on purpose: every draft token is accepted (the drafter's distribution leaks through)."""
    return Verdict(list(draft) + [sample(p[len(draft)], gen)], len(draft), list(range(len(draft))))


@pytest.mark.parametrize("biased", [_accept_resample_from_p, _accept_everything], ids=["resample_from_p", "accept_all"])
def test_check_has_teeth(models, monkeypatch, biased):
    monkeypatch.setattr(ChainVerifier, "accept", lambda self, p, d, g: biased(p, d.tokens, d.q, g))
    (t, (thr, _, _)), _, stats = check(models, "draft", "plain", seed0=5_000_000)
    assert stats.drafted > 0
    assert t > thr, f"a biased acceptor passed the check (TV {t:.4f} <= threshold {thr:.4f}): the check has no teeth"


# --------------------------------------------------------------------------------------------
# seeds: reproducible, and independent of the batch


@pytest.mark.parametrize("kind", ["ngram", "draft", "layerskip"])
def test_same_seeds_same_outputs(models, kind):
    target = models[1]
    sp = dataclasses.replace(PROCESSED, max_tokens=9)
    prompts = [PROMPT, [2, 4, 1], [0, 0, 3, 1, 4]]

    def once():
        eng = new_engine(target, make_drafter(kind, models))
        seqs = [eng.add_request(prompts[i % 3], dataclasses.replace(sp if i % 2 else PLAIN, seed=100 + i, max_tokens=9))
                for i in range(48)]
        return run_to_end(eng, seqs)

    a, b = once(), once()
    assert a == b
    assert len({tuple(o) for o in a}) > 10  # the seeds do matter


@pytest.mark.parametrize("kind", ["none", "ngram", "draft", "layerskip"])
def test_seeded_output_independent_of_batch(models, kind):
    """A request's output depends on its seed only, not on who else is in the batch (per-request generator)."""
    target = models[1]
    probe_prompt, probe = [4, 1, 3, 3, 2], dataclasses.replace(PLAIN, max_tokens=10)
    seeds = [7, 8, 9]

    def alone(seed):
        eng = new_engine(target, make_drafter(kind, models))
        return run_to_end(eng, [eng.add_request(probe_prompt, dataclasses.replace(probe, seed=seed))])[0]

    ref = {s: alone(s) for s in seeds}
    # in a batch: other prompts and lengths, greedy and processed neighbours, before and after
    eng = new_engine(target, make_drafter(kind, models))
    g = torch.Generator().manual_seed(0)
    seqs, probes = [], {}
    for i in range(20):
        if i in (3, 10, 17):
            s = seeds[len(probes)]
            probes[s] = eng.add_request(probe_prompt, dataclasses.replace(probe, seed=s))
            seqs.append(probes[s])
        plen = int(torch.randint(1, 6, (1,), generator=g))
        other = [PLAIN, PROCESSED, SamplingParams(temperature=0.0)][i % 3]
        seqs.append(eng.add_request(torch.randint(0, V, (plen,), generator=g).tolist(),
                                    dataclasses.replace(other, seed=1000 + i, max_tokens=int(torch.randint(1, 10, (1,), generator=g)),
                                                        ignore_eos=True)))
    run_to_end(eng, seqs)
    assert {s: q.output_ids for s, q in probes.items()} == ref


def test_long_prompt_joining_late_with_model_drafter(models):
    """Continuous batching: a long prompt is admitted while another request is near its context end.

    The batched `propose` itself must not raise (an engine may catch drafter errors and retry
    request by request, which would hide the bug behind a slow path), so the drafter is spied on.
    """
    target = models[1]
    drafter = make_drafter("layerskip", models)
    errors = []
    propose = drafter.propose

    def spy(seqs, ks):
        try:
            return propose(seqs, ks)
        except Exception as e:
            errors.append(e)
            raise

    drafter.propose = spy
    eng = new_engine(target, drafter, max_batch_size=2)
    long_run = eng.add_request([1, 2], dataclasses.replace(PLAIN, seed=1, max_tokens=MAX_LEN - 2))
    while long_run.num_output < 8:  # 8..11 of 14 outputs: still drafting, drafter slot rows >= 9
        eng.step()
    late = eng.add_request([0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 0, 1], dataclasses.replace(PLAIN, seed=3, max_tokens=4))
    outs = run_to_end(eng, [long_run, late])
    if errors:
        raise errors[0]
    assert [len(o) for o in outs] == [MAX_LEN - 2, 4]
