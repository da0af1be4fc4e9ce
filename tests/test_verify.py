"""verify.py on hand-built cases: the greedy and sampled acceptance rules, probs(), SamplingParams.

In the style of vLLM's rejection-sampler tests: one-hot target distributions make the sampled
rule deterministic, so each verdict is known exactly whatever the random draws are; every such
case is checked over many generator seeds.
"""

from __future__ import annotations

import math

import pytest
import torch

from verispec.drafters import Draft
from verispec.sampling import SamplingParams, probs
from verispec.verify import CHAIN, Verdict

pytestmark = pytest.mark.usefixtures("single_torch_thread")

V = 8
SEEDS = range(50)


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def one_hot(modes: list[int], vocab: int = V) -> torch.Tensor:
    return torch.nn.functional.one_hot(torch.tensor(modes), vocab).float()


def random_dist(rows: int, seed: int, vocab: int = V) -> torch.Tensor:
    """Random strictly positive distributions [rows, vocab]."""
    g = gen(10_000 + seed)
    return (torch.randn(rows, vocab, generator=g) * 1.5).softmax(-1)


def accept_sampled(p, draft, q, g) -> Verdict:
    """The chain rule on processed target probabilities p [k + 1, V]."""
    return CHAIN.accept(p, Draft(list(draft), q), g)


def accept_greedy(target_argmax: list[int], draft: list[int]) -> Verdict:
    """Greedy is the one-hot case: the same rule on one-hot target rows, whatever the draws."""
    return accept_sampled(one_hot(target_argmax, max(target_argmax + draft) + 1), draft, None, gen(0))


def nonzero(p: torch.Tensor) -> list[set[int]]:
    return [set(torch.nonzero(r).flatten().tolist()) for r in p]


# --------------------------------------------------------------------------------------------
# accept_greedy


def test_greedy_all_accepted_plus_bonus():
    v = accept_greedy([3, 1, 4, 2], [3, 1, 4])
    assert (v.tokens, v.accepted) == ([3, 1, 4, 2], 3)  # bonus = target argmax at position k


def test_greedy_first_rejected():
    v = accept_greedy([3, 1, 4, 2], [0, 1, 4])
    assert (v.tokens, v.accepted) == ([3], 0)  # the target's own token replaces the first draft


def test_greedy_middle_rejected():
    v = accept_greedy([3, 1, 4, 2], [3, 0, 4])
    assert (v.tokens, v.accepted) == ([3, 1], 1)  # later drafts are ignored, even if they match


def test_greedy_last_rejected():
    v = accept_greedy([3, 1, 4, 2], [3, 1, 5])
    assert (v.tokens, v.accepted) == ([3, 1, 4], 2)


def test_greedy_empty_draft():
    v = accept_greedy([6], [])
    assert (v.tokens, v.accepted) == ([6], 0)


# --------------------------------------------------------------------------------------------
# accept_sampled with one-hot targets: deterministic verdicts


MODES = [3, 1, 4, 2]  # argmax of p_0..p_3


@pytest.mark.parametrize("with_q", [True, False], ids=["q", "q_none"])
def test_sampled_onehot_target_all_match(with_q):
    p = one_hot(MODES)
    for s in SEEDS:
        q = random_dist(3, s) if with_q else None
        v = accept_sampled(p, MODES[:3], q, gen(s))
        assert (v.tokens, v.accepted) == (MODES, 3), f"seed {s}"  # bonus from p_3 = its mode


@pytest.mark.parametrize("with_q", [True, False], ids=["q", "q_none"])
@pytest.mark.parametrize("bad", [0, 1, 2])
def test_sampled_onehot_target_mismatch_rejected_and_recovered_to_mode(with_q, bad):
    p = one_hot(MODES)
    draft = list(MODES[:3])
    draft[bad] = (MODES[bad] + 5) % V  # p = 0 there
    for s in SEEDS:
        q = random_dist(3, s) if with_q else None
        v = accept_sampled(p, draft, q, gen(s))
        assert v.accepted == bad, f"seed {s}"
        assert v.tokens == MODES[: bad + 1], f"seed {s}"  # accepted drafts, then the recovered mode


@pytest.mark.parametrize("with_q", [True, False], ids=["q", "q_none"])
def test_sampled_empty_draft_samples_p0(with_q):
    p = one_hot([5])
    q = torch.zeros(0, V) if with_q else None
    for s in SEEDS:
        v = accept_sampled(p, [], q, gen(s))
        assert (v.tokens, v.accepted) == ([5], 0)


