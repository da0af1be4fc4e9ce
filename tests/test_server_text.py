"""Streamed text (server/text.py): the pieces a stream releases, put together, are exactly
`tokenizer.decode(output ids, skip_special_tokens=True)` — multi-byte characters split across
tokens, byte-fallback tokens (valid and invalid runs), special tokens inside a run, SentencePiece
spaces — on tiny tokenizers of each decoder kind and on Gemma 3's real tokenizer; each token is
decoded once (never the whole output again); stop strings keep their semantics."""

from __future__ import annotations

import random

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from conftest import char_tokenizer
from verispec.server.text import Detokenizer, TextStream, _plan

SPECIALS = ["<pad>", "<bos>", "<eos>", "<unk>", "<end_of_turn>"]
BYTES = [f"<0x{b:02X}>" for b in range(256)]
PIECES = ["▁", "▁▁", "▁▁▁", "a", "▁a", "b", "▁the", "\n", "日", "▁日", "é", "x", ".", "▁.", "\ufffd"]


def sentencepiece_tokenizer(*steps) -> PreTrainedTokenizerFast:
    """SentencePiece-style pieces ("▁" = space) with byte fallback, decoded by `steps`."""
    vocab = {t: i for i, t in enumerate(SPECIALS + BYTES + PIECES)}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tk.decoder = decoders.Sequence(list(steps))
    return PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<bos>", eos_token="<eos>", unk_token="<unk>",
                                   pad_token="<pad>", additional_special_tokens=["<end_of_turn>"])


