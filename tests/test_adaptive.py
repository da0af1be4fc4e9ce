"""Adaptive verification: the estimator, the planners, the cost profile, and losslessness.

- The estimator recovers known slopes and intercepts from synthetic censored data.
- The planner's window is optimal on small synthetic tables (brute force over every admissible
  set), and the greedy planner never admits a node because of what was drawn at or after it.
- The cost profile is monotone, cached, and measured again only when too short.
- Greedy output with the adaptive policy is the target's; sampled output is distributed as the
  target's (tests/test_sampling_lossless.py's exact check), and the same check catches a policy
  that admits a node by looking at its own token.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import random

import pytest
import torch

from conftest import build_hf, ours_from_hf
from verispec.adaptive import costs as C
from verispec.adaptive.costs import CostProfile, load_or_measure
from verispec.adaptive.estimator import AcceptanceEstimator
from verispec.adaptive.policy import AdaptiveDraftLength
from verispec.adaptive.planner import (argmax, best_width, budget_throughput, first_peak, keep, keep_best,
                                      plan_greedy, ranked_survival, throughput)
from verispec.adaptive.policy import observations
from verispec.adaptive.realized import RealizedGain
from verispec.drafters import Draft, ModelDrafter, NgramDrafter
from verispec.engine import Engine, EngineConfig
from verispec.sampling import SamplingParams
from verispec.verify import Verdict

import test_sampling_lossless as T
from test_sampling_lossless import models  # noqa: F401  (the fixture: tiny target, draft model)

pytestmark = pytest.mark.usefixtures("single_torch_thread")


# ---- estimator --------------------------------------------------------------------------------
def test_estimator_recovers_known_slope_and_intercepts():
    w_true, b_true = 1.3, [2.0, 0.6, -0.4, -1.0]
    est = AcceptanceEstimator(max_depth=4, refit_every=1)
    g = torch.Generator().manual_seed(0)
    for _ in range(40):  # 40 refits, each on a fresh window of 3000 observations
        d = torch.randint(0, 4, (3000,), generator=g)
        f = torch.randn(3000, generator=g, dtype=torch.float64) * 1.5
        p = torch.sigmoid(w_true * f + torch.tensor(b_true, dtype=torch.float64)[d])
        y = (torch.rand(3000, generator=g, dtype=torch.float64) < p).int()
        est.observe(f[:, None].tolist(), (d + 1).tolist(), y.tolist(), p.tolist())
        est.end_step()
    co = est.coefficients()
    assert abs(co["slope"][0] - w_true) < 0.08, co
    for b, t in zip(co["intercepts"], b_true):
        assert abs(b - t) < 0.12, co


def test_estimator_starts_near_uniform_and_intercepts_alone_learn_depth():
    est = AcceptanceEstimator(max_depth=3, refit_every=1)
    assert est.predict(None, [1, 2, 3]) == pytest.approx([0.5] * 3, abs=1e-9)
    rng = random.Random(1)
    truth = [0.9, 0.5, 0.2]
    for _ in range(30):
        depths = [rng.randint(1, 3) for _ in range(2000)]
        labels = [int(rng.random() < truth[d - 1]) for d in depths]
        est.observe(None, depths, labels, [0.5] * len(depths))
        est.end_step()
    assert est.predict(None, [1, 2, 3]) == pytest.approx(truth, abs=0.04)


def test_separable_windows_move_the_fit_in_bounds_and_it_comes_back():
    """A window of long n-gram matches, all accepted where the fit says 1%, then one all rejected:
    a bare Newton step divides by curvature ~0 (an intercept went -5 -> +20 -> -61000)."""
    est = AcceptanceEstimator(max_depth=2, refit_every=1)
    est.w, est.b = torch.tensor([1.0], dtype=torch.float64), torch.tensor([-5.0, -5.0], dtype=torch.float64)
    before = est.coefficients()
    est.observe([[0.5]] * 64, [1] * 64, [1] * 64, [0.01] * 64)
    est.end_step()
    after = est.coefficients()
    assert after["intercepts"][0] - before["intercepts"][0] == pytest.approx(3.0)  # moved up, by MAX_STEP at most
    assert after["intercepts"][1] == before["intercepts"][1]  # no data at depth 2: it holds still
    for _ in range(10):  # all accepted again and again: bounded, still a probability below 1
        est.observe([[0.5]] * 64, [1] * 64, [1] * 64, [0.5] * 64)
        est.end_step()
    co = est.coefficients()
    assert max(abs(b) for b in co["intercepts"]) <= 8.0 and 0.0 <= co["slope"][0] <= 8.0
    assert est.predict([[0.5]], [1])[0] > 0.99
    for _ in range(3):  # then all rejected: it turns round, in steps
        est.observe([[0.5]] * 64, [1] * 64, [0] * 64, [0.99] * 64)
        est.end_step()
    assert est.predict([[0.5]], [1])[0] < 0.5
    rng = random.Random(3)
    for _ in range(20):  # and recovers the truth from ordinary data
        f = [rng.gauss(0, 1) for _ in range(1000)]
        y = [int(rng.random() < 1 / (1 + math.exp(-(0.8 * x + 0.5)))) for x in f]
        est.observe([[x] for x in f], [1] * 1000, y, [0.5] * 1000)
        est.end_step()
    co = est.coefficients()
    assert co["slope"][0] == pytest.approx(0.8, abs=0.15) and co["intercepts"][0] == pytest.approx(0.5, abs=0.15)


def test_predict_many_is_predict_per_draft():
    est = AcceptanceEstimator(max_depth=3)
    est.w, est.b = torch.tensor([0.7, -0.2], dtype=torch.float64), torch.tensor([1.0, 0.0, -1.0], dtype=torch.float64)
    feats = [[[0.1, 2.0], [1.5, 0.0]], None, [[3.0, 1.0]], [[0.0, 0.0], [1.0, 1.0], [2.0, 2.0]]]
    depths = [[1, 2], [], [1], [1, 2, 3]]
    assert est.predict_many(feats, depths) == [est.predict(f, d) for f, d in zip(feats, depths)]
    no_feats = AcceptanceEstimator(max_depth=3)
    assert no_feats.predict_many([None, None], [[1, 2], [1]]) == [no_feats.predict(None, [1, 2]), no_feats.predict(None, [1])]


def test_first_refits_come_after_32_64_128_observations_then_every_512():
    est = AcceptanceEstimator(max_depth=2, refit_every=10**6)
    refit_at, seen = [], 0
    for _ in range(300):  # 8 observations a step
        est.observe(None, [1] * 8, [1, 0] * 4, [0.5] * 8)
        seen += 8
        before = est.refits
        est.end_step()
        if est.refits > before:
            refit_at.append(seen)
    assert refit_at[:7] == [32, 96, 224, 480, 992, 1504, 2016]  # windows of 32, 64, 128, 256, 512, 512, 512
    assert est.predict(None, [1])[0] == pytest.approx(0.5, abs=0.05)  # and they learn: half accepted


def test_censored_observations_of_chains_and_trees():
    # chain of 4, 2 accepted: nodes 0, 1 accepted, node 2 rejected, node 3 never verified
    d = Draft([5, 6, 7, 8])
    assert observations(d, Verdict([5, 6, 9], 2, [0, 1])) == ([0, 1, 2], [1, 1, 0])
    assert observations(d, Verdict([1], 0, [])) == ([0], [0])
    # tree: root children 0, 1, 2; node 3 child of 0; node 4 child of 1; node 5 child of 3
    t = Draft([1, 2, 3, 4, 5, 6], parents=[-1, -1, -1, 0, 1, 3])
    # node 1 accepted (0 rejected before it), then node 4 rejected: 2 is not observed (a sibling
    # was accepted first), 3 and 5 are not (their parent 0 was rejected)
    assert observations(t, Verdict([2, 9], 1, [1])) == ([0, 1, 4], [0, 1, 0])


# ---- planner ----------------------------------------------------------------------------------
def _random_tree(rng, n):
    parents = []
    for i in range(n):
        parents.append(rng.randint(-1, i - 1))
    return parents


def _valid_subsets(parents, n):
    """Every set of nodes that holds each member's parent and earlier siblings."""
    out = []
    for mask in range(1 << n):
        s = {i for i in range(n) if mask >> i & 1}
        ok = True
        for i in s:
            p = parents[i] if parents is not None else i - 1
            if p >= 0 and p not in s:
                ok = False
            sibs = [j for j in range(i) if (parents[j] if parents is not None else j - 1) == p]
            if any(j not in s for j in sibs):
                ok = False
        if ok:
            out.append(s)
    return out


def _theta(survival, sets, draft_s, cost):
    N = len(survival)
    W = max((len(s) for s in sets), default=0)
    return (N + sum(survival[r][i] for r, s in enumerate(sets) for i in s)) / (draft_s + cost(W))


