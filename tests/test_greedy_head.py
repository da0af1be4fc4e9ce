"""The greedy head (models/greedy_head.py): greedy tokens from an int8 copy of the bf16 LM head are
the full head's argmax, bit for bit (ties to the smaller token included), and an engine that uses
it decodes what the full head decodes, plain and speculative."""

from __future__ import annotations

import copy

import pytest
import torch

from conftest import build_hf, ours_from_hf
from test_greedy_lossless import DRAFTERS, prompts_for, run
from verispec import kernels
from verispec.models.greedy_head import GreedyHead
from verispec.models.prepack import PrepackedWeight, can_prepack, prepack_model
from verispec.sampling import argmax

pytestmark = [
    pytest.mark.usefixtures("single_torch_thread"),
    pytest.mark.skipif(not can_prepack(torch.bfloat16, "cpu") or kernels.bf16_gemm() is None
                       or kernels.int8_gemm() is None, reason="the greedy head runs on verispec's bf16 and int8 kernels"),
]


def _head(vocab: int, width: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(vocab, width, generator=g) * 0.05).bfloat16()


def _full_argmax(pw: PrepackedWeight, x: torch.Tensor) -> torch.Tensor:
    return argmax(pw.mm(x, invariant=True).float())


def _peaked_inputs(w: torch.Tensor, n: int, seed: int, noise: float) -> torch.Tensor:
    """Rows like a trained model's final states: a head row's direction (its token's logit stands
    out) plus noise, at norm 100."""
    g = torch.Generator().manual_seed(seed)
    x = w[torch.randint(w.shape[0], (n,), generator=g)].float()
    x = x / x.norm(dim=1, keepdim=True) + noise * torch.randn(x.shape, generator=g) / x.shape[1] ** 0.5
    return (100 * x / x.norm(dim=1, keepdim=True)).bfloat16()


@pytest.mark.parametrize("noise", [0.0, 0.5, 2.0, 100.0])
def test_tokens_are_the_full_heads_argmax(noise):
    """Peaked to flat inputs (noise 100: nearly random directions, many near-ties), 1 to 8 rows a
    call: every token equals the full bf16 head's argmax, and flat inputs keep more candidates."""
    w = _head(8192, 640, 0)
    full = PrepackedWeight(w)
    gh = GreedyHead(w, full)
    x = _peaked_inputs(w, 48, 1, noise)
    want = _full_argmax(full, x)
    for m in (1, 2, 3, 8):
        got = torch.cat([gh.tokens(x[i : i + m]) for i in range(0, len(x), m)])
        assert torch.equal(got, want), f"{m} rows a call: {int((got != want).sum())} tokens differ"
    assert gh.candidates >= gh.calls  # the argmax itself is always a candidate


def test_ties_go_to_the_smaller_token():
    """Duplicate head rows give equal logits: the full head's argmax is the first of them, and so
    is the greedy head's, although the int8 copy cannot tell them apart either."""
    w = _head(4096, 640, 2)
    for a, b in ((100, 3000), (7, 4095), (2048, 2049)):
        w[b] = w[a]
    full = PrepackedWeight(w)
    gh = GreedyHead(w, full)
    x = torch.stack([w[a].float() * 400 / w[a].float().norm() for a in (3000, 4095, 2049, 100)]).bfloat16()
    want = _full_argmax(full, x)
    assert want.tolist() == [100, 7, 2048, 100]
    assert torch.equal(gh.tokens(x), want)


def test_bits_of_the_rescored_rows_are_the_full_heads():
    """The candidates are scored by the bf16 kernel on the gathered rows: each lane on its own, so
    a subset of the head gives each row the bits it has among all of them (what makes the argmax
    exact, rounding ties included)."""
    w = _head(3000, 640, 3)
    x = torch.randn(5, 640, generator=torch.Generator().manual_seed(4)).bfloat16()
    full = PrepackedWeight(w).mm(x, invariant=True)
    rows = torch.tensor([2999, 0, 1234, 64, 65, 127, 128, 1])
    sub = kernels.run_bf16_gemm(kernels.bf16_gemm(), x.contiguous(), kernels.pack_bf16(w[rows]), None, len(rows))
    assert torch.equal(sub, full[:, rows])


