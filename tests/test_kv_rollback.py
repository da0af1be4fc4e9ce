"""KVCache bookkeeping (allocate / free / commit / rollback / compact) and its effect on the forward.

The property behind speculative decoding: rows written for rejected draft tokens are never seen
again. After any mix of verify steps, partial commits, rollbacks and tree compaction, the rows
[0:length] of a slot equal those of a cache that only ever saw the accepted tokens, and the next
logits equal transformers' logits for the accepted sequence.
"""

from __future__ import annotations

import pytest
import torch

from conftest import FAMILIES, hf_logits, random_ids
from verispec.kv import CacheFullError, KVCache

pytestmark = pytest.mark.usefixtures("single_torch_thread")

ATOL = 1e-4
KV_ATOL = 1e-5  # K/V rows computed in different chunkings differ only by fp32 rounding


def _close(a, b, atol=ATOL, what=""):
    torch.testing.assert_close(a.float(), b.float(), atol=atol, rtol=0, msg=lambda m: f"{what}: {m}")


def _clean_cache(ours, ids: torch.Tensor, max_len: int) -> KVCache:
    """Reference: the accepted tokens only, prefilled in one call into slot 0."""
    cache = ours.new_cache(1, max_len)
    ours(ids, cache, [0], torch.tensor([0]), want_logits=False)
    cache.commit(0, ids.shape[1])
    return cache


def _assert_same_rows(cache: KVCache, slot: int, ref: KVCache, what=""):
    n = cache.lengths[slot]
    assert n == ref.lengths[0]
    for i, (k, v, rk, rv) in enumerate(zip(cache.k, cache.v, ref.k, ref.v)):
        _close(k[slot, :, :n], rk[0, :, :n], atol=KV_ATOL, what=f"{what} K layer {i}")
        _close(v[slot, :, :n], rv[0, :, :n], atol=KV_ATOL, what=f"{what} V layer {i}")


def _wrong(tok: torch.Tensor, vocab: int) -> torch.Tensor:
    """A token different from tok (a rejected draft)."""
    return 3 + (tok - 3 + 1 + tok % 7) % (vocab - 3)


# --------------------------------------------------------------------------------------------
# speculative rounds: verify k drafts, accept a prefix, leave / roll back the rest


# (accepted, mode): commit only the accepted rows, or commit everything then roll back
ROUNDS = [(1, "commit"), (3, "rollback"), (4, "commit"), (2, "rollback"), (1, "rollback"), (3, "commit")]


@pytest.mark.parametrize("family", FAMILIES)
@torch.no_grad()
def test_speculative_rounds_match_clean_decode(tiny_hf_model, family):
    hf, ours = tiny_hf_model(family)
    V = hf.config.vocab_size
    K = 4  # tokens verified per round
    seq = random_ids(30, V, seed=101)
    ref = hf_logits(hf, seq)
    cache = ours.new_cache(num_slots=2, max_len=32)
    slot = cache.allocate(32)
    P = 6
    ours(seq[:, :P], cache, [slot], torch.tensor([0]))
    cache.commit(slot, P)
    L = P
    for accepted, mode in ROUNDS:
        x = seq[:, L : L + K].clone()
        x[:, accepted:] = _wrong(x[:, accepted:], V)  # rejected drafts
        out = ours(x, cache, [slot], torch.tensor([L]))
        # rows fed with correct tokens see only correct tokens before them
        _close(out.logits[:, :accepted], ref[:, L : L + accepted], what=f"verify at {L}")
        if mode == "commit":
            cache.commit(slot, accepted)
        else:
            cache.commit(slot, K)
            cache.rollback(slot, L + accepted)
        L += accepted
        assert cache.lengths[slot] == L
    _assert_same_rows(cache, slot, _clean_cache(ours, seq[:, :L], 32), family)
    # continuing after the rounds gives the clean sequence's logits
    out = ours(seq[:, L : L + 5], cache, [slot], torch.tensor([L]))
    _close(out.logits, ref[:, L : L + 5], what="after rollback")


