"""The real default target, Gemma 3 270M (converted once from the packaged GGUF)."""

from __future__ import annotations

import pytest
import torch

from verispec.drafters import ModelDrafter, NgramDrafter
from verispec.engine import Engine, EngineConfig
from verispec.models import hf_folder, load_model, load_tokenizer
from verispec.sampling import SamplingParams

pytestmark = pytest.mark.real_model

PROMPTS = [
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "The capital of France is",
    "<start_of_turn>user\nWrite a haiku about the sea.<end_of_turn>\n<start_of_turn>model\n",
]


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer("gemma3-270m")


@pytest.fixture(scope="module")
def fp32_model():
    return load_model("gemma3-270m", dtype=torch.float32)


@torch.inference_mode()
def test_forward_matches_transformers(fp32_model, tok):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(hf_folder("gemma3-270m")), dtype=torch.float32).eval()
    ids = torch.tensor([tok(PROMPTS[0]).input_ids])
    ref = hf(ids).logits.float()
    got = fp32_model(ids, fp32_model.new_cache(1, 64), [0], torch.tensor([0])).logits
    assert (got - ref).abs().max() < 1e-3 * ref.abs().max()
    assert torch.equal(got.argmax(-1), ref.argmax(-1))


def generate(model, tok, drafter, prompts, exact=False, max_tokens=32, k=5, tree="chain"):
    cfg = EngineConfig(drafter=None, draft_policy="fixed", num_draft_tokens=k, max_batch_size=len(prompts), max_model_len=256, exact=exact,
                       draft_tree=tree)
    eng = Engine(model, tok, cfg, drafter)
    sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    seqs = [eng.add_request(tok(p).input_ids, sp) for p in prompts]
    while eng.has_work:
        eng.step()
    return [s.output_ids for s in seqs], seqs


@pytest.mark.parametrize("drafter", ["ngram", "layerskip"])
def test_greedy_fp32_equals_plain_single_and_batched(fp32_model, tok, drafter):
    make = {
        "ngram": lambda: NgramDrafter(),
        "layerskip": lambda: ModelDrafter(fp32_model, len(PROMPTS), 256 + 6, num_layers=9),
    }[drafter]
    plain, _ = generate(fp32_model, tok, None, PROMPTS)
    batched, seqs = generate(fp32_model, tok, make(), PROMPTS)  # prompts of different lengths, one batch
    assert batched == plain
    assert sum(s.stats.accepted for s in seqs) > 0
    single, _ = generate(fp32_model, tok, make(), PROMPTS[:1])
    assert single == plain[:1]


def test_exact_mode_bf16_equals_plain(tok):
    model = load_model("gemma3-270m", dtype=torch.bfloat16)
    plain, _ = generate(model, tok, None, PROMPTS, exact=True)
    spec, seqs = generate(model, tok, NgramDrafter(), PROMPTS, exact=True)
    assert spec == plain
    assert sum(s.stats.accepted for s in seqs) > 0


def test_bf16_batched_and_chunked_equals_alone(tok):
    """Default bf16 mode: a request's greedy output does not depend on who shares its batch nor on
    how its prompt was cut into prefill chunks (prompts of 31-132 tokens, 48-token chunk budget,
    decode batches of up to 8 x 6 rows), with and without speculation."""
    from verispec import prompts as P

    model = load_model("gemma3-270m", dtype=torch.bfloat16)
    ps = P.load(["mtbench", "humaneval"], limit=4)
    ids = [P.render(p, tok, "gemma3_text") for p in ps]
    assert max(len(i) for i in ids) > 2 * 64  # past the GEMM row block and several chunks
    sp = SamplingParams(max_tokens=24, ignore_eos=True)

    def run(prompts, drafter, chunk):
        cfg = EngineConfig(drafter=None, draft_policy="fixed", num_draft_tokens=5, max_batch_size=len(prompts), max_model_len=256,
                           prefill_chunk=chunk)
        eng = Engine(model, tok, cfg, drafter)
        seqs = [eng.add_request(p, sp) for p in prompts]
        while eng.has_work:
            eng.step()
        return [s.output_ids for s in seqs]

    alone = [run([p], None, 4096)[0] for p in ids]
    assert run(ids, None, 48) == alone
    assert run(ids, NgramDrafter(), 48) == alone

