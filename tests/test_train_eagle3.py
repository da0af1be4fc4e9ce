"""Training toolkit: data generation (shards, loss mask, resume), losses, exact resume, DDP, end to end."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import build_hf, ours_from_hf, random_ids
from verispec.drafters.eagle3 import Eagle3Drafter, load_eagle3
from verispec.engine import Engine, EngineConfig
from verispec.train.data import build_dataset, capture
from verispec.train.dataset import HiddenStateData, collate
from verispec.train.losses import eagle3_loss
from verispec.train.trainer import TrainConfig, build_model, train
from verispec.sampling import SamplingParams

pytestmark = pytest.mark.usefixtures("single_torch_thread")
ROOT = Path(__file__).resolve().parents[1]
V = 48


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A 4-layer random Llama (saved as an HF folder for subprocesses) and greedy data for it.

    Embeddings scaled x12 make the residual stream lean on the current token, so the target's text is
    learnable from 48 short samples (a fully random target's next-next token is not)."""
    hf = build_hf("llama", num_hidden_layers=4, seed=1, vocab_size=V)
    with torch.no_grad():
        hf.model.embed_tokens.weight.mul_(12.0)
    folder = tmp_path_factory.mktemp("target")
    hf.save_pretrained(folder)
    target = ours_from_hf(hf)
    prompts = [random_ids(n, V, seed=200 + i)[0].tolist() for i, n in enumerate([4, 6, 9, 5, 7, 3, 8, 6] * 6)]
    data = tmp_path_factory.mktemp("data")
    build_dataset(target, prompts, data, [0, 2, 3], max_tokens=20, shard_size=16, batch_size=8,
                  meta={"model": str(folder)})
    return target, folder, data, prompts


def test_data_shards_index_mask_and_states(tiny):
    target, folder, data, prompts = tiny
    index = json.loads((data / "index.json").read_text())
    assert index["samples"] == len(prompts) == 48 and len(index["shards"]) == 3
    assert all(sh["target_dtype"] == "float32" for sh in index["shards"])  # each shard says its numerics
    d = HiddenStateData(data)
    s = d.samples[5]
    n_prompt = len(prompts[5])
    assert s.ids[:n_prompt].tolist() == prompts[5]
    assert not s.mask[:n_prompt].any() and s.mask[n_prompt:].all() and len(s.ids) == n_prompt + 20
    aux, last = capture(target, s.ids.tolist(), [0, 2, 3])
    assert torch.equal(aux, s.aux) and torch.equal(last, s.last)
    # greedy regeneration: the stored response is the target's own greedy output
    eng = Engine(target, None, EngineConfig(model="x", drafter=None, draft_policy="fixed", dtype="float32", max_batch_size=1), None)
    seq = eng.add_request(prompts[5], SamplingParams(max_tokens=20, ignore_eos=True))
    while eng.has_work:
        eng.step()
    assert seq.output_ids == s.ids[n_prompt:].tolist()
    assert int(d.token_counts.sum()) == sum(int(x.mask.sum()) for x in d.samples)


def test_max_prompts_reads_the_first_shards_only(tiny):
    """--max-prompts keeps an earlier run's data budget on an extended data set: the samples, the
    held-out split and the draft vocabulary's counts are those of the first shards alone."""
    _, _, data, prompts = tiny
    full, first = HiddenStateData(data), HiddenStateData(data, max_prompts=32)
    assert len(first.samples) == 32 and len(full.samples) == 48
    assert all(torch.equal(a.ids, b.ids) for a, b in zip(first.samples, full.samples))
    assert first.split(0.25)[1] == [j for j in full.split(0.25)[1] if j < 32]
    assert torch.equal(first.token_counts, sum(torch.bincount(x.ids[x.mask], minlength=V) for x in full.samples[:32]))
    with pytest.raises(ValueError, match="does not end at a shard boundary"):
        HiddenStateData(data, max_prompts=20)


def test_data_resume_after_kill_and_no_hidden(tiny, tmp_path):
    target, folder, data, prompts = tiny
    kw = dict(max_tokens=20, shard_size=16, batch_size=8, meta={"model": str(folder)})
    part = tmp_path / "part"
    build_dataset(target, prompts, part, [0, 2, 3], stop_after_shards=1, **kw)  # "killed" after one shard
    (part / "shard-00001.safetensors.tmp").write_bytes(b"half-written")
    assert json.loads((part / "index.json").read_text())["prompts_done"] == 16
    build_dataset(target, prompts[:32], part, [0, 2, 3], **kw)  # resumed, with fewer prompts than planned
    assert json.loads((part / "index.json").read_text())["prompts_done"] == 32
    build_dataset(target, prompts, part, [0, 2, 3], **kw)  # ... and extended to all of them
    a, b = HiddenStateData(data), HiddenStateData(part)
    assert len(a.samples) == len(b.samples)
    for x, y in zip(a.samples, b.samples):
        assert torch.equal(x.ids, y.ids) and torch.equal(x.aux, y.aux)
    assert torch.equal(a.token_counts, b.token_counts)
    with pytest.raises(ValueError, match="other arguments"):
        build_dataset(target, prompts, part, [0, 1, 3], **kw)
    ids_only = tmp_path / "ids"
    build_dataset(target, prompts[:8], ids_only, [0, 2, 3], no_hidden=True, **kw)
    c = HiddenStateData(ids_only)
    assert c.samples[0].aux is None and not c.has_hidden
    assert not any(f.name.endswith(".tmp") for f in part.iterdir())


