"""Which draft nodes to verify this step, across all requests, given each node's chance of
acceptance and what the step costs.

A node's survival S is the chance that it is accepted: its confidence times its parent's survival
(for a chain, the product over the positions up to it). It is also its expected contribution to
the step's output, so verifying the nodes A yields N + sum(S over A) tokens in expectation (each
of the N requests emits one token whatever happens).

The cost side follows this engine's verify forward, which pads every request's window to the
longest one: a step whose largest admitted draft has W nodes costs

    seconds(W) = draft_seconds + window_cost(W),
    window_cost(W) = body(N * (1 + W)) + head(N + sum over requests of min(W, n_r))

(the LM head runs on the real rows only; the policy passes window_cost for the whole batch, which
may hold requests the planner does not weigh: seeded sampled ones verify all they draft). So the
planners choose the window W, and every request verifies its best min(W, n) nodes: the padded
body costs nothing more, and a node's head row is the same whichever of a request's nodes it is. (In a packed, unpadded forward the cost would be step_cost(N + B) and the best
allocation vLLM's global top-B over survivals; with padding, the best set for a window W is each
request's top W, and no other set of the same width yields more.) The expected throughput is

    theta(W) = (N + sum over requests of its top-min(W, n) survivals) / seconds(W).

A request's nodes are ranked by survival, capped by the previous sibling's (`ranked_survival`),
so its top W are a subtree holding every kept node's parent and earlier siblings (a chain's
first W tokens).

- `plan_greedy` (DSpark's Algorithm 1, over windows): widen while theta rises. Admitting depth
  W + 1 depends only on the survivals of nodes in windows up to W + 1, whose confidences were known
  before any of those nodes' own tokens were drawn; so a node's admission never depends on its
  own token (docs/ARCHITECTURE.md, "Why adaptive budgets stay lossless").
- `best_width` (no early stop): the argmax over all windows. Deeper windows hold confidences that
  depend on earlier drawn tokens, so the adaptive policy uses it only with survivals one step
  old, as vLLM does with its global top-B budget.
"""

from __future__ import annotations

from typing import Callable

WindowCost = Callable[[int], float]  # seconds of the step after drafting, by window W


def ranked_survival(conf: list[float], parents: list[int] | None) -> list[float]:
    """Survival per node: conf times the parent's survival, capped by the previous sibling's, so
    that ranking by it (ties: earlier node first) admits parents before children and siblings in
    the order they were drawn."""
    out: list[float] = []
    last_child: dict[int, int] = {}
    for i, c in enumerate(conf):
        par = (i - 1) if parents is None else parents[i]
        s = c * (out[par] if par >= 0 else 1.0)
        if par in last_child:
            s = min(s, out[last_child[par]])
        last_child[par] = i
        out.append(s)
    return out


def request_order(survival: list[float]) -> list[int]:
    """A request's nodes, best first (ties: the earlier node)."""
    return sorted(range(len(survival)), key=lambda i: (-survival[i], i))


def throughput(survival: list[list[float]], draft_seconds: float, window_cost: WindowCost) -> list[float]:
    """theta(W) for W = 0 .. the largest draft."""
    N = len(survival)
    sums = [[0.0] for _ in survival]
    for r, ss in enumerate(survival):
        for i in request_order(ss):
            sums[r].append(sums[r][-1] + ss[i])
    widest = max((len(s) for s in survival), default=0)
    return [(N + sum(c[min(W, len(c) - 1)] for c in sums)) / (draft_seconds + window_cost(W))
            for W in range(widest + 1)]


def keep(survival: list[list[float]], width: int) -> list[list[int]]:
    """The nodes each request verifies in a window of `width`: its best min(width, n), in node order."""
    return [sorted(request_order(ss)[:width]) for ss in survival]


def plan_greedy(survival: list[list[float]], draft_seconds: float, window_cost: WindowCost) -> int:
    """DSpark's Algorithm 1 over windows: widen while the expected throughput rises."""
    theta = throughput(survival, draft_seconds, window_cost)
    W = 0
    while W + 1 < len(theta) and theta[W + 1] > theta[W]:
        W += 1
    return W


def best_width(survival: list[list[float]], draft_seconds: float, window_cost: WindowCost) -> int:
    """The window that maximises the expected throughput (the narrowest on ties)."""
    theta = throughput(survival, draft_seconds, window_cost)
    return max(range(len(theta)), key=lambda W: (theta[W], -W))
