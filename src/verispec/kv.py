"""The engine-owned KV cache: preallocated slots, one per running sequence.

Each slot holds up to `max_len` rows for every layer. A slot's length is the number of rows that
belong to its sequence; the model writes new rows past the length and the engine then commits the
accepted ones (`commit`) — rejected rows are simply left behind and overwritten by the next step.
Rolling back is moving an integer, O(1), and allocating is handing out a free slot index.

Memory is fixed at construction (`bytes_per_token * num_slots * max_len`): a sequence that cannot
fit is refused up front with `CacheFullError`, never by running out of memory mid-decode.
"""

from __future__ import annotations

import torch

KV_BLOCK = 512  # PyTorch's CPU flash attention splits keys in blocks of 512: batch-invariant forwards pad to whole blocks


def round_up(n: int, m: int) -> int:
    return -(-n // m) * m


class CacheFullError(RuntimeError):
    """A request needs more KV rows than the cache can hold."""


class KVCache:
    def __init__(self, num_layers, num_slots, max_len, kv_heads, head_dim, dtype, device):
        shape = (num_slots, kv_heads, max_len, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.max_len = max_len
        self.lengths = [0] * num_slots
        self._free = list(range(num_slots - 1, -1, -1))

    @staticmethod
    def bytes_per_token(num_layers, kv_heads, head_dim, dtype) -> int:
        return 2 * num_layers * kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()

    @property
    def num_slots(self) -> int:
        return len(self.lengths)

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, rows_needed: int) -> int:
        """Reserve a slot for a sequence that will hold at most `rows_needed` rows."""
        if rows_needed > self.max_len:
            raise CacheFullError(
                f"sequence needs {rows_needed} KV rows but a slot holds {self.max_len} "
                f"(raise max_model_len or shorten the prompt / max_tokens)"
            )
        if not self._free:
            raise CacheFullError(f"all {self.num_slots} KV slots are in use")
        slot = self._free.pop()
        self.lengths[slot] = 0
        return slot

    def free(self, slot: int) -> None:
        if slot in self._free:
            raise ValueError(f"KV slot {slot} is already free")
        self.lengths[slot] = 0
        self._free.append(slot)

    def commit(self, slot: int, n: int) -> None:
        """The next n rows written past the length now belong to the sequence."""
        self.lengths[slot] += n

    def share_prefix(self, src: int, dst: int, n: int) -> None:
        """Slot `dst` (empty) takes a copy of the first n rows of slot `src`: a prompt prefilled once
        serves every request with the same prompt (parallel sampling)."""
        if n > self.lengths[src] or self.lengths[dst]:
            raise ValueError(f"cannot share {n} rows of slot {src} (length {self.lengths[src]}) with slot {dst} "
                             f"(length {self.lengths[dst]})")
        for t in (*self.k, *self.v):
            t[dst, :, :n] = t[src, :, :n]
        self.lengths[dst] = n

    def rollback(self, slot: int, length: int) -> None:
        """Forget every row from `length` on (O(1): the rows are overwritten later)."""
        if not 0 <= length <= self.lengths[slot]:
            raise ValueError(f"cannot roll slot {slot} back to {length} (length {self.lengths[slot]})")
        self.lengths[slot] = length

    def compact(self, slot: int, start: int, keep: torch.Tensor) -> None:
        """Move rows `start + keep[i]` to `start + i` (the accepted path of a token tree)."""
        src = start + keep.to(self.k[0].device)
        dst = start + torch.arange(len(keep), device=src.device)
        for t in (*self.k, *self.v):
            t[slot, :, dst] = t[slot, :, src]
