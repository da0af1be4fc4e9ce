"""Checkpoint compatibility with speculators (the format vLLM serves with `"method": "eagle3"`).

Both directions, with speculators' own classes: our export loads in `Eagle3DraftModel.from_pretrained`
with identical tensors and the same draft logits; a checkpoint written by speculators imports into
ours with identical tensors and the same draft logits.
"""

from __future__ import annotations

import json

import pytest
import torch

from conftest import build_hf, ours_from_hf, random_ids
from test_eagle3 import random_eagle
from verispec.drafters.eagle3 import load_eagle3, vllm_command

pytestmark = pytest.mark.usefixtures("single_torch_thread")

try:
    from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig
    _IMPORT_ERROR = None
except Exception as e:  # noqa: BLE001 - any import failure is a reason to skip, reported verbatim
    _IMPORT_ERROR = f"{type(e).__name__}: {e}"

needs_speculators = pytest.mark.skipif(
    _IMPORT_ERROR is not None,
    reason=f"speculators cannot be imported ({_IMPORT_ERROR}); pip install --no-deps speculators==0.9.0 "
    "datasets loguru hs-connectors pyarrow dill multiprocess xxhash",
)


@pytest.fixture(scope="module")
def verifier(tmp_path_factory):
    hf = build_hf("llama", num_hidden_layers=4)
    path = tmp_path_factory.mktemp("verifier")
    hf.save_pretrained(path)
    return hf, ours_from_hf(hf), path


def _their_logits(model, aux, ids, steps):
    """speculators' Eagle3DraftModel on the aligned batch (its shift_batch convention)."""
    n = ids.shape[1] - 1
    from speculators.models.attention import create_float_mask

    model.config.transformer_layer_config._attn_implementation = "eager"  # dense masks on CPU (no flex attention)
    for layer in model.layers:
        layer.self_attn.config._attn_implementation = "eager"
    model._attn_impl, model._create_mask_fn = "eager", create_float_mask
    with torch.no_grad():
        logits = []

        def grab(mod, inp, out):
            logits.append(out.float())
        h = model.lm_head.register_forward_hook(grab)
        model(hidden_states=aux[:, :n], input_ids=ids[:, 1:], document_ids=torch.zeros(1, n, dtype=torch.long),
              ttt_steps=steps)
        h.remove()
    return logits


def _aux(target, ids, layers):
    out = target(ids, target.new_cache(1, 64), [0], torch.tensor([0]), taps=tuple(layers))
    return torch.cat([out.hidden[i] for i in layers], -1)


@needs_speculators
@pytest.mark.parametrize("flags", [{}, {"fc_norm": True, "norm_output": True}])
def test_export_loads_in_speculators(verifier, tmp_path, flags):
    hf, target, vpath = verifier
    m = random_eagle(target, draft_vocab=64, **flags)
    m.config.verifier = str(vpath)
    m.save(tmp_path / "ck", dtype=torch.float32)
    theirs = Eagle3DraftModel.from_pretrained(str(tmp_path / "ck"))
    assert isinstance(theirs.config, Eagle3SpeculatorConfig)
    # speculators (and vLLM) count hidden states like transformers' hidden_states: layer i's output is id i + 1
    assert theirs.config.eagle_aux_hidden_state_layer_ids == [i + 1 for i in m.config.aux_layers]
    assert theirs.config.fc_norm == m.config.fc_norm and theirs.config.norm_output == m.config.norm_output
    sd = theirs.state_dict()
    for k, v in m.state_dict().items():
        assert torch.equal(sd[k], v), k
    with torch.no_grad():
        theirs.embed_tokens.weight.copy_(target.model.embed_tokens.weight)
    theirs = theirs.float().eval()
    ids = random_ids(10, 160, seed=2)
    with torch.no_grad():
        aux = _aux(target, ids, m.config.aux_layers)
        ours = m(aux, ids, torch.ones_like(ids, dtype=torch.bool), steps=2)
    them = _their_logits(theirs, aux, ids, 2)
    torch.testing.assert_close(them[0][0], ours[0][0], atol=2e-4, rtol=2e-4)
    # step 1: speculators does not mask out-of-range teacher tokens; compare the rows both define
    torch.testing.assert_close(them[1][0, :-1], ours[1][0, :-1], atol=2e-4, rtol=2e-4)
    cmd = vllm_command(str(tmp_path / "ck"))
    assert '"method": "eagle3"' in cmd and str(vpath) in cmd


@needs_speculators
def test_speculators_checkpoint_imports_into_ours(verifier, tmp_path):
    from speculators.config import SpeculatorsConfig, VerifierConfig
    from speculators.proposals.greedy import GreedyTokenProposalConfig
    from transformers import LlamaConfig

    hf, target, vpath = verifier
    c = target.config
    tl = LlamaConfig(vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=80, num_hidden_layers=1,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6,
                     max_position_embeddings=256, rope_parameters={"rope_type": "default", "rope_theta": 5000.0})
    tl._attn_implementation = "eager"
    cfg = Eagle3SpeculatorConfig(
        transformer_layer_config=tl, draft_vocab_size=48, eagle_aux_hidden_state_layer_ids=[1, 2, 4], fc_norm=True,
        speculators_config=SpeculatorsConfig(
            algorithm="eagle3", proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=3)],
            default_proposal_method="greedy", verifier=VerifierConfig(name_or_path=str(vpath),
                                                                      architectures=["LlamaForCausalLM"])),
    )
    torch.manual_seed(0)
    theirs = Eagle3DraftModel(cfg)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in theirs.named_parameters():
            p.copy_(torch.rand(p.shape, generator=g) + 0.5 if "norm" in name else
                    torch.randn(p.shape, generator=g) * (1.0 / p.shape[-1] ** 0.5))
        keep = torch.randperm(c.vocab_size, generator=g)[:48].sort().values
        theirs.d2t.copy_(keep - torch.arange(48))
        theirs.t2d.zero_()
        theirs.t2d[keep] = True
        theirs.embed_tokens.weight.copy_(target.model.embed_tokens.weight)
    theirs.save_pretrained(str(tmp_path / "theirs"))
    saved = json.loads((tmp_path / "theirs" / "config.json").read_text())
    assert saved["speculators_model_type"] == "eagle3"
    ours = load_eagle3(tmp_path / "theirs", target)
    assert ours.config.aux_layers == [0, 1, 3] and ours.config.fc_norm and ours.config.rope_theta == 5000.0
    sd = theirs.state_dict()
    for k, v in ours.state_dict().items():
        assert torch.equal(sd[k].float(), v.float()), k
    ids = random_ids(9, 160, seed=4)
    with torch.no_grad():
        aux = _aux(target, ids, [0, 1, 3])
        mine = ours(aux, ids, torch.ones_like(ids, dtype=torch.bool), steps=1)
    them = _their_logits(theirs.float().eval(), aux, ids, 1)
    torch.testing.assert_close(them[0][0], mine[0][0], atol=2e-4, rtol=2e-4)
