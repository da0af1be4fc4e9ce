"""Chain and tree drafting with any model-like drafter: one loop shared by the draft-model,
layer-skip, EAGLE-3 and MTP drafters.

The drafter supplies the root distribution (its logits after the last committed token) and a
`step` that runs new nodes and returns their logits; this module decides which nodes to run.

- Chain (branching 1): each token is drawn from q = probs(logits, request params) with the
  request's generator, and q goes to the verifier (Leviathan et al.'s rule; greedy is one-hot q).
- Tree (EAGLE-2, Li et al. 2024): nodes are scored by their cumulative draft probability
  (product of the softmax probabilities along the path). Each depth expands the best
  `width` nodes of the frontier, each with its `width` most likely children (a static shape:
  exactly its branching at that depth), for up to `max_depth` depths; then the best `budget`
  nodes overall are kept (a child never outscores its parent, so they form a tree). Children
  are the top-k of the draft distribution, a deterministic function of the context, so the
  verifier uses the one-hot rule (q = None): lossless under greedy and sampling alike
  (docs/ARCHITECTURE.md).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch

from ..adaptive.estimator import logit
from ..sampling import probs, sample
from .base import CHAIN, Draft


@dataclass
class Node:
    token: int
    parent: int  # index among this sequence's expanded nodes, -1: the root
    depth: int  # 1 = a child of the root
    score: float  # log of the cumulative draft probability


# step(run, nodes) -> logits: run[b] lists indices into nodes[b] of the nodes to run for sequence b
# now (their parents were run before, or are the root); returns one [len(run[b]), Vd] tensor of
# logits per sequence (None where run[b] is empty), over the drafter's columns (see `Columns`).
Step = Callable[[list[list[int]], list[list[Node]]], list]


@dataclass(frozen=True)
class Columns:
    """What the columns of a drafter's logits are: the target ids `ids` [Vd] (increasing) of a
    reduced draft vocabulary, out of the target's `vocab_size`.

    Drafting over the Vd columns instead of scattering every step's logits into the target's
    vocabulary (262k for Gemma 3, 32x a draft vocabulary of 8192) gives the same drafts: a token
    outside the draft vocabulary has probability 0, so the argmax, the top-k, the log-softmax and
    the top-p set are the same, and the sampler's inverse running total (sampling.sample) meets
    the same token at the same uniform draw because the ids are increasing. Only a sampled chain's
    q goes to the verifier over the target's vocabulary (`full`)."""

    ids: torch.Tensor  # [Vd] int64, increasing
    vocab_size: int

    def full(self, q: torch.Tensor) -> torch.Tensor:
        """q [Vd] -> [V], zero outside the draft vocabulary."""
        return q.new_zeros(self.vocab_size).index_copy_(0, self.ids, q)


def _target_id(columns: Columns | None, i: int) -> int:
    return i if columns is None else int(columns.ids[i])


def draft(seqs, budgets: list[int], root_logits: torch.Tensor, step: Step,
          columns: Columns | None = None) -> list[Draft]:
    """root_logits [B, Vd]: the drafter's logits after each sequence's last committed token, over
    `columns` (None: the target's whole vocabulary, Vd = V)."""
    if all((s.tree or CHAIN).is_chain for s in seqs):
        return _chains(seqs, budgets, root_logits, step, columns)
    return _trees(seqs, budgets, root_logits, step, columns)


def draft_parallel(seqs, budgets: list[int], depth_logits: list[torch.Tensor],
                   columns: Columns | None = None) -> list[Draft]:
    """Chains or trees for a drafter whose one forward gave every depth's distribution at once,
    independent of the tokens drafted before it (P-EAGLE, DFlash): depth_logits[b] [k_b, Vd] is
    sequence b's logits (over `columns`) for depths 1..k_b; a node's children come from the next
    depth's row whatever the node's token."""

    def step(run, nodes):
        return [torch.stack([depth_logits[b][nodes[b][i].depth] for i in r]) if r else None
                for b, r in enumerate(run)]

    return draft(seqs, budgets, torch.stack([d[0] for d in depth_logits]), step, columns)


