"""`verispec data`, `verispec train` and `verispec export`: argument parsing; the work is in data.py
and trainer.py, imported when a command runs (so that `verispec --help` imports no torch)."""

from __future__ import annotations

import sys


def add_train_parser(sub) -> None:
    p = sub.add_parser("train", help="train a drafter (EAGLE-3, P-EAGLE, DFlash or MTP) on `verispec data` output; "
                       "resumes after a kill")
    p.add_argument("--method", default="eagle3", choices=["eagle3", "peagle", "dflash", "dspark", "mtp"],
                   help="eagle3 (speculators format, vLLM-servable), peagle (P-EAGLE: all K drafts in one forward), "
                   "dflash (block drafter with the target's features as keys and values), dspark (DFlash backbone + "
                   "Markov head + calibrated confidence head), all in the speculators format; or mtp (DeepSeek-style "
                   "MTP head, verispec format)")
    p.add_argument("--data", required=True, help="folder written by `verispec data`")
    p.add_argument("--out", required=True, help="output folder: the speculators checkpoint + checkpoint/ for resuming")
    p.add_argument("--model", default=None, help="the target (default: the one recorded in the data)")
    p.add_argument("--draft-vocab-size", type=int, default=8192)
    p.add_argument("--ttt-steps", type=int, default=3,
                   help="training-time-test unroll steps (P-EAGLE: parallel depths; DFlash: block size - 1; DSpark: "
                   "block size; the K it drafts) (default 3)")
    p.add_argument("--anchors", type=int, default=64, help="DFlash / DSpark: random anchor blocks per sample and step")
    p.add_argument("--markov-rank", type=int, default=256, help="DSpark: rank of the Markov head W1 W2")
    p.add_argument("--step-loss-decay", type=float, default=0.8)
    p.add_argument("--loss", choices=["kl", "ce", "tv"], default="kl",
                   help="kl: forward KL to the target; ce: cross-entropy on the data token; tv (DFlash / DSpark): "
                        "DSpark's 0.1 CE + 0.9 total variation (DSpark adds its confidence loss to each)")
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--weight-decay", type=float, default=0.0)
    p.add_argument("--warmup-ratio", type=float, default=0.04)
    p.add_argument("--grad-clip", type=float, default=0.5)
    p.add_argument("--batch-size", type=int, default=8, help="global batch in samples (split over torchrun ranks)")
    p.add_argument("--epochs", type=float, default=1.0)
    p.add_argument("--steps", type=int, default=None, help="total optimizer steps (overrides --epochs)")
    p.add_argument("--max-len", type=int, default=1024, help="truncate samples to this many tokens")
    p.add_argument("--max-prompts", type=int, default=None, metavar="N",
                   help="train on the data's first N prompts only (whole shards): an earlier run's data budget")
    p.add_argument("--val-fraction", type=float, default=0.05)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--save-every", type=int, default=50)
    p.add_argument("--eval-every", type=int, default=0)
    p.add_argument("--no-bf16", action="store_true", help="train in fp32 (default: bf16 autocast)")
    p.add_argument("--fc-norm", action="store_true", help="EAGLE 3.1: a norm on each target state before fusion (EAGLE-3, DFlash, DSpark; vLLM serves it for EAGLE-3 only)")
    p.add_argument("--norm-output", action="store_true", help="EAGLE 3.1: feed post-norm states to the next step")
    p.add_argument("--num-layers", type=int, default=1)
    p.add_argument("--intermediate-size", type=int, default=None)
    p.add_argument("--train-lm-head", action="store_true")
    p.add_argument("--init-from", default=None, metavar="DIR",
                   help="start from this drafter folder's weights (same method and shape; its draft vocabulary is kept)")
    p.add_argument("--export-dtype", default="bfloat16", choices=["bfloat16", "float32", "float16"])
    p.add_argument("--threads", type=_positive_int, default=None, help="CPU threads (default: the idle cores)")
    p.add_argument("--device", default="cpu", help="torch device to train on (default: cpu; cuda trains the "
                   "target's forward and the drafter on the GPU, one process per GPU under torchrun)")
    p.add_argument("--state-cache-gb", type=float, default=6.0,
                   help="token-id data (--no-hidden): memory for the target states kept between epochs (default 6)")
    p.add_argument("--time-budget", type=float, default=None, metavar="SECONDS",
                   help="end within this much wall time: the first steps are timed and the schedule (warm-up, cosine) "
                        "is fitted to the steps that fit, at most --steps / --epochs; a resumed run keeps that total")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--stop-after", type=int, default=None, help=argparse_suppress())
    p.set_defaults(run=cmd_train)


