"""Native CPU kernels: C sources compiled once per machine with the system compiler, loaded by ctypes.

- `bf16_gemm.c`: the decode-sized bf16 matmul behind prepacked weights (models/prepack.py), in
  AVX512-BF16, AVX512 or AVX2 + FMA instructions, whichever `-march=native` offers (`isa()`);
- `int8_gemm.c`, `int4_gemm.c`: the decode-sized matmuls behind weight-only int8 and int4
  (models/quant.py), bf16 activations, AVX512 or AVX2 + FMA (the same bits on either);
- `rms_norm.c`: RMSNorm of bf16 rows in one call (models/layers.py `RMSNorm`, at inference);
- `rope.c`: rotary embedding of bf16 q / k heads in one call, written as [B, heads, T, hd];
- `attention.c`: bf16 attention with each query row on its own (models/layers.py
  `grouped_attention`, at inference): batch-invariant by construction on any CPU;
- `layer.c`: a decoder layer on packed weights in two calls around the attention
  (models/native_layer.py), from the kernels above, and its activation times the up projection;
- `argmax.c`: each row's argmax of fp32 or bf16 logits, torch's definition (greedy decoding and
  verification);
- `amx.c`: whether Linux lends the process AMX's tile state, and the tile layout `bf16_gemm.c` uses.
The sources are compiled together with `-march=native` on first use into the verispec cache
(`$VERISPEC_CACHE/kernels`, the file named by a hash of the sources, the compiler and the CPU's
flags) in about a second, and reused after that. It links the OpenMP runtime by its soname,
`libgomp.so.1`, which is the one torch has loaded already, so both share one thread pool.

Where they cannot be had (no AVX2 and FMA, no C compiler, not Linux x86-64, or VERISPEC_NATIVE=0
to compare against the library kernels), `bf16_gemm()` and `rms_norm()` are None and callers use
torch's operators (oneDNN for prepacked matmuls where the CPU has bf16 arithmetic).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

SOURCES = sorted(Path(__file__).parent.glob("*.c"))
HEADERS = sorted(Path(__file__).parent.glob("*.h"))
GROUP_ROWS = 64  # weight rows per packed group (GROUP in bf16_gemm.c)

_LOADED: dict[str, object] = {}
_WHY_NOT: list[str] = []


def bf16_gemm():
    """The compiled `verispec_bf16_gemm` (bf16_gemm.c), or None (see `why_not`)."""
    return _function("verispec_bf16_gemm", [ctypes.c_void_p] * 4 + [ctypes.c_int] * 4)


def int8_gemm():
    """The compiled `verispec_int8_gemm` (int8_gemm.c), or None (see `why_not`)."""
    return _function("verispec_int8_gemm", [ctypes.c_void_p] * 4 + [ctypes.c_int] * 4)


def int4_gemm():
    """The compiled `verispec_int4_gemm` (int4_gemm.c), or None (see `why_not`)."""
    return _function("verispec_int4_gemm", [ctypes.c_void_p] * 5 + [ctypes.c_int] * 4)


def rms_norm():
    """The compiled `verispec_rms_norm_bf16` (rms_norm.c), or None (see `why_not`)."""
    return _function("verispec_rms_norm_bf16", [ctypes.c_void_p] * 4 + [ctypes.c_int, ctypes.c_int, ctypes.c_long,
                                                                        ctypes.c_int, ctypes.c_float, ctypes.c_int,
                                                                        ctypes.c_int])


def attention():
    """The compiled `verispec_attention_bf16` (attention.c), or None (see `why_not`)."""
    return _function("verispec_attention_bf16", [ctypes.c_void_p] * 6 + [ctypes.c_int] * 6 + [ctypes.c_long] * 8
                     + [ctypes.c_float, ctypes.c_float, ctypes.c_int])


def rope():
    """The compiled `verispec_rope_bf16` (rope.c), or None (see `why_not`)."""
    return _function("verispec_rope_bf16", [ctypes.c_void_p] + [ctypes.c_long] * 3 + [ctypes.c_void_p] * 2
                     + [ctypes.c_long] * 2 + [ctypes.c_void_p] + [ctypes.c_int] * 4)


def argmax_f32():
    """The compiled `verispec_argmax_f32` (argmax.c), or None (see `why_not`)."""
    return _function("verispec_argmax_f32", [ctypes.c_void_p, ctypes.c_long, ctypes.c_long, ctypes.c_long,
                                             ctypes.c_void_p, ctypes.c_int])


def argmax_bf16():
    """The compiled `verispec_argmax_bf16` (argmax.c), or None (see `why_not`)."""
    return _function("verispec_argmax_bf16", [ctypes.c_void_p, ctypes.c_long, ctypes.c_long, ctypes.c_long,
                                              ctypes.c_void_p, ctypes.c_int])


def act_mul():
    """The compiled `verispec_act_mul_bf16` (layer.c), or None (see `why_not`)."""
    return _function("verispec_act_mul_bf16", [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_long, ctypes.c_int,
                                               ctypes.c_int])


class LinearSpec(ctypes.Structure):
    """`vs_linear` of layer.c: one projection's packed weights (kind 0 bf16, 1 int8, 2 int4)."""
    _fields_ = [("kind", ctypes.c_int), ("N", ctypes.c_int), ("K", ctypes.c_int), ("w", ctypes.c_void_p),
                ("scale", ctypes.c_void_p), ("zero", ctypes.c_void_p), ("bias_f32", ctypes.c_void_p),
                ("bias_bf16", ctypes.c_void_p)]


