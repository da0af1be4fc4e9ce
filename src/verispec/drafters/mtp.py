"""MTP head (DeepSeek-V3 style multi-token prediction), trained with the same toolkit as EAGLE-3.

    x = eh_proj(concat(enorm(embed(x_{i+1})), hnorm(h_i)))    h_i: the target's final (post-norm) state
    y = one decoder block(x)                                   a Llama block with its own KV cache
    logits = head(norm(y))                                     the target's LM head (frozen copy of its rows)

Step s + 1 reads the block's output y of step s (DeepSeek chains its MTP depths the same way), so it
shares everything else with EAGLE-3: the training-time-test unroll (`Eagle3Model.forward`), the
losses, the trainer, and serving through `Eagle3Drafter` (which reads `target_taps = (-1,)`).

The LM head covers a draft vocabulary (`d2t`/`t2d`, default: the whole target vocabulary) and is not
trained: it is the target's own head. Checkpoints are verispec's own format (config.json with
`verispec_model_type: "mtp"` + model.safetensors); vLLM serves MTP only for models shipped with it.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import torch
from torch import nn

from .eagle3 import CheckpointError, Eagle3Config, Eagle3Drafter, Eagle3Model, RMSNorm, _Layer, _lin, check_config_types


class MTPModel(Eagle3Model):
    def __init__(self, c: Eagle3Config, embed_weight: torch.Tensor | None = None):
        nn.Module.__init__(self)
        if list(c.aux_layers) != [-1]:
            raise ValueError("an MTP head reads the target's final state only (aux_layers = [-1])")
        self.config = c
        H = c.hidden_size
        self.enorm = RMSNorm(H, c.rms_norm_eps)
        self.hnorm = RMSNorm(H, c.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * H, H, bias=False)
        self.layers = nn.ModuleList(_Layer(c, first=False) for _ in range(c.num_layers))
        self.norm = RMSNorm(H, c.rms_norm_eps)
        self.lm_head = nn.Linear(H, c.draft_vocab_size, bias=False)
        self.use_draft_vocab = c.draft_vocab_size != c.vocab_size
        if self.use_draft_vocab:
            self.register_buffer("d2t", torch.zeros(c.draft_vocab_size, dtype=torch.long))
            self.register_buffer("t2d", torch.zeros(c.vocab_size, dtype=torch.bool))
        else:
            self.d2t = self.t2d = None
        self.set_embedding(embed_weight)
        hd = c.head_dim
        self._inv_freq = 1.0 / (c.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd))

    @property
    def fc(self):  # Eagle3Drafter reads the dtype / device from `fc.weight`
        return self.eh_proj

    def fuse(self, aux: torch.Tensor) -> torch.Tensor:
        return aux.to(self.eh_proj.weight.dtype)

    def step(self, ids, hidden, positions, kvs):
        e = self.embed(ids).to(hidden.dtype)
        x = _lin(self.eh_proj, torch.cat([self.enorm(e), self.hnorm(hidden)], -1))
        cos, sin = self.rope(positions, hidden.dtype)
        for layer, kv in zip(self.layers, kvs):
            x = layer(x, cos, sin, kv)
        return x, _lin(self.lm_head, self.norm(x)).float()

    def save(self, out, dtype: torch.dtype = torch.bfloat16) -> Path:
        from safetensors.torch import save_file

        out = Path(out)
        out.mkdir(parents=True, exist_ok=True)
        sd = {k: (v.to(dtype) if v.is_floating_point() else v).contiguous().cpu() for k, v in self.state_dict().items()}
        save_file(sd, str(out / "model.safetensors.tmp"), metadata={"format": "pt"})
        (out / "model.safetensors.tmp").replace(out / "model.safetensors")
        cfg = {"verispec_model_type": "mtp", "dtype": str(dtype).removeprefix("torch."), **asdict(self.config)}
        (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
        return out


def is_mtp_dir(path: str) -> bool:
    p = Path(path) / "config.json"
    try:
        return p.is_file() and json.loads(p.read_text()).get("verispec_model_type") == "mtp"
    except (OSError, json.JSONDecodeError):
        return False


def load_mtp(path, target=None, dtype: torch.dtype = torch.float32) -> MTPModel:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    path = Path(path)
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise CheckpointError(f"{path}: no config.json (not an MTP checkpoint folder)")
    try:
        d = json.loads(cfg_file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{cfg_file}: not valid JSON ({e})") from e
    if not isinstance(d, dict) or d.get("verispec_model_type") != "mtp":
        raise CheckpointError(f"{path}: not an MTP checkpoint (config.json with verispec_model_type 'mtp')")
    d.pop("verispec_model_type"), d.pop("dtype", None)
    try:
        c = Eagle3Config(**d)
    except TypeError as e:
        raise CheckpointError(f"{path}/config.json: {e}") from e
    check_config_types(c, f"{path}/config.json")
    if target is not None:
        t = target.config
        if (c.hidden_size, c.vocab_size) != (t.hidden_size, t.vocab_size):
            raise CheckpointError(f"{path}: made for hidden size {c.hidden_size} / vocabulary {c.vocab_size}, the "
                                  f"target has {t.hidden_size} / {t.vocab_size}")
    try:
        sd = load_file(str(path / "model.safetensors"))
    except (SafetensorError, OSError, ValueError) as e:
        raise CheckpointError(f"{path}/model.safetensors: unreadable ({e})") from e
    model = MTPModel(c)
    want = model.state_dict()
    missing = sorted(set(want) - set(sd))
    if missing:
        raise CheckpointError(f"{path}/model.safetensors: tensor(s) missing: {', '.join(missing[:6])}")
    for k, v in want.items():
        if sd[k].shape != v.shape:
            raise CheckpointError(f"{path}/model.safetensors: {k} has shape {tuple(sd[k].shape)}, expected {tuple(v.shape)}")
    model.load_state_dict({k: sd[k] for k in want})
    model.to(dtype)
    if target is not None:
        model.set_embedding(target.model.embed_tokens.weight)
    return model.eval()


def make_mtp_drafter(path: str, target, max_batch: int, max_len: int, dtype, device) -> Eagle3Drafter:
    model = load_mtp(path, target, dtype=target.dtype).to(device)
    return Eagle3Drafter(model, target, max_batch, max_len, name=f"mtp:{path}")
