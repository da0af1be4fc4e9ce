"""What the engines did during a server sweep, step by step: the trace that `step_trace/`
records in every `verispec serve` process, split into the sweep's levels and compared method
against method.

    VERISPEC_STEP_TRACE=/tmp/trace PYTHONPATH=benchmarks/step_trace verispec bench ... \
        --concurrency 16,32,64 --sweep-via server --sweep-rounds 2
    python benchmarks/sweep_trace.py /tmp/trace

The client's record of each level (server, concurrency, start and end) picks each server's steps
of the level and round; the sweep's warm-up is left out. Per level and method: the engine
steps, the time the engine thread spent in them against their span (the rest is the
worker's loop: handing tokens to the event loop, admitting requests, waiting), tokens emitted per
second of span, tau over decode steps, the median full-batch decode step (its LM head, its minor page faults) and, for the adaptive
policy, its plans and probes and how they ran against the plain server's median full-batch step
at the same level and round.
"""

from __future__ import annotations

import argparse
import gzip
import json
import statistics
from pathlib import Path

def method(argv: list[str]) -> str:
    get = lambda flag, default: argv[argv.index(flag) + 1] if flag in argv else default  # noqa: E731
    drafter = get("--drafter", "none")
    if drafter == "none":
        return "plain"
    return f"{drafter} k={get('-k', '?')} {get('--draft-policy', 'fixed')}"


def med(xs) -> float | None:
    xs = list(xs)
    return statistics.median(xs) if xs else None


def kinds(steps: list[dict]) -> dict[str, dict]:
    """The level's steps by kind: prefill (a forward of prompts alone), quiet (decode, nothing
    verified), verify (decode with admitted nodes), rider / rider+verify (decode steps that
    carried prompt chunks): steps, seconds, mean running requests, prompt tokens and admitted
    nodes a step, decode tokens emitted. Admitted nodes are traced under the adaptive policy only:
    a fixed-k server's decode steps all count as quiet or rider."""
    out: dict[str, list[dict]] = {}
    for r in steps:
        if r["kind"] != "decode":
            kind = "prefill"
        elif r["prompt"]:
            kind = "rider+verify" if r.get("admitted") else "rider"
        else:
            kind = "verify" if r.get("admitted") else "quiet"
        out.setdefault(kind, []).append(r)
    return {k: {"steps": len(g), "seconds": sum(r["s"] for r in g), "mean_n": statistics.mean(r["n"] for r in g),
                "prompt_per_step": statistics.mean(r["prompt"] for r in g),
                "admitted_per_step": statistics.mean(r.get("admitted", 0) for r in g),
                "emitted": sum(r.get("emitted", 0) for r in g)} for k, g in sorted(out.items())}


