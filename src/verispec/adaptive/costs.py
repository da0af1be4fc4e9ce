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

import bisect
import hashlib
import json
import os
import statistics
import sys
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from .. import kernels

FORMAT = "verispec-cost-profile/4"  # 2: repeats round the grid, true token counts; 3: the LM head alone; 4: tiles
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
    seconds: list[float]  # verify cost at each grid point (the forward with its LM head on every row), monotone
    key: dict = field(default_factory=dict)  # what it was measured for
    head_tokens: list[int] = field(default_factory=list)  # rows given to the LM head alone
    head_seconds: list[float] = field(default_factory=list)  # its cost at each, monotone (empty: not measured)
    granule: int = 1  # rows the matmuls take a tile at a time (16 on AMX); a started tile costs a whole one

    def tiles(self, n: int) -> int:
        """n rounded up to whole tiles past the first: on AMX a 65-row matmul runs 5 tiles of 16
        rows, and its cost is 80 rows' (up to one tile, rows cost by the reads and stay as measured)."""
        g = self.granule
        return n if g <= 1 or n <= g else -(-n // g) * g

    def verify_cost(self, num_tokens: int) -> float:
        """Seconds for one target forward over num_tokens tokens (linear between grid points over
        whole tiles, linear extrapolation past the last)."""
        return _interpolate(self.tokens, self.seconds, self.tiles(num_tokens))

    def head_cost(self, rows: int) -> float:
        """Seconds of the LM head over `rows` rows (0 when not measured)."""
        return _interpolate(self.head_tokens, self.head_seconds, self.tiles(rows)) if self.head_tokens else 0.0

    def body_cost(self, num_tokens: int) -> float:
        """The forward without its LM head: the engine runs the head on the real rows only (a
        padded row of the verify window needs no logits), so the two are priced apart."""
        return max(0.0, self.verify_cost(num_tokens) - self.head_cost(num_tokens))

    def to_dict(self) -> dict:
        return {"format": FORMAT, "key": self.key, "tokens": self.tokens, "seconds": self.seconds,
                "head_tokens": self.head_tokens, "head_seconds": self.head_seconds, "granule": self.granule}

    @classmethod
    def from_dict(cls, d: dict) -> "CostProfile":
        if d.get("format") != FORMAT or len(d.get("tokens", [])) != len(d.get("seconds", [])) or not d["tokens"] \
                or len(d.get("head_tokens", [])) != len(d.get("head_seconds", [])):
            raise ValueError("not a verispec cost profile")
        return cls(list(d["tokens"]), monotone([float(x) for x in d["seconds"]]), d.get("key", {}),
                   list(d.get("head_tokens", [])), monotone([float(x) for x in d.get("head_seconds", [])]),
                   int(d.get("granule", 1)))


def _interpolate(t: list[int], s: list[float], n: int) -> float:
    """s at n: linear between grid points t (rising), linear extrapolation past the last."""
    if n <= t[0]:
        return s[0]
    i = bisect.bisect_left(t, n)  # t[i - 1] < n <= t[i]
    if i < len(t):
        return s[i - 1] + (s[i] - s[i - 1]) * (n - t[i - 1]) / (t[i] - t[i - 1])
    slope = (s[-1] - s[-2]) / (t[-1] - t[-2]) if len(t) > 1 else 0.0
    return s[-1] + slope * (n - t[-1])


def profile_key(model) -> dict:
    """What a profile depends on: the machine, the model (its config), dtype, device, threads, and
    the code that runs it (the native kernels' sources, whether its layers run natively)."""
    c = model.config
    arch = {k: getattr(c, k, None) for k in ("model_type", "num_layers", "hidden_size", "intermediate_size",
                                              "num_heads", "num_kv_heads", "head_dim", "vocab_size")}
    cpu = kernels.cpu_name()
    layers = getattr(getattr(model, "model", None), "layers", None)
    native = bool(layers) and hasattr(layers[0], "native") and layers[0].native() is not None
    return {"cpu": cpu, "cores": os.cpu_count(), "device": str(model.device), "dtype": str(model.dtype),
            "quant": getattr(model, "quant", "none"),
            "kernels": kernels.source_hash() if kernels.bf16_gemm() is not None else None,
            "native_layers": native,
            "greedy_head_rows": getattr(getattr(model, "greedy_head", None), "max_rows", None),
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
    decodes with (batch-invariant kernels for bf16/fp16: their cost differs), and the LM head alone
    over as many rows (the engine gives it a step's real rows only) as greedy steps run it: the
    model's greedy tokens, on inputs shaped like real states where its greedy head takes that
    many rows (sampled steps, which need fp32 logits, then cost a little more than priced). The repeats go round
    the whole grid, so a burst of other work on the machine lands on one repeat of every point,
    where the median drops it, instead of on every repeat of a few points (which bent the curve)."""
    from ..kv import KV_BLOCK, round_up
    from ..models.greedy_head import typical_inputs

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

    hidden = torch.zeros(max(grid), model.config.hidden_size, dtype=model.dtype, device=model.device)

    greedy = getattr(model, "greedy_head", None)
    typical = None if greedy is None else typical_inputs(greedy.weight, max(grid))

    def head(n: int) -> float:  # the LM head over n rows, as the engine runs it on a greedy step's real rows
        t0 = time.perf_counter()
        if model.greedy_tokens((hidden if typical is None else typical)[:n]) is None:
            model.lm_logits(hidden[:n])
        if model.device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - t0

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
        forward(n), head(n)
    times: dict[int, list[float]] = {n: [] for n in grid}
    head_times: dict[int, list[float]] = {n: [] for n in grid}
    for _ in range(repeats):
        for n in grid:
            times[n].append(forward(n))
            head_times[n].append(head(n))
    seconds = [statistics.median(times[n]) for n in grid]
    if progress:
        for n, sec in zip(grid, seconds):
            progress(n, sec)
    model.set_batch_invariant(was)
    return CostProfile(grid, monotone(seconds), head_tokens=grid,
                       head_seconds=monotone([statistics.median(head_times[n]) for n in grid]),
                       granule=tile_rows(model))


def tile_rows(model) -> int:
    """Rows the target's matmuls take a tile at a time: 16 where its bf16 weights run on AMX
    (kernels/bf16_gemm.c), else 1 (the other kernels' passes are a few rows, close to linear).

    Why it matters: a step's cost jumps where its rows start a tile. At 64 streams on AMX, steps
    that verified 23-27 nodes besides the 64 rows (two more tiles) took 110-111 ms against 80.4 for
    the 64 rows alone, where the line between measured counts had said about 101: plans predicted
    5% faster than plain decoding ran 1-3% slower (benchmarks/results/adaptive-s22/plan_trace_64.txt)."""
    layers = getattr(getattr(model, "model", None), "layers", None)
    if not layers or model.dtype != torch.bfloat16 or model.device.type != "cpu" or not getattr(model, "prepacked", False):
        return 1
    return 16 if kernels.isa() == "amx-bf16" and model.packed_head is not None and model.packed_head.native else 1


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


def batch_bin(num_reqs: int) -> int:
    """Batch sizes 1, 2, 3-4, 5-8, ..., 33-64, ... as bins 0, 1, 2, 3, ..."""
    return (num_reqs - 1).bit_length()


@dataclass
class BodyLine:
    """body = a + c N + b_row (rows - N) + b_pad (T - rows) (StepCost's line), and the most tokens
    beyond one per request that its steps had (`widest`)."""

    a: float
    c: float
    b_row: float
    b_pad: float
    widest: int

    def __call__(self, num_reqs: int, num_tokens: int, head_rows: int) -> float:
        return (self.a + self.c * num_reqs + self.b_row * (head_rows - num_reqs)
                + self.b_pad * (num_tokens - head_rows))

    @classmethod
    def fit(cls, pts: list[tuple[int, int, int, float]]) -> "BodyLine | None":
        """Least squares over (requests, tokens, head rows, body) points; a term whose column
        did not vary is left out, and so is one whose slope comes out negative (refitted without
        it); a token slope left out is the other one (a node's body costs what a riding prompt
        token's does, so nodes are not free in the first steps of a load where only prompts came
        and went), and with every token slope negative the line is flat. None when no token count
        varied."""
        y = np.array([p[3] for p in pts], dtype=np.float64)
        cols = {"c": [p[0] for p in pts], "b_row": [p[2] - p[0] for p in pts], "b_pad": [p[1] - p[2] for p in pts]}
        terms = [k for k, v in cols.items() if max(v) > min(v)]
        if not {"b_row", "b_pad"} & set(terms):
            return None
        while True:
            X = np.array([[1.0] * len(pts)] + [cols[k] for k in terms], dtype=np.float64).T
            coef = np.linalg.lstsq(X, y, rcond=None)[0].tolist()
            slopes = dict(zip(terms, coef[1:]))
            worst = min(terms, key=slopes.__getitem__, default=None)
            if worst is None or slopes[worst] >= -1e-12:
                break
            terms.remove(worst)
        slopes = {k: max(0.0, v) for k, v in slopes.items()}
        if not {"b_row", "b_pad"} & set(slopes):  # every token slope came out negative: a flat line
            slopes["b_row"] = slopes["b_pad"] = 0.0
        b_row = slopes.get("b_row", slopes.get("b_pad"))
        return cls(coef[0], slopes.get("c", 0.0), b_row, slopes.get("b_pad", b_row), max(p[1] - p[0] for p in pts))


class StepCost:
    """Seconds of a decode step after drafting (verify forward, LM head, verification, KV commit,
    output), as the engine really ran them, at N requests: the body of the forward and the rest
    of the step by the forward's token count T (N + the admitted nodes for packed chains, N (1 + W)
    for a window W padded), plus the LM head by the rows it is given (the real rows N + the
    admitted nodes: a padded row needs no logits).

    The profile times dummy forwards once; a live step also verifies, compacts the cache and
    emits, at the real context, on a machine whose speed drifts and that other work shares (the
    server's threads). Measured on a 2-core machine (Gemma 3 270M, bf16), 16 requests: the live
    step cost 292 / 448 / 630 / 811 / 1606 ms at windows 0 / 1 / 2 / 3 / 7, where the profile,
    measured minutes before, said 485 / 614 / 834 / 1139 / 1810: off by 1.7x at one end and 1.1x
    at the other, so the planner chose windows for a machine that was not there.

    So every step's time, less the profile's LM head cost for the rows it had, is recorded under
    its T (the forward pads every request to the window; T, not the batch size, sets what the body
    costs, so a batch of 16 at window 0 tells what a batch of 8 at window 1 costs). The head is
    priced apart because it is half of a small model's step and grows with the admitted nodes,
    not with the padding: at 4 requests a window of 3 costs 16 head rows when all four drafted,
    but 7 when one did. A token count seen MIN_SEEN times at this very batch size costs the median
    of its last `window` steps there: the rest of a step (verification, cache, output) grows with
    the requests, not with T, and at 4 requests windows of 1 to 3 cost what no other batch size says.
    Otherwise a token count seen MIN_SEEN times costs the median of its last `window` steps;
    an unseen one between seen counts is interpolated; past the largest seen count, the profile's
    shape from there; below the smallest, the profile's shape, at most that count's cost. With
    nothing seen, the profile itself.

    Before that rule, a line for what this batch size has not seen twice, fitted over the recent
    steps of its bin (batch sizes 1, 2, 3-4, 5-8, ..., 33-64, as `RealizedGain` bins them):
    body = a + c N + b_row (rows - N) + b_pad (T - rows), least squares (a slope that comes out
    negative is left out), where rows - N are the forward's tokens beyond the roots that the LM
    head also reads (the admitted nodes) and T - rows the ones it does not (prompt chunks riding
    along, a padded window's padding); a term whose tokens did not vary is left out too. It
    prices an unseen count once the bin has MIN_FIT fresh steps that varied in something beside
    N, and past the widest seen there at least what the rule above says.

    Why a bin's line and not a batch size's: at 64 streams the batch wanders over 57-64 as
    requests finish and others are admitted, and nearly every step carries some prompt, so one
    batch size seldom saw MIN_FIT steps, and for most of a level its plans were priced from the
    profile, whose step of 64 tokens (511 ms, measured in a slow minute) was 1.4x the 358 ms that
    plain steps took there, while it priced a node at 5.3 ms where nodes cost 5.8-12 ms: the
    policy verified plans predicted 1.05-1.3x plain decoding that ran at 0.7-0.9x, and the level
    at 0.83x plain decoding (session 31, first round; `benchmarks/inprocess_trace.py`). Why two
    slopes: a node also costs an LM head row (2.5-2.9 ms at 64 rows there) and a riding prompt
    token does not, and the head's profile price (3.7 ms a row) is not what the head costs live;
    with the body fitted apart for the two kinds of token, what a node adds is what nodes
    added, whatever the profile says of the head.
    Before the line pooled a bin, it fitted one batch size's steps (body = a + b (T - N)): plans
    of varying size seldom fill one count twice, and the price of an unseen count came from other
    batch sizes' counts and the profile's shape; at 64 requests on an AVX2 EPYC that priced a
    verified node at 0.2-4.2 ms where it cost 5.2 ms, as much as a decode token
    (`benchmarks/node_cost.py`), and the policy ran 0.76x plain decoding where the line ran
    0.96x; at 8 requests, 1.12x against 1.22x (`benchmarks/slope_ab.py`, session 27).

    An earlier version was optimistic past the largest seen count (the lower of the profile's
    shape and the straight line through the smallest and largest seen counts), so that a window
    a distorted profile priced too dear would still be tried. At 64 requests that line priced a
    window of 1 at well under the 1.8 plain steps it costs, and the tries cost the adaptive policy
    a quarter of plain decoding's throughput in one sweep (161 against 213 tok/s). The profile is
    now measured in rounds over the whole grid (`measure`), which keeps a burst of other work from
    bending its shape, and probe steps (policy.py) verify some nodes wherever nothing is chosen.
    """

    MIN_SEEN = 2
    MIN_FIT = 8  # steps in a batch-size bin before its line prices the counts it has not seen twice
    KEEP = 128  # steps kept per bin for its line
    FORGET_AFTER = 256  # steps: an older time no longer counts (see below)

    def __init__(self, profile: CostProfile, window: int = 16):
        self.profile = profile
        self.window = window
        self.steps = 0  # steps recorded so far: the clock samples are stamped with
        self.seen: dict[int, deque[tuple[int, float]]] = {}  # tokens in the forward -> (step, seconds less the head)
        self.seen_at: dict[int, dict[int, deque[tuple[int, float]]]] = {}  # requests -> tokens -> the same
        self.by_bin: dict[int, deque[tuple[int, int, int, int, float]]] = {}  # bin -> (step, requests, tokens, head rows, body)
        self._cached: tuple = (-1, {}, [], {})  # (steps, medians by tokens, their counts, lines by bin) as of `steps`

    def record(self, num_tokens: int, seconds: float, head_rows: int | None = None, num_reqs: int | None = None) -> None:
        """A step of num_reqs requests whose forward carried num_tokens tokens and whose LM head
        had head_rows rows (default: all of them) took `seconds` after drafting."""
        rows = num_tokens if head_rows is None else head_rows
        body = max(0.0, seconds - self.profile.head_cost(rows))
        self.steps += 1
        self.seen.setdefault(num_tokens, deque(maxlen=self.window)).append((self.steps, body))
        if num_reqs:
            self.seen_at.setdefault(num_reqs, {}).setdefault(num_tokens, deque(maxlen=self.window)).append((self.steps, body))
            self.by_bin.setdefault(batch_bin(num_reqs), deque(maxlen=self.KEEP)).append(
                (self.steps, num_reqs, num_tokens, rows, body))

    def _median(self, samples: deque | None) -> float | None:
        """The median of a bin's times from the last FORGET_AFTER steps, None with fewer than MIN_SEEN.

        Why forget: a bin is refreshed only when the planner chooses its plan, and the planner
        refuses a plan its bin prices too dear. So two slow steps early in a run (a machine's
        warm-up, a burst of other work) pinned a bin for good: in session 20's sweep at 16
        streams two 24-token steps of 77.8 and 69.6 ms, against about 55 ms in steady state, kept
        the policy from a plan that fixed k = 1 ran 3-5% faster. A bin nobody chose for
        FORGET_AFTER steps is priced again from its fresher neighbours and the profile, and so
        tried again if that says it pays: at worst one step in FORGET_AFTER per bin."""
        if samples is None:
            return None
        fresh = [t for at, t in samples if self.steps - at < self.FORGET_AFTER]
        return statistics.median(fresh) if len(fresh) >= self.MIN_SEEN else None

    def __call__(self, num_tokens: int) -> float:
        return self.costs(num_tokens, [num_tokens])[0]

    def table(self, num_reqs: int, widest: int, head_rows: list[int] | None = None) -> list[float]:
        """Seconds for windows 0..widest at this batch size, padded (forwards of num_reqs x
        (1 + window) tokens, the LM head over head_rows[window] rows, by default all of them)."""
        return self.costs(num_reqs, [num_reqs * (1 + w) for w in range(widest + 1)], head_rows)

    def costs(self, num_reqs: int, tokens: list[int], head_rows: list[int] | None = None) -> list[float]:
        """Seconds for steps of num_reqs requests whose forwards carry tokens[i] tokens (rising)
        and whose LM heads get head_rows[i] rows (default: all of them), monotone in i. The medians
        by token count and the bins' lines are computed once per recorded step (several calls
        price one step's plans); this batch size's own medians once per call."""
        if self._cached[0] != self.steps:  # the medians and lines change only with a step recorded
            med = {t: m for t, q in self.seen.items() if (m := self._median(q)) is not None}
            self._cached = (self.steps, med, sorted(med), {})
        _, med, known, lines = self._cached
        # this batch size's own medians, once per call (at 64 requests a plan prices ~450 budgets;
        # kept by batch size: a policy carried through a sweep had seen thousands of (requests,
        # tokens) pairs, and reading them all cost every step 1-3 ms at 64 requests, session 33)
        here_at = {t: m for t, q in self.seen_at.get(num_reqs, {}).items() if (m := self._median(q)) is not None}
        b = batch_bin(num_reqs)
        out: list[float] = []
        for i, T in enumerate(tokens):
            rows = T if head_rows is None else head_rows[i]
            body = here_at.get(T)
            if body is None:  # the bin's line, fitted once per recorded step and only where needed
                line = lines[b] if b in lines else lines.setdefault(b, self._line(num_reqs))
                tiled = self.profile.tiles(T)
                fit = None if line is None else max(0.0, line(num_reqs, tiled, rows))
                if fit is not None and T - num_reqs <= line.widest:
                    body = fit
                else:
                    body = self._estimate(tiled, known, med)
                    body = body if fit is None else max(fit, body)
            cost = body + self.profile.head_cost(rows)
            out.append(max(cost, out[-1] if out else 0.0))
        return out

    def _line(self, num_reqs: int) -> "BodyLine | None":
        """The line through the recent steps of this batch size's bin (see the class docstring);
        None with fewer than MIN_FIT of them from the last FORGET_AFTER steps, or when nothing
        but the batch size varied."""
        pts = [p[1:] for p in self.by_bin.get(batch_bin(num_reqs), ()) if self.steps - p[0] < self.FORGET_AFTER]
        if len(pts) < self.MIN_FIT:
            return None
        return BodyLine.fit(pts)

    def _estimate(self, num_tokens: int, known: list[int], med: dict[int, float]) -> float:
        prof = self.profile.body_cost
        if not known:
            return prof(num_tokens)
        j = bisect.bisect_left(known, num_tokens)  # known[j - 1] < num_tokens <= known[j]
        if j < len(known) and known[j] == num_tokens:
            return med[num_tokens]
        if 0 < j < len(known):
            lo, hi = known[j - 1], known[j]
            return med[lo] + (med[hi] - med[lo]) * (num_tokens - lo) / (hi - lo)
        if j == len(known):  # past every seen count: the profile's shape from the largest
            hi = known[-1]
            return med[hi] * prof(num_tokens) / max(prof(hi), 1e-12)
        near = known[0]  # below every seen count
        return min(med[near], med[near] * prof(num_tokens) / max(prof(near), 1e-12))