def by_window(survival, token_cost):
    """The planners' cost of window W for this batch from a cost by tokens: the forward carries N (1 + W)."""
    return lambda W: token_cost(len(survival) * (1 + W))


@pytest.mark.parametrize("shape", ["chain", "tree"])
def test_planner_window_is_optimal_by_brute_force(shape):
    rng = random.Random(7 if shape == "chain" else 8)
    for case in range(60):
        R = rng.randint(1, 3)
        parents = [None if shape == "chain" else _random_tree(rng, n)
                   for n in [rng.randint(0, 4) for _ in range(R)]]
        sizes = [len(p) if p is not None else rng.randint(0, 4) for p in parents]
        conf = [[rng.random() for _ in range(n)] for n in sizes]
        surv = [ranked_survival(c, p) for c, p in zip(conf, parents)]
        grid = sorted(rng.sample(range(1, 20), 5))
        prof = CostProfile(grid, C.monotone([rng.uniform(0.01, 0.1) * (1 + g / rng.uniform(2, 10)) for g in grid]))
        draft_s = rng.uniform(0, 0.05)
        cost = by_window(surv, prof.verify_cost)
        best = max(_theta(surv, combo, draft_s, cost)
                   for combo in itertools.product(*[_valid_subsets(p, n) for p, n in zip(parents, sizes)]))
        W = best_width(surv, draft_s, cost)
        sets = [set(k) for k in keep(surv, W)]
        for s, p, n in zip(sets, parents, sizes):  # what the window keeps is admissible
            assert s in _valid_subsets(p, n)
        assert _theta(surv, sets, draft_s, cost) == pytest.approx(best, rel=1e-12), case
        assert throughput(surv, draft_s, cost)[W] == pytest.approx(best, rel=1e-12)


def test_packed_budget_is_optimal_by_brute_force():
    """Packed chains: a step's cost depends on how many nodes it verifies, not where they are.
    The best budget of `budget_throughput`, filled by `keep_best`, is the best admissible set of
    nodes across the batch, found by trying every combination."""
    rng = random.Random(9)
    for case in range(60):
        R = rng.randint(1, 3)
        parents = [_random_tree(rng, rng.randint(0, 4)) if rng.random() < 0.3 else None for _ in range(R)]
        sizes = [len(p) if p is not None else rng.randint(0, 4) for p in parents]
        surv = [ranked_survival([rng.random() for _ in range(n)], p) for p, n in zip(parents, sizes)]
        grid = sorted(rng.sample(range(1, 20), 5))
        prof = CostProfile(grid, C.monotone([rng.uniform(0.01, 0.1) * (1 + g / rng.uniform(2, 10)) for g in grid]))
        draft_s = rng.uniform(0, 0.05)
        cost = lambda m: [prof.verify_cost(R + B) for B in range(m + 1)]  # noqa: E731
        best = max((R + sum(surv[r][i] for r, s in enumerate(combo) for i in s)) / (draft_s + prof.verify_cost(R + sum(map(len, combo))))
                   for combo in itertools.product(*[_valid_subsets(p, n) for p, n in zip(parents, sizes)]))
        theta = budget_throughput(surv, draft_s, cost)
        B = argmax(theta)
        kept = keep_best(surv, B)
        for k, p, n in zip(kept, parents, sizes):
            assert set(k) in _valid_subsets(p, n)
        assert sum(map(len, kept)) == B
        assert theta[B] == pytest.approx(best, rel=1e-12), case


def test_packed_greedy_admission_never_depends_on_a_node_or_what_was_drawn_after_it():
    rng = random.Random(12)
    cost = CostProfile([1, 4, 8, 16, 32], [0.05, 0.06, 0.09, 0.15, 0.3]).verify_cost
    for _ in range(300):
        R = rng.randint(1, 3)
        sizes = [rng.randint(1, 5) for _ in range(R)]
        conf = [[rng.random() for _ in range(n)] for n in sizes]
        r = rng.randrange(R)
        i = rng.randrange(sizes[r])
        changed = [list(c) for c in conf]
        for j in range(i + 1, sizes[r]):  # a chain's descendants: the later positions
            changed[r][j] = rng.random()
        admitted = []
        for cc in (conf, changed):
            surv = [ranked_survival(c, None) for c in cc]
            theta = budget_throughput(surv, 0.0, lambda m: [cost(R + B) for B in range(m + 1)])
            admitted.append(i in keep_best(surv, first_peak(theta))[r])
        assert admitted[0] == admitted[1]


def test_greedy_planner_equals_the_optimum_when_cost_is_affine():
    rng = random.Random(3)
    for _ in range(200):
        surv = [ranked_survival([rng.random() for _ in range(rng.randint(0, 6))], None) for _ in range(rng.randint(1, 5))]
        a, b = rng.uniform(0.01, 0.1), rng.uniform(0.0001, 0.01)
        cost = by_window(surv, lambda n: a + b * n)
        assert plan_greedy(surv, 0.01, cost) == best_width(surv, 0.01, cost)


def _descendants(parents, i):
    out, frontier = set(), {i}
    while frontier:
        frontier = {j for j, p in enumerate(parents) if p in frontier}
        out |= frontier
    return out


def test_greedy_admission_never_depends_on_a_node_or_what_was_drawn_after_it():
    """Changing the confidences of a node's descendants (drawn after it, possibly conditioned on its
    token) never changes whether the node is admitted by the greedy planner. The argmax planner has
    no such guarantee (the counterexample below), which is why adaptive-topb uses last step's window."""
    rng = random.Random(11)
    cost = CostProfile([1, 4, 8, 16, 32], [0.05, 0.06, 0.09, 0.15, 0.3]).verify_cost
    for _ in range(300):
        R = rng.randint(1, 3)
        parents = [_random_tree(rng, rng.randint(1, 5)) if rng.random() < 0.5 else None for _ in range(R)]
        sizes = [len(p) if p is not None else rng.randint(1, 5) for p in parents]
        conf = [[rng.random() for _ in range(n)] for n in sizes]
        r = rng.randrange(R)
        i = rng.randrange(sizes[r])
        par = parents[r] if parents[r] is not None else [j - 1 for j in range(sizes[r])]
        later = _descendants(par, i)
        changed = [list(c) for c in conf]
        for j in later:
            changed[r][j] = rng.random()
        admitted = []
        for cc in (conf, changed):
            surv = [ranked_survival(c, p) for c, p in zip(cc, parents)]
            admitted.append(i in keep(surv, plan_greedy(surv, 0.0, by_window(surv, cost)))[r])
        assert admitted[0] == admitted[1], "greedy admission of a node changed with its descendants' confidences"
    # the argmax does look ahead: node 0 is admitted only because its descendants are likely
    flat = CostProfile([1, 2, 6], [1.0, 1.5, 1.5]).verify_cost
    sure, unsure = [ranked_survival([0.4, 1, 1, 1, 1], None)], [ranked_survival([0.4, 0, 0, 0, 0], None)]
    flat = by_window(sure, flat)
    assert best_width(sure, 0.0, flat) == 5 and best_width(unsure, 0.0, flat) == 0
    assert plan_greedy(sure, 0.0, flat) == plan_greedy(unsure, 0.0, flat) == 0


@pytest.mark.parametrize("planner", ["greedy", "topb"])
@pytest.mark.parametrize("case", ["greedy request", "deterministic draft", "sampled draft"])
def test_policy_takes_the_best_window_now_when_nothing_was_drawn_at_random(planner, case):
    """The counterexample's shape in the policy: a window of 1 does not pay, one of 5 does. Where no
    admission rule can change the output (a greedy request, a deterministic draft), both planners
    take the best window by this step's survivals; a draft drawn at random for a sampled request
    keeps the early stop (greedy) or last step's window (topb: the same survivals each step)."""
    from verispec.sequence import Sequence

    policy = AdaptiveDraftLength(CostProfile([1, 2, 6], [1.0, 1.5, 1.5]), planner, max_depth=5)
    policy.step_cost.record = lambda *a, **kw: None
    policy.estimator.b = torch.tensor([logit_(0.4), 8.0, 8.0, 8.0, 8.0], dtype=torch.float64)
    params = SamplingParams(max_tokens=64) if case == "greedy request" else SamplingParams(max_tokens=64, temperature=1.0)
    seq = Sequence(0, [1, 2, 3], params, torch.Generator())
    q = None if case != "sampled draft" else torch.full((5, 8), 1 / 8)
    for step in range(2):
        policy.budgets([seq], 5)
        out = policy.admit([seq], [Draft([4, 5, 6, 7, 1], q=q)], 0.0)
        width = len(out[0].tokens)
        if case == "sampled draft" and planner == "greedy":
            assert width == step  # the early stop at 0, then a probe step's 1
        else:
            assert width == 5, (case, planner, step)
        policy.observe([seq], out, [Verdict([4], 0, [])])