def test_sampled_q_equals_p_accepts_everything():
    for s in SEEDS:
        p = random_dist(4, s)
        g = gen(s)
        draft = [int(torch.multinomial(p[i], 1, generator=g)) for i in range(3)]  # drafted from q = p
        v = accept_sampled(p, draft, p[:3].clone(), gen(s))
        assert v.accepted == 3 and v.tokens[:3] == draft and len(v.tokens) == 4, f"seed {s}"


def test_sampled_q_equals_p_onehot_bonus():
    p = one_hot(MODES)
    v = accept_sampled(p, MODES[:3], p[:3].clone(), gen(0))
    assert (v.tokens, v.accepted) == (MODES, 3)


def test_sampled_q_none_recovered_never_the_rejected_draft():
    """One-hot q (n-gram drafts): the residual is p with the draft token removed."""
    rejections = 0
    for s in range(200):
        p = random_dist(3, s)
        draft = [int(p[0].argmin()), int(p[1].argmax())]
        v = accept_sampled(p, draft, None, gen(s))
        if v.accepted < 2:
            rejections += 1
            assert v.tokens[-1] != draft[v.accepted], f"seed {s}: recovered the rejected draft token"
            assert len(v.tokens) == v.accepted + 1
    assert rejections > 100  # the argmin draft is rejected almost always: the case was exercised


@pytest.mark.parametrize("with_q", [True, False], ids=["q", "q_none"])
def test_sampled_draft_with_zero_target_prob_always_rejected(with_q):
    """p(d) = 0 (e.g. filtered by top-k/top-p) -> rejected whatever u and q(d) are; never recovered as d."""
    for s in SEEDS:
        p = random_dist(2, s)
        d = int(torch.randint(0, V, (1,), generator=gen(s)))
        p[0, d] = 0.0
        p[0] /= p[0].sum()
        q = one_hot([d]) * 0.999 + 0.001 / V if with_q else None  # q(d) ~ 1: the most favourable case
        v = accept_sampled(p, [d], q, gen(s))
        assert v.accepted == 0, f"seed {s}"
        assert v.tokens[0] != d and p[0, v.tokens[0]] > 0, f"seed {s}"


def test_sampled_recovered_token_in_residual_support():
    """The recovered token is drawn from max(0, p - q): only tokens where p > q are possible."""
    p = torch.tensor([[0.5, 0.3, 0.2, 0.0], [0.25, 0.25, 0.25, 0.25]])
    q = torch.tensor([[0.1, 0.1, 0.7, 0.1]])
    seen = set()
    for s in range(300):
        v = accept_sampled(p, [2], q, gen(s))
        if v.accepted == 0:
            seen.add(v.tokens[0])
        else:
            assert v.tokens[0] == 2
    assert seen == {0, 1}  # token 2 (p < q) and token 3 (p = 0) are impossible


def test_sampled_acceptance_probability_is_min_1_p_over_q():
    """P(accept d) = min(1, p(d) / q(d)); here 0.2 / 0.7 = 2/7, over 4000 seeds (+-5 sd)."""
    p = torch.tensor([[0.5, 0.3, 0.2, 0.0], [0.25, 0.25, 0.25, 0.25]])
    q = torch.tensor([[0.1, 0.1, 0.7, 0.1]])
    n = 4000
    acc = sum(accept_sampled(p, [2], q, gen(s)).accepted for s in range(n))
    rate, sd = 2 / 7, math.sqrt(2 / 7 * 5 / 7 / n)
    assert abs(acc / n - rate) < 5 * sd, (acc / n, rate)


def test_sampled_seeded_determinism():
    p = random_dist(4, 0)
    q = random_dist(3, 1)
    draft = [int(q[i].argmax()) for i in range(3)]
    verdicts = [accept_sampled(p, draft, q, gen(s)) for s in range(40)]
    again = [accept_sampled(p, draft, q, gen(s)) for s in range(40)]
    assert verdicts == again
    assert len({(tuple(v.tokens), v.accepted) for v in verdicts}) > 1  # and the seed does matter


# --------------------------------------------------------------------------------------------
# probs()


def logits_for(dist: list[float]) -> torch.Tensor:
    return torch.tensor([dist]).log()


def test_probs_temperature_is_softmax_of_scaled_logits():
    x = torch.randn(6, V, generator=gen(0)) * 3
    for t in (0.3, 0.8, 1.0, 1.7):
        torch.testing.assert_close(probs(x, SamplingParams(temperature=t)), (x / t).softmax(-1))


def test_probs_temperature_one_is_plain_softmax():
    x = torch.randn(6, V, generator=gen(1))
    torch.testing.assert_close(probs(x, SamplingParams(temperature=1.0)), x.softmax(-1))


