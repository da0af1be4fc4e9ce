"""One training loop for the EAGLE-3, P-EAGLE and MTP drafters (drafters/eagle3.py, peagle.py, mtp.py:
the modules that also serve).

- data: `verispec data` folders (stored hidden states, or token ids with the target run in the loop);
- training-time test unrolling (`ttt_steps`, loss decay per step), forward KL or CE (losses.py);
  P-EAGLE runs its `ttt_steps` depths in one forward, on COD-sampled anchors (peagle.py);
- AdamW, linear warm-up then cosine decay, gradient clipping, bf16 autocast (CPU and CUDA);
- a checkpoint every `save_every` steps (model, optimizer, scheduler, RNG states, data position =
  the global step), written so that a kill at any point of the save leaves one to resume from; a
  killed run restarted with the same command resumes from it (and refuses changed arguments) and
  ends with the same weights and the same train_log.jsonl as an uninterrupted run;
- data parallel under torchrun (DDP; gloo on CPU): the global batch is split across ranks and loss
  denominators are summed across ranks, so N processes give the weights one process gives;
- a held-out split evaluated with per-position acceptance estimates; the final drafter is exported
  in the speculators format (bf16 by default) into `out`.
"""

from __future__ import annotations

import json
import math
import os
import random
import shutil
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from ..drafters.eagle3 import Eagle3Config, Eagle3Model, build_vocab_mapping
from ..drafters.peagle import cod_rows
from .dataset import HiddenStateData, TargetStates, collate, global_batch
from .losses import block_loss, eagle3_loss, response_anchors, sample_anchors, summarize


@dataclass
class TrainConfig:
    data: str
    out: str
    model: str | None = None  # the target (default: the model recorded in the data index)
    method: str = "eagle3"  # eagle3 | peagle | dflash | dspark | mtp
    draft_vocab_size: int = 8192
    ttt_steps: int = 3
    step_loss_decay: float = 0.8
    loss: str = "kl"
    lr: float = 3e-4
    weight_decay: float = 0.0
    warmup_ratio: float = 0.04
    min_lr_ratio: float = 0.1
    grad_clip: float = 0.5
    batch_size: int = 8  # global batch (samples)
    epochs: float = 1.0
    steps: int | None = None  # overrides epochs
    max_len: int = 1024
    max_prompts: int | None = None  # train on the shards of the data's first N prompts only
    val_fraction: float = 0.05
    seed: int = 0
    save_every: int = 50
    eval_every: int = 0  # 0: only at the end
    bf16: bool = True
    fc_norm: bool = False
    norm_output: bool = False
    num_layers: int = 1
    intermediate_size: int | None = None
    train_lm_head: bool = False
    anchors: int = 64  # DFlash / DSpark: random anchor blocks per sample and step
    markov_rank: int = 256  # DSpark: rank of the Markov head
    init_from: str | None = None  # a drafter folder of the same method and shape to start from (warm start)
    export_dtype: str = "bfloat16"
    progress: bool = True
    device: str = "cpu"  # where the target and the drafter train (cuda: DDP over nccl)
    state_cache_gb: float = 6.0  # --no-hidden data: the target states kept in memory between epochs
    stop_after: int | None = None  # leave after this many steps of this run (as if killed after a checkpoint)
    time_budget_s: float | None = None  # fit the schedule to this much wall time (the run's total is then fixed)
    extra: dict = field(default_factory=dict)


# --------------------------------------------------------------------------------------------
# distributed


class Dist:
    def __init__(self, device: str = "cpu"):
        self.world = int(os.environ.get("WORLD_SIZE", "1"))
        self.rank = int(os.environ.get("RANK", "0"))
        self.device = device
        if device == "cuda" and self.world > 1:  # one GPU per process
            self.device = f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}"
            torch.cuda.set_device(self.device)
        if self.world > 1:
            import torch.distributed as td

            if not td.is_initialized():
                td.init_process_group("nccl" if torch.device(self.device).type == "cuda" else "gloo")
            self.td = td

    def reduce(self, t: torch.Tensor) -> torch.Tensor:
        if self.world > 1:
            self.td.all_reduce(t)
        return t

    def barrier(self):
        if self.world > 1:
            self.td.barrier()

    @property
    def main(self) -> bool:
        return self.rank == 0


# --------------------------------------------------------------------------------------------
# model set-up

