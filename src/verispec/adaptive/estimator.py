"""The head-free online acceptance estimator: how likely each draft node is to be accepted,
learned from the verifier's own verdicts while the engine runs.

Model (per node): P(accepted | parent accepted) = sigmoid(w . f + b_depth), with one weight vector
w shared by all depths and one intercept per depth. f is the drafter's feature vector for the node
(`Draft.features`): for model drafters logit(max q) of the draft distribution the node was drawn
from (it scores the distribution, never the drawn token), for n-gram drafters the log of the
evidence behind the continuation. Drafters without features get intercepts only, which still
learn how acceptance falls with depth. Initial state: w = 0, b = 0 (0.5 everywhere: no opinion),
so planning works before the first fit. An optimistic prior (0.82, as first shipped) made a fresh
engine at 16 streams verify windows of several tokens for its first dozen steps, where nothing
paid; 0.5 still drafts at one stream, where a window costs little.

Labels are censored: a node is an observation only if it was verified and its parent was
accepted (for a chain: every earlier position); its label is whether it was accepted. Siblings
after an accepted sibling are not observations either.

Fitting: every `refit_every` (100) steps, or as soon as the window holds `refit_observations`
(512) observations, a damped Newton step on the log-likelihood of the window of observations
gathered since the last refit (then the window starts afresh, so the fit follows the workload).
The observation trigger is for CPUs: at 3-20 steps a second, 100 steps can be half a minute, while
a batch of 32 yields 512 observations in a few steps. The first refits come sooner, after 32, 64,
128, 256 observations: until then the policy plans with the prior, and a short run (a benchmark
point of 30 steps, a burst of requests) would otherwise end before the first fit.

The step is kept in bounds three ways, because a window is often separable: at 64 requests a
window may hold only the nodes of long n-gram matches, all accepted, while the model says 0.01.
There the log-likelihood's curvature p (1 - p) is almost 0 and a bare Newton step is the gradient
over a tiny number: one such window moved an intercept from -5 to +20, the next (all rejected,
predicted 1.0) to -61000, and the policy verified windows at 64 requests that cost 1.7 plain steps
each, then never speculated again. So the Hessian carries a unit prior precision (a Gaussian prior
on the change, centred on the current fit), a refit moves no parameter by more than MAX_STEP
logits (the whole step is scaled down, keeping its direction), and the parameters stay within
+-CLAMP_PARAM (0.9997 at most: a fit can always come back). The step is further damped per
parameter by n / (n + 10) observations; non-finite steps, and steps that would make the slope
negative, are dropped.
"""

from __future__ import annotations

import math

import torch

INIT_INTERCEPT = 0.0
FIRST_REFIT = 32  # observations before the first refit; doubled after each up to refit_observations
DAMPING = 10.0
PRIOR_PRECISION = 1.0  # added to the Hessian's diagonal: a unit Gaussian prior on the change of a refit
MAX_STEP = 3.0  # logits: the largest change of any parameter in one refit
CLAMP_PARAM = 8.0  # |intercept|, slope <= 8
CLAMP = 40.0


def logit(p: float) -> float:
    p = min(max(p, 1e-12), 1 - 1e-12)
    return max(-CLAMP, min(CLAMP, math.log(p) - math.log1p(-p)))


