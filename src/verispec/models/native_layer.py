"""A decoder layer's inference forward in native code (kernels/layer.c), where its weights allow.

Why: at batch 1 the Python forward of one Gemma 3 270M layer spent about as long dispatching some
thirty small torch operators and ctypes calls as its kernels spent reading 11 MB of int8 weights.
On packed weights (prepacked bf16, int8 or int4, each on verispec's own kernel) a layer is two
native calls around the attention instead:

    q = pre(x)        norm, qkv, q/k norms, RoPE; the new keys and values written into the KV cache
    o = attention(q)  kernels/attention.c through `Attention.attend_cached` (token trees route there)
    y = post(o, x)    o projection, norms and residuals, gate/up, act(g) * u, down

Every kernel is the one the Python path calls, in the same order, so the layer's output has the
same bits but for the activation, which is layer.c's own (silu or tanh-GELU: the exact value
rounded to bf16, except within 1e-6 of a tie between two bf16 values: tests/test_native_layer.py). A model takes one path for all
its inference forwards (prefill, decode, verification, trees), so speculative decoding stays
lossless; training (autograd), other dtypes and devices, and unpacked weights take the Python path.

The spec is built once per set of weight objects: a packed model's weights are frozen (it refuses
`load_state_dict`, `.to()` and casts), and replacing a projection or a norm's parameter gives
other objects and so a new spec.
"""

from __future__ import annotations

import weakref

import torch

from .. import kernels
from .prepack import PrepackedWeight
from .quant import PackedWeight


