"""Which draft nodes to verify this step, across all requests, given each node's chance of
acceptance and what the step costs.

A node's survival S is the chance that it is accepted: its confidence times its parent's survival
(for a chain, the product over the positions up to it). It is also its expected contribution to
the step's output, so verifying the nodes A yields N + sum(S over A) tokens in expectation (each
of the N requests emits one token whatever happens).

The cost side follows this engine's verify forward. On the CPU, chains are packed (one entry per
node, engine._chain_forward): a step verifying B nodes of N requests costs what a forward of
N + B tokens costs, wherever the nodes are, so the best B nodes are the batch's top B by survival
(vLLM's global top-B) and

    theta(B) = (N + sum of the B largest survivals) / (draft_seconds + step_cost(N + B)).

`budget_throughput`, `keep_best`. Trees (and chains on devices where the engine pads) run as a
[N, 1 + W] batch, every request's window padded to the longest one: a step whose largest admitted
draft has W nodes costs

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

The same two rules pick a budget B or a window W from theta (`first_peak`, `argmax`):

- `plan_greedy` (DSpark's Algorithm 1, over windows): widen while theta rises. Admitting depth
  W + 1 depends only on the survivals of nodes in windows up to W + 1, whose confidences were known
  before any of those nodes' own tokens were drawn; so a node's admission never depends on its
  own token (docs/ARCHITECTURE.md, "Why adaptive budgets stay lossless"). Over packed budgets
  likewise: whether the node of rank B is in depends on the nodes ranked above it, and a node's
  descendants rank below it.
- `best_width` (no early stop): the argmax over all windows. Deeper windows hold confidences that
  depend on earlier drawn tokens, so the adaptive policy uses it only with survivals one step
  old, as vLLM does with its global top-B budget.
"""

from __future__ import annotations

from typing import Callable

WindowCost = Callable[[int], float]  # seconds of the step after drafting, by window W
BudgetCost = Callable[[int], list[float]]  # n -> seconds of the step after drafting for budgets 0..n (packed)


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


def global_order(survival: list[list[float]], floor: float = 0.0) -> list[tuple[int, int]]:
    """Every (request, node) with survival above `floor`, best first (ties: the earlier request,
    then the earlier node, so a request's parents and earlier siblings come before a node)."""
    nodes = [(-s, r, i) for r, ss in enumerate(survival) for i, s in enumerate(ss) if s > floor]
    return [(r, i) for _, r, i in sorted(nodes)]


def budget_throughput(survival: list[list[float]], draft_seconds: float, budget_cost: BudgetCost,
                      floor: float = 0.0) -> list[float]:
    """theta(B) for B = 0 .. the nodes above `floor`, verifying the batch's best B nodes (packed)."""
    order = global_order(survival, floor)
    costs = budget_cost(len(order))
    gain, out = float(len(survival)), []
    for B in range(len(order) + 1):
        if B:
            r, i = order[B - 1]
            gain += survival[r][i]
        out.append(gain / (draft_seconds + costs[B]))
    return out


def keep_best(survival: list[list[float]], budget: int, floor: float = 0.0) -> list[list[int]]:
    """The nodes each request verifies when the batch verifies its best `budget`, in node order."""
    kept: list[list[int]] = [[] for _ in survival]
    for r, i in global_order(survival, floor)[:budget]:
        kept[r].append(i)
    return [sorted(k) for k in kept]


def first_peak(theta: list[float]) -> int:
    """DSpark's early stop: widen while the expected throughput rises."""
    W = 0
    while W + 1 < len(theta) and theta[W + 1] > theta[W]:
        W += 1
    return W


def argmax(theta: list[float]) -> int:
    """The best entry (the smallest on ties)."""
    return max(range(len(theta)), key=lambda W: (theta[W], -W))


def keep(survival: list[list[float]], width: int) -> list[list[int]]:
    """The nodes each request verifies in a window of `width`: its best min(width, n), in node order."""
    return [sorted(request_order(ss)[:width]) for ss in survival]


def plan_greedy(survival: list[list[float]], draft_seconds: float, window_cost: WindowCost) -> int:
    """DSpark's Algorithm 1 over windows: widen while the expected throughput rises."""
    return first_peak(throughput(survival, draft_seconds, window_cost))


def best_width(survival: list[list[float]], draft_seconds: float, window_cost: WindowCost) -> int:
    """The window that maximises the expected throughput (the narrowest on ties)."""
    return argmax(throughput(survival, draft_seconds, window_cost))
