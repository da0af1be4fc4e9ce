"""Prepacked bf16 weights (models/prepack.py): the kernel computes the weight, a row's bits do not
depend on the rows beside it, a prepacked model computes what the dense one does, and speculative
decoding on it equals its own plain decoding."""

from __future__ import annotations

import copy

import pytest
import torch

from conftest import build_hf, ours_from_hf, random_ids
from test_greedy_lossless import DRAFTERS, noisy_copy, prompts_for, run
from verispec.drafters import ModelDrafter
from verispec.models.prepack import PrepackedWeight, can_prepack, prepack_model
from verispec.models.quant import quantize_model, weight_bytes

pytestmark = [
    pytest.mark.usefixtures("single_torch_thread"),
    pytest.mark.skipif(not can_prepack(torch.bfloat16, "cpu"),
                       reason="prepacking is used on CPUs with bf16 arithmetic only (AVX512-BF16 / AMX)"),
]


@pytest.fixture(params=["native", "onednn"])
def kernel(request, monkeypatch):
    """Both kernels a PrepackedWeight can run: verispec's own (kernels/bf16_gemm.c) and oneDNN's."""
    from verispec import kernels

    if request.param == "native" and kernels.bf16_gemm() is None:
        pytest.skip(f"native bf16 kernel unavailable: {kernels.why_not()}")
    if request.param == "onednn":
        monkeypatch.setitem(kernels._LOADED, "bf16_gemm", None)
    return request.param


def _weight(n: int, k: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, k, generator=g) * 0.05).bfloat16()


def test_kernel_computes_the_weight_and_bias(kernel):
    w, b = _weight(96, 128, 0), _weight(1, 96, 1)[0]
    pw = PrepackedWeight(w, b)
    x = torch.randn(5, 128, generator=torch.Generator().manual_seed(2)).bfloat16()
    ref = x.float() @ w.float().t() + b.float()
    for invariant in (False, True):
        torch.testing.assert_close(pw.mm(x, invariant).float(), ref, rtol=2e-2, atol=2e-2 * ref.abs().max().item())
        torch.testing.assert_close(pw.mm(x[:1], invariant).float(), ref[:1], rtol=2e-2, atol=2e-2 * ref.abs().max().item())
    with pytest.raises(ValueError, match="2-d bf16 CPU weight"):
        PrepackedWeight(w.float())


@pytest.mark.parametrize("shape", [(4096, 640), (640, 2048), (640, 1280)])
def test_rows_do_not_depend_on_the_row_count(shape, kernel):
    """Invariant calls give every row the bits it has alone, for 1 to 70 rows and at any position
    (oneDNN computes a lone row of an input wider than 1,024 differently from two rows, and the
    invariant path pads it: widths 2048 and 1280 fail without that; verispec's kernel computes
    every row alone)."""
    pw = PrepackedWeight(_weight(*shape, 3))
    X = torch.randn(70, shape[1], generator=torch.Generator().manual_seed(4)).bfloat16()
    alone = torch.cat([pw.mm(X[i : i + 1], invariant=True) for i in range(len(X))])
    for M in (2, 3, 5, 6, 8, 16, 17, 33, 64, 65, 70):
        assert torch.equal(pw.mm(X[:M], invariant=True), alone[:M]), f"rows of a {M}-row call differ from the rows alone"
        assert torch.equal(pw.mm(X[70 - M :], invariant=True), alone[70 - M :]), f"row position changes the bits (M={M})"


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma3"])
def test_prepacked_forward_is_the_dense_forward(family):
    """The same bf16 weights, blocked: the logits agree with the dense model's to bf16 rounding, the
    model reads as many weight bytes, and it refuses to be moved, re-packed or quantized."""
    dense = ours_from_hf(build_hf(family)).to(torch.bfloat16).fuse()
    packed = prepack_model(copy.deepcopy(dense))
    assert packed.prepacked and isinstance(packed.packed_head, PrepackedWeight)
    assert weight_bytes(packed) == weight_bytes(dense)
    ids = random_ids(13, dense.config.vocab_size, seed=5, batch=2)
    for m in (dense, packed):
        m.set_batch_invariant(True)
    got = packed(ids, packed.new_cache(2, 64), [0, 1], torch.zeros(2, dtype=torch.long)).logits
    want = dense(ids, dense.new_cache(2, 64), [0, 1], torch.zeros(2, dtype=torch.long)).logits
    torch.testing.assert_close(got, want, rtol=0.05, atol=0.05 * want.abs().max().item())
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() > 0.9
    with pytest.raises(RuntimeError, match="prepacked model cannot be moved"):
        packed.to(torch.float32)
    with pytest.raises(ValueError, match="packed already"):
        prepack_model(packed)
    with pytest.raises(ValueError, match="the model is prepacked"):
        quantize_model(packed, "int8")
    with pytest.raises(ValueError, match="packed already"):
        prepack_model(quantize_model(copy.deepcopy(dense), "int8"))