def test_non_finite_input_and_small_heads_take_the_full_head():
    w = _head(4096, 640, 5)
    gh = GreedyHead(w, PrepackedWeight(w))
    x = torch.zeros(2, 640, dtype=torch.bfloat16)
    x[1, 3] = float("inf")
    assert gh.tokens(x) is None
    assert GreedyHead.build(w, PrepackedWeight(w)) is None, "a 5 MB head is not worth a shortcut"


def test_a_model_with_capped_logits_keeps_the_full_head():
    """tanh capping can map two logits to one value: the argmax of capped logits is not the
    argmax of the bounded ones, so `greedy_tokens` declines."""
    model = prepack_model(ours_from_hf(build_hf("gemma3")).to(torch.bfloat16).fuse())
    assert model.config.final_logit_softcap is not None
    model.greedy_head = GreedyHead(model.head_weight(), model.packed_head)
    assert model.greedy_tokens(torch.ones(1, model.config.hidden_size, dtype=torch.bfloat16)) is None


@pytest.mark.parametrize("family", ["llama", "qwen3"])
@pytest.mark.parametrize("drafter", [None, "ngram", "layerskip"])
def test_an_engine_with_the_greedy_head_decodes_what_the_full_head_does(family, drafter):
    """Blocked weights, plain and speculative, a batch of 3 and a queue: the same tokens with the
    greedy head (forced on every row count) as without it, and the head was used. (The tiny Gemma 3
    config caps its logits, where the model keeps the full head; the real Gemma 3 270M does not.)"""
    dense = ours_from_hf(build_hf(family)).to(torch.bfloat16)
    target = prepack_model(copy.deepcopy(dense).fuse())
    target.greedy_head = None
    prompts = prompts_for(target.config.vocab_size)
    want, _ = run(target, DRAFTERS[drafter] if drafter else None, prompts, k=4)
    target.greedy_head = GreedyHead(target.head_weight(), target.packed_head, max_rows=64)
    got, _ = run(target, DRAFTERS[drafter] if drafter else None, prompts, k=4)
    assert got == want
    assert target.greedy_head.calls > 0, "the greedy head was not used: the check would be vacuous"


def test_the_row_count_is_timed_once_per_machine(tmp_path, monkeypatch):
    """`build` times the rows where the greedy head pays once and caches them, so that every
    process on the machine (a server's plain and speculative engines, the cost profile) takes the
    same path."""
    from verispec.models import greedy_head

    monkeypatch.setenv("VERISPEC_CACHE", str(tmp_path))
    monkeypatch.setattr(greedy_head, "MIN_BYTES", 0)
    monkeypatch.setattr(GreedyHead, "_time_rows", lambda self: 3)
    w = _head(4096, 640, 6)
    assert GreedyHead.build(w, PrepackedWeight(w)).max_rows == 3
    assert list((tmp_path / "greedy_head").glob("*.json")), "the timed row count is cached"

    def timed_again(self):
        raise AssertionError("timed again although cached")

    monkeypatch.setattr(GreedyHead, "_time_rows", timed_again)
    assert GreedyHead.build(w, PrepackedWeight(w)).max_rows == 3


@pytest.mark.parametrize("scale", [1e-3, 1.0, 1e3])
def test_tokens_hold_at_any_input_scale(scale):
    """Random directions at tiny to huge norms (the bound scales with ||x|| and |a|; flat rows
    leave more than the top 256 in play and search the whole row): the full head's argmax."""
    w = _head(8192, 640, 7)
    full = PrepackedWeight(w)
    gh = GreedyHead(w, full)
    x = (torch.randn(64, 640, generator=torch.Generator().manual_seed(8)) * scale).bfloat16()
    want = _full_argmax(full, x)
    got = torch.cat([gh.tokens(x[i : i + 4]) for i in range(0, len(x), 4)])
    assert torch.equal(got, want), f"{int((got != want).sum())} tokens differ"
