"""`verispec train` and `verispec export`: argument parsing only."""

from __future__ import annotations


def add_train_parser(sub) -> None:
    p = sub.add_parser("train", help="train a drafter (EAGLE-3 or MTP) on `verispec data` output; resumes after a kill")
    p.add_argument("--method", default="eagle3", choices=["eagle3", "mtp"],
                   help="eagle3 (speculators format, vLLM-servable) or mtp (DeepSeek-style MTP head, verispec format)")
    p.add_argument("--data", required=True, help="folder written by `verispec data`")
    p.add_argument("--out", required=True, help="output folder: the speculators checkpoint + checkpoint/ for resuming")
    p.add_argument("--model", default=None, help="the target (default: the one recorded in the data)")
    p.add_argument("--draft-vocab-size", type=int, default=8192)
    p.add_argument("--ttt-steps", type=int, default=3, help="training-time-test unroll steps (default 3)")
    p.add_argument("--step-loss-decay", type=float, default=0.8)
    p.add_argument("--loss", choices=["kl", "ce"], default="kl")
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--weight-decay", type=float, default=0.0)
    p.add_argument("--warmup-ratio", type=float, default=0.04)
    p.add_argument("--grad-clip", type=float, default=0.5)
    p.add_argument("--batch-size", type=int, default=8, help="global batch in samples (split over torchrun ranks)")
    p.add_argument("--epochs", type=float, default=1.0)
    p.add_argument("--steps", type=int, default=None, help="total optimizer steps (overrides --epochs)")
    p.add_argument("--max-len", type=int, default=1024, help="truncate samples to this many tokens")
    p.add_argument("--val-fraction", type=float, default=0.05)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--save-every", type=int, default=50)
    p.add_argument("--eval-every", type=int, default=0)
    p.add_argument("--no-bf16", action="store_true", help="train in fp32 (default: bf16 autocast)")
    p.add_argument("--fc-norm", action="store_true", help="EAGLE 3.1: a norm on each target state before fusion")
    p.add_argument("--norm-output", action="store_true", help="EAGLE 3.1: feed post-norm states to the next step")
    p.add_argument("--num-layers", type=int, default=1)
    p.add_argument("--intermediate-size", type=int, default=None)
    p.add_argument("--train-lm-head", action="store_true")
    p.add_argument("--export-dtype", default="bfloat16", choices=["bfloat16", "float32", "float16"])
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--stop-after", type=int, default=None, help=argparse_suppress())
    p.set_defaults(run=cmd_train)


def argparse_suppress():
    import argparse

    return argparse.SUPPRESS


def cmd_train(args) -> int:
    import torch

    from ..cli import UserError
    from .trainer import TrainConfig, train

    if args.threads:
        torch.set_num_threads(args.threads)
    for name in ("draft_vocab_size", "ttt_steps", "batch_size", "save_every", "num_layers"):
        if getattr(args, name) < 1:
            raise UserError(f"--{name.replace('_', '-')} must be >= 1")
    cfg = TrainConfig(
        data=args.data, out=args.out, model=args.model, method=args.method, draft_vocab_size=args.draft_vocab_size, ttt_steps=args.ttt_steps,
        step_loss_decay=args.step_loss_decay, loss=args.loss, lr=args.lr, weight_decay=args.weight_decay,
        warmup_ratio=args.warmup_ratio, grad_clip=args.grad_clip, batch_size=args.batch_size, epochs=args.epochs,
        steps=args.steps, max_len=args.max_len, val_fraction=args.val_fraction, seed=args.seed,
        save_every=args.save_every, eval_every=args.eval_every, bf16=not args.no_bf16, fc_norm=args.fc_norm,
        norm_output=args.norm_output, num_layers=args.num_layers, intermediate_size=args.intermediate_size,
        train_lm_head=args.train_lm_head, export_dtype=args.export_dtype, progress=not args.no_progress,
        stop_after=args.stop_after,
    )
    try:
        train(cfg)
    except (FileNotFoundError, ValueError) as e:
        raise UserError(str(e)) from e
    return 0


def add_export_parser(sub) -> None:
    p = sub.add_parser("export", help="show how vLLM serves a trained drafter (speculators format)")
    p.add_argument("--vllm", required=True, metavar="DIR", help="a drafter folder (config.json + model.safetensors)")
    p.add_argument("-k", "--num-speculative-tokens", type=int, default=None)
    p.add_argument("--model", default=None, help="check the drafter against this target before printing")
    p.set_defaults(run=cmd_export)


def cmd_export(args) -> int:
    import json

    from ..cli import UserError
    from ..drafters.eagle3 import CheckpointError, load_eagle3, vllm_command

    try:
        target = None
        if args.model:
            from ..models import load_model

            target = load_model(args.model)
        m = load_eagle3(args.vllm, target)
    except CheckpointError as e:
        raise UserError(str(e)) from e
    k = args.num_speculative_tokens or m.config.speculative_tokens
    print(vllm_command(args.vllm, k))
    spec = {"method": "eagle3", "model": args.vllm, "num_speculative_tokens": k}
    print(f"# the same as JSON for --speculative-config (vllm serve <target> or LLM(speculative_config=...)): "
          f"'{json.dumps(spec)}'")
    print(f"# or: vllm serve {args.vllm}   (vLLM reads the verifier from speculators_config)")
    return 0


def parsers():
    from .data import add_parser as add_data_parser

    return [add_data_parser, add_train_parser, add_export_parser]
