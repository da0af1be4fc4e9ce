"""A folder converted from a GGUF is a complete checkpoint: transformers loads it as it is and gets
verispec's logits, and it carries what vLLM needs (architectures, generation config, chat template).
A folder converted by an older verispec is completed in place, without converting again."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from conftest import random_ids
from verispec.chat import GEMMA_CHAT_TEMPLATE, encode_chat, render_chat, turn_end_ids
from verispec.models import checkpoint, hf_folder, load_model

SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"]  # Gemma's ids 0..5
PIECES = ["\u2581"] + [chr(c) for c in range(ord("a"), ord("z") + 1)] + list("?.!,HIM")
PIECES += ["\u2581" + c for c in "abcdefghijklmnopqrstuvwxyz"] + ["\n", "he", "ll", "\u2581he", "\u2581hello"]
VOCAB = SPECIALS + PIECES
HIDDEN, HEADS, KV_HEADS, HEAD_DIM, FFN, LAYERS = 32, 2, 1, 16, 48, 6
EOT = 5  # <end_of_turn>, marked as the end-of-turn token like a chat model's GGUF


def write_tiny_gemma3_gguf(path, chat_template: str | None = None, seed: int = 0) -> None:
    """A Gemma 3 GGUF with random float32 weights and a sentencepiece vocabulary of 100 tokens,
    written the way llama.cpp writes one (tensor names, metadata keys)."""
    import gguf

    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), "gemma3")
    w.add_name("tiny gemma3")
    w.add_context_length(256)
    w.add_embedding_length(HIDDEN)
    w.add_block_count(LAYERS)  # five sliding-window layers, then a global one (Gemma 3's pattern)
    w.add_feed_forward_length(FFN)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_key_length(HEAD_DIM)
    w.add_value_length(HEAD_DIM)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(1e6)
    w.add_sliding_window(4)
    w.add_tokenizer_model("llama")
    w.add_token_list(VOCAB)
    w.add_token_scores([0.0] * len(VOCAB))
    w.add_token_types([3, 3, 3, 2, 3, 3] + [1] * len(PIECES))  # 3 control, 2 unknown, 1 normal
    w.add_bos_token_id(2)
    w.add_eos_token_id(1)
    w.add_eot_token_id(EOT)
    w.add_unk_token_id(3)
    w.add_pad_token_id(0)
    w.add_add_bos_token(True)
    if chat_template is not None:
        w.add_chat_template(chat_template)

    def t(name, *shape, scale=None):
        scale = scale if scale is not None else 1.5 / shape[-1] ** 0.5
        w.add_tensor(name, (rng.standard_normal(shape) * scale).astype(np.float32))

    def norm(name, n):  # llama.cpp stores Gemma's norm weights as 1 + w
        w.add_tensor(name, (1.0 + rng.uniform(-0.5, 0.5, n)).astype(np.float32))

    t("token_embd.weight", len(VOCAB), HIDDEN, scale=1.0)
    for i in range(LAYERS):
        t(f"blk.{i}.attn_q.weight", HEADS * HEAD_DIM, HIDDEN)
        t(f"blk.{i}.attn_k.weight", KV_HEADS * HEAD_DIM, HIDDEN)
        t(f"blk.{i}.attn_v.weight", KV_HEADS * HEAD_DIM, HIDDEN)
        t(f"blk.{i}.attn_output.weight", HIDDEN, HEADS * HEAD_DIM)
        t(f"blk.{i}.ffn_gate.weight", FFN, HIDDEN)
        t(f"blk.{i}.ffn_up.weight", FFN, HIDDEN)
        t(f"blk.{i}.ffn_down.weight", HIDDEN, FFN)
        norm(f"blk.{i}.attn_q_norm.weight", HEAD_DIM)
        norm(f"blk.{i}.attn_k_norm.weight", HEAD_DIM)
        for n in ("attn_norm", "post_attention_norm", "ffn_norm", "post_ffw_norm"):
            norm(f"blk.{i}.{n}.weight", HIDDEN)
    norm("output_norm.weight", HIDDEN)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture
def converted(tmp_path, monkeypatch):
    """(gguf path, converted folder) in a private cache."""
    monkeypatch.setenv("VERISPEC_CACHE", str(tmp_path / "cache"))
    gguf_path = tmp_path / "tiny.gguf"
    write_tiny_gemma3_gguf(gguf_path)
    return gguf_path, hf_folder(str(gguf_path))


MSGS = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello?"},
        {"role": "assistant", "content": "hi."}, {"role": "user", "content": "more"}]


def test_converted_folder_is_complete_and_transformers_gives_verispecs_logits(converted):
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    _, folder = converted
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == ["Gemma3ForCausalLM"] and config["model_type"] == "gemma3_text"
    gen = GenerationConfig.from_pretrained(str(folder))
    assert (gen.bos_token_id, gen.eos_token_id, gen.pad_token_id) == (2, [1, EOT], 0)  # EOS and EOT, as the GGUF says
    assert json.loads((folder / "DONE").read_text())["format"] == checkpoint.FORMAT

    hf = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    assert type(hf).__name__ == "Gemma3ForCausalLM"
    ours = load_model(str(folder), dtype=torch.float32)
    ids = random_ids(20, len(VOCAB), seed=3)  # longer than the sliding window
    with torch.no_grad():
        want = hf(input_ids=ids, use_cache=False).logits.float()
        got = ours(ids, ours.new_cache(1, 64), [0], torch.tensor([0])).logits.float()
    assert want.abs().max() > 1.0  # not a degenerate model
    torch.testing.assert_close(got, want, rtol=0, atol=1e-4)

    # the chat template renders verispec's Gemma turn format: the same ids either way
    tok = AutoTokenizer.from_pretrained(str(folder))
    assert tok.chat_template == GEMMA_CHAT_TEMPLATE
    plain = AutoTokenizer.from_pretrained(str(folder))
    plain.chat_template = None
    assert render_chat(tok, "gemma3_text", MSGS) == "<bos>" + render_chat(plain, "gemma3_text", MSGS)
    assert encode_chat(tok, "gemma3_text", MSGS) == encode_chat(plain, "gemma3_text", MSGS)
    assert encode_chat(tok, "gemma3_text", MSGS).count(2) == 1
    assert turn_end_ids(tok, "gemma3_text", folder) == (EOT, 1)


def test_a_gguf_chat_template_is_kept(tmp_path, monkeypatch):
    monkeypatch.setenv("VERISPEC_CACHE", str(tmp_path / "cache"))
    template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    write_tiny_gemma3_gguf(tmp_path / "t.gguf", chat_template=template)
    from transformers import AutoTokenizer

    assert AutoTokenizer.from_pretrained(str(hf_folder(str(tmp_path / "t.gguf")))).chat_template == template


def test_an_older_conversion_is_completed_in_place(converted, monkeypatch):
    """What verispec before the fix left: no architectures, no generation_config.json, no chat
    template, and DONE holding the GGUF's path. It is completed without converting again."""
    gguf_path, folder = converted
    config = json.loads((folder / "config.json").read_text())
    config["architectures"] = None
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "generation_config.json").unlink()
    tok_cfg = json.loads((folder / "tokenizer_config.json").read_text())
    del tok_cfg["chat_template"]
    (folder / "tokenizer_config.json").write_text(json.dumps(tok_cfg))
    (folder / "DONE").write_text(str(gguf_path))
    assert checkpoint.folder_format(folder) == 1
    weights = (folder / "model.safetensors").stat().st_mtime_ns

    def no_conversion(*a, **k):
        raise AssertionError("converted again")

    monkeypatch.setattr("verispec.models.loading._convert_gguf", no_conversion)
    assert hf_folder(str(gguf_path)) == folder
    assert json.loads((folder / "config.json").read_text())["architectures"] == ["Gemma3ForCausalLM"]
    assert json.loads((folder / "generation_config.json").read_text())["eos_token_id"] == [1, EOT]
    assert json.loads((folder / "tokenizer_config.json").read_text())["chat_template"] == GEMMA_CHAT_TEMPLATE
    assert checkpoint.folder_format(folder) == checkpoint.FORMAT
    assert (folder / "model.safetensors").stat().st_mtime_ns == weights
    assert hf_folder(str(gguf_path)) == folder  # and then it is left alone

