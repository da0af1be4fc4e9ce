"""`verispec` command line: parsing and printing only; the work happens in the engine.

Building the parser imports no torch (`verispec --help` answers at once): every command's parser
lives in a torch-free module, and each command imports what it runs inside its own function.
"""

from __future__ import annotations

import json
import logging
import os
import sys

from .errors import EXIT_USER_ERROR, UserError
from .options import Parser, engine_options, int_range
from .threads import choose_wait_policy, setup_threads

__all__ = ["EXIT_USER_ERROR", "UserError", "build_parser", "main"]


def build_parser() -> Parser:
    p = Parser(prog="verispec", description="Lossless speculative decoding for Hugging Face LLMs.")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    g = sub.add_parser("generate", parents=[engine_options()], help="generate continuations of prompts, with speculation",
                       description="Decode prompts with speculation (greedy output equals the target's own greedy "
                                   "output); --compare also decodes without it and reports the speed-up.")
    g.add_argument("prompts", nargs="*", help="prompt text(s); several prompts run as one batch")
    g.add_argument("--prompts-file", help="a file with one prompt per line, or a .jsonl with a 'prompt' field per line")
    g.add_argument("--max-tokens", type=int_range(1), default=128, help="new tokens per prompt")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    g.add_argument("--top-k", type=int, default=None, help="sample among the K most likely tokens")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling")
    g.add_argument("--seed", type=int, default=None, help="seed for sampling")
    g.add_argument("--ignore-eos", action="store_true", help="always generate --max-tokens tokens")
    g.add_argument("--compare", action="store_true", help="also decode without speculation and report the speed-up")
    g.add_argument("--json", action="store_true", help="print one JSON document (token ids, text, statistics)")
    g.set_defaults(run=cmd_generate)
    for add in _extra_commands():
        add(sub)
    return p


def _extra_commands():
    """Other subcommands live beside the code they drive; each module has `add_parser(subparsers)`,
    which registers its arguments and `set_defaults(run=...)`. Add one import line per command."""
    from .adaptive.cli import add_parser as profile
    from .bench.cli import add_parser as bench
    from .server.cli import add_parser as serve
    from .train.cli import parsers as train_data_export  # data, train, export

    return [bench, serve, profile, *train_data_export()]


class _Stderr(logging.StreamHandler):
    """Writes to sys.stderr as it is at each record, not as it was when the handler was made (main()
    may run several times in one process, e.g. in tests that capture stderr)."""

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, _):
        pass


def _setup_logging() -> None:
    """Warnings as `WARNING name: message`; verispec's information lines (a first-use conversion)
    as `verispec: message`. Once per process (tests call main() many times)."""
    own = logging.getLogger("verispec")
    if any(getattr(h, "verispec_info", False) for h in own.handlers):
        return
    warn = _Stderr()
    warn.setLevel(logging.WARNING)
    warn.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    logging.basicConfig(level=logging.WARNING, handlers=[warn])
    info = _Stderr()
    info.addFilter(lambda r: r.levelno == logging.INFO)
    info.setFormatter(logging.Formatter("verispec: %(message)s"))
    info.verispec_info = True
    own.setLevel(logging.INFO)
    own.addHandler(info)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    _setup_logging()
    if getattr(args, "passive_waits", True):  # `bench` keeps OpenMP's default (bench/cli.py)
        choose_wait_policy()  # passive waits on a busy machine; before any command imports torch
    try:
        return args.run(args) or 0
    except UserError as e:
        print(f"verispec: error: {e}", file=sys.stderr)
        return EXIT_USER_ERROR


def read_prompts(args) -> list[str]:
    """The prompts on the command line, then those of --prompts-file; refuses an empty prompt
    (it would decode from <bos> alone) and a file that cannot be read as prompts."""
    prompts = list(args.prompts)
    if args.prompts_file:
        prompts += _prompts_file(args.prompts_file)
    if not prompts:
        raise UserError("no prompt given (pass text, or --prompts-file)")
    for i, p in enumerate(prompts):
        if not p:
            raise UserError(f"prompt {i + 1} is empty (it would decode from <bos> alone); give some text")
    return prompts


