"""Incremental detokenization with stop strings.

Text is released only when it can no longer change: a trailing incomplete UTF-8 sequence is held
back, and so is any tail that could still grow into a stop string. When a stop string appears —
even in the middle of a run of accepted draft tokens — the text is cut before it and nothing
after it is ever released.

Tokens are released in step with their text (`tokens_released`): a token whose text is held back is
held back too, so the tokens (and logprobs) a client receives are exactly those of the text it
receives, and usage counts them: at a stop, the tokens covering the text before the stop string.

The text itself comes from a `Detokenizer`, which decodes each new token once instead of the whole
output at every step; what it releases, put together, is exactly `tokenizer.decode(output ids,
skip_special_tokens=True)`.
"""

from __future__ import annotations

import json
import logging
import weakref
from bisect import bisect_left, bisect_right
from dataclasses import dataclass

log = logging.getLogger(__name__)

REPLACEMENT = "\ufffd"


@dataclass(frozen=True)
class _Plan:
    """How to decode one tokenizer's output incrementally (worked out once per tokenizer).

    backend: the `tokenizers.Tokenizer` whose decode *is* the tokenizer's decode (None: decode the
    whole output through the tokenizer at each token, as a slow or post-processing tokenizer needs).
    byte_ids: byte-fallback tokens (<0xNN>) when the decoder has a ByteFallback step: such a
    decoder turns a whole run of byte tokens into one '\ufffd' per token when any byte of the run is
    invalid, so a run's text is final only once a token that is not a byte ends the run.
    skipped_ids: special tokens, which decode to nothing (skip_special_tokens) and do not end a run.
    """

    backend: object | None
    byte_ids: frozenset
    skipped_ids: frozenset


_PLANS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _plan(tokenizer) -> _Plan:
    try:
        return _PLANS[tokenizer]
    except (KeyError, TypeError):
        pass
    plan = _make_plan(tokenizer)
    try:
        _PLANS[tokenizer] = plan
    except TypeError:  # not weak-referenceable: worked out again next time
        pass
    return plan


def _make_plan(tokenizer) -> _Plan:
    backend = _streaming_backend(tokenizer)
    raw = backend if backend is not None else getattr(tokenizer, "_tokenizer", None)
    if raw is None or not hasattr(raw, "get_added_tokens_decoder"):
        return _Plan(None, frozenset(), frozenset())
    byte_ids = frozenset()
    if "ByteFallback" in _decoder_types(raw):
        ids = (raw.token_to_id(f"<0x{b:02{case}}>") for b in range(256) for case in "Xx")
        byte_ids = frozenset(i for i in ids if i is not None)
    skipped = frozenset(i for i, t in raw.get_added_tokens_decoder().items() if t.special)
    return _Plan(backend, byte_ids, skipped)


def _decoder_types(raw) -> set[str]:
    """The type names of every step of a `tokenizers.Tokenizer`'s decoder (nested sequences too)."""
    found: set[str] = set()

    def walk(node):
        if isinstance(node, dict):
            if "type" in node:
                found.add(node["type"])
            for v in node.values():
                walk(v)
        elif isinstance(node, list):
            for v in node:
                walk(v)

    if raw.decoder is not None:
        walk(json.loads(raw.decoder.__getstate__()))
    return found


def _streaming_backend(tokenizer):
    """The tokenizers.Tokenizer to stream with, when `tokenizer.decode(ids, skip_special_tokens=True)`
    is exactly its decode: a transformers fast tokenizer that does not override decoding and whose
    Python-side clean-up of spaces is off (or skipped, as transformers skips it for BPE models)."""
    try:
        from tokenizers import Tokenizer
        from tokenizers.decoders import DecodeStream
        from transformers import PreTrainedTokenizerFast
    except ImportError:
        return None
    backend = getattr(tokenizer, "_tokenizer", None)
    if not isinstance(backend, Tokenizer) or not isinstance(tokenizer, PreTrainedTokenizerFast):
        return None
    if type(tokenizer)._decode is not PreTrainedTokenizerFast._decode:
        return None
    if getattr(tokenizer, "clean_up_tokenization_spaces", False) and not _cleanup_skipped(tokenizer, backend):
        return None
    try:  # stepping by a list of ids (tokenizers >= 0.22): a held-back run is fed in one piece
        DecodeStream(skip_special_tokens=True).step(backend, [])
    except TypeError:
        return None
    return backend


def _cleanup_skipped(tokenizer, backend) -> bool:
    """transformers (5.x) ignores clean_up_tokenization_spaces for BPE models unless forced."""
    force = getattr(tokenizer, "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output", None)
    return force is False and type(backend.model).__name__ == "BPE"


