"""Token trees: the n-gram trie, greedy identity, bits of the accepted path, KV compaction, and the
exact distribution of tree verification with siblings (i.i.d. and without replacement), with
negative controls that must fail."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from conftest import FAMILIES, build_hf, ours_from_hf
from test_greedy_lossless import prompts_for
from test_sampling_lossless import M, N, PLAIN, PROCESSED, PROMPT, V, exact_joint, marginals, models, null_thresholds  # noqa: F401
from verispec.distcheck import tv
from verispec.drafters import Draft, DrafterBase, NgramDrafter, TreeShape
from verispec.engine import Engine, EngineConfig
from verispec.kv import KV_BLOCK, round_up
from verispec.models.paths import PathViews
from verispec.sampling import SamplingParams, probs, sample
from verispec.sequence import SpecStats
from verispec.verify import TreeVerifier

pytestmark = pytest.mark.usefixtures("single_torch_thread")


# --------------------------------------------------------------------------------------------
# the n-gram trie


def _trie(tokens, budget, tree="dynamic:4", max_n=3):
    from verispec.sequence import Sequence

    s = Sequence(0, tokens, SamplingParams(), torch.Generator())
    s.tree = TreeShape.parse(tree)
    return NgramDrafter(max_n=max_n).propose([s], [budget])[0]


def test_trie_merges_the_continuations_of_every_match():
    # "1 2" occurs three times, followed by 3 4 | 3 5 | 7; the sequence ends with "9 1 2", which the
    # later two occurrences share (3 tokens of context), the first only "1 2" (2 tokens)
    seq = [1, 2, 3, 4, 9, 1, 2, 3, 5, 9, 1, 2, 7, 9, 1, 2]
    d = _trie(seq, budget=16, max_n=2)
    nodes = list(zip(d.tokens, d.parents))
    assert all(p < i for i, p in enumerate(d.parents))  # parents come first
    assert nodes[0] == (3, -1)  # two occurrences continue with 3: votes 3 + 2
    assert (7, -1) in nodes
    kids_of_3 = [t for t, p in nodes if p == 0]
    assert kids_of_3 == [5, 4]  # the continuation with the longer shared context first
    small = _trie(seq, budget=6, max_n=2)
    assert len(small.tokens) == 6 and 4 not in small.tokens  # the weakest branch is dropped first


def test_trie_respects_budget_and_branching():
    toks = [1, 2, 3, 4, 1, 2, 5, 6, 1, 2, 7, 8, 1, 2, 9, 9, 1, 2]
    assert len(_trie(toks, budget=3).tokens) == 3
    d = _trie(toks, budget=8, tree="static:2,1")
    roots = [t for t, p in zip(d.tokens, d.parents) if p == -1]
    assert len(roots) == 2  # two children at depth 0, then one per node
    per_parent = [sum(1 for p in d.parents if p == i) for i in range(len(d.tokens))]
    assert max(per_parent) <= 1
    assert _trie([1, 2, 3], budget=4).tokens == []  # no earlier occurrence of the suffix
    chain = _trie(toks, budget=4, tree="chain")
    assert chain.parents is None and chain.tokens == [9, 9, 1, 2]


def test_tree_shape_parse_errors():
    for bad in ("bush", "static:", "static:0,2", "dynamic:0", "static:a"):
        with pytest.raises(ValueError, match="tree shape"):
            TreeShape.parse(bad)
    assert TreeShape.parse("static:3,2").children(5) == 2 and TreeShape.parse("chain").is_chain


# --------------------------------------------------------------------------------------------
# greedy identity


def run(target, tree, prompts, k=8, max_tokens=24, max_batch=3, exact=False, drafter=None):
    cfg = EngineConfig(model="unused", drafter=None, draft_policy="fixed", num_draft_tokens=k, draft_tree=tree, dtype="float32",
                       max_batch_size=max_batch, max_model_len=96, exact=exact)
    eng = Engine(target, None, cfg, drafter if drafter is not None else (NgramDrafter(max_n=3) if tree else None))
    sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    seqs = [eng.add_request(p, sp) for p in prompts]
    while eng.has_work:
        eng.step()
    assert eng.cache.num_free == max_batch
    return [s.output_ids for s in seqs], seqs


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("tree", ["dynamic:3", "static:2,2,1"])
def test_greedy_tree_equals_plain(family, tree):
    hf = build_hf(family)
    target = ours_from_hf(hf)
    prompts = prompts_for(hf.config.vocab_size)
    plain, _ = run(target, "chain", prompts, k=0)
    batched, seqs = run(target, tree, prompts)
    assert batched == plain
    assert sum(s.stats.accepted for s in seqs) > 0
    assert any(s.stats.drafted > s.stats.forwards for s in seqs)  # trees with more than one node per step
    alone = [run(target, tree, [p], max_batch=1)[0][0] for p in prompts[:2]]
    assert alone == plain[:2]


def test_greedy_mixed_chain_and_tree_requests_in_one_batch():
    hf = build_hf("llama")
    target = ours_from_hf(hf)
    prompts = prompts_for(hf.config.vocab_size)
    plain, _ = run(target, "chain", prompts, k=0)
    cfg = EngineConfig(model="unused", drafter=None, draft_policy="fixed", num_draft_tokens=8, dtype="float32", max_batch_size=5,
                       max_model_len=96)
    eng = Engine(target, None, cfg, NgramDrafter())
    sp = SamplingParams(max_tokens=24, ignore_eos=True)
    seqs = [eng.add_request(p, sp, k, tree) for p, k, tree in
            zip(prompts, [8, 3, 8, 0, 5], ["dynamic", "chain", "static:3,1", "dynamic", "dynamic:2"])]
    while eng.has_work:
        eng.step()
    assert [s.output_ids for s in seqs] == plain


# --------------------------------------------------------------------------------------------
# bits: the accepted path does not depend on the tree around it


@torch.inference_mode()
def test_path_bits_do_not_depend_on_the_tree_bf16():
    """Every node of a random tree gets exactly the logits and KV rows that a chain forward of its
    root path produces (bf16, batch-invariant mode), for trees in a batch beside a chain."""
    hf = build_hf("gemma3")
    model = ours_from_hf(hf).to(torch.bfloat16).set_batch_invariant(True)
    Vv = hf.config.vocab_size
    g = torch.Generator().manual_seed(3)
    prompt = torch.randint(0, Vv, (1, 37), generator=g)
    cache = model.new_cache(3, KV_BLOCK)
    for slot in range(3):
        model(prompt, cache, [slot], torch.tensor([0]), kv_len=round_up(37, KV_BLOCK))
        cache.commit(slot, 37)
    for trial in range(6):
        n = 9
        parents = [0] + [int(torch.randint(0, i, (1,), generator=g)) for i in range(1, n)]  # node i's parent < i
        toks = torch.randint(0, Vv, (n + 1,), generator=g).tolist()  # node 0 = root
        depth = [0] * (n + 1)
        for i in range(1, n + 1):
            depth[i] = depth[parents[i - 1]] + 1
        start = 37
        T = n + 1
        Lk = round_up(start + T, KV_BLOCK)
        chain = torch.randint(0, Vv, (T,), generator=g).tolist()
        ids = torch.tensor([toks, chain])
        pos = torch.tensor([[start + d for d in depth], list(range(start, start + T))])
        pv = PathViews.build([0, 1], [start, start], [parents, list(range(n))], T, Lk, "cpu")
        out = model(ids, cache, [0, 1], torch.tensor([start, start]), positions=pos, paths=pv, kv_len=Lk)
        for leaf in range(1, n + 1):
            path = [leaf]
            while path[-1] != 0:
                path.append(parents[path[-1] - 1])
            path.reverse()
            ref = model(torch.tensor([[toks[i] for i in path]]), cache, [2], torch.tensor([start]),
                        kv_len=round_up(start + len(path), KV_BLOCK))
            assert torch.equal(ref.logits[0], out.logits[0, path]), (trial, leaf, path)
            for layer in (0, len(cache.k) - 1):
                assert torch.equal(cache.k[layer][2, :, start : start + len(path)], cache.k[layer][0, :, [start + i for i in path]])
        # the chain beside the trees equals a plain chain forward
        ref = model(torch.tensor([chain]), cache, [2], torch.tensor([start]), kv_len=Lk)
        assert torch.equal(ref.logits[0], out.logits[1])


@torch.inference_mode()
def test_kv_after_compaction_equals_plain_decoding_bf16():
    """After tree steps with compaction, the slot's KV rows equal those plain decoding writes for
    the same tokens (bf16, batch-invariant), bit for bit."""
    hf = build_hf("qwen3")
    target = ours_from_hf(hf).to(torch.bfloat16)
    prompts = prompts_for(hf.config.vocab_size, lengths=(9,))

    def engine(tree, k):
        cfg = EngineConfig(model="unused", drafter=None, draft_policy="fixed", num_draft_tokens=k, draft_tree=tree, dtype="bfloat16",
                           max_batch_size=1, max_model_len=96)
        return Engine(target, None, cfg, NgramDrafter() if k else None)

    tree_eng, plain_eng = engine("dynamic:3", 8), engine("chain", 0)
    sp = SamplingParams(max_tokens=40, ignore_eos=True)
    ts, ps = tree_eng.add_request(prompts[0], sp), plain_eng.add_request(prompts[0], sp)
    for _ in range(5):
        tree_eng.step()
    L = tree_eng.cache.lengths[ts.slot]
    assert ts.stats.accepted > 0 and L > len(prompts[0]) + 5
    while plain_eng.cache.lengths[ps.slot] < L:
        plain_eng.step()
    assert ps.tokens[:L] == ts.tokens[:L]
    for kc, kp, vc, vp in zip(tree_eng.cache.k, plain_eng.cache.k, tree_eng.cache.v, plain_eng.cache.v):
        assert torch.equal(kc[ts.slot, :, :L], kp[ps.slot, :, :L])
        assert torch.equal(vc[ts.slot, :, :L], vp[ps.slot, :, :L])


# --------------------------------------------------------------------------------------------
# the exact distribution of tree verification


class SiblingTreeDrafter(DrafterBase):
    """Draws a 2-level tree (3 children of the root, 2 under each) from a draft distribution q that
    depends on the path (a fixed random function, far from the target), with the request's
    generator: siblings without replacement (the default) or i.i.d. `claim_iid` is what the draft
    tells the verifier; a draft whose claim is false is a negative control."""

    name = "sibling-tree"

    def __init__(self, iid=False, claim_iid=None, widths=(3, 2)):
        self.iid, self.claim_iid, self.widths = iid, iid if claim_iid is None else claim_iid, widths

    def _q(self, ctx: list[int], params) -> torch.Tensor:
        g = torch.Generator().manual_seed(hash(tuple(ctx)) % (2**31))
        return probs(torch.randn(1, V, generator=g) * 1.5, params)[0]

    def _children(self, q, n, gen) -> list[int]:
        out, qq = [], q.clone()
        for _ in range(n):
            if qq.sum() <= 0:
                break
            t = sample(qq if not self.iid else q, gen)
            out.append(t)
            if not self.iid:
                qq[t] = 0.0
        return out

    def propose(self, seqs, budgets):
        drafts = []
        for s, b in zip(seqs, budgets):
            toks, parents, qs = [], [], []
            q0 = self._q(s.tokens, s.params)
            for t in self._children(q0, self.widths[0], s.generator):
                if len(toks) >= b:
                    break
                toks.append(t), parents.append(-1), qs.append(q0)
            for i in [i for i, p in enumerate(parents) if p == -1]:
                q1 = self._q(s.tokens + [toks[i]], s.params)
                for t in self._children(q1, self.widths[1], s.generator):
                    if len(toks) >= b:
                        break
                    toks.append(t), parents.append(i), qs.append(q1)
            drafts.append(Draft(toks, qs, parents, iid=self.claim_iid))
        return drafts


def _check(target, hf, drafter, sp, seed0):
    cfg = EngineConfig(model="unused", drafter=None, draft_policy="fixed", num_draft_tokens=9, dtype="float32", max_batch_size=512,
                       max_model_len=16)
    eng = Engine(target, None, cfg, drafter)
    seqs = [eng.add_request(PROMPT, dataclasses.replace(sp, seed=seed0 + i), tree="dynamic") for i in range(N)]
    while eng.has_work:
        eng.step()
    outs = [s.output_ids for s in seqs]
    codes = torch.tensor([sum(x * V ** (M - 1 - j) for j, x in enumerate(o)) for o in outs])
    counts = torch.bincount(codes, minlength=V**M).double()
    exact = exact_joint(hf, sp)
    stats = SpecStats()
    for s in seqs:
        stats.merge(s.stats)
    thr = null_thresholds(exact, N)["joint"][0]
    return tv(counts, exact).item(), thr, stats


TREE_CASES = [("wor", "plain"), ("wor", "processed"), ("iid", "plain"), ("ngram", "plain"), ("ngram", "processed")]


@pytest.mark.parametrize("kind,setting", TREE_CASES)
def test_tree_sampling_is_distributed_as_the_target(models, kind, setting):
    hf, target, _ = models
    sp = {"plain": PLAIN, "processed": PROCESSED}[setting]
    drafter = {"wor": SiblingTreeDrafter(), "iid": SiblingTreeDrafter(iid=True), "ngram": NgramDrafter()}[kind]
    t, thr, stats = _check(target, hf, drafter, sp, seed0=7_000_000 + 100_000 * TREE_CASES.index((kind, setting)))
    print(f"\n[tree {kind}/{setting}] TV={t:.4f} threshold={thr:.4f} acceptance {stats.acceptance_rate:.3f} tau {stats.tau:.3f}")
    assert stats.drafted > (stats.forwards if kind != "ngram" else N) and 0 < stats.accepted
    assert t < thr, f"TV {t:.4f} >= threshold {thr:.4f}: tree verification is not distributed as the target"


def _forget_residual(self, logits, draft, params, generator):
    """WRONG on purpose: a rejected sibling does not update the residual (p stays the target's)."""
    children = [[] for _ in range(len(draft.tokens) + 1)]
    for i, par in enumerate(draft.parents):
        children[par + 1].append(i)
    node, path, tokens = 0, [], []
    while True:
        p = probs(logits[node : node + 1], params)[0]
        chosen = None
        removed = []
        for i in children[node]:
            x = draft.tokens[i]
            q = TreeVerifier._q(draft, i, removed, p)
            if float(torch.rand((), generator=generator)) * float(q[x]) < float(p[x]):
                chosen = i
                break
            removed.append(x)
        if chosen is None:
            tokens.append(sample(p, generator))
            return type("V", (), {"tokens": tokens, "accepted": len(path), "path": path})()
        tokens.append(draft.tokens[chosen])
        path.append(chosen)
        node = chosen + 1


@pytest.mark.parametrize("control", ["iid_rule_on_draws_without_replacement", "forgets_residual_update"])
def test_tree_check_has_teeth(models, monkeypatch, control):
    hf, target, _ = models
    if control == "forgets_residual_update":
        monkeypatch.setattr(TreeVerifier, "verify", _forget_residual)
        drafter = SiblingTreeDrafter()
    else:
        drafter = SiblingTreeDrafter(iid=False, claim_iid=True)
    t, thr, stats = _check(target, hf, drafter, PLAIN, seed0=9_000_000)
    assert stats.drafted > 0
    assert t > thr, f"a wrong tree verifier passed the check (TV {t:.4f} <= threshold {thr:.4f})"


# --------------------------------------------------------------------------------------------
# model drafters: EAGLE-2 dynamic trees and static shapes


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("tree", ["dynamic:3", "static:3,2,1"])
def test_greedy_model_drafter_tree_equals_plain(family, tree):
    from test_greedy_lossless import noisy_copy
    from verispec.drafters import ModelDrafter

    hf = build_hf(family)
    target = ours_from_hf(hf)
    prompts = prompts_for(hf.config.vocab_size)
    plain, _ = run(target, "chain", prompts, k=0)
    for drafter in (ModelDrafter(noisy_copy(target), 3, 96 + 9), ModelDrafter(target, 3, 96 + 9, num_layers=1)):
        batched, seqs = run(target, tree, prompts, drafter=drafter)
        assert batched == plain
        assert sum(s.stats.accepted for s in seqs) > 0
        assert all(s.stats.drafted > s.stats.forwards for s in seqs)  # several nodes per step


def test_model_drafter_tree_is_the_best_first_expansion():
    """The dynamic tree keeps the highest cumulative-probability nodes, so with the target drafting
    for itself (a perfect drafter) the greedy path is in every tree down to its deepest level:
    every drafted position is accepted."""
    from verispec.drafters import ModelDrafter

    hf = build_hf("llama")
    target = ours_from_hf(hf)
    prompts = prompts_for(hf.config.vocab_size)
    plain, _ = run(target, "chain", prompts, k=0)
    out, seqs = run(target, "dynamic:2", prompts, k=6, drafter=ModelDrafter(target, 3, 96 + 7))
    assert out == plain
    for s in seqs:
        assert s.stats.accepted_at == s.stats.drafted_at and len(s.stats.drafted_at) >= 2
        assert s.stats.drafted > s.stats.accepted  # more nodes than the path: a real tree


def test_on_commit_sees_every_committed_token_once_with_its_hidden_state():
    """Prefill chunks and tree steps: on_commit is told about each committed token exactly once,
    in order, with the target's hidden state of that token (the accepted path's rows, not the
    tree's other nodes)."""
    hf = build_hf("llama")
    target = ours_from_hf(hf)
    calls = []

    class Recorder(NgramDrafter):
        target_taps = (0, -1)

        def on_commit(self, seq, start, hidden):
            calls.append((start, hidden[0].clone(), hidden[-1].clone()))

    cfg = EngineConfig(model="unused", drafter=None, draft_policy="fixed", num_draft_tokens=8, draft_tree="dynamic:3", dtype="float32",
                       max_batch_size=1, max_model_len=96, prefill_chunk=5)
    eng = Engine(target, None, cfg, Recorder())
    prompt = prompts_for(hf.config.vocab_size, lengths=(11,))[0]
    seq = eng.add_request(prompt, SamplingParams(max_tokens=30, ignore_eos=True))
    while eng.has_work:
        eng.step()
    assert seq.stats.accepted > 0
    starts = [c[0] for c in calls]
    lengths = [c[1].shape[0] for c in calls]
    assert starts == [sum(lengths[:i]) for i in range(len(calls))]  # contiguous, no gaps, no repeats
    n = sum(lengths)
    assert n == len(seq.tokens) - 1 or n == len(seq.tokens)  # everything but (at most) the last token
    ref = target(torch.tensor([seq.tokens[:n]]), target.new_cache(1, 128), [0], torch.tensor([0]), taps=(0,))
    torch.testing.assert_close(torch.cat([c[1] for c in calls]), ref.hidden[0][0], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(torch.cat([c[2] for c in calls]), ref.last_hidden[0], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("tree", [None, "dynamic:3", "static:3,2,1"])
@pytest.mark.parametrize("params", [SamplingParams(), SamplingParams(temperature=0.8, top_k=5, top_p=0.9, seed=7),
                                    SamplingParams(temperature=1.3, seed=3)], ids=["greedy", "topk-topp", "t1.3"])
def test_drafting_over_draft_vocabulary_columns_equals_drafting_over_the_scattered_logits(tree, params):
    """A drafter with a reduced vocabulary drafts over its Vd columns (expand.Columns) and gets the same
    tokens, parents, features and (target-vocabulary) q as from its logits scattered into the target's
    vocabulary with -inf elsewhere -- the same request generator draws included."""
    from verispec.drafters import expand
    from verispec.sequence import Sequence

    V, Vd = 97, 23
    g = torch.Generator().manual_seed(0)
    ids = torch.randperm(V, generator=g)[:Vd].sort().values
    table = torch.randn(V, 4, Vd, generator=g) * 2  # node logits: a function of (token, depth)
    root = torch.randn(2, Vd, generator=g) * 2

    def run(columns):
        seqs = []
        for i in range(2):
            s = Sequence(i, [1, 2, 3], params, torch.Generator().manual_seed(11 + i))
            s.tree = TreeShape.parse(tree) if tree else None
            seqs.append(s)
        wide = (lambda lg: lg) if columns else (lambda lg: torch.full((lg.shape[0], V), float("-inf")).index_copy_(1, ids, lg))

        def step(run_nodes, nodes):
            return [wide(torch.stack([table[nodes[b][i].token, nodes[b][i].depth % 4] for i in r])) if r else None
                    for b, r in enumerate(run_nodes)]

        return expand.draft(seqs, [5, 4], wide(root), step, expand.Columns(ids, V) if columns else None)

    for a, b in zip(run(True), run(False)):
        assert a.tokens == b.tokens and a.parents == b.parents
        # the confidence feature: a logsumexp over 23 or 97 terms (-inf included)
        torch.testing.assert_close(torch.tensor(a.features), torch.tensor(b.features), rtol=1e-5, atol=1e-5)
        assert len(a.tokens) > 0 and set(a.tokens) <= set(ids.tolist())
        assert (a.q is None) == (b.q is None)
        if a.q is not None:
            assert a.q.shape == (len(a.tokens), V)
            torch.testing.assert_close(a.q, b.q, rtol=0, atol=1e-7)
