"""What the EAGLE-3 and MTP drafters share: a trained draft head on a frozen target, and its checkpoint.

A `DraftHead` is

    x = input part (subclass: EAGLE-3's `fc` over fused target layers, MTP's `eh_proj`)
    y = Llama decoder layers (models.layers, configured by `layer_config`)
    logits = lm_head(norm(y))                  over a draft vocabulary (`d2t` / `t2d`, optional)

with the target's embedding attached by reference (not a parameter, never saved). It owns everything
but the input part and `step`: construction, the vocabulary mapping, RoPE, the training-time-test
unroll (`forward`), and one save / load path for a folder of config.json + model.safetensors, where
each subclass supplies only the config.json dialect (speculators for EAGLE-3, verispec's for MTP).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from ..models.config import ModelConfig
from ..models.layers import DecoderLayer, RMSNorm, linear, rope_cos_sin
from .expand import Columns

DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}


class CheckpointError(ValueError):
    """A drafter checkpoint that cannot be used (corrupt, incomplete, or made for another target)."""


def layer_config(c) -> ModelConfig:
    """The draft layers as a `ModelConfig`: plain Llama layers (what speculators' `transformer_layer_config`
    describes), RoPE with `c.rope_theta`, and the attention scale of PyTorch's SDPA default."""
    hd = c.head_dim
    inv_freq = 1.0 / (c.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd))
    return ModelConfig(
        model_type="llama", vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
        num_layers=c.num_layers, num_heads=c.num_heads, num_kv_heads=c.num_kv_heads, head_dim=hd,
        rms_norm_eps=c.rms_norm_eps, tie_word_embeddings=False, activation="silu", attention_bias=False,
        mlp_bias=False, qk_norm=False, gemma_norms=False, attn_scale=1.0 / math.sqrt(hd), final_logit_softcap=None,
        attn_logit_softcap=None, sliding_windows=[None] * c.num_layers, rope_kinds=["full_attention"] * c.num_layers,
        rope={"full_attention": (inv_freq, 1.0)}, max_position_embeddings=c.max_position_embeddings,
    )


def speculators_layers(c, model_type: str) -> dict:
    """speculators' `transformer_layer_config` for draft layers of `model_type` (llama, or qwen3 with
    q/k norms) described by a head config `c`."""
    d = {
        "model_type": model_type,
        "architectures": [{"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM"}[model_type]],
        "vocab_size": c.vocab_size,
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_hidden_layers": c.num_layers,
        "num_attention_heads": c.num_heads,
        "num_key_value_heads": c.num_kv_heads,
        "head_dim": c.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": c.rms_norm_eps,
        "max_position_embeddings": c.max_position_embeddings,
        "attention_bias": False,
        "tie_word_embeddings": False,
        "rope_parameters": {"rope_type": "default", "rope_theta": c.rope_theta},
    }
    if model_type == "llama":
        d["mlp_bias"] = False
    return d


def speculators_block(c, algorithm: str) -> dict:
    """speculators' `speculators_config`: the algorithm, a greedy proposal of c.speculative_tokens,
    and the verifier."""
    return {
        "algorithm": algorithm,
        "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": c.speculative_tokens,
                              "verifier_accept_k": 1, "accept_tolerance": 0.0}],
        "default_proposal_method": "greedy",
        "verifier": {"name_or_path": c.verifier, "architectures": list(c.verifier_architectures)},
    }


