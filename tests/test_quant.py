"""Weight-only int8 / int4 targets (models/quant.py).

- the packed kernels compute x @ W.T for the de-quantized W (the weights the model runs);
- a row's bits do not depend on how many rows share the call (what keeps verification lossless);
- a quantized model's forward equals transformers' forward with the de-quantized weights;
- speculative output equals the quantized model's own plain output: greedy identity, and the
  exact-distribution check against the de-quantized model's joint.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from conftest import build_hf, hf_logits, ours_from_hf, random_ids
from test_greedy_lossless import DRAFTERS, noisy_copy, prompts_for, run
from test_sampling_lossless import check, target_and_draft_hf
from verispec.drafters import ModelDrafter
from verispec.engine import EngineConfig
from verispec.models.quant import INT4_GROUP, PackedWeight, quantize_model, weight_bytes

pytestmark = pytest.mark.usefixtures("single_torch_thread")

MODES = ("int8", "int4")


def _weight(n: int, k: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, k, generator=g) * 0.05


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_computes_the_dequantized_weight(mode, dtype):
    w = _weight(96, 128, 0).to(dtype)
    pw = PackedWeight(w, mode)
    assert pw.kernel, "the packed CPU kernel should take this shape"
    deq = pw.dequantize().float()
    x = torch.randn(5, 128, generator=torch.Generator().manual_seed(1)).to(dtype)
    ref = x.float() @ deq.t()
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(pw.mm(x).float(), ref, rtol=tol, atol=tol * ref.abs().max().item())
    if mode == "int8":  # within half a step of its row's grid
        step = w.float().abs().amax(1, keepdim=True) / 127
        assert ((deq - w.float()).abs() <= 0.5 * step * 1.02 + 1e-3).all()
    elif dtype == torch.float32:  # (bf16's de-quantized values are rounded once more)
        # every group's squared error at most that of its [min, max] grid (the fit's starting point)
        g = w.float().reshape(96, -1, INT4_GROUP)
        lo, hi = g.amin(-1, keepdim=True), g.amax(-1, keepdim=True)
        s = ((hi - lo) / 15).to(dtype).float()
        z = (lo + 8 * s).to(dtype).float()
        minmax = ((g - z) / s + 8).round().clamp(0, 15)
        err_minmax = ((minmax - 8) * s + z - g).pow(2).sum(-1)
        err = (deq.reshape(g.shape) - g).pow(2).sum(-1)
        assert (err <= err_minmax * 1.0001 + 1e-12).all()
        assert err.sum() < 0.97 * err_minmax.sum(), "the least-squares refit should improve on min-max"


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("native", [True, False])
def test_linear_takes_the_packed_kernel_in_every_mode(mode, native, monkeypatch):
    """`models.layers.linear` sends a packed weight to its kernel for invariant and ordinary calls
    alike, whatever the CPU's bf16 fast path would pick for a dense weight (the layer-skip drafter
    runs a quantized target's layers outside invariant mode)."""
    from verispec.models import layers

    monkeypatch.setattr(layers, "_BF16_NATIVE", [native])
    pw = PackedWeight(_weight(96, 128, 4).bfloat16(), mode)
    x = torch.randn(1, 3, 128, generator=torch.Generator().manual_seed(5)).bfloat16()
    for invariant in (False, True):
        assert torch.equal(layers.linear(x, pw, invariant=invariant)[0], pw.mm(x[0], invariant))


@pytest.mark.parametrize("mode", MODES)
def test_rows_do_not_depend_on_the_row_count(mode):
    """Each row of an M-row call has the bits it has alone (bf16, the engine's default), for row
    counts on both sides of the kernels' internal blocking."""
    pw = PackedWeight(_weight(4096, 640, 2).bfloat16(), mode)
    X = torch.randn(70, 640, generator=torch.Generator().manual_seed(3)).bfloat16()
    alone = torch.cat([pw.mm(X[i : i + 1]) for i in range(len(X))])
    for M in (2, 3, 5, 8, 16, 17, 33, 64, 70):
        assert torch.equal(pw.mm(X[:M]), alone[:M]), f"{mode}: rows of a {M}-row call differ from the rows alone"
        assert torch.equal(pw.mm(X[70 - M :]), alone[70 - M :]), f"{mode}: row position changes the bits (M={M})"


def test_unsupported_shapes_and_devices_run_the_same_numbers_densely():
    w = _weight(40, 64, 4)  # 40 output rows: the int4 kernel packs tiles of 16
    pw = PackedWeight(w, "int4")
    assert not pw.kernel and pw.dense is not None
    x = torch.randn(3, 64)
    torch.testing.assert_close(pw.mm(x), x @ pw.dequantize().t())
    with pytest.raises(ValueError, match="multiple of the group size"):
        PackedWeight(_weight(32, 48, 5), "int4")
    with pytest.raises(ValueError, match="unknown quantization"):
        PackedWeight(w, "int3")