def test_loss_only_on_masked_positions_and_zero_for_target_copy(tiny):
    target, folder, data, _ = tiny
    d = HiddenStateData(data)
    model = build_model(TrainConfig(data=str(data), out="unused", draft_vocab_size=40), target, d)
    b = collate(d.samples[:3])
    d2t = model.draft_to_target()
    t2d = model.target_to_draft(torch.arange(V))
    head = target.head_weight()[d2t].detach()
    with torch.no_grad():
        outs = model(b["aux"].float(), b["ids"], b["valid"], steps=2)
        l1, m1 = eagle3_loss(outs, b, head, None, d2t, t2d, 0.8)
        b2 = dict(b)
        b2["last"] = b["last"].clone()
        b2["last"][~b["mask"]] = torch.randn_like(b2["last"][~b["mask"]])  # scramble prompt positions
        # positions whose *next* token is a prompt token are not scored: prompt states only matter at
        # the last prompt position (it predicts the first response token)
        for i, s in enumerate(d.samples[:3]):
            p = int((~s.mask).sum())
            b2["last"][i, p - 1] = b["last"][i, p - 1]
        l2, _ = eagle3_loss(outs, b2, head, None, d2t, t2d, 0.8)
        assert torch.allclose(l1, l2)
        # a drafter whose step-0 logits are the target's own has zero step-0 KL
        from verispec.train.losses import target_logits
        T = b["ids"].shape[1]
        perfect = [torch.cat([target_logits(b["last"][:, 1 : T - 1], head, None), torch.zeros(3, 1, 40)], 1)]
        l0, m0 = eagle3_loss(perfect, b, head, None, d2t, t2d, 0.8)
        assert abs(float(l0)) < 1e-5
        assert float(m0["acc_0"][0] / m0["acc_0"][1]) > 0.9  # greedy data: target argmax == data token (in the draft vocab)
        # training at the response anchors only: the same acceptance counts as the full unroll
        from verispec.train.losses import response_anchors
        a = response_anchors(b)
        part = model(b["aux"].float(), b["ids"], b["valid"], steps=2, anchors=a)
        la, ma = eagle3_loss(part, b, head, None, d2t, t2d, 0.8, anchors=a)
        for k in ("acc_0", "acc_all_0", "acc_1", "acc_all_1"):
            assert torch.equal(ma[k][0], m1[k][0]) and torch.equal(ma[k][1], m1[k][1]), k
        assert torch.isfinite(la) and float(ma["acc_0"][1]) > 0


def _cfg(data, out, **kw):
    base = dict(data=str(data), out=str(out), draft_vocab_size=32, ttt_steps=2, lr=3e-3, batch_size=8, steps=6,
                save_every=3, bf16=False, progress=False, val_fraction=0.125, intermediate_size=64)
    base.update(kw)
    return TrainConfig(**base)


