"""What a matmul costs by the number of rows it multiplies: Gemma 3 270M's LM head (262,144 x 640)
on verispec's bf16, int8 and int4 kernels, at 1 to 64 rows (a decode step, a verify step of k + 1
rows, a batch), against the kernels of an earlier commit built from its sources, interleaved.

    python benchmarks/kernel_rows.py --ref 56bc2b5 --out benchmarks/results/kernel-rows

A verify step of 6 rows or a batch of 16 requests should cost about what one row costs: the
weights are read once either way. Where a kernel's arithmetic, not the reads, sets the time, more
rows cost more. Median of --repeats calls, the two builds alternating.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from verispec import kernels

ROOT = Path(__file__).resolve().parents[1]
KERNELS = "src/verispec/kernels"


def build_at(ref: str, tmp: Path) -> ctypes.CDLL:
    """The kernels' library from the sources at git commit `ref`, built as verispec builds its own."""
    names = subprocess.run(["git", "-C", str(ROOT), "ls-tree", "--name-only", f"{ref}:{KERNELS}"],
                           capture_output=True, text=True, check=True).stdout.split()
    for name in names:
        if name.endswith((".c", ".h")):
            src = subprocess.run(["git", "-C", str(ROOT), "show", f"{ref}:{KERNELS}/{name}"], capture_output=True,
                                 check=True).stdout
            (tmp / name).write_bytes(src)
    out = tmp / "ref.so"
    subprocess.run(["cc", "-O3", "-march=native", "-fopenmp", "-shared", "-fPIC",
                    *sorted(str(p) for p in tmp.glob("*.c")), "-o", str(out), "-lm"], check=True)
    return ctypes.CDLL(str(out))


def functions(lib) -> dict:
    sig = {"verispec_bf16_gemm": [ctypes.c_void_p] * 4 + [ctypes.c_int] * 4,
           "verispec_int8_gemm": [ctypes.c_void_p] * 4 + [ctypes.c_int] * 4,
           "verispec_int4_gemm": [ctypes.c_void_p] * 5 + [ctypes.c_int] * 4}
    out = {}
    for name, args in sig.items():
        f = getattr(lib, name)
        f.restype, f.argtypes = None, args
        out[name] = f
    isa = lib.verispec_kernel_isa
    isa.restype = ctypes.c_char_p
    out["isa"] = isa().decode()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ref", required=True, help="the git commit whose kernels to compare with")
    ap.add_argument("--rows", default="1,2,4,6,8,16,32,64")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    torch.set_num_threads(2)
    g = torch.Generator().manual_seed(0)
    N, K = 262_144, 640
    w = (torch.randn(N, K, generator=g) * 0.05).bfloat16()
    q8, s8 = torch.randint(-127, 128, (N, K), dtype=torch.int8, generator=g), torch.rand(N, generator=g).bfloat16()
    q4 = torch.randint(0, 16, (N, K), dtype=torch.uint8, generator=g)
    s4, z4 = (kernels.pack_int4_groups(torch.rand(N, K // 32, generator=g).bfloat16()) for _ in range(2))
    packed = {"bf16": (kernels.pack_bf16(w),), "int8": (kernels.pack_int8(q8), s8), "int4": (kernels.pack_int4(q4), s4, z4)}
    runners = {"bf16": kernels.run_bf16_gemm, "int8": kernels.run_int8_gemm, "int4": kernels.run_int4_gemm}
    with tempfile.TemporaryDirectory() as tmp:
        builds = {"this": functions(kernels._LOADED["library"] if kernels.bf16_gemm() else None),
                  args.ref: functions(build_at(args.ref, Path(tmp)))}
        results = []
        for kind in ("bf16", "int8", "int4"):
            for M in map(int, args.rows.split(",")):
                x = torch.randn(M, K, generator=g).bfloat16()
                times = {b: [] for b in builds}
                for _ in range(args.repeats):
                    for b, fns in builds.items():
                        fn = fns[f"verispec_{kind}_gemm"]
                        extra = (None,) if kind == "bf16" else ()
                        t0 = time.perf_counter()
                        runners[kind](fn, x, *packed[kind], *extra, N)
                        times[b].append(time.perf_counter() - t0)
                row = {"kind": kind, "rows": M, **{b: statistics.median(t) * 1e3 for b, t in times.items()}}
                results.append(row)
                print(row, file=sys.stderr, flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    isas = {b: fns["isa"] for b, fns in builds.items()}
    (out / "kernel_rows.json").write_text(json.dumps({"config": vars(args), "isa": isas, "results": results}, indent=1))
    rows = sorted({r["rows"] for r in results})
    md = [f"# The LM head (262144 x 640) by rows, ms per call (median of {args.repeats}, builds alternating)", "",
          f"`python benchmarks/kernel_rows.py --ref {args.ref} --out {args.out}`; this build: {isas['this']}, "
          f"{args.ref}: {isas[args.ref]}", "",
          "| kernel | build | " + " | ".join(f"{m} rows" for m in rows) + " |", "|---|---|" + "---|" * len(rows)]
    for kind in ("bf16", "int8", "int4"):
        for b in builds:
            cells = [next(r[b] for r in results if r["kind"] == kind and r["rows"] == m) for m in rows]
            md.append(f"| {kind} | {b} | " + " | ".join(f"{c:.1f}" for c in cells) + " |")
    (out / "kernel_rows.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    sys.exit(main())
