"""The bench report: one dict with every number (JSON), a Markdown summary, console tables, plots."""

from __future__ import annotations

import datetime
import json
import os
import platform
import sys
from collections import defaultdict
from importlib import metadata
from pathlib import Path

from .metrics import DEFINITIONS, Trace, equality, speedups, summarize


def environment() -> dict:
    import torch

    def ver(pkg):
        try:
            return metadata.version(pkg)
        except metadata.PackageNotFoundError:
            return None

    from ..kernels import cpu_name

    cpu = cpu_name()
    mem = None
    try:
        mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    except (ValueError, OSError, AttributeError):
        pass
    return {
        "versions": {"python": sys.version.split()[0], **{p: ver(p) for p in (
            "verispec", "torch", "transformers", "numpy", "matplotlib", "llama_cpp_python")}},
        "machine": {"platform": platform.platform(), "cpu": cpu, "logical_cpus": os.cpu_count(),
                    "torch_threads": torch.get_num_threads(), "memory_gib": round(mem, 1) if mem else None,
                    "load_average": [round(x, 2) for x in os.getloadavg()] if hasattr(os, "getloadavg") else None,
                    "cuda": torch.cuda.is_available(),
                    "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None},
    }


def build(traces: list[Trace], methods, prompts, config: dict, sweep: list | None = None,
          notes: list[str] | None = None, env: dict | None = None, sampled: dict | None = None,
          decode=None) -> dict:
    """decode(ids) -> text, as the server detokenizes: lets server sweep outputs be checked too."""
    by_method = defaultdict(list)
    for t in traces:
        by_method[t.method].append(t)
    base = {m.name: m.baseline for m in methods}
    greedy = not config.get("temperature")

    def summ(select) -> dict:
        out = {}
        for m in methods:
            ts = [t for t in by_method[m.name] if select(t)]
            if ts:
                bl = [t for t in by_method[base[m.name]] if select(t)]
                out[m.name] = summarize(ts, bl, compare_outputs=greedy)
        return out

    datasets = list(dict.fromkeys(p.dataset for p in prompts))
    cats = list(dict.fromkeys((p.dataset, p.category) for p in prompts))
    report = {
        "created_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": sys.argv,
        "config": config,
        **(env or environment()),
        "definitions": DEFINITIONS,
        "notes": list(notes or []),
        "methods": [{"name": m.name, "family": m.family, "baseline": m.baseline, "config": m.config} for m in methods],
        "prompts": [{"id": p.id, "dataset": p.dataset, "category": p.category, "prompt_tokens": len(p.ids)}
                    for p in prompts],
        "summary": summ(lambda t: True),
        "by_dataset": {d: summ(lambda t, d=d: t.dataset == d) for d in datasets},
        "by_category": {f"{d}/{c}": summ(lambda t, d=d, c=c: t.dataset == d and t.category == c)
                        for d, c in cats if len([1 for dd, _ in cats if dd == d]) > 1},
    }
    if "plain" in by_method:  # every method against verispec plain decoding, paired, cross-engine
        report["vs_verispec_plain"] = {m.name: speedups(by_method[m.name], by_method["plain"])["round"]
                                       for m in methods if m.name != "plain"}
        report["peer_outputs_vs_verispec_plain"] = {m.name: equality(by_method[m.name], by_method["plain"])
                                                    for m in methods if m.family != "verispec"}
    exact_cost = {}
    for m in methods:
        if m.name.endswith(" [exact]") and m.name[: -len(" [exact]")] in by_method:
            normal = m.name[: -len(" [exact]")]
            s = summarize(by_method[m.name], by_method[normal], compare_outputs=greedy)
            exact_cost[normal] = {"speed_ratio_exact_over_normal": s["speedup"], "outputs_equal_normal": s.get("equality")}
    if exact_cost:
        report["exact_cost"] = exact_cost
    report["sampled_check"] = sampled
    report["sweep"] = [p if isinstance(p, dict) else p.to_dict() for p in (sweep or [])]
    single = {}  # batched greedy outputs vs the single-stream plain decoding of the same prompt (round 0)
    for t in traces:
        if t.round == 0:
            single[(t.method, t.prompt)] = t.output_ids
    # a sweep prompt outside the single-stream set is checked against plain decoding's batched
    # output at the same level and path (itself checked where the sets overlap: batch invariance)
    def tag_of(method: str) -> str:
        return " [exact]" if method.endswith(" [exact]") else ""

    batched = {(p["concurrency"], p.get("via"), tag_of(p["method"]), r["prompt"]): r for p in report["sweep"]
               if p["method"].split(" ")[0] == "plain" for r in p["per_request"]}
    for p in report["sweep"]:
        tag = tag_of(p["method"])
        server = p.get("via") == "server"  # the server streams text: compare with the detokenized reference
        if server and decode is None:
            continue
        pairs = []
        for r in p["per_request"]:
            ref = single.get((f"plain{tag}", r["prompt"]))
            if ref is not None:
                ref = decode(ref) if server else ref
            elif not p["method"].startswith("plain") and (p["concurrency"], p.get("via"), tag, r["prompt"]) in batched:
                ref = batched[(p["concurrency"], p.get("via"), tag, r["prompt"])]["text" if server else "output_ids"]
            if ref is not None:
                pairs.append((r["text"] if server else r["output_ids"], ref))
        p["identical_to_single_stream_plain"] = {"identical": sum(a == b for a, b in pairs), "total": len(pairs)}
    report["mismatches"] = {n: s["equality"]["mismatched_prompts"] for n, s in report["summary"].items()
                            if s.get("equality") and s["equality"]["identical"] < s["equality"]["total"]}
    report["traces"] = [t.to_dict() for t in traces]
    return report


# ---- tables ----------------------------------------------------------------------------------
def _f(x, nd=2) -> str:
    return "-" if x is None else f"{x:.{nd}f}"


def _s(s: dict | None, nd=2) -> str:
    if not s or s.get("median") is None:
        return "-"
    return f"{s['median']:.{nd}f} [{s['min']:.{nd}f}, {s['max']:.{nd}f}]"


def table(headers: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])