class LayerSpec(ctypes.Structure):
    """`vs_layer` of layer.c: a decoder layer's shapes, norms and projections."""
    _fields_ = [("H", ctypes.c_int), ("heads", ctypes.c_int), ("kv_heads", ctypes.c_int), ("head_dim", ctypes.c_int),
                ("inter", ctypes.c_int), ("gemma", ctypes.c_int), ("act", ctypes.c_int), ("eps", ctypes.c_float),
                ("in_norm", ctypes.c_void_p), ("post_attn_norm", ctypes.c_void_p), ("pre_ff_norm", ctypes.c_void_p),
                ("post_ff_norm", ctypes.c_void_p), ("q_norm", ctypes.c_void_p), ("k_norm", ctypes.c_void_p),
                ("qkv", LinearSpec), ("o", LinearSpec), ("gate_up", LinearSpec), ("down", LinearSpec)]


ACTIVATIONS = {"silu": 0, "gelu_tanh": 1}  # ACT_SILU, ACT_GELU_TANH in layer.c


def layer_pre():
    """The compiled `verispec_layer_pre` (layer.c), or None (see `why_not`)."""
    return _function("verispec_layer_pre", [ctypes.POINTER(LayerSpec), ctypes.c_void_p, ctypes.c_int, ctypes.c_int]
                     + [ctypes.c_void_p] * 2 + [ctypes.c_long] * 2 + [ctypes.c_void_p] * 2 + [ctypes.c_long] * 3
                     + [ctypes.c_void_p] * 3 + [ctypes.c_int])


def layer_post():
    """The compiled `verispec_layer_post` (layer.c), or None (see `why_not`)."""
    return _function("verispec_layer_post", [ctypes.POINTER(LayerSpec), ctypes.c_void_p] + [ctypes.c_long] * 3
                     + [ctypes.c_void_p] * 2 + [ctypes.c_int] * 3)


def _function(name: str, argtypes: list):
    if name not in _LOADED:
        if "library" not in _LOADED:
            _LOADED["library"] = _load()
        lib = _LOADED["library"]
        fn = None
        if lib is not None:
            fn = getattr(lib, name)
            fn.restype, fn.argtypes = None, argtypes
        _LOADED[name] = fn
    return _LOADED[name]


def isa() -> str | None:
    """The instruction set the kernels were built for: "avx512-bf16", "avx512" or "avx2" (None
    when unavailable). Bits of a matmul differ between them, never between calls on one."""
    fn = _function("verispec_kernel_isa", [])
    if fn is None:
        return None
    fn.restype = ctypes.c_char_p
    return fn().decode()


def cpu_name() -> str:
    """The CPU's model name from /proc/cpuinfo (else what `platform` says): what the timings cached
    per machine (cost profiles, the greedy head's row count) and the reports name."""
    try:
        with open("/proc/cpuinfo") as f:
            name = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), None)
        if name:
            return name
    except OSError:
        pass
    return platform.processor() or platform.machine()