@pytest.mark.parametrize("packed", [True, False])
def test_packed_chains_verify_the_batchs_best_nodes_wherever_they_are(packed):
    """Two requests, one confident draft and one hopeless: packed, the step verifies the confident
    request's nodes alone and pays for 2 + 2 tokens; padded, a window of 2 would cost 2 x 3 tokens
    (steep past 4), so it takes a window of 1, the hopeless request's first node in it too."""
    from verispec.sequence import Sequence

    policy = AdaptiveDraftLength(CostProfile([1, 2, 3, 4, 6], [1.0, 1.1, 1.2, 1.3, 9.0]), max_depth=2)
    policy.packed_chains = packed
    policy.step_cost.record = lambda *a, **kw: None
    policy.estimator.w, policy.estimator.b = torch.tensor([1.0], dtype=torch.float64), torch.zeros(2, dtype=torch.float64)
    seqs = [Sequence(i, [1, 2, 3], SamplingParams(max_tokens=64), torch.Generator()) for i in range(2)]
    policy.budgets(seqs, 2)
    sure, hopeless = Draft([4, 5], features=[[8.0], [8.0]]), Draft([6, 7], features=[[-8.0], [-8.0]])
    out = policy.admit(seqs, [sure, hopeless], 0.0)
    if packed:
        assert [d.tokens for d in out] == [[4, 5], []]
        assert policy._verify_started[1:3] == (4, 4)  # forward tokens, LM head rows
    else:
        assert [d.tokens for d in out] == [[4], [6]]
        assert policy._verify_started[1:3] == (4, 4)


def _plan_two_sure_drafts(profile: CostProfile, riding: int):
    """Two requests, each a sure 1-node draft, `riding` prompt tokens (one prompt ending) in the
    forward: the nodes kept and the step's (forward tokens, LM head rows) as it will be timed."""
    from verispec.sequence import Sequence

    policy = AdaptiveDraftLength(profile, max_depth=2)
    policy.estimator.w, policy.estimator.b = torch.tensor([1.0], dtype=torch.float64), torch.zeros(2, dtype=torch.float64)
    seqs = [Sequence(i, [1, 2, 3], SamplingParams(max_tokens=64), torch.Generator()) for i in range(2)]
    policy.budgets(seqs, 1)
    if riding:
        policy.riders(riding, 1)
    out = policy.admit(seqs, [Draft([4], features=[[8.0]]), Draft([5], features=[[8.0]])], 0.0)
    return [d.tokens for d in out], policy._verify_started[1:3]


def test_a_plan_is_priced_by_what_it_adds_to_the_forward_the_prompt_tokens_ride_in():
    """Two requests with sure drafts on a machine where 2 more tokens triple a 2-token forward but
    add 4% to a 20-token one: alone, plain decoding is cheaper; with 18 prompt tokens riding in
    the forward (engine._decode_step calls `riders` before `admit`), the 2 nodes add 0.2 s to a
    step whose decoding costs 1 s, and verifying them pays. The riders' own 4 s are not the
    plan's: priced in, they would make any plan look cheap. The step is timed at the forward's
    real size: 2 + 2 + 18 tokens, 2 + 2 + 1 head rows."""
    profile = CostProfile([1, 2, 4, 20, 22], [1.0, 1.0, 3.0, 5.0, 5.2])
    assert _plan_two_sure_drafts(profile, 0) == ([[], []], (2, 2))
    assert _plan_two_sure_drafts(profile, 18) == ([[4], [5]], (22, 5))


def test_the_riders_own_cost_does_not_pay_for_a_plan():
    """The same two sure drafts where 2 more tokens cost as much at 20 tokens as at 2 (a linear
    machine): plain decoding wins with riders as without them. (With the riders' 4 s counted as
    the plan's base, theta(2) = 4 / 7 would beat theta(0) = 2 / 5.)"""
    profile = CostProfile([1, 2, 4, 20, 22], [1.0, 1.0, 3.0, 5.0, 7.0])
    assert _plan_two_sure_drafts(profile, 0)[0] == [[], []]
    assert _plan_two_sure_drafts(profile, 18)[0] == [[], []]


def logit_(p):
    return math.log(p) - math.log1p(-p)


# ---- cost profile -----------------------------------------------------------------------------
def test_cost_profile_is_monotone_cached_and_extended(tmp_path, monkeypatch):
    monkeypatch.setenv("VERISPEC_CACHE", str(tmp_path))
    target = ours_from_hf(build_hf("llama", seed=0))
    calls = []
    real = C.measure

    def counting(model, max_tokens, max_batch, **kw):
        calls.append(max_tokens)
        return real(model, max_tokens, max_batch, repeats=2)

    monkeypatch.setattr(C, "measure", counting)
    p1 = load_or_measure(target, 12, 4)
    assert calls == [64]  # at least 64, so small engines share one profile
    assert p1.tokens[0] == 1 and p1.tokens[-1] == 64
    assert all(a <= b for a, b in zip(p1.seconds, p1.seconds[1:]))
    assert all(p1.verify_cost(n) <= p1.verify_cost(n + 1) for n in range(1, 80))
    p2 = load_or_measure(target, 40, 4)  # from the cache
    assert calls == [64] and p2.seconds == p1.seconds
    load_or_measure(target, 100, 4)  # too short: measured again, further
    assert calls == [64, 100]
    path = C.profile_path(C.profile_key(target))
    assert json.loads(path.read_text())["tokens"][-1] == 100
    path.write_text("{not json")  # a damaged cache is measured again, not trusted
    load_or_measure(target, 10, 4)
    assert calls == [64, 100, 64]
    with pytest.raises(ValueError, match="not a verispec cost profile"):
        CostProfile.from_dict({"format": "x"})


def test_a_carried_policy_reaches_the_forwards_of_its_new_engine(tmp_path, monkeypatch):
    """A load sweep hands one adaptive policy from engine to engine up the levels: its cost profile
    must reach each engine's largest forward (every request's root and k nodes, and a prompt chunk
    riding along), not stay the 64 tokens it was measured to at one stream; the step times it has
    seen stay, a smaller engine measures nothing, and a caller's own profile is never replaced.
    Each engine loads (or measures) the profile as it starts, not in a request's first step."""
    from verispec.engine import profile_tokens

    monkeypatch.setenv("VERISPEC_CACHE", str(tmp_path))
    target = ours_from_hf(build_hf("llama", seed=0))
    calls = []
    real = C.measure
    monkeypatch.setattr(C, "measure", lambda model, n, b, **kw: calls.append(n) or real(model, n, b, repeats=1))

    def config(max_batch):
        return EngineConfig(model="unused", drafter=None, num_draft_tokens=4, dtype="float32", max_batch_size=max_batch,
                            max_model_len=64)

    def engine(max_batch, policy=None):
        return Engine(target, None, config(max_batch), NgramDrafter(), policy=policy)

    assert [profile_tokens(config(b)) for b in (1, 2, 8)] == [8, 512, 512]
    assert profile_tokens(dataclasses.replace(config(1), max_batch_size=64, num_draft_tokens=7)) == 1024
    policy = engine(1).policy
    assert calls == [64]  # as the engine started, at least 64 tokens (load_or_measure)
    assert policy.step_cost.profile.tokens[-1] == 64
    policy.step_cost.record(10, 0.5)
    engine(8, policy)
    assert calls == [64, 512]  # as the engine started
    assert policy.step_cost.profile.tokens[-1] == 512
    assert 10 in policy.step_cost.seen  # the times seen stay
    engine(2, policy)  # reaches no further: nothing measured, the same profile
    assert policy.step_cost.profile.tokens[-1] == 512 and calls == [64, 512]
    given = AdaptiveDraftLength(CostProfile([1, 64], [1.0, 64.0]))
    engine(8, given)
    assert given.profile.tokens == [1, 64] and calls == [64, 512]


def test_cost_profile_interpolates_and_forces_monotone():
    p = CostProfile.from_dict({"format": C.FORMAT, "tokens": [1, 3, 5], "seconds": [1.0, 0.5, 2.0]})
    assert p.seconds == [1.0, 1.0, 2.0]
    assert p.verify_cost(4) == pytest.approx(1.5)
    assert p.verify_cost(7) == pytest.approx(3.0)  # linear past the last point
    assert C.token_grid(20) == [1, 2, 3, 4, 6, 8, 12, 16, 20]


