"""Reading `verispec data` folders: samples, a held-out split, and deterministic padded batches.

The order of training samples is a function of (seed, epoch) only, so a resumed run continues with
exactly the batches it would have seen (the data position is just the global step). A global batch
is split across data-parallel ranks by taking every world-th sample.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

import torch


@dataclass
class Sample:
    ids: torch.Tensor  # [T] long
    mask: torch.Tensor  # [T] bool: response tokens
    aux: torch.Tensor | None  # [T, n*H] bf16 (None: recomputed online)
    last: torch.Tensor | None  # [T, H] bf16


class HiddenStateData:
    def __init__(self, folder: str | Path, max_len: int | None = None, max_prompts: int | None = None):
        """max_prompts: read only the shards of the first `max_prompts` prompts (a shard is read
        whole or not at all), so that a run on an extended data set can keep an earlier run's
        data budget, held-out split and draft vocabulary."""
        folder = Path(folder)
        index_path = folder / "index.json"
        if not index_path.is_file():
            raise FileNotFoundError(f"{folder}: no index.json (make one with `verispec data`)")
        self.index = json.loads(index_path.read_text())
        self.layers = list(self.index["layers"])
        self.has_hidden = bool(self.index.get("has_hidden", True))
        self.samples: list[Sample] = []
        V = int(self.index["vocab_size"])
        # response-token counts for the draft vocabulary, from the shards themselves (a
        # token_freq.safetensors left stale by a killed `verispec data` is never read)
        self.token_counts = torch.zeros(V, dtype=torch.int64)
        shards = self.index["shards"]
        if max_prompts is not None:
            shards = [sh for sh in shards if sh["first_prompt"] + sh["num_prompts"] <= max_prompts]
            done = sum(sh["num_prompts"] for sh in shards)
            if done != max_prompts:
                raise ValueError(f"{folder}: --max-prompts {max_prompts} does not end at a shard boundary "
                                 f"(the shards whole below it hold {done} prompts)")
        for sh in shards:
            t = _load_shard(folder / sh["file"], sh)
            self.token_counts += torch.bincount(t["input_ids"].long()[t["loss_mask"].bool()], minlength=V)[:V]
            off = t["offsets"].tolist()
            for a, b in zip(off[:-1], off[1:]):
                if max_len is not None:
                    b = min(b, a + max_len)
                if b - a < 3:
                    continue
                self.samples.append(Sample(
                    t["input_ids"][a:b].long(), t["loss_mask"][a:b].bool(),
                    t["aux"][a:b] if "aux" in t else None, t["last"][a:b] if "last" in t else None))

    def split(self, val_fraction: float, seed: int = 0) -> tuple[list[int], list[int]]:
        """(train indices, held-out indices). Sample j is held out when a seeded hash of j falls below
        val_fraction, so extending a data set (more prompts, appended shards) never moves a sample
        between the two sides."""
        train, val = [], []
        for j in range(len(self.samples)):
            h = ((j + 1) * 2654435761 + seed * 40503) % 2**32 / 2**32
            (val if h < val_fraction else train).append(j)
        if val_fraction > 0 and not val and len(train) > 1:
            val.append(train.pop())
        return train, val


def _load_shard(path: Path, entry: dict) -> dict:
    from safetensors.torch import load_file

    if "bytes" in entry and path.is_file() and path.stat().st_size != entry["bytes"]:
        raise ValueError(f"{path}: truncated or changed ({path.stat().st_size} bytes; index.json says "
                         f"{entry['bytes']}); rerun `verispec data` with the same arguments to regenerate it")
    try:
        t = load_file(str(path))
        if not {"input_ids", "loss_mask", "offsets"} <= set(t):
            raise ValueError("input_ids, loss_mask or offsets missing")
    except Exception as e:  # noqa: BLE001 - any unreadable shard: name the file, no traceback
        raise ValueError(f"{path}: unreadable data shard ({type(e).__name__}: {e}); rerun `verispec data` with the "
                         "same arguments to regenerate it") from e
    return t


def epoch_order(indices: list[int], seed: int, epoch: int) -> list[int]:
    order = list(indices)
    random.Random(seed * 1_000_003 + epoch).shuffle(order)
    return order


def global_batch(indices: list[int], batch_size: int, seed: int, step: int) -> list[int]:
    """The samples of global step `step` (epochs wrap; the last incomplete batch of an epoch is dropped)."""
    per_epoch = max(1, len(indices) // batch_size)
    epoch, i = divmod(step, per_epoch)
    order = epoch_order(indices, seed, epoch)
    if len(order) < batch_size:
        order = (order * (batch_size // max(1, len(order)) + 1))[:batch_size]
    return order[i * batch_size : (i + 1) * batch_size]


def collate(samples: list[Sample]) -> dict:
    """Right-padded batch: ids [B, T], mask [B, T], valid [B, T], aux [B, T, nH], last [B, T, H]."""
    T = max(len(s.ids) for s in samples)
    B = len(samples)
    ids = torch.zeros(B, T, dtype=torch.long)
    mask = torch.zeros(B, T, dtype=torch.bool)
    valid = torch.zeros(B, T, dtype=torch.bool)
    out = {"ids": ids, "mask": mask, "valid": valid}
    if samples[0].aux is not None:
        out["aux"] = torch.zeros(B, T, samples[0].aux.shape[-1], dtype=samples[0].aux.dtype)
        out["last"] = torch.zeros(B, T, samples[0].last.shape[-1], dtype=samples[0].last.dtype)
    for b, s in enumerate(samples):
        n = len(s.ids)
        ids[b, :n], mask[b, :n], valid[b, :n] = s.ids, s.mask, True
        if s.aux is not None:
            out["aux"][b, :n] = s.aux
            out["last"][b, :n] = s.last
    return out


class TargetStates:
    """--no-hidden data: the target's states (aux, last) of each sample, computed on first use and
    kept in memory (bf16, about 5 KB a token for a 640-wide target with three fused layers) up to
    `budget_bytes`, so that every epoch after the first skips the target's forward.

    Each sample runs alone (batch 1): no padding rows are computed, and a sample's states never
    depend on the batch it arrives in, so a resumed run sees exactly the states of an uninterrupted one."""

    def __init__(self, target, layers: list[int], budget_bytes: float = 6 * 2**30):
        self.target, self.layers, self.budget = target, list(layers), budget_bytes
        self.kept: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.bytes = 0

    @torch.no_grad()
    def _compute(self, s: Sample) -> tuple[torch.Tensor, torch.Tensor]:
        t = self.target
        ids = s.ids.to(t.device)[None]
        out = t(ids, t.new_cache(1, ids.shape[1]), [0], torch.zeros(1, dtype=torch.long, device=t.device),
                taps=tuple(self.layers), want_logits=False)
        aux = torch.cat([out.hidden[i] for i in self.layers], -1)[0].to(torch.bfloat16).cpu()
        return aux, out.last_hidden[0].to(torch.bfloat16).cpu()

    def samples(self, data: "HiddenStateData", idx: list[int]) -> list[Sample]:
        """The samples `idx` of `data` with their states attached (stored ones as they are)."""
        out = []
        for j in idx:
            s = data.samples[j]
            if s.aux is None:
                st = self.kept.get(j)
                if st is None:
                    st = self._compute(s)
                    size = sum(x.numel() * x.element_size() for x in st)
                    if self.bytes + size <= self.budget:
                        self.kept[j] = st
                        self.bytes += size
                s = Sample(s.ids, s.mask, *st)
            out.append(s)
        return out


@torch.no_grad()
def online_states(target, batch: dict, layers: list[int]) -> dict:
    """--no-hidden data: run the target over the batch to get aux / last (right padding is harmless
    under a causal mask)."""
    ids = batch["ids"].to(target.device)
    B, T = ids.shape
    cache = target.new_cache(B, T)
    out = target(ids, cache, list(range(B)), torch.zeros(B, dtype=torch.long, device=ids.device), taps=tuple(layers),
                 want_logits=False)
    batch = dict(batch)
    batch["aux"] = torch.cat([out.hidden[i] for i in layers], -1).to(torch.bfloat16)
    batch["last"] = out.last_hidden.to(torch.bfloat16)
    return batch
