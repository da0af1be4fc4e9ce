"""`verispec` command line: parsing and printing only; the work happens in the engine."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys

EXIT_USER_ERROR = 2


class UserError(Exception):
    """Bad input from the user: printed as one line, no traceback."""


def _positive_int(s: str) -> int:
    v = int(s)
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {v}")
    return v


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="verispec", description="Lossless speculative decoding for Hugging Face LLMs.")
    sub = p.add_subparsers(dest="command", required=True)

    from .cli_help import DRAFTER_HELP, TREE_HELP, HelpFormatter

    g = sub.add_parser("generate", help="generate continuations of prompts, with speculation", formatter_class=HelpFormatter)
    g.add_argument("prompts", nargs="*", help="prompt text(s); several prompts run as one batch")
    g.add_argument("--prompts-file", help="a file with one prompt per line (or a .jsonl with a 'prompt' field)")
    g.add_argument("--model", default="gemma3-270m", help="HF folder, .gguf file, or 'gemma3-270m' (default)")
    g.add_argument("--drafter", default="ngram", help=DRAFTER_HELP)
    g.add_argument("-k", "--num-draft-tokens", type=int, default=5, help="draft tokens (tree: nodes) verified per step")
    g.add_argument("--tree", default="chain", help=TREE_HELP)
    g.add_argument("--max-tokens", type=_positive_int, default=128)
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    g.add_argument("--top-k", type=int, default=None)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--ignore-eos", action="store_true", help="always generate --max-tokens tokens")
    g.add_argument("--dtype", default="bfloat16", help="bfloat16 (default) or float32")
    g.add_argument("--device", default="cpu")
    g.add_argument("--max-model-len", type=_positive_int, default=2048)
    g.add_argument("--exact", action="store_true",
                   help="batch-invariant numerics in fp32 too (bf16 is invariant already)")
    g.add_argument("--compare", action="store_true", help="also decode without speculation and report the speed-up")
    g.add_argument("--json", action="store_true", help="print one JSON document (token ids, text, statistics)")
    g.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    g.set_defaults(run=cmd_generate)
    for add in EXTRA_COMMANDS:
        add(sub)
    return p


def _extra_commands():
    """Other subcommands live beside the code they drive; each module has `add_parser(subparsers)`,
    which registers its arguments and `set_defaults(run=...)`. Add one import line per command."""
    from .bench.cli import add_parser as bench
    from .server.cli import add_parser as serve
    from .train.cli import parsers as train_data_export  # data, train, export

    return [bench, serve, *train_data_export()]


EXTRA_COMMANDS = _extra_commands()


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        return args.run(args) or 0
    except UserError as e:
        print(f"verispec: error: {e}", file=sys.stderr)
        return EXIT_USER_ERROR


def _prompts(args) -> list[str]:
    prompts = list(args.prompts)
    if args.prompts_file:
        if not os.path.exists(args.prompts_file):
            raise UserError(f"prompts file not found: {args.prompts_file}")
        with open(args.prompts_file) as f:
            for line in f:
                line = line.rstrip("\n")
                if not line.strip():
                    continue
                prompts.append(json.loads(line)["prompt"] if args.prompts_file.endswith(".jsonl") else line)
    if not prompts:
        raise UserError("no prompt given (pass text, or --prompts-file)")
    return prompts


def cmd_generate(args) -> int:
    import torch

    from .engine import LLM
    from .kv import CacheFullError
    from .models import ModelLoadError
    from .sampling import SamplingParams

    if args.threads:
        torch.set_num_threads(args.threads)
    prompts = _prompts(args)
    try:
        sp = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k,
                            top_p=args.top_p, seed=args.seed, ignore_eos=args.ignore_eos)
        drafter = None if args.drafter in ("none", "") else args.drafter
        llm = LLM(args.model, drafter=drafter, num_draft_tokens=args.num_draft_tokens, draft_tree=args.tree, dtype=args.dtype,
                  device=args.device, max_model_len=args.max_model_len, exact=args.exact)
        ids = [llm.encode(p) for p in prompts]
        for p, i in zip(prompts, ids):
            if len(i) + sp.max_tokens > llm.engine.max_len:
                raise UserError(f"prompt of {len(i)} tokens + --max-tokens {sp.max_tokens} exceeds the context of "
                                f"{llm.engine.max_len} tokens (raise --max-model-len or shorten the prompt)")
        llm.generate(ids[:1], SamplingParams(max_tokens=2, ignore_eos=True))  # warm-up: first-call allocations
        spec = llm.generate(ids, sp)
        plain = llm.generate(ids, sp, speculative=False) if args.compare and drafter else None
    except (ModelLoadError, ValueError, CacheFullError) as e:
        raise UserError(str(e)) from e

    report = {
        "model": args.model, "drafter": drafter, "num_draft_tokens": args.num_draft_tokens, "tree": args.tree,
        "dtype": args.dtype,
        "exact": args.exact, "sampling": sp.__dict__,
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
    print(f"\n[{drafter or 'no drafter'}, k={args.num_draft_tokens}, {args.tree}, {args.dtype}] {s['tokens']} tokens in "
          f"{s['seconds']} s = {s['tokens_per_second']} tok/s | tau {s['tau']} tokens/forward | "
          f"acceptance {s['acceptance_rate']:.1%} | per position {s['acceptance_per_position_conditional']}")
    if plain is not None:
        b = report["baseline"]
        ident = "" if b["outputs_identical"] is None else f" | identical to plain: {sum(b['outputs_identical'])}/{len(prompts)}"
        print(f"[plain decoding] {b['tokens']} tokens in {b['seconds']} s = {b['tokens_per_second']} tok/s"
              f" | speed-up {report['speedup']}x{ident}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