def test_step_cost_prefers_what_the_engine_measured_and_follows_the_profile_past_it():
    prof = CostProfile([1, 4, 8, 16, 32], [1.0, 1.0, 2.0, 4.0, 8.0])
    sc = C.StepCost(prof, window=4)
    assert sc.table(4, 2) == [1.0, 2.0, 3.0]  # nothing seen: the profile at 4 x (1 + window) tokens
    sc.record(4, 3.0)  # seen once: not trusted yet
    assert sc(4) == 1.0
    for s in (2.0, 100.0):  # 4 tokens seen 3 times: their median, 3.0
        sc.record(4, s)
    assert sc(4) == 3.0
    # one count seen: past it the profile's shape from there (x 3), below it the shape, capped
    assert sc.table(4, 2) == pytest.approx([3.0, 6.0, 9.0])
    assert sc(2) == pytest.approx(3.0)
    sc.record(16, 9.0), sc.record(16, 9.0)
    assert sc(16) == 9.0 and sc(10) == pytest.approx(3.0 + 6.0 * 6 / 12)  # between seen counts: linear
    assert sc(32) == pytest.approx(18.0)  # past the last seen count: the profile's shape (9 x 8 / 4)
    sc.record(8, 5.0), sc.record(8, 5.0)
    sc.record(12, 1.0), sc.record(12, 1.0)  # a wider window never reads cheaper than a narrower one
    assert sc.table(4, 2) == pytest.approx([3.0, 5.0, 5.0])
    for _ in range(4):
        sc.record(4, 1.0)  # only the last `window` steps count
    assert sc(4) == 1.0


def test_step_cost_prices_the_lm_head_by_the_rows_it_is_given():
    """The engine runs the LM head on the real rows only: a step's time, less the profile's head
    cost for its rows, is the body's cost at its token count; a window is priced at the body of the
    padded forward plus the head over the rows the window admits."""
    prof = CostProfile([1, 4, 16], [1.0, 2.0, 8.0], head_tokens=[1, 4, 16], head_seconds=[0.5, 1.0, 4.0])
    assert prof.body_cost(16) == pytest.approx(4.0) and prof.head_cost(10) == pytest.approx(2.5)
    sc = C.StepCost(prof)
    for _ in range(2):
        sc.record(16, 5.0, head_rows=7)  # 4 requests at window 3, one of them drafting: head(7) = 1.75
    assert sc.seen[16][0][1] == pytest.approx(3.25)  # (step, seconds less the head)
    # window 3 at 4 requests, all four drafting (16 head rows) or one (7): body 3.25 + head
    assert sc.table(4, 3, [4, 7, 10, 16])[3] == pytest.approx(3.25 + 4.0)
    assert sc.table(4, 3, [4, 5, 6, 7])[3] == pytest.approx(3.25 + 1.75)
    d = CostProfile.from_dict(json.loads(json.dumps(prof.to_dict())))
    assert d.head_tokens == [1, 4, 16] and d.head_seconds == [0.5, 1.0, 4.0]


def test_step_cost_at_a_seen_batch_size_and_window_is_what_those_steps_cost():
    """16 tokens as 4 requests at window 3 and as 2 at window 7 cost what each really cost; 8
    requests at window 1 (never seen) read the token count's median over both."""
    sc = C.StepCost(CostProfile([1, 64], [1.0, 64.0]))
    for _ in range(2):
        sc.record(16, 3.0, num_reqs=4), sc.record(16, 5.0, num_reqs=2)
    assert sc.table(4, 3)[3] == pytest.approx(3.0) and sc.table(2, 7)[7] == pytest.approx(5.0)
    assert sc.table(8, 1)[1] == pytest.approx(4.0)


def test_a_started_tile_costs_a_whole_one():
    """On AMX (granule 16) a forward of 65 tokens costs what 80 do, past the first tile; within it,
    the measured line; unseen counts are priced at whole tiles from a seen one; the granule is kept."""
    prof = CostProfile([1, 16, 64, 128], [1.0, 2.0, 4.0, 8.0], granule=16)
    assert prof.verify_cost(65) == prof.verify_cost(80) == pytest.approx(5.0)
    assert prof.verify_cost(8) == pytest.approx(1.0 + 7 / 15)
    assert CostProfile([1, 16, 64, 128], [1.0, 2.0, 4.0, 8.0]).verify_cost(65) == pytest.approx(4.0625)
    sc = C.StepCost(prof)
    for _ in range(2):
        sc.record(64, 3.0, num_reqs=64)
    assert sc.costs(64, [70])[0] == pytest.approx(3.0 * 5.0 / 4.0)
    assert CostProfile.from_dict(json.loads(json.dumps(prof.to_dict()))).granule == 16


def test_step_cost_forgets_a_bin_nobody_chose_for_a_while():
    """Two slow early steps at 24 tokens price that bin at their median; once FORGET_AFTER later
    steps have passed without it, it is priced from its fresher neighbours again (the line
    between 16 and 32 tokens), and a fresh step there counts once more."""
    sc = C.StepCost(CostProfile([1, 64], [1.0, 64.0]))
    sc.record(24, 9.0, num_reqs=16), sc.record(24, 8.0, num_reqs=16)
    for _ in range(2):
        sc.record(16, 2.0, num_reqs=16), sc.record(32, 4.0, num_reqs=16)
    assert sc.costs(16, [24])[0] == pytest.approx(8.5)  # the bin's own median (the profile has no head cost)
    for i in range(C.StepCost.FORGET_AFTER):
        sc.record(16 if i % 2 else 32, 2.0 if i % 2 else 4.0, num_reqs=16)
    assert sc.costs(16, [24])[0] == pytest.approx(3.0), "the early outliers still price the bin"
    sc.record(24, 3.5, num_reqs=16)
    line = sc._line(16)  # the fresh step joined the line through this batch size's steps (16 and 32 tokens)
    assert line(16, 24, 24) == pytest.approx(3.0, abs=0.02)
    assert sc.costs(16, [24])[0] == pytest.approx(line(16, 24, 24)), "one fresh step is not yet a price"
    sc.record(24, 3.5, num_reqs=16)
    assert sc.costs(16, [24])[0] == pytest.approx(3.5)


def test_step_cost_prices_counts_unseen_at_a_batch_size_by_the_line_through_its_steps():
    """64 requests, each forward a different size once (plans vary): body = 0.3 + 0.005 (T - 64)
    plus noise. Other batch sizes saw cheaper forwards of those sizes, and the profile is flat; an
    unseen count still costs the line through this batch size's own steps, a count seen twice here
    its median, and past the widest seen here never less than the profile's shape says."""
    prof = CostProfile([1, 64, 128, 512], [0.1, 0.3, 0.32, 0.4])
    sc = C.StepCost(prof)
    for t in (96, 112, 128):  # 32 requests: 0.1 s whatever the count
        sc.record(t, 0.1, num_reqs=32), sc.record(t, 0.1, num_reqs=32)
    noise = [0.004, -0.003, 0.002, -0.004, 0.001, 0.003, -0.002, -0.001]
    for j, t in enumerate(range(64, 104, 5)):
        sc.record(t, 0.3 + 0.005 * (t - 64) + noise[j], num_reqs=64)
    line = sc._line(64)
    assert line.a == pytest.approx(0.3, abs=0.005) and line.b_row == pytest.approx(0.005, rel=0.1)
    assert sc.costs(64, [90])[0] == pytest.approx(line(64, 90, 90))  # unseen here, within what was seen
    assert sc.costs(32, [100])[0] == pytest.approx(0.1)  # 32 requests: too few steps for a line
    sc.record(90, 0.2, num_reqs=64), sc.record(90, 0.2, num_reqs=64)
    assert sc.costs(64, [90])[0] == pytest.approx(0.2)  # seen twice here: its own median
    line = sc._line(64)  # the two steps at 90 joined it
    assert sc.costs(64, [200])[0] == pytest.approx(line(64, 200, 200))  # past them too: dearer than the shape
    # one request, memory-bound: 1-3 tokens cost the same, a flat line; the profile has a knee
    # past 8 tokens, and past the widest count seen here its shape prices 32 tokens at 4 steps
    knee = C.StepCost(CostProfile([1, 4, 8, 64], [1.0, 1.0, 1.0, 8.0]))
    for t in (1, 2, 3) * 3:
        knee.record(t, 1.0, num_reqs=1)
    assert (knee._line(1).a, knee._line(1).b_row) == pytest.approx((1.0, 0.0))
    assert knee.costs(1, [32])[0] == pytest.approx(4.0)
    fewer = C.StepCost(prof)
    for t in range(64, 64 + C.StepCost.MIN_FIT - 1):
        fewer.record(t, 1.0, num_reqs=64)
    assert fewer._line(64) is None  # MIN_FIT steps before a line
    flat = C.StepCost(prof)
    for _ in range(C.StepCost.MIN_FIT):
        flat.record(64, 1.0, num_reqs=64)
    assert flat._line(64) is None  # one count says nothing of a slope