def source_hash() -> str:
    """A short hash of the kernels' C sources: what their speed depends on, besides the machine
    (the adaptive policy's cost profiles are cached under it)."""
    return hashlib.sha256("\0".join(p.read_text() for p in SOURCES + HEADERS).encode()).hexdigest()[:16]


def why_not() -> str | None:
    """Why `bf16_gemm()` is None, in words; None when it is available (or not tried yet)."""
    return _WHY_NOT[0] if _WHY_NOT else None


def _load():
    reason = None
    if os.environ.get("VERISPEC_NATIVE", "1") == "0":
        reason = "VERISPEC_NATIVE=0"
    elif sys.platform != "linux" or platform.machine() not in ("x86_64", "AMD64"):
        reason = f"native kernels are built for Linux x86-64, not {sys.platform} {platform.machine()}"
    elif not (_cpu_flag("avx2") and _cpu_flag("fma")):
        reason = "the CPU has no AVX2 and FMA"
    if reason is None:
        try:
            return _compile_and_open()
        except (OSError, subprocess.SubprocessError, RuntimeError) as e:
            reason = f"could not build {', '.join(p.name for p in SOURCES)}: {e}"
    _WHY_NOT[:] = [reason]
    return None


def _cpu_flag(flag: str) -> bool:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return any(ln.startswith("flags") and flag in ln.split() for ln in text.splitlines())


def _compile_and_open(extra_flags: tuple[str, ...] = ()):
    """The library built for this CPU (`-march=native`, then `extra_flags`: the tests build the
    narrower instruction sets with e.g. -mno-avx512f), compiled on first use."""
    from ..models.loading import cache_root

    cc = shutil.which(os.environ.get("CC", "cc"))
    if cc is None:
        raise RuntimeError("no C compiler (cc) on PATH")
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    flags = next((ln for ln in Path("/proc/cpuinfo").read_text().splitlines() if ln.startswith("flags")), "")
    key = hashlib.sha256("\0".join([*(p.read_text() for p in SOURCES + HEADERS), version, flags, *extra_flags]).encode()).hexdigest()[:16]
    out = cache_root() / "kernels" / f"verispec-{key}.so"
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
            part = Path(tmp) / out.name
            cmd = [cc, "-O3", "-march=native", *extra_flags, "-fopenmp", "-shared", "-fPIC", *map(str, SOURCES),
                   "-o", str(part), "-lm"]
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
            if done.returncode != 0:
                raise RuntimeError(done.stderr.strip()[-500:] or f"{cc} exited with {done.returncode}")
            os.replace(part, out)  # atomic: another process never opens half a library
    return ctypes.CDLL(str(out))


