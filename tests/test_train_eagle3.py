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
from verispec.train.dataset import HiddenStateData, collate, global_batch
from verispec.train.losses import eagle3_loss
from verispec.train.trainer import TrainConfig, build_model, train
from verispec.verify import SamplingParams

pytestmark = pytest.mark.usefixtures("single_torch_thread")
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A 4-layer random Llama (saved as an HF folder for subprocesses) and greedy data for it."""
    hf = build_hf("llama", num_hidden_layers=4, seed=1)
    folder = tmp_path_factory.mktemp("target")
    hf.save_pretrained(folder)
    target = ours_from_hf(hf)
    prompts = [random_ids(n, 160, seed=200 + i)[0].tolist() for i, n in enumerate([4, 6, 9, 5, 7, 3, 8, 6] * 6)]
    data = tmp_path_factory.mktemp("data")
    build_dataset(target, prompts, data, [0, 2, 3], max_tokens=20, shard_size=16, batch_size=8,
                  meta={"model": str(folder)})
    return target, folder, data, prompts


def test_data_shards_index_mask_and_states(tiny):
    target, folder, data, prompts = tiny
    index = json.loads((data / "index.json").read_text())
    assert index["samples"] == len(prompts) == 48 and len(index["shards"]) == 3
    d = HiddenStateData(data)
    s = d.samples[5]
    n_prompt = len(prompts[5])
    assert s.ids[:n_prompt].tolist() == prompts[5]
    assert not s.mask[:n_prompt].any() and s.mask[n_prompt:].all() and len(s.ids) == n_prompt + 20
    aux, last = capture(target, s.ids.tolist(), [0, 2, 3])
    assert torch.equal(aux, s.aux) and torch.equal(last, s.last)
    # greedy regeneration: the stored response is the target's own greedy output
    eng = Engine(target, None, EngineConfig(model="x", drafter=None, dtype="float32", max_batch_size=1), None)
    seq = eng.add_request(prompts[5], SamplingParams(max_tokens=20, ignore_eos=True))
    while eng.has_work:
        eng.step()
    assert seq.output_ids == s.ids[n_prompt:].tolist()
    assert int(d.token_counts.sum()) == sum(int(x.mask.sum()) for x in d.samples)


def test_data_resume_after_kill_and_no_hidden(tiny, tmp_path):
    target, folder, data, prompts = tiny
    kw = dict(max_tokens=20, shard_size=16, batch_size=8, meta={"model": str(folder)})
    part = tmp_path / "part"
    build_dataset(target, prompts, part, [0, 2, 3], stop_after_shards=1, **kw)  # "killed" after one shard
    (part / "shard-00001.safetensors.tmp").write_bytes(b"half-written")
    assert json.loads((part / "index.json").read_text())["prompts_done"] == 16
    build_dataset(target, prompts, part, [0, 2, 3], **kw)
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
    model = build_model(TrainConfig(data=str(data), out="unused", draft_vocab_size=160), target, d)
    b = collate(d.samples[:3])
    d2t = model.draft_to_target()
    t2d = model.target_to_draft(torch.arange(160))
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
        perfect = [torch.cat([target_logits(b["last"][:, 1 : T - 1], head, None), torch.zeros(3, 1, 160)], 1)]
        l0, m0 = eagle3_loss(perfect, b, head, None, d2t, t2d, 0.8)
        assert abs(float(l0)) < 1e-5
        assert float(m0["acc_0"][0] / m0["acc_0"][1]) > 0.95  # greedy data: target argmax == data token


def _cfg(data, out, **kw):
    base = dict(data=str(data), out=str(out), draft_vocab_size=64, ttt_steps=2, lr=3e-3, batch_size=8, steps=6,
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
    assert [r["step"] for r in log] == [1, 2, 3, 4, 4, 5, 6]
    straight = [json.loads(x) for x in (tmp_path / "straight" / "train_log.jsonl").read_text().splitlines()]
    assert log[-1]["loss"] == straight[-1]["loss"]


def test_ddp_two_processes_equal_one(tiny, tmp_path):
    target, folder, data, _ = tiny
    common = ["--data", str(data), "--model", str(folder), "--draft-vocab-size", "64", "--ttt-steps", "2",
              "--steps", "3", "--batch-size", "8", "--save-every", "3", "--no-bf16", "--no-progress",
              "--lr", "3e-3", "--intermediate-size", "64", "--threads", "1", "--val-fraction", "0.125"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1"}
    one = subprocess.run([sys.executable, "-m", "verispec.cli", "train", "--out", str(tmp_path / "one"), *common],
                         env=env, capture_output=True, text=True, timeout=120)
    assert one.returncode == 0, one.stderr[-2000:]
    two = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                          "29533", "-m", "verispec.cli", "train", "--out", str(tmp_path / "two"), *common],
                         env=env, capture_output=True, text=True, timeout=180)
    assert two.returncode == 0, two.stderr[-3000:]
    t32 = ours_from_hf(build_hf("llama", num_hidden_layers=4, seed=1))
    a = load_eagle3(tmp_path / "one", t32).state_dict()
    b = load_eagle3(tmp_path / "two", t32).state_dict()
    for k in a:
        torch.testing.assert_close(a[k].float(), b[k].float(), atol=1e-2, rtol=1e-2)  # bf16 export
    sa = torch.load(tmp_path / "one" / "checkpoint" / "state.pt", weights_only=False)["model"]
    sb = torch.load(tmp_path / "two" / "checkpoint" / "state.pt", weights_only=False)["model"]
    for k in sa:
        torch.testing.assert_close(sa[k], sb[k], atol=1e-5, rtol=1e-4)  # fp32 training state


def _acceptance(target, drafter, prompts):
    cfg = EngineConfig(model="x", drafter=None, num_draft_tokens=3, dtype="float32", max_batch_size=4, max_model_len=64)
    eng = Engine(target, None, cfg, drafter)
    seqs = [eng.add_request(p, SamplingParams(max_tokens=20, ignore_eos=True)) for p in prompts]
    while eng.has_work:
        eng.step()
    acc = sum(s.stats.accepted for s in seqs) / max(1, sum(s.stats.drafted for s in seqs))
    return acc, [s.output_ids for s in seqs]


def test_end_to_end_training_raises_acceptance(tiny, tmp_path):
    target, folder, data, _ = tiny
    cfg = _cfg(data, tmp_path / "e2e", steps=60, save_every=100, lr=5e-3, ttt_steps=3, intermediate_size=96,
               draft_vocab_size=160, warmup_ratio=0.05, export_dtype="float32", train_lm_head=True)
    d = HiddenStateData(data)
    untrained = build_model(cfg, target, d).eval()
    ev = train(cfg, target)
    assert ev["acceptance_unconditional"][0] > 0.3, ev
    trained = load_eagle3(tmp_path / "e2e", target)
    prompts = [random_ids(n, 160, seed=900 + n)[0].tolist() for n in (5, 7, 4, 9)]
    plain, _ = _acceptance(target, None, prompts)
    a0, out0 = _acceptance(target, Eagle3Drafter(untrained, target, 4, 70), prompts)
    a1, out1 = _acceptance(target, Eagle3Drafter(trained, target, 4, 70), prompts)
    assert out0 == out1  # lossless either way
    assert a1 > a0 + 0.2 and a1 > 0.3, (a0, a1)