class NativeLayer:
    """The packed weights of one `DecoderLayer` as layer.c's `vs_layer`, and the two calls."""

    def __init__(self, layer, pre, post):
        attn, mlp, c = layer.self_attn, layer.mlp, layer.self_attn.c
        self._pre, self._post = pre, post
        self._keep: list[torch.Tensor] = []  # every tensor the spec points into
        norms = [layer.input_layernorm, layer.post_attention_layernorm]
        if layer.gemma:
            norms += [layer.pre_feedforward_layernorm, layer.post_feedforward_layernorm]
        else:
            norms += [None, None]
        norms += [attn.q_norm, attn.k_norm] if c.qk_norm else [None, None]
        spec = kernels.LayerSpec(
            H=c.hidden_size, heads=c.num_heads, kv_heads=c.num_kv_heads, head_dim=c.head_dim,
            inter=mlp.gate_up[0].shape[0] // 2, gemma=int(layer.gemma), act=kernels.ACTIVATIONS[c.activation],
            eps=c.rms_norm_eps,
        )
        for name, norm in zip(("in_norm", "post_attn_norm", "pre_ff_norm", "post_ff_norm", "q_norm", "k_norm"), norms):
            setattr(spec, name, None if norm is None else self._ptr(norm.fp32_scale()))
        for name, (w, bias) in (("qkv", attn.qkv), ("o", attn.out), ("gate_up", mlp.gate_up), ("down", mlp.down)):
            setattr(spec, name, self._linear(w, bias))
        self.spec = spec
        self.ref = kernels.ctypes.byref(spec)
        self.heads, self.head_dim = c.num_heads, c.head_dim

    @staticmethod
    def build(layer) -> "NativeLayer | None":
        """The layer's native form, or None where a projection is not on a native kernel, the
        shapes are not a target layer's, or the kernels cannot be had."""
        attn, mlp = layer.self_attn, layer.mlp
        pre, post = kernels.layer_pre(), kernels.layer_post()
        c = attn.c
        if pre is None or post is None or c.activation not in kernels.ACTIVATIONS:
            return None
        if attn.out is None or attn.qkv is None or mlp.gate_up is None or mlp.down is None:
            return None
        nq, nk = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        shapes = {"qkv": (nq + 2 * nk, c.hidden_size), "o": (c.hidden_size, nq)}
        inter = mlp.gate_up[0].shape[0] // 2
        shapes.update(gate_up=(2 * inter, c.hidden_size), down=(c.hidden_size, inter))
        for name, (w, bias) in (("qkv", attn.qkv), ("o", attn.out), ("gate_up", mlp.gate_up), ("down", mlp.down)):
            if not _native_weight(w, bias) or tuple(w.shape) != shapes[name]:
                return None
        return NativeLayer(layer, pre, post)

    def _ptr(self, t: torch.Tensor) -> int:
        self._keep.append(t)
        return t.data_ptr()

    def _linear(self, w, bias) -> "kernels.LinearSpec":
        N, K = w.shape
        if isinstance(w, PrepackedWeight):
            return kernels.LinearSpec(0, N, K, self._ptr(w.packed), None, None,
                                      None if w.bias is None else self._ptr(w.bias), None)
        b = None if bias is None else self._ptr(bias.contiguous())
        if w.mode == "int8":
            return kernels.LinearSpec(1, N, K, self._ptr(w.packed), self._ptr(w.scale), None, None, b)
        return kernels.LinearSpec(2, N, K, self._ptr(w.packed), self._ptr(w.scales), self._ptr(w.zeros), None, b)

    def pre(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache) -> torch.Tensor:
        """x [B, T, H] dense, cos / sin [B, 1, T, hd], cache = (k_cache, v_cache [S, kvh, L, hd], slots,
        rows [B * T] int64): writes the entries' keys and values, returns q [B, heads, T, hd]."""
        k_cache, v_cache, slots, rows = cache
        if v_cache.stride() != k_cache.stride() or k_cache.stride(-1) != 1:  # layer.c writes both through k's strides
            raise ValueError(f"K/V caches of strides {k_cache.stride()} and {v_cache.stride()}: the native layer "
                             f"needs one layout with dense heads")
        B, T, _ = x.shape
        c, s = cos[:, 0], sin[:, 0]  # [B, T, hd]
        if c.stride(-1) != 1 or s.stride() != c.stride():
            c, s = c.contiguous(), s.contiguous()
        q = torch.empty(B, self.heads, T, self.head_dim, dtype=torch.bfloat16)
        self._pre(self.ref, x.data_ptr(), B, T, c.data_ptr(), s.data_ptr(), c.stride(0), c.stride(1),
                  k_cache.data_ptr(), v_cache.data_ptr(), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
                  slots.data_ptr(), rows.data_ptr(), q.data_ptr(), torch.get_num_threads())
        return q

    def post(self, o: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """o [B, heads, T, hd] (each head's values dense), x [B, T, H] dense -> the layer's output [B, T, H]."""
        if o.stride(-1) != 1:
            o = o.contiguous()
        out = torch.empty_like(x)
        B, T, _ = x.shape
        self._post(self.ref, o.data_ptr(), o.stride(0), o.stride(1), o.stride(2), x.data_ptr(), out.data_ptr(), B, T,
                   torch.get_num_threads())
        return out


def _native_weight(w, bias) -> bool:
    """A projection that layer.c can run: prepacked bf16 on verispec's kernel (its bias inside), or
    int8 / int4 on theirs (a bias in bf16, added after)."""
    if isinstance(w, PrepackedWeight):
        return w.native is not None and bias is None and w.shape[1] % 2 == 0
    if isinstance(w, PackedWeight):
        return (w.native is not None and w.dense is None and w.dtype == torch.bfloat16
                and (bias is None or (bias.dtype == torch.bfloat16 and bias.dim() == 1)))
    return False


_SPECS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # layer -> _Built


class _Built:
    """A layer's native form and the objects it was built from. `fresh` compares them by identity
    through the modules' own dicts (nn.Module's attribute lookup would cost more than the check)."""

    def __init__(self, layer):
        self.parts = _parts(layer)
        self.native = NativeLayer.build(layer)

    def fresh(self, layer) -> bool:
        return all(a is b for a, b in zip(_parts(layer), self.parts))


def _parts(layer) -> list:
    modules = layer._modules
    attn, mlp = modules["self_attn"], modules["mlp"]
    a, m = attn.__dict__, mlp.__dict__
    norms = [modules[n] for n in modules if n.endswith("layernorm")] + [attn._modules[n] for n in ("q_norm", "k_norm")
                                                                          if n in attn._modules]
    return [attn, mlp, a["qkv"], a["out"], m["gate_up"], m["down"], *(n._parameters["weight"] for n in norms)]


def native_for(layer) -> NativeLayer | None:
    """The layer's native form for its current weights (built on first use, and again when a
    projection or a norm's parameter is another object), or None. Kept beside the layer, not on
    it, so that the module holds no ctypes pointers."""
    built = _SPECS.get(layer)
    if built is None or not built.fresh(layer):
        built = _SPECS[layer] = _Built(layer)
    return built.native