def _positive_int(s: str) -> int:
    from ..options import int_range

    return int_range(1)(s)


def argparse_suppress():
    import argparse

    return argparse.SUPPRESS


def cmd_train(args) -> int:
    from ..errors import UserError
    from ..threads import setup_threads
    from .trainer import TrainConfig, train

    setup_threads(args.threads)
    for name in ("draft_vocab_size", "ttt_steps", "batch_size", "save_every", "num_layers", "anchors", "markov_rank"):
        if getattr(args, name) < 1:
            raise UserError(f"--{name.replace('_', '-')} must be >= 1")
    cfg = TrainConfig(
        data=args.data, out=args.out, model=args.model, method=args.method, draft_vocab_size=args.draft_vocab_size, ttt_steps=args.ttt_steps,
        step_loss_decay=args.step_loss_decay, loss=args.loss, lr=args.lr, weight_decay=args.weight_decay,
        warmup_ratio=args.warmup_ratio, grad_clip=args.grad_clip, batch_size=args.batch_size, epochs=args.epochs,
        steps=args.steps, max_len=args.max_len, max_prompts=args.max_prompts, val_fraction=args.val_fraction, seed=args.seed,
        save_every=args.save_every, eval_every=args.eval_every, bf16=not args.no_bf16, fc_norm=args.fc_norm,
        norm_output=args.norm_output, num_layers=args.num_layers, intermediate_size=args.intermediate_size,
        train_lm_head=args.train_lm_head, anchors=args.anchors, markov_rank=args.markov_rank, init_from=args.init_from,
        export_dtype=args.export_dtype, state_cache_gb=args.state_cache_gb, device=args.device,
        progress=not args.no_progress,
        stop_after=args.stop_after, time_budget_s=args.time_budget,
    )
    from .. import preflight

    if hint := preflight.train_precision_hint(cfg.bf16, cfg.device or "cpu"):
        print(hint, file=sys.stderr, flush=True)
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

    from ..errors import UserError
    from ..drafters.eagle3 import CheckpointError, load_eagle3, vllm_command
    from ..drafters import dflash, dspark
    from ..drafters.peagle import is_peagle_dir, load_peagle

    for kind, module, load in (("dflash", dflash, dflash.load_dflash), ("dspark", dspark, dspark.load_dspark)):
        if not getattr(module, f"is_{kind}_dir")(args.vllm):
            continue
        try:
            target = None
            if args.model:
                from ..models import load_model

                target = load_model(args.model)
            m = load(args.vllm, target)
        except CheckpointError as e:
            raise UserError(str(e)) from e
        if m.config.fc_norm:
            raise UserError(f"{args.vllm}: this {kind} drafter normalizes each target state before fusing them "
                            "(fc_norm), which vLLM's implementation does not do; verispec serves it, vLLM would not "
                            "draft with the weights it was trained with")
        k = min(args.num_speculative_tokens or m.config.speculative_tokens, m.config.speculative_tokens)
        spec = {"method": kind, "model": args.vllm, "num_speculative_tokens": k}
        print(f"vllm serve {m.config.verifier or '<target model>'} --speculative-config '{json.dumps(spec)}'")
        print(f"# the same as JSON for --speculative-config: '{json.dumps(spec)}'")
        return 0
    peagle = is_peagle_dir(args.vllm)
    try:
        target = None
        if args.model:
            from ..models import load_model

            target = load_model(args.model)
        m = (load_peagle if peagle else load_eagle3)(args.vllm, target)
    except CheckpointError as e:
        raise UserError(str(e)) from e
    k = args.num_speculative_tokens or m.config.speculative_tokens
    spec = {"method": "eagle3", "model": args.vllm, "num_speculative_tokens": k}
    if peagle:  # vLLM serves P-EAGLE as eagle3 with parallel drafting
        spec["parallel_drafting"] = True
    print(vllm_command(args.vllm, k, parallel=peagle))
    print(f"# the same as JSON for --speculative-config (vllm serve <target> or LLM(speculative_config=...)): "
          f"'{json.dumps(spec)}'")
    print(f"# or: vllm serve {args.vllm}   (vLLM reads the verifier from speculators_config)")
    return 0


