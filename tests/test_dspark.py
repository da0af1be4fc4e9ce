"""DSpark (drafters/dspark.py): training equals serving, lossless drafting with the Markov head (greedy
and sampled, chains and trees) and a negative control that reports the base logits as q, checkpoints
(ours and speculators' own class), Sequential Temperature Scaling, training."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from conftest import build_hf, ours_from_hf, random_ids, randomize_head
from verispec.drafters import make_drafter
from verispec.drafters.dspark import (DSparkConfig, DSparkDrafter, DSparkModel, expected_calibration_error, load_dspark,
                                      sequential_temperature_scaling)
from test_eagle3 import _engine_run
from verispec.engine import Engine, EngineConfig
from verispec.sampling import SamplingParams, probs

pytestmark = pytest.mark.usefixtures("single_torch_thread")


def random_dspark(target, draft_vocab=None, seed=0, counts=None, markov_scale=1.0, **kw) -> DSparkModel:
    kw.setdefault("mask_token_id", 3)
    kw.setdefault("block_size", 4)
    kw.setdefault("markov_rank", 8)
    c = DSparkConfig.for_target(target, draft_vocab_size=draft_vocab, aux_layers=kw.pop("aux_layers", None), **kw)
    torch.manual_seed(seed)
    m = DSparkModel(c, embed_weight=target.model.embed_tokens.weight)
    randomize_head(m, counts)
    with torch.no_grad():
        m.markov_head.markov_w1.weight.normal_(0, markov_scale)  # a Markov bias that matters
    return m


@pytest.fixture(scope="module")
def llama():
    hf = build_hf("llama", num_hidden_layers=4)
    return hf, ours_from_hf(hf)


def _states(target, ids, layers):
    out = target(ids, target.new_cache(ids.shape[0], 64), list(range(ids.shape[0])),
                 torch.zeros(ids.shape[0], dtype=torch.long), taps=tuple(layers))
    return {i: out.hidden[i] for i in layers}, torch.cat([out.hidden[i] for i in layers], -1)


@torch.no_grad()
def test_training_forward_is_the_serving_forward(llama):
    """Teacher-forced training logits and confidences of an anchor block equal the serving drafter's
    slots fed the same previous tokens."""
    _, target = llama
    m = random_dspark(target, draft_vocab=64, aux_layers=[0, 2, 3], num_layers=2)
    T = 12
    ids = random_ids(T, 160, seed=3)
    hidden, aux = _states(target, ids, m.config.aux_layers)
    anchors = torch.tensor([[2, 5, 7]])
    logits, conf = m(aux, ids, torch.ones_like(ids, dtype=torch.bool), anchors)
    assert logits.shape == (1, 3, 4, 64) and conf.shape == (1, 3, 4)
    for j, a in enumerate(anchors[0].tolist()):
        d = DSparkDrafter(m, target, 2, 64)
        seq = SimpleNamespace(drafter_state=None, prompt_ids=ids[0].tolist(), params=SimpleNamespace(max_tokens=8))
        d.on_commit(seq, 0, {i: h[0, :a] for i, h in hidden.items()})
        h = d.block_states([seq.drafter_state.slot], [a], [int(ids[0, a])])[0]  # [S, H]
        lg, cf = m.heads(h, m.head_logits(h), ids[0, a : a + 4])
        torch.testing.assert_close(lg, logits[0, j], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(cf, conf[0, j], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("family", ["llama", "gemma3", "qwen3"])
@pytest.mark.parametrize("tree", [None, "dynamic:3", "static:2,2,1"])
def test_greedy_lossless_with_dspark(family, tree):
    hf = build_hf(family)
    target = ours_from_hf(hf)
    prompts = [random_ids(n, 160, seed=10 + n)[0].tolist() for n in (5, 12, 3, 9)]
    sp = SamplingParams(max_tokens=20, ignore_eos=True)
    plain, _ = _engine_run(target, None, prompts, sp)
    m = random_dspark(target, draft_vocab=100, block_size=5)
    kw = {"draft_tree": tree} if tree else {}
    out, seqs = _engine_run(target, DSparkDrafter(m, target, 3, 96 + 5), prompts, sp, k=5, **kw)
    assert out == plain
    assert sum(s.stats.drafted for s in seqs) > 0


def test_draft_features_are_the_calibrated_confidences_of_the_parent_token(llama):
    """Each drafted node carries logit(c_k) / T_k computed from its parent's token, the planner's input."""
    _, target = llama
    m = random_dspark(target, draft_vocab=100, block_size=4)
    m.config.confidence_temperatures = [2.0, 0.5, 1.0, 3.0]
    d = DSparkDrafter(m, target, 1, 64)
    eng = Engine(target, None, EngineConfig(model="unused", drafter=None, draft_policy="fixed", num_draft_tokens=4,
                                            dtype="float32", max_batch_size=1, max_model_len=64), d)
    s = eng.add_request(random_ids(6, 160, seed=1)[0].tolist(), SamplingParams(max_tokens=20, ignore_eos=True))
    eng.step()
    assert not s.finished and s.drafter_state.n_obs == len(s.tokens) - 1
    draft = d.propose([s], [4])[0]
    assert len(draft.tokens) == 4
    h = d.block_states([s.drafter_state.slot], [len(s.tokens) - 1], [s.tokens[-1]])[0]
    prev = torch.tensor([s.tokens[-1]] + draft.tokens[:3])
    _, conf = m.heads(h, m.head_logits(h), prev)
    torch.testing.assert_close(torch.tensor([f[0] for f in draft.features]), conf / m.temperatures(), atol=1e-5, rtol=1e-5)


class _BaseQDrafter(DSparkDrafter):
    """Negative control: tokens drawn from the Markov-corrected q_k, but the verifier told q is the
    backbone's softmax(U_k) alone."""

    def propose(self, seqs, ks):
        drafts = super().propose(seqs, ks)
        for s, d in zip(seqs, drafts):
            if not d.tokens:
                continue
            h = self.block_states([s.drafter_state.slot], [len(s.tokens) - 1], [s.tokens[-1]])[0]
            base = self.model.to_target_vocab(self.model.head_logits(h))[: len(d.tokens)]
            d.q = probs(base, s.params)
        return drafts