class DraftHead(nn.Module):
    """Base of the EAGLE-3 and MTP heads. Subclasses build their input modules, pass them to
    `__init__` (in registration order, so seeded initialisation is reproducible), and define
    `fuse` (target states -> the first step's hidden input), `step`, and the checkpoint dialect."""

    FORMAT = "drafter"  # the checkpoint dialect, for messages
    # names of tensors a checkpoint may carry that this head does not use (dropped on load)
    IGNORED_TENSORS: tuple[str, ...] = ()
    # tensors a checkpoint may leave out because they are the target's (filled in when loading
    # with a target): name -> function(model, target) -> tensor
    FROM_TARGET: dict = {}

    def __init__(self, c, embed_weight: torch.Tensor | None, inputs: dict[str, nn.Module],
                 first_layer: nn.Module | None = None):
        super().__init__()
        self.config = c
        for name, module in inputs.items():
            setattr(self, name, module)
        lc = self.layer_config(c)
        first = [first_layer] if first_layer is not None else []
        self.layers = nn.ModuleList(first + [DecoderLayer(lc) for _ in range(c.num_layers - len(first))])
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.lm_head = nn.Linear(c.hidden_size, c.draft_vocab_size, bias=False)
        self.packed_head = None  # the LM head prepacked for serving (models/prepack.py `prepack_head`)
        self.use_draft_vocab = c.draft_vocab_size != c.vocab_size
        if self.use_draft_vocab:
            self.register_buffer("d2t", torch.zeros(c.draft_vocab_size, dtype=torch.long))
            self.register_buffer("t2d", torch.zeros(c.vocab_size, dtype=torch.bool))
        else:
            self.d2t = self.t2d = None
        self.set_embedding(embed_weight)
        self._inv_freq = lc.rope["full_attention"][0]

    # ---- pieces ----------------------------------------------------------------------------------
    @staticmethod
    def layer_config(c) -> ModelConfig:
        """The draft layers' configuration (Llama layers; DFlash: Qwen3 layers with q/k norms)."""
        return layer_config(c)

    def set_embedding(self, weight: torch.Tensor | None) -> None:
        """Attach the target's embedding table [V, H]: a detached view (not a parameter, never saved)."""
        self.__dict__["embed_weight"] = None if weight is None else weight.detach()

    def set_vocab_mapping(self, d2t: torch.Tensor, t2d: torch.Tensor) -> None:
        if not self.use_draft_vocab:
            return
        self.d2t.copy_(d2t)
        self.t2d.copy_(t2d)

    def draft_to_target(self) -> torch.Tensor:
        """[Vd] target ids of the draft vocabulary."""
        ar = torch.arange(self.config.draft_vocab_size, device=self.lm_head.weight.device)
        return ar + self.d2t if self.use_draft_vocab else ar

    def to_target_vocab(self, lg: torch.Tensor, d2t: torch.Tensor | None = None) -> torch.Tensor:
        """Draft-vocabulary logits [n, Vd] -> fp32 logits over the target vocabulary [n, V] (-inf
        outside the draft vocabulary). d2t: `draft_to_target()`, when the caller keeps it."""
        out = torch.full((lg.shape[0], self.config.vocab_size), float("-inf"), device=lg.device)
        out[:, self.draft_to_target() if d2t is None else d2t] = lg.float()
        return out

    def columns(self) -> Columns | None:
        """What the columns of `head_logits` are, for drafting over them (expand.Columns); None
        without a draft vocabulary (the columns are the target's ids)."""
        return Columns(self.draft_to_target(), self.config.vocab_size) if self.use_draft_vocab else None

    def target_to_draft(self, ids: torch.Tensor) -> torch.Tensor:
        """Target ids -> draft ids (-1 where the id is not in the draft vocabulary)."""
        if not self.use_draft_vocab:
            return ids
        lut = torch.full((self.config.vocab_size,), -1, dtype=torch.long, device=ids.device)
        lut[self.draft_to_target().to(ids.device)] = torch.arange(self.config.draft_vocab_size, device=ids.device)
        return lut[ids]

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        if self.embed_weight is None:
            raise RuntimeError("the drafter needs the target's embedding (attach it with embed_weight=...)")
        return F.embedding(ids, self.embed_weight)

    def rope(self, positions: torch.Tensor, dtype) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = rope_cos_sin(self._inv_freq, positions)
        return cos.to(dtype)[:, None], sin.to(dtype)[:, None]  # [B, 1, T, hd]

    def run_layers(self, x: torch.Tensor, positions: torch.Tensor, kvs, dtype) -> torch.Tensor:
        """The decoder layers over x [B, T, *] at RoPE `positions` [B, T]; kvs[l] is layer l's `kv`
        (models.layers); RoPE tables in `dtype` (the hidden input's)."""
        cos, sin = self.rope(positions, dtype)
        for layer, kv in zip(self.layers, kvs):
            x = layer(x, cos, sin, kv)
        return x

    def head_logits(self, y: torch.Tensor) -> torch.Tensor:
        """Post-norm state -> fp32 logits over the draft vocabulary."""
        return linear(y, self.packed_head or self.lm_head.weight).float()

    def step(self, ids, hidden, positions, kvs):
        """One draft step (`step_states` of the subclass, then the LM head): returns (next hidden
        [B, T, H], draft logits [B, T, Vd] fp32)."""
        hidden, out = self.step_states(ids, hidden, positions, kvs)
        return hidden, self.head_logits(out)

    # ---- training: training-time test unrolling ---------------------------------------------------
    def forward(self, aux: torch.Tensor, ids: torch.Tensor, valid: torch.Tensor, steps: int = 3,
                anchors: torch.Tensor | None = None) -> list[torch.Tensor]:
        """Unroll `steps` draft steps over whole sequences (teacher-forced tokens, own hidden states).

        aux     [B, T, n*H]  target states g_0 .. g_{T-1} for tokens x_0 .. x_{T-1}
        ids     [B, T]       tokens x_0 .. x_{T-1}
        valid   [B, T] bool  real (not padding) tokens
        anchors [B, R]       optional: the anchor rows (0 <= i <= T - 2) whose drafts are wanted
        Returns logits per step: out[s][b, i] ([B, T-1, Vd]) is the draft's distribution for token
        x_{i+2+s} from anchor row i (target state g_i, then tokens x_{i+1} .. x_{i+1+s}); with
        `anchors`, out[s][b, j] ([B, R, Vd]) is that of anchor row anchors[b, j].

        Step s attends the step-0 keys causally and, for every earlier step j in 1..s, only the key of
        the same row (the draft chain of that anchor) -- exactly what serving sees in its KV cache.
        With `anchors`, step 0 still runs every row (each is context for the anchors after it), but
        the LM head and the later steps run the anchor rows only: training on response tokens skips
        the prompt's rows (and padding), which carry no loss, in all but the first step's layers.
        """
        B, T = ids.shape
        n = T - 1
        dev = ids.device
        hidden = self.fuse(aux[:, :n])
        rows = torch.arange(n, device=dev)
        positions = (rows + 1)[None].expand(B, n)
        kvalid = valid[:, 1:]  # row i reads x_{i+1}
        diag = torch.eye(n, dtype=torch.bool, device=dev)[None, None].expand(B, 1, n, n)
        causal = ((rows[None, :] <= rows[:, None])[None, None] & kvalid[:, None, None, :]) | diag  # [B, 1, n, n]
        past = [([], []) for _ in self.layers]

        def kvs(mask):
            def make_kv(l):
                def kv(k, v):
                    past[l][0].append(k)
                    past[l][1].append(v)
                    return torch.cat(past[l][0], 2), torch.cat(past[l][1], 2), mask
                return kv
            return [make_kv(l) for l in range(len(self.layers))]

        if anchors is not None:
            return self._forward_anchors(ids, hidden, positions, kvalid, causal, kvs, steps, anchors)
        out = []
        for s in range(steps):
            tok = torch.cat([ids[:, 1 + s :], ids.new_zeros(B, s)], 1)[:, :n] if s else ids[:, 1:]
            mask = torch.cat([causal] + [diag] * s, dim=-1)  # [B, 1, n, (s+1) n]
            hidden, logits = self.step(tok, hidden, positions + s, kvs(mask))
            out.append(logits)
        return out

    def _forward_anchors(self, ids, hidden, positions, kvalid, causal, kvs, steps, anchors):
        """`forward` at the anchor rows only (see there): step 0 over all n rows, its outputs taken
        at the anchors; steps 1.. over the R anchors, attending step 0's keys up to their own row and
        their own earlier steps' keys."""
        B, T = ids.shape
        n, R = T - 1, anchors.shape[1]
        dev = ids.device
        a = anchors.clamp(0, n - 1)  # [B, R]
        rows = torch.arange(n, device=dev)
        take = lambda t: t.gather(1, a[..., None].expand(-1, -1, t.shape[-1]))  # noqa: E731  [B, n, X] -> [B, R, X]
        hidden, state = self.step_states(ids[:, 1:], hidden, positions, kvs(causal))
        hidden = take(hidden)
        out = [self.head_logits(take(state))]
        context = ((rows[None, None, :] <= a[:, :, None]) & kvalid[:, None, :]) | (rows[None, None, :] == a[:, :, None])
        own = torch.eye(R, dtype=torch.bool, device=dev)[None].expand(B, R, R)  # [B, R, R] same anchor
        for s in range(1, steps):
            tok = ids.gather(1, (a + 1 + s).clamp(max=T - 1))  # x_{i+1+s} (clamped past the end: no loss there)
            mask = torch.cat([context] + [own] * s, dim=-1)[:, None]  # [B, 1, R, n + s R]
            hidden, state = self.step_states(tok, hidden, a + 1 + s, kvs(mask))
            out.append(self.head_logits(state))
        return out

    # ---- checkpoint: a folder of config.json + model.safetensors ------------------------------------
    def config_json(self, dtype_name: str) -> dict:
        """config.json for this head, in its format's dialect."""
        raise NotImplementedError

    @classmethod
    def claims(cls, d: dict) -> bool:
        """Whether a parsed config.json is a checkpoint of this kind."""
        raise NotImplementedError

    @classmethod
    def config_from_json(cls, d: dict, where: str):
        """Parsed config.json -> the head's config; CheckpointError naming the problem otherwise."""
        raise NotImplementedError

    @classmethod
    def check_target(cls, c, target, where: str) -> None:
        """Refuse a target this head was not made for (CheckpointError)."""
        t = target.config
        if c.hidden_size != t.hidden_size:
            raise CheckpointError(f"{where}: drafter hidden size {c.hidden_size} != target hidden size {t.hidden_size}")
        if c.vocab_size != t.vocab_size:
            raise CheckpointError(f"{where}: drafter vocabulary {c.vocab_size} != target vocabulary {t.vocab_size}")

    def save(self, out: str | Path, dtype: torch.dtype = torch.bfloat16) -> Path:
        """Write the folder (weights first, atomically; the embedding is not saved)."""
        from safetensors.torch import save_file

        out = Path(out)
        out.mkdir(parents=True, exist_ok=True)
        sd = {k: (v.to(dtype) if v.is_floating_point() else v).contiguous().cpu() for k, v in self.state_dict().items()}
        tmp = out / "model.safetensors.tmp"
        save_file(sd, str(tmp), metadata={"format": "pt"})
        tmp.replace(out / "model.safetensors")
        (out / "config.json").write_text(json.dumps(self.config_json(DTYPE_NAMES[dtype]), indent=2) + "\n")
        return out

    @classmethod
    def is_checkpoint(cls, path: str | Path) -> bool:
        """A folder of this format, or one whose config.json cannot be read at all (then the loader
        names the broken file instead of the drafter spec being called unknown)."""
        p = Path(path) / "config.json"
        if not p.is_file():
            return False
        try:
            d = json.loads(p.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError):
            return True
        return not isinstance(d, dict) or cls.claims(d)

    @classmethod
    def load(cls, path: str | Path, target=None, dtype: torch.dtype = torch.float32):
        """Load a checkpoint folder; with `target`, check it was made for it and attach the target's
        embedding. Refuses bad checkpoints with a CheckpointError naming the problem."""
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        path = Path(path)
        cfg_file, w_file = path / "config.json", path / "model.safetensors"
        if not cfg_file.is_file():
            raise CheckpointError(f"{path}: no config.json (not a {cls.FORMAT} checkpoint folder)")
        try:
            d = json.loads(cfg_file.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise CheckpointError(f"{cfg_file}: not valid JSON ({e})") from e
        if not isinstance(d, dict):
            raise CheckpointError(f"{cfg_file}: not a JSON object")
        c = cls.config_from_json(d, str(cfg_file))
        if not w_file.is_file():
            raise CheckpointError(f"{path}: no model.safetensors")
        try:
            sd = load_file(str(w_file))
        except (SafetensorError, OSError, ValueError) as e:
            raise CheckpointError(f"{w_file}: unreadable safetensors file ({e})") from e
        if target is not None:
            cls.check_target(c, target, str(path))
        try:
            model = cls(c)
        except ValueError as e:
            raise CheckpointError(f"{cfg_file}: {e}") from e
        want = model.state_dict()
        for k in cls.IGNORED_TENSORS:
            sd.pop(k, None)
        if target is not None:
            for k, fill in cls.FROM_TARGET.items():
                if k in want and k not in sd:
                    if model.use_draft_vocab:  # the rows of the draft vocabulary need the mapping first
                        for b in ("d2t", "t2d"):
                            if b in sd:
                                getattr(model, b).copy_(sd[b])
                    sd[k] = fill(model, target).detach().float()
        missing, unexpected = sorted(set(want) - set(sd)), sorted(set(sd) - set(want))
        if missing:
            raise CheckpointError(f"{w_file}: tensor(s) missing: {', '.join(missing[:6])}")
        if unexpected:
            raise CheckpointError(f"{w_file}: unexpected tensor(s) {', '.join(unexpected[:6])} for this config.json")
        for k, v in want.items():
            if tuple(sd[k].shape) != tuple(v.shape):
                raise CheckpointError(f"{w_file}: tensor {k} has shape {tuple(sd[k].shape)}, config.json implies "
                                      f"{tuple(v.shape)} (hidden size {c.hidden_size}, draft vocab {c.draft_vocab_size})")
        model.load_state_dict({k: (v.to(dtype) if v.is_floating_point() else v) for k, v in sd.items()})
        model.to(dtype)
        if model.use_draft_vocab:
            tgt = model.draft_to_target()
            if int(tgt.min()) < 0 or int(tgt.max()) >= c.vocab_size or not bool((tgt[1:] > tgt[:-1]).all()) \
                    or int(model.t2d.sum()) != c.draft_vocab_size or not bool(model.t2d[tgt].all()):
                raise CheckpointError(f"{w_file}: d2t / t2d do not form a consistent draft vocabulary mapping")
        if target is not None:
            model.set_embedding(target.model.embed_tokens.weight)
        return model.eval()
