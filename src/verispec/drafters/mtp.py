"""MTP head (DeepSeek-V3 style multi-token prediction), trained with the same toolkit as EAGLE-3.

    x = eh_proj(concat(enorm(embed(x_{i+1})), hnorm(h_i)))    h_i: the target's final (post-norm) state
    y = one decoder block(x)                                   a Llama block with its own KV cache
    logits = head(norm(y))                                     the target's LM head (frozen copy of its rows)

Step s + 1 reads the block's output y of step s (DeepSeek chains its MTP depths the same way), so it
shares everything else with EAGLE-3 through `DraftHead` (head.py): the layers, the training-time-test
unroll, the checkpoint code; and the losses, the trainer, and serving through `Eagle3Drafter` (which
reads `target_taps = (-1,)`).

The LM head covers a draft vocabulary (`d2t`/`t2d`, default: the whole target vocabulary) and is not
trained: it is the target's own head. Checkpoints are verispec's own format (config.json with
`verispec_model_type: "mtp"` + model.safetensors); vLLM serves MTP only for models shipped with it.
"""

from __future__ import annotations

from dataclasses import asdict

import torch
from torch import nn

from ..models.layers import RMSNorm, linear
from ..models.prepack import prepack_head
from .base import register
from .eagle3 import Eagle3Config, Eagle3Drafter, check_config_types
from .head import CheckpointError, DraftHead


class MTPModel(DraftHead):
    FORMAT = "verispec MTP"

    def __init__(self, c: Eagle3Config, embed_weight: torch.Tensor | None = None):
        if list(c.aux_layers) != [-1]:
            raise ValueError("an MTP head reads the target's final state only (aux_layers = [-1])")
        H, eps = c.hidden_size, c.rms_norm_eps
        inputs = {"enorm": RMSNorm(H, eps), "hnorm": RMSNorm(H, eps), "eh_proj": nn.Linear(2 * H, H, bias=False)}
        super().__init__(c, embed_weight, inputs)

    @property
    def fc(self):  # Eagle3Drafter reads the dtype / device from `fc.weight`
        return self.eh_proj

    def fuse(self, aux: torch.Tensor) -> torch.Tensor:
        return aux.to(self.eh_proj.weight.dtype)

    def step_states(self, ids, hidden, positions, kvs):
        e = self.embed(ids).to(hidden.dtype)
        x = linear(torch.cat([self.enorm(e), self.hnorm(hidden)], -1), self.eh_proj.weight)
        y = self.run_layers(x, positions, kvs, hidden.dtype)
        return y, self.norm(y)

    # ---- checkpoint (verispec format: the config's fields as they are) ------------------------------
    def config_json(self, dtype_name: str) -> dict:
        return {"verispec_model_type": "mtp", "dtype": dtype_name, **asdict(self.config)}

    @classmethod
    def claims(cls, d: dict) -> bool:
        return d.get("verispec_model_type") == "mtp"

    @classmethod
    def config_from_json(cls, d: dict, where: str) -> Eagle3Config:
        if not cls.claims(d):
            raise CheckpointError(f"{where}: not an MTP checkpoint (verispec_model_type is not 'mtp')")
        fields = {k: v for k, v in d.items() if k not in ("verispec_model_type", "dtype")}
        try:
            c = Eagle3Config(**fields)
        except TypeError as e:
            raise CheckpointError(f"{where}: {e}") from e
        check_config_types(c, where)
        return c


def is_mtp_dir(path: str) -> bool:
    return MTPModel.is_checkpoint(path)


def load_mtp(path, target=None, dtype: torch.dtype = torch.float32) -> MTPModel:
    return MTPModel.load(path, target, dtype)


def make_mtp_drafter(path: str, target, max_batch: int, max_len: int, dtype, device) -> Eagle3Drafter:
    model = load_mtp(path, target, dtype=target.dtype).to(device)
    prepack_head(model)  # bf16 on a CPU with bf16 arithmetic: oneDNN's blocked layout
    return Eagle3Drafter(model, target, max_batch, max_len, name=f"mtp:{path}")


@register("mtp", "mtp:DIR (or a bare DIR)", "a DeepSeek-style MTP head trained by `verispec train --method mtp`",
          detect=lambda p: is_mtp_dir(p))
def _make(arg: str, ctx) -> Eagle3Drafter:
    try:
        return make_mtp_drafter(arg, ctx.target, ctx.max_batch, ctx.max_len, ctx.dtype, ctx.device)
    except CheckpointError as e:
        raise ValueError(str(e)) from e
