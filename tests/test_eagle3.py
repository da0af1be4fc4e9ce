"""EAGLE-3 drafter: vocabulary mapping, training-time-test unrolling == serving, losslessness, checkpoints."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from conftest import build_hf, ours_from_hf, random_ids, randomize_head
from verispec.drafters import make_drafter
from verispec.drafters.eagle3 import (
    CheckpointError, Eagle3Config, Eagle3Drafter, Eagle3Model, build_vocab_mapping, default_aux_layers, load_eagle3,
)
from verispec.engine import Engine, EngineConfig
from verispec.sequence import Sequence
from verispec.sampling import SamplingParams

pytestmark = pytest.mark.usefixtures("single_torch_thread")


def random_eagle(target, draft_vocab=None, seed=0, counts=None, **kw) -> Eagle3Model:
    c = Eagle3Config.for_target(target, draft_vocab_size=draft_vocab, aux_layers=kw.pop("aux_layers", None), **kw)
    torch.manual_seed(seed)
    m = Eagle3Model(c, embed_weight=target.model.embed_tokens.weight)
    return randomize_head(m, counts)


@pytest.fixture(scope="module")
def llama():
    hf = build_hf("llama", num_hidden_layers=4)
    return hf, ours_from_hf(hf)


def test_default_layers():
    assert default_aux_layers(18) == [2, 9, 15]
    assert default_aux_layers(32) == [2, 16, 29]
    assert default_aux_layers(4) == [0, 2, 3] and default_aux_layers(3) == [0, 1, 2] and default_aux_layers(2) == [0, 1]
    for L in range(2, 40):
        ids = default_aux_layers(L)
        assert len(set(ids)) == len(ids) and all(0 <= i < L for i in ids)


def test_vocab_mapping():
    counts = torch.tensor([0, 5, 1, 9, 0, 9, 3, 0.0])
    d2t, t2d = build_vocab_mapping(counts, 4)
    kept = torch.arange(4) + d2t
    assert kept.tolist() == [1, 3, 5, 6]  # the 4 most frequent ids, sorted
    assert t2d.tolist() == [False, True, False, True, False, True, True, False]
    # fewer seen ids than the draft vocabulary: padded with the lowest unseen ids
    d2t, t2d = build_vocab_mapping(torch.tensor([0, 0, 7, 0, 0.0]), 3)
    assert (torch.arange(3) + d2t).tolist() == [0, 1, 2]
    with pytest.raises(ValueError):
        build_vocab_mapping(counts, 9)


def test_vocab_mapping_roundtrip_through_model(llama):
    _, target = llama
    m = random_eagle(target, draft_vocab=40)
    tgt = m.draft_to_target()
    assert (m.target_to_draft(tgt) == torch.arange(40)).all()
    assert int((m.target_to_draft(torch.arange(160)) >= 0).sum()) == 40


def _serve_rows(m: Eagle3Model, drafter: Eagle3Drafter, ids, aux, slot=0):
    """Serving path, one row at a time through the drafter's KV cache: row i = (g_i, x_{i+1})."""
    outs = []
    for i in range(ids.shape[1] - 1):
        h, state = drafter._run(ids[:, i + 1 : i + 2], m.fuse(aux[:, i : i + 1]), torch.tensor([i]), [slot])
        outs.append((h, m.head_logits(state)))
    return outs


@torch.no_grad()
@pytest.mark.parametrize("flags", [{}, {"fc_norm": True, "norm_output": True}, {"norm_before_fc": True},
                                   {"num_layers": 2, "norm_before_residual": True}])