def pack_bf16(weight: torch.Tensor) -> torch.Tensor:
    """A bf16 weight [N, K] in the kernel's layout [ceil(N/64), ceil(K/2), 64, 2], zero rows padding
    N up to a whole group and a zero column padding an odd K (the kernel reads column pairs)."""
    N, K = weight.shape
    groups = -(-N // GROUP_ROWS)
    w = torch.nn.functional.pad(weight.detach(), (0, K % 2, 0, groups * GROUP_ROWS - N))
    return w.view(groups, GROUP_ROWS, w.shape[1] // 2, 2).permute(0, 2, 1, 3).contiguous()


def run_bf16_gemm(fn, x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, N: int) -> torch.Tensor:
    """x [M, K] bf16 contiguous @ the packed weight -> [M, N] bf16; bias fp32 [N] or None."""
    M, K = x.shape
    if K % 2:  # the zero column the weight was padded with, times zero: the sums are unchanged
        x, K = torch.nn.functional.pad(x, (0, 1)), K + 1
    y = torch.empty(M, N, dtype=torch.bfloat16)
    fn(x.data_ptr(), packed.data_ptr(), None if bias is None else bias.data_ptr(), y.data_ptr(),
       M, N, K, torch.get_num_threads())
    return y


def pack_int8(q: torch.Tensor) -> torch.Tensor:
    """int8 codes [N, K] in the kernel's layout [ceil(N/64), K, 64], zero rows padding N up to a
    whole group."""
    N, K = q.shape
    groups = -(-N // GROUP_ROWS)
    w = torch.nn.functional.pad(q.detach(), (0, 0, 0, groups * GROUP_ROWS - N))
    return w.view(groups, GROUP_ROWS, K).transpose(1, 2).contiguous()


def unpack_int8(packed: torch.Tensor, N: int) -> torch.Tensor:
    """The codes [N, K] back from `pack_int8`'s layout."""
    return packed.transpose(1, 2).reshape(-1, packed.shape[1])[:N]


def run_int8_gemm(fn, x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, N: int) -> torch.Tensor:
    """x [M, K] bf16 contiguous @ (codes * scale[n]).T -> [M, N] bf16; scale bf16 [N]."""
    M, K = x.shape
    y = torch.empty(M, N, dtype=torch.bfloat16)
    fn(x.data_ptr(), packed.data_ptr(), scale.data_ptr(), y.data_ptr(), M, N, K, torch.get_num_threads())
    return y


INT4_GROUP = 32  # input columns per scale and zero (QGROUP in int4_gemm.c)


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """int4 codes [N, K] (uint8, 0..15) in the kernel's layout [ceil(N/64), K, 32] uint8: byte j of
    a group's column k holds row j (low nibble) and row j + 32 (high); zero rows pad N."""
    N, K = q.shape
    groups = -(-N // GROUP_ROWS)
    w = torch.nn.functional.pad(q.detach().to(torch.uint8), (0, 0, 0, groups * GROUP_ROWS - N))
    w = w.view(groups, GROUP_ROWS, K).transpose(1, 2)  # [groups, K, 64]
    half = GROUP_ROWS // 2
    return (w[..., :half] | (w[..., half:] << 4)).contiguous()


def unpack_int4(packed: torch.Tensor, N: int) -> torch.Tensor:
    """The codes [N, K] back from `pack_int4`'s layout."""
    w = torch.cat([packed & 15, packed >> 4], -1)  # [groups, K, 64]
    return w.transpose(1, 2).reshape(-1, packed.shape[1])[:N]


def pack_int4_groups(t: torch.Tensor) -> torch.Tensor:
    """Per-group scales or zeros [N, K / 32] bf16 in the kernel's layout [ceil(N/64), K / 32, 64]."""
    N, G = t.shape
    groups = -(-N // GROUP_ROWS)
    t = torch.nn.functional.pad(t.detach().to(torch.bfloat16), (0, 0, 0, groups * GROUP_ROWS - N))
    return t.view(groups, GROUP_ROWS, G).transpose(1, 2).contiguous()


def run_int4_gemm(fn, x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                  N: int) -> torch.Tensor:
    """x [M, K] bf16 contiguous @ ((codes - 8) * scale + zero).T -> [M, N] bf16 (int4_gemm.c)."""
    M, K = x.shape
    if K % INT4_GROUP or packed.shape[1] != K:
        raise ValueError(f"int4 weights of {packed.shape[1]} columns (a multiple of {INT4_GROUP}) against x [{M}, {K}]")
    y = torch.empty(M, N, dtype=torch.bfloat16)
    fn(x.data_ptr(), packed.data_ptr(), scales.data_ptr(), zeros.data_ptr(), y.data_ptr(), M, N, K,
       torch.get_num_threads())
    return y


def run_rms_norm(fn, x: torch.Tensor, scale: torch.Tensor, eps: float, gemma: bool,
                 residual: torch.Tensor | None = None) -> torch.Tensor:
    """RMSNorm over the last dim of bf16 x [..., D] -> dense bf16 [..., D] (rms_norm.c), plus
    `residual` (dense, same shape) when given; scale: fp32 [D], (1 + w) for Gemma, w otherwise.
    x may be a strided view whose last two dims are dense (a head split of a fused projection):
    it is read as groups of dense rows, without a copy."""
    D = x.shape[-1]
    v = x.reshape(-1, x.shape[-2] if x.dim() > 1 else 1, D)  # [groups, per, D], a view where it can be
    if v.stride(2) != 1 or (v.shape[1] > 1 and v.stride(1) != D):
        v = v.contiguous()
    y = torch.empty(x.shape, dtype=torch.bfloat16)
    fn(v.data_ptr(), scale.data_ptr(), None if residual is None else residual.data_ptr(), y.data_ptr(),
       v.shape[0], v.shape[1], v.stride(0), D, eps, int(gemma), torch.get_num_threads())
    return y


def run_attention(fn, q: torch.Tensor, K: torch.Tensor, V: torch.Tensor, mask: torch.Tensor, scale: float,
                  softcap: float | None, slots: torch.Tensor | None = None) -> torch.Tensor:
    """q [B, h, T, hd], K/V [B, kvh, Lk, hd], mask [B, 1, T, Lk] bool -> [B, h, T, hd], all bf16 but the
    mask (attention.c). K and V are read through their strides (the cache's views), as long as each
    key's hd values are dense; the mask may be broadcast over the batch or the queries. With `slots`
    [B] (long), K and V are [S, kvh, Lk, hd] and batch entry b reads entry slots[b] in place."""
    B, h, T, hd = q.shape
    kvh, Lk = K.shape[1], K.shape[2]
    q = q.contiguous()
    K, V = (t if t.stride(-1) == 1 else t.contiguous() for t in (K, V))
    m = mask.expand(B, 1, T, Lk)[:, 0]
    if m.stride(-1) != 1:
        m = m.contiguous()
    m = m.view(torch.uint8)
    if slots is not None:
        slots = slots.to(torch.int64).contiguous()
        if slots.shape != (B,) or not 0 <= int(slots.min()) <= int(slots.max()) < K.shape[0] or V.shape[0] != K.shape[0]:
            raise ValueError(f"slots {tuple(slots.shape)} must index the {K.shape[0]} K/V entries once per batch entry ({B})")
    elif K.shape[0] != B or V.shape[0] != B:
        K, V = K.expand(B, -1, -1, -1), V.expand(B, -1, -1, -1)
    out = torch.empty(B, h, T, hd, dtype=torch.bfloat16)
    fn(q.data_ptr(), K.data_ptr(), V.data_ptr(), m.data_ptr(), None if slots is None else slots.data_ptr(),
       out.data_ptr(), B, h, kvh, T, Lk, hd,
       K.stride(0), K.stride(1), K.stride(2), V.stride(0), V.stride(1), V.stride(2), m.stride(0), m.stride(1),
       scale, softcap or 0.0, torch.get_num_threads())
    return out


def run_rope(fn, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, T, H, hd] bf16 (a head split of a projection: any strides, heads dense), cos/sin
    [B, 1, T, hd] bf16 -> rotated, dense [B, H, T, hd] (rope.c)."""
    B, T, H, hd = x.shape
    if x.stride(-1) != 1:
        x = x.contiguous()
    c, s = cos[:, 0], sin[:, 0]  # [B, T, hd]
    if c.stride(-1) != 1 or s.stride() != c.stride():
        c, s = c.contiguous(), s.contiguous()
    out = torch.empty(B, H, T, hd, dtype=torch.bfloat16)
    fn(x.data_ptr(), x.stride(0), x.stride(1), x.stride(2), c.data_ptr(), s.data_ptr(), c.stride(0), c.stride(1),
       out.data_ptr(), B, T, H, hd)
    return out


def run_argmax(fn, x: torch.Tensor) -> torch.Tensor:
    """The first index of each row's largest value, x [R, V] (fp32 for `argmax_f32`, bf16 for
    `argmax_bf16`; rows dense) -> [R] int64, as torch.argmax(x, -1) gives it, NaN counted largest
    (argmax.c)."""
    R, V = x.shape
    if x.stride(-1) != 1:
        x = x.contiguous()
    out = torch.empty(R, dtype=torch.int64)
    fn(x.data_ptr(), R, V, x.stride(0), out.data_ptr(), torch.get_num_threads())
    return out


def run_act_mul(fn, gu: torch.Tensor, activation: str) -> torch.Tensor:
    """act(g) * u for gu [..., 2I] = [g | u] bf16 -> [..., I] bf16 (layer.c), each rounded as torch rounds."""
    gu = gu.contiguous()
    I = gu.shape[-1] // 2
    out = torch.empty(*gu.shape[:-1], I, dtype=torch.bfloat16)
    fn(gu.data_ptr(), out.data_ptr(), gu.numel() // (2 * I), I, ACTIVATIONS[activation])
    return out