# verispec aliases -> the Hugging Face model a vLLM deployment would load as the verifier (the alias
# itself is the q4_k_m GGUF of it, dequantized)
HF_IDS = {"gemma3-270m": "google/gemma-3-270m"}


def build_model(cfg: TrainConfig, target, data: HiddenStateData) -> Eagle3Model:
    V = target.config.vocab_size
    vd = min(cfg.draft_vocab_size, V)
    kw = {}
    if cfg.intermediate_size:
        kw["intermediate_size"] = cfg.intermediate_size
    if cfg.method not in METHODS:
        raise ValueError(f"unknown method {cfg.method!r} ({', '.join(METHODS)})")
    if cfg.loss == "tv" and cfg.method not in ("dflash", "dspark"):
        raise ValueError(f"--loss tv is DSpark's block loss (dflash, dspark); {cfg.method} trains with kl or ce")
    mtp = cfg.method == "mtp"
    # the mask token of the parallel drafters: the target's padding token (never in a response), else 0
    pad = target.config.pad_token_id
    mask_token = pad if pad is not None and 0 <= pad < V else 0
    if cfg.method in ("dflash", "dspark"):
        from ..drafters.dflash import DFlashConfig, DFlashModel
        from ..drafters.dspark import DSparkConfig, DSparkModel

        if cfg.method == "dspark":  # every slot drafts (the anchor's too): K = block size
            config_cls, model_cls, kw["block_size"], kw["markov_rank"] = DSparkConfig, DSparkModel, cfg.ttt_steps, cfg.markov_rank
        else:  # slot 0 is the anchor: K = block size - 1
            config_cls, model_cls, kw["block_size"] = DFlashConfig, DFlashModel, cfg.ttt_steps + 1
        c = config_cls.for_target(target, draft_vocab_size=vd, aux_layers=data.layers, num_layers=cfg.num_layers,
                                  mask_token_id=mask_token, fc_norm=cfg.fc_norm, **kw)
        name = data.index.get("model") or cfg.model
        c.verifier = HF_IDS.get(name, name)
        torch.manual_seed(cfg.seed)
        model = model_cls(c, embed_weight=target.model.embed_tokens.weight)
        if model.use_draft_vocab:
            counts = data.token_counts if data.token_counts is not None else torch.zeros(V)
            model.set_vocab_mapping(*build_vocab_mapping(counts.double(), vd))
        with torch.no_grad():
            model.lm_head.weight.copy_(target.head_weight()[model.draft_to_target()].float())
        model.lm_head.weight.requires_grad_(cfg.train_lm_head)
        return model
    if cfg.method == "peagle":
        from ..drafters.peagle import PEagleConfig, PEagleModel

        kw["mask_token_id"] = mask_token
        config_cls, model_cls = PEagleConfig, PEagleModel
    else:
        config_cls, model_cls = Eagle3Config, Eagle3Model
    c = config_cls.for_target(target, draft_vocab_size=vd, aux_layers=[-1] if mtp else data.layers,
                              fc_norm=cfg.fc_norm and not mtp, norm_output=cfg.norm_output and not mtp,
                              num_layers=cfg.num_layers, speculative_tokens=cfg.ttt_steps, **kw)
    name = data.index.get("model") or cfg.model
    c.verifier = HF_IDS.get(name, name)  # what vLLM loads as the verifier
    torch.manual_seed(cfg.seed)
    if mtp:
        from ..drafters.mtp import MTPModel

        model = MTPModel(c, embed_weight=target.model.embed_tokens.weight)
    else:
        model = model_cls(c, embed_weight=target.model.embed_tokens.weight)
    if model.use_draft_vocab:
        counts = data.token_counts if data.token_counts is not None else torch.zeros(V)
        model.set_vocab_mapping(*build_vocab_mapping(counts.double(), vd))
    with torch.no_grad():  # the LM head starts as the target's rows of the draft vocabulary (speculators does too)
        model.lm_head.weight.copy_(target.head_weight()[model.draft_to_target()].float())
        # (starting the final norm as the target's own, to start on its logit scale, trained worse on
        # Gemma 3 270M: confident wrong drafts, KL ~400 at step 1 against ~20)
    model.lm_head.weight.requires_grad_(cfg.train_lm_head and not mtp)  # MTP: the target's shared head
    return model


METHODS = ("eagle3", "peagle", "dflash", "dspark", "mtp")