def test_ttt_one_step_is_plain_forward_and_unroll_is_the_chain(llama, flags):
    _, target = llama
    m = random_eagle(target, draft_vocab=64, **flags)
    T = 9
    ids = random_ids(T, 160, seed=3)
    out = target(ids, target.new_cache(1, 32), [0], torch.tensor([0]), taps=tuple(m.config.aux_layers))
    aux = torch.cat([out.hidden[i] for i in m.config.aux_layers], -1)
    one = m(aux, ids, torch.ones_like(ids, dtype=torch.bool), steps=1)
    assert len(one) == 1 and one[0].shape == (1, T - 1, 64)
    # the same rows fed one by one through the serving KV cache
    d = Eagle3Drafter(m, target, 1, 32)
    rows = _serve_rows(m, d, ids, aux)
    serve = torch.cat([lg for _, lg in rows], 1)
    torch.testing.assert_close(one[0], serve, atol=1e-4, rtol=1e-4)
    # a 3-step unroll: step s at anchor i == the serving chain from anchor i fed x_{i+2}..x_{i+1+s}
    three = m(aux, ids, torch.ones_like(ids, dtype=torch.bool), steps=3)
    torch.testing.assert_close(three[0], one[0], atol=1e-5, rtol=1e-5)
    for anchor in (0, 3, 5):
        d = Eagle3Drafter(m, target, 1, 32)
        rows = _serve_rows(m, d, ids[:, : anchor + 2], aux)
        h = rows[-1][0]
        for s in (1, 2):
            tok = ids[:, anchor + 1 + s : anchor + 2 + s]
            h, state = d._run(tok, h, torch.tensor([anchor + s]), [0])
            lg = m.head_logits(state)
            torch.testing.assert_close(three[s][:, anchor], lg[:, 0], atol=1e-4, rtol=1e-4)