def _chains(seqs, budgets, root_logits, step, columns) -> list[Draft]:
    B = len(seqs)
    qs: list[list[torch.Tensor]] = [[] for _ in range(B)]
    feats: list[list[list[float]]] = [[] for _ in range(B)]
    nodes: list[list[Node]] = [[] for _ in range(B)]
    logits = list(root_logits)
    for j in range(max(budgets, default=0)):
        run: list[list[int]] = [[] for _ in range(B)]
        for b, s in enumerate(seqs):
            if j >= budgets[b]:
                continue
            # confidence feature: the largest probability of the distribution the node is drawn
            # from (greedy: of the unscaled draft distribution, since q is one-hot)
            if s.params.greedy:  # the argmax, with q = None (the verifier's one-hot rule: the same
                # acceptance as a one-hot q, without a [V] tensor per node); log max softmax = max - logsumexp
                lg = logits[b].float()
                i = int(lg.argmax())  # the first maximum, as probs() picks it
                top = math.exp(float(lg[i] - lg.logsumexp(-1)))
            else:
                q = probs(logits[b].float()[None], s.params)[0]
                qs[b].append(q if columns is None else columns.full(q))
                top, i = float(q.max()), sample(q, s.generator)
            tok = _target_id(columns, i)
            feats[b].append([logit(top)])
            nodes[b].append(Node(tok, len(nodes[b]) - 1, j + 1, 0.0))
            if j + 1 < budgets[b]:  # its logits are needed only if the chain goes on
                run[b].append(len(nodes[b]) - 1)
        if not any(run):
            break
        out = step(run, nodes)
        for b in range(B):
            if run[b]:
                logits[b] = out[b][0]
    # greedy chains carry q = None: their tokens are the argmax, a deterministic function of the context
    return [Draft([n.token for n in ns], torch.stack(q) if q else None, features=f) for ns, q, f in zip(nodes, qs, feats)]


def _trees(seqs, budgets, root_logits, step, columns) -> list[Draft]:
    B = len(seqs)
    nodes: list[list[Node]] = [[] for _ in range(B)]  # every candidate, parents before children
    frontier: list[list[tuple[int, torch.Tensor]]] = [[(-1, root_logits[b])] for b in range(B)]  # (node, logits)
    shapes = [s.tree or CHAIN for s in seqs]
    depth_cap = [_max_depth(sh, k) if k > 0 else 0 for sh, k in zip(shapes, budgets)]
    for d in range(max(depth_cap, default=0)):
        run: list[list[int]] = [[] for _ in range(B)]
        for b in range(B):
            if d >= depth_cap[b]:
                continue
            sh = shapes[b]
            first = len(nodes[b])
            for parent, lg in frontier[b]:
                top = lg.float().log_softmax(-1).topk(sh.children(d))
                base = _score(nodes[b], parent)
                for lp, t in zip(top.values.tolist(), top.indices.tolist()):
                    nodes[b].append(Node(_target_id(columns, t), parent, d + 1, base + lp))
            if not sh.dynamic:  # a static shape stops growing once it holds the budget
                del nodes[b][budgets[b]:]
            if d + 1 < depth_cap[b]:  # expand next: the best `width` new nodes (static: all of them)
                new = list(range(first, len(nodes[b])))
                if sh.dynamic:
                    new = sorted(new, key=lambda i: (-nodes[b][i].score, i))[: sh.children(0)]
                run[b] = sorted(new)
        out = step(run, nodes) if any(run) else [None] * B
        for b in range(B):
            frontier[b] = [(i, out[b][j]) for j, i in enumerate(run[b])]
        if not any(frontier):
            break
    return [_select(n, k) for n, k in zip(nodes, budgets)]


def _max_depth(shape, budget: int) -> int:
    if shape.dynamic:
        return max(1, min(budget, 2 + budget // max(1, shape.children(0))))
    return budget


def _score(nodes: list[Node], i: int) -> float:
    return 0.0 if i < 0 else nodes[i].score


def _select(nodes: list[Node], budget: int) -> Draft:
    """The best `budget` nodes (ties: earlier first), renumbered parents-first."""
    if budget <= 0 or not nodes:
        return Draft([], None, [])
    keep = sorted(range(len(nodes)), key=lambda i: (-nodes[i].score, i))[:budget]
    keep.sort()  # run order puts parents before children; a child never outscores its parent
    index = {-1: -1}
    for i in keep:
        index[i] = len(index) - 1
    # confidence feature: the node's own draft probability given its parent (the children are
    # the top-k, a deterministic function of the context, so this is known before any draw)
    feats = [[logit(math.exp(nodes[i].score - _score(nodes, nodes[i].parent)))] for i in keep]
    return Draft([nodes[i].token for i in keep], None, [index[nodes[i].parent] for i in keep], features=feats)
