"""EAGLE-3 drafter: one module for training (training-time test unrolling) and serving (chain drafting).

Architecture (EAGLE-3, arXiv 2503.01840; weight names exactly as speculators / vLLM `eagle3`):

    g = fc(concat(N_a(h_a), N_b(h_b), N_c(h_c)))       3 target layer outputs -> H  (N_*: `fc_norm`, EAGLE 3.1)
    x = concat(embed(token), g)                       the target's (frozen, unscaled) embedding, 2H
    layer 0: residual = g; a = attn(concat(input_layernorm(e), hidden_norm(g)))   q/k/v read 2H
             y = g + o_proj(a); y = y + mlp(post_attention_layernorm(y))           a Llama block
    logits = lm_head(norm(y))                          over the reduced draft vocabulary (d2t / t2d)

Alignment (as speculators `shift_batch`): draft row i reads the target state g_i of token x_i and the
embedding of x_{i+1}, sits at RoPE position i + 1 and predicts x_{i+2}. At step s of the recurrence
the hidden input is the draft's own output state y of step s - 1 (post-norm with `norm_output`,
EAGLE 3.1) and the token is the one drafted (serving) or the ground truth shifted by s (training).

Training-time test (TTT): all rows of a sequence unroll `steps` steps at once; step s attends the
step-0 keys causally and, for every earlier step j in 1..s, only the key of the same row (the draft
chain of that anchor) -- exactly what serving sees in its KV cache, so a one-step unroll is a plain
causal forward (tests/test_eagle3.py checks both against the serving path).

Draft vocabulary: `d2t[i]` is an offset, target id = i + d2t[i]; `t2d` is a bool mask over the target
vocabulary. Both are built from token-frequency counts (`build_vocab_mapping`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from ..models.model import linear
from ..sequence import Sequence
from ..verify import probs, sample
from .base import Draft, Drafter

ARCHITECTURES = {"gemma3_text": "Gemma3ForCausalLM", "llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                 "qwen3": "Qwen3ForCausalLM"}


class CheckpointError(ValueError):
    """An EAGLE-3 checkpoint that cannot be used (corrupt, incomplete, or made for another target)."""


# --------------------------------------------------------------------------------------------
# configuration


@dataclass
class Eagle3Config:
    hidden_size: int  # = the target's hidden size
    vocab_size: int  # the target's vocabulary
    draft_vocab_size: int
    aux_layers: list[int]  # target layers whose outputs are fused
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 64
    intermediate_size: int = 1024
    num_layers: int = 1
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 4096
    fc_norm: bool = False  # EAGLE 3.1: a norm on each target state before fusion
    norm_output: bool = False  # EAGLE 3.1: feed the post-norm state to the next step
    norm_before_fc: bool = False  # one norm over the concatenation (gpt-oss style)
    norm_before_residual: bool = False
    speculative_tokens: int = 3
    verifier: str | None = None  # name or path of the target
    verifier_architectures: list[str] = field(default_factory=list)
    target_num_layers: int | None = None

    @classmethod
    def for_target(cls, target, draft_vocab_size: int | None = None, aux_layers=None, **kw) -> "Eagle3Config":
        """Defaults from a target `CausalLM` (its hidden size, heads, vocabulary)."""
        c = target.config
        L = c.num_layers
        aux = list(aux_layers) if aux_layers is not None else default_aux_layers(L)
        kw.setdefault("num_heads", c.num_heads)
        kw.setdefault("num_kv_heads", c.num_kv_heads)
        kw.setdefault("head_dim", c.head_dim)
        kw.setdefault("intermediate_size", c.intermediate_size)
        kw.setdefault("rms_norm_eps", c.rms_norm_eps)
        kw.setdefault("max_position_embeddings", c.max_position_embeddings)
        kw.setdefault("verifier_architectures", [ARCHITECTURES.get(c.model_type, c.model_type)])
        return cls(hidden_size=c.hidden_size, vocab_size=c.vocab_size,
                   draft_vocab_size=draft_vocab_size or c.vocab_size, aux_layers=aux, target_num_layers=L, **kw)

    # ---- the speculators config.json ----------------------------------------------------------
    def to_speculators(self, dtype: str = "bfloat16") -> dict:
        return {
            "architectures": ["Eagle3Speculator"],
            "speculators_model_type": "eagle3",
            "speculators_version": "0.9.0",
            "draft_vocab_size": self.draft_vocab_size,
            "target_hidden_size": None,
            "eagle_aux_hidden_state_layer_ids": list(self.aux_layers),
            "norm_before_residual": self.norm_before_residual,
            "norm_before_fc": self.norm_before_fc,
            "fc_norm": self.fc_norm,
            "norm_output": self.norm_output,
            "embed_requires_grad": False,
            "dtype": dtype,
            "transformer_layer_config": {
                "model_type": "llama",
                "architectures": ["LlamaForCausalLM"],
                "vocab_size": self.vocab_size,
                "hidden_size": self.hidden_size,
                "intermediate_size": self.intermediate_size,
                "num_hidden_layers": self.num_layers,
                "num_attention_heads": self.num_heads,
                "num_key_value_heads": self.num_kv_heads,
                "head_dim": self.head_dim,
                "hidden_act": "silu",
                "rms_norm_eps": self.rms_norm_eps,
                "max_position_embeddings": self.max_position_embeddings,
                "attention_bias": False,
                "mlp_bias": False,
                "tie_word_embeddings": False,
                "rope_parameters": {"rope_type": "default", "rope_theta": self.rope_theta},
            },
            "speculators_config": {
                "algorithm": "eagle3",
                "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": self.speculative_tokens,
                                      "verifier_accept_k": 1, "accept_tolerance": 0.0}],
                "default_proposal_method": "greedy",
                "verifier": {"name_or_path": self.verifier, "architectures": list(self.verifier_architectures)},
            },
        }

    @classmethod
    def from_speculators(cls, d: dict, where: str = "config.json") -> "Eagle3Config":
        if d.get("speculators_model_type") != "eagle3":
            raise CheckpointError(f"{where}: speculators_model_type is {d.get('speculators_model_type')!r}, not 'eagle3'")
        try:
            tl = d["transformer_layer_config"]
            sc = d.get("speculators_config") or {}
            ver = sc.get("verifier") or {}
            props = sc.get("proposal_methods") or [{}]
            if tl.get("model_type", "llama") != "llama":  # speculators also writes qwen3 layers (q/k norms)
                raise CheckpointError(f"{where}: draft layer type {tl.get('model_type')!r} is not supported yet "
                                      "(llama only)")
            H = tl["hidden_size"]
            nh = tl.get("num_attention_heads", 32)
            rp = tl.get("rope_parameters") or {}
            theta = rp.get("rope_theta", tl.get("rope_theta", 10000.0))
            if rp.get("rope_type", "default") != "default":
                raise CheckpointError(f"{where}: rope_type {rp.get('rope_type')!r} is not supported (default only)")
            aux = d.get("eagle_aux_hidden_state_layer_ids")
            if aux is None:
                raise CheckpointError(f"{where}: eagle_aux_hidden_state_layer_ids is missing")
            _check_ints(tl, where, "transformer_layer_config.", "hidden_size", "vocab_size", "intermediate_size",
                        "num_attention_heads", "num_key_value_heads", "head_dim", "num_hidden_layers",
                        "max_position_embeddings")
            _check_ints(d, where, "", "draft_vocab_size")
            if not isinstance(aux, list) or not all(_is_int(i) for i in aux):
                raise CheckpointError(f"{where}: eagle_aux_hidden_state_layer_ids must be a list of integers, got {aux!r}")
            ths = d.get("target_hidden_size")
            if ths is not None and ths != H:
                raise CheckpointError(f"{where}: target_hidden_size {ths} != draft hidden size {H} (not supported)")
            return cls(
                hidden_size=H, vocab_size=tl["vocab_size"], draft_vocab_size=d.get("draft_vocab_size", tl["vocab_size"]),
                aux_layers=list(aux), num_heads=nh, num_kv_heads=tl.get("num_key_value_heads", nh),
                head_dim=tl.get("head_dim") or H // nh, intermediate_size=tl["intermediate_size"],
                num_layers=tl.get("num_hidden_layers", 1), rms_norm_eps=tl.get("rms_norm_eps", 1e-6), rope_theta=theta,
                max_position_embeddings=tl.get("max_position_embeddings", 4096), fc_norm=bool(d.get("fc_norm", False)),
                norm_output=bool(d.get("norm_output", False)), norm_before_fc=bool(d.get("norm_before_fc", False)),
                norm_before_residual=bool(d.get("norm_before_residual", False)),
                speculative_tokens=props[0].get("speculative_tokens", 3), verifier=ver.get("name_or_path"),
                verifier_architectures=list(ver.get("architectures") or []),
            )
        except CheckpointError:
            raise
        except KeyError as e:
            raise CheckpointError(f"{where}: required field {e} is missing") from e
        except (TypeError, ValueError, AttributeError) as e:  # e.g. head_dim derived from a hidden size that is a string
            raise CheckpointError(f"{where}: {e}") from e


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _check_ints(d: dict, where: str, prefix: str, *keys: str) -> None:
    """Integer fields must be JSON integers: a hidden size of "640" would otherwise end in
    messages like "640 != 640" or a shape error deep in the model."""
    for k in keys:
        v = d.get(k)
        if v is not None and (not _is_int(v) or v < 0):
            raise CheckpointError(f"{where}: {prefix}{k} must be a non-negative integer, got {v!r}")


INT_FIELDS = ("hidden_size", "vocab_size", "draft_vocab_size", "num_heads", "num_kv_heads", "head_dim",
              "intermediate_size", "num_layers", "max_position_embeddings", "speculative_tokens")


def check_config_types(c: "Eagle3Config", where: str) -> None:
    """The types of a config built from a verispec (MTP) config.json, checked the same way."""
    _check_ints(vars(c), where, "", *INT_FIELDS)
    if not isinstance(c.aux_layers, list) or not all(_is_int(i) for i in c.aux_layers):
        raise CheckpointError(f"{where}: aux_layers must be a list of integers, got {c.aux_layers!r}")


def default_aux_layers(num_layers: int) -> list[int]:
    """EAGLE-3's low / middle / high target layers: [2, L // 2, L - 3]; for small targets where those
    collide, three (or fewer) distinct layers spread evenly (speculators refuses duplicates)."""
    L = num_layers
    ids = [2, L // 2, L - 3]
    if len(set(ids)) == 3 and min(ids) >= 0 and ids == sorted(ids):
        return ids
    return sorted({round(i * (L - 1) / 2) for i in range(3)})


# --------------------------------------------------------------------------------------------
# vocabulary mapping


def build_vocab_mapping(counts: torch.Tensor, draft_vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """counts [V] token frequencies -> (d2t [Vd] int64 offsets, t2d [V] bool).

    The `draft_vocab_size` most frequent ids are kept (ties and unseen ids: lowest id first), sorted
    by id, so target id = i + d2t[i] is increasing.
    """
    V = counts.numel()
    if not 1 <= draft_vocab_size <= V:
        raise ValueError(f"draft_vocab_size must be in 1..{V}, got {draft_vocab_size}")
    # stable sort by count descending: equal counts keep the lower id first
    order = torch.sort(-counts.double(), stable=True).indices[:draft_vocab_size]
    keep = order.sort().values
    d2t = keep - torch.arange(draft_vocab_size)
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[keep] = True
    return d2t.long(), t2d


# --------------------------------------------------------------------------------------------
# the module


class RMSNorm(nn.Module):
    """Llama RMSNorm (fp32 statistics; weight applied after casting back)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