def _dequantized_hf(hf, quantized):
    """transformers' model with every quantized weight replaced by its de-quantized values."""
    hf = copy.deepcopy(hf)
    with torch.no_grad():
        for L, Q in zip(hf.model.layers, quantized.model.layers):
            a, m = L.self_attn, L.mlp
            q, k, v = Q.self_attn.qkv[0].dequantize().float().split(
                [a.q_proj.out_features, a.k_proj.out_features, a.v_proj.out_features])
            a.q_proj.weight.copy_(q), a.k_proj.weight.copy_(k), a.v_proj.weight.copy_(v)
            a.o_proj.weight.copy_(Q.self_attn.out[0].dequantize().float())
            g, u = Q.mlp.gate_up[0].dequantize().float().chunk(2)
            m.gate_proj.weight.copy_(g), m.up_proj.weight.copy_(u)
            m.down_proj.weight.copy_(Q.mlp.down[0].dequantize().float())
        hf.lm_head.weight = nn.Parameter(quantized.packed_head.dequantize().float())  # unties a tied head
    return hf


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma3"])
def test_quantized_forward_equals_transformers_with_dequantized_weights(family, mode):
    hf = build_hf(family)
    ours = quantize_model(ours_from_hf(hf).fuse(), mode)  # fp32 activations
    assert ours.quant == mode and isinstance(ours.packed_head, PackedWeight)
    ref_hf = _dequantized_hf(hf, ours)
    ids = random_ids(13, hf.config.vocab_size, seed=5, batch=2)
    cache = ours.new_cache(2, 64)
    got = ours(ids, cache, [0, 1], torch.zeros(2, dtype=torch.long)).logits
    want = hf_logits(ref_hf, ids)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-3)
    # and it is not the unquantized model (the test would pass vacuously if nothing were quantized)
    assert (hf_logits(hf, ids) - want).abs().max() > 1e-2


def test_quantized_model_reads_fewer_bytes_and_refuses_to_move():
    hf = build_hf("llama")
    dense = ours_from_hf(hf).to(torch.bfloat16).fuse()
    b16 = weight_bytes(dense)
    q8 = quantize_model(copy.deepcopy(dense), "int8")
    q4 = quantize_model(copy.deepcopy(dense), "int4")
    assert weight_bytes(q8) < 0.55 * b16 and weight_bytes(q4) < 0.35 * b16
    with pytest.raises(RuntimeError, match="quantized model cannot be moved"):
        q8.to(torch.float32)
    with pytest.raises(ValueError, match="quantized already"):
        quantize_model(q8, "int4")
    with pytest.raises(ValueError, match="unknown quantization"):
        EngineConfig(quant="int3")


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("family", ["llama", "gemma3"])
@pytest.mark.parametrize("drafter", ["ngram", "layerskip", "draft-model"])
def test_greedy_on_a_quantized_target_equals_its_plain_decoding(family, mode, drafter):
    """bf16 activations (the engine's batch-invariant numerics), a batch of 3 and a queue."""
    dense = ours_from_hf(build_hf(family)).to(torch.bfloat16)
    target = quantize_model(copy.deepcopy(dense).fuse(), mode)
    prompts = prompts_for(target.config.vocab_size)
    plain, _ = run(target, None, prompts, k=4)
    # the draft model: the unquantized weights plus noise (a quantized model has no dense weights to perturb)
    factory = (lambda t, b, L: ModelDrafter(noisy_copy(dense), b, L)) if drafter == "draft-model" else DRAFTERS[drafter]
    spec, seqs = run(target, factory, prompts, k=4)
    assert spec == plain
    assert sum(s.stats.accepted for s in seqs) > 0, "nothing accepted: the check would be vacuous"


@pytest.fixture(scope="module")
def quantized_models():
    """(transformers with the de-quantized weights, our int8/int4 target, draft model): the
    sampling test's models (test_sampling_lossless.models), the target quantized."""
    hf, draft_hf = target_and_draft_hf()
    out = {}
    for mode in MODES:
        target = quantize_model(ours_from_hf(hf).fuse(), mode)
        out[mode] = (_dequantized_hf(hf, target), target, ours_from_hf(draft_hf))
    return out


@pytest.mark.parametrize("mode,kind", [("int8", "draft"), ("int4", "draft"), ("int8", "ngram")])
def test_sampled_output_of_a_quantized_target_is_its_distribution(quantized_models, mode, kind):
    models = quantized_models[mode]
    (t, (thr, _, _)), marg, stats = check(models, kind, "plain", seed0=7_000_000 + 100_000 * MODES.index(mode))
    assert stats.drafted > 0 and 0 < stats.accepted < stats.drafted
    assert t < thr, f"TV {t:.4f} >= threshold {thr:.4f}: sampling on the {mode} target is not its distribution"
    for pos, (tm, (thm, _, _)) in enumerate(marg):
        assert tm < thm, f"position {pos + 1}: marginal TV {tm:.4f} >= threshold {thm:.4f}"


def test_quality_scores_equal_transformers_loss():
    """bench/quality.py: teacher-forced NLL and argmax of the scored tokens, against transformers."""
    from verispec.bench.quality import common_prefix, greedy_agreement, perplexity, score

    hf = build_hf("qwen3")
    ours = ours_from_hf(hf).fuse()
    ids = random_ids(20, hf.config.vocab_size, seed=8)[0].tolist()
    s = score(ours, ids, start=7)
    logp = hf_logits(hf, torch.tensor([ids]))[0].log_softmax(-1)[6:19]
    want = -logp.gather(1, torch.tensor(ids[7:])[:, None]).sum().item()
    assert s.tokens == 13 and abs(s.nll - want) < 1e-3 * abs(want)
    assert torch.equal(s.argmax, logp.argmax(-1))
    assert abs(perplexity([s]) - torch.exp(torch.tensor(want / 13)).item()) < 1e-3 * perplexity([s])
    assert common_prefix([1, 2, 3], [1, 2, 4]) == 2
    assert greedy_agreement([[1, 2], [3]], [[1, 2], [4]]) == {"identical": 1, "outputs": 2,
                                                              "mean_common_prefix": 1.0, "mean_length": 1.5}
    with pytest.raises(ValueError, match="context token"):
        score(ours, ids, start=0)