class AcceptanceEstimator:
    def __init__(self, max_depth: int, refit_every: int = 100, refit_observations: int = 512):
        self.max_depth = max_depth
        self.refit_every = refit_every
        self.refit_observations = refit_observations
        self._next_refit = min(FIRST_REFIT, refit_observations)  # observations that trigger the next refit
        self._since = 0  # steps since the last refit
        self.w: torch.Tensor | None = None  # [F] shared slope(s), set when the first features arrive
        self.b = torch.full((max_depth,), INIT_INTERCEPT, dtype=torch.float64)  # [D] per-depth intercepts
        self._f: list[list[float]] = []  # window: features, depth index, label
        self._d: list[int] = []
        self._y: list[float] = []
        self.steps = 0
        self.refits = 0
        # predicted vs observed, over all observations (for /metrics)
        self.predicted_sum = 0.0
        self.observed_sum = 0.0
        self.observations = 0

    def _ensure(self, num_features: int) -> None:
        if self.w is None or len(self.w) != num_features:
            self.w = torch.zeros(num_features, dtype=torch.float64)

    def predict(self, features: list[list[float]] | None, depths: list[int]) -> list[float]:
        """P(accept | parent accepted) for each node (depth 1 = a child of the root)."""
        if not depths:
            return []
        d = torch.tensor([min(x, self.max_depth) - 1 for x in depths])
        z = self.b[d].clone()
        if features is not None and features and len(features[0]):
            self._ensure(len(features[0]))
            z += torch.tensor(features, dtype=torch.float64) @ self.w
        return torch.sigmoid(z).tolist()

    def predict_many(self, features: list[list[list[float]] | None], depths: list[list[int]]) -> list[list[float]]:
        """`predict` for a batch of drafts in one call (at 64 requests the policy's admit took 3.9-4.1 ms a
        step with a call per draft, 2.4 ms with one)."""
        have = [f is not None and len(f) > 0 and len(f[0]) > 0 for f, d in zip(features, depths) if d]
        if not have or (any(have) and not all(have)):  # nothing drafted, or drafts with and without features
            return [self.predict(f, d) for f, d in zip(features, depths)]
        flat = self.predict([x for f, d in zip(features, depths) if d for x in f] if all(have) else None,
                            [x for d in depths for x in d])
        out, i = [], 0
        for d in depths:
            out.append(flat[i : i + len(d)])
            i += len(d)
        return out

    def observe(self, features: list[list[float]] | None, depths: list[int], labels: list[int],
                predicted: list[float]) -> None:
        """Add the observed nodes of one verified draft (already filtered to observations)."""
        for i, (d, y) in enumerate(zip(depths, labels)):
            self._f.append(list(features[i]) if features is not None else [])
            self._d.append(min(d, self.max_depth) - 1)
            self._y.append(float(y))
            self.predicted_sum += predicted[i]
            self.observed_sum += y
            self.observations += 1

    def end_step(self) -> None:
        self.steps += 1
        self._since += 1
        if self._since >= self.refit_every or len(self._y) >= self._next_refit:
            self.refit()

    def refit(self) -> None:
        """One damped Newton step on the current window, then a fresh window."""
        if self._y:
            self._newton_step()
        self._f, self._d, self._y = [], [], []
        self._since = 0
        self.refits += 1
        self._next_refit = min(2 * self._next_refit, self.refit_observations)

    def _newton_step(self) -> None:
        F = len(self._f[0]) if all(len(f) == len(self._f[0]) for f in self._f) else 0
        if F:
            self._ensure(F)
        D = self.max_depth
        y = torch.tensor(self._y, dtype=torch.float64)
        d = torch.tensor(self._d)
        onehot = torch.nn.functional.one_hot(d, D).to(torch.float64)  # [N, D]
        X = torch.cat([torch.tensor(self._f, dtype=torch.float64), onehot], 1) if F else onehot  # [N, F + D]
        theta = torch.cat([self.w, self.b]) if F else self.b.clone()
        p = torch.sigmoid(X @ theta)
        grad = X.T @ (y - p)  # ascent direction of the log-likelihood
        H = (X * (p * (1 - p))[:, None]).T @ X + PRIOR_PRECISION * torch.eye(X.shape[1], dtype=torch.float64)
        try:
            step = torch.linalg.solve(H, grad)
        except RuntimeError:
            return
        if not torch.isfinite(step).all():
            return
        counts = torch.cat([torch.full((F,), float(len(y))), onehot.sum(0)]) if F else onehot.sum(0)
        step = step * counts / (counts + DAMPING)  # positions with no data hold still
        step = step * min(1.0, MAX_STEP / max(step.abs().max().item(), 1e-12))
        if F:
            w = self.w + step[:F]
            if (w < 0).any():  # a larger confidence never means a smaller acceptance: keep the old slope
                step[:F] = 0
            self.w = (self.w + step[:F]).clamp(0.0, CLAMP_PARAM)
        self.b = (self.b + step[F:]).clamp(-CLAMP_PARAM, CLAMP_PARAM)

    def coefficients(self) -> dict:
        return {"slope": [] if self.w is None else self.w.tolist(), "intercepts": self.b.tolist()}
