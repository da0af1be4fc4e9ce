"""CPU attention kernels at Gemma 3 270M's shapes (4 query heads, 1 KV head, head_dim 256), bf16.

    python benchmarks/attention_kernels.py [--threads 2]

For decode, verify and prefill shapes it times PyTorch's SDPA (one call; and in calls of two
queries, the old invariant mode) against `grouped_attention` (two batched GEMMs), and prints the
milliseconds per call and each one's largest error against fp32 attention, as a table.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from verispec.models.layers import grouped_attention

SHAPES = [(1, 1, 512), (1, 6, 512), (1, 1, 1536), (8, 1, 512), (8, 6, 512), (64, 1, 512), (1, 256, 512)]


def timed(f, n: int) -> float:
    f()
    t = time.perf_counter()
    for _ in range(n):
        f()
    return (time.perf_counter() - t) / n * 1e3


def sdpa(q, K, V, m):
    return F.scaled_dot_product_attention(q, K, V, attn_mask=m, scale=1 / 16, enable_gqa=True)


def sdpa_pairs(q, K, V, m):
    if q.shape[2] == 1:
        return sdpa(torch.cat([q, q], 2), K, V, torch.cat([m, m], 2))[:, :, :1]
    return torch.cat([sdpa(q[:, :, i : i + 2], K, V, m[:, :, i : i + 2]) for i in range(0, q.shape[2], 2)], 2)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=None)
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    g = torch.Generator().manual_seed(0)
    print("| batch | queries | keys | SDPA ms | SDPA in pairs ms | grouped GEMMs ms | max error SDPA / grouped |")
    print("|---|---|---|---|---|---|---|")
    for B, T, Lk in SHAPES:
        q = (torch.randn(B, 4, T, 256, generator=g) / 4).bfloat16()
        K = (torch.randn(B, 1, Lk, 256, generator=g) * 2).bfloat16()
        V = torch.randn(B, 1, Lk, 256, generator=g).bfloat16()
        m = torch.ones(B, 1, T, Lk, dtype=torch.bool).tril(Lk - T)
        ref = F.scaled_dot_product_attention(q.float(), K.float(), V.float(), attn_mask=m, scale=1 / 16, enable_gqa=True)
        n = 20 if B * T >= 64 else 100
        e1 = (sdpa(q, K, V, m).float() - ref).abs().max().item()
        e2 = (grouped_attention(q, K, V, m, 1 / 16).float() - ref).abs().max().item()
        print(f"| {B} | {T} | {Lk} | {timed(lambda: sdpa(q, K, V, m), n):.2f} | {timed(lambda: sdpa_pairs(q, K, V, m), n):.2f} | "
              f"{timed(lambda: grouped_attention(q, K, V, m, 1 / 16), n):.2f} | {e1:.1e} / {e2:.1e} |", flush=True)


if __name__ == "__main__":
    main()
