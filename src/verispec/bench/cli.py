"""`verispec bench`: parse, load, run, report. The work is in prompts / runner / peers / report."""

from __future__ import annotations

import argparse
import os
import sys

DEFAULT_CONCURRENCY = "1,2,4,8,16,32"


def _ints(s: str) -> list[int]:
    if s.strip().lower() in ("", "none", "0"):
        return []
    try:
        v = [int(x) for x in s.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {s!r}") from None
    if any(x < 1 for x in v):
        raise argparse.ArgumentTypeError("values must be >= 1")
    return v


def _list(s: str) -> list[str]:
    return [x.strip() for x in s.split(",") if x.strip() and x.strip().lower() != "none"]


def _names(s: str) -> list[str]:
    """A comma-separated list where "none" is a name (--quant none,int8), not the empty list."""
    return [x.strip() for x in s.split(",") if x.strip()]


def add_parser(sub) -> None:
    from ..options import engine_options

    opts = engine_options(drafter=False, exact=False, quant=False,
                          max_model_len_help="KV rows per sequence (default: longest prompt + max tokens + 8)")
    b = sub.add_parser("bench", parents=[opts], help="benchmark drafters against plain decoding and peers on standard prompt sets",
                       description="Runs plain decoding and every drafter on the same prompts (interleaved per "
                                   "prompt, order rotated), checks greedy outputs equal plain decoding token for "
                                   "token, and prints speed, tau and acceptance; --report DIR writes JSON, Markdown "
                                   "and PNG plots.")
    b.add_argument("--drafters", type=_list, default=["ngram"],
                   help="comma-separated methods DRAFTER[@tree=SHAPE][@k=N] (plain always runs); DRAFTER is "
                        "{drafters}; SHAPE: chain, dynamic[:W] or static:B1,B2,..; N: draft nodes per step (-k "
                        "by default)")
    b.add_argument("--datasets", type=_list, default=["mtbench", "humaneval"],
                   help="comma-separated: mtbench, humaneval, sharegpt (default mtbench,humaneval)")
    b.add_argument("--limit", type=int, default=None, help="first N prompts (questions) of each dataset")
    b.add_argument("--spread", action="store_true",
                   help="with --limit: evenly spaced prompts of each set instead of the first ones (MT-Bench: "
                        "every 80/N-th question, covering all 8 categories when N >= 8)")
    b.add_argument("--mtbench-turns", type=int, choices=(1, 2), default=1,
                   help="2: also the second turns (history = the target's own greedy answer to turn 1)")
    b.add_argument("--sharegpt-n", type=int, default=80, help="size of the seeded ShareGPT sample (default 80)")
    b.add_argument("--seed", type=int, default=0, help="ShareGPT sample seed")
    b.add_argument("--max-tokens", type=int, default=128, help="new tokens per request (default 128)")
    b.add_argument("--temperature", type=float, default=0.0,
                   help="0: greedy, outputs checked token for token against plain decoding; > 0: sampled (seeded "
                        "per prompt), speed and tau only (losslessness there is --sample-check's distribution test) "
                        "(default 0)")
    b.add_argument("--stop-at-eos", action="store_true", help="stop at <eos> (default: always --max-tokens tokens)")
    b.add_argument("--modes", type=_list, default=["normal"],
                   help="normal and/or exact (EngineConfig.exact): e.g. normal,exact measures exact mode's cost")
    b.add_argument("--exact-drafters", type=_list, default=None,
                   help="drafters that also run in exact mode (default: all of --drafters)")
    b.add_argument("--quant", type=_names, default=["none"],
                   help="comma-separated precisions of the target: none (the --dtype weights), int8, int4; plain and "
                        "every drafter run on each, interleaved in the same run (the load sweep and the sampled "
                        "check use the first)")
    b.add_argument("--rounds", type=int, default=3)
    b.add_argument("--peers", type=_list, default=["hf", "hf-pld", "llama.cpp", "llama.cpp-pld"],
                   help="hf (transformers generate), hf-pld[:K] (its prompt lookup; K defaults to -k), "
                        "hf-assist:PATH (its assisted generation with a draft model folder), llama.cpp and "
                        "llama.cpp-pld[:K] (plain / prompt lookup, when llama-cpp-python is installed: "
                        "pip install 'verispec[llama]'); vllm, vllm-ngram[:K] and vllm-eagle3[:DIR] (vLLM in its "
                        "own venv, made by benchmarks/vllm_env.sh; DIR defaults to the eagle3 drafter in "
                        "--drafters); 'none' for no peers")
    b.add_argument("--concurrency", type=_ints, default=_ints(DEFAULT_CONCURRENCY),
                   help=f"load sweep levels (default {DEFAULT_CONCURRENCY}); 'none' to skip")
    b.add_argument("--sweep-via", type=_list, default=["engine"],
                   help="engine (in process) and/or server (through `verispec serve` processes over HTTP)")
    b.add_argument("--sweep-rounds", type=int, default=1, help="rounds of the load sweep, in process and through the server (each point: its median round)")
    b.add_argument("--sweep-drafters", type=_list, default=None,
                   help="drafters in the load sweep (default: plain + --drafters)")
    b.add_argument("--sample-check", type=int, default=2, metavar="PROMPTS",
                   help="sampled-output distribution check on this many prompts per method: exact distribution of "
                        "3 tokens at T=0.8, top-k 5, top-p 0.95 vs --sample-n seeded requests (default 2; 0: off)")
    b.add_argument("--sample-n", type=int, default=1000, help="requests per sampled check (default 1000)")
    b.add_argument("--report", default=None, help="directory for report.json, report.md and the PNG plots")
    b.add_argument("--strict", action="store_true",
                   help="exit 1 if any verispec greedy output differs from plain or a sampled check fails")
    b.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    # OpenMP's own waits, not the other commands' choice by the load (threads.py): a benchmark runs on an
    # idle machine, where sleeping at every barrier halved every engine's speed, peers' included
    b.set_defaults(run=cmd_bench, passive_waits=False)


def _check(args) -> None:
    from ..errors import UserError
    from ..prompts import DATASETS

    args.datasets = list(dict.fromkeys(args.datasets))  # prompt ids must be unique within a run
    bad = [d for d in args.datasets if d not in DATASETS]
    if bad or not args.datasets:
        raise UserError(f"unknown dataset(s) {bad}; choose from {', '.join(DATASETS)}")
    for name, v, lo in (("--max-tokens", args.max_tokens, 1), ("--rounds", args.rounds, 1),
                        ("--num-draft-tokens", args.num_draft_tokens, 1), ("--limit", 1 if args.limit is None else args.limit, 1),
                        ("--sharegpt-n", args.sharegpt_n, 1), ("--sample-check", args.sample_check, 0),
                        ("--sample-n", args.sample_n, 10)):
        if v < lo:
            raise UserError(f"{name} must be >= {lo}, got {v}")
    if args.temperature < 0:
        raise UserError(f"--temperature must be >= 0, got {args.temperature}")
    if args.temperature > 0 and (args.peers or args.concurrency):
        raise UserError("--temperature > 0 measures single-stream speed and tau of verispec's methods only (the peers "
                        "and the load sweep decode greedily): add --peers none --concurrency none")
    if not args.sweep_via or any(v not in ("engine", "server") for v in args.sweep_via):
        raise UserError(f"--sweep-via takes engine and/or server, got {args.sweep_via}")
    from ..options import QUANT_MODES

    args.quant = list(dict.fromkeys(args.quant))
    if not args.quant or any(q not in QUANT_MODES for q in args.quant):
        raise UserError(f"--quant takes {', '.join(QUANT_MODES)}, got {args.quant}")
    if not args.modes or any(m not in ("normal", "exact") for m in args.modes):
        raise UserError(f"--modes takes normal and/or exact, got {args.modes}")
    for p in args.peers:
        name, _, k = p.partition(":")
        if name in ("hf-pld", "llama.cpp-pld") and k and not k.isdigit() or name == "hf-assist" and not k:
            raise UserError(f"bad peer {p!r}: hf-pld:K / llama.cpp-pld:K take a number, hf-assist:PATH a draft model")
        if name in ("vllm-ngram",) and k and not k.isdigit() or name == "vllm" and k:
            raise UserError(f"bad peer {p!r}: vllm takes no argument, vllm-ngram:K a number")
        if name not in ("hf", "hf-pld", "hf-assist", "llama.cpp", "llama.cpp-pld", "vllm", "vllm-ngram", "vllm-eagle3"):
            raise UserError(f"unknown peer {p!r}; use hf, hf-pld[:K], hf-assist:PATH, llama.cpp, llama.cpp-pld[:K], "
                            f"vllm, vllm-ngram[:K], vllm-eagle3[:DIR] or none")
        if args.device != "cpu" and not name.startswith("hf"):
            raise UserError(f"peer {p!r} runs on the CPU (its CPU build); on --device {args.device} the peers are "
                            f"transformers': hf, hf-pld[:K], hf-assist:PATH")


def cmd_bench(args) -> int:
    import torch

    from .. import preflight
    from .. import prompts as P
    from ..engine import DTYPES
    from ..errors import UserError
    from ..kv import CacheFullError
    from ..models import ModelLoadError, hf_folder, load_model, load_tokenizer
    from ..threads import setup_threads
    from . import report as R
    from .runner import measured_requests, run_interleaved, run_sweep, verispec_methods

    _check(args)
    preflight.device(args.device)
    setup_threads(args.threads)
    log = (lambda m: None) if args.quiet else (lambda m: print(f"[bench] {m}", file=sys.stderr, flush=True))
    load_at_start = [round(x, 2) for x in os.getloadavg()] if hasattr(os, "getloadavg") else None
    notes = []
    ignore_eos = not args.stop_at_eos
    cfg = preflight.model_config(args.model, args.dtype)
    if args.max_model_len is not None:
        preflight.max_model_len(args.max_model_len, cfg, args.model)
    try:
        prompts = P.load(args.datasets, args.limit, args.mtbench_turns, args.sharegpt_n, args.seed, args.spread)
        log(f"{len(prompts)} prompts; loading {args.model} ({args.dtype})")
        targets = {q: load_model(args.model, DTYPES[args.dtype], args.device, quant=q) for q in args.quant}
        target = targets[args.quant[0]]
        if args.quant[0] != "none":
            notes.append(f"the load sweep and the sampled-output check run on the {args.quant[0]} target.")
        tok = load_tokenizer(args.model)
        model_type = target.config.model_type
        for p in prompts:
            if not p.needs_history:
                p.ids = P.render(p, tok, model_type)
        longest = max(len(p.ids) if p.ids else 0 for p in prompts)
        if any(p.needs_history for p in prompts):
            _fill_second_turns(prompts, target, tok, model_type, args, longest)
            notes.append("MT-Bench second turns: the history holds the target's own plain greedy answer to turn 1 "
                         "(untimed, cut at <eos>).")
        longest = max(len(p.ids) for p in prompts)
        max_len = args.max_model_len or longest + args.max_tokens + 8
        if longest + args.max_tokens > max_len:
            raise UserError(f"the longest prompt ({longest} tokens) + --max-tokens {args.max_tokens} exceeds "
                            f"--max-model-len {max_len}")
        methods = [m for q, t in targets.items()
                   for m in verispec_methods(t, tok, args.model, args.drafters, args.num_draft_tokens, args.dtype,
                                             args.modes, max_len, ignore_eos, exact_drafters=args.exact_drafters,
                                             quant=q, temperature=args.temperature)]
        methods += _peers(args, max_len, ignore_eos, notes, log)
    except P.PromptSetError as e:
        raise UserError(str(e)) from e
    except (ModelLoadError, CacheFullError, ValueError) as e:
        raise UserError(str(e)) from e
    if not args.stop_at_eos:
        notes.append("every request generates exactly --max-tokens tokens (<eos> does not stop it; transformers: "
                     "eos_token_id=None, llama.cpp: its generator is not stopped at <eos>).")
    notes.append("speed numbers are measured in this run; nothing is cached between requests, except that "
                 "requests with the same prompt admitted together prefill it once (the load sweep draws distinct "
                 "prompts, so that none repeats within a batch). Peers' tau = (tokens - 1) / (target forward calls - "
                 "1), counted with a forward hook (transformers) or per eval call (llama.cpp).")

    log(f"{len(methods)} methods x {len(prompts)} prompts x {args.rounds} rounds")
    traces = run_interleaved(methods, prompts, args.max_tokens, args.rounds, progress=log)
    sampled = None
    if args.sample_check:
        from .sampled import run_sampled_check

        sampled = run_sampled_check(target, tok, args.model, args.drafters, args.num_draft_tokens, args.dtype, prompts,
                                    args.sample_check, args.sample_n, max_len, progress=log,
                                    tag="" if args.quant[0] == "none" else f" [{args.quant[0]}]")
    sweep = []
    if args.concurrency:
        pool = sweep_pool(prompts, args.datasets, max(2 * c + measured_requests(len(prompts), c) for c in args.concurrency),
                          tok, model_type, max_len - args.max_tokens, args.sharegpt_n, args.seed)
        log(f"load sweep: {len(pool)} distinct prompts")
        sweep_drafters = [None, *(args.sweep_drafters if args.sweep_drafters is not None else args.drafters)]
        sweep_drafters = [None if d in (None, "plain") else d for d in dict.fromkeys(sweep_drafters)]
        if "engine" in args.sweep_via:
            sweep += run_sweep(target, tok, args.model, sweep_drafters, args.num_draft_tokens, args.dtype,
                               args.modes[0], args.concurrency, prompts, args.max_tokens, max_len, ignore_eos,
                               rounds=args.sweep_rounds, progress=log, pool=pool)
        if "server" in args.sweep_via:
            from .server_sweep import run_server_sweep

            if not ignore_eos:
                raise UserError("--sweep-via server always generates --max-tokens tokens (drop --stop-at-eos)")
            sweep += run_server_sweep(args.model, sweep_drafters, args.num_draft_tokens, args.dtype, args.concurrency,
                                      prompts, args.max_tokens, max_len, args.sweep_rounds, args.threads, progress=log,
                                      quant=args.quant[0], pool=pool, device=args.device)
    config = {
        "model": args.model, "model_type": model_type, "hf_folder": str(hf_folder(args.model)), "dtype": args.dtype,
        "quant": args.quant,
        "drafters": args.drafters, "datasets": args.datasets, "limit": args.limit, "spread": args.spread, "mtbench_turns": args.mtbench_turns,
        "sharegpt_n": args.sharegpt_n, "seed": args.seed, "max_tokens": args.max_tokens, "ignore_eos": ignore_eos,
        "num_draft_tokens": args.num_draft_tokens, "modes": args.modes,
        "exact_drafters": args.exact_drafters, "rounds": args.rounds, "peers": args.peers,
        "concurrency": args.concurrency, "sweep_via": args.sweep_via, "sweep_rounds": args.sweep_rounds,
        "max_model_len": max_len, "threads": torch.get_num_threads(), "device": args.device,
        "greedy": not args.temperature, "temperature": args.temperature, "load_average_at_start": load_at_start, "sample_check": args.sample_check,
        "sample_n": args.sample_n,
    }
    report = R.build(traces, methods, prompts, config, sweep, notes, sampled=sampled,
                     decode=lambda ids: tok.decode(ids, skip_special_tokens=True))
    print(R.console(report))
    if args.report:
        files = R.write(report, args.report)
        print(f"report: {', '.join(str(f) for f in files)}")
    if args.strict:
        fam = {m.name: m.family for m in methods}
        if any(fam.get(n) == "verispec" for n in report["mismatches"]):
            return 1
        if sampled and not all(c["passed"] for c in sampled["checks"]):
            return 1
    return 0


def _peers(args, max_len: int, ignore_eos: bool, notes: list[str], log) -> list:
    from ..models.loading import resolve_model_path
    from . import peers

    out = []
    ks = {"hf-pld": [], "llama.cpp-pld": []}
    assists = []
    for p in args.peers:
        name, _, k = p.partition(":")
        if name in ks:
            ks[name].append(int(k) if k else args.num_draft_tokens)
        elif name == "hf-assist":
            assists.append(k)
    if "hf" in args.peers or ks["hf-pld"] or assists:
        log("loading the transformers model")
        drafts = {a: peers.load_hf(a, args.dtype, args.device) for a in assists}
        out += peers.hf_methods(peers.load_hf(args.model, args.dtype, args.device), ks["hf-pld"], args.dtype, ignore_eos, drafts,
                                args.num_draft_tokens)
    if "llama.cpp" in args.peers or ks["llama.cpp-pld"]:
        path = resolve_model_path(args.model)
        if not peers.llama_cpp_available():
            notes.append("llama.cpp skipped: llama-cpp-python is not installed (pip install 'verispec[llama]'; it "
                         "builds from source).")
        elif path.suffix != ".gguf":
            notes.append(f"llama.cpp skipped: {args.model} is not a GGUF file.")
        else:
            import torch

            out += peers.llama_methods(path, torch.get_num_threads(), max_len, ignore_eos, ks["llama.cpp-pld"])
    vllm_peers = [p for p in args.peers if p.partition(":")[0] in ("vllm", "vllm-ngram", "vllm-eagle3")]
    if vllm_peers:
        import torch

        from ..models import hf_folder
        from .vllm_peer import vllm_methods

        eagle3 = [d.split("@")[0].removeprefix("eagle3:") for d in args.drafters if d.startswith("eagle3:")]
        out += vllm_methods(hf_folder(args.model), vllm_peers, args.num_draft_tokens, args.dtype, max_len,
                            torch.get_num_threads(), eagle3, notes, ignore_eos, log)
    return out


def _fill_second_turns(prompts, target, tok, model_type, args, longest: int) -> None:
    """Answer each turn-1 question with plain greedy decoding (untimed) and build the turn-2 prompts."""
    from ..engine import Engine
    from ..sampling import SamplingParams
    from .. import prompts as P
    from .runner import engine_config

    first = {p.id: p for p in prompts if not p.needs_history}
    eng = Engine(target, tok, engine_config(args.model, None, 0, args.dtype, False, 8, longest + args.max_tokens + 8,
                                            str(target.device)))
    todo = [p for p in prompts if p.needs_history]
    seqs = [eng.add_request(first[p.id.split("#")[0]].ids, SamplingParams(max_tokens=args.max_tokens)) for p in todo]
    while eng.has_work:
        eng.step()
    for p, s in zip(todo, seqs):
        p.answers = [tok.decode(s.output_ids, skip_special_tokens=True).strip()]
        p.ids = P.render(p, tok, model_type)


def sweep_pool(prompts: list, datasets: list[str], needed: int, tok, model_type: str, max_prompt: int,
               sharegpt_n: int = 80, seed: int = 0) -> list:
    """The load sweep's prompts: the run's single-turn ones first (their batched outputs are checked
    against single-stream plain decoding), then the datasets' other first turns, taken from each
    dataset in turn, up to `needed` (or all there are), each at most `max_prompt` tokens. Distinct
    prompts keep plain decoding's lockstep waves from prefilling repeated prompts once for several
    requests, which staggered speculative requests cannot (`runner.sweep_requests`)."""
    from .. import prompts as P

    pool = [p for p in prompts if len(p.turns) == 1]
    seen = {p.id for p in pool}
    rest = [[p for p in P.load([d], sharegpt_n=sharegpt_n, seed=seed) if p.id not in seen and len(p.turns) == 1]
            for d in datasets]
    for i in range(max((len(r) for r in rest), default=0)):
        for r in rest:
            if len(pool) >= needed:
                return pool
            if i < len(r):
                r[i].ids = P.render(r[i], tok, model_type)
                if len(r[i].ids) <= max_prompt:
                    pool.append(r[i])
    return pool
