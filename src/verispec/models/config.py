"""One description of every supported decoder family.

Llama, Qwen2, Qwen3 and Gemma 3 differ in a handful of switches (norm style, q/k norms, biases,
activation, embedding scale, per-layer RoPE and sliding windows). `ModelConfig.from_hf` reads a
transformers config once and turns those differences into plain fields, so the forward in
`model.py` has no `if family == ...` branches.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "gemma3_text")


@dataclass
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    tie_word_embeddings: bool
    activation: str  # "silu" or "gelu_tanh"
    attention_bias: bool
    mlp_bias: bool
    qk_norm: bool
    gemma_norms: bool  # (1 + w) RMSNorm, 4 norms per layer, scaled embeddings
    attn_scale: float
    final_logit_softcap: float | None
    attn_logit_softcap: float | None
    # per layer: sliding window size (None = global) and which RoPE table it uses
    sliding_windows: list[int | None] = field(default_factory=list)
    rope_kinds: list[str] = field(default_factory=list)
    # RoPE table per kind: (inv_freq [head_dim/2], attention_scaling)
    rope: dict[str, tuple[torch.Tensor, float]] = field(default_factory=dict, repr=False)
    max_position_embeddings: int = 4096
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int | None = None

    @property
    def embed_scale(self) -> float | None:
        return self.hidden_size**0.5 if self.gemma_norms else None

    @classmethod
    def from_hf(cls, hf) -> "ModelConfig":
        """Build from a transformers `PretrainedConfig` (text config of the model)."""
        mt = hf.model_type
        if mt not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"unsupported model type {mt!r}; verispec supports {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        n_layers = hf.num_hidden_layers
        head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
        layer_types = list(getattr(hf, "layer_types", None) or ["full_attention"] * n_layers)
        gemma = mt == "gemma3_text"
        window = getattr(hf, "sliding_window", None)
        if mt == "qwen2" and not getattr(hf, "use_sliding_window", False):
            layer_types = ["full_attention"] * n_layers
        windows = [window if t == "sliding_attention" else None for t in layer_types]
        rope = _rope_tables(hf, layer_types, head_dim)
        eos = hf.eos_token_id
        eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else ((eos,) if eos is not None else ())
        act = getattr(hf, "hidden_activation", None) or getattr(hf, "hidden_act", "silu")
        return cls(
            model_type=mt,
            vocab_size=hf.vocab_size,
            hidden_size=hf.hidden_size,
            intermediate_size=hf.intermediate_size,
            num_layers=n_layers,
            num_heads=hf.num_attention_heads,
            num_kv_heads=hf.num_key_value_heads,
            head_dim=head_dim,
            rms_norm_eps=hf.rms_norm_eps,
            tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
            activation={"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh"}[act],
            attention_bias=bool(getattr(hf, "attention_bias", mt == "qwen2")),
            mlp_bias=bool(getattr(hf, "mlp_bias", False)),
            qk_norm=mt in ("qwen3", "gemma3_text"),
            gemma_norms=gemma,
            attn_scale=(hf.query_pre_attn_scalar**-0.5) if gemma else head_dim**-0.5,
            final_logit_softcap=getattr(hf, "final_logit_softcapping", None),
            attn_logit_softcap=None if gemma else getattr(hf, "attn_logit_softcapping", None),  # unused by Gemma 3
            sliding_windows=windows,
            rope_kinds=[t if t in rope else "full_attention" for t in layer_types],
            rope=rope,
            max_position_embeddings=hf.max_position_embeddings,
            bos_token_id=hf.bos_token_id,
            eos_token_ids=eos_ids,
            pad_token_id=getattr(hf, "pad_token_id", None),
        )


def _rope_tables(hf, layer_types: list[str], head_dim: int) -> dict[str, tuple[torch.Tensor, float]]:
    """Inverse frequencies per layer kind, using transformers' RoPE formulas (default, linear, llama3, yarn...)."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = getattr(hf, "rope_parameters", None) or {}
    per_type = all(isinstance(params.get(t), dict) for t in set(layer_types))
    tables = {}
    for kind in sorted(set(layer_types)):
        p = params[kind] if per_type else params
        rope_type = p.get("rope_type", "default")
        if rope_type == "default":
            base = p.get("rope_theta", getattr(hf, "rope_theta", 10000.0))
            dim = int(head_dim * p.get("partial_rotary_factor", 1.0))
            inv = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
            tables[kind] = (inv, 1.0)
        else:
            kw = {"layer_type": kind} if per_type else {}
            tables[kind] = ROPE_INIT_FUNCTIONS[rope_type](hf, None, **kw)
        if not per_type:
            return {"full_attention": tables[kind]}
    return tables
