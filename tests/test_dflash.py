"""DFlash (drafters/dflash.py): the training forward equals the serving forward, lossless drafting
(greedy and sampled, chains and trees), checkpoints (ours and speculators' own class), training."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from conftest import build_hf, ours_from_hf, random_ids, randomize_head
from verispec.drafters import make_drafter
from verispec.drafters.dflash import DFlashConfig, DFlashDrafter, DFlashModel, default_dflash_layers, load_dflash
from test_eagle3 import _engine_run
from verispec.engine import Engine, EngineConfig
from verispec.sampling import SamplingParams

pytestmark = pytest.mark.usefixtures("single_torch_thread")


def random_dflash(target, draft_vocab=None, seed=0, counts=None, **kw) -> DFlashModel:
    kw.setdefault("mask_token_id", 3)
    kw.setdefault("block_size", 5)
    c = DFlashConfig.for_target(target, draft_vocab_size=draft_vocab, aux_layers=kw.pop("aux_layers", None), **kw)
    torch.manual_seed(seed)
    m = DFlashModel(c, embed_weight=target.model.embed_tokens.weight)
    return randomize_head(m, counts)


@pytest.fixture(scope="module")
def llama():
    hf = build_hf("llama", num_hidden_layers=4)
    return hf, ours_from_hf(hf)


def _states(target, ids, layers):
    out = target(ids, target.new_cache(ids.shape[0], 64), list(range(ids.shape[0])),
                 torch.zeros(ids.shape[0], dtype=torch.long), taps=tuple(layers))
    return {i: out.hidden[i] for i in layers}, torch.cat([out.hidden[i] for i in layers], -1)


def test_default_layers():
    assert default_dflash_layers(36, 5) == [1, 9, 17, 25, 33]  # DFlash's choice for Qwen3-8B
    assert default_dflash_layers(18, 1) == [9]
    assert default_dflash_layers(4, 3) == [1]  # a 4-layer target has one layer between 1 and L - 3


@torch.no_grad()
@pytest.mark.parametrize("num_layers,fc_norm", [(1, False), (2, False), (1, True)])
def test_training_forward_is_the_serving_forward(llama, num_layers, fc_norm):
    """Every anchor block of the training forward equals the serving drafter's block for the same
    context (its context rows written by on_commit, in two chunks), also with anchors batched."""
    _, target = llama
    m = random_dflash(target, draft_vocab=64, num_layers=num_layers, aux_layers=[0, 2, 3], fc_norm=fc_norm)
    T = 12
    ids = random_ids(T, 160, seed=3)
    hidden, aux = _states(target, ids, m.config.aux_layers)
    valid = torch.ones_like(ids, dtype=torch.bool)
    anchors = torch.tensor([[1, 4, 7, 10]])
    train = m(aux, ids, valid, anchors)  # [1, 4, S, Vd]
    assert train.shape == (1, 4, 5, 64)
    for j, a in enumerate(anchors[0].tolist()):
        alone = m(aux, ids, valid, torch.tensor([[a]]))
        torch.testing.assert_close(alone[0, 0], train[0, j], atol=1e-5, rtol=1e-5)
        d = DFlashDrafter(m, target, 2, 64)
        seq = SimpleNamespace(drafter_state=None, prompt_ids=ids[0].tolist(), params=SimpleNamespace(max_tokens=8))
        cut = a // 2
        d.on_commit(seq, 0, {i: h[0, :cut] for i, h in hidden.items()})
        d.on_commit(seq, cut, {i: h[0, cut:a] for i, h in hidden.items()})
        serve = d.block_logits([seq.drafter_state.slot], [a], [int(ids[0, a])])
        torch.testing.assert_close(serve[0], train[0, j], atol=1e-4, rtol=1e-4)


@torch.no_grad()
def test_padding_and_invalid_context_rows(llama):
    _, target = llama
    m = random_dflash(target, draft_vocab=64)
    ids = random_ids(12, 160, seed=5, batch=2)
    _, aux = _states(target, ids, m.config.aux_layers)
    valid = torch.ones_like(ids, dtype=torch.bool)
    valid[1, 8:] = False
    anchors = torch.tensor([[2, 6], [3, 7]])
    both = m(aux, ids, valid, anchors)
    alone = m(aux[1:, :8], ids[1:, :8], valid[1:, :8], anchors[1:])
    torch.testing.assert_close(both[1], alone[0], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("family", ["llama", "gemma3", "qwen3"])
@pytest.mark.parametrize("tree", [None, "dynamic:3", "static:2,2,1"])
def test_greedy_lossless_with_dflash(family, tree):
    hf = build_hf(family)
    target = ours_from_hf(hf)
    prompts = [random_ids(n, 160, seed=10 + n)[0].tolist() for n in (5, 12, 3, 9)]
    sp = SamplingParams(max_tokens=20, ignore_eos=True)
    plain, _ = _engine_run(target, None, prompts, sp)
    m = random_dflash(target, draft_vocab=100, block_size=6)
    kw = {"draft_tree": tree} if tree else {}
    out, seqs = _engine_run(target, DFlashDrafter(m, target, 3, 96 + 5), prompts, sp, k=5, **kw)
    assert out == plain
    assert sum(s.stats.drafted for s in seqs) > 0


def test_greedy_lossless_small_vocab_budget_above_the_block():
    """A 5-token vocabulary makes random drafts accepted now and then; a budget larger than the block
    drafts S - 1 tokens."""
    hf = build_hf("llama", seed=3, vocab_size=5, num_hidden_layers=3)
    target = ours_from_hf(hf)
    m = random_dflash(target, aux_layers=[0, 1, 2], mask_token_id=0, block_size=4)
    prompts = [random_ids(n, 5, seed=40 + n)[0].tolist() for n in (4, 7, 2, 6, 5)]
    sp = SamplingParams(max_tokens=24, ignore_eos=True)
    plain, _ = _engine_run(target, None, prompts, sp)
    out, seqs = _engine_run(target, DFlashDrafter(m, target, 3, 101), prompts, sp, k=6)
    assert out == plain
    assert sum(s.stats.accepted for s in seqs) > 0
    assert max(len(s.stats.accepted_at) for s in seqs) == 3  # S - 1


@pytest.mark.parametrize("tree", [None, "dynamic:2"])
def test_sampled_lossless_tv(tree):
    """Total variation against the exact joint distribution (test_sampling_lossless's harness)."""
    import test_sampling_lossless as tsl

    hf = build_hf("llama", seed=3, vocab_size=tsl.V, num_hidden_layers=3)
    with torch.no_grad():
        hf.model.embed_tokens.weight.mul_(2.0)
        hf.lm_head.weight.mul_(2.0)
    target = ours_from_hf(hf)
    m = random_dflash(target, draft_vocab=4, counts=torch.tensor([5.0, 5, 1, 5, 5]), aux_layers=[0, 1, 2],
                      mask_token_id=2, block_size=tsl.K + 1)
    for sp in (tsl.PLAIN, tsl.PROCESSED) if tree is None else (tsl.PLAIN,):
        drafter = DFlashDrafter(m, target, tsl.BATCH, tsl.MAX_LEN + tsl.K + 1)
        tv, thr, _ = tsl.drafter_tv(hf, target, drafter, sp, 1200, tree=tree)
        assert tv < thr, (sp, tree, tv, thr)


def test_save_load_roundtrip_export_and_bad_checkpoints(llama, tmp_path, capsys):
    from verispec.cli import main

    _, target = llama
    m = random_dflash(target, draft_vocab=64, mask_token_id=7, block_size=6)
    m.config.verifier = "tiny-llama"
    m.save(tmp_path / "ck", dtype=torch.float32)
    cfg = json.loads((tmp_path / "ck" / "config.json").read_text())
    assert cfg["speculators_model_type"] == "dflash" and cfg["block_size"] == 6 and cfg["mask_token_id"] == 7
    assert cfg["aux_hidden_state_layer_ids"] == [i + 1 for i in m.config.aux_layers]
    assert cfg["transformer_layer_config"]["model_type"] == "qwen3"
    back = load_dflash(tmp_path / "ck", target)
    for (k, a), (_, b) in zip(m.state_dict().items(), back.state_dict().items()):
        assert torch.equal(a, b), k
    d = make_drafter(str(tmp_path / "ck"), target, 2, 64, torch.float32, "cpu")
    assert type(d) is DFlashDrafter and d.target_taps == tuple(m.config.aux_layers)
    capsys.readouterr()
    assert main(["export", "--vllm", str(tmp_path / "ck")]) == 0
    spec = json.loads(capsys.readouterr().out.splitlines()[-1].split("'")[1])
    assert spec == {"method": "dflash", "model": str(tmp_path / "ck"), "num_speculative_tokens": 5}
    for change, msg in [({"mask_token_id": 500}, "mask_token_id 500 is outside"),
                        ({"sample_from_anchor": True}, "sample_from_anchor is set"),
                        ({"block_size": 1}, "block_size must be at least 2"),
                        ({"aux_hidden_state_layer_ids": [0, 2]}, "layer ids >= 1")]:
        (tmp_path / "ck" / "config.json").write_text(json.dumps({**cfg, **change}))
        with pytest.raises(ValueError, match=msg):
            make_drafter(str(tmp_path / "ck"), target, 2, 64, torch.float32, "cpu")


@torch.no_grad()
def test_fc_norm_normalizes_each_target_state_and_is_refused_by_the_vllm_export(llama, tmp_path, capsys):
    """fc_norm: each target layer's state is normalized on its own before the fusion, so scaling one
    layer's states changes nothing; the flag survives save / load, and `export --vllm` refuses it
    (vLLM's DFlash would fuse the raw states)."""
    from verispec.cli import main

    _, target = llama
    m = random_dflash(target, draft_vocab=64, aux_layers=[0, 2, 3], fc_norm=True)
    with torch.no_grad():
        for nrm in m.fc_norm:
            nrm.weight.uniform_(0.5, 1.5)
    aux = torch.randn(1, 5, 3 * m.config.hidden_size)
    scaled = aux.clone()
    scaled[..., m.config.hidden_size : 2 * m.config.hidden_size] *= 1000.0  # one layer, 1000x larger
    torch.testing.assert_close(m.context(scaled), m.context(aux), atol=1e-4, rtol=1e-4)
    plain = random_dflash(target, draft_vocab=64, aux_layers=[0, 2, 3])
    assert not torch.allclose(plain.context(scaled), plain.context(aux), atol=1e-2)
    m.save(tmp_path / "ck", dtype=torch.float32)
    assert json.loads((tmp_path / "ck" / "config.json").read_text())["fc_norm"] is True
    back = load_dflash(tmp_path / "ck", target)
    assert back.config.fc_norm and torch.equal(back.context(aux), m.context(aux))
    assert "fc_norm" not in plain.config_json("bfloat16")  # the default format is speculators' own
    capsys.readouterr()
    assert main(["export", "--vllm", str(tmp_path / "ck")]) != 0
    assert "vLLM's implementation does not do" in capsys.readouterr().err


def test_full_vocabulary_checkpoint_takes_the_targets_head(llama, tmp_path):
    """speculators leaves lm_head out of a full-vocabulary DFlash checkpoint (it is the verifier's)."""
    from safetensors.torch import load_file, save_file

    _, target = llama
    m = random_dflash(target)
    m.save(tmp_path / "ck", dtype=torch.float32)
    sd = load_file(str(tmp_path / "ck" / "model.safetensors"))
    del sd["lm_head.weight"]
    save_file(sd, str(tmp_path / "ck" / "model.safetensors"))
    back = load_dflash(tmp_path / "ck", target)
    assert torch.equal(back.lm_head.weight, target.head_weight().float())
    with pytest.raises(ValueError, match="missing: lm_head.weight"):
        load_dflash(tmp_path / "ck")  # without the target there is no head to take


def test_export_loads_in_speculators_dflash_class(llama, tmp_path):
    """Our checkpoint in speculators' own DFlashDraftModel: the same tensors, and its training
    forward (its anchors, its anchor-block mask) gives the logits ours gives at those anchors."""
    try:
        from speculators.losses import resolve_loss_config
        from speculators.models.attention import create_float_mask
        from speculators.models.dflash import DFlashDraftModel
        from speculators.models.dflash.utils import select_anchors
    except Exception as e:  # noqa: BLE001
        pytest.skip(f"speculators cannot be imported ({type(e).__name__}: {e})")
    hf, target = llama
    vpath = tmp_path / "verifier"
    hf.save_pretrained(vpath)
    m = random_dflash(target, draft_vocab=64, mask_token_id=7, block_size=4, num_layers=2)
    m.config.verifier = str(vpath)
    m.save(tmp_path / "ck", dtype=torch.float32)
    theirs = DFlashDraftModel.from_pretrained(str(tmp_path / "ck"))
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
    grabbed = []
    hook = theirs.lm_head.register_forward_hook(lambda mod, inp, out: grabbed.append(out.float()))
    torch.manual_seed(5)
    with torch.no_grad():
        theirs(hidden_states=aux, input_ids=ids, loss_mask=loss_mask, verifier_last_hidden_states=aux[..., :64],
               document_ids=torch.zeros(1, T, dtype=torch.long), max_anchors=A,
               loss_config=resolve_loss_config("kl_div", implementation="eager"))
        ours = m(aux, ids, torch.ones_like(ids, dtype=torch.bool), anchors[None])
    hook.remove()
    torch.testing.assert_close(ours.reshape(1, A * m.config.block_size, -1), grabbed[0], atol=1e-4, rtol=1e-4)


# --------------------------------------------------------------------------------------------
# training (the tiny target and greedy data of test_train_eagle3)

from test_train_eagle3 import V as TINY_V, _cfg, check_trained_drafter, tiny  # noqa: E402,F401  (a module fixture)


def test_training_raises_acceptance_and_matches_the_engine(tiny, tmp_path):
    from verispec.train.dataset import HiddenStateData
    from verispec.train.trainer import build_model, train

    target, folder, data, _ = tiny
    cfg = _cfg(data, tmp_path / "df", method="dflash", steps=120, save_every=1000, lr=1e-2, ttt_steps=3,
               intermediate_size=96, draft_vocab_size=TINY_V, warmup_ratio=0.05, export_dtype="float32",
               train_lm_head=True, num_layers=2, anchors=16)
    untrained = build_model(cfg, target, HiddenStateData(data)).eval()
    assert isinstance(untrained, DFlashModel) and untrained.config.block_size == 4
    ev = train(cfg, target)
    assert ev["acceptance_unconditional"][0] > 0.3, ev
    check_trained_drafter(tiny, cfg, untrained, ev, DFlashDrafter, "DFlash")