@pytest.mark.parametrize("tree", [None, "dynamic:2"])
def test_sampled_lossless_tv_and_the_base_q_control_fails(tree):
    """Total variation against the exact joint distribution (test_sampling_lossless's harness); the
    drafter that reports U_k instead of the Markov-corrected q_k must fail the same test."""
    import test_sampling_lossless as tsl

    hf = build_hf("llama", seed=3, vocab_size=tsl.V, num_hidden_layers=3)
    with torch.no_grad():
        hf.model.embed_tokens.weight.mul_(2.0)
        hf.lm_head.weight.mul_(2.0)
    target = ours_from_hf(hf)
    m = random_dspark(target, draft_vocab=4, counts=torch.tensor([5.0, 5, 1, 5, 5]), aux_layers=[0, 1, 2],
                      mask_token_id=2, block_size=tsl.K, markov_scale=3.0)
    cases = [(DSparkDrafter, sp, True) for sp in ((tsl.PLAIN, tsl.PROCESSED) if tree is None else (tsl.PLAIN,))]
    if tree is None:
        cases.append((_BaseQDrafter, tsl.PLAIN, False))
    for cls, sp, lossless in cases:
        drafter = cls(m, target, tsl.BATCH, tsl.MAX_LEN + tsl.K + 1)
        tv, thr, _ = tsl.drafter_tv(hf, target, drafter, sp, 1200, tree=tree)
        if lossless:
            assert tv < thr, (cls.__name__, sp, tree, tv, thr)
        else:
            assert tv > 2 * thr, (cls.__name__, tv, thr)  # the control is caught, by a wide margin