@torch.no_grad()
def test_padding_does_not_change_real_rows(llama):
    _, target = llama
    m = random_eagle(target, draft_vocab=64)
    ids = random_ids(12, 160, seed=5, batch=2)
    out = target(ids, target.new_cache(2, 32), [0, 1], torch.tensor([0, 0]), taps=tuple(m.config.aux_layers))
    aux = torch.cat([out.hidden[i] for i in m.config.aux_layers], -1)
    valid = torch.ones_like(ids, dtype=torch.bool)
    valid[1, 7:] = False
    full = m(aux[1:, :7], ids[1:, :7], valid[1:, :7], steps=2)
    padded = m(aux, ids, valid, steps=2)
    torch.testing.assert_close(padded[0][1, :6], full[0][0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(padded[1][1, :5], full[1][0, :5], atol=1e-5, rtol=1e-5)

@torch.no_grad()
@pytest.mark.parametrize("flags", [{}, {"fc_norm": True, "norm_output": True}, {"num_layers": 2}])
def test_unroll_at_anchor_rows_equals_the_full_unroll(llama, flags):
    """Training at the response anchors only (the head and the later steps skip the other rows) gives
    each anchor the drafts the full unroll gives it, wherever the drafted token exists."""
    from verispec.train.losses import response_anchors

    _, target = llama
    m = random_eagle(target, draft_vocab=64, **flags)
    B, T = 3, 14
    ids = random_ids(T, 160, seed=8, batch=B)
    out = target(ids, target.new_cache(B, 32), list(range(B)), torch.zeros(B, dtype=torch.long),
                 taps=tuple(m.config.aux_layers))
    aux = torch.cat([out.hidden[i] for i in m.config.aux_layers], -1)
    valid = torch.ones_like(ids, dtype=torch.bool)
    valid[2, 10:] = False
    mask = torch.zeros_like(valid)
    mask[0, 4:], mask[1, 9:], mask[2, 2:10] = True, True, True  # response tokens (prompts of 4, 9, 2)
    anchors = response_anchors({"mask": mask, "valid": valid})
    assert anchors[0].tolist() == list(range(3, 12)) and anchors[1, :4].tolist() == [8, 9, 10, 11]
    assert (anchors[1, 4:] == T - 1).all() and anchors[2, :7].tolist() == list(range(1, 8))
    full = m(aux, ids, valid, steps=4)
    part = m(aux, ids, valid, steps=4, anchors=anchors)
    for s in range(4):
        assert part[s].shape == (B, anchors.shape[1], 64)
        for b in range(B):
            for j, a in enumerate(anchors[b].tolist()):
                if a + 2 + s < T and valid[b, a + 2 + s]:
                    torch.testing.assert_close(part[s][b, j], full[s][b, a], atol=1e-5, rtol=1e-5)



def test_one_row_step_under_autocast(llama):
    """Training runs the head under bf16 autocast on fp32 weights, so one-row inputs reach the shared
    `models.layers.linear` in bf16 against fp32 weights: they must take F.linear (which autocast
    casts), not the one-row `mv` fast path (which refuses mixed dtypes)."""
    _, target = llama
    m = random_eagle(target, draft_vocab=64).train()
    ids = random_ids(2, 160, seed=6)  # 2 tokens: one draft row per step
    aux = torch.randn(1, 2, 3 * target.config.hidden_size)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        outs = m(aux, ids, torch.ones_like(ids, dtype=torch.bool), steps=2)
    sum(o.float().logsumexp(-1).sum() for o in outs).backward()
    assert all(o.shape == (1, 1, 64) and torch.isfinite(o).all() for o in outs)
    assert m.fc.weight.grad is not None and torch.isfinite(m.fc.weight.grad).all()


# --------------------------------------------------------------------------------------------
# losslessness through the engine


def _engine_run(target, drafter, prompts, sp, k=4, max_batch=3, **kw):
    cfg = EngineConfig(model="unused", drafter=None, draft_policy="fixed", num_draft_tokens=k, dtype="float32", max_batch_size=max_batch,
                       max_model_len=96, **kw)
    eng = Engine(target, None, cfg, drafter)
    seqs = [eng.add_request(p, sp) for p in prompts]
    while eng.has_work:
        eng.step()
    return [s.output_ids for s in seqs], seqs


@pytest.mark.parametrize("family", ["llama", "gemma3", "qwen3"])
def test_greedy_lossless_with_eagle3(family):
    hf = build_hf(family)
    target = ours_from_hf(hf)
    prompts = [random_ids(n, 160, seed=10 + n)[0].tolist() for n in (5, 12, 3, 9)]
    sp = SamplingParams(max_tokens=20, ignore_eos=True)
    plain, _ = _engine_run(target, None, prompts, sp)
    m = random_eagle(target, draft_vocab=100)
    out, seqs = _engine_run(target, Eagle3Drafter(m, target, 3, 96 + 5), prompts, sp)
    assert out == plain
    assert sum(s.stats.drafted for s in seqs) > 0


@pytest.mark.parametrize("family", ["llama", "gemma3"])
@pytest.mark.parametrize("tree", ["dynamic:3", "static:2,2,1"])
def test_greedy_lossless_with_eagle3_trees(family, tree):
    hf = build_hf(family)
    target = ours_from_hf(hf)
    prompts = [random_ids(n, 160, seed=10 + n)[0].tolist() for n in (5, 12, 3, 9)]
    sp = SamplingParams(max_tokens=20, ignore_eos=True)
    plain, _ = _engine_run(target, None, prompts, sp)
    m = random_eagle(target, draft_vocab=100)
    out, seqs = _engine_run(target, Eagle3Drafter(m, target, 3, 96 + 9), prompts, sp, k=8, draft_tree=tree)
    assert out == plain
    assert all(s.stats.drafted > s.stats.forwards for s in seqs)  # trees of several nodes


def test_sampled_lossless_tv_eagle3_tree():
    """Trees of top-k children under sampling: deterministic siblings, the one-hot rule."""
    import test_sampling_lossless as tsl

    hf = build_hf("llama", seed=3, vocab_size=tsl.V, num_hidden_layers=3)
    target = ours_from_hf(hf)
    m = random_eagle(target, draft_vocab=4, counts=torch.tensor([5.0, 5, 1, 5, 5]), aux_layers=[0, 1, 2])
    n = 1500
    cfg = EngineConfig(model="unused", drafter=None, draft_policy="fixed", num_draft_tokens=6, draft_tree="dynamic:2", dtype="float32",
                       max_batch_size=tsl.BATCH, max_model_len=tsl.MAX_LEN)
    eng = Engine(target, None, cfg, Eagle3Drafter(m, target, tsl.BATCH, tsl.MAX_LEN + 7))
    seqs = [eng.add_request(tsl.PROMPT, dataclasses.replace(tsl.PLAIN, seed=3000 + i)) for i in range(n)]
    outs = tsl.run_to_end(eng, seqs)
    codes = torch.tensor([sum(x * tsl.V ** (tsl.M - 1 - j) for j, x in enumerate(o)) for o in outs])
    counts = torch.bincount(codes, minlength=tsl.V ** tsl.M).double()
    exact = tsl.exact_joint(hf, tsl.PLAIN)
    thr = tsl.null_thresholds(exact, n)["joint"][0]
    assert sum(s.stats.accepted for s in seqs) > 0 and sum(s.stats.drafted for s in seqs) > sum(s.stats.forwards for s in seqs)
    assert tsl.tv(counts, exact) < thr, (tsl.tv(counts, exact), thr)


def test_greedy_lossless_self_distilled_drafter_accepts():
    """A drafter whose LM head reads the target's own logits can't be trained in a unit test; instead
    a drafter over a 5-token vocab accepts often by chance and must stay token-identical."""
    hf = build_hf("llama", seed=3, vocab_size=5, num_hidden_layers=3)
    target = ours_from_hf(hf)
    prompts = [[1, 3, 4, 3, 0, 3], [2, 2, 1]]
    sp = SamplingParams(max_tokens=24, ignore_eos=True)
    plain, _ = _engine_run(target, None, prompts, sp)
    m = random_eagle(target, draft_vocab=4, counts=torch.tensor([1.0, 5, 5, 5, 5]))
    out, seqs = _engine_run(target, Eagle3Drafter(m, target, 3, 96 + 5), prompts, sp)
    assert out == plain
    assert sum(s.stats.accepted for s in seqs) > 0


def test_greedy_lossless_chunked_prefill_and_exact_mode(llama):
    """Prompts longer than the prefill chunk: the drafter receives target states chunk by chunk."""
    _, target = llama
    prompts = [random_ids(n, 160, seed=n)[0].tolist() for n in (37, 20, 6)]
    sp = SamplingParams(max_tokens=16, ignore_eos=True)
    plain, _ = _engine_run(target, None, prompts, sp)
    m = random_eagle(target, draft_vocab=100)
    for kw in ({"prefill_chunk": 8}, {"prefill_chunk": 16, "exact": True}):
        out, seqs = _engine_run(target, Eagle3Drafter(m, target, 3, 101), prompts, sp, **kw)
        assert out == plain
        assert all(s.stats.drafted > 0 for s in seqs)


def test_greedy_lossless_bf16_exact_mode():
    """bf16 target and drafter (the serving dtype; decode-sized matmuls take models.model.linear)."""
    hf = build_hf("gemma3")
    target = ours_from_hf(hf).to(torch.bfloat16)
    prompts = [random_ids(n, 160, seed=n)[0].tolist() for n in (9, 4)]
    sp = SamplingParams(max_tokens=16, ignore_eos=True)
    plain, _ = _engine_run(target, None, prompts, sp, exact=True)
    m = random_eagle(target, draft_vocab=100).to(torch.bfloat16)
    m.set_embedding(target.model.embed_tokens.weight)
    out, seqs = _engine_run(target, Eagle3Drafter(m, target, 3, 101), prompts, sp, exact=True)
    assert out == plain and all(s.stats.drafted > 0 for s in seqs)


def test_sampled_seeded_reproducible(llama):
    _, target = llama
    m = random_eagle(target, draft_vocab=100)
    prompts = [random_ids(n, 160, seed=n)[0].tolist() for n in (4, 7)]
    sp = SamplingParams(max_tokens=16, temperature=0.9, top_k=50, seed=11, ignore_eos=True)
    a, _ = _engine_run(target, Eagle3Drafter(m, target, 3, 101), prompts, sp)
    b, _ = _engine_run(target, Eagle3Drafter(m, target, 3, 101), prompts, sp)
    assert a == b


def test_draft_q_lives_on_the_draft_vocab(llama):
    _, target = llama
    m = random_eagle(target, draft_vocab=30)
    d = Eagle3Drafter(m, target, 1, 64)
    sp = SamplingParams(max_tokens=8, temperature=1.0, seed=1)
    seq = Sequence(0, [5, 6, 7, 8], sp, torch.Generator().manual_seed(1))
    with torch.no_grad():
        out = target(torch.tensor([[5, 6, 7, 8]]), target.new_cache(1, 16), [0], torch.tensor([0]),
                     taps=d.target_taps)
    d.on_commit(seq, 0, {i: out.hidden[i][0] for i in d.target_taps})
    seq.tokens.append(9)
    (draft,) = d.propose([seq], [3])
    assert len(draft.tokens) == 3 and draft.q.shape == (3, 160)
    torch.testing.assert_close(draft.q.sum(-1), torch.ones(3))
    outside = ~m.t2d
    assert float(draft.q[:, outside].abs().sum()) == 0.0
    assert all(bool(m.t2d[t]) for t in draft.tokens)


def test_sampled_lossless_tv():
    """Total variation against the exact joint distribution (the harness of test_sampling_lossless),
    with an EAGLE-3 drafter whose draft vocabulary misses a token (q = 0 there)."""
    import test_sampling_lossless as tsl

    hf = build_hf("llama", seed=3, vocab_size=tsl.V, num_hidden_layers=3)
    with torch.no_grad():
        hf.model.embed_tokens.weight.mul_(2.0)
        hf.lm_head.weight.mul_(2.0)
    target = ours_from_hf(hf)
    m = random_eagle(target, draft_vocab=4, counts=torch.tensor([5.0, 5, 1, 5, 5]), aux_layers=[0, 1, 2])
    n = 1200
    for sp in (tsl.PLAIN, tsl.PROCESSED):
        eng = tsl.new_engine(target, Eagle3Drafter(m, target, tsl.BATCH, tsl.MAX_LEN + tsl.K + 1))
        seqs = [eng.add_request(tsl.PROMPT, dataclasses.replace(sp, seed=1000 + i)) for i in range(n)]
        outs = tsl.run_to_end(eng, seqs)
        codes = torch.tensor([sum(x * tsl.V ** (tsl.M - 1 - j) for j, x in enumerate(o)) for o in outs])
        counts = torch.bincount(codes, minlength=tsl.V ** tsl.M).double()
        exact = tsl.exact_joint(hf, sp)
        thr = tsl.null_thresholds(exact, n)["joint"][0]
        assert sum(s.stats.drafted for s in seqs) > 0 and sum(s.stats.accepted for s in seqs) > 0
        assert tsl.tv(counts, exact) < thr, (sp, tsl.tv(counts, exact), thr)


# --------------------------------------------------------------------------------------------
# checkpoints


def test_save_load_roundtrip_and_make_drafter(llama, tmp_path):
    _, target = llama
    m = random_eagle(target, draft_vocab=64, fc_norm=True, norm_output=True)
    m.config.verifier = "tiny-llama"
    m.save(tmp_path / "ck", dtype=torch.float32)
    cfg = json.loads((tmp_path / "ck" / "config.json").read_text())
    assert cfg["speculators_model_type"] == "eagle3" and cfg["fc_norm"] and cfg["norm_output"]
    back = load_eagle3(tmp_path / "ck", target)
    for (k, a), (_, b) in zip(m.state_dict().items(), back.state_dict().items()):
        assert torch.equal(a, b), k
    for spec in (str(tmp_path / "ck"), f"eagle3:{tmp_path / 'ck'}"):
        d = make_drafter(spec, target, 2, 64, torch.float32, "cpu")
        assert isinstance(d, Eagle3Drafter) and d.target_taps == tuple(m.config.aux_layers)


def test_bad_checkpoints_are_refused(llama, tmp_path):
    from safetensors.torch import load_file, save_file

    _, target = llama
    m = random_eagle(target, draft_vocab=64)
    good = m.save(tmp_path / "good", dtype=torch.float32)

    def variant(name, edit_cfg=None, edit_sd=None):
        d = tmp_path / name
        d.mkdir()
        cfg = json.loads((good / "config.json").read_text())
        sd = load_file(str(good / "model.safetensors"))
        if edit_cfg:
            edit_cfg(cfg)
        if edit_sd:
            edit_sd(sd)
        (d / "config.json").write_text(json.dumps(cfg))
        save_file(sd, str(d / "model.safetensors"))
        return d

    def hidden(cfg):
        cfg["transformer_layer_config"]["hidden_size"] = 32
    with pytest.raises(CheckpointError, match="hidden size"):
        load_eagle3(variant("hidden", hidden), target)
    with pytest.raises(CheckpointError, match="missing: fc.weight"):
        load_eagle3(variant("missing", edit_sd=lambda sd: sd.pop("fc.weight")), target)

    def verifier(cfg):
        cfg["speculators_config"]["verifier"]["architectures"] = ["Qwen3ForCausalLM"]
    with pytest.raises(CheckpointError, match="verifier"):
        load_eagle3(variant("verifier", verifier), target)

    def layers(cfg):
        cfg["eagle_aux_hidden_state_layer_ids"] = [1, 2, 10]  # speculators ids: outputs of layers 0, 1, 9
    with pytest.raises(CheckpointError, match="out of range"):
        load_eagle3(variant("layers", layers), target)

    def embeddings(cfg):
        cfg["eagle_aux_hidden_state_layer_ids"] = [0, 1, 2]
    with pytest.raises(CheckpointError, match="embeddings"):
        load_eagle3(variant("embeddings", embeddings), target)
    with pytest.raises(CheckpointError, match="shape"):
        load_eagle3(variant("shape", edit_sd=lambda sd: sd.update({"lm_head.weight": sd["lm_head.weight"][:10]})), target)
    corrupt = tmp_path / "corrupt"
    corrupt.mkdir()
    (corrupt / "config.json").write_text((good / "config.json").read_text())
    (corrupt / "model.safetensors").write_bytes(b"\x00garbage" * 10)
    with pytest.raises(CheckpointError, match="unreadable"):
        load_eagle3(corrupt, target)
    with pytest.raises(ValueError, match="hidden size"):
        make_drafter(str(tmp_path / "hidden"), target, 1, 32, torch.float32, "cpu")


def test_mtp_checkpoint_shares_the_checked_load_path(llama, tmp_path):
    """MTP heads save and load through the same code as EAGLE-3 (drafters/head.py), so they are refused
    for the same reasons: stray tensors, a broken draft-vocabulary mapping, another target."""
    from safetensors.torch import load_file, save_file

    from verispec.drafters.mtp import MTPModel, load_mtp

    _, target = llama
    c = Eagle3Config.for_target(target, draft_vocab_size=40, aux_layers=[-1], intermediate_size=48)
    torch.manual_seed(0)
    m = MTPModel(c, embed_weight=target.model.embed_tokens.weight)
    m.set_vocab_mapping(*build_vocab_mapping(torch.arange(160, 0, -1).float(), 40))
    good = m.save(tmp_path / "good", dtype=torch.float32)
    back = load_mtp(good, target)
    assert back.state_dict().keys() == m.state_dict().keys()
    assert all(torch.equal(a, b) for a, b in zip(m.state_dict().values(), back.state_dict().values()))
    assert back.embed_weight is not None and back.config == c

    def variant(name, edit_sd):
        d = tmp_path / name
        d.mkdir()
        (d / "config.json").write_text((good / "config.json").read_text())
        sd = load_file(str(good / "model.safetensors"))
        edit_sd(sd)
        save_file(sd, str(d / "model.safetensors"))
        return d

    with pytest.raises(CheckpointError, match="unexpected tensor"):
        load_mtp(variant("stray", lambda sd: sd.update({"fc.weight": torch.zeros(2, 2)})), target)
    with pytest.raises(CheckpointError, match="draft vocabulary mapping"):
        load_mtp(variant("vocab", lambda sd: sd.update({"d2t": torch.ones(40, dtype=torch.long)})), target)
    other = ours_from_hf(build_hf("llama", num_hidden_layers=2, hidden_size=32, head_dim=8))
    with pytest.raises(CheckpointError, match="hidden size"):
        load_mtp(good, other)
    with pytest.raises(CheckpointError, match="not an MTP checkpoint"):
        load_mtp(random_eagle(target, draft_vocab=40).save(tmp_path / "eagle", dtype=torch.float32), target)
