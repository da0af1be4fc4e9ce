"""Shared fixtures: tiny random Hugging Face models and our `CausalLM` loaded with the same weights."""

from __future__ import annotations

import pytest
import torch

from verispec.models.config import ModelConfig
from verispec.models.model import CausalLM

_COMMON = dict(
    vocab_size=160,
    hidden_size=64,
    intermediate_size=96,
    num_attention_heads=4,
    num_key_value_heads=2,  # GQA
    head_dim=16,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)


def _hf_config(family: str):
    from transformers import Gemma3TextConfig, LlamaConfig, Qwen2Config, Qwen3Config

    if family == "llama":  # llama3 RoPE scaling, untied head
        return LlamaConfig(
            **_COMMON,
            num_hidden_layers=3,
            tie_word_embeddings=False,
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 10000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 16,
            },
        )
    if family == "llama_linear":  # linear RoPE scaling, biases everywhere, tied head
        return LlamaConfig(
            **_COMMON,
            num_hidden_layers=2,
            tie_word_embeddings=True,
            attention_bias=True,
            mlp_bias=True,
            rope_parameters={"rope_type": "linear", "rope_theta": 500.0, "factor": 4.0},
        )
    if family == "qwen2":  # q/k/v biases (no o_proj bias)
        return Qwen2Config(**_COMMON, num_hidden_layers=3, tie_word_embeddings=False, rope_parameters={"rope_type": "default", "rope_theta": 1000.0})
    if family == "qwen3":  # q/k norms, tied head
        return Qwen3Config(**_COMMON, num_hidden_layers=3, tie_word_embeddings=True, rope_parameters={"rope_type": "default", "rope_theta": 1000.0})
    if family == "gemma3":  # (1 + w) norms, sliding + global layers, per-kind RoPE, final softcap
        return Gemma3TextConfig(
            **_COMMON,
            num_hidden_layers=4,
            tie_word_embeddings=True,
            sliding_window=4,
            layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
            query_pre_attn_scalar=24,
            final_logit_softcapping=50.0,
            rope_parameters={
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "linear", "rope_theta": 1000000.0, "factor": 8.0},
            },
        )
    raise ValueError(family)


FAMILIES = ("llama", "llama_linear", "qwen2", "qwen3", "gemma3")


@torch.no_grad()
def _randomize(model: torch.nn.Module, seed: int) -> None:
    """Weights large enough that attention is far from uniform; norms random so (1 + w) vs w matters."""
    g = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if "norm" in name:
            p.copy_(torch.rand(p.shape, generator=g) + 0.5)  # in [0.5, 1.5)
        elif name.endswith("bias"):
            p.copy_(torch.randn(p.shape, generator=g) * 0.1)
        elif "embed_tokens" in name:
            p.copy_(torch.randn(p.shape, generator=g))
        else:
            p.copy_(torch.randn(p.shape, generator=g) * (1.5 / p.shape[-1] ** 0.5))


def build_hf(family: str, attn: str = "eager", seed: int = 0, **overrides):
    from transformers import AutoModelForCausalLM

    cfg = _hf_config(family)
    for k, v in overrides.items():
        setattr(cfg, k, v)
    torch.manual_seed(seed)
    hf = AutoModelForCausalLM.from_config(cfg, attn_implementation=attn, dtype=torch.float32)
    _randomize(hf, seed)
    return hf.eval()


def ours_from_hf(hf) -> CausalLM:
    model = CausalLM(ModelConfig.from_hf(hf.config))
    sd = dict(hf.state_dict())
    if model.config.tie_word_embeddings:
        sd.pop("lm_head.weight", None)
    model.load_state_dict(sd, strict=True)
    return model.to(hf.dtype).eval()


_PAIRS: dict = {}


@pytest.fixture(scope="session")
def tiny_hf_model():
    """Factory: tiny_hf_model(family, attn="eager") -> (hf_model, our_model), same random weights (cached)."""

    def make(family: str, attn: str = "eager"):
        key = (family, attn)
        if key not in _PAIRS:
            hf = build_hf(family, attn)
            _PAIRS[key] = (hf, ours_from_hf(hf))
        return _PAIRS[key]

    return make


def random_ids(n: int, vocab: int, seed: int, batch: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (batch, n), generator=g)


