"""The native decoder layer (models/native_layer.py, kernels/layer.c): on packed weights a layer's
inference forward is two native calls around the attention, and it computes what the Python layer
computes, bit for bit, once both use the same activation; its activation is silu / tanh-GELU to
within float rounding; and it is taken exactly where it can be."""

from __future__ import annotations

import copy

import pytest
import torch

from verispec import kernels
from verispec.models.layers import MLP, DecoderLayer
from verispec.models.native_layer import NativeLayer
from verispec.models.prepack import prepack_model
from verispec.models.quant import quantize_model

from conftest import build_hf, ours_from_hf, random_ids

needs_kernels = pytest.mark.skipif(kernels.layer_pre() is None, reason=f"native kernels unavailable: {kernels.why_not()}")

PACKINGS = {
    "bf16": lambda m: prepack_model(m),
    "int8": lambda m: quantize_model(m, "int8"),
    "int4": lambda m: quantize_model(m, "int4"),
}


def _packed(family: str, packing: str):
    return PACKINGS[packing](ours_from_hf(build_hf(family)).to(torch.bfloat16).fuse())


def _native_activation(self, g, u):
    """What layer.c computes for act(g) * u, for the Python layer to compare with."""
    return kernels.run_act_mul(kernels.act_mul(), torch.cat([g, u], -1), "gelu_tanh" if self.gelu else "silu")


def _run(model, steps):
    """A prefill of two sequences in slots 2 and 0 (not in order), then single-token steps for both:
    the logits, the last hidden states and the cache of every forward."""
    cache = model.new_cache(3, 64)
    outs = []
    starts = torch.zeros(2, dtype=torch.long)
    for ids in steps:
        out = model(ids, cache, [2, 0], starts, taps=(0,))
        outs.append((out.logits, out.last_hidden, out.hidden[0]))
        starts = starts + ids.shape[1]
    return outs, cache


@needs_kernels
@pytest.mark.parametrize("family", ["llama", "llama_linear", "qwen2", "qwen3", "gemma3"])
@pytest.mark.parametrize("packing", list(PACKINGS))
def test_native_layer_has_the_python_layers_bits(family, packing, monkeypatch):
    """Prefill 11 tokens, then 3 decode steps, batch 2: every logit, hidden state and cache row the
    native layers write equals the Python layers' (with layer.c's activation), for biases (Qwen2's
    q/k/v, Llama's everywhere), q/k norms (Qwen3), Gemma's four norms and tanh-GELU, and every
    packing. And the native path did run."""
    model = _packed(family, packing)
    vocab = model.config.vocab_size
    steps = [random_ids(11, vocab, seed=1, batch=2)] + [random_ids(1, vocab, seed=2 + i, batch=2) for i in range(3)]
    calls = []
    pre = NativeLayer.pre
    monkeypatch.setattr(NativeLayer, "pre", lambda self, *a: calls.append(1) or pre(self, *a))
    with torch.inference_mode():
        native, native_cache = _run(model, steps)
    assert len(calls) == len(steps) * model.config.num_layers, "the native layer did not run"
    monkeypatch.setattr(DecoderLayer, "native", lambda self: None)
    monkeypatch.setattr(MLP, "activate", _native_activation)
    with torch.inference_mode():
        python, python_cache = _run(model, steps)
    for step, (a, b) in enumerate(zip(native, python)):
        for got, want in zip(a, b):
            assert torch.equal(got, want), f"step {step} differs"
    for i in range(model.config.num_layers):
        assert torch.equal(native_cache.k[i], python_cache.k[i]) and torch.equal(native_cache.v[i], python_cache.v[i])


@needs_kernels
def test_native_layer_is_taken_only_where_it_can_run():
    """Unpacked weights and float32 activations take the Python layer, and so does a forward that
    records gradients; a layer whose norm or projection is replaced builds a new spec (the old one
    points into the old weights)."""
    dense = ours_from_hf(build_hf("llama")).to(torch.bfloat16).fuse()
    assert all(layer.native() is None for layer in dense.model.layers)
    packed = prepack_model(copy.deepcopy(dense))
    layer = packed.model.layers[0]
    spec = layer.native()
    assert spec is not None and layer.native() is spec
    ids = random_ids(5, packed.config.vocab_size, seed=3)
    with torch.inference_mode():
        before = packed(ids, packed.new_cache(1, 32), [0], torch.zeros(1, dtype=torch.long)).logits
    layer.input_layernorm.weight = torch.nn.Parameter(layer.input_layernorm.weight.detach() * 2, requires_grad=False)
    assert layer.native() is not spec
    with torch.inference_mode():
        after = packed(ids, packed.new_cache(1, 32), [0], torch.zeros(1, dtype=torch.long)).logits
    assert not torch.equal(before, after), "the new norm weights were not used"
    with torch.enable_grad():
        calls = []
        pre = NativeLayer.pre
        NativeLayer.pre = lambda self, *a: calls.append(1) or pre(self, *a)
        try:
            packed(ids, packed.new_cache(1, 32), [0], torch.zeros(1, dtype=torch.long))
        finally:
            NativeLayer.pre = pre
        assert not calls, "a forward under autograd took the native layer"
    fp32 = quantize_model(ours_from_hf(build_hf("llama")).fuse(), "int8")  # fp32 activations: torch's kernels
    assert all(layer.native() is None for layer in fp32.model.layers)


