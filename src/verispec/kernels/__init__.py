"""Native CPU kernels: C sources compiled once per machine with the system compiler, loaded by ctypes.

The one kernel so far is `bf16_gemm.c`, the decode-sized bf16 matmul behind prepacked weights
(models/prepack.py). It is compiled with `-march=native` on first use into the verispec cache
(`$VERISPEC_CACHE/kernels`, the file named by a hash of the source, the compiler and the CPU's
flags) in well under a second, and reused after that. It links the OpenMP runtime by its soname,
`libgomp.so.1`, which is the one torch has loaded already, so both share one thread pool.

Where it cannot be had (no AVX512-BF16, no C compiler, not Linux x86-64, or VERISPEC_NATIVE=0 to
compare against the library kernels), `bf16_gemm()` is None and callers use oneDNN.
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

SOURCE = Path(__file__).with_name("bf16_gemm.c")
GROUP_ROWS = 64  # weight rows per packed group (GROUP in bf16_gemm.c)

_LOADED: dict[str, object] = {}
_WHY_NOT: list[str] = []


def bf16_gemm():
    """The compiled `verispec_bf16_gemm` function, or None (see `why_not`)."""
    if "bf16_gemm" not in _LOADED:
        _LOADED["bf16_gemm"] = _load()
    return _LOADED["bf16_gemm"]


def why_not() -> str | None:
    """Why `bf16_gemm()` is None, in words; None when it is available (or not tried yet)."""
    return _WHY_NOT[0] if _WHY_NOT else None


def _load():
    from ..preflight import cpu_has_bf16_arithmetic

    reason = None
    if os.environ.get("VERISPEC_NATIVE", "1") == "0":
        reason = "VERISPEC_NATIVE=0"
    elif sys.platform != "linux" or platform.machine() not in ("x86_64", "AMD64"):
        reason = f"native kernels are built for Linux x86-64, not {sys.platform} {platform.machine()}"
    elif not _cpu_flag("avx512_bf16"):
        reason = "the CPU has no AVX512-BF16" + (" (AMX alone is not used)" if cpu_has_bf16_arithmetic() else "")
    if reason is None:
        try:
            return _compile_and_open()
        except (OSError, subprocess.SubprocessError, RuntimeError) as e:
            reason = f"could not build {SOURCE.name}: {e}"
    _WHY_NOT[:] = [reason]
    return None


def _cpu_flag(flag: str) -> bool:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return any(ln.startswith("flags") and flag in ln.split() for ln in text.splitlines())


def _compile_and_open():
    from ..models.loading import cache_root

    cc = shutil.which(os.environ.get("CC", "cc"))
    if cc is None:
        raise RuntimeError("no C compiler (cc) on PATH")
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    flags = next((ln for ln in Path("/proc/cpuinfo").read_text().splitlines() if ln.startswith("flags")), "")
    key = hashlib.sha256("\0".join([SOURCE.read_text(), version, flags]).encode()).hexdigest()[:16]
    out = cache_root() / "kernels" / f"{SOURCE.stem}-{key}.so"
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
            part = Path(tmp) / out.name
            cmd = [cc, "-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", str(SOURCE), "-o", str(part)]
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
            if done.returncode != 0:
                raise RuntimeError(done.stderr.strip()[-500:] or f"{cc} exited with {done.returncode}")
            os.replace(part, out)  # atomic: another process never opens half a library
    fn = ctypes.CDLL(str(out)).verispec_bf16_gemm
    fn.restype = None
    fn.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int] * 4
    return fn


def pack_bf16(weight: torch.Tensor) -> torch.Tensor:
    """A bf16 weight [N, K] (K even) in the kernel's layout [ceil(N/64), K/2, 64, 2], zero rows
    padding N up to a whole group."""
    N, K = weight.shape
    groups = -(-N // GROUP_ROWS)
    w = weight.detach().contiguous()
    if groups * GROUP_ROWS != N:
        w = torch.cat([w, w.new_zeros(groups * GROUP_ROWS - N, K)])
    return w.view(groups, GROUP_ROWS, K // 2, 2).permute(0, 2, 1, 3).contiguous()


def run_bf16_gemm(fn, x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, N: int) -> torch.Tensor:
    """x [M, K] bf16 contiguous @ the packed weight -> [M, N] bf16; bias fp32 [N] or None."""
    M, K = x.shape
    y = torch.empty(M, N, dtype=torch.bfloat16)
    fn(x.data_ptr(), packed.data_ptr(), None if bias is None else bias.data_ptr(), y.data_ptr(),
       M, N, K, torch.get_num_threads())
    return y