@pytest.mark.parametrize("family", ["llama", "gemma3"])
@torch.no_grad()
def test_rollback_into_committed_rows_then_diverge(tiny_hf_model, family):
    """Roll back past committed tokens and continue with a different continuation."""
    hf, ours = tiny_hf_model(family)
    V = hf.config.vocab_size
    a = random_ids(16, V, seed=111)
    b = torch.cat([a[:, :7], random_ids(9, V, seed=112)], 1)  # shares 7 tokens with a
    cache = ours.new_cache(1, 20)
    ours(a, cache, [0], torch.tensor([0]))
    cache.commit(0, 16)
    cache.rollback(0, 7)
    out = ours(b[:, 7:], cache, [0], torch.tensor([7]))
    cache.commit(0, 9)
    _close(out.logits, hf_logits(hf, b)[:, 7:])
    _assert_same_rows(cache, 0, _clean_cache(ours, b, 20))


@pytest.mark.parametrize("family", ["qwen2", "gemma3"])
@torch.no_grad()
def test_batched_verify_with_different_acceptance(tiny_hf_model, family):
    """Two sequences in non-contiguous slots verify together; each accepts a different count."""
    hf, ours = tiny_hf_model(family)
    V = hf.config.vocab_size
    seqs = [random_ids(24, V, seed=121), random_ids(24, V, seed=122)]
    refs = [hf_logits(hf, s) for s in seqs]
    slots = [2, 0]
    cache = ours.new_cache(3, 28)
    lens = [8, 5]
    for s, seq, n in zip(slots, seqs, lens):
        ours(seq[:, :n], cache, [s], torch.tensor([0]))
        cache.commit(s, n)
    for acc in ([1, 3], [4, 1], [2, 2]):
        x = torch.stack([seq[0, n : n + 4] for seq, n in zip(seqs, lens)])
        for b in range(2):
            x[b, acc[b] :] = _wrong(x[b, acc[b] :], V)
        out = ours(x, cache, slots, torch.tensor(lens))
        for b in range(2):
            _close(out.logits[b, : acc[b]], refs[b][0, lens[b] : lens[b] + acc[b]], what=f"seq {b}")
            cache.commit(slots[b], acc[b])
            lens[b] += acc[b]
    for b in range(2):
        _assert_same_rows(cache, slots[b], _clean_cache(ours, seqs[b][:, : lens[b]], 28), f"seq {b}")
    # the untouched slot 1 was never written
    assert all(k[1].abs().sum() == 0 for k in cache.k)


# --------------------------------------------------------------------------------------------
# token trees: verify a tree, compact the accepted path, continue


def _tree(parents):
    T = len(parents)
    mask = torch.zeros(T, T, dtype=torch.bool)
    depth = [0] * T
    for i, p in enumerate(parents):
        mask[i, i] = True
        if p >= 0:
            mask[i] |= mask[p]
            depth[i] = depth[p] + 1
    return mask, torch.tensor(depth)


@pytest.mark.parametrize("keep", [[0, 2], [0, 1, 3], [0, 2, 4], [0]], ids=str)
@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma3"])
@torch.no_grad()
def test_compact_accepted_tree_path(tiny_hf_model, family, keep):
    hf, ours = tiny_hf_model(family)
    V = hf.config.vocab_size
    parents = [-1, 0, 0, 1, 2]  # root; a, b children of root; a->3, b->4
    P = 7
    prefix = random_ids(P, V, seed=131)
    nodes = random_ids(len(parents), V, seed=132)
    nxt = random_ids(3, V, seed=133)
    mask, depth = _tree(parents)
    cache = ours.new_cache(2, 20)
    slot = 1
    ours(prefix, cache, [slot], torch.tensor([0]))
    cache.commit(slot, P)
    ours(nodes, cache, [slot], torch.tensor([P]), positions=(P + depth)[None], tree_mask=mask[None])

    cache.compact(slot, P, torch.tensor(keep))
    cache.commit(slot, len(keep))
    accepted = torch.cat([prefix, nodes[:, keep]], 1)
    _assert_same_rows(cache, slot, _clean_cache(ours, accepted, 20), f"keep={keep}")

    L = cache.lengths[slot]
    out = ours(nxt, cache, [slot], torch.tensor([L]))
    _close(out.logits, hf_logits(hf, torch.cat([accepted, nxt], 1))[:, L:], what="after compact")