def add_data_parser(sub) -> None:
    from ..options import engine_options, int_range

    p = sub.add_parser("data", parents=[engine_options(drafter=False, draft_tokens=False, exact=False)],
                       help="regenerate responses with the target and store its hidden states (EAGLE-3 training data)")
    p.add_argument("--prompts", required=True, help="mix (chat + code + instruction, decontaminated) | sharegpt | mtbench | humaneval | FILE.jsonl")
    p.add_argument("--num-samples", type=int_range(1), required=True, help="number of prompts to answer")
    p.add_argument("--out", required=True, help="output folder (resumed if it holds a run with the same arguments)")
    p.add_argument("--layers", default=None, help="comma-separated target layers to store (default: EAGLE-3's [2, L/2, L-3])")
    p.add_argument("--max-tokens", type=int_range(1), default=128, help="response length cap")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch-size", type=int_range(1), default=8, help="requests decoded together")
    p.add_argument("--shard-size", type=int_range(1), default=64, help="samples per shard")
    p.add_argument("--no-hidden", action="store_true", help="store token ids only (online training recomputes states)")
    p.add_argument("--max-prompt-tokens", type=int, default=1024, help="keep the last N tokens of longer prompts")
    p.add_argument("--speculate", action="store_true",
                   help="decode with n-gram speculation (pays at small --batch-size; at 32+ streams on a CPU plain "
                   "batched decoding is faster, so the default is off)")
    p.set_defaults(run=cmd_data)


def cmd_data(args) -> int:
    from .. import preflight
    from ..drafters.eagle3 import default_aux_layers
    from ..engine import DTYPES
    from ..errors import UserError
    from ..models import ModelLoadError, load_model
    from ..threads import setup_threads
    from .data import DataError, build_dataset, bytes_per_token, encode_prompt, load_prompts

    setup_threads(args.threads)
    try:
        prompts = load_prompts(args.prompts, args.num_samples, args.seed)
    except DataError as e:
        raise UserError(str(e)) from e
    if not prompts:
        raise UserError(f"no prompts found in {args.prompts}")
    cfg = preflight.model_config(args.model, args.dtype)
    max_len = preflight.max_model_len(args.max_model_len, cfg, args.model)
    L = cfg.num_layers
    try:
        layers = [int(x) for x in args.layers.split(",")] if args.layers else default_aux_layers(L)
    except ValueError as e:
        raise UserError(f"--layers must be comma-separated integers, got {args.layers!r}") from e
    if any(not 0 <= i < L for i in layers):
        raise UserError(f"--layers {layers} out of range for a {L}-layer target")
    tok = preflight.tokenizer(args.model)
    ids = [encode_prompt(tok, cfg.model_type, p) for p in prompts]
    if args.max_prompt_tokens and args.max_prompt_tokens > 0:
        n = args.max_prompt_tokens
        ids = [i if len(i) <= n else i[:1] + i[len(i) - n + 1:] for i in ids]  # keep <bos> and the end
    from ..chat import turn_end_ids
    from ..models import hf_folder

    stop = list(turn_end_ids(tok, cfg.model_type, hf_folder(args.model)))
    bpt = bytes_per_token(len(layers), cfg.hidden_size, args.no_hidden)
    est = sum(len(i) + args.max_tokens for i in ids)
    print(f"{len(ids)} prompts from {args.prompts}; storing layers {layers} + final state of a "
          f"{cfg.hidden_size}-wide target: {bpt} bytes per token (bf16), at most "
          f"~{est * bpt / 2**20:.1f} MiB for ~{est} tokens", flush=True)
    try:
        target = load_model(args.model, DTYPES[args.dtype], args.device, args.quant)
        index = build_dataset(target, ids, args.out, layers, max_tokens=args.max_tokens, temperature=args.temperature,
                              seed=args.seed, batch_size=args.batch_size, shard_size=args.shard_size,
                              no_hidden=args.no_hidden, stop_token_ids=tuple(stop), max_model_len=max_len,
                              drafter="ngram" if args.speculate else None,
                              meta={"model": args.model, "quant": args.quant, "target_dtype": args.dtype,
                                    "prompts_source": args.prompts}, progress=True)
    except (DataError, ModelLoadError) as e:
        raise UserError(str(e)) from e
    print(f"done: {index['samples']} samples, {index['tokens']} tokens in {len(index['shards'])} shards -> {args.out}")
    return 0


def parsers():
    return [add_data_parser, add_train_parser, add_export_parser]
