"""How much a quantized target changes the model: perplexity on held-out text and agreement with
the unquantized target (benchmarks/quant_quality.py writes the report).

Speculative decoding on a quantized target is lossless relative to that quantized model; whether
the quantized model is still the model you wanted is this module's question:
- teacher-forced perplexity of human-written text (ShareGPT answers, HumanEval reference
  solutions), scored only on the answer tokens;
- top-1 agreement: at each answer token, whether the quantized model's argmax equals the
  reference model's;
- greedy agreement: plain greedy continuations of the benchmark prompts, compared token by token
  (outputs identical, and the mean length of the common prefix).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..kv import KV_BLOCK, round_up


@dataclass
class Scored:
    """Teacher-forced results for one text: summed NLL of the scored tokens and their argmaxes."""

    nll: float
    tokens: int
    argmax: torch.Tensor  # [tokens] the model's top-1 prediction for each scored token


@torch.inference_mode()
def score(model, ids: list[int], start: int) -> Scored:
    """Score tokens ids[start:] given everything before them, in one forward with the numerics the
    engine decodes with (batch-invariant matmuls for bf16)."""
    if not 0 < start < len(ids):
        raise ValueError(f"need at least one context token and one scored token (start {start}, {len(ids)} ids)")
    x = torch.tensor([ids], device=model.device)
    cache = model.new_cache(1, round_up(len(ids), KV_BLOCK))
    model.set_batch_invariant(model.dtype != torch.float32)
    rows = torch.arange(start - 1, len(ids) - 1, device=model.device)[None]  # logits predicting ids[start:]
    out = model(x, cache, [0], torch.zeros(1, dtype=torch.long), logit_rows=rows,
                kv_len=round_up(len(ids), KV_BLOCK))
    logp = out.logits[0].log_softmax(-1)  # [n, V]
    target = x[0, start:]
    nll = -logp.gather(1, target[:, None]).sum().item()
    return Scored(nll, len(target), logp.argmax(-1).cpu())


def perplexity(scored: list[Scored]) -> float:
    return math.exp(sum(s.nll for s in scored) / sum(s.tokens for s in scored))


def top1_agreement(a: list[Scored], b: list[Scored]) -> float:
    same = sum(int((x.argmax == y.argmax).sum()) for x, y in zip(a, b))
    return same / sum(x.tokens for x in a)


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def greedy_agreement(ref: list[list[int]], other: list[list[int]]) -> dict:
    """Identical outputs and the mean common prefix (in tokens) of paired greedy continuations."""
    pref = [common_prefix(a, b) for a, b in zip(ref, other)]
    return {"identical": sum(a == b for a, b in zip(ref, other)), "outputs": len(ref),
            "mean_common_prefix": sum(pref) / len(pref), "mean_length": sum(map(len, ref)) / len(ref)}
