"""Where n-gram and EAGLE-3 drafts each win, measured on the steps of EAGLE-3 decoding: the data
behind the hybrid drafter's rule (drafters/hybrid.py).

At every step of greedy EAGLE-3 decoding (k = 8, fixed) it records EAGLE-3's draft and the n-gram
draft (prompt lookup, suffixes of 3..1 tokens) at the same position, with the context the n-gram
match shares with the sequence's end. Greedy output does not depend on the drafter, so the final
output tells how many tokens of each draft would have been accepted. The table groups the steps by
shared context and gives each drafter's mean accepted length at k = 5, and that of the better of
the two (what a tree holding both would accept).

    python benchmarks/hybrid_probe.py                      # 6 prompts of each set: ~15 min on 2 cores
    python benchmarks/hybrid_probe.py --analyze benchmarks/results/eagle3/hybrid_probe.json
"""

from __future__ import annotations

import argparse
import collections
import json


def measure(drafter: str, sets: list[str], limit: int, max_tokens: int) -> list[dict]:
    from verispec import prompts as P
    from verispec.drafters.ngram import lookup
    from verispec.engine import LLM
    from verispec.sampling import SamplingParams

    llm = LLM("gemma3-270m", drafter=drafter, dtype="bfloat16", num_draft_tokens=8, draft_policy="fixed")
    eng = llm.engine
    propose, seen = eng.drafter.propose, []

    def recording(seqs, ks):
        out = propose(seqs, ks)
        seen.extend((len(s.tokens), d.tokens) for s, d in zip(seqs, out))
        return out

    eng.drafter.propose = recording
    rows = []
    for p in P.load(sets, limit=limit, spread=True):
        ids = P.render(p, llm.tokenizer, eng.model.config.model_type)
        seen.clear()
        seq = eng.add_request(ids, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
        while eng.has_work:
            eng.step()
        toks = seq.tokens
        for n, eagle in seen:
            truth = toks[n : n + 8]
            ngram, shared = lookup(toks[:n], 8, 3, 1)
            rows.append(dict(set=p.id.split("/")[0], pos=n - len(ids), eagle=accepted(eagle, truth),
                             ngram=accepted(ngram, truth), ngram_len=len(ngram), shared=shared))
    return rows


def accepted(draft: list[int], truth: list[int]) -> int:
    return next((i for i, (a, b) in enumerate(zip(draft, truth)) if a != b), min(len(draft), len(truth)))


def table(rows: list[dict], k: int = 5) -> str:
    groups = collections.defaultdict(list)
    for r in rows:
        groups[min(r["shared"], 6) if r["ngram_len"] else -1].append(r)
    out = [f"accepted tokens at k = {k}, by the context the n-gram match shares (-1: no match; 6: 6 or more)",
           "| shared | steps | EAGLE-3 | n-gram | better of the two |", "|---|---|---|---|---|"]
    for sh in sorted(groups):
        g = groups[sh]
        e, n = (sum(min(r[x], k) for r in g) / len(g) for x in ("eagle", "ngram"))
        m = sum(max(min(r["eagle"], k), min(r["ngram"], k)) for r in g) / len(g)
        out.append(f"| {sh} | {len(g)} | {e:.2f} | {n:.2f} | {m:.2f} |")
    out += ["", "| set | steps | EAGLE-3 | n-gram | n-gram where it matches, else EAGLE-3 | better of the two |",
            "|---|---|---|---|---|---|"]
    for s in dict.fromkeys(r["set"] for r in rows):
        g = [r for r in rows if r["set"] == s]
        mean = lambda f: sum(f(r) for r in g) / len(g)  # noqa: E731
        out.append(f"| {s} | {len(g)} | {mean(lambda r: min(r['eagle'], k)):.2f} | {mean(lambda r: min(r['ngram'], k)):.2f} | "
                   f"{mean(lambda r: min(r['ngram'] if r['ngram_len'] else r['eagle'], k)):.2f} | "
                   f"{mean(lambda r: max(min(r['eagle'], k), min(r['ngram'], k))):.2f} |")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--drafter", default="drafters/gemma3-270m-eagle3")
    ap.add_argument("--datasets", default="mtbench,humaneval,sharegpt")
    ap.add_argument("--limit", type=int, default=6)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--out", default="benchmarks/results/eagle3/hybrid_probe.json")
    ap.add_argument("--analyze", metavar="JSON", help="print the table of an earlier run")
    a = ap.parse_args()
    if a.analyze:
        rows = json.load(open(a.analyze))["steps"]
    else:
        rows = measure(a.drafter, a.datasets.split(","), a.limit, a.max_tokens)
        json.dump({"config": vars(a), "steps": rows}, open(a.out, "w"))
    print(table(rows))


if __name__ == "__main__":
    main()