def _acc(s: dict) -> str:
    return _f(s["acceptance_rate"], 3) if s.get("drafted") else "-"


def _ident(e: dict | None) -> str:
    return f"{e['identical']}/{e['total']}" if e else "-"


def _eq(s: dict) -> str:
    e = s.get("equality")
    return f"{e['identical']}/{e['total']}" if e else "-"


def main_table(summary: dict) -> str:
    rows = []
    for name, s in summary.items():
        rows.append([name, _s(s["tokens_per_s"], 1), _s(s.get("speedup")), _s(s.get("speedup_per_prompt")),
                     _f(s["tau"]), _acc(s), _f(s["tpot_ms"]["median"], 1),
                     _f(s["ttft_ms"]["median"], 1), _eq(s)])
    return table(["method", "tok/s median [min,max]", "speed-up (rounds)", "speed-up (per prompt)", "tau",
                  "accept rate", "TPOT ms", "TTFT ms", "identical to plain"], rows)


def group_table(groups: dict) -> str:
    rows = []
    for g, summ in groups.items():
        for name, s in summ.items():
            rows.append([g, name, str(s["prompts"]), _s(s["tokens_per_s"], 1), _s(s.get("speedup")), _f(s["tau"]),
                         _acc(s), _eq(s)])
    return table(["set", "method", "prompts", "tok/s", "speed-up", "tau", "accept rate", "identical"], rows)


def sweep_table(sweep: list[dict]) -> str:
    def ident(p):
        e = p.get("identical_to_single_stream_plain")
        return f"{e['identical']}/{e['total']}" if e and e["total"] else "-"

    rows = [[p["method"], str(p["concurrency"]), str(p["requests"]), _f(p["throughput_tok_s"], 1),
             _f(p.get("drain_throughput_tok_s"), 1), _f(p["per_user_tok_s"]["median"], 1), _f(p["tpot_ms"]["median"], 1),
             _f(p["tau"]), ident(p)]
            for p in sweep]
    return table(["method", "concurrency", "requests", "throughput tok/s", "with the drain tok/s", "per-user tok/s",
                  "TPOT ms", "tau", "identical to plain (single-stream, else batched)"], rows)


