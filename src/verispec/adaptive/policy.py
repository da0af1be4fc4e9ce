"""The adaptive draft-length policy: per step, verify only the draft nodes worth their cost.

The engine calls, every decode step:
1. `budgets(seqs, cap)`: how many nodes each request may draft (its own `num_draft_tokens`);
2. `admit(seqs, drafts, draft_seconds)`: which drafted nodes to verify. The estimator scores each
   node from the drafter's features (never from the node's own token), the planner picks the
   nodes that maximise expected tokens per second against the step cost (`StepCost`: the
   measured profile, calibrated by the times of the steps the engine really ran);
3. `observe(seqs, drafts, verdicts)`: the verifier's verdicts become the estimator's labels, and
   the time since `admit` the step cost at this forward's token count and LM head rows.

Planners (planner.py): "greedy" (DSpark's Algorithm 1 over verify windows: current survivals,
early stop) or "topb" (no early stop: the window that was best by the previous step's survivals,
its slots filled by the current ones, as vLLM sizes its global top-B budget). Both serve sampled
requests with drafts drawn at random; a step where nothing was (every request greedy, or every
draft deterministic: the n-gram lookup) takes the best window by the current survivals, since
then no admission rule can change the output.
"""

from __future__ import annotations

import time
from typing import Callable

from ..drafters.base import Draft
from ..sequence import Sequence
from ..verify import Verdict
from .costs import CostProfile, DraftCost, StepCost
from .estimator import AcceptanceEstimator
from .planner import best_width, keep, plan_greedy, ranked_survival

PLANNERS = ("greedy", "topb")