def warm_start(model, path: str, target, method: str) -> None:
    """Start from the weights of a trained drafter folder (continue training on more data, or at a
    new schedule). Its shape must be the one this run builds, and its draft vocabulary mapping is
    kept (the LM head rows follow it): the new data's token counts would pick other ids, and the
    trained weights are only meaningful for the ids they were trained on."""
    from ..drafters.head import CheckpointError

    src_cls = type(model)
    # A P-EAGLE head is an EAGLE-3 head plus the mask state of its depths >= 2: it can start from a
    # trained EAGLE-3 (depth 1 is then that head exactly; only the mask state starts from scratch).
    if method == "peagle" and Eagle3Model.is_checkpoint(path) and not type(model).is_checkpoint(path):
        src_cls = Eagle3Model
    if (Path(path) / "config.json").is_file() and not src_cls.is_checkpoint(path):
        allowed = "a P-EAGLE or EAGLE-3 drafter" if method == "peagle" else "a drafter of this run's method"
        raise CheckpointError(f"--init-from {path}: not a --method {method} drafter; start from {allowed}")
    src = src_cls.load(path, target)
    # (this run's config through the same JSON round trip: fields the format does not store drop out)
    mine = asdict(type(model).config_from_json(model.config_json("float32"), "this run"))
    theirs = asdict(src.config)
    if src_cls is not type(model):  # EAGLE-3 -> P-EAGLE: the fields of the shared head must agree
        mine = {k: v for k, v in mine.items() if k in theirs and k != "speculative_tokens"}
    diff = sorted(k for k in mine if mine[k] != theirs.get(k))
    # An EAGLE-3 / P-EAGLE head may grow deeper than its init: the layers past the init's start as the
    # identity (their attention and MLP output projections zero), so the grown head drafts exactly as
    # the init did, and the new layers learn from there.
    grow = isinstance(model, Eagle3Model) and mine["num_layers"] > theirs["num_layers"]
    if grow:
        diff.remove("num_layers")
    if diff:
        raise CheckpointError(f"--init-from {path}: its config differs from this run's in {', '.join(diff[:6])}; "
                              "train with the arguments it was trained with"
                              + (" (a run may have more --num-layers than its init, not fewer)"
                                 if "num_layers" in diff else ""))
    state = model.state_dict()  # (what the source lacks, P-EAGLE's mask state, keeps its fresh init)
    state.update({k: v.to(state[k].dtype) for k, v in src.state_dict().items() if k in state})
    for layer in range(theirs["num_layers"], mine["num_layers"]) if grow else ():
        for proj in ("self_attn.o_proj.weight", "mlp.down_proj.weight"):
            state[f"layers.{layer}.{proj}"] = torch.zeros_like(state[f"layers.{layer}.{proj}"])
    with torch.no_grad():
        model.load_state_dict(state)


def forward_loss(model, net, batch: dict, cfg: TrainConfig, head, cap, d2t, t2d, reduce=None, evaluation=False):
    """The drafter's outputs on a batch and their loss and metrics (losses.py), for each method:
    EAGLE-3 / MTP unroll `ttt_steps` steps; P-EAGLE runs its depths at once (COD-sampled anchors in
    training); DFlash runs blocks from random anchors (every anchor in evaluation)."""
    if cfg.method in ("dflash", "dspark"):
        anchors, ok = sample_anchors(batch, None if evaluation else cfg.anchors)
        # (evaluation: every anchor, 64 at a time; the block attention is [A*S, T + A*S])
        chunks = range(0, anchors.shape[1], 64) if evaluation else [0]
        outs = [net(_inputs(model, batch), batch["ids"], batch["valid"], anchors[:, i : i + 64] if evaluation else anchors)
                for i in chunks]
        if cfg.method == "dflash":
            return block_loss(torch.cat(outs, 1), anchors, ok, batch, head, cap, d2t, t2d, kind=cfg.loss, reduce=reduce)
        logits, conf = torch.cat([o[0] for o in outs], 1), torch.cat([o[1] for o in outs], 1)
        return block_loss(logits, anchors, ok, batch, head, cap, d2t, t2d, kind=cfg.loss, reduce=reduce, first_slot=0,
                          confidence=conf)
    if cfg.method == "peagle":
        kw = {}
        if not evaluation:  # COD: each depth on a random subset of the anchors before
            c = model.config
            kw["rows"] = cod_rows(batch["ids"].shape[1] - 1, cfg.ttt_steps, c.cod_ratio, c.cod_ratio_min)
        outs = net(_inputs(model, batch), batch["ids"], batch["valid"], steps=cfg.ttt_steps, **kw)
        return eagle3_loss(outs, batch, head, cap, d2t, t2d, cfg.step_loss_decay, cfg.loss, reduce, rows=kw.get("rows"))
    # EAGLE-3 / MTP: the head and the later unroll steps run at the response anchors only
    anchors = response_anchors(batch)
    outs = net(_inputs(model, batch), batch["ids"], batch["valid"], steps=cfg.ttt_steps, anchors=anchors)
    return eagle3_loss(outs, batch, head, cap, d2t, t2d, cfg.step_loss_decay, cfg.loss, reduce, anchors=anchors)


