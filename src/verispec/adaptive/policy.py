"""The adaptive draft-length policy: per step, verify only the draft nodes worth their cost.

The engine calls, every decode step:
1. `budgets(seqs, cap)`: how many nodes each request may draft (its own `num_draft_tokens`);
2. `admit(seqs, drafts, draft_seconds)`: which drafted nodes to verify. The estimator scores each
   node from the drafter's features (never from the node's own token), the planner picks the
   nodes that maximise expected tokens per second against the step cost (`StepCost`: the
   measured profile, calibrated by the times of the steps the engine really ran);
3. `observe(seqs, drafts, verdicts)`: the verifier's verdicts become the estimator's labels, and
   the time since `admit` the step cost at this forward's token count and LM head rows.

What a plan is depends on the engine's verify forward (planner.py): packed chains (the CPU)
verify the batch's best B nodes wherever they are, at the cost of N + B tokens; trees, and
chains where the engine pads, verify every request's best min(W, n) nodes in a window W.
Planners: "greedy" (DSpark's Algorithm 1: current survivals, early stop) or "topb" (no early stop:
the budget or window that was best by the previous step's survivals, filled by the current ones,
as vLLM sizes its global top-B budget). Both serve sampled
requests with drafts drawn at random; a step where nothing was (every request greedy, or every
draft deterministic: the n-gram lookup) takes the best plan by the current survivals, since
then no admission rule can change the output.
"""

from __future__ import annotations

import math
import time
from typing import Callable

from ..drafters.base import Draft
from ..sequence import Sequence
from ..verify import Verdict
from .costs import CostProfile, DraftCost, StepCost
from .estimator import AcceptanceEstimator
from .planner import (argmax, budget_throughput, first_peak, keep, keep_best, ranked_survival, request_order,
                      throughput)
from .realized import RealizedGain

PLANNERS = ("greedy", "topb")