@pytest.mark.parametrize("k", [1, 2, 3, V - 1, V, V + 3])
def test_probs_top_k_keeps_exactly_k(k):
    x = torch.randn(16, V, generator=gen(2)) * 2
    p = probs(x, SamplingParams(temperature=1.0, top_k=k))
    kk = min(k, V)
    top = x.topk(kk, -1).indices
    assert ((p > 0).sum(-1) == kk).all()
    assert nonzero(p) == [set(r.tolist()) for r in top]
    # the kept tokens keep their relative probabilities: softmax over the top k
    ref = torch.full_like(x, float("-inf")).scatter(-1, top, x.gather(-1, top)).softmax(-1)
    torch.testing.assert_close(p, ref)


def test_probs_top_k_ties_kept():
    x = torch.tensor([[2.0, 1.0, 1.0, 0.0]])
    p = probs(x, SamplingParams(temperature=1.0, top_k=2))
    assert nonzero(p) == [{0, 1, 2}]  # ties at the k-th value are all kept (documented "ties aside")


@pytest.mark.parametrize(
    "top_p,kept",
    [
        (0.3, [0.5]),  # the first token alone covers top_p: one-hot
        (0.6, [0.5, 0.25]),  # the token that crosses top_p is included
        (0.74, [0.5, 0.25]),
        (0.8, [0.5, 0.25, 0.15]),
        (0.95, [0.5, 0.25, 0.15, 0.1]),
        (1.0, [0.5, 0.25, 0.15, 0.1]),
    ],
)
def test_probs_top_p_smallest_prefix_reaching_mass(top_p, kept):
    dist = [0.15, 0.5, 0.1, 0.25]  # sorted: 0.5, 0.25, 0.15, 0.1
    p = probs(logits_for(dist), SamplingParams(temperature=1.0, top_p=top_p))[0]
    expect = torch.tensor([d if d in kept else 0.0 for d in dist])
    torch.testing.assert_close(p, expect / expect.sum())


def test_probs_top_p_first_token_dominant_is_one_hot():
    x = torch.randn(10, V, generator=gen(3))
    x[torch.arange(10), torch.arange(10) % V] += 8.0
    assert (x.softmax(-1).max(-1).values > 0.9).all()  # the top token alone covers top_p = 0.9
    p = probs(x, SamplingParams(temperature=1.0, top_p=0.9))
    torch.testing.assert_close(p, one_hot((torch.arange(10) % V).tolist()))


def test_probs_top_k_then_top_p_compose():
    """top-p applies to the distribution renormalised after top-k (temperature -> top-k -> top-p)."""
    dist = [0.5, 0.3, 0.2]
    x = logits_for(dist)
    # top-p 0.6 alone keeps {0.5, 0.3}; after top-k 2 the head is 0.5/0.8 = 0.625 >= 0.6: one-hot
    torch.testing.assert_close(probs(x, SamplingParams(temperature=1.0, top_p=0.6))[0], torch.tensor([0.625, 0.375, 0.0]))
    torch.testing.assert_close(probs(x, SamplingParams(temperature=1.0, top_k=2, top_p=0.6))[0], torch.tensor([1.0, 0.0, 0.0]))
    # top-p 0.7 after top-k 2 keeps both
    torch.testing.assert_close(probs(x, SamplingParams(temperature=1.0, top_k=2, top_p=0.7))[0], torch.tensor([0.625, 0.375, 0.0]))


def test_probs_temperature_then_filters():
    """Temperature is applied before top-p: a low temperature sharpens the head past top_p."""
    x = logits_for([0.5, 0.3, 0.2])
    assert (probs(x, SamplingParams(temperature=1.0, top_p=0.6))[0] > 0).sum() == 2
    torch.testing.assert_close(probs(x, SamplingParams(temperature=0.25, top_p=0.6))[0], torch.tensor([1.0, 0.0, 0.0]))


@pytest.mark.parametrize(
    "sp",
    [
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.5, top_k=3),
        SamplingParams(temperature=1.3, top_p=0.8),
        SamplingParams(temperature=0.8, top_k=4, top_p=0.9),
        SamplingParams(temperature=0.05, top_k=1),
    ],
    ids=["plain", "topk", "topp", "both", "near_greedy"],
)
def test_probs_rows_are_distributions(sp):
    x = torch.randn(32, V, generator=gen(4)) * 4
    p = probs(x, sp)
    assert p.shape == x.shape and p.dtype == torch.float32
    assert torch.isfinite(p).all() and (p >= 0).all()
    torch.testing.assert_close(p.sum(-1), torch.ones(32))
    assert (p.argmax(-1) == x.argmax(-1)).all()  # the mode survives every filter