def _prompts_file(path: str) -> list[str]:
    if os.path.isdir(path):
        raise UserError(f"--prompts-file {path} is a directory, not a file")
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except FileNotFoundError:
        raise UserError(f"prompts file not found: {path}") from None
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"cannot read --prompts-file {path}: {e}") from None
    if not path.endswith(".jsonl"):
        return [line for line in lines if line.strip()]
    out = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise UserError(f"{path}:{n}: not valid JSON ({e.msg}, column {e.colno})") from None
        if not isinstance(row, dict) or not isinstance(row.get("prompt"), str):
            raise UserError(f'{path}:{n}: expected an object with a "prompt" string, like {{"prompt": "def f(x):"}}')
        out.append(row["prompt"])
    return out


def cmd_generate(args) -> int:
    from . import preflight
    from .kv import CacheFullError
    from .models import ModelLoadError
    from .sampling import SamplingParams

    prompts = read_prompts(args)
    try:
        sp = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k,
                            top_p=args.top_p, seed=args.seed, ignore_eos=args.ignore_eos)
    except ValueError as e:
        raise UserError(str(e)) from e
    threads = setup_threads(args.threads)
    preflight.device(args.device)
    cfg = preflight.model_config(args.model, args.dtype)
    max_len = preflight.max_model_len(args.max_model_len, cfg, args.model)
    tok = preflight.tokenizer(args.model)
    ids = [list(tok(p).input_ids) for p in prompts]
    preflight.check_prompt_lengths(ids, sp.max_tokens, max_len)
    if hint := preflight.precision_hint(args.dtype, args.quant, args.device):
        print(hint, file=sys.stderr)

    from .engine import LLM

    drafter = None if args.drafter in ("none", "") else args.drafter
    try:
        llm = LLM(args.model, tokenizer=tok, drafter=drafter, num_draft_tokens=args.num_draft_tokens,
                  draft_tree=args.tree, draft_policy=args.draft_policy, dtype=args.dtype, quant=args.quant, device=args.device, max_model_len=max_len, exact=args.exact)
        llm.generate(ids[:1], SamplingParams(max_tokens=2, ignore_eos=True))  # warm-up: first-call allocations
        spec = llm.generate(ids, sp)
        plain = llm.generate(ids, sp, speculative=False) if args.compare and drafter else None
    except (ModelLoadError, ValueError, CacheFullError) as e:
        raise UserError(str(e)) from e

    report = {
        "model": args.model, "drafter": drafter, "num_draft_tokens": args.num_draft_tokens, "tree": args.tree,
        "dtype": args.dtype, "quant": args.quant, "exact": args.exact, "threads": threads, "sampling": sp.__dict__,
        "outputs": [o.to_dict() for o in spec.outputs],
        "stats": {**spec.stats.to_dict(), "tokens": spec.num_tokens, "seconds": round(spec.seconds, 3),
                  "tokens_per_second": round(spec.tokens_per_second, 2)},
    }
    if plain is not None:
        same = [a.token_ids == b.token_ids for a, b in zip(spec.outputs, plain.outputs)]
        report["baseline"] = {"tokens": plain.num_tokens, "seconds": round(plain.seconds, 3),
                              "tokens_per_second": round(plain.tokens_per_second, 2),
                              "outputs_identical": same if sp.greedy else None}
        report["speedup"] = round(spec.tokens_per_second / plain.tokens_per_second, 3)
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    for p, o in zip(prompts, spec.outputs):
        print(f"--- prompt: {p!r}")
        print(o.text)
    s = report["stats"]
    print(f"\n[{drafter or 'no drafter'}, k={args.num_draft_tokens}, {args.tree}, {args.dtype}{'' if args.quant == 'none' else ' ' + args.quant}, {threads} threads] {s['tokens']} "
          f"tokens in {s['seconds']} s = {s['tokens_per_second']} tok/s | tau {s['tau']} tokens/forward | "
          f"acceptance {s['acceptance_rate']:.1%} | per position {s['acceptance_per_position_conditional']}")
    if plain is not None:
        b = report["baseline"]
        ident = "" if b["outputs_identical"] is None else f" | identical to plain: {sum(b['outputs_identical'])}/{len(prompts)}"
        print(f"[plain decoding] {b['tokens']} tokens in {b['seconds']} s = {b['tokens_per_second']} tok/s"
              f" | speed-up {report['speedup']}x{ident}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