def byte_level_tokenizer() -> PreTrainedTokenizerFast:
    """GPT-2 / Llama 3 / Qwen style: byte-level BPE, one token per byte here (no merges)."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tk = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    tok = PreTrainedTokenizerFast(tokenizer_object=tk)
    tok.add_special_tokens({"eos_token": "<eos>", "pad_token": "<pad>"})
    return tok


GEMMA = (decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse())
TOKENIZERS = {
    "gemma-style": lambda: sentencepiece_tokenizer(*GEMMA),
    "llama2-style (strip the first space)": lambda: sentencepiece_tokenizer(*GEMMA, decoders.Strip(content=" ", left=1, right=0)),
    "metaspace": lambda: sentencepiece_tokenizer(decoders.ByteFallback(), decoders.Metaspace(replacement="▁", prepend_scheme="always")),
    "byte-level": byte_level_tokenizer,
    "characters": char_tokenizer,
}


def stream_text(tok, ids: list[int], rng: random.Random | None = None) -> tuple[str, list[str]]:
    """Push ids in random chunks (accepted draft runs) through a TextStream; the text and every
    piece released."""
    ts, pieces, i = TextStream(tok, []), [], 0
    while i < len(ids):
        n = rng.randint(1, 6) if rng else 1
        pieces.append(ts.push(ids[i : i + n], final=i + n >= len(ids)))
        i += n
    return "".join(pieces), pieces


def random_ids(tok, rng: random.Random, n: int) -> list[int]:
    """Mostly byte-fallback tokens and special tokens, where streaming goes wrong."""
    vocab = len(tok)
    byte_ids = [i for i in (tok.convert_tokens_to_ids(b) for b in BYTES) if i is not None and i != tok.unk_token_id]
    specials = list(tok.all_special_ids)
    out = []
    for _ in range(n):
        r = rng.random()
        if byte_ids and r < 0.4:
            # a lead byte, a continuation byte, an ASCII byte or any byte
            out.append(byte_ids[rng.choice([0xE6, 0xF0, 0x97, 0x9F, 0xA5, 0x41, rng.randrange(256)])])
        elif r < 0.5:
            out.append(rng.choice(specials))
        else:
            out.append(rng.randrange(vocab))
    return out


def encode_with_byte_fallback(tok, text: str, rng: random.Random) -> list[int]:
    """Ids of text, each character as its piece or (at random) as its UTF-8 byte tokens."""
    ids = []
    for ch in text:
        piece = tok.convert_tokens_to_ids(ch)
        if piece is not None and piece != tok.unk_token_id and rng.random() < 0.5:
            ids.append(piece)
        else:
            ids += [tok.convert_tokens_to_ids(f"<0x{b:02X}>") for b in ch.encode()]
    return ids


@pytest.mark.parametrize("name", list(TOKENIZERS))
def test_streamed_text_is_the_whole_decode(name):
    tok = TOKENIZERS[name]()
    rng = random.Random(name)
    for _ in range(300):
        ids = random_ids(tok, rng, rng.randint(1, 30))
        text, _ = stream_text(tok, ids, rng)
        assert text == tok.decode(ids, skip_special_tokens=True), ids


def test_each_token_is_decoded_once_not_the_whole_output_again():
    tok = sentencepiece_tokenizer(*GEMMA)
    assert _plan(tok).backend is not None
    calls = []
    orig = tok.decode
    tok.decode = lambda *a, **k: calls.append(a) or orig(*a, **k)
    ids = [tok.convert_tokens_to_ids(p) for p in ["▁the", "▁a", "b", "\n"]] * 500
    ts = TextStream(tok, ["zz"])
    out = "".join(ts.push(ids[i : i + 3]) for i in range(0, len(ids), 3)) + ts.push([], final=True)
    assert out == orig(ids, skip_special_tokens=True)
    assert calls == []  # the old stream decoded all of ids at every push: ~670 decodes of up to 2000 tokens


def test_an_invalid_byte_run_is_released_as_the_whole_decode_shows_it():
    """ByteFallback turns a whole run of byte tokens into one U+FFFD per token when any of its bytes
    is invalid, so "n%" must not be released before the run ends (the run below ends with 0xFF)."""
    tok = sentencepiece_tokenizer(*GEMMA)
    b = lambda x: tok.convert_tokens_to_ids(f"<0x{x:02X}>")  # noqa: E731
    x, eos = tok.convert_tokens_to_ids("x"), tok.eos_token_id
    for ids in ([b(0x6E), b(0x25), b(0xFF), x], [b(0xE6), b(0x97), b(0xA5), b(0x80), x],
                [b(0xE6), eos, b(0x97), b(0xA5), x], [x, b(0xE6), b(0x97)]):
        text, pieces = stream_text(tok, ids)
        assert text == tok.decode(ids, skip_special_tokens=True), ids
    assert stream_text(tok, [b(0x6E), b(0x25), b(0xFF), x])[1] == ["", "", "", "\ufffd" * 3 + "x"]
    # a special token inside a run does not end it: the character is whole
    assert stream_text(tok, [b(0xE6), eos, b(0x97), b(0xA5), x])[0] == "日x"


def test_a_slow_tokenizer_or_python_clean_up_falls_back_to_whole_decodes():
    tok = sentencepiece_tokenizer(*GEMMA)
    tok.clean_up_tokenization_spaces = True  # " ." -> "." in Python, after the tokenizers decode
    assert _plan(tok).backend is None
    ids = [tok.convert_tokens_to_ids(p) for p in ["▁the", "▁.", "▁a", "▁.", "x"]]
    assert stream_text(tok, ids)[0] == tok.decode(ids, skip_special_tokens=True) == " the. a.x"


def test_if_the_streaming_decoder_fails_the_stream_goes_on_with_whole_decodes():
    tok = sentencepiece_tokenizer(*GEMMA)
    ids = [tok.convert_tokens_to_ids(p) for p in ["▁the", "日", "<0xE6>", "<0x97>", "<0xA5>", "▁a", "b"]]

    class Broken:
        def step(self, *a):
            raise RuntimeError("invalid prefix")

    d, out = Detokenizer(tok), []
    out.append(d.add(ids[0]))
    d.stream = Broken()
    out += [d.add(t) for t in ids[1:]] + [d.flush()]
    assert d.stream is None and "".join(p for p in out if p) == tok.decode(ids, skip_special_tokens=True)


# ---- stop strings ---------------------------------------------------------------------------------
def test_stop_strings_cut_the_text_and_count_the_tokens_before_them():
    tok = char_tokenizer()
    rng = random.Random(1)
    ids_of = lambda s: tok(s, add_special_tokens=False).input_ids  # noqa: E731 (one token per character)
    for _ in range(400):
        full = "".join(rng.choice("ab c\n") for _ in range(rng.randint(1, 25)))
        i0 = rng.randrange(len(full))
        stop = full[i0 : i0 + rng.randint(1, 4)] if rng.random() < 0.8 else "zz"
        ts, released, ids, i = TextStream(tok, [stop, "qq"]), "", ids_of(full), 0
        while i < len(ids) and not ts.stopped:
            n = rng.randint(1, 5)
            released += ts.push(ids[i : i + n], final=i + n >= len(ids))
            assert stop not in released
            i += n
        cut = full.find(stop)
        assert released == (full[:cut] if cut >= 0 else full), (full, stop)
        assert ts.stopped == (cut >= 0)
        if cut >= 0:  # usage: the tokens covering the text before the stop string
            assert ts.tokens_released == cut


def test_text_that_may_start_a_stop_string_is_held_back_with_its_tokens():
    tok = char_tokenizer()
    ids = lambda s: tok(s, add_special_tokens=False).input_ids  # noqa: E731
    ts = TextStream(tok, ["abc"])
    assert (ts.push(ids("xa")), ts.tokens_released) == ("x", 1)
    assert (ts.push(ids("b")), ts.tokens_released) == ("", 1)
    assert (ts.push(ids("d")), ts.tokens_released) == ("abd", 4)
    ts = TextStream(tok, ["abc"])
    assert (ts.push(ids("xab")), ts.push(ids("c")), ts.stopped, ts.tokens_released) == ("x", "", True, 1)


# ---- Gemma 3's real tokenizer -------------------------------------------------------------------
@pytest.fixture(scope="module")
def gemma_tokenizer():
    from verispec.models import load_tokenizer

    return load_tokenizer("gemma3-270m")


TRICKY = ["日本語 🎉 naïve — ü\n\t  x", "   leading spaces and ▁ literal", "👩‍👩‍👧 family, ½ ∑ 𝔘 \ufffd end",
          "def f(x):\n    return x  # ok\n\n\n", "emoji at the end 🎉"]


@pytest.mark.real_model
def test_gemma_streamed_text_is_the_whole_decode(gemma_tokenizer):
    tok = gemma_tokenizer
    assert _plan(tok).backend is not None and len(_plan(tok).byte_ids) == 256
    rng = random.Random(0)
    cases = []
    for s in TRICKY:
        cases.append(tok(s, add_special_tokens=False).input_ids)
        cases.append(encode_with_byte_fallback(tok, s, rng))  # characters split into byte tokens
        ids = encode_with_byte_fallback(tok, s, rng)
        cases.append(ids[: rng.randrange(1, len(ids))])  # cut anywhere, even inside a character
    cases += [random_ids(tok, rng, rng.randint(1, 40)) for _ in range(400)]
    for ids in cases:
        for chunked in (None, rng):
            assert stream_text(tok, ids, chunked)[0] == tok.decode(ids, skip_special_tokens=True), ids


@pytest.mark.real_model
def test_gemma_stop_string_across_byte_tokens(gemma_tokenizer):
    tok = gemma_tokenizer
    rng = random.Random(2)
    full = "日本語 🎉 naïve ü end"
    for stop in ("本語 🎉", "🎉", "ï", " end", "語"):
        for _ in range(5):
            ids = encode_with_byte_fallback(tok, full, rng)
            ts, out, i = TextStream(tok, [stop]), "", 0
            while i < len(ids) and not ts.stopped:
                n = rng.randint(1, 6)
                out += ts.push(ids[i : i + n], final=i + n >= len(ids))
                i += n
            cut = full.find(stop)
            assert (out, ts.stopped) == (full[:cut], True), (stop, ids)
            n = ts.tokens_released  # the fewest tokens whose text covers the text before the stop
            assert tok.decode(ids[:n], skip_special_tokens=True).startswith(full[:cut])
            assert not tok.decode(ids[: n - 1], skip_special_tokens=True).startswith(full[:cut])
