"""What a step costs on this machine: the target's verify forward by the number of tokens it
carries, and the drafter's proposal by the number of requests.

The planner trades expected tokens against seconds, so it needs the real curve, not a model of
it: on a CPU a forward of 6 tokens costs about what a forward of 1 costs (the weights are read
once), while 200 tokens cost several times more; on a GPU the curve is a staircase of graph
buckets. `verify_cost[num_tokens]` is measured once per (machine, model, dtype, threads) at the
first adaptive step: dummy forwards over a grid of token counts at a synthetic context, median of
5 runs each, forced monotone, cached as JSON under the model cache (`~/.cache/verispec/profiles`).
Between grid points the cost is interpolated linearly.

`draft_cost[num_reqs]` is measured on the live workload instead, as a running median of the
drafter's proposal time per batch-size bucket: what a drafter costs depends on its state (the
n-gram index grows with the text, model drafters carry hidden states) and a dummy call would
measure neither.

`StepCost` is what the planners read: the profile is the prior, and the times of the steps the
engine really ran (forward plus verification and bookkeeping, by the forward's token count)
replace it as they come in.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import statistics
import sys
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import torch

FORMAT = "verispec-cost-profile/2"  # 2: repeats round the grid, true token counts
CONTEXT = 256  # committed rows the dummy forwards attend to
REPEATS = 5


def token_grid(max_tokens: int) -> list[int]:
    """1, 2, 3, 4, 6, 8, 12, 16, 24, ... up to and including max_tokens."""
    grid, p = [1, 2, 3], 4
    while p < max_tokens:
        grid += [p, p * 3 // 2]
        p *= 2
    return sorted({n for n in grid if n < max_tokens} | {max_tokens})


def monotone(values: list[float]) -> list[float]:
    """Running maximum: a larger step never costs less (timing noise must not invert the curve)."""
    out, hi = [], 0.0
    for v in values:
        hi = max(hi, v)
        out.append(hi)
    return out


@dataclass
class CostProfile:
    tokens: list[int]  # grid of step sizes (tokens verified in one forward)
    seconds: list[float]  # verify cost at each grid point, monotone
    key: dict = field(default_factory=dict)  # what it was measured for

    def verify_cost(self, num_tokens: int) -> float:
        """Seconds for one target forward over num_tokens tokens (linear between grid points,
        linear extrapolation past the last)."""
        t, s = self.tokens, self.seconds
        if num_tokens <= t[0]:
            return s[0]
        for i in range(1, len(t)):
            if num_tokens <= t[i]:
                return s[i - 1] + (s[i] - s[i - 1]) * (num_tokens - t[i - 1]) / (t[i] - t[i - 1])
        slope = (s[-1] - s[-2]) / (t[-1] - t[-2]) if len(t) > 1 else 0.0
        return s[-1] + slope * (num_tokens - t[-1])

    def to_dict(self) -> dict:
        return {"format": FORMAT, "key": self.key, "tokens": self.tokens, "seconds": self.seconds}

    @classmethod
    def from_dict(cls, d: dict) -> "CostProfile":
        if d.get("format") != FORMAT or len(d.get("tokens", [])) != len(d.get("seconds", [])) or not d["tokens"]:
            raise ValueError("not a verispec cost profile")
        return cls(list(d["tokens"]), monotone([float(x) for x in d["seconds"]]), d.get("key", {}))


def profile_key(model) -> dict:
    """What a profile depends on: the machine, the model (its config), dtype, device, threads."""
    c = model.config
    arch = {k: getattr(c, k, None) for k in ("model_type", "num_layers", "hidden_size", "intermediate_size",
                                              "num_heads", "num_kv_heads", "head_dim", "vocab_size")}
    cpu = platform.processor() or platform.machine()
    try:
        cpu = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                    if ln.startswith("model name")), cpu)
    except OSError:
        pass
    return {"cpu": cpu, "cores": os.cpu_count(), "device": str(model.device), "dtype": str(model.dtype),
            "quant": getattr(model, "quant", "none"),
            "threads": torch.get_num_threads(), "model": arch, "context": CONTEXT}


def profile_path(key: dict) -> Path:
    from ..models.loading import cache_root

    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return cache_root() / "profiles" / f"{key['model'].get('model_type')}-{digest}.json"


@torch.inference_mode()
def measure(model, max_tokens: int, max_batch: int, repeats: int = REPEATS, progress=None) -> CostProfile:
    """Time dummy verify forwards over the token grid: a grid point of n tokens is min(n, max_batch)
    rows of ceil(n / rows) tokens (what a decode step looks like; the profile records the tokens
    that forward really carries) at a synthetic context of CONTEXT rows, in the numerics the engine
    decodes with (batch-invariant kernels for bf16/fp16: their cost differs). The repeats go round
    the whole grid, so a burst of other work on the machine lands on one repeat of every point,
    where the median drops it, instead of on every repeat of a few points (which bent the curve)."""
    from ..kv import KV_BLOCK, round_up

    shapes = {}  # tokens in the forward -> (rows, width)
    for n in token_grid(max_tokens):
        rows = min(n, max_batch)
        width = -(-n // rows)
        shapes.setdefault(rows * width, (rows, width))
    grid = sorted(shapes)
    rows_max = min(max_batch, max_tokens)
    width_max = max(w for _, w in shapes.values())
    cache = model.new_cache(rows_max, round_up(CONTEXT + width_max + 1, KV_BLOCK))
    was = getattr(model, "invariant", False)
    model.set_batch_invariant(model.dtype != torch.float32)

    def forward(n: int) -> float:
        rows, width = shapes[n]
        ids = torch.zeros(rows, width, dtype=torch.long, device=model.device)
        starts = torch.full((rows,), CONTEXT)
        kv_len = round_up(CONTEXT + width, KV_BLOCK) if model.dtype != torch.float32 else None
        t0 = time.perf_counter()
        model(ids, cache, list(range(rows)), starts, kv_len=kv_len)
        if model.device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - t0

    for n in grid:  # warm-up
        forward(n)
    times: dict[int, list[float]] = {n: [] for n in grid}
    for _ in range(repeats):
        for n in grid:
            times[n].append(forward(n))
    seconds = [statistics.median(times[n]) for n in grid]
    if progress:
        for n, sec in zip(grid, seconds):
            progress(n, sec)
    model.set_batch_invariant(was)
    return CostProfile(grid, monotone(seconds))


def load_or_measure(model, max_tokens: int, max_batch: int, progress=None) -> CostProfile:
    """The cached profile for this machine and model, or a fresh measurement (then cached). A
    cached profile that stops short of max_tokens is measured again up to max_tokens (at least 64,
    so that small engines share one profile)."""
    key = profile_key(model)
    path = profile_path(key)
    try:
        prof = CostProfile.from_dict(json.loads(path.read_text()))
        if prof.key == key and prof.tokens[-1] >= max_tokens:
            return prof
    except (OSError, ValueError, KeyError, TypeError):
        pass  # missing, damaged or too short: measure again
    max_tokens = max(max_tokens, 64)
    print(f"verispec: measuring the verify cost of 1..{max_tokens} tokens for adaptive drafting (once for this "
          f"machine, model and thread count; cached in {path})", file=sys.stderr, flush=True)
    prof = measure(model, max_tokens, max_batch, progress=progress)
    prof.key = key
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(prof.to_dict(), indent=1))
    os.replace(tmp, path)
    return prof


class DraftCost:
    """Running median of the drafter's proposal seconds per batch-size bucket (powers of two),
    forced monotone across buckets when read."""

    def __init__(self, window: int = 32):
        self.samples: dict[int, deque[float]] = {}
        self.window = window

    @staticmethod
    def bucket(num_reqs: int) -> int:
        return 1 << max(0, num_reqs - 1).bit_length()

    def record(self, num_reqs: int, seconds: float) -> None:
        self.samples.setdefault(self.bucket(num_reqs), deque(maxlen=self.window)).append(seconds)

    def __call__(self, num_reqs: int) -> float:
        """Seconds to draft for num_reqs requests (0 until measured)."""
        b = self.bucket(num_reqs)
        known = sorted(self.samples)
        below = [statistics.median(self.samples[k]) for k in known if k <= b]
        if below:
            return max(below)
        return statistics.median(self.samples[known[0]]) if known else 0.0


class StepCost:
    """Seconds of a decode step after drafting (verify forward, LM head, verification, KV commit,
    output) by the number of tokens its forward carries, as the engine really ran them.

    The profile times dummy forwards once; a live step also verifies, compacts the cache and
    emits, at the real context, on a machine whose speed drifts and that other work shares (the
    server's threads). Measured on a 2-core machine (Gemma 3 270M, bf16), 16 requests: the live
    step cost 292 / 448 / 630 / 811 / 1606 ms at windows 0 / 1 / 2 / 3 / 7, where the profile,
    measured minutes before, said 485 / 614 / 834 / 1139 / 1810: off by 1.7x at one end and 1.1x
    at the other, so the planner chose windows for a machine that was not there.

    So every step's time is recorded under its forward's token count T = requests x (1 + window)
    (the forward pads every request to the window; T, not the batch size, sets what it costs, so
    a batch of 16 at window 0 tells what a batch of 8 at window 1 costs). A count seen MIN_SEEN
    times costs the median of its last `window` steps; an unseen one between seen counts is
    interpolated. Past the largest seen count the estimate is optimistic: the lower of the
    profile's shape from there and the straight line through the smallest and largest seen counts.
    A window estimated too dear is never tried, so never corrected (a profile measured while other
    work ran said 3 tokens cost 1.8x one token, and the planner kept one stream at a window of 1);
    one estimated too cheap is tried and then known. Below the smallest seen count: the profile's
    shape, at most that count's cost. With nothing seen, the profile itself.
    """

    MIN_SEEN = 2

    def __init__(self, profile: CostProfile, window: int = 16):
        self.profile = profile
        self.window = window
        self.seen: dict[int, deque[float]] = {}  # tokens in the forward -> seconds of recent steps

    def record(self, num_tokens: int, seconds: float) -> None:
        self.seen.setdefault(num_tokens, deque(maxlen=self.window)).append(seconds)

    def __call__(self, num_tokens: int) -> float:
        return self.table(num_tokens, 0)[0]

    def table(self, num_reqs: int, widest: int) -> list[float]:
        """Seconds for windows 0..widest at this batch size (forwards of num_reqs x (1 + window)
        tokens), monotone in the window. The medians are taken once per call (once per step)."""
        med = {t: statistics.median(q) for t, q in self.seen.items() if len(q) >= self.MIN_SEEN}
        known = sorted(med)
        out: list[float] = []
        for w in range(widest + 1):
            out.append(max(self._estimate(num_reqs * (1 + w), known, med), out[-1] if out else 0.0))
        return out

    def _estimate(self, num_tokens: int, known: list[int], med: dict[int, float]) -> float:
        below = [t for t in known if t <= num_tokens]
        above = [t for t in known if t >= num_tokens]
        prof = self.profile.verify_cost
        if below and above:
            lo, hi = below[-1], above[0]
            if lo == hi:
                return med[lo]
            return med[lo] + (med[hi] - med[lo]) * (num_tokens - lo) / (hi - lo)
        if below:  # past every seen count
            lo, hi = known[0], known[-1]
            shape = med[hi] * prof(num_tokens) / max(prof(hi), 1e-12)
            if lo == hi:
                return shape
            slope = max(0.0, (med[hi] - med[lo]) / (hi - lo))
            return min(shape, med[hi] + slope * (num_tokens - hi))
        if above:  # below every seen count
            near = above[0]
            return min(med[near], med[near] * prof(num_tokens) / max(prof(near), 1e-12))
        return prof(num_tokens)
