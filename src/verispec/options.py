"""Command-line options that several commands share, each defined once.

`engine_options()` is the argparse parent parser of the engine flags (model, drafter, -k, dtype,
device, max-model-len, exact, threads) used by generate, serve, bench and data, so that a flag
has one spelling, one type check and one help text everywhere. `Parser` turns argparse's usage
errors into the one-line `verispec: error: ...` with exit code 2 that every other bad input gets.

This module must not import torch: it is all `verispec --help` loads.
"""

from __future__ import annotations

import argparse
import sys

from . import cli_help
from .errors import EXIT_USER_ERROR

DEFAULT_MODEL = "gemma3-270m"  # = models.DEFAULT_MODEL (a test checks)
QUANT_MODES = ("none", "int8", "int4")  # models/quant.py
DTYPE_NAMES = ("bfloat16", "bf16", "float32", "fp32", "float16", "fp16")  # = engine.DTYPES (a test checks)
# -k is the number of spare KV rows every request reserves (k + 1) and the rows of every verify
# forward; a cap keeps a typo (-k 1000) from reserving and verifying thousands of rows per step.
# 64 is well past useful chains (a draft is accepted in full only where the text repeats) and
# holds an EAGLE-2-sized token tree (60 nodes).
MAX_DRAFT_TOKENS = 64
THREADS_HELP = ("CPU threads (default: one per core; where other work keeps the cores busy at start, their "
                "OpenMP waits sleep instead of spin, so it slows decoding down gracefully)")


class HelpFormatter(cli_help.HelpFormatter):
    """Shows each option's default, unless its help already names it or there is nothing to show
    (and, from cli_help, lists the registered drafters where a help text says {drafters})."""

    def _get_help_string(self, action):
        text = action.help or ""
        if (not action.option_strings or "default" in text or action.default is None or action.default is False
                or action.default is argparse.SUPPRESS):
            return text
        return f"{text} (default: %(default)s)" if text else "(default: %(default)s)"


class Parser(argparse.ArgumentParser):
    """argparse with one-line errors: `verispec: error: ...`, exit code 2, no usage dump."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str):
        print(f"verispec: error: {message} (see `{self.prog} --help`)", file=sys.stderr)
        sys.exit(EXIT_USER_ERROR)


def int_range(lo: int, hi: int | None = None):
    """An argparse type: an integer in [lo, hi] (hi None: no upper bound)."""

    def parse(s: str) -> int:
        try:
            v = int(s)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {s!r}") from None
        if v < lo or (hi is not None and v > hi):
            raise argparse.ArgumentTypeError(f"must be >= {lo}, got {v}" if hi is None else
                                             f"must be between {lo} and {hi}, got {v}")
        return v

    return parse


def dtype_name(s: str) -> str:
    if s not in DTYPE_NAMES:
        raise argparse.ArgumentTypeError(f"unknown dtype {s!r}; choose one of {', '.join(DTYPE_NAMES)}")
    return s


def engine_options(*, drafter: bool = True, draft_tokens: bool = True, device: bool = True, exact: bool = True,
                   quant: bool = True, max_model_len_help: str | None = None,
                   per_request: bool = False) -> argparse.ArgumentParser:
    """The parent parser of the engine flags. A command leaves out the flags it has no use for
    (bench takes a list of --drafters, modes and --quant; data drafts with ngram). per_request:
    say that a request may override -k and --tree (the server)."""
    p = argparse.ArgumentParser(add_help=False)
    g = p.add_argument_group("model and engine")
    g.add_argument("--model", default=DEFAULT_MODEL, help="a Hugging Face folder, a .gguf file, or gemma3-270m")
    if drafter:
        g.add_argument("--drafter", default="ngram", help=cli_help.DRAFTER_HELP)
    if draft_tokens:
        g.add_argument("-k", "--num-draft-tokens", type=int_range(0, MAX_DRAFT_TOKENS), default=5, metavar="K",
                       help=f"draft tokens (tree: nodes) verified per step, 0 to {MAX_DRAFT_TOKENS}"
                            + (" (a request may ask for fewer with num_draft_tokens)" if per_request else ""))
    if drafter:
        g.add_argument("--tree", default="chain", help=cli_help.TREE_HELP
                       + (" (a request may choose its own with draft_tree)" if per_request else ""))
        g.add_argument("--draft-policy", default="adaptive", choices=["adaptive", "adaptive-topb", "fixed"],
                       help="adaptive: each step, verify only the draft nodes worth their measured cost "
                            "(up to k; learned acceptance, cost profile cached per machine); adaptive-topb: "
                            "the same with vLLM's one-step-old budget instead of the early stop; fixed: all k")
    g.add_argument("--dtype", type=dtype_name, default="bfloat16", metavar="DTYPE",
                   help="bfloat16, float32, or float16 (refused for Gemma, whose activations overflow it)")
    if quant:
        g.add_argument("--quant", choices=QUANT_MODES, default="none",
                       help="weight-only quantization of the target's projections and LM head: int8 (per-row scales) "
                            "or int4 (groups of 32); speculative output equals the quantized model's own plain output")
    if device:
        g.add_argument("--device", default="cpu", help="torch device")
    g.add_argument("--max-model-len", type=int_range(2), default=None, metavar="N",
                   help=max_model_len_help or "KV rows per request (prompt + output), at most the model's context "
                                              "(default: 2048, or the context if shorter)")
    if exact:
        g.add_argument("--exact", action="store_true",
                       help="batch-invariant numerics in float32 too (bfloat16 is invariant already)")
    g.add_argument("--threads", type=int_range(1), default=None, metavar="N", help=THREADS_HELP)
    return p
