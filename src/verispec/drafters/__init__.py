"""Drafters: every kind behind the one `Drafter` interface (base.py)."""

from __future__ import annotations

import torch

from .base import Draft, Drafter
from .model_drafter import ModelDrafter
from .ngram import NgramDrafter


def make_drafter(spec: str, target, max_batch: int, max_len: int, dtype: torch.dtype, device) -> Drafter:
    """Build a drafter from its command-line spec.

    ngram[:MAX_N]         prompt lookup over prompt + output (default n = 3..1)
    layerskip:N           the target's first N layers + final norm + LM head
    draft:PATH            an independent smaller model with the same tokenizer (folder or .gguf)
    eagle3:DIR | DIR      an EAGLE-3 head in the speculators format (config.json + model.safetensors)
    mtp:DIR | DIR         a DeepSeek-style MTP head trained by `verispec train --method mtp`
    """
    kind, _, arg = spec.partition(":")
    from .eagle3 import CheckpointError, is_eagle3_dir, make_eagle3_drafter

    if kind == "eagle3" or is_eagle3_dir(spec):  # eagle3:DIR, or a speculators checkpoint folder
        path = arg if kind == "eagle3" else spec
        try:
            return make_eagle3_drafter(path, target, max_batch, max_len, dtype, device)
        except CheckpointError as e:
            raise ValueError(str(e)) from e
    from .mtp import is_mtp_dir, make_mtp_drafter

    if kind == "mtp" or is_mtp_dir(spec):  # mtp:DIR, or a verispec MTP-head folder
        try:
            return make_mtp_drafter(arg if kind == "mtp" else spec, target, max_batch, max_len, dtype, device)
        except CheckpointError as e:
            raise ValueError(str(e)) from e
    if kind == "ngram":
        return NgramDrafter(max_n=int(arg) if arg else 3)
    if kind == "layerskip":
        if not arg:
            raise ValueError("layerskip needs a layer count, e.g. layerskip:6")
        return ModelDrafter(target, max_batch, max_len, num_layers=int(arg), name=f"layerskip:{arg}")
    if kind == "draft":
        from ..models import load_model

        model = load_model(arg, dtype, device)
        if model.config.vocab_size != target.config.vocab_size:
            raise ValueError(
                f"draft model vocabulary ({model.config.vocab_size}) differs from the target's "
                f"({target.config.vocab_size}); a draft model must share the target's tokenizer"
            )
        return ModelDrafter(model, max_batch, max_len, name=f"draft:{arg}")
    raise ValueError(f"unknown drafter {spec!r}; use ngram[:N], layerskip:N, draft:PATH, eagle3:DIR or mtp:DIR")


__all__ = ["Draft", "Drafter", "ModelDrafter", "NgramDrafter", "make_drafter"]