@torch.no_grad()
def test_compact_moves_rows_only_in_its_slot():
    cache = KVCache(num_layers=2, num_slots=3, max_len=10, kv_heads=2, head_dim=4, dtype=torch.float32, device="cpu")
    for t in (*cache.k, *cache.v):
        t.copy_(torch.randn(t.shape))
    before = [t.clone() for t in (*cache.k, *cache.v)]
    cache.compact(1, 3, torch.tensor([0, 2, 3, 5]))
    for t, b in zip((*cache.k, *cache.v), before):
        assert torch.equal(t[0], b[0]) and torch.equal(t[2], b[2])
        assert torch.equal(t[1, :, :3], b[1, :, :3])  # below start: untouched
        assert torch.equal(t[1, :, 3:7], b[1, :, [3, 5, 6, 8]])  # overlapping moves read the old rows
        assert torch.equal(t[1, :, 7:], b[1, :, 7:])
    assert cache.lengths == [0, 0, 0]  # compact moves rows, the caller commits


# --------------------------------------------------------------------------------------------
# allocation bookkeeping


def _cache(num_slots=2, max_len=8):
    return KVCache(num_layers=2, num_slots=num_slots, max_len=max_len, kv_heads=2, head_dim=4, dtype=torch.float32, device="cpu")


def test_allocate_too_long_raises_clear_error():
    cache = _cache(max_len=8)
    assert cache.allocate(8) in (0, 1)  # exactly max_len fits
    with pytest.raises(CacheFullError, match=r"needs 9 KV rows but a slot holds 8"):
        cache.allocate(9)
    assert cache.num_free == 1  # a refused request takes no slot
    assert issubclass(CacheFullError, RuntimeError)


def test_allocate_without_free_slot_raises():
    cache = _cache(num_slots=2)
    got = {cache.allocate(4), cache.allocate(4)}
    assert got == {0, 1} and cache.num_free == 0
    with pytest.raises(CacheFullError, match=r"all 2 KV slots are in use"):
        cache.allocate(1)


def test_free_makes_slot_reusable_and_resets_length():
    cache = _cache(num_slots=2)
    a, b = cache.allocate(4), cache.allocate(4)
    cache.commit(a, 3)
    cache.commit(b, 2)
    cache.free(a)
    assert cache.num_free == 1
    assert cache.lengths[b] == 2  # other slot untouched
    c = cache.allocate(8)
    assert c == a and cache.lengths[c] == 0


def test_commit_and_rollback_bounds():
    cache = _cache()
    s = cache.allocate(8)
    cache.commit(s, 5)
    cache.rollback(s, 5)  # no-op is allowed
    cache.rollback(s, 2)
    assert cache.lengths[s] == 2
    with pytest.raises(ValueError, match="cannot roll slot"):
        cache.rollback(s, 3)  # cannot roll forward
    with pytest.raises(ValueError):
        cache.rollback(s, -1)
    cache.rollback(s, 0)
    assert cache.lengths[s] == 0


def test_bytes_per_token_matches_allocation():
    for dtype in (torch.float32, torch.bfloat16):
        cache = KVCache(num_layers=3, num_slots=2, max_len=5, kv_heads=2, head_dim=8, dtype=dtype, device="cpu")
        total = sum(t.numel() * t.element_size() for t in (*cache.k, *cache.v))
        assert total == KVCache.bytes_per_token(3, 2, 8, dtype) * 2 * 5


def test_double_free_never_hands_out_a_slot_twice():
    cache = _cache(num_slots=3)
    s = cache.allocate(4)
    cache.free(s)
    try:
        cache.free(s)
    except (ValueError, RuntimeError):
        return  # rejecting the double free is fine too
    got = [cache.allocate(4) for _ in range(cache.num_free if cache.num_free <= 3 else 3)]
    assert len(got) == len(set(got)), f"slots handed out twice: {got}"
