"""Where the time of one plain decode step goes, per precision (torch profiler, batch 1).

    python benchmarks/step_breakdown.py --quant none,int8,int4 --tokens 32 --out benchmarks/results/quant
    python benchmarks/step_breakdown.py --quant none,int8,int4 --layers native,python --out DIR   # native layers or not
    python benchmarks/step_breakdown.py --quant dense,onednn,none --out benchmarks/results/native   # bf16 layouts

bf16 rows: `dense` is the row-major layout, `onednn` prepacked for oneDNN's kernels, `none` the
default (prepacked for verispec's own kernel where it builds, verispec/kernels).

Decodes --tokens tokens of the quick-start prompt once untimed, then under the profiler, and
groups the operators' self CPU time per decode step into: projections (the matmul kernels of
q/k/v, o, gate/up, down), LM head (the matmul of the one [N = vocab] weight), attention, and
everything else (norms, RoPE, activations, KV writes, casts, indexing: one small op after
another). Also prints the weight bytes a step reads and the wall time per step without the
profiler, against the bytes / (measured read bandwidth) bound. Writes breakdown.json/.md.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from verispec import kernels
from verispec.engine import DTYPES, Engine, EngineConfig
from verispec.models import load_model, load_tokenizer
try:
    from verispec.models.quant import weight_bytes
except ImportError:  # a verispec from before quantization (PYTHONPATH=an older checkout, for "before" numbers)
    def weight_bytes(model) -> int:
        return sum(p.nbytes for n, p in model.named_parameters() if "norm" not in n and "embed" not in n) \
            + model.head_weight().nbytes
from verispec.sampling import SamplingParams
from verispec.threads import setup_threads

NATIVE_OP = "verispec::bf16_gemm"  # verispec's matmul kernels (bf16, int8, int4): ctypes calls the profiler cannot see, labelled
MATMUL_OPS = {"aten::mm", "aten::mv", "aten::addmm", "aten::matmul", "aten::_weight_int8pack_mm",
              "aten::_weight_int4pack_mm_for_cpu", "aten::linear",
              "mkldnn::_linear_pointwise", NATIVE_OP, NATIVE_OP + " (LM head)"}
ATTENTION_OPS = {"aten::_scaled_dot_product_flash_attention_for_cpu", "aten::_scaled_dot_product_flash_attention",
                 "aten::bmm",  # models/layers.py: attention as two batched GEMMs (q K^T, then @ V)
                 "verispec::attention"}  # or as kernels/attention.c: a ctypes call, labelled
NORM_OP = "verispec::rms_norm"  # likewise
LAYER_OP = "verispec::layer"  # a native layer's calls around the attention (models/native_layer.py), likewise
try:
    from verispec.models.layers import DecoderLayer
    from verispec.models.native_layer import NativeLayer
except ImportError:  # a verispec from before native layers
    DecoderLayer = NativeLayer = None


def read_bandwidth(mb: int = 512, repeats: int = 5) -> float:
    """GB/s of summing a large fp32 tensor (all threads): how fast this machine streams weights in."""
    x = torch.ones(mb * 2**20 // 4)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - t0)
    return x.numel() * 4 / best / 1e9


def decode(model, tok, prompt: str, tokens: int):
    eng = Engine(model, tok, EngineConfig(model="unused", drafter=None, draft_policy="fixed", num_draft_tokens=0,
                                          max_batch_size=1, max_model_len=256))
    seq = eng.add_request(tok(prompt).input_ids, SamplingParams(max_tokens=tokens, ignore_eos=True))
    eng.step()  # prefill (and the first token)
    t0 = time.perf_counter()
    steps = 0
    while eng.has_work:
        eng.step()
        steps += 1
    return seq, (time.perf_counter() - t0) / steps, steps


def breakdown(model, tok, prompt: str, tokens: int) -> dict:
    decode(model, tok, prompt, 8)  # warm-up
    walls = [decode(model, tok, prompt, tokens)[1] for _ in range(3)]
    head_n = model.config.vocab_size
    native = kernels.run_bf16_gemm

    def labelled(fn, x, packed, bias, N):
        with torch.profiler.record_function(NATIVE_OP + (" (LM head)" if N == head_n else "")):
            return native(fn, x, packed, bias, N)

    native_int8 = getattr(kernels, "run_int8_gemm", None)  # absent in a checkout from before the int8 kernel

    def labelled_int8(fn, x, packed, scale, N):
        with torch.profiler.record_function(NATIVE_OP + (" (LM head)" if N == head_n else "")):
            return native_int8(fn, x, packed, scale, N)

    native_int4 = getattr(kernels, "run_int4_gemm", None)

    def labelled_int4(fn, x, packed, scales, zeros, N):
        with torch.profiler.record_function(NATIVE_OP + (" (LM head)" if N == head_n else "")):
            return native_int4(fn, x, packed, scales, zeros, N)

    norm = kernels.run_rms_norm

    def labelled_norm(*a, **kw):
        with torch.profiler.record_function(NORM_OP):
            return norm(*a, **kw)

    attention = kernels.run_attention

    def labelled_attention(*a, **kw):
        with torch.profiler.record_function("verispec::attention"):
            return attention(*a, **kw)

    kernels.run_bf16_gemm, kernels.run_rms_norm, kernels.run_attention = labelled, labelled_norm, labelled_attention
    kernels.run_int8_gemm, kernels.run_int4_gemm = labelled_int8, labelled_int4
    halves = {}
    if NativeLayer is not None:  # a native layer's two calls (kernels/layer.c): its projections, norms, RoPE, ...
        for half in ("pre", "post"):
            halves[half] = getattr(NativeLayer, half)

            def labelled_half(self, *a, _f=halves[half]):
                with torch.profiler.record_function(LAYER_OP):
                    return _f(self, *a)

            setattr(NativeLayer, half, labelled_half)
    try:
        with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
            _, _, steps = decode(model, tok, prompt, tokens)
    finally:
        kernels.run_bf16_gemm, kernels.run_rms_norm, kernels.run_attention = native, norm, attention
        kernels.run_int8_gemm, kernels.run_int4_gemm = native_int8, native_int4
        for half, f in halves.items():
            setattr(NativeLayer, half, f)
    groups = defaultdict(float)
    for ev in prof.key_averages(group_by_input_shape=True):
        us = ev.self_cpu_time_total
        shapes = str(ev.input_shapes)
        if ev.key in MATMUL_OPS:
            groups["LM head" if str(head_n) in shapes or "LM head" in ev.key else "projections"] += us
        elif ev.key in ATTENTION_OPS:
            groups["attention"] += us
        elif ev.key == NORM_OP:
            groups["norms"] += us
        elif ev.key == LAYER_OP:
            groups["native layers"] += us
        else:
            groups["everything else"] += us
    # the prefill step ran before the profiler; every profiled step is a one-token decode step
    per_step = {k: v / 1e3 / steps for k, v in groups.items()}
    return {"wall_ms_per_step": sorted(walls)[1] * 1e3, "profiled_ms_per_step": per_step,
            "weight_bytes": weight_bytes(model), "prepacked": model.prepacked}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="gemma3-270m")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--quant", default="none,int8,int4")
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--prompt", default="def fibonacci(n):")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--layers", default="native", help="native,python: also each precision with the Python layers")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    threads = setup_threads(args.threads)
    tok = load_tokenizer(args.model)
    bw = read_bandwidth()
    rows = {}
    for q in args.quant.split(","):
        # "dense": bf16 in the row-major layout; "onednn": prepacked for oneDNN (models/prepack.py)
        native = kernels.bf16_gemm()
        if q == "onednn":
            kernels._LOADED["verispec_bf16_gemm"] = None  # what kernels.bf16_gemm() returns
        try:
            model = load_model(args.model, DTYPES[args.dtype], **({"prepack": False} if q == "dense" else
                                                                   {} if q in ("none", "onednn") else {"quant": q}))
        finally:
            kernels._LOADED["verispec_bf16_gemm"] = native
        for layers in args.layers.split(","):
            name = q if layers == "native" else f"{q}, python layers"
            native_layer = DecoderLayer.native if DecoderLayer is not None else None
            if layers == "python" and DecoderLayer is not None:
                DecoderLayer.native = lambda self: None
            try:
                rows[name] = breakdown(model, tok, args.prompt, args.tokens)
            finally:
                if DecoderLayer is not None:
                    DecoderLayer.native = native_layer
            rows[name]["kernel"] = ("verispec" if model.packed_head.native is not None else "oneDNN") if model.prepacked else None
            rows[name]["quant"], rows[name]["layers"] = q, layers
            print(f"[breakdown] {name}: {rows[name]}", file=sys.stderr, flush=True)
        del model
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "breakdown.json").write_text(json.dumps({"config": vars(args) | {"threads": threads},
                                                    "read_bandwidth_gb_s": bw, "rows": rows}, indent=2))
    cats = ["native layers", "projections", "LM head", "attention", "norms", "everything else"]
    md = [f"# One plain decode step of {args.model} at batch 1 ({threads} threads)", "",
          f"`python benchmarks/step_breakdown.py --quant {args.quant} --layers {args.layers} --tokens {args.tokens} "
          f"--out {args.out}`; "
          f"read bandwidth {bw:.1f} GB/s (summing a 512 MiB fp32 tensor).", "",
          "| weights | MB read per step | bound (MB / bandwidth) | wall ms/step | tok/s | "
          + " | ".join(f"{c} ms" for c in cats) + " |", "|---" * (5 + len(cats)) + "|"]
    for q, r in rows.items():
        mb = r["weight_bytes"] / 1e6
        bound_ms = r["weight_bytes"] / (bw * 1e9) * 1e3
        p = r["profiled_ms_per_step"]
        packed = f" (prepacked, {r['kernel']} kernel)" if r["prepacked"] else ""
        q_name = r.get("quant", q)
        name = {"none": args.dtype + packed, "onednn": args.dtype + packed,
                "dense": args.dtype + " (row-major)"}.get(q_name, q_name) + (", Python layers" if r.get("layers") == "python" else "")
        md.append(f"| {name} | {mb:.0f} | {bound_ms:.1f} ms ({1e3 / bound_ms:.0f} tok/s) | "
                  f"{r['wall_ms_per_step']:.1f} | {1e3 / r['wall_ms_per_step']:.1f} | "
                  + " | ".join(f"{p.get(c, 0):.1f}" for c in cats) + " |")
    md += ["", "Profiled times are self CPU time per step under the profiler (it adds its own overhead to "
               "every op, so the small ops look larger than they are); wall time is the median of 3 runs without it. "
               "'native layers' is the two native calls of each decoder layer (kernels/layer.c: its projections, "
               "norms, RoPE, KV writes and activation); with Python layers those are the other columns."]
    (out / "breakdown.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    sys.exit(main())
