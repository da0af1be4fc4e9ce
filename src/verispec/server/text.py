"""Incremental detokenization with stop strings.

Text is released only when it can no longer change: a trailing incomplete UTF-8 sequence is held
back, and so is any tail that could still grow into a stop string. When a stop string appears —
even in the middle of a run of accepted draft tokens — the text is cut before it and nothing
after it is ever released.

Tokens are released in step with their text (`tokens_released`): a token whose text is held back is
held back too, so the tokens (and logprobs) a client receives are exactly those of the text it
receives, and usage counts them: at a stop, the tokens covering the text before the stop string.
"""

from __future__ import annotations


class TextStream:
    def __init__(self, tokenizer, stop: list[str]):
        self.tokenizer = tokenizer
        self.stop = [s for s in stop if s]
        self.ids: list[int] = []
        self.sent = 0  # characters released so far
        self.stopped = False
        self.tokens_used = 0  # tokens whose text is (partly) inside the released text, at a stop
        self.tokens_released = 0  # tokens released with their text (all of it, or up to a stop)

    def push(self, new_ids: list[int], final: bool = False) -> str:
        """Add tokens; return the newly releasable text."""
        if self.stopped:
            return ""
        self.ids += new_ids
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
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
            full = len(text)
            text = text.rstrip("\ufffd")  # an incomplete multi-byte character may still complete
            hold = max((_overlap(text, s) for s in self.stop), default=0)
            text = text[: len(text) - hold]
            if len(text) == full:  # nothing held back: every token's text is out
                self.tokens_released = len(self.ids)
            else:  # (rare: a possible stop string or an incomplete character at the end)
                self.tokens_released = self._tokens_within(len(text))
        out = text[self.sent:] if len(text) > self.sent else ""
        self.sent = max(self.sent, len(text))
        return out

    def _tokens_within(self, n_chars: int) -> int:
        """The most tokens (from those released already) whose text fits in the first n_chars."""
        n = self.tokens_released
        while n < len(self.ids) and len(self.tokenizer.decode(self.ids[: n + 1], skip_special_tokens=True)) <= n_chars:
            n += 1
        return n

    def _tokens_covering(self, n_chars: int) -> int:
        for n in range(len(self.ids) + 1):
            if len(self.tokenizer.decode(self.ids[:n], skip_special_tokens=True)) >= n_chars:
                return n
        return len(self.ids)


def _overlap(text: str, stop: str) -> int:
    """Length of the longest suffix of text that is a proper prefix of stop."""
    for n in range(min(len(stop) - 1, len(text)), 0, -1):
        if text.endswith(stop[:n]):
            return n
    return 0