class AdaptiveDraftLength:
    # While nothing pays, probe steps verify one token per request whatever the planner says
    # (otherwise a policy that starts, or lands, where its estimates say nothing pays would never
    # see a verdict again). The interval from the last verified window to a probe starts at 8 and
    # doubles with every probe, up to 256, over the policy's life: probing costs little where
    # speculation really does not pay (at 64 requests a probe step costs about 1.8 plain steps),
    # and where it does the planner verifies windows itself. A dear drafter drafts only on probes.
    PROBE_EVERY = 8
    PROBE_MAX = 256
    CHEAP_DRAFT = 0.05  # drafting under 5% of a plain step's time: always draft the full k

    def __init__(self, profile: "CostProfile | Callable[[], CostProfile]", planner: str = "greedy",
                 max_depth: int = 64, refit_every: int = 100):
        if planner not in PLANNERS:
            raise ValueError(f"unknown planner {planner!r}; choose from {', '.join(PLANNERS)}")
        self._profile = profile  # a CostProfile, or a function that measures or loads one on first use
        self.planner = planner
        self.estimator = AcceptanceEstimator(max_depth, refit_every)
        self.draft_cost = DraftCost()
        self._step_cost: StepCost | None = None
        self._verify_started: tuple[int, int, int, float] | None = None  # (num_reqs, window, head rows, perf_counter)
        self.steps = 0
        self.width = None  # the window chosen last step (None: no step yet)
        self._probe = False  # this step is a probe (budgets): it verifies at least one node per draft
        self._probe_every = self.PROBE_EVERY
        self._next_probe = 0
        self._stale_width: int | None = None  # topb: the best window by last step's survivals
        self._pending: dict[int, list[float]] = {}  # seq id -> confidences of its admitted nodes
        self.last_drafted = 0  # nodes drafted / admitted in the last step (metrics)
        self.last_admitted = 0

    @property
    def profile(self) -> CostProfile:
        if not isinstance(self._profile, CostProfile):
            self._profile = self._profile()
        return self._profile

    @property
    def step_cost(self) -> StepCost:
        if self._step_cost is None:
            self._step_cost = StepCost(self.profile)
        return self._step_cost

    def budgets(self, seqs: list[Sequence], cap: int) -> list[int]:
        """How many nodes each request may draft: its own k when drafting is cheap (under
        CHEAP_DRAFT of a plain step: the n-gram lookup), since the planner then chooses among the
        drafted nodes at almost no cost. A dear drafter (a model's forward per node) drafts at most
        two more than last step's window, and nothing after a step that verified nothing, but on
        probe steps. Only past steps decide this."""
        self.steps += 1
        self._probe = self.width == 0 and self.steps >= self._next_probe
        if self._probe:
            self._next_probe = self.steps + self._probe_every
            self._probe_every = min(2 * self._probe_every, self.PROBE_MAX)
        elif self.width:  # a verified window gave verdicts: the next probe is an interval from here
            self._next_probe = self.steps + self._probe_every
        n = len(seqs)
        if self.width is None or self._probe or self.draft_cost(n) <= self.CHEAP_DRAFT * self.step_cost(n):
            adaptive_cap = cap  # (the step cost, medians over every seen count, is read only when it decides)
        else:
            adaptive_cap = min(cap, self.width + 2) if self.width else 0
        return [max(0, min(s.num_draft_tokens, cap if pinned(s) else adaptive_cap, s.params.max_tokens - s.num_output - 1))
                for s in seqs]

    def admit(self, seqs: list[Sequence], drafts: list[Draft], draft_seconds: float) -> list[Draft]:
        self.last_drafted = sum(len(d.tokens) for d in drafts)
        if not self.last_drafted:  # nothing to plan; the window stays as it was
            self.last_admitted = 0
            self._verify_started = (len(seqs), 0, len(seqs), time.perf_counter())
            return drafts
        self.draft_cost.record(len(seqs), draft_seconds)
        conf = self.estimator.predict_many([d.features for d in drafts], [d.depths() for d in drafts])
        surv = [ranked_survival(c, d.parents) for c, d in zip(conf, drafts)]
        n, dsec = len(seqs), self.draft_cost(len(seqs))
        pins = [pinned(s) for s in seqs]
        widest = max(len(d.tokens) for d in drafts)
        # LM head rows at each window: every request's root, a free draft's first min(W, n) nodes, a pinned one's all
        pinned_rows = sum(len(d.tokens) for d, p in zip(drafts, pins) if p)
        head_rows = [n + pinned_rows + sum(min(W, len(d.tokens)) for d, p in zip(drafts, pins) if not p)
                     for W in range(widest + 1)]
        cost = self.step_cost.table(n, widest, head_rows).__getitem__  # seconds by window
        free = [sv for sv, p in zip(surv, pins) if not p]  # the planner weighs the others only
        if all(s.params.greedy or d.q is None for s, d in zip(seqs, drafts)):
            # nothing drawn at random (greedy requests, deterministic drafts): any admission rule is
            # lossless, so the best window by the current survivals (no early stop at a local maximum)
            width = self._stale_width = best_width(free, dsec, cost)
        elif self.planner == "greedy":
            width = plan_greedy(free, dsec, cost)
        else:
            best = best_width(free, dsec, cost)
            width = best if self._stale_width is None else self._stale_width
            self._stale_width = best  # used next step only: its survivals are then history
        self.width = width
        if self._probe:
            width = max(width, 1)
        # a pinned draft widens the window for everyone, at no further cost
        width = max([width] + [len(d.tokens) for d, p in zip(drafts, pins) if p])
        out = []
        for s, d, c, k, p in zip(seqs, drafts, conf, keep(surv, width), pins):
            k = list(range(len(d.tokens))) if p else k
            out.append(d.select(k))
            self._pending[s.id] = [c[i] for i in k]
        self.last_admitted = sum(len(d.tokens) for d in out)
        self._verify_started = (n, max(len(d.tokens) for d in out), n + self.last_admitted, time.perf_counter())
        return out

    def observe(self, seqs: list[Sequence], drafts: list[Draft], verdicts: list[Verdict]) -> None:
        if self._verify_started is not None:  # the step's time after drafting, by forward size and head rows
            n, width, rows, t0 = self._verify_started
            self.step_cost.record(n * (1 + width), time.perf_counter() - t0, rows, n)
            self._verify_started = None
        for s, d, v in zip(seqs, drafts, verdicts):
            conf = self._pending.pop(s.id, [])
            if not d.tokens:
                continue
            idx, labels = observations(d, v)
            feats = None if d.features is None else [d.features[i] for i in idx]
            depths = d.depths()
            self.estimator.observe(feats, [depths[i] for i in idx], labels, [conf[i] for i in idx])
        self.estimator.end_step()


def pinned(seq: Sequence) -> bool:
    """A sampled request with its own seed always verifies its whole draft (up to its k): its
    output then depends only on the seed, not on the load or the timing that steer the windows
    (the adaptive policy keeps every request's distribution exact, but not its realization)."""
    return seq.params.seed is not None and not seq.params.greedy


def observations(draft: Draft, verdict: Verdict) -> tuple[list[int], list[int]]:
    """The censored observations of a verified draft: nodes whose parent was accepted (the root
    always is) and no earlier sibling was; label 1 if the node itself was accepted."""
    accepted = set(verdict.path)
    parents = draft.parents if draft.parents is not None else list(range(-1, len(draft.tokens) - 1))
    idx, labels, sibling_taken = [], [], set()
    for i, par in enumerate(parents):
        if (par >= 0 and par not in accepted) or par in sibling_taken:
            continue
        idx.append(i)
        labels.append(int(i in accepted))
        if i in accepted:
            sibling_taken.add(par)
    return idx, labels