def _to(batch: dict, device) -> dict:
    return {k: v.to(device, non_blocking=True) for k, v in batch.items()}


def _inputs(model, batch: dict) -> torch.Tensor:
    """What the drafter reads from the target: EAGLE-3 the fused layers, MTP the final state."""
    return batch["last"] if list(model.config.aux_layers) == [-1] else batch["aux"]


def lr_lambda(total: int, warmup: int, min_ratio: float):
    def f(step: int) -> float:
        if warmup and step < warmup:
            return (step + 1) / warmup
        p = (step - warmup) / max(1, total - warmup)
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, p)))
    return f


# --------------------------------------------------------------------------------------------
# checkpoints


# The fields a resumed run must share with the run that wrote the checkpoint: any of them changes
# the batches, the loss or the schedule, so the result would match no uninterrupted run.
RESUME_FIELDS = ("data", "method", "draft_vocab_size", "ttt_steps", "step_loss_decay", "loss", "lr", "weight_decay",
                 "warmup_ratio", "min_lr_ratio", "grad_clip", "batch_size", "epochs", "steps", "max_len", "max_prompts",
                 "val_fraction", "seed", "bf16", "fc_norm", "norm_output", "num_layers", "intermediate_size",
                 "train_lm_head", "anchors", "markov_rank", "init_from", "time_budget_s")
STATE = "state.pt"


def _siblings(path: Path) -> tuple[Path, Path]:
    return path.with_name(path.name + ".tmp"), path.with_name(path.name + ".old")