def test_step_cost_line_pools_a_bin_of_batch_sizes_and_prices_nodes_apart_from_riders():
    """At 64 streams the batch wanders over 57-64 and most steps carry prompt chunks, so no one
    batch size sees enough steps for a line of its own; the bin's steps do. Their body is
    a + c N + b_row (nodes) + b_pad (riding prompt tokens): the line recovers both slopes, prices
    a plan unseen at its batch size by them, and while no step verified a node, a node's body
    costs what a riding token's does (not nothing)."""
    a, c, b_row, b_pad = 0.02, 0.003, 0.005, 0.002
    gen = torch.Generator().manual_seed(0)
    sc = C.StepCost(CostProfile([1, 64], [1.0, 64.0]))  # no head cost: the body is the step
    only_prompts = C.StepCost(CostProfile([1, 64], [1.0, 64.0]))
    for i in range(40):
        n = 57 + i % 8
        nodes = [0, 0, 7, 17, 30][i % 5]
        prompt = [0, 40, 128, 256][(i // 5) % 4]
        noise = 0.002 * float(torch.randn((), generator=gen))
        sc.record(n + nodes + prompt, a + c * n + b_row * nodes + b_pad * prompt + noise, n + nodes, n)
        only_prompts.record(n + prompt, a + c * n + b_pad * prompt + noise, n, n)
    assert sc._line(57) == sc._line(64)  # one bin: 5 steps at each batch size, 40 in all
    line = sc._line(64)
    assert line.b_row == pytest.approx(b_row, rel=0.1) and line.b_pad == pytest.approx(b_pad, rel=0.1)
    assert line.c == pytest.approx(c, rel=0.35)
    plan = sc.costs(61, [61 + 13], [61 + 13])[0]  # 61 requests never verified 13 nodes
    assert plan == pytest.approx(a + c * 61 + b_row * 13, rel=0.03)
    riding = sc.costs(61, [61 + 13 + 100], [61 + 13])[0]
    assert riding - plan == pytest.approx(100 * b_pad, rel=0.15)
    cold = only_prompts._line(64)
    assert cold.b_row == cold.b_pad == pytest.approx(b_pad, rel=0.1)
    assert C.StepCost(CostProfile([1, 64], [1.0, 64.0]))._line(64) is None


def test_adaptive_policy_times_every_decode_step_by_its_forwards_tokens():
    target = ours_from_hf(build_hf("llama", seed=0))
    policy = AdaptiveDraftLength(STEEP, max_depth=6)
    sp = SamplingParams(max_tokens=12, ignore_eos=True)
    forwards = []  # (requests, tokens the packed forward carries) per decode step
    admit = policy.admit

    def spy(seqs, drafts, draft_seconds):
        out = admit(seqs, drafts, draft_seconds)
        forwards.append((len(seqs), len(seqs) + sum(len(d.tokens) for d in out)))
        return out

    policy.admit = spy
    _, seqs, eng = _run(target, NgramDrafter(), policy, [[5, 6, 7, 5, 6, 7, 5, 6], [9, 8, 9, 8, 9, 8]], sp, k=4)
    decode_steps = max(s.stats.forwards for s in seqs)
    seen = policy.step_cost.seen
    assert sum(len(q) for q in seen.values()) == decode_steps == len(forwards)
    assert sorted(t for t, q in seen.items() for _ in q) == sorted(t for _, t in forwards)
    assert sorted((n, t) for n, by in policy.step_cost.seen_at.items() for t, q in by.items() for _ in q) == sorted(forwards)
    assert all(t > 0 for q in seen.values() for _, t in q)


@pytest.mark.parametrize("drafting", ["cheap", "dear"])
def test_where_nothing_pays_probe_steps_still_verify_and_come_ever_rarer(drafting):
    """A profile where every window costs ten times a plain step: the planner never chooses one.
    Probe steps still verify one token per draft whatever the planner says, so the estimator keeps
    getting verdicts: right after the first step, then 8, 16, 32, ... steps apart. A cheap drafter
    (the n-gram lookup) drafts every step; a dear one only on those probe steps."""
    class Always(NgramDrafter):  # drafts its budget every time: k copies of the last token
        def propose(self, seqs, budgets):
            return [Draft([s.tokens[-1]] * k) for s, k in zip(seqs, budgets)]

    class Cost(C.DraftCost):  # what drafting costs, fixed (a live median would follow the test machine)
        def __call__(self, num_reqs):
            return 0.0 if drafting == "cheap" else 1.0  # nothing, or a plain step (the StepCost prior)

    target = ours_from_hf(build_hf("llama", seed=0))
    dear = CostProfile([1, 2, 64], [1.0, 10.0, 320.0])
    policy = AdaptiveDraftLength(dear, max_depth=6)
    policy.draft_cost = Cost()
    policy.step_cost.record = lambda *a, **kw: None  # plan by the profile, not by this machine's step times
    drafted, verified = [], []
    admit = policy.admit

    def spy(seqs, drafts, draft_seconds):
        out = admit(seqs, drafts, draft_seconds)
        if any(d.tokens for d in drafts):
            drafted.append(policy.steps)
        if any(d.tokens for d in out):
            verified.append((policy.steps, max(len(d.tokens) for d in out)))
        return out

    policy.admit = spy
    _, seqs, _ = _run(target, Always(), policy, [[5, 6, 7, 5, 6]], SamplingParams(max_tokens=80, ignore_eos=True), k=4)
    assert [s for s, _ in verified][:4] == [2, 10, 26, 58], verified
    assert all(w == 1 for _, w in verified)  # a probe verifies one token; the planner wanted none
    if drafting == "cheap":
        assert drafted == list(range(1, len(drafted) + 1)) and len(drafted) >= 60
    else:
        assert drafted == [1] + [s for s, _ in verified]
    assert seqs[0].stats.drafted == len(verified) == policy.estimator.observations


def test_a_packed_probe_verifies_the_surest_requests_that_a_quarter_of_a_step_pays_for():
    """Where a token costs 1 beside a step's fixed 3 (a CPU at high load: 8 requests 11) and the
    drafts are unsure, no node pays and the planner verifies nothing; the probe step after it
    verifies the best node of the two surest requests (11 x 1.25 = 13.75: 2 more tokens), not one
    node of each of the 8. A cold estimator (under 256 observations) probes two there too (nodes
    are dear), but all 8 where a node costs half a plain token (a plain step of 8 costs 8.0, of
    16 12.0, of one 7.0)."""
    from verispec.sequence import Sequence

    dear = CostProfile([1, 64], [4.0, 67.0])
    policy = AdaptiveDraftLength(dear, max_depth=2)
    policy.step_cost.record = lambda *a, **kw: None
    policy.estimator.w, policy.estimator.b = torch.tensor([1.0], dtype=torch.float64), torch.zeros(2, dtype=torch.float64)
    policy.estimator.observations = AdaptiveDraftLength.PROBE_ALL_UNTIL  # warm: probes are bounded
    seqs = [Sequence(i, [1, 2, 3], SamplingParams(max_tokens=64), torch.Generator(), num_draft_tokens=2) for i in range(8)]
    surety = [-0.5, 1.0, -2.0, 2.0, -1.0, 0.0, -3.0, 0.5]  # logits of acceptance: requests 3 and 1 are the surest
    verified = []
    for step in range(2):
        assert policy.budgets(seqs, 2) == [2] * 8
        drafts = [Draft([4, 5], features=[[f], [f]]) for f in surety]
        out = policy.admit(seqs, drafts, 0.0)
        verified.append([r for r, d in enumerate(out) for _ in d.tokens])
        policy.observe(seqs, out, [Verdict(d.tokens[:1] or [9], 0, []) for d in out])
    assert verified == [[], [1, 3]]
    assert policy._probe
    for profile, probed in ((dear, [1, 1] + [0] * 6),
                            (CostProfile([1, 8, 16], [7.0, 8.0, 12.0]), [1] * 8)):
        cold = AdaptiveDraftLength(profile, max_depth=2)
        cold.step_cost.record = lambda *a, **kw: None
        for step in range(2):
            cold.budgets(seqs, 2)
            out = cold.admit(seqs, [Draft([4, 5], features=[[f], [f]]) for f in surety], 0.0)
        assert cold._probe and [len(d.tokens) for d in out] == probed


@pytest.mark.parametrize("planner", ["greedy", "topb"])
def test_a_plan_must_beat_plain_decoding_by_the_margin(planner):
    """One request, one node, a verify of 2 tokens costing 1.5 plain steps: a node accepted with
    chance 0.53 makes the step 2% faster than plain decoding (1.53 / 1.5), within the margin, so it
    is not verified; one at 0.58 (5% faster) is."""
    from verispec.sequence import Sequence

    for chance, verified in [(0.53, 0), (0.58, 1)]:
        policy = AdaptiveDraftLength(CostProfile([1, 2], [1.0, 1.5]), planner, max_depth=1)
        policy.step_cost.record = lambda *a, **kw: None
        policy.estimator.w, policy.estimator.b = torch.tensor([1.0], dtype=torch.float64), torch.zeros(1, dtype=torch.float64)
        seq = Sequence(0, [1, 2, 3], SamplingParams(max_tokens=64), torch.Generator(), num_draft_tokens=1)
        policy.budgets([seq], 1)
        out = policy.admit([seq], [Draft([4], features=[[logit_(chance)]])], 0.0)
        assert len(out[0].tokens) == verified, chance


def _one_request_on_a_clock(monkeypatch, pair: float = 1.5):
    """The margin test's request (one node at chance 0.58, predicted 5% faster than plain
    decoding, at a 2-token verify priced `pair` = 1.5 plain steps) under a fake clock: the policy,
    the request, and step(seconds, riders=0, draft=True, chance=0.58), which runs one step that takes `seconds`
    and returns how many nodes it verified."""
    from verispec.adaptive import policy as P
    from verispec.sequence import Sequence

    clock = [0.0]
    monkeypatch.setattr(P.time, "perf_counter", lambda: clock[0])
    policy = AdaptiveDraftLength(CostProfile([1, 2], [1.0, pair]), max_depth=1)
    policy.step_cost.record = lambda *a, **kw: None
    policy.estimator.w, policy.estimator.b = torch.tensor([1.0], dtype=torch.float64), torch.zeros(1, dtype=torch.float64)
    policy.estimator.observe = lambda *a, **kw: None  # the confidence stays 0.58
    seq = Sequence(0, [1, 2, 3], SamplingParams(max_tokens=10_000), torch.Generator(), num_draft_tokens=1)

    def step(seconds: float, riders: int = 0, draft: bool = True, chance: float = 0.58) -> int:
        policy.budgets([seq], 1)
        policy._probe = False
        if riders:
            policy.riders(riders, 1)
        out = policy.admit([seq], [Draft([4], features=[[logit_(chance)]]) if draft else Draft([])], 0.0)
        clock[0] += seconds
        policy.observe([seq], out, [Verdict([7], 0)])
        return len(out[0].tokens)

    return policy, seq, step


def test_a_plan_must_also_beat_what_plans_at_its_batch_size_lately_overshot(monkeypatch):
    """The margin test's node at chance 0.58 (predicted 5% faster than plain decoding) is verified
    while its steps run as priced; after 8 of them each took 3 plain steps' time (realized gain
    1/3), it is not, at that batch size; 256 steps after the last record it is verified again.
    A step with prompt chunks riding along is on record apart. (Nodes are dear here: one costs
    half a plain step, DEAR_SHARE set to 0.5.)"""
    policy, _, step = _one_request_on_a_clock(monkeypatch)
    policy.DEAR_SHARE = 0.5

    assert step(1.5) == 1 and policy.realized.overshoot(policy.steps, 1) == 0.0  # one record: not yet
    for _ in range(RealizedGain.MIN_PLANS - 2):
        assert step(3.0) == 1
    assert step(3.0, riders=4) == 1 and policy.realized.overshoot(policy.steps, 1) == 0.0  # on record apart: 7 records
    assert step(3.0) == 1  # the 8th
    assert policy.realized.overshoot(policy.steps, 1) == pytest.approx(1.053 - 1 / 3, abs=0.01)
    assert policy.realized.overshoot(policy.steps, 2) == 0.0  # another batch size's bin
    assert step(1.0) == 0
    policy.steps += RealizedGain.FORGET
    assert step(1.5) == 1


@pytest.mark.parametrize("packed", [True, False])
@pytest.mark.parametrize("one", [2.5, 7.9])
def test_where_plain_steps_grow_with_every_request_a_node_costs_at_least_their_slope(one, packed):
    """8 requests, each drafting one node at chance 0.8. The profile prices a plain step of 8
    tokens at 8.0 and one of 16 at 8.8, a node at 0.1: verified, 1.64x plain decoding by that
    price. But a plain step of one request costs 2.5 there, so each of the 7 more requests added
    0.79: a node, one more token through the body and the head, costs at least that (a step's
    cost is convex in its tokens), and 8 nodes cost 6.3 more, 1.01x plain decoding: refused.
    Where one request's step costs 7.9 (the weights' reads set the step: the slope is 0.014),
    the nodes are priced as the profile says and verified. The same for packed chains and for
    padded windows (a window of 1 is also a forward of 16 tokens)."""
    from verispec.sequence import Sequence

    policy = AdaptiveDraftLength(CostProfile([1, 8, 16], [one, 8.0, 8.8]), max_depth=1)
    policy.packed_chains = packed
    policy.step_cost.record = lambda *a, **kw: None
    policy.estimator.w, policy.estimator.b = torch.tensor([1.0], dtype=torch.float64), torch.zeros(1, dtype=torch.float64)
    seqs = [Sequence(i, [1, 2, 3], SamplingParams(max_tokens=100), torch.Generator(), num_draft_tokens=1)
            for i in range(8)]
    policy.budgets(seqs, 1)
    policy._probe = False
    out = policy.admit(seqs, [Draft([4], features=[[logit_(0.8)]]) for _ in seqs], 0.0)
    floor = (8.0 - one) / 7
    assert policy._nodes(8) == (one == 2.5, pytest.approx(floor), pytest.approx(8.0 / (8 * floor)))
    assert sum(len(d.tokens) for d in out) == (0 if one == 2.5 else 8)


def test_where_no_plan_can_pay_nothing_is_drafted_not_even_probes():
    """A step costs 8 plus 1 a token: at 64 requests a node costs at least 1 (the slope of plain
    steps from one request), so a plan whose every node is accepted gains at most 72 / 64 = 1.125x
    plain decoding, under MIN_CEILING. Drafts accepted with chance 0.99 are predicted 1.07x there
    (past the margin, and taken without the ceiling), but nothing is drafted in 300 steps, no probe
    either; a seeded sampled request (pinned) still drafts and verifies its k. At 8 requests the
    ceiling is 2: the same drafts are drafted and verified, but not while 56 more hold slots with
    their prompts prefilling (a full batch's first wave): the load is judged at 64."""
    from verispec.sequence import Sequence

    def run(policy, seqs, steps, holding=0):
        drafted, verified = 0, 0
        for _ in range(steps):
            ks = policy.budgets(seqs, 2, holding)
            drafted += sum(ks)
            out = policy.admit(seqs, [Draft([4] * k, features=[[logit_(0.99)]] * k) for k in ks], 0.0)
            verified += sum(len(d.tokens) for d in out)
            policy.observe(seqs, out, [Verdict(d.tokens + [9], len(d.tokens), list(range(len(d.tokens)))) for d in out])
        return drafted, verified

    def requests(n, seeded=False):
        params = SamplingParams(max_tokens=10**4, temperature=0.8, seed=1) if seeded else SamplingParams(max_tokens=10**4)
        return [Sequence(100 * seeded + i, [1, 2, 3], params, torch.Generator(), num_draft_tokens=2) for i in range(n)]

    def policy():
        p = AdaptiveDraftLength(CostProfile([1, 64, 128], [9.0, 72.0, 136.0]), max_depth=2)
        p.step_cost.record = lambda *a, **kw: None
        p.estimator.w, p.estimator.b = torch.tensor([1.0], dtype=torch.float64), torch.zeros(2, dtype=torch.float64)
        p.estimator.observe = lambda *a, **kw: None  # the confidence stays 0.99
        return p

    p = policy()
    assert p._nodes(64)[2] == pytest.approx(1.125)
    assert p._hopeless(64) and not p._hopeless(8)
    assert run(p, requests(64), 300) == (0, 0)
    assert run(p, requests(63) + requests(1, seeded=True), 10) == (20, 20)  # the pinned request's 2 nodes a step
    assert run(p, requests(8), 10, holding=64) == (0, 0)  # 56 more hold slots, their prompts prefilling
    assert run(p, requests(8), 10) == (160, 160)
    # without the ceiling the planner takes the 64-request plan
    p = policy()
    p.MIN_CEILING = 1.0
    drafted, verified = run(p, requests(64), 10)
    assert verified >= 64 * 2 * 9


@pytest.mark.parametrize("pair,dear", [(1.7, True), (1.5, False)])
def test_where_nodes_are_dear_a_batch_size_whose_plans_lately_lost_takes_none_and_drafts_only_on_probes(
        monkeypatch, pair, dear):
    """Plans ran at plain decoding's speed (realized 1.0, short of the 3% margin): 8 predicted 5%
    faster (chance 0.79 at a 2-token verify priced 1.7 plain steps; 0.58 at 1.5), then 4 at chance
    0.9, predicted 12% (27%) faster, which beat the margin plus the median overshoot (5%).
    Where one node costs 0.7 of a plain step (at least DEAR_SHARE), those 12 records close the
    batch size: the next node at chance 0.9 is not verified, and the cheap drafter drafts nothing
    there but on a probe. Plans on steps with riders are on record apart and still taken; once
    the first record is 256 steps old, the bin plans again. Where a node costs 0.5 of a plain step,
    a losing record may say only that the text was novel: the node is verified, and the overshoot
    is not asked for (a node predicted 5.3% faster is verified too)."""
    policy, seq, step = _one_request_on_a_clock(monkeypatch, pair)
    first = 1.053 * pair - 1  # the chance at which a node is predicted 5.3% faster
    assert policy._dear(1) is dear

    for _ in range(RealizedGain.MIN_PLANS):
        assert step(1.0, chance=first) == 1
    assert policy.realized.overshoot(policy.steps, 1) == pytest.approx(0.053, abs=0.01)
    for _ in range(RealizedGain.MIN_LOSING - RealizedGain.MIN_PLANS):
        assert step(1.0, chance=0.9) == 1
    assert policy.realized.overshoot(policy.steps, 1) == pytest.approx(0.053, abs=0.01)
    assert policy.realized.losing(policy.steps, 1, False, policy.MARGIN)
    if not dear:
        assert step(1.0, chance=0.9) == 1 and step(1.0, chance=first) == 1
        assert all(policy.budgets([seq], 1)[0] for _ in range(16))
        return
    assert step(1.0, chance=0.9) == 0
    assert step(1.0, chance=0.9, riders=4) == 1
    budgets = [policy.budgets([seq], 1)[0] for _ in range(AdaptiveDraftLength.PROBE_MAX)]
    drafting = [i for i, b in enumerate(budgets) if b]
    assert drafting[:5] == [8, 16, 32, 64, 128]  # probes only, ever rarer
    lapsed = policy.steps - len(budgets) + 1 + drafting[5]  # then every step: the first record (step 1) lapsed
    assert all(budgets[drafting[5]:]) and lapsed == 1 + RealizedGain.FORGET
    assert step(1.0, chance=0.9) == 1


def test_the_realized_gain_is_against_the_bins_own_plain_steps_and_steps_with_riders_keep_their_own(monkeypatch):
    """Plain decoding, priced 1.0 s a step, ran 0.4 s in the quiet steps that verified nothing
    (once 4 are on record; a step with prompt chunks riding along is not one of them): plans whose
    steps took 1.5 s for one token realized 0.4 / 1.5 of plain decoding's speed, not 1 / 1.5.
    Plans on steps with riders are on record apart, their time less the riders' priced part
    (2.0 s of a 3.5 s step). (Nodes are dear here, DEAR_SHARE set to 0.5.)"""
    policy, _, step = _one_request_on_a_clock(monkeypatch)
    policy.DEAR_SHARE = 0.5

    for _ in range(RealizedGain.MIN_PLAIN - 1):
        step(0.4, draft=False)
    step(0.9, riders=4, draft=False)
    assert policy.realized.plain_seconds(policy.steps, 1) is None  # 3 plain steps: the price stands
    step(0.4, draft=False)
    assert policy.realized.plain_seconds(policy.steps, 1) == pytest.approx(0.4)
    for _ in range(RealizedGain.MIN_PLANS):
        assert step(3.5, riders=4) == 1
    assert policy.realized.overshoot(policy.steps, 1) == 0.0
    assert policy.realized.overshoot(policy.steps, 1, riders=True) == pytest.approx(1.053 - 0.4 / 1.5, abs=0.01)
    assert step(3.5, riders=4) == 0
    for _ in range(RealizedGain.MIN_PLANS):
        assert step(1.5) == 1
    assert policy.realized.overshoot(policy.steps, 1) == pytest.approx(1.053 - 0.4 / 1.5, abs=0.01)
    assert step(1.5) == 0


@pytest.mark.parametrize("planning,dear,looks", [
    (0.0, True, [1, 2, 4, 7, 10, 13, 16, 19, 22, 25, 26, 29]),
    (0.015, True, [1, 2, 4, 8, 10, 16, 22, 26, 32, 38]),
    (0.015, False, [1, 2, 4, 7, 10, 13, 16, 19, 22, 25, 26, 29, 32, 35, 38]),
])
def test_a_cheap_drafter_whose_drafts_were_not_worth_verifying_looks_again_every_few_steps(planning, dear, looks):
    """Drafting that costs 1.5% of a plain step, where nothing pays: after a step that verified
    nothing, the drafter drafts 2 steps later, then every 3rd step (keeping fruitless drafting
    under 0.5% of the time), and on the probe steps (2, 10, 26: 8, 16, ... steps after the last
    verified one). Where nodes are dear and planning a look costs another 1.5%, every 6th step
    once the doubling waits reach it (and the probes); where they are cheap (a node 0.5 of a
    plain step), planning is not counted."""
    from verispec.sequence import Sequence

    class Cost(C.DraftCost):
        def __init__(self, seconds):
            super().__init__()
            self.seconds = seconds

        def __call__(self, num_reqs):
            return self.seconds  # a plain step costs 1.0 (the profile at 1 token)

    policy = AdaptiveDraftLength(CostProfile([1, 2, 64], [1.0, 10.0 if dear else 1.5, 320.0]), max_depth=4)
    policy.draft_cost, policy.plan_cost = Cost(0.015), Cost(planning)
    policy.step_cost.record = lambda *a, **kw: None
    seq = Sequence(0, [1, 2, 3], SamplingParams(max_tokens=200), torch.Generator(), num_draft_tokens=4)
    drafted = []
    for step in range(1, 41 if planning else 31):
        k = policy.budgets([seq], 4)[0]
        if k:
            drafted.append(step)
        out = policy.admit([seq], [Draft([4] * k, features=[[0.0]] * k)], 0.0)
        policy.observe([seq], out, [Verdict(out[0].tokens[:1] or [9], 0, [])])
    assert policy._dear(1) is dear
    assert drafted == looks, str(drafted)


def test_profile_records_the_tokens_its_forwards_carry_and_repeats_round_the_grid(monkeypatch):
    target = ours_from_hf(build_hf("llama", seed=0))
    calls = []
    forward = type(target).forward

    def counting(self, ids, *a, **kw):
        calls.append(tuple(ids.shape))
        return forward(self, ids, *a, **kw)

    monkeypatch.setattr(type(target), "forward", counting)
    prof = C.measure(target, 12, 4, repeats=2)
    # 6 tokens over 4 rows is a forward of 4 x 2 = 8: recorded as 8, measured once per round
    assert prof.tokens == [1, 2, 3, 4, 8, 12]
    shapes = [(1, 1), (2, 1), (3, 1), (4, 1), (4, 2), (4, 3)]
    assert calls == shapes * 3  # a warm-up round, then the repeats round the whole grid


# ---- lossless, through the engine -------------------------------------------------------------
STEEP = CostProfile([1, 2, 4, 8, 16, 64], [1.0, 1.3, 1.6, 2.4, 4.0, 16.0])  # windows of 0..3 all occur


def _run(target, drafter, policy, prompts, sp, max_batch=3, k=4, tree="chain"):
    cfg = EngineConfig(model="unused", drafter=None, num_draft_tokens=k, draft_tree=tree, dtype="float32",
                       max_batch_size=max_batch, max_model_len=96)
    eng = Engine(target, None, cfg, drafter, policy=policy)
    seqs = [eng.add_request(p, sp) for p in prompts]
    while eng.has_work:
        eng.step()
    return [s.output_ids for s in seqs], seqs, eng


@pytest.mark.parametrize("planner", ["greedy", "topb"])
@pytest.mark.parametrize("kind,tree", [("ngram", "chain"), ("draft", "chain"), ("ngram", "dynamic:2"),
                                       ("draft", "dynamic:2")])
def test_greedy_output_with_adaptive_policy_is_the_targets(planner, kind, tree):
    from test_greedy_lossless import noisy_copy, prompts_for

    target = ours_from_hf(build_hf("llama", seed=0))
    prompts = prompts_for(target.config.vocab_size)
    sp = SamplingParams(max_tokens=24, ignore_eos=True)
    plain, _, _ = _run(target, None, None, prompts, sp)
    drafter = NgramDrafter() if kind == "ngram" else ModelDrafter(noisy_copy(target), 3, 96 + 8)
    policy = AdaptiveDraftLength(STEEP, planner, max_depth=6, refit_every=5)
    outs, seqs, eng = _run(target, drafter, policy, prompts, sp, k=6, tree=tree)
    assert outs == plain
    assert sum(s.stats.drafted for s in seqs) > 0
    assert policy.estimator.observations > 0 and policy.estimator.refits > 0


class _PeekingPolicy(AdaptiveDraftLength):
    """WRONG on purpose: verifies a drafted token only if its id is even (it looks at the token)."""

    def admit(self, seqs, drafts, draft_seconds):
        out = []
        for d in drafts:
            n = 0
            while n < len(d.tokens) and d.tokens[n] % 2 == 0:
                n += 1
            out.append(d.truncate(n))
        return out

    def observe(self, seqs, drafts, verdicts):
        pass


@pytest.mark.parametrize("policy", ["adaptive", "adaptive-topb", "peeking"])
def test_sampled_output_with_adaptive_policy_is_distributed_as_the_target(models, policy):
    sp = T.SETTINGS["plain"]
    exact = T.exact_joint(models[0], sp)
    # at 512 requests a step of 1 + W tokens per request costs: windows of 1 and 2 pay, 3 does not
    wide = CostProfile([1, 512, 1024, 1536, 2048], [1.0, 1.0, 1.3, 1.45, 1.9])
    if policy == "peeking":
        pol = _PeekingPolicy(wide)
    else:
        pol = AdaptiveDraftLength(wide, "topb" if policy == "adaptive-topb" else "greedy", max_depth=T.K, refit_every=3)
    eng = Engine(models[1], None, EngineConfig(model="unused", drafter=None, num_draft_tokens=T.K, dtype="float32",
                                               max_batch_size=T.BATCH, max_model_len=T.MAX_LEN),
                 T.make_drafter("draft", models), policy=pol)
    random.seed(7)  # no per-request seed (a seeded request always verifies its whole draft): the
    # engine draws each request's seed from Python's generator, seeded here for a repeatable test
    seqs = [eng.add_request(T.PROMPT, sp) for _ in range(T.N)]
    outs = T.run_to_end(eng, seqs)
    codes = torch.tensor([sum(x * T.V ** (T.M - 1 - j) for j, x in enumerate(o)) for o in outs])
    counts = torch.bincount(codes, minlength=T.V ** T.M).double()
    thr = T.null_thresholds(exact, T.N)["joint"][0]
    got = T.tv(counts, exact).item()
    drafted = sum(s.stats.drafted for s in seqs)  # verified draft tokens
    print(f"\n[{policy}] TV {got:.4f} threshold {thr:.4f}, verified {drafted} draft tokens, "
          f"accepted {sum(s.stats.accepted for s in seqs)}")
    assert drafted > T.N // 2
    if policy == "peeking":
        assert got > thr, f"the check missed a policy that looks at the drafted token (TV {got:.4f} < {thr:.4f})"
    else:
        assert got < thr, f"TV {got:.4f} >= threshold {thr:.4f}: adaptive admission changed the distribution"


def test_metrics_report_budget_coefficients_and_predicted_against_observed():
    from test_greedy_lossless import prompts_for
    from verispec.server.metrics import Metrics

    target = ours_from_hf(build_hf("llama", seed=0))
    policy = AdaptiveDraftLength(STEEP, "greedy", max_depth=4, refit_every=5)
    cfg = EngineConfig(model="unused", drafter=None, num_draft_tokens=4, dtype="float32", max_batch_size=3,
                       max_model_len=96)
    eng = Engine(target, None, cfg, NgramDrafter(), policy=policy)
    m = Metrics("tiny")
    for p in prompts_for(target.config.vocab_size)[:3]:
        eng.add_request(p, SamplingParams(max_tokens=24, ignore_eos=True))
    steps = 0
    while eng.has_work:
        eng.step()
        m.observe_engine(eng)
        m.observe_engine(eng)  # a look without a step counts nothing twice
        steps += 1
    text = m.render().decode()
    values = {ln.rsplit(" ", 1)[0]: float(ln.rsplit(" ", 1)[1]) for ln in text.splitlines() if ln and not ln.startswith("#")}
    lbl = '{model_name="tiny"}'
    assert values[f"verispec:spec_decode_adaptive_budget_tokens_count{lbl}"] == policy.steps
    assert values[f"verispec:spec_decode_adaptive_budget_tokens_sum{lbl}"] > 0
    est = policy.estimator
    assert est.observations > 0
    assert values[f"verispec:spec_decode_adaptive_observations_total{lbl}"] == est.observations
    assert values[f"verispec:spec_decode_adaptive_observed_accepted_total{lbl}"] == est.observed_sum
    assert values[f"verispec:spec_decode_adaptive_predicted_accepted_total{lbl}"] == pytest.approx(est.predicted_sum)
    assert values['verispec:spec_decode_adaptive_estimator_coefficient{index="0",kind="intercepts",model_name="tiny"}'] \
        == pytest.approx(est.coefficients()["intercepts"][0])


def test_a_step_with_prompt_chunks_riding_is_timed_at_its_forwards_real_size():
    """A request admitted while another decodes has its prompt ride in the packed verify forward
    (engine._decode_step): the policy records that step under the forward's real token count
    (requests + admitted nodes + prompt tokens) and LM head rows (+ one for the prompt that ends)."""
    target = ours_from_hf(build_hf("llama", seed=0))
    policy = AdaptiveDraftLength(STEEP, max_depth=4)
    cfg = EngineConfig(model="unused", drafter=None, num_draft_tokens=4, dtype="float32", max_batch_size=2,
                       max_model_len=96)
    eng = Engine(target, None, cfg, NgramDrafter(), policy=policy)
    sp = SamplingParams(max_tokens=10, ignore_eos=True)
    planned, recorded = [], []
    admit, record = policy.admit, policy.step_cost.record

    def spy_admit(seqs, drafts, draft_seconds):
        out = admit(seqs, drafts, draft_seconds)
        planned.append(len(seqs) + sum(len(d.tokens) for d in out))
        return out

    policy.admit = spy_admit
    policy.step_cost.record = lambda tokens, seconds, rows=None, n=None: (recorded.append((tokens, rows)),
                                                                          record(tokens, seconds, rows, n))
    eng.add_request([5, 6, 7, 5, 6, 7, 5, 6], sp)
    eng.step()  # prefilled alone: no decode step
    eng.step()
    second = [9, 8, 9, 8, 9, 8, 3]
    late = eng.add_request(second, sp)
    eng.step()  # the first decodes; the second's prompt rides in that forward
    assert late.num_output == 1 and late in eng.running
    assert recorded[-1] == (planned[-1] + len(second), planned[-1] + 1)
    assert [t for t, _ in recorded[:-1]] == planned[:-1]
    while eng.has_work:
        eng.step()
    assert [t for t, _ in recorded[2:]] == planned[2:]


def _fruitless_steps(policy, seqs, steps, k=2):
    """Drive the policy through `steps` decode steps of `seqs` (every draft k nodes of feature 0,
    the first rejected); returns the steps that drafted and those that verified."""
    drafted, verified = [], []
    for _ in range(steps):
        ks = policy.budgets(seqs, k)
        if any(ks):
            drafted.append(policy.steps)
        out = policy.admit(seqs, [Draft([4] * b, features=[[0.0]] * b) for b in ks], 0.0)
        if any(d.tokens for d in out):
            verified.append(policy.steps)
        policy.observe(seqs, out, [Verdict([9], 0, []) for _ in out])
    return drafted, verified


def test_a_fruitless_look_waits_twice_as_long_up_to_the_cost_cap():
    """A cheap drafter (4% of a plain step: the cap is every 8th step) where nothing pays and no
    probe comes but the first (step 2, right after the first step): it drafts 1, 2, 4, then 8 steps
    after each fruitless look."""
    from verispec.sequence import Sequence

    class Cost(C.DraftCost):
        def __init__(self, seconds):
            super().__init__()
            self.seconds = seconds

        def __call__(self, num_reqs):
            return self.seconds

    policy = AdaptiveDraftLength(CostProfile([1, 2, 64], [1.0, 10.0, 320.0]), max_depth=2)
    policy.PROBE_EVERY = 10**6  # no probes after the first: the looks alone
    policy.draft_cost, policy.plan_cost = Cost(0.04), Cost(0.0)  # (planning as timed here would move the cap)
    policy.step_cost.record = lambda *a, **kw: None
    seq = Sequence(0, [1, 2, 3], SamplingParams(max_tokens=200), torch.Generator(), num_draft_tokens=2)
    drafted, verified = _fruitless_steps(policy, [seq], 40)
    assert drafted == [1, 2, 4, 8, 16, 24, 32, 40] and verified == [2], (drafted, verified)


def test_a_new_load_starts_the_probe_interval_again():
    """Where nothing pays at 64 requests the probes grow 256 steps apart; at 32 they stay so, but
    when the batch shrinks to 4 (4-fold or more: LOAD_CHANGE) the policy probes 8 steps later, as a fresh one would, since what pays
    depends on the load."""
    from verispec.sequence import Sequence

    policy = AdaptiveDraftLength(CostProfile([1, 64, 512], [25.0, 88.0, 536.0]), max_depth=2)
    policy.step_cost.record = lambda *a, **kw: None
    seqs = [Sequence(i, [1, 2, 3], SamplingParams(max_tokens=10**4), torch.Generator(), num_draft_tokens=2)
            for i in range(64)]
    _, verified = _fruitless_steps(policy, seqs, 600)
    assert verified[:6] == [2, 10, 26, 58, 122, 250], verified  # 8, 16, 32, ... steps apart
    assert policy._probe_every == AdaptiveDraftLength.PROBE_MAX
    _, verified = _fruitless_steps(policy, seqs[:32], 20)  # half the batch: not yet a new load
    assert not verified
    _, verified = _fruitless_steps(policy, seqs[:4], 20)  # a sixteenth
    assert verified and verified[0] <= 620 + 8 + 1, verified
