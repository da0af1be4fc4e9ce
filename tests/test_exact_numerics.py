"""Exact mode rests on batch-invariant matmuls: a row's result must not depend on its batch."""

from __future__ import annotations

import pytest
import torch

from verispec.models.model import linear


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", [(32, 64), (96, 64), (640, 1024), (4096, 640), (640, 2048)])
def test_invariant_linear_is_row_and_batch_invariant(dtype, shape):
    """Up to prefill-sized row counts: bf16 GEMM rows stop matching one-row results past ~78 rows
    when K = 2048 (Gemma 3 270M's down projection) unless the rows go in fixed-size blocks."""
    g = torch.Generator().manual_seed(0)
    W = torch.randn(*shape, generator=g).to(dtype)
    X = torch.randn(300, shape[1], generator=g).to(dtype)
    one_by_one = torch.cat([linear(X[i : i + 1], W, invariant=True) for i in range(300)])
    for M in (2, 3, 6, 17, 24, 64, 65, 79, 80, 130, 300):
        y = linear(X[:M], W, invariant=True)
        assert torch.equal(y, one_by_one[:M]), f"rows differ for a batch of {M}"
    perm = torch.randperm(24, generator=g)
    assert torch.equal(linear(X[:24][perm], W, invariant=True), one_by_one[perm])


@pytest.mark.parametrize("heads", [(4, 1), (2, 2)])  # Gemma 3 270M's GQA; MHA, where one query is one row
def test_bf16_attention_rows_do_not_depend_on_query_count_batch_or_key_padding(heads):
    """bf16 attention (`grouped_attention`, head_dim 256 as Gemma 3 270M) gives a query row the same
    bits alone as in any query count up to a prefill chunk, beside other sequences of the batch, and
    over a key range padded further with masked rows (the verify window, the batch and the rounded-up
    key length of invariant mode all change these)."""
    from verispec.models.layers import attend

    h, kvh = heads
    g = torch.Generator().manual_seed(0)
    Lk, T = 1024, 256
    K = torch.randn(3, kvh, Lk, 256, generator=g).to(torch.bfloat16)
    V = torch.randn(3, kvh, Lk, 256, generator=g).to(torch.bfloat16)
    q = (torch.randn(3, h, T, 256, generator=g) / 4).to(torch.bfloat16)
    mask = (torch.arange(Lk)[None, :] <= (300 + torch.arange(T))[:, None])[None, None].expand(3, 1, T, Lk)
    alone = torch.cat([attend(q[:1, :, i : i + 1], K[:1, :, :768], V[:1, :, :768], mask[:1, :, i : i + 1, :768], 1 / 16,
                              invariant=True) for i in range(T)], 2)
    for n in (2, 3, 6, 9, 17, 40, 65, 128, 256):
        got = attend(q[:, :, :n], K, V, mask[:, :, :n], 1 / 16, invariant=True)
        assert torch.equal(got[:1], alone[:, :, :n]), n
    assert torch.equal(attend(q[:1, :, 100:106], K[:1], V[:1], mask[:1, :, 100:106], 1 / 16), alone[:, :, 100:106])
    ref = torch.nn.functional.scaled_dot_product_attention(q.float(), K.float(), V.float(), attn_mask=mask, scale=1 / 16,
                                                           enable_gqa=h != kvh)
    assert (attend(q, K, V, mask, 1 / 16).float() - ref).abs().max() < 1e-2  # and it is attention


def test_fp32_invariant_attention_rows_do_not_depend_on_the_query_count():
    """The CPU SDPA kernel gives a row other bits with the number of queries in the call; in fp32
    invariant mode (`--exact`) `attend` calls it with exactly two queries, so every row gets its
    one-query bits."""
    import torch.nn.functional as F

    from verispec.models.layers import attend

    g = torch.Generator().manual_seed(0)
    Lk, T = 512, 40
    K = torch.randn(1, 1, Lk, 256, generator=g)
    V = torch.randn(1, 1, Lk, 256, generator=g)
    q = torch.randn(1, 4, T, 256, generator=g)
    mask = (torch.arange(Lk)[None, :] <= (300 + torch.arange(T))[:, None])[None, None]  # [1, 1, T, Lk]
    alone = torch.cat([attend(q[:, :, i : i + 1], K, V, mask[:, :, i : i + 1], 1 / 16, invariant=True)
                       for i in range(T)], 2)
    for n in range(2, T + 1):
        assert torch.equal(attend(q[:, :, :n], K, V, mask[:, :, :n], 1 / 16, invariant=True), alone[:, :, :n]), n
    # the kernel itself does differ (the property above is not vacuous on this machine)
    whole = F.scaled_dot_product_attention(q, K, V, attn_mask=mask, scale=1 / 16, enable_gqa=True)
    if torch.equal(whole, alone):
        pytest.skip("this CPU's fp32 attention kernel is row-invariant at 40 queries; nothing to guard")
