"""P-EAGLE (drafters/peagle.py): the training forward equals serving, lossless drafting (greedy and
sampled, chains and trees), checkpoints (ours and speculators' own class), training and export."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import build_hf, ours_from_hf, random_ids, randomize_head
from verispec.drafters import make_drafter
from verispec.drafters.peagle import PEagleConfig, PEagleDrafter, PEagleModel, cod_rows, load_peagle
from test_eagle3 import _engine_run
from verispec.engine import Engine, EngineConfig
from verispec.sampling import SamplingParams

pytestmark = pytest.mark.usefixtures("single_torch_thread")


def random_peagle(target, draft_vocab=None, seed=0, counts=None, **kw) -> PEagleModel:
    kw.setdefault("mask_token_id", 3)
    c = PEagleConfig.for_target(target, draft_vocab_size=draft_vocab, aux_layers=kw.pop("aux_layers", None), **kw)
    torch.manual_seed(seed)
    m = PEagleModel(c, embed_weight=target.model.embed_tokens.weight)
    return randomize_head(m, counts)


@pytest.fixture(scope="module")
def llama():
    hf = build_hf("llama", num_hidden_layers=4)
    return hf, ours_from_hf(hf)


def _aux(target, ids, layers):
    out = target(ids, target.new_cache(ids.shape[0], 64), list(range(ids.shape[0])), torch.zeros(ids.shape[0], dtype=torch.long),
                 taps=tuple(layers))
    return torch.cat([out.hidden[i] for i in layers], -1)


def _serve_depths(m: PEagleModel, target, ids, aux, anchor: int, k: int) -> torch.Tensor:
    """The serving drafter's K distributions from anchor row `anchor` (one forward: rows 0..anchor from
    the target states, then k - 1 mask rows): [k, Vd]."""
    d = PEagleDrafter(m, target, 1, 32)
    hid = torch.cat([m.fuse(aux[0, : anchor + 1]), m.mask_state().expand(k - 1, -1)])[None]
    tok = torch.cat([ids[0, 1 : anchor + 2], torch.full((k - 1,), m.config.mask_token_id)])[None]
    _, states = d._run(tok, hid, torch.tensor([0]), [0])
    return m.head_logits(states[0, anchor : anchor + k])


@torch.no_grad()
@pytest.mark.parametrize("flags", [{}, {"fc_norm": True}, {"norm_before_fc": True}, {"num_layers": 2}])
def test_training_forward_is_the_serving_forward(llama, flags):
    _, target = llama
    m = random_peagle(target, draft_vocab=64, **flags)
    T, K = 10, 4
    ids = random_ids(T, 160, seed=3)
    aux = _aux(target, ids, m.config.aux_layers)
    valid = torch.ones_like(ids, dtype=torch.bool)
    full = m(aux, ids, valid, steps=K)
    assert [o.shape for o in full] == [(1, T - 1, 64)] * K
    for anchor in (0, 3, T - 2):
        serve = _serve_depths(m, target, ids, aux, anchor, K)
        for s in range(K):
            torch.testing.assert_close(full[s][0, anchor], serve[s], atol=1e-4, rtol=1e-4)
    # depth 0 is EAGLE-3's first step: the same weights run as an EAGLE-3 head give the same logits
    from verispec.drafters.eagle3 import Eagle3Model

    e3 = Eagle3Model(m.config, embed_weight=target.model.embed_tokens.weight)
    e3.load_state_dict({k: v for k, v in m.state_dict().items() if k != "mask_hidden"})
    torch.testing.assert_close(e3(aux, ids, valid, steps=1)[0], full[0], atol=1e-5, rtol=1e-5)
    # COD: the rows kept at each depth get exactly the logits they get in the full forward
    torch.manual_seed(1)
    rows = cod_rows(T - 1, K, 0.6, 0.2)
    assert all(set(rows[s].tolist()) <= set(rows[s - 1].tolist()) for s in range(1, K))
    assert [len(r) for r in rows] == [T - 1] + [min(len(rows[s - 1]), max(1, round((T - 1) * max(0.6**s, 0.2))))
                                               for s in range(1, K)]
    cod = m(aux, ids, valid, steps=K, rows=rows)
    for s in range(K):
        torch.testing.assert_close(cod[s][0], full[s][0, rows[s]], atol=1e-5, rtol=1e-5)


@torch.no_grad()
def test_padding_rows_do_not_change_real_rows(llama):
    _, target = llama
    m = random_peagle(target, draft_vocab=64)
    ids = random_ids(12, 160, seed=5, batch=2)
    aux = _aux(target, ids, m.config.aux_layers)
    valid = torch.ones_like(ids, dtype=torch.bool)
    valid[1, 7:] = False
    alone = m(aux[1:, :7], ids[1:, :7], valid[1:, :7], steps=3)
    padded = m(aux, ids, valid, steps=3)
    for s in range(3):
        torch.testing.assert_close(padded[s][1, : 6 - s], alone[s][0, : 6 - s], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("family", ["llama", "gemma3", "qwen3"])
@pytest.mark.parametrize("tree", [None, "dynamic:3", "static:2,2,1"])
def test_greedy_lossless_with_peagle(family, tree):
    hf = build_hf(family)
    target = ours_from_hf(hf)
    prompts = [random_ids(n, 160, seed=10 + n)[0].tolist() for n in (5, 12, 3, 9)]
    sp = SamplingParams(max_tokens=20, ignore_eos=True)
    plain, _ = _engine_run(target, None, prompts, sp)
    m = random_peagle(target, draft_vocab=100)
    kw = {"draft_tree": tree} if tree else {}
    out, seqs = _engine_run(target, PEagleDrafter(m, target, 3, 96 + 5), prompts, sp, k=5, **kw)
    assert out == plain
    assert sum(s.stats.drafted for s in seqs) > 0


def test_greedy_lossless_small_vocab_accepts_and_budgets_vary():
    """A 5-token vocabulary makes random drafts accepted now and then; requests of different budgets
    (their own num_draft_tokens) share batches."""
    hf = build_hf("llama", seed=3, vocab_size=5, num_hidden_layers=3)
    target = ours_from_hf(hf)
    m = random_peagle(target, aux_layers=[0, 1, 2], mask_token_id=0)
    prompts = [random_ids(n, 5, seed=40 + n)[0].tolist() for n in (4, 7, 2, 6, 5)]
    plain, _ = _engine_run(target, None, prompts, SamplingParams(max_tokens=24, ignore_eos=True))
    cfg = EngineConfig(model="unused", drafter=None, draft_policy="fixed", num_draft_tokens=5, dtype="float32",
                       max_batch_size=3, max_model_len=96)
    eng = Engine(target, None, cfg, PEagleDrafter(m, target, 3, 101))
    seqs = [eng.add_request(p, SamplingParams(max_tokens=24, ignore_eos=True), num_draft_tokens=1 + i % 5)
            for i, p in enumerate(prompts)]
    while eng.has_work:
        eng.step()
    assert [s.output_ids for s in seqs] == plain
    assert sum(s.stats.accepted for s in seqs) > 0
    # each request drafted up to its own budget
    assert [len(s.stats.accepted_at) for s in seqs] == [1 + i % 5 for i in range(len(prompts))]


@pytest.mark.parametrize("tree", [None, "dynamic:2"])
def test_sampled_lossless_tv(tree):
    """Total variation against the exact joint distribution (test_sampling_lossless's harness): chains
    drawn from the per-depth q (which does not depend on the tokens drafted before it), and trees of
    per-depth top-k children (the one-hot rule)."""
    import test_sampling_lossless as tsl

    hf = build_hf("llama", seed=3, vocab_size=tsl.V, num_hidden_layers=3)
    with torch.no_grad():
        hf.model.embed_tokens.weight.mul_(2.0)
        hf.lm_head.weight.mul_(2.0)
    target = ours_from_hf(hf)
    m = random_peagle(target, draft_vocab=4, counts=torch.tensor([5.0, 5, 1, 5, 5]), aux_layers=[0, 1, 2],
                      mask_token_id=2)
    for sp in (tsl.PLAIN, tsl.PROCESSED) if tree is None else (tsl.PLAIN,):
        drafter = PEagleDrafter(m, target, tsl.BATCH, tsl.MAX_LEN + tsl.K + 1)
        tv, thr, _ = tsl.drafter_tv(hf, target, drafter, sp, 1200, tree=tree)
        assert tv < thr, (sp, tree, tv, thr)


def test_save_load_roundtrip_export_and_bad_mask_token(llama, tmp_path, capsys):
    from verispec.cli import main

    hf, target = llama
    m = random_peagle(target, draft_vocab=64, fc_norm=True, mask_token_id=7)
    m.config.verifier = "tiny-llama"
    m.save(tmp_path / "ck", dtype=torch.float32)
    cfg = json.loads((tmp_path / "ck" / "config.json").read_text())
    assert cfg["speculators_model_type"] == "peagle" and cfg["architectures"] == ["PEagleSpeculator"]
    assert cfg["mask_token_id"] == cfg["ptd_token_id"] == 7 and cfg["embed_requires_grad"] is False
    back = load_peagle(tmp_path / "ck", target)
    assert back.config.mask_token_id == 7 and back.config.fc_norm and back.config.aux_layers == m.config.aux_layers
    for (k, a), (_, b) in zip(m.state_dict().items(), back.state_dict().items()):
        assert torch.equal(a, b), k
    for spec in (str(tmp_path / "ck"), f"peagle:{tmp_path / 'ck'}"):
        d = make_drafter(spec, target, 2, 64, torch.float32, "cpu")
        assert type(d) is PEagleDrafter and d.target_taps == tuple(m.config.aux_layers)
    with pytest.raises(ValueError, match="not 'eagle3'"):
        make_drafter(f"eagle3:{tmp_path / 'ck'}", target, 2, 64, torch.float32, "cpu")
    # vLLM serves it as eagle3 with parallel drafting
    capsys.readouterr()
    assert main(["export", "--vllm", str(tmp_path / "ck"), "-k", "5"]) == 0
    out = capsys.readouterr().out
    spec = json.loads(next(ln for ln in out.splitlines() if ln.startswith("#") and "speculative-config" in ln)
                      .split("'")[1])
    assert spec == {"method": "eagle3", "model": str(tmp_path / "ck"), "num_speculative_tokens": 5,
                    "parallel_drafting": True}
    # a mask token outside the target's vocabulary, or none at all, is refused by name
    cfg["mask_token_id"] = cfg["ptd_token_id"] = 10_000
    (tmp_path / "ck" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="mask_token_id 10000 is outside the target's vocabulary"):
        make_drafter(str(tmp_path / "ck"), target, 2, 64, torch.float32, "cpu")
    del cfg["mask_token_id"], cfg["ptd_token_id"]
    (tmp_path / "ck" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="needs mask_token_id"):
        make_drafter(str(tmp_path / "ck"), target, 2, 64, torch.float32, "cpu")


def test_export_loads_in_speculators_peagle_class(llama, tmp_path):
    """Our checkpoint in speculators' own PEagleDraftModel: the same tensors, and its training
    forward (COD anchors and depths, its mask) gives the logits ours gives at those rows."""
    try:
        from speculators.models.attention import create_float_mask
        from speculators.models.peagle import PEagleDraftModel
        from speculators.losses import resolve_loss_config
        from speculators.models.peagle.data import generate_cod_sample_indices
    except Exception as e:  # noqa: BLE001
        pytest.skip(f"speculators cannot be imported ({type(e).__name__}: {e})")
    hf, target = llama
    vpath = tmp_path / "verifier"
    hf.save_pretrained(vpath)
    m = random_peagle(target, draft_vocab=64, fc_norm=True, mask_token_id=7)
    m.config.verifier = str(vpath)
    m.save(tmp_path / "ck", dtype=torch.float32)
    theirs = PEagleDraftModel.from_pretrained(str(tmp_path / "ck")).eval()
    assert theirs.mask_token_id == 7
    sd = theirs.state_dict()
    for k, v in m.state_dict().items():
        assert torch.equal(sd[k].float(), v.float()), k
    with torch.no_grad():  # speculators loads the verifier's embedding only when training (as in test_eagle3_speculators)
        theirs.embed_tokens.weight.copy_(target.model.embed_tokens.weight)
    theirs = theirs.float()
    theirs.config.transformer_layer_config._attn_implementation = "eager"
    for layer in theirs.layers:
        layer.self_attn.config._attn_implementation = "eager"
    theirs._attn_impl, theirs._create_mask_fn = "eager", create_float_mask
    T, K = 12, 3
    ids = random_ids(T, 160, seed=8)
    aux = _aux(target, ids, m.config.aux_layers)
    n = T - 1
    last = aux[:, :, : target.config.hidden_size]  # only their loss reads it
    grabbed = []
    hook = theirs.lm_head.register_forward_hook(lambda mod, inp, out: grabbed.append(out.float()))
    torch.manual_seed(5)
    anchor, depth = generate_cod_sample_indices(n, torch.ones(1, n), num_depths=K, down_sample_ratio=0.8,
                                                down_sample_ratio_min=0.5)
    torch.manual_seed(5)
    with torch.no_grad():
        theirs(hidden_states=aux[:, :n], input_ids=ids[:, 1:], document_ids=torch.zeros(1, n, dtype=torch.long),
               verifier_last_hidden_states=last[:, 1:], num_depths=K, down_sample_ratio=0.8, down_sample_ratio_min=0.5,
               loss_config=resolve_loss_config("kl_div", implementation="eager"))
    hook.remove()
    assert int(depth.max()) == K - 1
    rows = [anchor[depth == s] for s in range(K)]
    with torch.no_grad():
        ours = m(aux, ids, torch.ones_like(ids, dtype=torch.bool), steps=K, rows=rows)
    torch.testing.assert_close(torch.cat(ours, 1), grabbed[0], atol=1e-4, rtol=1e-4)


# --------------------------------------------------------------------------------------------
# training (the tiny target and greedy data of test_train_eagle3)

from test_train_eagle3 import V as TINY_V, _cfg, check_trained_drafter, tiny  # noqa: E402,F401  (a module fixture)


def test_training_raises_acceptance_and_matches_the_engine(tiny, tmp_path):
    """`verispec train --method peagle`: COD-sampled depths, exported in the speculators format."""
    from verispec.train.dataset import HiddenStateData
    from verispec.train.trainer import build_model, train

    target, folder, data, _ = tiny
    cfg = _cfg(data, tmp_path / "pe", method="peagle", steps=120, save_every=1000, lr=1e-2, ttt_steps=3,
               intermediate_size=96, draft_vocab_size=TINY_V, warmup_ratio=0.05, export_dtype="float32",
               train_lm_head=True, num_layers=2)
    untrained = build_model(cfg, target, HiddenStateData(data)).eval()
    assert isinstance(untrained, PEagleModel) and untrained.config.mask_token_id == target.config.pad_token_id
    ev = train(cfg, target)
    assert ev["acceptance_unconditional"][0] > 0.3, ev
    assert json.loads((tmp_path / "pe" / "config.json").read_text())["para_depths"] == 3
    check_trained_drafter(tiny, cfg, untrained, ev, PEagleDrafter, "P-EAGLE")


def test_warm_start_from_an_eagle3_drafter(tiny, tmp_path):
    """--method peagle --init-from an EAGLE-3 folder: P-EAGLE's depth 1 is that EAGLE-3 head exactly
    (same weights, same logits on the same states); only the mask state starts fresh. Another head
    shape, or a drafter of a third kind, is refused by name."""
    from verispec.drafters.eagle3 import load_eagle3
    from verispec.drafters.head import CheckpointError
    from verispec.train.trainer import train

    target, folder, data, _ = tiny
    train(_cfg(data, tmp_path / "e3", draft_vocab_size=16), target)
    # more depths than the EAGLE-3 was trained with is fine: speculative_tokens is not a weight shape
    train(_cfg(data, tmp_path / "pe", method="peagle", ttt_steps=3, init_from=str(tmp_path / "e3"),
               draft_vocab_size=16, lr=0.0), target)
    e3, pe = load_eagle3(tmp_path / "e3", target), load_peagle(tmp_path / "pe", target)
    shared = e3.state_dict()
    assert set(pe.state_dict()) - set(shared) == {"mask_hidden"}
    assert all(torch.equal(shared[k], pe.state_dict()[k]) for k in shared)
    ids = random_ids(9, TINY_V, seed=5)
    aux = _aux(target, ids, e3.config.aux_layers)
    valid = torch.ones_like(ids, dtype=torch.bool)
    with torch.no_grad():
        torch.testing.assert_close(pe(aux, ids, valid, steps=2)[0], e3(aux, ids, valid, steps=1)[0])
    # a deeper head: the new layer starts as the identity, so depth 1 still drafts as the EAGLE-3
    train(_cfg(data, tmp_path / "deep", method="peagle", ttt_steps=3, init_from=str(tmp_path / "e3"),
               draft_vocab_size=16, lr=0.0, num_layers=2), target)
    deep = load_peagle(tmp_path / "deep", target)
    assert len(deep.layers) == 2 and not deep.layers[1].mlp.down_proj.weight.any()
    with torch.no_grad():
        torch.testing.assert_close(deep(aux, ids, valid, steps=2)[0], e3(aux, ids, valid, steps=1)[0])
    with pytest.raises(CheckpointError, match="intermediate_size"):
        train(_cfg(data, tmp_path / "other", method="peagle", init_from=str(tmp_path / "e3"), draft_vocab_size=16,
                   intermediate_size=32), target)
    with pytest.raises(CheckpointError, match="num_layers.*more --num-layers than its init, not fewer"):
        train(_cfg(data, tmp_path / "shallow", method="peagle", init_from=str(tmp_path / "deep"), draft_vocab_size=16),
              target)
    train(_cfg(data, tmp_path / "mtp", method="mtp", draft_vocab_size=16), target)
    with pytest.raises(CheckpointError, match="not a --method peagle drafter; start from a P-EAGLE or EAGLE-3"):
        train(_cfg(data, tmp_path / "x", method="peagle", init_from=str(tmp_path / "mtp"), draft_vocab_size=16), target)
