"""Exact mode rests on batch-invariant matmuls: a row's result must not depend on its batch."""

from __future__ import annotations

import pytest
import torch

from verispec.models.model import linear


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", [(96, 64), (640, 1024), (4096, 640), (640, 2048)])
def test_invariant_linear_is_row_and_batch_invariant(dtype, shape):
    """Up to prefill-sized row counts: bf16 GEMM rows stop matching one-row results past ~78 rows
    when K = 2048 (Gemma 3 270M's down projection) unless the rows go in fixed-size blocks."""
    g = torch.Generator().manual_seed(0)
    W = torch.randn(*shape, generator=g).to(dtype)
    X = torch.randn(300, shape[1], generator=g).to(dtype)
    one_by_one = torch.cat([linear(X[i : i + 1], W, invariant=True) for i in range(300)])
    for M in (2, 6, 17, 24, 64, 65, 79, 80, 130, 300):
        y = linear(X[:M], W, invariant=True)
        assert torch.equal(y, one_by_one[:M]), f"rows differ for a batch of {M}"
    perm = torch.randperm(24, generator=g)
    assert torch.equal(linear(X[:24][perm], W, invariant=True), one_by_one[perm])
