"""Calibrating a trained DSpark drafter's confidences on the held-out split (Sequential Temperature
Scaling, drafters/dspark.py), with the numbers and a reliability plot written beside the checkpoint.

The event a cumulative confidence prod_{i<=k} c_i predicts is "drafts 1..k are all accepted". On
greedy-regenerated data that is "the drafter's argmax equals the data token at every slot up to k",
with the Markov head fed the data tokens, which is exactly what a greedy chain drafts while all its
drafts are right (tests/test_dspark.py checks training against serving).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ..drafters.dspark import expected_calibration_error, sequential_temperature_scaling
from .dataset import collate, online_states
from .losses import sample_anchors


@torch.no_grad()
def held_out_confidences(model, target, data, idx: list[int], bf16: bool, batch_size: int = 8):
    """Raw confidence logits [N, S], outcomes [N, S] (slots 1..k all right) and validity [N, S] of
    every anchor block of the held-out samples."""
    d2t = model.draft_to_target()
    zs, acc, val = [], [], []
    for i in range(0, len(idx), batch_size):
        b = collate([data.samples[j] for j in idx[i : i + batch_size]])
        if "aux" not in b:
            b = online_states(target, b, data.layers)
        anchors, ok = sample_anchors(b, None)
        T = b["ids"].shape[1]
        okt = b["mask"] & b["valid"]
        S = model.config.block_size
        for a in range(0, anchors.shape[1], 64):
            an, aok = anchors[:, a : a + 64], ok[:, a : a + 64]
            with torch.autocast(torch.device(target.device).type, dtype=torch.bfloat16, enabled=bf16):
                logits, conf = model(b["aux"], b["ids"], b["valid"], an)
            pos = an[..., None] + 1 + torch.arange(S)  # [B, A, S] the token each slot drafts
            inside = pos < T
            tok = b["ids"].gather(1, pos.clamp(max=T - 1).flatten(1)).reshape(pos.shape)
            real = okt.gather(1, pos.clamp(max=T - 1).flatten(1)).reshape(pos.shape) & inside & aok[..., None]
            right = (d2t[logits.float().argmax(-1)] == tok) & real
            zs.append(conf.float()[aok])
            acc.append(right.cumprod(-1).bool()[aok])
            val.append(real[aok])
    return torch.cat(zs), torch.cat(acc), torch.cat(val)


def calibrate_dspark(model, target, data, idx: list[int], cfg, out: Path) -> dict:
    """Fit the STS temperatures into model.config and write calibration.json and reliability.png."""
    model.eval()
    z, accepted, valid = held_out_confidences(model, target, data, idx, cfg.bf16)
    temps, before, after = sequential_temperature_scaling(z, accepted, valid)
    model.config.confidence_temperatures = temps
    rep = {"blocks": int(z.shape[0]), "temperatures": temps, "ece_before": before, "ece_after": after}
    out.mkdir(parents=True, exist_ok=True)
    (out / "calibration.json").write_text(json.dumps(rep, indent=2) + "\n")
    _reliability_plot(z, accepted, valid, torch.tensor(temps), out / "reliability.png")
    print("confidence calibration (STS) per position: ECE of the cumulative confidence "
          + ", ".join(f"{b:.3f}->{a:.3f}" for b, a in zip(before, after)), flush=True)
    return rep


def _reliability_plot(z, accepted, valid, temps, path: Path, bins: int = 10) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    S = z.shape[1]
    fig, axes = plt.subplots(1, S, figsize=(3.2 * S, 3.2), squeeze=False)
    raw = torch.sigmoid(z).cumprod(1)
    cal = torch.sigmoid(z / temps).cumprod(1)
    for k, ax in enumerate(axes[0]):
        ok = valid[:, k]
        for pred, label in ((raw[:, k][ok], "raw"), (cal[:, k][ok], "STS")):
            which = (pred * bins).long().clamp(max=bins - 1)
            xs, ys = [], []
            for b in range(bins):
                sel = which == b
                if sel.any():
                    xs.append(float(pred[sel].mean()))
                    ys.append(float(accepted[:, k][ok][sel].float().mean()))
            ece = expected_calibration_error(pred, accepted[:, k][ok])
            ax.plot(xs, ys, "o-", label=f"{label} (ECE {ece:.3f})")
        ax.plot([0, 1], [0, 1], "k:", lw=0.8)
        ax.set_title(f"drafts 1..{k + 1} accepted")
        ax.set_xlabel("predicted (cumulative confidence)")
        if k == 0:
            ax.set_ylabel("observed")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