@torch.no_grad()
def hf_logits(hf, ids: torch.Tensor) -> torch.Tensor:
    return hf(input_ids=ids, use_cache=False).logits.float()


@pytest.fixture(scope="module")
def single_torch_thread():
    """Tiny models run several times faster on one thread (no oversubscription on a busy 2-core box)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


CHAR_SPECIALS = ["<pad>", "<bos>", "<eos>", "<unk>", "<start_of_turn>", "<end_of_turn>", "<|im_start|>", "<|im_end|>"]


def char_tokenizer(add_bos: bool = True, chat_template: str | None = None):
    """A real (fast) Hugging Face tokenizer with one token per printable ASCII character, Gemma's
    special tokens (<bos> = 1, <eos> = 2, <start_of_turn>, <end_of_turn>) and ChatML's; it adds
    <bos> to plain text like Gemma's when add_bos. Small enough for tiny models' vocabularies."""
    import string

    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    chars = [c for c in string.printable if c not in "\x0b\x0c\r"]
    vocab = {t: i for i, t in enumerate(CHAR_SPECIALS + chars)}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tk.decoder = decoders.Fuse()
    if add_bos:
        tk.post_processor = processors.TemplateProcessing(single="<bos> $A", pair="<bos> $A $B",
                                                          special_tokens=[("<bos>", vocab["<bos>"])])
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<bos>", eos_token="<eos>", unk_token="<unk>",
                                  pad_token="<pad>", additional_special_tokens=CHAR_SPECIALS[4:])
    tok.chat_template = chat_template
    return tok


# --------------------------------------------------------------------------------------------
# `pytest -m "not slow"`: the fast subset (README.md, "Tests"). A test is slow when it loads the
# real model (marker real_model) or runs for more than about 5 s on 2 cores: the statistical
# sampled-output checks (thousands of seeded requests each), multi-process training, and servers
# under load or in a subprocess. They are listed here, in one place, rather than
# marked in each file.
SLOW = (
    "test_sampling_lossless.py::test_sampled_output_distribution_is_the_targets",
    "test_sampling_lossless.py::test_check_has_teeth",
    "test_tree.py::test_tree_sampling_is_distributed_as_the_target",
    "test_tree.py::test_tree_check_has_teeth",
    "test_eagle3.py::test_sampled_lossless_tv",
    "test_bench.py::test_sampled_check_passes_and_catches_a_biased_acceptor",
    "test_train_eagle3.py::test_ddp_two_processes_equal_one",
    "test_server_faults.py::test_64_concurrent_mixed_streams_each_equal_the_same_request_alone",
    "test_server_faults.py::test_body_limit_is_answered_at_once_and_tokenization_never_stalls_the_loop",
    "test_server_faults.py::test_serve_logs_its_address_and_drains_on_sigterm",
    "test_server_faults.py::test_a_fault_in_any_engine_step_fails_only_that_steps_requests",
)


def pytest_collection_modifyitems(config, items):
    for item in items:
        name = item.nodeid.split("/")[-1].split("[")[0]
        if item.get_closest_marker("real_model") or name.startswith(SLOW):
            item.add_marker(pytest.mark.slow)


@pytest.fixture(autouse=True)
def _keep_torch_threads():
    """Commands run in-process (`verispec.cli.main`) set torch's thread count; bits depend on it,
    so every test starts with the count the session started with."""
    n = torch.get_num_threads()
    yield
    if torch.get_num_threads() != n:
        torch.set_num_threads(n)


def randomize_head(m, counts=None):
    """Random weights for a draft head built from a config (norm weights in [0.5, 1.5], the rest
    normal with a 1.5 / sqrt(fan-in) scale) and, with a reduced draft vocabulary, the mapping of
    the most frequent ids by `counts` (default: lower ids first). Returns it in eval mode."""
    from verispec.drafters.eagle3 import build_vocab_mapping

    with torch.no_grad():
        for name, p in m.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            else:
                p.normal_(0, 1.5 / p.shape[-1] ** 0.5)
    if m.use_draft_vocab:
        c = m.config
        if counts is None:
            counts = torch.arange(c.vocab_size, 0, -1).float()
        m.set_vocab_mapping(*build_vocab_mapping(counts, c.draft_vocab_size))
    return m.eval()