def test_resume_after_kill_is_exact(tiny, tmp_path):
    target, folder, data, _ = tiny
    train(_cfg(data, tmp_path / "straight"), target)
    r = train(_cfg(data, tmp_path / "killed", stop_after=4), target)  # checkpoint at 3, "killed" at 4
    assert r == {"stopped_at": 4}
    train(_cfg(data, tmp_path / "killed"), target)  # resumes from step 3
    a = load_eagle3(tmp_path / "straight", target).state_dict()
    b = load_eagle3(tmp_path / "killed", target).state_dict()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    log = [json.loads(x) for x in (tmp_path / "killed" / "train_log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log] == [1, 2, 3, 4, 5, 6]  # step 4 of the killed run is not repeated
    straight = [json.loads(x) for x in (tmp_path / "straight" / "train_log.jsonl").read_text().splitlines()]
    assert log[-1]["loss"] == straight[-1]["loss"]


def test_time_budget_fits_the_schedule_and_a_resumed_run_keeps_it(tiny, tmp_path, monkeypatch):
    """--time-budget: the probe's time per step sets the total (at most what was asked; the reserve
    left for the final evaluation); a run killed after the fit resumes with the fitted total and
    schedule from its checkpoint (no second fit), ending with the uninterrupted run's weights."""
    from verispec.train import trainer

    cfg = _cfg(None, None, steps=1000, time_budget_s=100.0)
    per = trainer.BUDGET_PROBE_STEPS - 1
    # 2 s a step, 10 s spent: (100 * (1 - reserve) - 10) / 2 steps after the probe's
    assert trainer.fit_total(cfg, 6, 1000, 2.0 * per, 10.0) == 6 + int((100 * (1 - trainer.BUDGET_RESERVE) - 10) / 2)
    assert trainer.fit_total(cfg, 6, 20, 2.0 * per, 10.0) == 20  # never more than asked for
    assert trainer.fit_total(cfg, 6, 1000, 500.0 * per, 99.0) == 7  # over budget already: one more step

    calls = []
    monkeypatch.setattr(trainer, "BUDGET_PROBE_STEPS", 2)
    monkeypatch.setattr(trainer, "fit_total", lambda *a, **k: calls.append(a[1]) or 7)
    kw = dict(steps=50, time_budget_s=60.0, save_every=2)
    train(_cfg(data := tiny[2], tmp_path / "straight", **kw), tiny[0])
    assert calls == [2]  # fitted once, after the probe's two steps
    log = [json.loads(x) for x in (tmp_path / "straight" / "train_log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log] == list(range(1, 8))
    assert log[-1]["lr"] == pytest.approx(3e-3 * 0.1)  # the cosine ends at the fitted total
    assert train(_cfg(data, tmp_path / "killed", stop_after=4, **kw), tiny[0]) == {"stopped_at": 4}
    train(_cfg(data, tmp_path / "killed", **kw), tiny[0])  # resumes at step 4 with total 7
    assert calls == [2, 2]  # the resumed run did not fit again
    a = load_eagle3(tmp_path / "straight", tiny[0]).state_dict()
    b = load_eagle3(tmp_path / "killed", tiny[0]).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    # killed right after the fit, long before a periodic checkpoint: the fit itself was saved
    kw["save_every"] = 50
    assert train(_cfg(data, tmp_path / "early", stop_after=2, **kw), tiny[0]) == {"stopped_at": 2}
    train(_cfg(data, tmp_path / "early", **kw), tiny[0])
    assert calls == [2, 2, 2]
    c = load_eagle3(tmp_path / "early", tiny[0]).state_dict()
    assert all(torch.equal(a[k], c[k]) for k in a)


def test_warm_start_continues_from_a_drafter_and_refuses_another_shape(tiny, tmp_path):
    """--init-from: at learning rate 0 the exported weights are the init's; training on from them
    keeps the init's draft vocabulary (trained on the first shard, whose counts pick other ids
    than the whole data's); a drafter of another shape or a missing folder is refused by name."""
    from verispec.drafters.head import CheckpointError

    target, folder, data, _ = tiny
    train(_cfg(data, tmp_path / "first", max_prompts=16, draft_vocab_size=16), target)
    first = load_eagle3(tmp_path / "first", target).state_dict()
    train(_cfg(data, tmp_path / "same", init_from=str(tmp_path / "first"), draft_vocab_size=16, lr=0.0), target)
    same = load_eagle3(tmp_path / "same", target).state_dict()
    assert all(torch.equal(first[k], same[k]) for k in first)
    fresh = build_model(_cfg(data, tmp_path / "x", draft_vocab_size=16), target, HiddenStateData(data))
    assert not torch.equal(fresh.d2t, first["d2t"])  # the whole data would pick another vocabulary
    train(_cfg(data, tmp_path / "cont", init_from=str(tmp_path / "first"), draft_vocab_size=16), target)
    cont = load_eagle3(tmp_path / "cont", target).state_dict()
    assert torch.equal(cont["d2t"], first["d2t"]) and torch.equal(cont["lm_head.weight"], first["lm_head.weight"])
    assert not torch.equal(cont["fc.weight"], first["fc.weight"])
    with pytest.raises(CheckpointError, match="intermediate_size"):
        train(_cfg(data, tmp_path / "other", init_from=str(tmp_path / "first"), draft_vocab_size=16,
                   intermediate_size=32), target)
    with pytest.raises(CheckpointError, match="no config.json"):
        train(_cfg(data, tmp_path / "none", init_from=str(tmp_path / "nowhere")), target)
    # a killed warm-started run resumes from its checkpoint, even once the init folder is gone
    import shutil

    shutil.copytree(tmp_path / "first", tmp_path / "init")
    kw = dict(init_from=str(tmp_path / "init"), draft_vocab_size=16)
    assert train(_cfg(data, tmp_path / "killed", stop_after=4, **kw), target) == {"stopped_at": 4}
    shutil.rmtree(tmp_path / "init")
    train(_cfg(data, tmp_path / "killed", **kw), target)
    resumed = load_eagle3(tmp_path / "killed", target).state_dict()
    assert all(torch.equal(resumed[k], cont[k]) for k in cont)  # = the uninterrupted warm-started run
    with pytest.raises(CheckpointError, match="not a --method mtp drafter"):
        train(_cfg(data, tmp_path / "mtp", init_from=str(tmp_path / "first"), method="mtp", draft_vocab_size=16), target)


def test_eval_log_curves_and_a_fresh_start_over_stale_logs(tiny, tmp_path):
    from PIL import Image

    target, folder, data, _ = tiny
    out = tmp_path / "run"
    out.mkdir()
    (out / "train_log.jsonl").write_text('{"step": 1, "loss": 99}\n{"step": 2, "loss": 99}\n')  # no checkpoint
    (out / "eval_log.jsonl").write_text('{"step": 2, "expected_tau": 9}\n')
    train(_cfg(data, out, eval_every=2), target)
    log = [json.loads(x) for x in (out / "train_log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log] == [1, 2, 3, 4, 5, 6] and all(r["loss"] != 99 for r in log)
    evals = [json.loads(x) for x in (out / "eval_log.jsonl").read_text().splitlines()]
    assert [e["step"] for e in evals] == [2, 4, 6] and evals[0]["expected_tau"] != 9
    final = json.loads((out / "eval.json").read_text())
    assert evals[-1]["acceptance_conditional"] == final["acceptance_conditional"]
    with Image.open(out / "training_curves.png") as im:
        assert im.size[0] > 500


def test_ddp_two_processes_equal_one(tiny, tmp_path):
    target, folder, data, _ = tiny
    common = ["--data", str(data), "--model", str(folder), "--draft-vocab-size", "32", "--ttt-steps", "2",
              "--steps", "3", "--batch-size", "8", "--save-every", "3", "--no-bf16", "--no-progress",
              "--lr", "3e-3", "--intermediate-size", "64", "--threads", "1", "--val-fraction", "0.125"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1"}
    one = subprocess.run([sys.executable, "-m", "verispec.cli", "train", "--out", str(tmp_path / "one"), *common],
                         env=env, capture_output=True, text=True, timeout=60)
    assert one.returncode == 0, one.stderr[-2000:]
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = str(sock.getsockname()[1])
    two = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                          port, "-m", "verispec.cli", "train", "--out", str(tmp_path / "two"), *common],
                         env=env, capture_output=True, text=True, timeout=90)
    assert two.returncode == 0, two.stderr[-3000:]
    a = load_eagle3(tmp_path / "one", target).state_dict()
    b = load_eagle3(tmp_path / "two", target).state_dict()
    for k in a:
        torch.testing.assert_close(a[k].float(), b[k].float(), atol=1e-2, rtol=1e-2)  # bf16 export
    sa = torch.load(tmp_path / "one" / "checkpoint" / "state.pt", weights_only=False)["model"]
    sb = torch.load(tmp_path / "two" / "checkpoint" / "state.pt", weights_only=False)["model"]
    for k in sa:
        torch.testing.assert_close(sa[k], sb[k], atol=1e-5, rtol=1e-4)  # fp32 training state


def _acceptance(target, drafter, prompts):
    cfg = EngineConfig(model="x", drafter=None, draft_policy="fixed", num_draft_tokens=3, dtype="float32", max_batch_size=4, max_model_len=64)
    eng = Engine(target, None, cfg, drafter)
    seqs = [eng.add_request(p, SamplingParams(max_tokens=20, ignore_eos=True)) for p in prompts]
    while eng.has_work:
        eng.step()
    acc = sum(s.stats.accepted for s in seqs) / max(1, sum(s.stats.drafted for s in seqs))
    return acc, [s.output_ids for s in seqs]


def check_trained_drafter(tiny, cfg, untrained, ev, drafter_cls, name: str) -> None:
    """What every drafter kind's training test checks after `train(cfg)`: the checkpoint in cfg.out
    loads by its folder (`make_drafter`), its engine acceptance beats the untrained drafter's by 0.2
    with outputs equal to plain decoding's, and the trainer's held-out acceptance is the engine's
    at the same anchors (train/consistency.py), position by position within 0.01."""
    from verispec.drafters import make_drafter
    from verispec.train.consistency import engine_acceptance_at_every_anchor

    target, _, data, _ = tiny
    prompts = [random_ids(n, V, seed=900 + n)[0].tolist() for n in (5, 7, 4, 9)]
    _, plain = _acceptance(target, None, prompts)
    a0, out0 = _acceptance(target, drafter_cls(untrained, target, 4, 70), prompts)
    trained = make_drafter(cfg.out, target, 4, 70, torch.float32, "cpu")
    assert type(trained) is drafter_cls
    a1, out1 = _acceptance(target, trained, prompts)
    assert out0 == out1 == plain
    print(f"{name} engine acceptance rate: untrained {a0:.3f} -> trained {a1:.3f}; held-out conditional "
          f"{[round(x, 3) for x in ev['acceptance_conditional']]}")
    assert a1 > a0 + 0.2, (a0, a1)
    d = HiddenStateData(data)
    _, val = d.split(cfg.val_fraction, cfg.seed)
    samples = [(d.samples[j].ids, d.samples[j].mask) for j in val]
    ours = engine_acceptance_at_every_anchor(target, drafter_cls(trained.model, target, 16, 70), samples, 3,
                                             max_model_len=64)
    print(f"trainer {ev['acceptance_unconditional']} vs engine {ours['acceptance_unconditional']} "
          f"at {ours['anchors']} anchors")
    assert ours["anchors"] > 50
    for a, b in zip(ev["acceptance_unconditional"], ours["acceptance_unconditional"]):
        assert abs(a - b) <= 0.01, (ev["acceptance_unconditional"], ours["acceptance_unconditional"])


def test_end_to_end_training_raises_acceptance(tiny, tmp_path):
    target, folder, data, _ = tiny
    cfg = _cfg(data, tmp_path / "e2e", steps=100, save_every=1000, lr=1e-2, ttt_steps=3, intermediate_size=96,
               draft_vocab_size=V, warmup_ratio=0.05, export_dtype="float32", train_lm_head=True)
    d = HiddenStateData(data)
    untrained = build_model(cfg, target, d).eval()
    ev = train(cfg, target)
    assert ev["acceptance_unconditional"][0] > 0.3, ev
    trained = load_eagle3(tmp_path / "e2e", target)
    prompts = [random_ids(n, V, seed=900 + n)[0].tolist() for n in (5, 7, 4, 9)]
    plain, _ = _acceptance(target, None, prompts)
    a0, out0 = _acceptance(target, Eagle3Drafter(untrained, target, 4, 70), prompts)
    a1, out1 = _acceptance(target, Eagle3Drafter(trained, target, 4, 70), prompts)
    assert out0 == out1  # lossless either way
    print(f"EAGLE-3 engine acceptance rate: untrained {a0:.3f} -> trained {a1:.3f}; held-out {ev['acceptance_conditional']}")
    assert a1 > a0 + 0.2 and a1 > 0.3, (a0, a1)

    # train <-> serve: the trainer's held-out acceptance, measured by the engine at the same anchors
    from verispec.train.consistency import engine_acceptance_at_every_anchor

    _, val = d.split(cfg.val_fraction, cfg.seed)
    samples = [(d.samples[j].ids, d.samples[j].mask) for j in val]
    ours = engine_acceptance_at_every_anchor(target, Eagle3Drafter(trained, target, 16, 70), samples, 3, max_model_len=64)
    print(f"trainer {ev['acceptance_unconditional']} vs engine {ours['acceptance_unconditional']} "
          f"at {ours['anchors']} anchors")
    assert ours["anchors"] > 50
    for a, b in zip(ev["acceptance_unconditional"], ours["acceptance_unconditional"]):
        assert abs(a - b) <= 0.01, (ev["acceptance_unconditional"], ours["acceptance_unconditional"])


def test_bf16_and_ce_options_run(tiny, tmp_path):
    target, folder, data, _ = tiny
    for loss in ("kl", "ce"):
        ev = train(_cfg(data, tmp_path / loss, steps=2, bf16=True, loss=loss, fc_norm=True, norm_output=True), target)
        assert len(ev["acceptance_unconditional"]) == 2
        cfg = json.loads((tmp_path / loss / "config.json").read_text())
        assert cfg["fc_norm"] and cfg["norm_output"] and cfg["dtype"] == "bfloat16"


def test_cli_export_train_and_data_errors(tiny, tmp_path, capsys):
    from verispec.cli import main

    target, folder, data, _ = tiny
    train(_cfg(data, tmp_path / "d", steps=1), target)
    assert main(["export", "--vllm", str(tmp_path / "d")]) == 0
    out = capsys.readouterr().out
    assert "vllm serve" in out and '"method": "eagle3"' in out and "--speculative-config" in out
    (tmp_path / "d" / "model.safetensors").write_bytes(b"broken")
    assert main(["export", "--vllm", str(tmp_path / "d")]) == 2
    assert "unreadable" in capsys.readouterr().err
    assert main(["train", "--data", str(tmp_path / "nothing"), "--out", str(tmp_path / "x"), "--model", str(folder)]) == 2
    assert "index.json" in capsys.readouterr().err
    assert main(["data", "--model", str(folder), "--prompts", "nosuchset", "--num-samples", "2",
                 "--out", str(tmp_path / "y")]) == 2


def test_online_training_from_token_ids_matches_stored_states(tiny, tmp_path):
    """--no-hidden data: the trainer runs the target in the loop and sees the same states."""
    target, folder, data, prompts = tiny
    ids_only = tmp_path / "ids"
    build_dataset(target, prompts, ids_only, [0, 2, 3], max_tokens=20, shard_size=16, batch_size=8, no_hidden=True,
                  meta={"model": str(folder)})
    # the same token counts, so the same draft vocabulary
    assert torch.equal(HiddenStateData(ids_only).token_counts, HiddenStateData(data).token_counts)
    train(_cfg(data, tmp_path / "stored", steps=3), target)
    train(_cfg(ids_only, tmp_path / "online", steps=3), target)
    a = [json.loads(x)["loss"] for x in (tmp_path / "stored" / "train_log.jsonl").read_text().splitlines()]
    b = [json.loads(x)["loss"] for x in (tmp_path / "online" / "train_log.jsonl").read_text().splitlines()]
    assert a == pytest.approx(b, rel=2e-2)


def test_mtp_head_trains_and_drafts_losslessly(tiny, tmp_path):
    from verispec.drafters import make_drafter
    from verispec.drafters.mtp import MTPModel, load_mtp

    target, folder, data, _ = tiny
    cfg = _cfg(data, tmp_path / "mtp", method="mtp", steps=100, save_every=1000, lr=1e-2, ttt_steps=3,
               intermediate_size=96, draft_vocab_size=V, export_dtype="float32")
    d = HiddenStateData(data)
    untrained = build_model(cfg, target, d).eval()
    assert isinstance(untrained, MTPModel) and not untrained.lm_head.weight.requires_grad
    ev = train(cfg, target)
    assert ev["acceptance_unconditional"][0] > 0.3, ev
    trained = load_mtp(tmp_path / "mtp", target)
    for k, v in trained.state_dict().items():  # the LM head is the target's, untouched
        if k == "lm_head.weight":
            assert torch.equal(v, target.head_weight()[trained.draft_to_target()])
    prompts = [random_ids(n, V, seed=900 + n)[0].tolist() for n in (5, 7, 4, 9)]
    plain = _acceptance(target, None, prompts)[1]
    a0, out0 = _acceptance(target, Eagle3Drafter(untrained, target, 4, 70), prompts)
    drafter = make_drafter(str(tmp_path / "mtp"), target, 4, 70, torch.float32, "cpu")
    assert drafter.target_taps == (-1,)
    a1, out1 = _acceptance(target, drafter, prompts)
    assert out0 == out1 == plain
    print(f"MTP engine acceptance rate: untrained {a0:.3f} -> trained {a1:.3f}")
    assert a1 > a0 + 0.2, (a0, a1)


def test_held_out_split_is_stable_when_data_grows():
    small, big = HiddenStateData.__new__(HiddenStateData), HiddenStateData.__new__(HiddenStateData)
    small.samples, big.samples = [None] * 40, [None] * 400
    t_small, v_small = small.split(0.1, seed=3)
    t_big, v_big = big.split(0.1, seed=3)
    assert v_small == [j for j in v_big if j < 40] and t_small == [j for j in t_big if j < 40]
    assert 20 <= len(v_big) <= 60 and sorted(t_big + v_big) == list(range(400))


def test_prompt_sources_and_sampled_regeneration_is_deterministic(tiny, tmp_path):
    from verispec.train.data import DataError, load_prompts

    assert len(load_prompts("mtbench", 5)) == 5 and "messages" in load_prompts("mtbench", 1)[0]
    assert load_prompts("humaneval", 2)[0]["text"].startswith("from typing") or "def " in load_prompts("humaneval", 1)[0]["text"]
    f = tmp_path / "p.jsonl"
    f.write_text('{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "old"}]}\n'
                 '{"prompt": "raw text"}\n')
    assert load_prompts(str(f), 10) == [{"messages": [{"role": "user", "content": "hi"}]}, {"text": "raw text"}]
    f.write_text('{"foo": 1}\n')
    with pytest.raises(DataError, match="expected"):
        load_prompts(str(f), 10)
    with pytest.raises(DataError, match="sharegpt, mtbench"):
        load_prompts("no-such-source", 1)
    target, folder, data, prompts = tiny
    kw = dict(max_tokens=12, temperature=0.8, shard_size=8, batch_size=4, seed=5)
    build_dataset(target, prompts[:16], tmp_path / "a", [0, 2, 3], **kw)
    build_dataset(target, prompts[:16], tmp_path / "b", [0, 2, 3], stop_after_shards=1, **kw)
    build_dataset(target, prompts[:16], tmp_path / "b", [0, 2, 3], **kw)
    a, b = HiddenStateData(tmp_path / "a"), HiddenStateData(tmp_path / "b")
    assert [s.ids.tolist() for s in a.samples] == [s.ids.tolist() for s in b.samples]


# ---- crash safety: a kill at any point of a checkpoint save or a data shard write ---------------------
class Killed(BaseException):
    """Stands for SIGKILL: nothing after it runs (not even `except Exception` blocks)."""


class KillAt:
    """Counts the file-system operations of a save (rmtree, replace, fsync, torch.save) and "kills"
    the process at operation `at`: before it runs, or for torch.save halfway through its write."""

    def __init__(self, monkeypatch, at: int | None):
        import shutil

        self.at, self.n = at, 0
        for mod, name in ((shutil, "rmtree"), (os, "replace"), (os, "fsync"), (torch, "save")):
            orig = getattr(mod, name)
            monkeypatch.setattr(mod, name, self._wrap(orig, name))

    def _wrap(self, orig, name):
        def op(*args, **kw):
            self.n += 1
            if self.n == self.at:
                if name == "save":  # a torch.save cut short: half of the bytes reach the file
                    import io

                    buf = io.BytesIO()
                    orig(args[0], buf)
                    dst = args[1]
                    data = buf.getvalue()[: len(buf.getvalue()) // 2]
                    dst.write(data) if hasattr(dst, "write") else Path(dst).write_bytes(data)
                raise Killed(f"killed at operation {self.n} ({name})")
            return orig(*args, **kw)
        return op


def _resumed_at(capsys) -> int | None:
    import re

    m = re.search(r"resuming from .* at step (\d+)/", capsys.readouterr().out)
    return int(m.group(1)) if m else None


def test_checkpoint_save_killed_at_every_point_resumes_from_a_good_checkpoint(tiny, tmp_path, monkeypatch, capsys):
    import shutil

    target, folder, data, _ = tiny
    cfg = lambda out, **kw: _cfg(data, out, steps=4, save_every=2, **kw)  # noqa: E731
    train(cfg(tmp_path / "straight"), target)
    straight = load_eagle3(tmp_path / "straight", target).state_dict()
    train(cfg(tmp_path / "base", stop_after=2), target)  # a checkpoint at step 2
    with monkeypatch.context() as m:  # how many operations does the save at step 4 take?
        probe = KillAt(m, None)
        shutil.copytree(tmp_path / "base", tmp_path / "probe")
        probe.n = 0
        train(cfg(tmp_path / "probe"), target)
    n_ops = probe.n
    assert n_ops >= 8
    capsys.readouterr()
    for k in range(1, n_ops + 1):
        out = tmp_path / f"kill{k}"
        shutil.copytree(tmp_path / "base", out)
        with monkeypatch.context() as m:
            with pytest.raises(Killed):
                KillAt(m, k)
                train(cfg(out), target)
        capsys.readouterr()
        train(cfg(out), target)  # the same command again
        assert _resumed_at(capsys) in (2, 4), f"killed at operation {k}: resumed from scratch"
        trained = load_eagle3(out, target).state_dict()
        assert all(torch.equal(straight[x], trained[x]) for x in straight), k
        log = [json.loads(x)["step"] for x in (out / "train_log.jsonl").read_text().splitlines()]
        assert log == [1, 2, 3, 4], (k, log)
        assert sorted(p.name for p in out.iterdir() if p.name.startswith("checkpoint")) == ["checkpoint"]


def test_killed_between_the_two_renames_resumes_from_the_newer_checkpoint(tiny, tmp_path, capsys):
    """The layout the kill in issue 15 left: no checkpoint/, the new one in .tmp, the old in .old."""
    import shutil

    target, folder, data, _ = tiny
    out = tmp_path / "run"
    train(_cfg(data, out, steps=6, save_every=2, stop_after=2), target)
    shutil.copytree(out / "checkpoint", tmp_path / "at2")
    train(_cfg(data, out, steps=6, save_every=2, stop_after=2), target)  # now at 4
    (out / "checkpoint").rename(out / "checkpoint.tmp")
    shutil.copytree(tmp_path / "at2", out / "checkpoint.old")
    capsys.readouterr()
    train(_cfg(data, out, steps=6, save_every=2), target)
    assert _resumed_at(capsys) == 4
    # with only the old one left (the .tmp half-written), it is the one resumed, and kept until replaced
    out2 = tmp_path / "run2"
    shutil.copytree(out, out2)
    shutil.rmtree(out2 / "checkpoint")
    shutil.copytree(tmp_path / "at2", out2 / "checkpoint.old")
    (out2 / "checkpoint.tmp").mkdir()
    (out2 / "checkpoint.tmp" / "state.pt.part").write_bytes(b"half")
    capsys.readouterr()
    train(_cfg(data, out2, steps=6, save_every=2), target)
    assert _resumed_at(capsys) == 2


def test_resume_refuses_changed_arguments_and_names_a_truncated_checkpoint(tiny, tmp_path):
    from verispec.cli import main

    target, folder, data, _ = tiny
    out = tmp_path / "run"
    train(_cfg(data, out, stop_after=3), target)  # checkpoint at 3
    for change in (dict(batch_size=4), dict(lr=1e-3), dict(ttt_steps=3), dict(method="mtp")):
        with pytest.raises(ValueError, match="was written with") as e:
            train(_cfg(data, out, **change), target)
        key = next(iter(change))
        assert f"--{key.replace('_', '-')}" in str(e.value)
    state = out / "checkpoint" / "state.pt"
    state.write_bytes(state.read_bytes()[: state.stat().st_size // 2])
    with pytest.raises(ValueError, match=f"{state}: unreadable checkpoint"):
        train(_cfg(data, out), target)
    # through the command line: one line, exit code 2
    args = ["train", "--data", str(data), "--out", str(out), "--model", str(folder), "--no-progress"]
    assert main(args) == 2


def test_truncated_data_shard_is_named_and_regenerated(tiny, tmp_path, capsys):
    import shutil

    target, folder, data, prompts = tiny
    copy = tmp_path / "data"
    shutil.copytree(data, copy)
    shard = copy / "shard-00001.safetensors"
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    with pytest.raises(ValueError, match=f"{shard}: truncated"):
        HiddenStateData(copy)
    capsys.readouterr()
    build_dataset(target, prompts, copy, [0, 2, 3], max_tokens=20, shard_size=16, batch_size=8,
                  meta={"model": str(folder)})  # the same command again notices it
    assert "shard-00001.safetensors: truncated" in capsys.readouterr().out
    a, b = HiddenStateData(data), HiddenStateData(copy)
    assert [s.ids.tolist() for s in a.samples] == [s.ids.tolist() for s in b.samples]
    assert all(torch.equal(x.aux, y.aux) for x, y in zip(a.samples, b.samples))
    assert torch.equal(a.token_counts, b.token_counts)


def test_data_killed_at_every_write_counts_each_shard_once(tiny, tmp_path, monkeypatch):
    """Kill `verispec data` at each replace of the second shard (shard, index, counts), resume: the
    token counts and the samples are those of an uninterrupted run (not the first shard's twice)."""
    from safetensors.torch import load_file

    target, folder, data, prompts = tiny
    kw = dict(max_tokens=20, shard_size=8, batch_size=8, meta={"model": str(folder)}, no_hidden=True)
    straight = tmp_path / "straight"
    build_dataset(target, prompts[:16], straight, [0, 2, 3], **kw)
    want = HiddenStateData(straight).token_counts
    for k in (1, 2, 3):
        out = tmp_path / f"kill{k}"
        build_dataset(target, prompts[:16], out, [0, 2, 3], stop_after_shards=1, **kw)
        with monkeypatch.context() as m:
            calls = {"n": 0}
            orig = os.replace

            def replace(a, b, k=k):
                calls["n"] += 1
                if calls["n"] == k:
                    raise Killed(f"killed at replace {k}")
                return orig(a, b)

            m.setattr(os, "replace", replace)
            with pytest.raises(Killed):
                build_dataset(target, prompts[:16], out, [0, 2, 3], **kw)
        build_dataset(target, prompts[:16], out, [0, 2, 3], **kw)  # resumed
        d = HiddenStateData(out)
        assert torch.equal(d.token_counts, want), k
        assert torch.equal(load_file(str(out / "token_freq.safetensors"))["counts"], want), k
        assert [s.ids.tolist() for s in d.samples] == [s.ids.tolist() for s in HiddenStateData(straight).samples]


def test_broken_drafter_folders_are_refused_naming_the_problem(tiny, tmp_path):
    import shutil

    from verispec.drafters import make_drafter

    target, folder, data, _ = tiny
    make = lambda spec: make_drafter(spec, target, 2, 64, torch.float32, "cpu")  # noqa: E731
    for method in ("eagle3", "mtp"):
        good = tmp_path / method
        train(_cfg(data, good, steps=1, method=method), target)
        cfg_text = (good / "config.json").read_text()
        broken = tmp_path / f"{method}-broken"
        shutil.copytree(good, broken)
        (broken / "config.json").write_text(cfg_text[:-20])  # a bare folder, config.json cut short
        for spec in (str(broken), f"{method}:{broken}"):
            with pytest.raises(ValueError) as e:
                make(spec)
            assert f"{broken / 'config.json'}" in str(e.value) and "unknown drafter" not in str(e.value), str(e.value)
        cfg = json.loads(cfg_text)
        layer = cfg["transformer_layer_config"] if method == "eagle3" else cfg
        layer["hidden_size"] = str(target.config.hidden_size)  # "64", not 64
        (broken / "config.json").write_text(json.dumps(cfg))
        with pytest.raises(ValueError, match="hidden_size must be a non-negative integer, got '64'") as e:
            make(str(broken))
        assert "64 != 64" not in str(e.value)


def test_block_loss_kinds_and_the_dspark_confidence_term():
    """block_loss per kind against the formulas written out here: kl = KL(p_t || q), tv = 0.1 CE +
    0.9 TV, and with DSpark's confidence logits every kind adds BCE(confidence, 1 - TV)."""
    import math

    import torch.nn.functional as F

    from verispec.train.losses import block_loss

    g = torch.Generator().manual_seed(0)
    B, T, H, Vd, S = 1, 8, 6, 5, 3
    ids = torch.randint(0, Vd, (B, T), generator=g)
    batch = {"ids": ids, "mask": torch.ones(B, T, dtype=torch.bool), "valid": torch.ones(B, T, dtype=torch.bool),
             "last": torch.randn(B, T, H, generator=g)}
    head = torch.randn(Vd, H, generator=g)
    d2t, t2d = torch.arange(Vd), torch.arange(Vd)
    anchors, ok = torch.tensor([[1, 3]]), torch.ones(1, 2, dtype=torch.bool)
    logits = torch.randn(B, 2, S, Vd, generator=g)
    conf = torch.randn(B, 2, S, generator=g)

    def expected(kind, with_conf, first_slot):
        total = 0.0
        for s in range(S - first_slot):
            vals = []
            for a in anchors[0].tolist():
                q = logits[0, anchors[0].tolist().index(a), s + first_slot].log_softmax(-1)
                p = (batch["last"][0, a + s] @ head.t()).log_softmax(-1)
                tok = int(ids[0, a + 1 + s])
                tv = 0.5 * float((q.exp() - p.exp()).abs().sum())
                v = float((p.exp() * (p - q)).sum()) if kind == "kl" else 0.1 * -float(q[tok]) + 0.9 * tv
                if with_conf:
                    c = conf[0, anchors[0].tolist().index(a), s + first_slot]
                    v += float(F.binary_cross_entropy_with_logits(c, torch.tensor(1 - tv)))
                vals.append(v)
            total += math.exp(-s / 4.0) * sum(vals) / len(vals)
        return total

    for kind in ("kl", "tv"):
        got, _ = block_loss(logits, anchors, ok, batch, head, None, d2t, t2d, kind=kind)
        assert float(got) == pytest.approx(expected(kind, False, 1), rel=1e-5)
        got, metrics = block_loss(logits, anchors, ok, batch, head, None, d2t, t2d, kind=kind, first_slot=0,
                                  confidence=conf)
        assert float(got) == pytest.approx(expected(kind, True, 0), rel=1e-5) and "conf_0" in metrics