class _Attention(nn.Module):
    def __init__(self, c: Eagle3Config, in_dim: int):
        super().__init__()
        self.c = c
        self.q_proj = nn.Linear(in_dim, c.num_heads * c.head_dim, bias=False)
        self.k_proj = nn.Linear(in_dim, c.num_kv_heads * c.head_dim, bias=False)
        self.v_proj = nn.Linear(in_dim, c.num_kv_heads * c.head_dim, bias=False)
        self.o_proj = nn.Linear(c.num_heads * c.head_dim, c.hidden_size, bias=False)

    def forward(self, x, cos, sin, kv):
        """x [B, T, in]; cos/sin [B, 1, T, hd]; kv(k, v) -> (K, V, mask) stores the new keys and
        returns what these queries attend to ([B, kvh, Lk, hd] x2 and a bool mask [B, 1, T, Lk])."""
        B, T, _ = x.shape
        c = self.c
        q = _lin(self.q_proj, x).view(B, T, c.num_heads, c.head_dim).transpose(1, 2)
        k = _lin(self.k_proj, x).view(B, T, c.num_kv_heads, c.head_dim).transpose(1, 2)
        v = _lin(self.v_proj, x).view(B, T, c.num_kv_heads, c.head_dim).transpose(1, 2)
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        K, V, mask = kv(k, v)
        o = F.scaled_dot_product_attention(q, K.to(q.dtype), V.to(q.dtype), attn_mask=mask,
                                           enable_gqa=c.num_heads != c.num_kv_heads)
        return _lin(self.o_proj, o.transpose(1, 2).reshape(B, T, -1))