# --------------------------------------------------------------------------------------------
# SamplingParams validation


@pytest.mark.parametrize(
    "kwargs,field",
    [
        ({"temperature": -0.5}, "temperature"),
        ({"temperature": float("inf")}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_p": -0.1}, "top_p"),
        ({"top_k": 0}, "top_k"),
        ({"top_k": -3}, "top_k"),
        ({"top_k": 2.5}, "top_k"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": -1}, "max_tokens"),
    ],
)
def test_sampling_params_invalid(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_sampling_params_valid_edges():
    assert SamplingParams(temperature=0.0).greedy
    assert not SamplingParams(temperature=1e-3).greedy
    SamplingParams(top_p=1.0, top_k=1, max_tokens=1)
    SamplingParams(top_p=1e-6)


@pytest.mark.parametrize("top_k,top_p", [(None, 0.9), (None, 0.999), (50, 0.95), (None, 0.3)])
def test_top_p_over_candidates_equals_the_full_sort(top_k, top_p):
    """Large vocabularies take top-p over the most likely candidates (growing them until they
    provably hold every kept token); the kept set and probabilities equal a full sort's."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 20000, generator=g) * torch.tensor([[0.5], [1.0], [2.0], [4.0], [8.0], [0.1]])
    sp = SamplingParams(temperature=1.0, top_k=top_k, top_p=top_p)
    got = probs(logits, sp)
    x = logits if top_k is None else logits.masked_fill(logits < logits.topk(top_k, -1).values[:, -1:], float("-inf"))
    p = x.softmax(-1)
    sorted_p, order = p.sort(-1, descending=True)
    drop = torch.zeros_like(p, dtype=torch.bool).scatter(-1, order, (sorted_p.cumsum(-1) - sorted_p) >= top_p)
    ref = p.masked_fill(drop, 0.0)
    ref = ref / ref.sum(-1, keepdim=True)
    assert torch.equal(got > 0, ref > 0)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-7)
    if top_k is None and top_p > 0.5:
        assert (got > 0).sum(-1).max() > 64  # the flat rows needed more than the first 64 candidates


def test_inverse_cdf_sample_never_draws_a_zero_probability_token():
    from verispec.sampling import sample

    p = torch.zeros(262144)
    p[[5, 70000, 262143]] = torch.tensor([0.2, 0.3, 0.5])
    g = torch.Generator().manual_seed(1)
    draws = [sample(p, g) for _ in range(3000)]
    assert set(draws) == {5, 70000, 262143}
    freq = torch.tensor([draws.count(t) for t in (5, 70000, 262143)]) / 3000
    assert (freq - torch.tensor([0.2, 0.3, 0.5])).abs().max() < 0.04


# --------------------------------------------------------------------------------------------
# the greedy shortcuts (argmax rows, no one-hot) against the general rule on one-hot rows


@pytest.mark.parametrize("seed", range(40))
def test_greedy_shortcuts_give_the_verdicts_of_the_general_rule(seed):
    """verify() on a greedy request (argmax of each row) = the general chain / tree rule on the
    one-hot rows `probs` makes, for drafts that match the argmax for a while, with no q, a one-hot q
    or an arbitrary q, on chains and on trees with siblings (ties in the logits included)."""
    from verispec.verify import TREE

    g = gen(seed)
    vocab, k = 6, 5
    logits = torch.randn(k + 1, vocab, generator=g).round(decimals=0)  # coarse values: ties happen
    best = logits.argmax(-1).tolist()
    greedy = SamplingParams(temperature=0.0)
    p = probs(logits, greedy)
    agree = int(torch.randint(0, k + 1, (), generator=g))
    chain = [best[i] if i < agree else int(torch.randint(0, vocab, (), generator=g)) for i in range(k)]
    for q in (None, one_hot(chain, vocab), random_dist(k, seed, vocab)):
        d = Draft(list(chain), q)
        assert CHAIN.verify(logits, d, greedy, gen(seed)) == CHAIN.accept(p, d, gen(seed))
    # a tree: root children 0, 1; node 0's children 2, 3; node 2's child 4 (tokens may repeat)
    parents = [-1, -1, 0, 0, 2]
    tokens = [int(torch.randint(0, vocab, (), generator=g)) for _ in parents]
    if seed % 2:
        tokens[1] = best[0]  # the second sibling is the argmax
    for q in (None, random_dist(len(parents), seed + 1, vocab)):
        d = Draft(list(tokens), q, parents=parents)
        general = TREE.walk(lambda node: p[node], d, gen(seed))
        assert TREE.verify(logits, d, greedy, gen(seed)) == general