def save_state(path: Path, model, opt, sched, step: int, cfg: TrainConfig, total: int | None = None) -> None:
    """Write the checkpoint `path/state.pt` so that a kill at any point leaves a complete one.

    `tmp/state.pt` appears (by rename) only once it is fully written and synced, so a folder
    holding a state.pt is always complete. Then path -> old, tmp -> path, old removed. A kill
    between the two renames leaves no `path`, but a complete `tmp` (and `old`): `recover_state`
    promotes it before anything is deleted."""
    tmp, old = _siblings(path)
    shutil.rmtree(tmp, ignore_errors=True)  # a half-written save of a killed run (recovery ran first)
    tmp.mkdir(parents=True)
    part = tmp / (STATE + ".part")
    with open(part, "wb") as f:
        torch.save({
            "model": model.state_dict(), "optimizer": opt.state_dict(), "scheduler": sched.state_dict(), "step": step,
            "total": total,
            "rng": {"torch": torch.get_rng_state(), "python": random.getstate()},
            "config": asdict(cfg),
        }, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(part, tmp / STATE)
    _fsync_dir(tmp)
    if path.exists():
        shutil.rmtree(old, ignore_errors=True)  # safe: tmp is complete
        os.replace(path, old)
    os.replace(tmp, path)
    _fsync_dir(path.parent)
    shutil.rmtree(old, ignore_errors=True)


# A time budget: the first steps of a run are timed and the schedule's total becomes the steps that
# fit (never more than --steps / --epochs asked for), leaving BUDGET_RESERVE of the budget for the
# final held-out evaluation, DSpark's calibration and the export.
BUDGET_PROBE_STEPS = 6
BUDGET_RESERVE = 0.12


def fit_total(cfg: TrainConfig, step: int, total: int, probe_s: float, elapsed_s: float, dist=None) -> int:
    """The total steps that end the run within cfg.time_budget_s, from the time of the probe's
    BUDGET_PROBE_STEPS - 1 steps (the first epoch's steps, which also run the target: later ones
    can only be faster). Every rank takes the smallest, so they all stop together."""
    per_step = probe_s / (BUDGET_PROBE_STEPS - 1)
    left = cfg.time_budget_s * (1 - BUDGET_RESERVE) - elapsed_s
    fit = min(total, step + max(1, int(left / per_step)))
    if dist is not None and dist.world > 1:
        t = torch.tensor([fit], device=dist.device)
        dist.td.all_reduce(t, op=dist.td.ReduceOp.MIN)
        fit = int(t.item())
    return fit


def _fsync_dir(d: Path) -> None:
    try:
        fd = os.open(d, os.O_RDONLY)
    except OSError:  # not supported on this platform / file system
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def recover_state(path: Path) -> Path | None:
    """The checkpoint to resume from, after finishing a save that a kill interrupted: if `path` has
    no state.pt, a complete `tmp` (the newer one) or else `old` is renamed to `path`. Nothing is
    deleted here; None when there is no checkpoint at all."""
    if (path / STATE).is_file():
        return path
    for cand in _siblings(path):
        if (cand / STATE).is_file():
            if path.exists():
                shutil.rmtree(path)  # a folder without state.pt is never a checkpoint
            os.replace(cand, path)
            print(f"recovered the checkpoint of an interrupted save from {cand}", flush=True)
            return path
    return None


def read_state(path: Path) -> dict:
    f = path / STATE
    try:
        return torch.load(f, map_location="cpu", weights_only=False)
    except Exception as e:  # noqa: BLE001 - truncated or foreign: say which file, not a traceback
        raise ValueError(f"{f}: unreadable checkpoint ({type(e).__name__}: {e}); delete {path} to start the run "
                         "over") from e


def check_resume_config(st: dict, cfg: TrainConfig, path: Path) -> None:
    """Refuse to resume with arguments that change the training (the checkpoint records them)."""
    saved = st.get("config") or {}
    now = asdict(cfg)
    diff = [k for k in RESUME_FIELDS if k in saved and saved[k] != now[k]]
    if diff:
        was = ", ".join(f"{_flag(k)} {saved[k]}" for k in diff)
        new = ", ".join(f"{_flag(k)} {now[k]}" for k in diff)
        raise ValueError(f"{path} was written with {was}; this run has {new}. Resume with the same arguments, "
                         "or train into a new --out")


def _flag(name: str) -> str:
    return {"bf16": "bf16"}.get(name, "--" + name.replace("_", "-"))


def load_state(path: Path, model, opt, sched, cfg: TrainConfig | None = None) -> tuple[int, int | None]:
    """Load a checkpoint: (its step, the run's total steps when a time budget fixed it, else None)."""
    st = read_state(path)
    if cfg is not None:
        check_resume_config(st, cfg, path)
    model.load_state_dict(st["model"])
    opt.load_state_dict(st["optimizer"])
    sched.load_state_dict(st["scheduler"])
    torch.set_rng_state(st["rng"]["torch"])
    random.setstate(st["rng"]["python"])
    return int(st["step"]), st.get("total")


def trim_log(log_path: Path, step: int) -> None:
    """Drop the log records of steps after the checkpoint: a resumed run writes them again."""
    if not log_path.exists():
        return
    keep = []
    for line in log_path.read_text().splitlines():
        try:
            if json.loads(line)["step"] <= step:
                keep.append(line)
        except (ValueError, KeyError, TypeError):
            continue  # a line cut by the kill
    tmp = log_path.with_name(log_path.name + ".tmp")
    tmp.write_text("".join(x + "\n" for x in keep))
    os.replace(tmp, log_path)


# --------------------------------------------------------------------------------------------
# the loop


def _autocast(on: bool, device):
    dev = torch.device(device).type
    return torch.autocast(dev, dtype=torch.bfloat16, enabled=on)


def evaluate(model: Eagle3Model, target, data: HiddenStateData, idx: list[int], cfg: TrainConfig, batch_size: int = 8,
             dist: Dist | None = None, states: TargetStates | None = None) -> dict:
    """Per-position acceptance estimates on held-out samples (greedy data: P(draft == target's token))."""
    if not idx:
        return {}
    states = states or TargetStates(target, data.layers, 0)
    head, cap, d2t, t2d = _head(model, target)
    acc: dict = {}
    with torch.no_grad():
        for i in range(0, len(idx), batch_size):
            b = _to(collate(states.samples(data, idx[i : i + batch_size])), target.device)
            with _autocast(cfg.bf16, target.device):
                _, m = forward_loss(model, model, b, cfg, head, cap, d2t, t2d, evaluation=True)
            for k, (a, n) in m.items():
                s0, n0 = acc.get(k, (0.0, 0.0))
                acc[k] = (s0 + a, n0 + n)
    r = summarize(acc, dist.reduce if dist else None)
    K = sum(1 for k in r if k.startswith("acc_all_"))
    r["acceptance_unconditional"] = [r[f"acc_all_{s}"] for s in range(K)]
    r["acceptance_conditional"] = [r[f"acc_all_{s}"] / r[f"acc_all_{s-1}"] if s and r[f"acc_all_{s-1}"] else
                                   (r[f"acc_all_{s}"] if not s else 0.0) for s in range(K)]
    r["expected_tau"] = 1 + sum(r["acceptance_unconditional"])  # chain of K drafts, bonus token included
    return r


def _log_eval(out: Path, step: int, ev: dict) -> None:
    """Append a held-out evaluation to eval_log.jsonl (records past `step` first dropped: a resumed
    run evaluates them again) and redraw training_curves.png."""
    from .curves import plot_run

    path = out / "eval_log.jsonl"
    trim_log(path, step - 1)
    rec = {"step": step, "acceptance_conditional": ev["acceptance_conditional"],
           "acceptance_unconditional": ev["acceptance_unconditional"], "expected_tau": ev["expected_tau"],
           **{k: v for k, v in ev.items() if k.startswith("loss_")}}
    with open(path, "a") as f:
        f.write(json.dumps(rec) + "\n")
    plot_run(out)


def _head(model: Eagle3Model, target):
    d2t = model.draft_to_target()
    head = target.head_weight()[d2t].detach()
    t2d = model.target_to_draft(torch.arange(target.config.vocab_size, device=head.device))
    return head, target.config.final_logit_softcap, d2t, t2d


def train(cfg: TrainConfig, target=None) -> dict:
    """Run (or resume) a training run; returns the final held-out evaluation."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    t_start = time.time()
    dist = Dist(cfg.device)
    out = Path(cfg.out)
    data = HiddenStateData(cfg.data, cfg.max_len, cfg.max_prompts)
    if target is None:
        from ..models import load_model

        name = cfg.model or data.index.get("model")
        if not name:
            raise ValueError("the data index names no target model; pass --model")
        target = load_model(name, torch.float32 if not cfg.bf16 else torch.bfloat16, dist.device)
    if data.index["hidden_size"] != target.config.hidden_size or data.index["vocab_size"] != target.config.vocab_size:
        raise ValueError(f"{cfg.data} was made for another target (hidden {data.index['hidden_size']}, vocab "
                         f"{data.index['vocab_size']}); this one has {target.config.hidden_size} / {target.config.vocab_size}")
    train_idx, val_idx = data.split(cfg.val_fraction, cfg.seed)
    if not train_idx:
        raise ValueError(f"{cfg.data} holds no training samples")
    model = build_model(cfg, target, data).to(target.device)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay)
    per_epoch = max(1, len(train_idx) // cfg.batch_size)
    total = cfg.steps if cfg.steps is not None else max(1, int(round(cfg.epochs * per_epoch)))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(total, int(cfg.warmup_ratio * total), cfg.min_lr_ratio))
    ck = out / "checkpoint"
    log_path = out / "train_log.jsonl"
    step = 0
    if dist.main:
        recover_state(ck)
    dist.barrier()
    fitted = None  # the total a time budget fixed (kept in the checkpoint, so a resumed run keeps its schedule)
    if (ck / STATE).is_file():
        step, fitted = load_state(ck, model, opt, sched, cfg)
        if fitted is not None:
            total = fitted
            sched.lr_lambdas[0] = lr_lambda(total, int(cfg.warmup_ratio * total), cfg.min_lr_ratio)
        if dist.main:
            for leftover in _siblings(ck):  # of a killed save; the checkpoint just loaded is good
                shutil.rmtree(leftover, ignore_errors=True)
            print(f"resuming from {ck} at step {step}/{total}", flush=True)
    elif cfg.init_from:  # a fresh start only: a resumed run has its own weights (the init may be gone)
        warm_start(model, cfg.init_from, target, cfg.method)
    if dist.main:  # records past the checkpoint (all of them when starting over) are written again
        trim_log(log_path, step)
        trim_log(out / "eval_log.jsonl", step)
    net = DDP(model) if dist.world > 1 else model
    states = TargetStates(target, data.layers, cfg.state_cache_gb * 2**30)
    head, cap, d2t, t2d = _head(model, target)
    reduce = dist.reduce if dist.world > 1 else None
    bar = None
    if cfg.progress and dist.main:
        from tqdm import tqdm

        bar = tqdm(total=total, initial=step, desc=cfg.method, file=sys.stderr, dynamic_ncols=True)
    out.mkdir(parents=True, exist_ok=True)
    done_this_run = 0
    t0 = time.time()
    while step < total:
        gb = global_batch(train_idx, cfg.batch_size, cfg.seed, step)
        local = gb[dist.rank :: dist.world]
        batch = _to(collate(states.samples(data, local)), target.device)
        model.train()
        with _autocast(cfg.bf16, target.device):
            loss, m = forward_loss(model, net, batch, cfg, head, cap, d2t, t2d, reduce)
        (loss * dist.world).backward()  # DDP averages gradients over ranks; the loss is already global
        gnorm = torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip) if cfg.grad_clip else None
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        step += 1
        done_this_run += 1
        just_fitted = bool(cfg.time_budget_s) and fitted is None and done_this_run == BUDGET_PROBE_STEPS
        if just_fitted:
            total = fitted = fit_total(cfg, step, total, time.time() - t_probe, time.time() - t_start, dist)
            sched.lr_lambdas[0] = lr_lambda(total, int(cfg.warmup_ratio * total), cfg.min_lr_ratio)
            if dist.main:
                print(f"time budget {cfg.time_budget_s:.0f} s: {total} steps in all", flush=True)
            if bar is not None:
                bar.total = total
        if done_this_run == 1:
            t_probe = time.time()  # the first step of a run pays for warm-up; the probe times the ones after
        r = summarize(m, reduce)
        gloss = float(loss.detach()) if reduce is None else float(reduce(loss.detach().clone()))  # all ranks
        if dist.main:
            rec = {"step": step, "loss": round(gloss, 5),
                   "lr": sched.get_last_lr()[0], "grad_norm": float(gnorm) if gnorm is not None else None,
                   **{k: round(v, 4) for k, v in r.items() if k.startswith("acc_")}, "elapsed_s": round(time.time() - t0, 1)}
            with open(log_path, "a") as f:
                f.write(json.dumps(rec) + "\n")
            if bar is not None:
                bar.update(1)
                bar.set_postfix(loss=f"{rec['loss']:.3f}",
                                acc="/".join(f"{r.get(f'acc_{s}', 0):.2f}" for s in range(cfg.ttt_steps)))
        if cfg.eval_every and step % cfg.eval_every == 0 and step < total:
            ev = evaluate(model, target, data, val_idx, cfg, dist=dist, states=states)
            if dist.main and ev:
                _log_eval(out, step, ev)
                print(f"\nstep {step}: held-out acceptance per position {[round(x, 3) for x in ev['acceptance_conditional']]}"
                      f", expected tau {ev['expected_tau']:.3f}", flush=True)
        if step % cfg.save_every == 0 or step == total or just_fitted:  # the fitted total is kept at once
            if dist.main:
                save_state(ck, model, opt, sched, step, cfg, fitted)
            dist.barrier()
        if cfg.stop_after is not None and done_this_run >= cfg.stop_after and step < total:
            if bar is not None:
                bar.close()
            return {"stopped_at": step}
    if bar is not None:
        bar.close()
    ev = evaluate(model, target, data, val_idx, cfg, dist=dist, states=states)
    if cfg.method == "dspark" and dist.main and val_idx:
        from .calibration import calibrate_dspark

        calibrate_dspark(model, target, data, val_idx, cfg, out)
    if dist.main:
        dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}[cfg.export_dtype]
        model.save(out, dtype=dtype)
        (out / "eval.json").write_text(json.dumps({"step": step, "held_out_samples": len(val_idx), **ev}, indent=2))
        if ev:
            _log_eval(out, step, ev)
        if ev:
            print(f"held-out ({len(val_idx)} samples): acceptance per position (conditional) "
                  f"{[round(x, 3) for x in ev['acceptance_conditional']]}, expected tau {ev['expected_tau']:.3f}",
                  flush=True)
        print(f"drafter written to {out} (serve: verispec generate --drafter {out})", flush=True)
    dist.barrier()
    return ev
