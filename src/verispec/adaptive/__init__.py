"""Adaptive verification: per step, verify only the draft nodes worth their cost.

- `costs.py`: what a verify forward costs by its token count (measured once per machine and
  model, cached) and what drafting costs by batch size (measured live);
- `estimator.py`: the head-free online acceptance estimator (drafter features -> P(accept));
- `planner.py`: survival products and the two planners (DSpark's greedy, vLLM's global top-B);
- `realized.py`: what verified plans gained against what they were predicted to, per batch size;
- `policy.py`: `AdaptiveDraftLength`, the engine's default `DraftLengthPolicy` with a drafter;
- `cli.py`: `verispec profile`.

Nothing is imported here, so that `verispec --help` (which registers `profile`) imports no torch.
"""