@needs_kernels
@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
def test_native_activation_is_the_exact_function_rounded(activation):
    """act(g) * u for every bf16 g from -100 to 100, random ones and a few extremes: the exact act
    (float64) rounded to float then bf16, times u, rounded again -- bit for bit, except where the
    exact act lies within 1e-6 of a tie between two bf16 values; and where the exact act is below
    1e-30 (the far negative tail, -100 and beyond), a value as negligible, of the right sign or zero."""
    g = torch.cat([torch.linspace(-100, 100, 20001).bfloat16().unique(),
                   (torch.randn(50_000, generator=torch.Generator().manual_seed(1)) * 4).bfloat16(),
                   torch.tensor([0.0, -0.0, 1e-30, -1e-30, 3e4, -3e4], dtype=torch.bfloat16)])
    u = (torch.randn(g.shape[0], generator=torch.Generator().manual_seed(0)) * 3).bfloat16()
    got = kernels.run_act_mul(kernels.act_mul(), torch.cat([g, u])[None], activation)[0]
    x = g.double()
    z = x if activation == "silu" else 2 * (2 / torch.pi) ** 0.5 * (x + 0.044715 * x**3)
    act = x * torch.sigmoid(z)
    want = (act.float().bfloat16().double() * u.double()).bfloat16()
    normal = act.abs() > 1e-30
    near_tie = (act * (1 + 1e-6)).float().bfloat16() != (act * (1 - 1e-6)).float().bfloat16()
    off = (got != want) & normal
    assert not (off & ~near_tie).any(), f"{g[off & ~near_tie][:5]} -> {got[off & ~near_tie][:5]}, not {want[off & ~near_tie][:5]}"
    assert (got[~normal].double().abs() <= 1e-29).all() and not got.isnan().any()


@needs_kernels
@pytest.mark.parametrize("packing", ["bf16", "int8"])
def test_sampled_output_through_native_layers_is_the_targets_distribution(packing):
    """Speculative sampling (n-gram drafts, k = 3, T = 1) on a packed target whose layers run
    natively: 3,500 seeded requests against the exact joint distribution of 4 tokens, enumerated
    with the same model's own forward (distcheck), never outside its support, TV under the null's
    threshold; drafts both accepted and rejected."""
    from test_sampling_lossless import M, PROMPT, V, target_and_draft_hf

    from verispec.distcheck import exact_distribution, null_tv, tv
    from verispec.drafters.ngram import NgramDrafter
    from verispec.engine import Engine, EngineConfig
    from verispec.sampling import SamplingParams

    hf, _ = target_and_draft_hf()
    target = PACKINGS[packing](ours_from_hf(hf).to(torch.bfloat16).fuse())
    assert all(layer.native() is not None for layer in target.model.layers)
    sp = SamplingParams(max_tokens=M, temperature=1.0, ignore_eos=True)
    exact = exact_distribution(target, PROMPT, sp, M)
    assert exact.borderline is None
    cfg = EngineConfig(model="unused", drafter=None, draft_policy="fixed", num_draft_tokens=3, dtype="bfloat16",
                       max_batch_size=512, max_model_len=16)
    eng = Engine(target, None, cfg, drafter=NgramDrafter())
    n = 3500
    seqs = [eng.add_request(PROMPT, SamplingParams(max_tokens=M, temperature=1.0, ignore_eos=True, seed=9_000 + i))
            for i in range(n)]
    while eng.has_work:
        eng.step()
    index = exact.index()
    outside = [s.output_ids for s in seqs if tuple(s.output_ids) not in index]
    assert not outside, f"outputs outside the exact support: {outside[:3]}"
    counts = torch.zeros(len(exact.outcomes), dtype=torch.float64)
    for s in seqs:
        counts[index[tuple(s.output_ids)]] += 1
    drafted, accepted = sum(s.stats.drafted for s in seqs), sum(s.stats.accepted for s in seqs)
    assert 0 < accepted < drafted, "need both accepted and rejected drafts"
    null = null_tv(exact.probs, n)
    assert tv(counts, exact.probs) < null.threshold, (tv(counts, exact.probs), null)
    assert V ** M >= len(exact.outcomes) > 1