def summary(steps: list[dict], level: int, plain_step: float | None) -> dict:
    span = steps[-1]["t"] + steps[-1]["s"] - steps[0]["t"]
    decode = [r for r in steps if r["kind"] == "decode"]
    full = [r for r in decode if r["n"] >= 3 * level // 4]
    quiet = [r["s"] for r in full if not r.get("admitted") and not r["prompt"]]
    riders = [r for r in decode if r["prompt"]]
    emitted = sum(r.get("emitted", 0) for r in decode)
    forwards = sum(1 for r in decode)
    out = {
        "steps": len(steps), "span_s": span, "engine_busy": sum(r["s"] for r in steps) / span,
        "tok_s": emitted / span, "tau": emitted / sum(r["n"] for r in decode) if decode else None,
        "full_steps": len(full), "quiet_full_step_ms": statistics.median(quiet) * 1e3 if quiet else None,
        # the quiet full steps' LM head and the minor page faults a step took (fresh pages zeroed)
        "quiet_head_ms": med(r["head_s"] * 1e3 for r in full if "head_s" in r and not r.get("admitted") and not r["prompt"]),
        "quiet_faults": med(r["faults"] for r in full if "faults" in r and not r.get("admitted") and not r["prompt"]),
        "rider_steps": len(riders), "rider_s": sum(r["s"] for r in riders),
        "prefill_steps": sum(r["kind"] == "prefill" for r in steps),
        "prefill_s": sum(r["s"] for r in steps if r["kind"] == "prefill"),
        "mean_batch": statistics.mean(r["n"] for r in decode) if decode else None,
        "kinds": kinds(steps),
    }
    planned = [r for r in full if r.get("admitted") and not r.get("probe") and not r["prompt"]]
    probes = [r for r in full if r.get("probe")]
    if any("drafted" in r for r in decode):
        base = plain_step or out["quiet_full_step_ms"] / 1e3 if (plain_step or out["quiet_full_step_ms"]) else None
        ran = [(r["n"] + r.get("accepted", 0)) / r["s"] / (r["n"] / base) for r in planned] if base else []
        out.update(
            verifying_steps=sum(1 for r in decode if r.get("admitted")), plans=len(planned), probes=len(probes),
            drafting_s=sum(r.get("draft_s", 0) for r in decode),
            admitted=sum(r.get("admitted", 0) for r in decode), accepted=sum(r.get("accepted", 0) for r in decode),
            plan_predicted=med(r["predicted"] for r in planned if r.get("predicted")),
            plan_ran=med(ran),
            plan_cost_error=med(r["s"] / r["cost_plan"] for r in planned if r.get("cost_plan")),
            quiet_cost_error=med(r["s"] / r["cost_plain"] for r in full if r.get("cost_plain") and not r.get("admitted") and not r["prompt"]),
            plan_expected=sum(r.get("expected", 0) for r in planned), plan_accepted=sum(r.get("accepted", 0) for r in planned),
            probe_ran=med((r["n"] + r.get("accepted", 0)) / r["s"] / (r["n"] / base) for r in probes) if base else None,
        )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("trace", type=Path)
    ap.add_argument("--json", type=Path, help="write the per-level summaries here")
    args = ap.parse_args()
    servers, levels = {}, []  # url: [(method, records)], a server per method and round (a port may recur)
    for f in sorted(list(args.trace.glob("*.json")) + list(args.trace.glob("*.json.gz"))):
        d = json.loads(gzip.open(f).read() if f.suffix == ".gz" else f.read_text())
        if "serve" in d["argv"]:
            port = d["argv"][d["argv"].index("--port") + 1]
            servers.setdefault(f"http://127.0.0.1:{port}", []).append((method(d["argv"]), d["records"]))
        levels += d.get("levels", [])
    if not servers or not levels:
        raise SystemExit(f"no server traces or no client levels in {args.trace}")
    table, rounds = {}, {}
    for lv in sorted(levels, key=lambda lv: lv["t0"]):
        if lv["requests"] == 2 or lv["url"] not in servers:  # the sweep's warm-up
            continue
        for name, records in servers[lv["url"]]:
            steps = sorted((x for x in records if lv["t0"] <= x["t"] <= lv["t1"]), key=lambda x: x["t"])
            if steps:  # the server at this url during the level
                c = lv["concurrency"]
                r = rounds[(name, c)] = rounds.get((name, c), -1) + 1
                table[(name, r, c)] = (lv, steps)
    out = {}
    for key in sorted(table, key=lambda k: (k[2], k[1], k[0] != "plain")):
        name, r, c = key
        lv, steps = table[key]
        plain = out.get(("plain", r, c))
        s = out[key] = summary(steps, c, plain["quiet_full_step_ms"] / 1e3 if plain and plain["quiet_full_step_ms"] else None)
        s["client_s"] = lv["t1"] - lv["t0"]
        line = (f"{c:3d} r{r + 1} {name:20s} level {s['client_s']:5.1f} s, engine busy {s['engine_busy']:.0%} of its "
                f"{s['span_s']:.1f} s, tau {s['tau']:.2f}, {s['steps']} steps (mean batch {s['mean_batch']:.1f}), quiet full "
                f"step {s['quiet_full_step_ms'] or float('nan'):.1f} ms (head {s['quiet_head_ms'] or float('nan'):.1f} ms, "
                f"{s['quiet_faults'] if s['quiet_faults'] is not None else float('nan'):.0f} page faults), riders {s['rider_steps']} ({s['rider_s']:.1f} s), "
                f"prefills {s['prefill_steps']} ({s['prefill_s']:.1f} s)")
        if "plans" in s:
            line += (f"\n        verifying {s['verifying_steps']} (plans {s['plans']}, probes {s['probes']}), drafting "
                     f"{s['drafting_s']:.2f} s, admitted {s['admitted']}, accepted {s['accepted']}; full-batch plans predicted "
                     f"{s['plan_predicted'] or float('nan'):.2f}x, ran {s['plan_ran'] or float('nan'):.2f}x; probes ran "
                     f"{s['probe_ran'] or float('nan'):.2f}x plain's quiet step"
                     f"\n        plan steps ran {s['plan_cost_error'] or float('nan'):.2f}x their priced time, quiet looks "
                     f"{s['quiet_cost_error'] or float('nan'):.2f}x; plans expected {s['plan_expected']:.0f} accepted, got {s['plan_accepted']}")
        for k, g in s["kinds"].items():
            line += (f"\n        {k:13s} {g['steps']:4d} steps {g['seconds']:6.2f} s, mean n {g['mean_n']:5.1f}, "
                     f"{g['prompt_per_step']:5.1f} prompt and {g['admitted_per_step']:4.1f} admitted a step, emitted {g['emitted']}")
        print(line)
    if args.json:
        args.json.write_text(json.dumps({f"{n}|{r}|{c}": s for (n, r, c), s in out.items()}, indent=1))


if __name__ == "__main__":
    main()