class AdaptiveDraftLength:
    # While nothing pays, probe steps verify a token whatever the planner says (otherwise a policy
    # that starts, or lands, where its estimates say nothing pays would never see a verdict again).
    # The interval from the last verified window to a probe starts at 8 and doubles with every
    # probe, up to 256, over the policy's life. Once the estimator has PROBE_ALL_UNTIL observations,
    # a packed probe verifies the best node of as many requests as fit in PROBE_SHARE more than
    # the plain step costs, at least one: a verdict per request is not needed to fit a slope and
    # intercepts, and at 64 requests on a 2-core CPU, where a step's cost grows with every token,
    # a probe of one token per request cost 2.7 plain steps. Before that, every request's best node
    # (bounded probes left a fresh policy at 8 requests verifying almost nothing), but where nodes
    # are dear (`DEAR_SHARE`): there a fresh policy's first three probes at 64 requests verified
    # 57 nodes each, at 2.2 plain steps' time (session 33). A dear drafter drafts only on probes.
    # The interval starts again at PROBE_EVERY when the batch has grown or shrunk LOAD_CHANGE-fold
    # since it last did: whether speculation pays depends on the load, and a policy that learned at
    # 64 requests that nothing pays probed every 256 steps at 2 and 4, verifying almost nothing for
    # a whole sweep level where fixed k = 5 ran 1.3x plain decoding (session 24).
    PROBE_EVERY = 8
    PROBE_MAX = 256
    LOAD_CHANGE = 4
    PROBE_SHARE = 0.25
    PROBE_ALL_UNTIL = 256  # observations before probes are bounded: a cold policy learns from every request
    CHEAP_DRAFT = 0.05  # drafting under 5% of a plain step's time: draft the full k
    # A cheap drafter whose last draft was not worth verifying drafts again ("looks") 1, 2, 4, ...
    # steps later, doubling with every fruitless look, at most as rarely as keeps such drafting under
    # LOOK_SHARE of the decode time: every 4th step at 64 requests (2 of 75 ms); a look whose plan
    # verifies starts the doubling again. (With the cap alone, one fruitless look at 4 requests,
    # 0.4 ms of drafting against a 12 ms step, meant 7 steps of plain decoding.) Where nodes are
    # dear (`DEAR_SHARE`) a look costs its planning too (pricing some 450 budgets for 64 drafts):
    # on the AVX-512 EPYC at 64 requests a fruitless look cost 9 ms beyond the plain step's price,
    # 3 of them drafting, and looks every 6th step 1.3% of the decode time (session 33). Not where
    # nodes are cheap: counted there it spaced looks up to 6 steps apart at 1-2 streams and the
    # level fell to 0.84x fixed k = 7 (session 31).
    LOOK_SHARE = 0.005
    # A plan is the best of many estimates, so its estimate is biased up (the optimizer's curse);
    # where a step's cost grows with every token (64 requests on a 2-core CPU) the best plans are
    # within a few percent of plain decoding. In one traced run at 64 requests, the 36 steps whose
    # plan was predicted 0-2% faster than plain decoding ran at 0.96x its speed (median), the 31
    # predicted 2-6% faster at 1.00x. So a plan must beat plain decoding by MARGIN.
    MARGIN = 0.03
    # Where verifying one node per request costs at least this share of a plain step (as priced),
    # plans live on a margin thinner than the price's error: there a plan must also beat what the
    # plans at this batch size lately overshot their predictions by, and a batch size whose plans
    # lately lost takes none (`RealizedGain.overshoot`, `losing`, `closed`). Where nodes are
    # cheaper, a record that fell short says only that the text was novel, which the estimator
    # learns: at one stream on a fast CPU a few rejected plans (the lookup's all-or-nothing
    # drafts) set an overshoot of 0.5 that refused every plan for the rest of a 256-token bench,
    # 1.09x plain decoding where fixed k = 7 ran 1.70x (session 33), since a refused plan leaves
    # no record to lift it (realized.py).
    DEAR_SHARE = 0.6
    # A plan's gain has a ceiling: with every node accepted and ever more of them, a step's tokens
    # per second tend to one a node's price against plain decoding's num_reqs a plain step, and a
    # node costs at least the floor (`_nodes`). Where that ceiling is under MIN_CEILING, a plan's
    # predicted gain is within the errors of its acceptance estimate and its price (one node per
    # request accepted 85% of the time gains 3%, at 95% 8%), so nothing is drafted or verified,
    # not even probes: what a probe learns is acceptance, which cannot make such a plan pay. It
    # is judged at the requests holding a slot, prefilling ones included (`budgets`). At 64
    # requests on the AVX-512 EPYC plans predicted 1.03-1.22x plain decoding, with 80-100% of
    # their nodes accepted, ran at 0.96-1.0x (the traces of `adaptive-s33/ab64c`). The ceiling
    # there is 1.17-1.20, 1.22-1.26 at 48 requests, 1.34-1.41 at 32, 1.8-2.1 at 16 (the profiles
    # of session 34's runs).
    MIN_CEILING = 1.25
    SURVIVAL_FLOOR = 1e-3  # nodes less likely than this are never worth a token's cost: not ranked

    def __init__(self, profile: "CostProfile | Callable[[], CostProfile]", planner: str = "greedy",
                 max_depth: int = 64, refit_every: int = 100):
        if planner not in PLANNERS:
            raise ValueError(f"unknown planner {planner!r}; choose from {', '.join(PLANNERS)}")
        self._profile = profile  # a CostProfile, or a function that measures or loads one (the engine calls it as it starts)
        self._given = isinstance(profile, CostProfile)  # a caller's own profile stays (`reach`)
        self.planner = planner
        self.estimator = AcceptanceEstimator(max_depth, refit_every)
        self.draft_cost = DraftCost()
        self.plan_cost = DraftCost()  # admit's own seconds on steps that drafted
        self._step_cost: StepCost | None = None
        self._verify_started: tuple[int, int, int, float] | None = None  # (num_reqs, forward tokens, head rows, perf_counter)
        self._riding = (0, 0)  # this step's prompt tokens in the verify forward and the head rows they add (riders)
        self.steps = 0
        self.width = None  # the window chosen last step; packed: the most nodes one request got (None: no step yet)
        self._probe = False  # this step is a probe (budgets): it verifies at least one node
        self._probe_every = self.PROBE_EVERY
        self._next_probe = 0
        self._last_draft = 0  # the step that last drafted
        self._look_wait = 1  # steps from a fruitless look to the next (doubling; a cheap drafter)
        self._probe_load: int | None = None  # the batch size when the probe interval last started
        self._stale: int | None = None  # topb: the best window or budget by last step's survivals
        self.packed_chains = True  # the engine verifies chains packed (set by the engine: CPU yes, else padded)
        self._pending: dict[int, list[float]] = {}  # seq id -> confidences of its admitted nodes
        self.realized = RealizedGain()  # plans' predicted against realized gain, per batch size
        self._predicted: float | None = None  # this step's plan's predicted gain, when it is checked (no probe)
        self._draft_seconds = 0.0  # this step's drafting and planning time (a checked plan's realized gain counts it)
        self._share = 0.0  # the priced seconds of this step's riders (a checked plan's realized gain leaves them out)
        self._with_riders = False  # this step's forward carries prompt chunks
        self._quiet_plain = False  # this step verifies nothing and carries no riders: plain decoding's speed
        self._hopeless_now = False  # this step's load is past the ceiling (`budgets`)
        self._dear_at: dict[int, tuple[int, bool, float, float]] = {}  # batch size -> (step, `_nodes` then)
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
        elif self._step_cost.profile is not self.profile:  # `reach` replaced it: the step times seen stay
            self._step_cost.profile = self.profile
        return self._step_cost

    def reach(self, max_tokens: int, load: Callable[[], CostProfile]) -> None:
        """Carried to an engine whose forwards reach max_tokens tokens (a load sweep builds one per
        level and hands the policy on, as a server's policy lives through the load): a profile that
        stops short of them gives way to `load`'s (measured once where no cached one reaches that far).

        Past its last point a profile is extrapolated along its last segment. A policy born at one
        stream kept its 64-token profile up to 64 streams, whose forwards of 100-700 tokens (prompt
        chunks riding along) cost more per token than the segment from 48 to 64 said, and so plans
        there were priced too cheap."""
        if self._given:
            return
        if not isinstance(self._profile, CostProfile) or self._profile.tokens[-1] < max_tokens:
            self._profile = load  # (a factory not yet called is replaced by the engine's own)

    def budgets(self, seqs: list[Sequence], cap: int, holding: int = 0) -> list[int]:
        """How many nodes each request may draft: its own k when drafting is cheap (under
        CHEAP_DRAFT of a plain step: the n-gram lookup), since the planner then chooses among the
        drafted nodes at almost no cost; after a step that verified nothing, only every
        `look_every` steps. A dear drafter (a model's forward per node) drafts at most two more
        than last step's window, and nothing after a step that verified nothing. Probe steps
        draft the full k. Where no plan can pay (`MIN_CEILING`), nothing is drafted but a pinned
        request's draft; that is judged at the requests holding a slot (`holding`: the running
        ones and those whose prompts are being prefilled, which join the batch within a few steps
        while their chunks ride in its forwards). Only past steps and the prices decide this."""
        self.steps += 1
        n = len(seqs)
        if self._probe_load is None or max(n, self._probe_load) >= self.LOAD_CHANGE * min(n, self._probe_load):
            self._probe_load, self._probe_every = n, self.PROBE_EVERY  # a new load: probe as a fresh policy would
            self._next_probe = min(self._next_probe, self.steps + self.PROBE_EVERY)
        hopeless = self._hopeless_now = self._hopeless(max(n, holding))  # no plan can pay: no draft, no probe
        self._probe = self.width == 0 and self.steps >= self._next_probe and not hopeless
        if self._probe:
            self._next_probe = self.steps + self._probe_every
            self._probe_every = min(2 * self._probe_every, self.PROBE_MAX)
        elif self.width:  # a verified window gave verdicts: the next probe is an interval from here
            self._next_probe = self.steps + self._probe_every
        if hopeless:
            self.width, adaptive_cap = 0, 0
        elif self.width is None or self._probe:
            adaptive_cap = cap
        elif self.realized.closed(self.steps, n, self.MARGIN) and self._dear(n):  # plans lately lost: probes only
            self.width, adaptive_cap = 0, 0
        else:  # (the step cost, medians over every seen count, is read only when it decides)
            draft, step = self.draft_cost(n), self.step_cost(n)
            if draft <= self.CHEAP_DRAFT * step:
                look = draft + (self.plan_cost(n) if self._dear(n) else 0.0)
                wait = min(self._look_wait, look_every(look, step, self.LOOK_SHARE))
                adaptive_cap = cap if self.width or self.steps - self._last_draft >= wait else 0
            else:
                adaptive_cap = min(cap, self.width + 2) if self.width else 0
        out = [max(0, min(s.num_draft_tokens, cap if pinned(s) else adaptive_cap, s.params.max_tokens - s.num_output - 1))
               for s in seqs]
        if any(out):
            self._last_draft = self.steps
        return out

    def admit(self, seqs: list[Sequence], drafts: list[Draft], draft_seconds: float) -> list[Draft]:
        t0 = time.perf_counter()
        self.last_drafted = sum(len(d.tokens) for d in drafts)
        n = len(seqs)
        riding, ends = self._riding
        self._riding = (0, 0)
        self._predicted, self._share, self._with_riders, self._quiet_plain = None, 0.0, riding > 0, not riding
        if not self.last_drafted:  # nothing to plan; the window stays as it was
            self.last_admitted = 0
            self._verify_started = (n, n + riding, n + ends, time.perf_counter())
            return drafts
        self.draft_cost.record(n, draft_seconds)
        conf = self.estimator.predict_many([d.features for d in drafts], [d.depths() for d in drafts])
        surv = [ranked_survival(c, d.parents) for c, d in zip(conf, drafts)]
        pins = [pinned(s) for s in seqs]
        # nothing drawn at random (greedy requests, deterministic drafts): any admission rule is
        # lossless, so the best plan by the current survivals (no early stop at a local maximum)
        exact = all(s.params.greedy or d.q is None for s, d in zip(seqs, drafts))
        packed = self.packed_chains and all(d.parents is None for d in drafts)
        if packed:
            kept = self._plan_packed(surv, pins, drafts, exact, riding, ends)
        else:
            kept = self._plan_window(surv, pins, drafts, exact)
        if self._probe or (riding and not packed):  # the plan's part of the step is not known: not checked
            self._predicted = None
        if self.width:  # a look (or a probe) that found a plan worth verifying
            self._look_wait = 1
        elif not self._probe:  # a fruitless look: the next one waits twice as long (capped where it is read)
            self._look_wait = min(2 * self._look_wait, self.PROBE_MAX)
        out = []
        for s, d, c, k in zip(seqs, drafts, conf, kept):
            out.append(d.select(k))
            self._pending[s.id] = [c[i] for i in k]
        self.last_admitted = sum(len(d.tokens) for d in out)
        self._quiet_plain = not riding and not self.last_admitted
        tokens = n + self.last_admitted if packed else n * (1 + max(len(d.tokens) for d in out))
        now = time.perf_counter()
        self.plan_cost.record(n, now - t0)
        self._draft_seconds = draft_seconds + now - t0  # a plan's realized gain pays for its planning too
        self._verify_started = (n, tokens + riding, n + self.last_admitted + ends, now)
        return out

    def _choose(self, theta: list[float], exact: bool, num_reqs: int, riders: bool = False) -> int:
        """The planner's pick among the plans scored by theta (windows, or packed budgets); plain
        decoding (0) unless the pick beats it by MARGIN and, where nodes are dear (`_dear`), by
        MARGIN plus the recent overshoot of plans at this batch size, on steps with riders or
        without as this one, and those plans did not lately realize less than MARGIN over plain
        decoding (`RealizedGain`)."""
        if exact:
            choice = self._stale = argmax(theta)
        elif self.planner == "greedy":
            choice = first_peak(theta)
        else:
            best = argmax(theta)
            choice = best if self._stale is None else min(self._stale, len(theta) - 1)
            self._stale = best  # used next step only: its survivals are then history
        if not choice or theta[choice] < (1 + self.MARGIN) * theta[0] or self._hopeless_now:
            return 0
        if self._dear(num_reqs):  # where plans live on a thin margin, their record must allow it
            need = 1 + self.MARGIN + self.realized.overshoot(self.steps, num_reqs, riders)
            if theta[choice] < need * theta[0] or self.realized.losing(self.steps, num_reqs, riders, self.MARGIN):
                return 0
        self._predicted = theta[choice] / theta[0]
        return choice

    def _dear(self, num_reqs: int) -> bool:
        return self._nodes(num_reqs)[0]

    def _hopeless(self, num_reqs: int) -> bool:
        return self._nodes(num_reqs)[2] < self.MIN_CEILING

    def _nodes(self, num_reqs: int) -> tuple[bool, float, float]:
        """(dear, floor, ceiling) at num_reqs requests, as the step cost prices them (again every
        16 steps: pricing an unseen count fits the bin's line, 0.3 ms, a fiftieth of a one-request
        step on a fast CPU). floor: the slope of plain steps from one request to num_reqs, what a
        node costs at least where a step's cost is convex in its tokens (flat while the weights'
        reads set it, then a line), as a node is one more token through the body and the LM head
        like a request's own, in a forward of num_reqs tokens or more (prompt chunks riding
        along). dear: one node per request costs at least DEAR_SHARE of a plain step, by the price
        or by the floor. ceiling: the most any plan can gain (`MIN_CEILING`), a plain step over
        num_reqs nodes at the floor, both by the profile's shape (the forward of num_reqs tokens
        against that of one): the live price of a one-request step, below every forward a
        64-stream level had seen, came from that shape scaled by whichever small forward was
        seen, and moved the ceiling at 64 requests from 1.17 to 1.29 within a level (session 34).

        Why the floor: a bin's live line fits the head rows' slope from its few plan steps. At 64
        requests on the AVX-512 EPYC it priced a node at 1.25 ms where nodes cost 1.9 ms, as much
        as a request's plain token (the profile's slope from 64 to 128 tokens: 1.92 ms), and the
        policy verified plans of 12-192 nodes predicted 1.04-1.4x plain decoding that ran at about
        1.0x and staggered the requests' finishes (session 33: 0.96x plain decoding by the sweep's
        measure, 0.99x by the level's time). There the floor is 1.6 ms; on the AVX2 EPYC, 5.2 ms
        where nodes cost 5.2-5.8 (session 31)."""
        at, dear, floor, ceiling = self._dear_at.get(num_reqs, (-16, False, 0.0, math.inf))
        if self.steps - at >= 16:
            plain, doubled = self.step_cost.costs(num_reqs, [num_reqs, 2 * num_reqs])
            floor = 0.0
            if num_reqs > 1:
                floor = max(0.0, (plain - self.step_cost.costs(1, [1])[0]) / (num_reqs - 1))
            dear = max(doubled - plain, num_reqs * floor) >= self.DEAR_SHARE * plain
            one, full = self.profile.verify_cost(1), self.profile.verify_cost(num_reqs)
            ceiling = full * (num_reqs - 1) / (num_reqs * (full - one)) if full > one else math.inf
            self._dear_at[num_reqs] = (self.steps, dear, floor, ceiling)
        return dear, floor, ceiling

    def _floored(self, num_reqs: int, costs: list[float], nodes: list[int]) -> list[float]:
        """Plans' costs (costs[i] for nodes[i] verified nodes, nodes[0] = 0) where nodes are dear:
        each node at least the floor (`_nodes`)."""
        dear, floor, _ = self._nodes(num_reqs)
        if not dear or not floor:
            return costs
        return [max(c, costs[0] + k * floor) for c, k in zip(costs, nodes)]

    def _plan_packed(self, surv, pins, drafts, exact, riding: int = 0, ends: int = 0) -> list[list[int]]:
        """Packed chains (engine._chain_forward): a step costs what its N + B tokens cost, so the
        batch verifies its best B nodes by survival, wherever they are (vLLM's global top-B).

        Prompt chunks riding in the forward (`riding` tokens, `ends` of them given to the LM head):
        B nodes cost what they add to the forward they really join, but the riders' own cost is
        not the plan's. Every request's prompt is prefilled once whatever is verified, so what a
        plan changes is decode time per decode token; counted in, the riders' cost made any plan
        look cheap beside it (predicted 1.38x on such steps at 64 streams, where verified tokens
        cost about what they saved: benchmarks/results/adaptive-s26/level_steps_64_*.txt)."""
        n = len(surv)
        base = n + sum(len(d.tokens) for d, p in zip(drafts, pins) if p)  # roots and pinned drafts
        free = [[] if p else sv for sv, p in zip(surv, pins)]
        dsec = self.draft_cost(n)

        def priced(budgets: range) -> list[float]:
            alone = self.step_cost.costs(n, [base], [base])[0] if riding else 0.0
            joined = self.step_cost.costs(n, [base + riding + B for B in budgets], [base + ends + B for B in budgets])
            joined = self._floored(n, joined, [B - budgets[0] for B in budgets])
            self._share = joined[0] - alone if riding else 0.0  # the riders' part of the step
            return [c - self._share for c in joined]

        theta = budget_throughput(free, dsec, lambda m: priced(range(m + 1)), self.SURVIVAL_FLOOR)
        budget = self._choose(theta, exact, n, riders=riding > 0)
        kept = keep_best(free, budget, self.SURVIVAL_FLOOR)
        self.width = max(len(k) for k in kept)
        if self._probe and not budget:  # the best node of as many requests as PROBE_SHARE pays for
            firsts = [(r, request_order(sv)[0]) for r, sv in enumerate(free) if sv]
            firsts.sort(key=lambda ri: -free[ri[0]][ri[1]])
            costs = priced(range(len(firsts) + 1))
            m = max(1, sum(1 for c in costs[1:] if c <= (1 + self.PROBE_SHARE) * costs[0])) if firsts else 0
            if self.estimator.observations < self.PROBE_ALL_UNTIL and not self._dear(n):  # a cold estimator: a verdict from every request
                m = len(firsts)
            for r, i in firsts[:m]:
                kept[r] = [i]
        for r, (sv, p) in enumerate(zip(surv, pins)):
            if p:
                kept[r] = list(range(len(sv)))
        return kept

    def _plan_window(self, surv, pins, drafts, exact) -> list[list[int]]:
        """Padded windows (trees, or chains where the engine pads): a step costs the body of
        N (1 + W) tokens and the LM head over the real rows; every request verifies its best min(W, n)."""
        n = len(surv)
        widest = max(len(d.tokens) for d in drafts)
        # LM head rows at each window: every request's root, a free draft's first min(W, n) nodes, a pinned one's all
        pinned_rows = sum(len(d.tokens) for d, p in zip(drafts, pins) if p)
        head_rows = [n + pinned_rows + sum(min(W, len(d.tokens)) for d, p in zip(drafts, pins) if not p)
                     for W in range(widest + 1)]
        table = self.step_cost.table(n, widest, head_rows)
        cost = self._floored(n, table, [r - head_rows[0] for r in head_rows]).__getitem__  # seconds by window
        free = [sv for sv, p in zip(surv, pins) if not p]  # the planner weighs the others only
        width = self._choose(throughput(free, self.draft_cost(n), cost), exact, n)
        self.width = width
        if self._probe:
            width = max(width, 1)
        # a pinned draft widens the window for everyone, at no further cost
        width = max([width] + [len(d.tokens) for d, p in zip(drafts, pins) if p])
        return [list(range(len(d.tokens))) if p else k for d, k, p in zip(drafts, keep(surv, width), pins)]

    def riders(self, tokens: int, head_rows: int) -> None:
        """Prompt tokens in this step's forward (engine._decode_step, before `admit`): the plan is
        priced, and the step timed, at its forward's real size."""
        self._riding = (tokens, head_rows)

    def observe(self, seqs: list[Sequence], drafts: list[Draft], verdicts: list[Verdict]) -> None:
        if self._verify_started is not None:  # the step's time after drafting, by forward size and head rows
            n, tokens, rows, t0 = self._verify_started
            seconds = time.perf_counter() - t0
            self.step_cost.record(tokens, seconds, rows, n)
            self._verify_started = None
            if self._quiet_plain:
                self.realized.plain(self.steps, n, seconds)
            elif self._predicted is not None:  # a checked plan: what it gained against plain decoding
                plain = self.realized.plain_seconds(self.steps, n) or self.step_cost.costs(n, [n], [n])[0]
                spent = seconds - self._share + self._draft_seconds
                if plain > 0 and spent > 0:
                    emitted = sum(v.accepted + 1 for v in verdicts)
                    self.realized.record(self.steps, n, self._predicted, (emitted / spent) / (n / plain), self._with_riders)
            self._predicted, self._quiet_plain = None, False
        for s, d, v in zip(seqs, drafts, verdicts):
            conf = self._pending.pop(s.id, [])
            if not d.tokens:
                continue
            idx, labels = observations(d, v)
            feats = None if d.features is None else [d.features[i] for i in idx]
            depths = d.depths()
            self.estimator.observe(feats, [depths[i] for i in idx], labels, [conf[i] for i in idx])
        self.estimator.end_step()


def look_every(draft_seconds: float, step_seconds: float, share: float) -> int:
    """Steps between fruitless drafts that keep their cost under `share` of the decode time."""
    return max(1, math.ceil(draft_seconds / max(share * step_seconds, 1e-12)))


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