def _lin(m: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """m(x), with the faster CPU kernels of models.model.linear for decode-sized bf16 inputs."""
    if x.dtype != m.weight.dtype:  # autocast training: let F.linear cast
        return m(x)
    return linear(x, m.weight, m.bias)


def _rotate(x, cos, sin):
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


class _MLP(nn.Module):
    def __init__(self, c: Eagle3Config):
        super().__init__()
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)

    def forward(self, x):
        return _lin(self.down_proj, F.silu(_lin(self.gate_proj, x)) * _lin(self.up_proj, x))


class _Layer(nn.Module):
    """A Llama decoder layer; the first one reads concat(embedding, hidden) (2H) as EAGLE-3 does."""

    def __init__(self, c: Eagle3Config, first: bool):
        super().__init__()
        H = c.hidden_size
        self.first = first
        self.self_attn = _Attention(c, 2 * H if first else H)
        self.mlp = _MLP(c)
        self.input_layernorm = RMSNorm(H, c.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(H, c.rms_norm_eps)
        if first:
            self.hidden_norm = RMSNorm(H, c.rms_norm_eps)
        self.norm_before_residual = c.norm_before_residual

    def forward(self, x, cos, sin, kv):
        if self.first:
            e, h = x.chunk(2, dim=-1)
            hn = self.hidden_norm(h)
            residual = hn if self.norm_before_residual else h
            a = self.self_attn(torch.cat([self.input_layernorm(e), hn], dim=-1), cos, sin, kv)
        else:
            residual = x
            a = self.self_attn(self.input_layernorm(x), cos, sin, kv)
        y = residual + a
        return y + self.mlp(self.post_attention_layernorm(y))


class Eagle3Model(nn.Module):
    """The drafter's weights (names as speculators writes them) plus a frozen reference to the target's
    embedding table (not a parameter, not saved: vLLM and speculators take it from the verifier)."""

    def __init__(self, c: Eagle3Config, embed_weight: torch.Tensor | None = None):
        super().__init__()
        self.config = c
        H, n = c.hidden_size, len(c.aux_layers)
        if c.fc_norm and c.norm_before_fc:
            raise ValueError("fc_norm and norm_before_fc are mutually exclusive")
        if c.fc_norm:
            self.fc_norm = nn.ModuleList(RMSNorm(H, c.rms_norm_eps) for _ in range(n))
        if c.norm_before_fc:
            self.input_norm = RMSNorm(n * H, c.rms_norm_eps)
        self.fc = nn.Linear(n * H, H, bias=False)
        self.layers = nn.ModuleList(_Layer(c, i == 0) for i in range(c.num_layers))
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

    # ---- pieces ----------------------------------------------------------------------------------
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

    def target_to_draft(self, ids: torch.Tensor) -> torch.Tensor:
        """Target ids -> draft ids (-1 where the id is not in the draft vocabulary)."""
        if not self.use_draft_vocab:
            return ids
        lut = torch.full((self.config.vocab_size,), -1, dtype=torch.long, device=ids.device)
        lut[self.draft_to_target().to(ids.device)] = torch.arange(self.config.draft_vocab_size, device=ids.device)
        return lut[ids]

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        if self.embed_weight is None:
            raise RuntimeError("the EAGLE-3 drafter needs the target's embedding (attach it with embed_weight=...)")
        return F.embedding(ids, self.embed_weight)

    def fuse(self, aux: torch.Tensor) -> torch.Tensor:
        """aux [..., n*H] (target layer outputs, concatenated in aux_layers order) -> [..., H]."""
        aux = aux.to(self.fc.weight.dtype)
        if self.config.norm_before_fc:
            aux = self.input_norm(aux)
        if self.config.fc_norm:
            aux = torch.cat([nrm(a) for nrm, a in zip(self.fc_norm, aux.chunk(len(self.fc_norm), -1))], -1)
        return _lin(self.fc, aux)

    def rope(self, positions: torch.Tensor, dtype) -> tuple[torch.Tensor, torch.Tensor]:
        f = positions.float()[..., None] * self._inv_freq.to(positions.device)
        emb = torch.cat((f, f), -1)
        return emb.cos().to(dtype)[:, None], emb.sin().to(dtype)[:, None]  # [B, 1, T, hd]

    def step(self, ids, hidden, positions, kvs):
        """One draft step: ids [B, T] tokens, hidden [B, T, H] (fused target state, or the previous
        step's output), positions [B, T]; kvs[l](k, v) -> (K, V, mask) per layer.
        Returns (next hidden [B, T, H], draft logits [B, T, Vd] fp32)."""
        e = self.embed(ids).to(hidden.dtype)
        x = torch.cat([e, hidden], -1)
        cos, sin = self.rope(positions, hidden.dtype)
        for layer, kv in zip(self.layers, kvs):
            x = layer(x, cos, sin, kv)
        if self.config.norm_output:
            x = self.norm(x)
            return x, _lin(self.lm_head, x).float()
        return x, _lin(self.lm_head, self.norm(x)).float()

    # ---- training: training-time test unrolling ---------------------------------------------------
    def forward(self, aux: torch.Tensor, ids: torch.Tensor, valid: torch.Tensor, steps: int = 3) -> list[torch.Tensor]:
        """Unroll `steps` draft steps over whole sequences (teacher-forced tokens, own hidden states).

        aux   [B, T, n*H]  target layer outputs g_0 .. g_{T-1} for tokens x_0 .. x_{T-1}
        ids   [B, T]       tokens x_0 .. x_{T-1}
        valid [B, T] bool  real (not padding) tokens
        Returns logits per step: out[s][b, i] ([B, T-1, Vd]) is the draft's distribution for token
        x_{i+2+s} from anchor row i (target state g_i, then tokens x_{i+1} .. x_{i+1+s}).
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
        out = []
        for s in range(steps):
            tok = torch.cat([ids[:, 1 + s :], ids.new_zeros(B, s)], 1)[:, :n] if s else ids[:, 1:]
            mask = torch.cat([causal] + [diag] * s, dim=-1)  # [B, 1, n, (s+1) n]

            def make_kv(l):
                def kv(k, v):
                    past[l][0].append(k)
                    past[l][1].append(v)
                    return torch.cat(past[l][0], 2), torch.cat(past[l][1], 2), mask
                return kv

            hidden, logits = self.step(tok, hidden, positions + s, [make_kv(l) for l in range(len(self.layers))])
            out.append(logits)
        return out

    # ---- checkpoint (speculators format) ----------------------------------------------------------
    def save(self, out: str | Path, dtype: torch.dtype = torch.bfloat16) -> Path:
        from safetensors.torch import save_file

        out = Path(out)
        out.mkdir(parents=True, exist_ok=True)
        sd = {k: (v.to(dtype) if v.is_floating_point() else v).contiguous().cpu() for k, v in self.state_dict().items()}
        tmp = out / "model.safetensors.tmp"
        save_file(sd, str(tmp), metadata={"format": "pt"})
        tmp.replace(out / "model.safetensors")
        name = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}[dtype]
        (out / "config.json").write_text(json.dumps(self.config.to_speculators(name), indent=2) + "\n")
        return out


def load_eagle3(path: str | Path, target=None, dtype: torch.dtype = torch.float32) -> Eagle3Model:
    """Load a speculators-format EAGLE-3 checkpoint folder; with `target`, check it was made for it
    and attach the target's embedding. Refuses bad checkpoints with a message naming the problem."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    path = Path(path)
    cfg_file, w_file = path / "config.json", path / "model.safetensors"
    if not cfg_file.is_file():
        raise CheckpointError(f"{path}: no config.json (not a speculators checkpoint folder)")
    try:
        d = json.loads(cfg_file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{cfg_file}: not valid JSON ({e})") from e
    if not isinstance(d, dict):
        raise CheckpointError(f"{cfg_file}: not a JSON object")
    c = Eagle3Config.from_speculators(d, str(cfg_file))
    if not w_file.is_file():
        raise CheckpointError(f"{path}: no model.safetensors")
    try:
        sd = load_file(str(w_file))
    except (SafetensorError, OSError, ValueError) as e:
        raise CheckpointError(f"{w_file}: unreadable safetensors file ({e})") from e
    if target is not None:
        check_target(c, target, str(path))
    model = Eagle3Model(c)
    want = model.state_dict()
    sd.pop("embed_tokens.weight", None)  # speculators may save the verifier's embedding; we use the target's
    for k in ("verifier_lm_head.weight", "verifier_norm.weight"):
        sd.pop(k, None)
    missing = sorted(set(want) - set(sd))
    unexpected = sorted(set(sd) - set(want))
    if missing:
        raise CheckpointError(f"{w_file}: tensor(s) missing: {', '.join(missing[:6])}")
    if unexpected:
        raise CheckpointError(f"{w_file}: unexpected tensor(s) {', '.join(unexpected[:6])} for this config.json")
    for k, v in want.items():
        if tuple(sd[k].shape) != tuple(v.shape):
            raise CheckpointError(f"{w_file}: tensor {k} has shape {tuple(sd[k].shape)}, config.json implies {tuple(v.shape)}"
                                  f" (hidden size {c.hidden_size}, draft vocab {c.draft_vocab_size})")
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


def check_target(c: Eagle3Config, target, where: str) -> None:
    t = target.config
    if c.hidden_size != t.hidden_size:
        raise CheckpointError(f"{where}: drafter hidden size {c.hidden_size} != target hidden size {t.hidden_size}")
    if c.vocab_size != t.vocab_size:
        raise CheckpointError(f"{where}: drafter vocabulary {c.vocab_size} != target vocabulary {t.vocab_size}")
    bad = [i for i in c.aux_layers if not 0 <= i < t.num_layers]
    if bad:
        raise CheckpointError(f"{where}: target layer ids {bad} out of range for a {t.num_layers}-layer target")
    arch = ARCHITECTURES.get(t.model_type)
    if c.verifier_architectures and arch and arch not in c.verifier_architectures:
        raise CheckpointError(f"{where}: made for verifier {c.verifier_architectures} ({c.verifier}), "
                              f"but the target is {arch}")


# --------------------------------------------------------------------------------------------
# serving


@dataclass
class _State:
    slot: int
    fused: torch.Tensor  # [max_rows, H] fc(target states) of the committed tokens, row i = token i
    n_obs: int = 0  # target states received (tokens 0 .. n_obs-1)
    n_real: int = 0  # draft KV rows built from target states (row i: g_i + x_{i+1})


class Eagle3Drafter(Drafter):
    """Chain drafting with an EAGLE-3 head and its own small KV cache (one slot per sequence)."""

    def __init__(self, model: Eagle3Model, target, max_batch: int, max_len: int, name: str = "eagle3"):
        from ..kv import KVCache

        self.model, self.name = model, name
        c = model.config
        self.target_taps = tuple(c.aux_layers)
        self.dtype = model.fc.weight.dtype
        self.device = model.fc.weight.device
        self.cache = KVCache(c.num_layers, max_batch, max_len, c.num_kv_heads, c.head_dim, self.dtype, self.device)
        self.max_len = max_len
        self._d2t = model.draft_to_target()

    def _state(self, seq: Sequence) -> _State:
        if seq.drafter_state is None:
            n = len(seq.prompt_ids) + seq.params.max_tokens + 1
            slot = self.cache.allocate(min(n, self.max_len))
            seq.drafter_state = _State(slot, torch.zeros(n, self.model.config.hidden_size, dtype=self.dtype, device=self.device))
        return seq.drafter_state

    @torch.inference_mode()
    def observe(self, seq: Sequence, start: int, hidden: dict[int, torch.Tensor]) -> None:
        st = self._state(seq)
        aux = torch.cat([hidden[i] for i in self.target_taps], -1)  # [n, 3H]
        n = aux.shape[0]
        if start > st.n_obs:  # a gap: the drafter missed states; start over from what it has
            return
        st.fused[start : start + n] = self.model.fuse(aux).to(self.dtype)
        st.n_obs = start + n
        st.n_real = min(st.n_real, start)

    def _kv(self, l, slots, starts, T):
        cache = self.cache
        dev = self.device
        # padding rows of a catch-up batch may run past the slot: clamp them onto the last row, which
        # holds no committed row of this sequence and is rewritten before any query can see it
        rows = (starts[:, None] + torch.arange(T, device=dev)).clamp(max=self.max_len - 1)  # [B, T]
        Lk = int(rows.max()) + 1
        sl = torch.tensor(slots, device=dev)
        j = torch.arange(Lk, device=dev)
        mask = (j[None, None, :] <= rows[:, :, None])[:, None]  # [B, 1, T, Lk]

        def kv(k, v):  # k, v [B, kvh, T, hd]
            cache.k[l][sl[:, None], :, rows] = k.transpose(1, 2).to(self.dtype)
            cache.v[l][sl[:, None], :, rows] = v.transpose(1, 2).to(self.dtype)
            K = cache.k[l][sl[:, None], :, j[None, :]].permute(0, 2, 1, 3)
            V = cache.v[l][sl[:, None], :, j[None, :]].permute(0, 2, 1, 3)
            return K, V, mask
        return kv

    def _run(self, ids, hidden, starts, slots):
        T = ids.shape[1]
        positions = starts[:, None] + torch.arange(T, device=self.device) + 1  # row i sits at position i + 1
        kvs = [self._kv(l, slots, starts, T) for l in range(len(self.model.layers))]
        return self.model.step(ids, hidden, positions, kvs)

    @torch.inference_mode()
    def propose(self, seqs: list[Sequence], ks: list[int]) -> list[Draft]:
        drafts = [Draft([]) for _ in seqs]
        idx = []
        for i, (s, k) in enumerate(zip(seqs, ks)):
            if k <= 0:
                continue
            st = self._state(s)
            n = len(s.tokens) - 1
            if st.n_obs < n or n < 1 or n + k > self.max_len:  # no target state for the last committed token yet
                continue
            idx.append(i)
        if not idx:
            return drafts
        run = [seqs[i] for i in idx]
        states = [s.drafter_state for s in run]
        kmax = max(ks[i] for i in idx)
        # 1. catch up: rows n_real .. n-1 from the target states (always re-run row n-1 for its output)
        feeds = []
        for s, st in zip(run, states):
            n = len(s.tokens) - 1
            st.n_real = min(st.n_real, n - 1)
            feeds.append((st.n_real, n))
        T = max(b - a for a, b in feeds)
        H = self.model.config.hidden_size
        ids = torch.zeros(len(run), T, dtype=torch.long, device=self.device)
        hid = torch.zeros(len(run), T, H, dtype=self.dtype, device=self.device)
        for b, ((a, e), s, st) in enumerate(zip(feeds, run, states)):
            ids[b, : e - a] = torch.tensor(s.tokens[a + 1 : e + 1], device=self.device)
            hid[b, : e - a] = st.fused[a:e]
        starts = torch.tensor([a for a, _ in feeds], device=self.device)
        slots = [st.slot for st in states]
        h, logits = self._run(ids, hid, starts, slots)
        last = torch.tensor([e - a - 1 for a, e in feeds], device=self.device)
        ar = torch.arange(len(run), device=self.device)
        h, logits = h[ar, last], logits[ar, last]  # [B, H], [B, Vd]
        for (a, e), st in zip(feeds, states):
            st.n_real = e
        # 2. the chain
        toks = [[] for _ in run]
        qs = [[] for _ in run]
        for j in range(kmax):
            nxt = []
            for b, s in enumerate(run):
                if s.params.greedy:
                    t = int(self._d2t[int(logits[b].argmax())])
                else:
                    full = torch.full((self.model.config.vocab_size,), float("-inf"), device=self.device)
                    full[self._d2t] = logits[b]
                    q = probs(full[None], s.params)[0]
                    t = sample(q, s.generator) if j < ks[idx[b]] else 0
                    qs[b].append(q)
                nxt.append(t)
                if j < ks[idx[b]]:
                    toks[b].append(t)
            if j == kmax - 1:
                break
            pos0 = torch.tensor([e + j for _, e in feeds], device=self.device)
            h, logits = self._run(torch.tensor(nxt, device=self.device)[:, None], h[:, None], pos0, slots)
            h, logits = h[:, 0], logits[:, 0]
        for b, i in enumerate(idx):
            q = torch.stack(qs[b][: ks[i]]) if qs[b] else None
            drafts[i] = Draft(toks[b], q)
        return drafts

    def release(self, seq: Sequence) -> None:
        if seq.drafter_state is not None:
            self.cache.free(seq.drafter_state.slot)
            seq.drafter_state = None


def is_eagle3_dir(path: str) -> bool:
    """A speculators EAGLE-3 folder, or a folder whose config.json cannot be read at all (then the
    loader names the broken file instead of the drafter spec being called unknown)."""
    p = Path(path) / "config.json"
    if not p.is_file():
        return False
    try:
        d = json.loads(p.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return True
    return not isinstance(d, dict) or d.get("speculators_model_type") == "eagle3"


def make_eagle3_drafter(path: str, target, max_batch: int, max_len: int, dtype: torch.dtype, device) -> Eagle3Drafter:
    model = load_eagle3(path, target, dtype=target.dtype).to(device)
    model.set_embedding(target.model.embed_tokens.weight)
    return Eagle3Drafter(model, target, max_batch, max_len, name=f"eagle3:{path}")


def vllm_command(path: str, num_tokens: int | None = None) -> str:
    c = Eagle3Config.from_speculators(json.loads((Path(path) / "config.json").read_text()))
    spec = {"method": "eagle3", "model": str(Path(path).resolve()), "num_speculative_tokens": num_tokens or c.speculative_tokens}
    target = c.verifier or "<target model>"
    return f"vllm serve {target} --speculative-config '{json.dumps(spec)}'"


__all__ = ["Eagle3Config", "Eagle3Model", "Eagle3Drafter", "CheckpointError", "build_vocab_mapping", "load_eagle3",
           "default_aux_layers", "is_eagle3_dir", "make_eagle3_drafter", "vllm_command"]