def acceptance_table(summary: dict) -> str:
    rows = [[n, " ".join(f"{x:.2f}" for x in s["acceptance_conditional"]),
             " ".join(f"{x:.2f}" for x in s["acceptance_unconditional"])]
            for n, s in summary.items() if s.get("drafted")]
    return table(["method", "conditional, k = 1, 2, ...", "unconditional, k = 1, 2, ..."], rows)


def _decoding(config: dict) -> str:
    t = config.get("temperature")
    return f"sampled at temperature {t} (seeded per prompt)" if t else "greedy"


def console(report: dict) -> str:
    c = report["config"]
    out = [f"verispec bench: {c['model']} {c['dtype']}, {len(report['prompts'])} prompts x {c['rounds']} rounds, "
           f"{c['max_tokens']} new tokens, k={c['num_draft_tokens']}, {_decoding(c)}",
           main_table(report["summary"])]
    if len(report["by_dataset"]) > 1:
        out += ["", group_table(report["by_dataset"])]
    if report.get("exact_cost"):
        out += ["", exact_table(report["exact_cost"])]
    if report["sweep"]:
        out += ["", sweep_table(report["sweep"])]
    if report.get("sampled_check"):
        out += ["", sampled_title(report["sampled_check"]), sampled_table(report["sampled_check"])]
    for c in (report.get("sampled_check") or {}).get("checks", []):
        if not c["passed"]:
            out.append(f"SAMPLED CHECK FAILED: {c['method']} on {c['prompt']} (TV {c['tv']:.3f} > {c['threshold']:.3f} "
                       f"or {c['outside_support']} samples outside the support)")
    for n, ps in report["mismatches"].items():
        out.append(f"MISMATCH: {n} differs from its plain decoding on {len(ps)} prompt(s): {', '.join(ps[:8])}")
    for n, e in report.get("peer_outputs_vs_verispec_plain", {}).items():
        out.append(f"peer {n}: greedy output identical to verispec plain on {e['identical']}/{e['total']} requests, "
                   f"tok/s {_s(report['vs_verispec_plain'][n])} x verispec plain (paired rounds)")
    out += [f"note: {n}" for n in report["notes"]]
    out.append("legend: tau = tokens per target forward after prefill, bonus included; speed-up = paired tok/s "
               "ratio vs the same engine's plain decoding (per round: ratio of totals); tok/s include prefill; "
               "full definitions in report.md / report.json")
    return "\n".join(out)


def sampled_title(sc: dict) -> str:
    st = sc["settings"]
    return (f"Sampled output vs the exact target distribution of the first {st['max_tokens']} tokens "
            f"(T = {st['temperature']}, top-k {st['top_k']}, top-p {st['top_p']}; {sc['samples_per_check']} seeded "
            f"requests per check; pass: TV <= max null TV + 2 sd and no sample outside the support)")


def sampled_table(sc: dict) -> str:
    rows = [[c["method"], c["prompt"], str(c["outcomes"]), _f(c["tv"], 3), _f(c["null_tv_mean"], 3),
             _f(c["threshold"], 3), str(c["outside_support"]), _f(c["acceptance_rate"], 2),
             "pass" if c["passed"] else "**FAIL**"] for c in sc["checks"]]
    rows += [["-", s["prompt"], "-", "-", "-", "-", "-", "-", f"skipped: {s['reason']}"] for s in sc["skipped"]]
    return table(["method", "prompt", "outcomes", "TV", "null TV mean", "threshold", "outside support",
                  "accept rate", "result"], rows)


def exact_table(cost: dict) -> str:
    rows = [[n, _s(v["speed_ratio_exact_over_normal"], 3),
             f"{v['outputs_equal_normal']['identical']}/{v['outputs_equal_normal']['total']}"] for n, v in cost.items()]
    return table(["method", "tok/s exact / normal (paired, rounds)", "exact output == normal output"], rows)