class Detokenizer:
    """The text of a growing list of output tokens, one token at a time.

    `add(token)` returns the text that token completes — with the text of any tokens held back
    before it — or None while it is held back (an incomplete UTF-8 character, an open run of
    byte-fallback tokens). `flush()` releases the rest at the end. Everything released, in order,
    is exactly `tokenizer.decode(ids, skip_special_tokens=True)`.

    With a fast tokenizer each token costs one decode of a few tokens (the tokenizers library's
    `DecodeStream`), however long the output; otherwise, and if the stream ever fails, the whole
    output is decoded at each token.
    """

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.plan = _plan(tokenizer)
        self.stream = None
        if self.plan.backend is not None:
            from tokenizers.decoders import DecodeStream

            self.stream = DecodeStream(skip_special_tokens=True)
        self.ids: list[int] = []
        self.n_chars = 0  # characters released so far
        self.held = 0  # tokens at the end of ids whose text is not released yet
        self._unfed: list[int] = []  # held tokens not given to the stream yet (an open byte run)

    def add(self, token: int) -> str | None:
        self.ids.append(token)
        self.held += 1
        plan = self.plan
        if token in plan.skipped_ids:
            if self.held == 1:  # nothing before it is held: it is out at once, with no text
                self.held = 0
                return ""
            return None
        if self.stream is not None:
            self._unfed.append(token)
        if token in plan.byte_ids:  # the run's text is final only once a token that is not a byte ends it
            return None
        if self.stream is None:
            return self._release(self._decode_all(hold_incomplete=True))
        feed, self._unfed = self._unfed, []
        try:
            piece = self.stream.step(self.plan.backend, feed)
        except Exception as e:  # noqa: BLE001 - a decoder the stream cannot follow: decode whole outputs
            log.warning("streaming detokenization failed (%s); decoding whole outputs for this request", e)
            self.stream = None
            return self._release(self._decode_all(hold_incomplete=True))
        return self._release(piece)

    def flush(self) -> str:
        """The text of the tokens still held back (the output is complete)."""
        if not self.held:
            return ""
        self._unfed = []
        return self._release(self._decode_all(hold_incomplete=False)) or ""

    def _decode_all(self, hold_incomplete: bool) -> str | None:
        text = self.decode(self.ids)
        if hold_incomplete and text.endswith(REPLACEMENT):
            return None
        return text[self.n_chars:]

    def decode(self, ids: list[int]) -> str:
        """The whole decode of ids, as `tokenizer.decode(ids, skip_special_tokens=True)` gives it."""
        if self.plan.backend is not None:
            return self.plan.backend.decode(ids, skip_special_tokens=True)
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def _release(self, piece: str | None) -> str | None:
        if piece is None:
            return None
        self.n_chars += len(piece)
        self.held = 0
        return piece


class TextStream:
    def __init__(self, tokenizer, stop: list[str]):
        self.tokenizer = tokenizer
        self.stop = [s for s in stop if s]
        self.detok = Detokenizer(tokenizer)
        self.ids: list[int] = []
        self.text = ""  # decoded so far (released, plus any tail held back for a stop string)
        self.ends: list[int] = []  # ends[i]: len(text) once token i's text is in it
        self.sent = 0  # characters released so far
        self.stopped = False
        self.tokens_used = 0  # tokens whose text is (partly) inside the released text, at a stop
        self.tokens_released = 0  # tokens released with their text (all of it, or up to a stop)

    def push(self, new_ids: list[int], final: bool = False) -> str:
        """Add tokens; return the newly releasable text."""
        if self.stopped:
            return ""
        for t in new_ids:
            self.ids.append(t)
            self._append(self.detok.add(t))
        if final:
            self._append(self.detok.flush())
        text = self.text
        for s in self.stop:
            i = text.find(s, max(0, self.sent - len(s) + 1))
            if i != -1:
                text = text[:i]
                self.stopped = True
        if self.stopped:
            self.tokens_used = self._tokens_covering(len(text))
            self.tokens_released = max(self.tokens_released, self.tokens_used)
        elif final:
            self.tokens_released = len(self.ids)
        else:
            hold = max((_overlap(text, s) for s in self.stop), default=0)
            text = text[: len(text) - hold]
            if not hold and len(self.ends) == len(self.ids):  # nothing held back: every token's text is out
                self.tokens_released = len(self.ids)
            else:  # (rare: a possible stop string or an incomplete character at the end)
                self.tokens_released = max(self.tokens_released, bisect_right(self.ends, len(text)))
        out = text[self.sent:] if len(text) > self.sent else ""
        self.sent = max(self.sent, len(text))
        return out

    def _append(self, piece: str | None) -> None:
        if piece is None:
            return
        self.text += piece
        self.ends.extend([len(self.text)] * (len(self.ids) - len(self.ends)))

    def _tokens_covering(self, n_chars: int) -> int:
        """The fewest tokens whose text covers the first n_chars characters."""
        if n_chars <= 0:
            return 0
        j = bisect_left(self.ends, n_chars)  # the first token released with text reaching n_chars
        if j >= len(self.ends):
            return len(self.ids)
        last = bisect_right(self.ends, self.ends[j])  # ... and the tokens released with it
        want = self.text[:n_chars]
        for n in range(j + 1, last):  # several tokens came out as one piece (a byte run, a split character)
            if self.detok.decode(self.ids[:n]).startswith(want):
                return n
        return last


def _overlap(text: str, stop: str) -> int:
    """Length of the longest suffix of text that is a proper prefix of stop."""
    for n in range(min(len(stop) - 1, len(text)), 0, -1):
        if text.endswith(stop[:n]):
            return n
    return 0