def test_save_load_roundtrip_and_bad_checkpoints(llama, tmp_path, capsys):
    from verispec.cli import main

    _, target = llama
    m = random_dspark(target, draft_vocab=64, mask_token_id=7, block_size=5)
    m.config.confidence_temperatures = [1.5, 0.8, 1.0, 1.2, 2.0]
    m.config.verifier = "tiny-llama"
    m.save(tmp_path / "ck", dtype=torch.float32)
    cfg = json.loads((tmp_path / "ck" / "config.json").read_text())
    assert cfg["speculators_model_type"] == "dspark" and cfg["sample_from_anchor"] and cfg["markov_rank"] == 8
    assert cfg["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 5
    back = load_dspark(tmp_path / "ck", target)
    assert back.config.confidence_temperatures == [1.5, 0.8, 1.0, 1.2, 2.0]
    for (k, a), (_, b) in zip(m.state_dict().items(), back.state_dict().items()):
        assert torch.equal(a, b), k
    d = make_drafter(str(tmp_path / "ck"), target, 2, 64, torch.float32, "cpu")
    assert type(d) is DSparkDrafter
    capsys.readouterr()
    assert main(["export", "--vllm", str(tmp_path / "ck")]) == 0
    spec = json.loads(capsys.readouterr().out.splitlines()[-1].split("'")[1])
    assert spec == {"method": "dspark", "model": str(tmp_path / "ck"), "num_speculative_tokens": 5}
    for change, msg in [({"markov_head_type": "rnn"}, "markov_head_type 'rnn' is not supported"),
                        ({"markov_rank": 0}, "markov_rank must be >= 1"),
                        ({"sample_from_anchor": False}, "without sample_from_anchor"),
                        ({"confidence_temperatures": [1.0, -2]}, "positive numbers")]:
        (tmp_path / "ck" / "config.json").write_text(json.dumps({**cfg, **change}))
        with pytest.raises(ValueError, match=msg):
            make_drafter(str(tmp_path / "ck"), target, 2, 64, torch.float32, "cpu")


def test_export_loads_in_speculators_dspark_class(llama, tmp_path):
    """Our checkpoint in speculators' own DSparkDraftModel: the same tensors, and its training forward
    gives our teacher-forced logits (Markov-corrected) at its anchors."""
    try:
        from speculators.losses import resolve_loss_config
        from speculators.models.attention import create_float_mask
        from speculators.models.dflash.utils import select_anchors
        from speculators.models.dspark import DSparkDraftModel
    except Exception as e:  # noqa: BLE001
        pytest.skip(f"speculators cannot be imported ({type(e).__name__}: {e})")
    hf, target = llama
    vpath = tmp_path / "verifier"
    hf.save_pretrained(vpath)
    m = random_dspark(target, draft_vocab=64, mask_token_id=7, block_size=4, num_layers=2)
    m.config.verifier = str(vpath)
    m.save(tmp_path / "ck", dtype=torch.float32)
    theirs = DSparkDraftModel.from_pretrained(str(tmp_path / "ck"))
    sd = theirs.state_dict()
    for k, v in m.state_dict().items():
        assert torch.equal(sd[k].float(), v.float()), k
    with torch.no_grad():
        theirs.embed_tokens.weight.copy_(target.model.embed_tokens.weight)
    theirs = theirs.float().eval()
    theirs.config.transformer_layer_config._attn_implementation = "eager"
    for layer in theirs.layers:
        layer.self_attn.config._attn_implementation = "eager"
    theirs._attn_impl, theirs._create_mask_fn = "eager", create_float_mask
    T, A = 14, 3
    ids = random_ids(T, 160, seed=8)
    _, aux = _states(target, ids, m.config.aux_layers)
    loss_mask = torch.ones(1, T)
    torch.manual_seed(5)
    anchors, _ = select_anchors(loss_mask, A, m.config.block_size)
    torch.manual_seed(5)
    import speculators.models.dspark.core as core

    captured = {}
    real = core.compute_metrics

    def spy(logits, targets, confidence_logits, *a, **kw):  # their loss needs Triton's fused TV kernel
        captured["logits"], captured["conf"] = logits.float(), confidence_logits.float()
        return torch.zeros(()), {}

    core.compute_metrics = spy
    try:
        with torch.no_grad():
            theirs(hidden_states=aux, input_ids=ids, loss_mask=loss_mask, verifier_last_hidden_states=aux[..., :64],
                   document_ids=torch.zeros(1, T, dtype=torch.long), max_anchors=A,
                   loss_config=resolve_loss_config("kl_div", implementation="eager"))
    finally:
        core.compute_metrics = real
    with torch.no_grad():
        lg, conf = m(aux, ids, torch.ones_like(ids, dtype=torch.bool), anchors[None])
    S = m.config.block_size
    torch.testing.assert_close(lg.reshape(1, A * S, -1), captured["logits"], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(conf.reshape(1, A * S), captured["conf"], atol=1e-4, rtol=1e-4)


def test_sequential_temperature_scaling_recovers_a_known_miscalibration():
    """Confidences whose true probability is sigmoid(z / 3) at every position: STS finds T_k near 3
    and cuts the ECE of the cumulative products; ECE itself is checked on a hand-made case."""
    assert expected_calibration_error(torch.tensor([0.9, 0.9, 0.1, 0.1]), torch.tensor([1, 0, 0, 0])) == \
        pytest.approx(0.5 * abs(0.9 - 0.5) + 0.5 * abs(0.1 - 0.0))
    g = torch.Generator().manual_seed(0)
    N, S = 20000, 4
    z = torch.randn(N, S, generator=g) * 4
    ok = torch.rand(N, S, generator=g) < torch.sigmoid(z / 3.0)
    accepted = ok.cumprod(1).bool()  # draft k survives when it and all before it do
    temps, before, after = sequential_temperature_scaling(z, accepted, torch.ones(N, S, dtype=torch.bool))
    assert all(abs(t - 3.0) < 0.6 for t in temps), temps
    assert all(a < b / 3 for a, b in zip(after, before)), (before, after)


# --------------------------------------------------------------------------------------------
# training (the tiny target and greedy data of test_train_eagle3)

from test_train_eagle3 import V as TINY_V, _cfg, check_trained_drafter, tiny  # noqa: E402,F401  (a module fixture)


def test_training_raises_acceptance_matches_the_engine_and_calibrates(tiny, tmp_path):
    from verispec.train.dataset import HiddenStateData
    from verispec.train.trainer import build_model, train

    target, folder, data, _ = tiny
    cfg = _cfg(data, tmp_path / "ds", method="dspark", steps=120, save_every=1000, lr=1e-2, ttt_steps=3,
               intermediate_size=96, draft_vocab_size=TINY_V, warmup_ratio=0.05, export_dtype="float32",
               train_lm_head=True, num_layers=2, anchors=16)
    untrained = build_model(cfg, target, HiddenStateData(data)).eval()
    assert isinstance(untrained, DSparkModel) and untrained.config.block_size == 3  # every slot drafts
    ev = train(cfg, target)
    assert ev["acceptance_unconditional"][0] > 0.3, ev
    saved = json.loads((tmp_path / "ds" / "config.json").read_text())
    assert len(saved["confidence_temperatures"]) == 3  # STS on the held-out split
    cal = json.loads((tmp_path / "ds" / "calibration.json").read_text())
    assert len(cal["ece_before"]) == len(cal["ece_after"]) == 3 and (tmp_path / "ds" / "reliability.png").is_file()
    check_trained_drafter(tiny, cfg, untrained, ev, DSparkDrafter, "DSpark")