def markdown(report: dict, plots: list[str]) -> str:
    c, env = report["config"], report["machine"]
    md = [f"# verispec bench — {c['model']} ({c['dtype']})", "",
          f"Created {report['created_utc']}. Command: `{' '.join(report['command'])}`", "",
          f"{len(report['prompts'])} prompts ({', '.join(c['datasets'])}) x {c['rounds']} rounds, "
          f"{c['max_tokens']} new tokens, {_decoding(c)}, k = {c['num_draft_tokens']}, modes {', '.join(c['modes'])}, "
          f"single stream; methods interleaved per prompt, order rotated every prompt and round.", "",
          f"Machine: {env['cpu']}, {env['logical_cpus']} logical CPUs, torch threads {env['torch_threads']}, "
          f"{env['memory_gib']} GiB, load average at the end {env['load_average']}. Versions: "
          + ", ".join(f"{k} {v}" for k, v in report["versions"].items() if v), "",
          "## Results (all prompts)", "", main_table(report["summary"]), ""]
    if report["mismatches"]:
        md += ["**Output mismatches** (greedy output differs from the same engine's plain decoding):", ""]
        md += [f"- {n}: {', '.join(ps)}" for n, ps in report["mismatches"].items()] + [""]
    if any(s.get("drafted") for s in report["summary"].values()):
        md += ["## Per-position acceptance (all prompts)", "", acceptance_table(report["summary"]), ""]
    md += ["## Per dataset", "", group_table(report["by_dataset"]), ""]
    if report["by_category"]:
        md += ["## Per category", "", group_table(report["by_category"]), ""]
    if report.get("vs_verispec_plain"):
        md += ["## Everything vs verispec plain decoding (paired, median [min, max] over rounds)", "",
               table(["method", "tok/s ratio", "greedy output identical to verispec plain"],
                     [[n, _s(s), _ident(report.get("peer_outputs_vs_verispec_plain", {}).get(n))]
                      for n, s in report["vs_verispec_plain"].items()]), ""]
    if report.get("exact_cost"):
        md += ["## Cost of exact mode", "", exact_table(report["exact_cost"]), ""]
    if report.get("sampled_check"):
        md += ["## Sampled output: distribution check", "", sampled_title(report["sampled_check"]) + ".", "",
               sampled_table(report["sampled_check"]), ""]
    if report["sweep"]:
        md += ["## Load sweep", "", "In-process points: one engine per point with max_batch_size = concurrency; the "
               "requests from a pool of distinct prompts (the run's first): a first wave, the measured requests "
               "(the prompts once, or one per slot, at least 16), a wave more queued behind them, so a finished request's slot "
               "goes to a waiting one; every method runs the level's requests at once, their engines' steps "
               "alternating, each method timed on its own clock (the sum of its steps' times); throughput by "
               "Little's law over the measured requests, and with the drain "
               "until the last one finished. Outputs outside the single-stream prompts are compared with plain "
               "decoding's at the same level. Points "
               "marked (server): a `verispec serve` process per method (max_batch_size = the largest level), "
               "requests streamed over HTTP with that many in flight; TTFT/TPOT measured at the client; output "
               "compared as text with the single-stream plain decoding.", "", sweep_table(report["sweep"]), ""]
    md += ["## Plots", ""] + [f"![{p}]({p})" for p in plots] + [""]
    md += ["## Definitions", ""] + [f"- **{k}**: {v}" for k, v in report["definitions"].items()] + [""]
    if report["notes"]:
        md += ["## Notes", ""] + [f"- {n}" for n in report["notes"]] + [""]
    return "\n".join(md)


def write(report: dict, out_dir: str | Path) -> list[Path]:
    from . import plots as plot_mod

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    names = plot_mod.write_all(report, out)
    (out / "report.json").write_text(json.dumps(report, indent=1))
    (out / "report.md").write_text(markdown(report, names))
    return [out / "report.json", out / "report.md", *(out / n for n in names)]