@pytest.mark.parametrize("family", ["llama", "gemma3"])
@pytest.mark.parametrize("drafter", ["ngram", "layerskip", "draft-model"])
def test_greedy_on_a_prepacked_target_equals_its_plain_decoding(family, drafter):
    """The engine's batch-invariant bf16 numerics on blocked weights: a batch of 3 and a queue."""
    dense = ours_from_hf(build_hf(family)).to(torch.bfloat16)
    target = prepack_model(copy.deepcopy(dense).fuse())
    prompts = prompts_for(target.config.vocab_size)
    plain, _ = run(target, None, prompts, k=4)
    alone = [run(target, None, [p], k=4, max_batch=1)[0][0] for p in prompts[:2]]
    assert alone == plain[:2], "a sequence decodes the same alone and in a batch"
    factory = (lambda t, b, L: ModelDrafter(noisy_copy(dense), b, L)) if drafter == "draft-model" else DRAFTERS[drafter]
    spec, seqs = run(target, factory, prompts, k=4)
    assert spec == plain
    assert sum(s.stats.accepted for s in seqs) > 0, "nothing accepted: the check would be vacuous"


def test_a_served_draft_head_runs_prepacked_and_stays_lossless(tmp_path):
    """`make_drafter` on a bf16 target prepacks the head's layers and LM head (models/prepack.py
    `prepack_head`): its logits agree with the dense head's, and decoding equals plain decoding."""
    from test_eagle3 import _engine_run, random_eagle
    from verispec.drafters import make_drafter
    from verispec.drafters.eagle3 import Eagle3Drafter
    from verispec.sampling import SamplingParams

    dense = ours_from_hf(build_hf("gemma3")).to(torch.bfloat16)
    target = prepack_model(copy.deepcopy(dense).fuse())
    random_eagle(dense, draft_vocab=100).save(tmp_path / "e3", dtype=torch.bfloat16)
    d = make_drafter(str(tmp_path / "e3"), target, 3, 101, torch.bfloat16, "cpu")
    assert isinstance(d, Eagle3Drafter) and isinstance(d.model.packed_head, PrepackedWeight)
    assert all(isinstance(layer.self_attn.qkv[0], PrepackedWeight) and isinstance(layer.mlp.down[0], PrepackedWeight)
               for layer in d.model.layers)
    y = torch.randn(3, dense.config.hidden_size, generator=torch.Generator().manual_seed(6)).bfloat16()
    want = y.float() @ d.model.lm_head.weight.float().t()
    torch.testing.assert_close(d.model.head_logits(y), want, rtol=2e-2, atol=2e-2 * want.abs().max().item())
    prompts = [random_ids(n, 160, seed=n)[0].tolist() for n in (9, 4, 13)]
    sp = SamplingParams(max_tokens=16, ignore_eos=True)
    plain, _ = _engine_run(target, None, prompts, sp)
    out, seqs = _engine_run(target, d, prompts, sp)
    assert out == plain and all(s.stats.drafted > 0 for s in seqs)


def test_a_cpu_whose_rows_fail_the_probe_is_not_prepacked(monkeypatch):
    """`can_prepack` asks the once-per-process row-invariance probe: where it fails (another oneDNN
    kernel choice), bf16 stays on the row-major path instead of risking lossless decoding."""
    from verispec.models import prepack

    assert prepack.rows_invariant_here()  # this CPU passes (the module would be skipped otherwise)
    monkeypatch.setattr(prepack, "_ROWS_INVARIANT", [False])
    assert not prepack.can_prepack(torch.bfloat16, "cpu")
