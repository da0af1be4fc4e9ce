"""bf16 decode-sized matmuls: torch's row-major `F.linear`, oneDNN's prepacked kernel and verispec's
own (kernels/bf16_gemm.c), on Gemma 3 270M's shapes, in one run; ms per call and the weight bytes
read per second.

    python benchmarks/gemm_kernels.py --out benchmarks/results/gemm

Median of --repeats timed batches of calls, the three kernels interleaved within each batch (the
machines are shared and noisy; compare columns of one run, not runs).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from verispec import kernels
from verispec.models.layers import bf16_native

SHAPES = {  # Gemma 3 270M: [N, K] of each projection of a decoder layer and the LM head
    "qkv 1280x640": (1280, 640),
    "o 640x1024": (640, 1024),
    "gate_up 4096x640": (4096, 640),
    "down 640x2048": (640, 2048),
    "LM head 262144x640": (262144, 640),
}


def time_calls(fn, calls: int) -> float:
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t0) / calls


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1,2,4,8")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    native = kernels.bf16_gemm()
    onednn_ok = torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    results = []
    g = torch.Generator().manual_seed(0)
    for name, (N, K) in SHAPES.items():
        w = (torch.randn(N, K, generator=g) * 0.05).bfloat16()
        packed = kernels.pack_bf16(w) if native else None
        onednn = torch.ops.mkldnn._reorder_linear_weight(w, 1) if onednn_ok else None
        calls = max(3, int(2e8 // (N * K * 2)))  # about 200 MB of weights per timed batch
        for M in map(int, args.rows.split(",")):
            x = torch.randn(M, K, generator=g).bfloat16()
            cands = {"row-major F.linear": lambda: F.linear(x, w)}
            if onednn is not None:
                cands["oneDNN prepacked"] = lambda: torch.ops.mkldnn._linear_pointwise(x, onednn, None, "none", [], "")
            if native:
                cands["verispec kernel"] = lambda: kernels.run_bf16_gemm(native, x, packed, None, N)
            times = {k: [] for k in cands}
            with torch.inference_mode():
                for fn in cands.values():
                    fn()  # warm-up
                for _ in range(args.repeats):
                    for k, fn in cands.items():
                        times[k].append(time_calls(fn, calls))
            row = {"shape": name, "rows": M}
            for k, ts in times.items():
                s = statistics.median(ts)
                row[k] = {"ms": s * 1e3, "gb_s": N * K * 2 / s / 1e9}
            results.append(row)
            print(json.dumps(row), file=sys.stderr, flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    config = vars(args) | {"threads": torch.get_num_threads(), "cpu": platform.processor() or platform.machine(),
                           "kernel_isa": kernels.isa(), "why_no_kernel": kernels.why_not(),
                           "cpu_bf16_arithmetic": bf16_native(), "torch": torch.__version__}
    (out / "gemm.json").write_text(json.dumps({"config": config, "results": results}, indent=2))
    cols = [k for k in ("row-major F.linear", "oneDNN prepacked", "verispec kernel") if k in results[0]]
    lines = [f"# bf16 decode matmuls ({config['threads']} threads, kernel ISA {config['kernel_isa']}, "
             f"bf16 arithmetic in hardware: {config['cpu_bf16_arithmetic']})", "",
             "`python benchmarks/gemm_kernels.py " + " ".join(sys.argv[1:]) + "`; median of "
             f"{args.repeats} batches; ms per call (GB/s of weights read).", "",
             "| shape | rows | " + " | ".join(cols) + " |", "|---|---:|" + "---:|" * len(cols)]
    for r in results:
        lines.append(f"| {r['shape']} | {r['rows']} | " + " | ".join(f"{r[c]['ms']:.3f} ({r[c]['gb_s']:.1f})" for c in cols) + " |")
    (out / "gemm.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
