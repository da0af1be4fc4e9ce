"""`verispec profile`: measure (or show the cached) verify cost profile that adaptive drafting
plans with, print it as a table and plot it."""

from __future__ import annotations


def add_parser(sub) -> None:
    from ..options import engine_options, int_range

    p = sub.add_parser("profile", parents=[engine_options(drafter=False, draft_tokens=False, exact=False)],
                       help="measure and show the verify cost per step size that adaptive drafting plans with")
    p.add_argument("--max-tokens", type=int_range(1, 4096), default=64,
                   help="largest step measured, in tokens (default 64; an engine needs max-batch x (k + 1))")
    p.add_argument("--max-batch-size", type=int_range(1), default=8, help="rows the tokens are spread over")
    p.add_argument("--remeasure", action="store_true", help="measure again even if a cached profile covers it")
    p.add_argument("--plot", default=None, metavar="PNG", help="also plot seconds and tokens/s per step size")
    p.set_defaults(run=cmd_profile)


def cmd_profile(args) -> int:
    from .. import preflight
    from ..engine import DTYPES
    from ..errors import UserError
    from ..models import ModelLoadError, load_model
    from ..threads import setup_threads
    from . import costs

    threads = setup_threads(args.threads)
    preflight.device(args.device)
    preflight.model_config(args.model, args.dtype)
    try:
        model = load_model(args.model, DTYPES[args.dtype], args.device, args.quant)
    except ModelLoadError as e:
        raise UserError(str(e)) from e
    path = costs.profile_path(costs.profile_key(model))
    if args.remeasure and path.exists():
        path.unlink()
    prof = costs.load_or_measure(model, args.max_tokens, args.max_batch_size)
    print(f"verify cost of {args.model} ({args.dtype}, quant {args.quant}, {threads} threads, "
          f"context {costs.CONTEXT}); cached in {path}")
    print(f"{'tokens':>7} {'ms':>9} {'ms/token':>9} {'tokens/s':>9} {'LM head ms':>11}")
    for n, s in zip(prof.tokens, prof.seconds):
        print(f"{n:>7} {s * 1e3:>9.2f} {s * 1e3 / n:>9.3f} {n / s:>9.1f} {prof.head_cost(n) * 1e3:>11.2f}")
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
        a.plot(prof.tokens, [s * 1e3 for s in prof.seconds], marker="o", label="forward with LM head")
        if prof.head_tokens:
            a.plot(prof.head_tokens, [s * 1e3 for s in prof.head_seconds], marker=".", label="LM head alone")
            a.legend()
        a.set(xlabel="tokens in the verify forward", ylabel="ms (median of 5, monotone)", xscale="log",
              title="verify cost")
        b.plot(prof.tokens, [n / s for n, s in zip(prof.tokens, prof.seconds)], marker="o")
        b.set(xlabel="tokens in the verify forward", ylabel="tokens / s", xscale="log", title="verify throughput")
        fig.suptitle(f"{args.model} {args.dtype}, {threads} threads")
        fig.tight_layout()
        fig.savefig(args.plot, dpi=110)
        print(f"plot: {args.plot}")
    return 0
