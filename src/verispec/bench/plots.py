"""PNG plots of a bench report (matplotlib, Agg backend); each function reads the report dict."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

FAMILY_COLORS = {"verispec": "tab:blue", "transformers": "tab:orange", "llama.cpp": "tab:green"}


def _err(s: dict) -> tuple[float, float, float]:
    m = s["median"] or 0.0
    return m, m - (s["min"] if s["min"] is not None else m), (s["max"] if s["max"] is not None else m) - m


def speedup_by_dataset(report: dict, path: Path) -> None:
    groups = {"all": report["summary"], **report["by_dataset"]}
    methods = [m["name"] for m in report["methods"] if m["name"] != m["baseline"]]
    fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(groups) * max(1, len(methods)) / 2), 4))
    w = 0.8 / max(1, len(methods))
    for j, name in enumerate(methods):
        vals = [_err(g[name]["speedup"]) if name in g and "speedup" in g[name] else (0, 0, 0) for g in groups.values()]
        xs = [i + j * w for i in range(len(groups))]
        ax.bar(xs, [v[0] for v in vals], w, yerr=[[v[1] for v in vals], [v[2] for v in vals]], capsize=3, label=name)
    ax.axhline(1.0, color="k", lw=0.8, ls="--")
    ax.set_xticks([i + w * (len(methods) - 1) / 2 for i in range(len(groups))], list(groups))
    ax.set_ylabel("speed-up over the same engine's plain decoding")
    ax.set_title("Paired speed-up per dataset (median over rounds, bars: min-max)")
    if methods:
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def acceptance_curves(report: dict, path: Path) -> None:
    fig, ax = plt.subplots(figsize=(6, 4))
    for name, s in report["summary"].items():
        cond, unc = s.get("acceptance_conditional"), s.get("acceptance_unconditional")
        if not cond:
            continue
        pos = list(range(1, len(cond) + 1))
        line, = ax.plot(pos, cond, marker="o", label=f"{name} (conditional)")
        ax.plot(pos, unc, marker="x", ls="--", color=line.get_color(), label=f"{name} (unconditional)")
    ax.set_xlabel("draft position k")
    ax.set_ylabel("acceptance")
    ax.set_ylim(0, 1.05)
    ax.set_title("Per-position acceptance, all prompts (solid: conditional, dashed: unconditional)", fontsize=9)
    if ax.lines:
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def load_sweep(report: dict, path: Path) -> None:
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    by = {}
    for p in report["sweep"]:
        by.setdefault(p["method"], []).append(p)
    for name, pts in by.items():
        pts.sort(key=lambda p: p["concurrency"])
        cs = [p["concurrency"] for p in pts]
        ls = "--" if pts[0].get("via") == "server" else "-"  # dashed: through the HTTP server
        line, = a.plot(cs, [p["throughput_tok_s"] for p in pts], marker="o", ls=ls, label=name)
        users = [p["per_user_tok_s"]["median"] or 0.0 for p in pts]
        b.plot(users, [p["throughput_tok_s"] for p in pts], marker="o", ls=ls, color=line.get_color(), label=name)
        for c, x, y in zip(cs, users, [p["throughput_tok_s"] for p in pts]):
            b.annotate(str(c), (x, y), fontsize=7, xytext=(3, 3), textcoords="offset points")
    a.set_xscale("log", base=2)
    a.set_xlabel("concurrency (requests in flight)")
    a.set_ylabel("throughput, output tok/s")
    a.set_title("Throughput vs concurrency")
    b.set_xlabel("per-user speed, tok/s (median 1/TPOT)")
    b.set_ylabel("throughput, output tok/s")
    b.set_title("Throughput vs per-user speed (labels: concurrency)")
    for ax in (a, b):
        if ax.lines:
            ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def peers_vs_verispec(report: dict, path: Path) -> None:
    fams = {m["name"]: m["family"] for m in report["methods"]}
    names = list(report["summary"])
    vals = [_err(report["summary"][n]["tokens_per_s"]) for n in names]
    fig, ax = plt.subplots(figsize=(max(8, 0.9 * len(names)), 4.5))
    ax.bar(range(len(names)), [v[0] for v in vals], yerr=[[v[1] for v in vals], [v[2] for v in vals]], capsize=3,
           color=[FAMILY_COLORS.get(fams.get(n), "tab:gray") for n in names])
    ax.set_xticks(range(len(names)), names, rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("tok/s, single stream")
    ax.set_title("Same prompts, same run: verispec (blue), transformers (orange), llama.cpp (green)\n"
                 "median over rounds, bars: min-max", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_all(report: dict, out: Path) -> list[str]:
    files = {"speedup_by_dataset.png": speedup_by_dataset, "acceptance_per_position.png": acceptance_curves,
             "peers_vs_verispec.png": peers_vs_verispec}
    if report.get("sweep"):
        files["load_sweep.png"] = load_sweep
    for name, fn in files.items():
        fn(report, out / name)
    return list(files)
