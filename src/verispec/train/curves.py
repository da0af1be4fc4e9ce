"""Training curves of a run: loss and per-position acceptance, on the training batches and held out.

The trainer writes `train_log.jsonl` (one record per step) and `eval_log.jsonl` (one record per
held-out evaluation) into its output folder and calls `plot_run` after each evaluation and at the
end, so `training_curves.png` is always current. `python -m verispec.train.curves OUT` redraws it.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def read_jsonl(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            continue  # a line cut by a kill
    return out


def _smooth(xs: list[float], n: int) -> list[float]:
    """Trailing mean over n steps (training batches are small and noisy)."""
    out, acc = [], 0.0
    for i, x in enumerate(xs):
        acc += x
        if i >= n:
            acc -= xs[i - n]
        out.append(acc / min(i + 1, n))
    return out


def plot_run(out: str | Path) -> Path | None:
    """Draw `training_curves.png` in `out` from its logs; None when there is no log yet."""
    out = Path(out)
    train = read_jsonl(out / "train_log.jsonl")
    if not train:
        return None
    evals = read_jsonl(out / "eval_log.jsonl")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in train]
    n = max(1, len(train) // 40)
    K = sum(1 for k in train[0] if k.startswith("acc_all_"))
    fig, (a, b, c) = plt.subplots(1, 3, figsize=(15, 4))
    a.plot(steps, [r["loss"] for r in train], lw=0.5, alpha=0.4, color="tab:blue")
    a.plot(steps, _smooth([r["loss"] for r in train], n), color="tab:blue", label=f"training (mean of {n})")
    a.set_xlabel("step")
    a.set_ylabel("loss")
    a.set_title("loss")
    a.legend(fontsize=8)
    unc = [_smooth([r[f"acc_all_{s}"] for r in train], n) for s in range(K)]
    for s in range(K):  # conditional acceptance on the training batches: acc_all_s / acc_all_{s-1}, smoothed first
        cond = unc[0] if not s else [x / y if y else 0.0 for x, y in zip(unc[s], unc[s - 1])]
        b.plot(steps, cond, label=f"position {s + 1}")
    b.set_xlabel("step")
    b.set_ylabel("conditional acceptance (greedy)")
    b.set_title("training batches")
    b.set_ylim(0, 1)
    b.legend(fontsize=8)
    if evals:
        for s in range(len(evals[-1]["acceptance_conditional"])):
            c.plot([e["step"] for e in evals], [e["acceptance_conditional"][s] for e in evals], marker="o",
                   label=f"position {s + 1}")
        ax2 = c.twinx()
        ax2.plot([e["step"] for e in evals], [e["expected_tau"] for e in evals], "k--", marker="x", label="expected tau")
        ax2.set_ylabel("expected tau (chain)")
        ax2.legend(fontsize=8, loc="lower right")
        c.legend(fontsize=8, loc="upper left")
    c.set_xlabel("step")
    c.set_ylabel("conditional acceptance (greedy)")
    c.set_title("held-out samples")
    c.set_ylim(0, 1)
    fig.suptitle(out.name)
    fig.tight_layout()
    path = out / "training_curves.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


if __name__ == "__main__":
    for folder in sys.argv[1:] or ["."]:
        print(plot_run(folder))
