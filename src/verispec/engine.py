"""The engine: requests in, tokens out, one speculative step at a time for the whole batch.

    step():  admit + prefill new requests   (KV slots permitting; the rest wait)
             plan    -> policy.budgets(running, holding)   draft nodes per request (policy.py)
             draft   -> drafter.propose(running, budgets)   a chain or a token tree each
             verify  -> ONE target forward over [last token, draft nodes] per request
             accept  -> verifier.verify(...)           lossless chain / tree rule (verify/)
             commit  -> kv.compact(accepted path); kv.commit(slot, 1 + accepted);
                        drafter.on_commit(...). Rejected rows are simply left behind.

Requests may join and leave between steps; each has its own sampling parameters, generator and
draft length, so a batch mixes greedy and sampled requests freely.
"""

from __future__ import annotations

import itertools
import logging
import random
import time
from collections import deque
from dataclasses import dataclass, field

import torch

from .drafters import Draft, Drafter, TreeShape, make_drafter
from .kv import KV_BLOCK, CacheFullError, KVCache, round_up
from .models import DEFAULT_MODEL, CausalLM, ForwardOutput, load_model, load_tokenizer
from .models.paths import PathViews
from .options import MAX_DRAFT_TOKENS, QUANT_MODES
from .policy import DraftLengthPolicy, FixedDraftLength
from .sampling import SamplingParams, argmax, probs, sample
from .sequence import Sequence, SpecStats
from .verify import for_draft

log = logging.getLogger(__name__)


DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16}


DRAFT_POLICIES = ("adaptive", "adaptive-topb", "fixed")


@dataclass
class EngineConfig:
    model: str = DEFAULT_MODEL
    drafter: str | None = "ngram"  # ngram | draft:<path> | layerskip:<N> | None
    num_draft_tokens: int = 5  # draft nodes verified per step (a chain's length, a tree's node budget)
    draft_tree: str = "chain"  # chain | dynamic[:W] | static:B1,B2,..  (drafters.TreeShape)
    dtype: str = "bfloat16"
    quant: str = "none"  # none | int8 | int4: weight-only quantized target (models/quant.py)
    device: str = "cpu"
    max_batch_size: int = 8  # KV slots: requests decoded at once (more wait in the queue)
    kv_cache_mb: float | None = None  # if set, the target's KV memory budget; it must hold max_batch_size slots
    max_model_len: int = 2048  # KV rows per sequence (prompt + output + draft)
    exact: bool = False  # batch-invariant numerics in fp32 too (one GEMV per row); bf16 is invariant already
    # False: the fastest kernels, whose rounding may depend on the batch and the verify window, so
    # speculative output equals plain output only up to near-ties; for jobs that compare no two runs
    # (data regeneration: 54.6 against 32.9 tok/s for invariant bf16 on a 64-prompt probe)
    batch_invariant: bool = True
    prefill_chunk: int = 256  # prompt tokens prefilled per engine step, over all requests
    # which drafted nodes to verify: "adaptive" (by confidence and measured cost, adaptive/),
    # "adaptive-topb" (the same with vLLM's global top-B budget) or "fixed" (all of them, up to k)
    draft_policy: str = "adaptive"

    def __post_init__(self):
        if self.dtype not in DTYPES:
            raise ValueError(f"unknown dtype {self.dtype!r}; choose one of {', '.join(DTYPES)}")
        if self.quant not in QUANT_MODES:
            raise ValueError(f"unknown quantization {self.quant!r}; choose one of {', '.join(QUANT_MODES)}")
        if not 0 <= self.num_draft_tokens <= MAX_DRAFT_TOKENS:
            raise ValueError(f"num_draft_tokens must be between 0 and {MAX_DRAFT_TOKENS}, got {self.num_draft_tokens}")
        if self.max_batch_size < 1 or self.max_model_len < 2:
            raise ValueError("max_batch_size must be >= 1 and max_model_len >= 2")
        TreeShape.parse(self.draft_tree)  # refuse a bad shape up front
        if self.draft_policy not in DRAFT_POLICIES:
            raise ValueError(f"unknown draft policy {self.draft_policy!r}; choose from {', '.join(DRAFT_POLICIES)}")
        if self.exact and not self.batch_invariant:
            raise ValueError("exact mode is batch-invariant numerics; it cannot be combined with batch_invariant=False")


@dataclass
class RequestOutput:
    id: int
    prompt_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str
    stats: SpecStats
    seconds: float = 0.0  # wall time of the generate call that produced it

    def to_dict(self) -> dict:
        return {"id": self.id, "prompt_tokens": len(self.prompt_ids), "token_ids": self.token_ids, "text": self.text,
                "finish_reason": self.finish_reason, **self.stats.to_dict()}


@dataclass
class GenerateResult:
    outputs: list[RequestOutput]
    seconds: float
    stats: SpecStats = field(default_factory=SpecStats)

    @property
    def num_tokens(self) -> int:
        return sum(len(o.token_ids) for o in self.outputs)

    @property
    def tokens_per_second(self) -> float:
        return self.num_tokens / self.seconds if self.seconds else 0.0


@dataclass
class StepEvent:
    """What one request got from one engine step (the server streams these)."""

    seq: Sequence
    new_tokens: list[int]
    finished: bool


class Engine:
    def __init__(self, model: CausalLM, tokenizer, config: EngineConfig, drafter: Drafter | None = None,
                 policy: DraftLengthPolicy | None = None):
        self.model, self.tokenizer, self.config = model, tokenizer, config
        self.drafter = drafter
        self.policy = policy or make_policy(config, model, drafter)
        if policy is not None and hasattr(policy, "reach"):  # carried from another engine, maybe a smaller one
            policy.reach(profile_tokens(config), profile_loader(config, model))
        if drafter is not None and hasattr(self.policy, "profile"):
            # the cost profile at engine start, loaded or measured (minutes, once per machine): in a
            # request's first step it stalled a fresh server's first requests for 213 s (session 35)
            _ = self.policy.profile
        self.tree = TreeShape.parse(config.draft_tree)
        # chains verify packed, one entry per node, where attention reads the cache in place (CPU)
        self.packs_chains = model.device.type == "cpu"
        if hasattr(self.policy, "packed_chains"):
            self.policy.packed_chains = self.packs_chains  # what a window costs depends on it
        # Forwards are batch-invariant whenever that is (nearly) free — bf16/fp16 on CPU: GEMM rows
        # in blocks of at most 64 (rows that do not depend on the row count), attention over a key
        # length rounded up to the CPU kernel's 512-key block — so a token's bits do not depend on
        # the verify window, on which other requests share the batch, nor on how its prompt was
        # cut into prefill chunks. fp32 pays for it only in exact mode; batch_invariant=False turns it off.
        self.invariant = config.exact or (config.batch_invariant and model.dtype != torch.float32)
        self.max_len = min(config.max_model_len, model.config.max_position_embeddings)
        rows = round_up(self.max_len + config.num_draft_tokens + 1, KV_BLOCK)
        c = model.config
        need_mb = config.max_batch_size * rows * KVCache.bytes_per_token(c.num_layers, c.num_kv_heads, c.head_dim,
                                                                          model.dtype) / 2**20
        if config.kv_cache_mb is not None and need_mb > config.kv_cache_mb:
            raise CacheFullError(
                f"{config.max_batch_size} KV slots of {rows} tokens need {need_mb:.0f} MiB, over the budget of "
                f"{config.kv_cache_mb:g} MiB (lower max_batch_size or max_model_len)"
            )
        self.cache: KVCache = model.new_cache(config.max_batch_size, rows)
        self.waiting: deque[Sequence] = deque()
        self.prefilling: list[Sequence] = []  # holding a KV slot, prompt partly in the cache
        self.running: list[Sequence] = []  # decoding
        self.drafter_errors = 0
        self._ids = 0
        self.eos = set(model.config.eos_token_ids)
        if tokenizer is not None and tokenizer.eos_token_id is not None:
            self.eos.add(tokenizer.eos_token_id)

    # ---- requests -------------------------------------------------------------------------
    def add_request(self, prompt_ids: list[int], params: SamplingParams, num_draft_tokens: int | None = None,
                    tree: TreeShape | str | None = None) -> Sequence:
        """Queue a request; it waits (never dropped) until a KV slot is free."""
        if not prompt_ids:
            raise ValueError("the prompt is empty")
        need = len(prompt_ids) + params.max_tokens
        if need > self.max_len:
            raise CacheFullError(
                f"prompt ({len(prompt_ids)} tokens) + max_tokens ({params.max_tokens}) = {need} exceeds the "
                f"context of {self.max_len} tokens"
            )
        seed = params.seed if params.seed is not None else random.getrandbits(63)
        gen = torch.Generator(self.model.device).manual_seed(seed)
        seq = Sequence(self._ids, list(prompt_ids), params, gen)
        k = self.config.num_draft_tokens if num_draft_tokens is None else num_draft_tokens
        seq.num_draft_tokens = max(0, k) if self.drafter is not None else 0
        seq.tree = TreeShape.parse(tree) if isinstance(tree, str) else (tree or self.tree)
        self._ids += 1
        self.waiting.append(seq)
        return seq

    def abort(self, seq: Sequence) -> None:
        """Cancel a request: its KV slot is free at once."""
        if seq in self.waiting:
            self.waiting.remove(seq)
            seq.finish_reason = "abort"
        elif seq in self.prefilling or seq in self.running:
            self._finish(seq, "abort")

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.prefilling or self.running)

    @property
    def num_active(self) -> int:
        return len(self.prefilling) + len(self.running)

    # ---- the step -------------------------------------------------------------------------
    @torch.inference_mode()
    def step(self) -> list[StepEvent]:
        """One engine step: admit, one budget of prefill chunks, then one speculative decode step
        for every running request. Returns what each request received."""
        while self.waiting and self.cache.num_free:
            seq = self.waiting.popleft()
            seq.slot = self.cache.allocate(len(seq.prompt_ids) + seq.params.max_tokens)
            self.prefilling.append(seq)
        prefill = self._prefill_chunks()
        if not self.running:
            return self._run_prefill(*prefill)
        return self._decode_step(list(self.running), prefill)

    def _decode_step(self, seqs: list[Sequence], prefill=((), {})) -> list[StepEvent]:
        """One speculative step for `seqs`. The prompt chunks of `prefill` (`_prefill_chunks`) ride
        in the same forward where it is packed: a request admitted beside running ones then costs
        its prompt's rows, not a forward of its own (a straggler's prefill read every weight and
        the LM head again). Elsewhere they run first, in a forward of their own."""
        budgets = self.policy.budgets(seqs, self.config.num_draft_tokens, self.num_active)  # KV slack is sized for it
        t0 = time.perf_counter()  # the drafter's own time (the policy's is not what it costs to draft)
        drafts = self._propose(seqs, budgets)
        draft_seconds = time.perf_counter() - t0
        packed = self.packs_chains and all(d.parents is None for d in drafts)  # admit keeps chains chains
        chunks, twins = prefill
        # a prefill of its own runs before admit: the policy times the step from there
        events = [] if packed or not chunks else self._run_prefill(chunks, twins)
        riders = chunks if packed else []
        if riders:  # the adaptive policy prices its plan, and times the step, with their tokens
            self.policy.riders(sum(len(c) for _, _, c, _ in riders), sum(1 for *_, last in riders if last))
        drafts = self.policy.admit(seqs, drafts, draft_seconds)
        width = 1 + max(len(d.tokens) for d in drafts)
        starts = [self.cache.lengths[s.slot] for s in seqs]
        self.model.set_batch_invariant(self.invariant)
        top = max([st + width for st in starts] + [d + len(c) for _, d, c, _ in riders])
        kv_len = round_up(top, KV_BLOCK) if self.invariant else None
        if packed:
            out, rider_outs = self._chain_forward(seqs, drafts, starts, width, kv_len, riders)
        else:
            out = self._window_forward(seqs, drafts, starts, width, kv_len)
        # logits of the real rows only: the LM head is the largest matmul, padding rows need none;
        # and of the last rows of the prompts that end here
        sizes = [1 + len(d.tokens) for d in drafts]
        ends = [o.last_hidden[0, -1:] for o, (_, _, _, last) in zip(rider_outs, riders) if last] if riders else []
        starting = [s for q, *_, last in riders if last for s in (q, *twins.get(q.id, ()))]
        flat, best = self._head(torch.cat([out.last_hidden[b, :n] for b, n in enumerate(sizes)] + ends), seqs + starting)
        if riders:
            first = iter(flat[sum(sizes):].split(1) if flat is not None else best[sum(sizes):])  # [1, V] or a token each
            flat = flat[: sum(sizes)] if flat is not None else None  # [sum sizes, V]
            events += self._finish_prefill(riders, twins, rider_outs, [next(first) if last else None for *_, last in riders])
        logits = flat.split(sizes) if flat is not None else [None] * len(seqs)
        offsets = [0, *itertools.accumulate(sizes)]
        verdicts = []
        for b, (s, d) in enumerate(zip(seqs, drafts)):
            verifier = for_draft(d)
            if s.params.greedy:
                v = verifier.greedy(best[offsets[b] : offsets[b + 1]], d)
            else:
                v = verifier.verify(logits[b], d, s.params, s.generator)  # logits[b]: [1 + n, V]
            verdicts.append(v)
            s.stats.record(len(d.tokens), v.accepted, len(v.tokens), depth=d.depth)
            rows = [0] + [i + 1 for i in v.path]  # window rows kept: the root, then the accepted path
            if rows != list(range(len(rows))):
                self.cache.compact(s.slot, starts[b], torch.tensor(rows))
            self.cache.commit(s.slot, len(rows))
            self._on_commit(s, out, b, starts[b], rows)
            events.append(self._emit(s, v.tokens, logits[b], rows))
        self.policy.observe(seqs, drafts, verdicts)
        return events

    def _window_forward(self, seqs, drafts, starts, width, kv_len) -> ForwardOutput:
        """The verify forward as a [B, width] batch: every request's window padded to the longest
        (trees attend along their paths: each path as plain decoding would)."""
        dev = self.model.device
        ids = torch.tensor([[s.tokens[-1]] + d.tokens + [0] * (width - 1 - len(d.tokens)) for s, d in zip(seqs, drafts)])
        depths = [[0] + d.depths() + [0] * (width - 1 - len(d.tokens)) for d in drafts]
        positions = torch.tensor(starts)[:, None] + torch.tensor(depths)  # [B, width]: a node sits at its depth
        paths = None
        if any(d.parents is not None for d in drafts):
            parents = [[p + 1 for p in d.parents] if d.parents is not None else list(range(len(d.tokens))) for d in drafts]
            paths = PathViews.build([s.slot for s in seqs], starts, parents, width, kv_len or max(starts) + width, dev)
        return self.model(ids.to(dev), self.cache, [s.slot for s in seqs], torch.tensor(starts),
                          positions=positions.to(dev), taps=self._taps, kv_len=kv_len, paths=paths, want_logits=False)

    def _chain_forward(self, seqs, drafts, starts, width, kv_len, riders=()) -> tuple[ForwardOutput, list[ForwardOutput]]:
        """The verify forward for chains, packed: one single-token entry per node (the last token,
        then the draft) at its own cache row and position, so a request's forward carries the
        nodes it verifies and no padding up to the batch's longest window (16 requests, 8 of them
        verifying one node: 24 tokens, not 32). Every entry writes its keys before any attends, and
        its mask is plain decoding's for that row, so a node's bits are what plain decoding would
        give it. The native attention kernel reads the repeated slots in place; elsewhere attention
        would gather the cache once per entry, so other devices take the padded window
        (`packs_chains`). Prompt chunks (`riders`: (seq, rows done, chunk ids, last)) follow as
        entries of the same kind, a prompt token at its own row: the bits of a prefill alone.
        Returns the hidden states as [B, width, H], as the padded forward does, and each rider's as
        a one-request forward's [1, n, H]."""
        dev = self.model.device
        sizes = [1 + len(d.tokens) for d in drafts]
        ids = [t for s, d in zip(seqs, drafts) for t in (s.tokens[-1], *d.tokens)] + [t for _, _, c, _ in riders for t in c]
        slots = [s.slot for s, n in zip(seqs, sizes) for _ in range(n)] + [q.slot for q, _, c, _ in riders for _ in c]
        rows = [st + j for st, n in zip(starts, sizes) for j in range(n)] + [d + j for _, d, c, _ in riders for j in range(len(c))]
        out = self.model(torch.tensor(ids, device=dev)[:, None], self.cache, slots, torch.tensor(rows),  # [E, 1]: row = position
                         taps=self._taps, kv_len=kv_len, want_logits=False)
        offsets = list(itertools.accumulate([0, *sizes]))
        index = torch.tensor([[o + min(j, n - 1) for j in range(width)] for o, n in zip(offsets, sizes)], device=dev)
        # [B, width]: entry of each request's row j (a padding row repeats its last node and is never read)
        verify = ForwardOutput(None, {i: h[:, 0][index] for i, h in out.hidden.items()}, out.last_hidden[:, 0][index]) \
            if seqs else None
        parts, at = [], offsets[-1]
        for _, _, c, _ in riders:
            part = slice(at, at + len(c))
            parts.append(ForwardOutput(None, {i: h[part, 0][None] for i, h in out.hidden.items()}, out.last_hidden[part, 0][None]))
            at += len(c)
        return verify, parts

    def _propose(self, seqs: list[Sequence], ks: list[int]) -> list[Draft]:
        """Drafts for the batch. A drafter that raises is retried request by request; a request
        whose drafting fails falls back to plain decoding for good (counted in drafter_errors)."""
        if self.drafter is None or not any(k > 0 for k in ks):
            return [Draft([]) for _ in seqs]
        try:
            drafts = self.drafter.propose(seqs, ks)
        except Exception:
            drafts = []
            for s, k in zip(seqs, ks):
                try:
                    drafts.append(self.drafter.propose([s], [k])[0] if k > 0 else Draft([]))
                except Exception:
                    log.exception("drafter %s failed for request %d; it continues without speculation",
                                  self.drafter.name, s.id)
                    self.drafter_errors += 1
                    s.num_draft_tokens = 0
                    drafts.append(Draft([]))
        return [d.truncate(k) for d, k in zip(drafts, ks)]

    def _prefill_chunks(self) -> tuple[list[tuple], dict[int, list[Sequence]]]:
        """This step's prompt chunks, at most `prefill_chunk` tokens in all, so a long prompt delays
        the running requests' decode by one chunk at a time instead of stalling them: (seq, rows
        already in the cache, chunk ids, whether the prompt ends with it) per request, and the twins
        of each prompt that ends here from its first row (requests with the same prompt, admitted
        but not started: they take a copy of its rows, so parallel sampling prefills a prompt once)."""
        chunks, twins, budget = [], {}, self.config.prefill_chunk
        for seq in self.prefilling:
            if budget <= 0:
                break
            if any(seq is t for ts in twins.values() for t in ts):
                continue
            done_rows = self.cache.lengths[seq.slot]
            chunk_ids = seq.prompt_ids[done_rows : done_rows + budget]
            last = done_rows + len(chunk_ids) == len(seq.prompt_ids)
            chunks.append((seq, done_rows, chunk_ids, last))
            budget -= len(chunk_ids)
            if last and done_rows == 0:
                twins[seq.id] = [t for t in self.prefilling if t is not seq and not self.cache.lengths[t.slot]
                                 and t.prompt_ids == seq.prompt_ids and not any(t is c[0] for c in chunks)]
        return chunks, twins

    def _run_prefill(self, chunks, twins) -> list[StepEvent]:
        """The prompt chunks in a forward of their own: several packed (as `_chain_forward` packs
        drafts, one LM head call for the prompts that end: a forward per request read every weight
        and multiplied the 262k-row head for its one row), one as a [1, T] batch."""
        if not chunks:
            return []
        self.model.set_batch_invariant(self.invariant)  # a prompt's bits must not depend on its chunking
        if len(chunks) > 1 and self.packs_chains:
            top = max(d + len(c) for _, d, c, _ in chunks)
            _, outs = self._chain_forward([], [], [], 0, round_up(top, KV_BLOCK) if self.invariant else None, chunks)
            ends = [o.last_hidden[0, -1:] for o, (*_, last) in zip(outs, chunks) if last]  # [1, H] each
            first = iter(self._first_rows(ends, chunks, twins))
            return self._finish_prefill(chunks, twins, outs, [next(first) if last else None for *_, last in chunks])
        outs = []
        for seq, done_rows, chunk_ids, last in chunks:
            outs.append(self.model(
                torch.tensor([chunk_ids], device=self.model.device), self.cache, [seq.slot], torch.tensor([done_rows]),
                want_logits=False, taps=self._taps,
                kv_len=round_up(done_rows + len(chunk_ids), KV_BLOCK) if self.invariant else None,
            ))
        ends = [o.last_hidden[0, -1:] for o, (*_, last) in zip(outs, chunks) if last]
        first = iter(self._first_rows(ends, chunks, twins))
        return self._finish_prefill(chunks, twins, outs, [next(first) if last else None for *_, last in chunks])

    def _first_rows(self, ends: list[torch.Tensor], chunks, twins) -> list:
        """What the prompts that end in `chunks` start from: their last rows' logits [1, V] each, or
        their greedy first tokens (`_head`)."""
        if not ends:
            return []
        starting = [s for q, *_, last in chunks if last for s in (q, *twins.get(q.id, ()))]
        flat, best = self._head(torch.cat(ends), starting)
        return list(flat.split(1)) if flat is not None else best

    def _head(self, h: torch.Tensor, seqs: list[Sequence]) -> tuple[torch.Tensor | None, list[int] | None]:
        """The LM head over rows h [R, H] of the requests `seqs`: (fp32 logits [R, V], each row's
        argmax if a request is greedy), or (None, the argmax tokens) where every request is greedy
        without logprobs, so nothing else reads the logits: the model's greedy tokens, the same
        ones without fp32 logits (`CausalLM.greedy_tokens`: for a few rows the greedy head reads
        a fraction of the head's bytes, models/greedy_head.py)."""
        if all(s.params.greedy and s.params.logprobs is None for s in seqs):
            best = self.model.greedy_tokens(h)
            if best is not None:
                return None, best.tolist()
        flat = self.model.lm_logits(h)
        # greedy requests need only each row's argmax: one call for the batch, not one per request
        return flat, argmax(flat).tolist() if any(s.params.greedy for s in seqs) else None

    def _finish_prefill(self, chunks, twins, outs: list[ForwardOutput], logits: list) -> list[StepEvent]:
        """Commit the chunks' rows (outs: each a one-request forward's), hand the drafter their
        states, and start the requests whose prompt ended (logits: [1, V] each, None elsewhere)."""
        events = []
        for (seq, done_rows, chunk_ids, last), out, lg in zip(chunks, outs, logits):
            self.cache.commit(seq.slot, len(chunk_ids))
            self._on_commit(seq, out, 0, done_rows, range(len(chunk_ids)))
            if not last:
                continue
            for t in twins.get(seq.id, []):
                self.cache.share_prefix(seq.slot, t.slot, len(chunk_ids))
                self._on_commit(t, out, 0, 0, range(len(chunk_ids)))
            for s in [seq, *twins.get(seq.id, [])]:
                events.append(self._first_token(s, lg))
        return events

    def _first_token(self, seq: Sequence, head) -> StepEvent:
        """The prompt is in the cache: token 1, sampled from the last prompt row's logits [1, V], or
        the greedy token `_head` gave instead (an int)."""
        self.prefilling.remove(seq)
        self.running.append(seq)
        if isinstance(head, int):
            return self._emit(seq, [head], None)
        return self._emit(seq, [sample(probs(head, seq.params)[0], seq.generator)], head)

    @property
    def _taps(self) -> tuple[int, ...]:
        return tuple(t for t in self.drafter.target_taps if t >= 0) if self.drafter else ()

    def _on_commit(self, seq: Sequence, out, b: int, start: int, rows) -> None:
        """Hand the drafter the target hidden states of the rows just committed for seq (forward
        rows `rows` of batch entry b, now cache rows start, start + 1, ...)."""
        if self.drafter is None or seq.finished:
            return
        hidden = {}
        if self.drafter.target_taps:
            idx = torch.as_tensor(list(rows), device=out.last_hidden.device)
            hidden = {i: h[b, idx] for i, h in out.hidden.items()}
            if -1 in self.drafter.target_taps:
                hidden[-1] = out.last_hidden[b, idx]
        self.drafter.on_commit(seq, start, hidden)

    def _emit(self, seq: Sequence, tokens: list[int], logits: torch.Tensor, rows=None) -> StepEvent:
        """Append emitted tokens up to a stop condition (finishing the sequence if one is met).
        logits[rows]: [len(tokens), V], the target logits each token was chosen from (for logprobs;
        selected only then: a copy of 1 MB a row)."""
        p = seq.params
        kept = []
        for t in tokens:
            kept.append(t)
            seq.tokens.append(t)
            if (t in self.eos and not p.ignore_eos) or t in p.stop_token_ids:
                self._finish(seq, "stop")
                break
            if seq.num_output >= p.max_tokens:
                self._finish(seq, "length")
                break
        if p.logprobs is not None:
            lp = (logits if rows is None else logits[rows])[: len(kept)].float().log_softmax(-1)  # [n, V]
            chosen = lp.gather(1, torch.tensor(kept, device=lp.device)[:, None])[:, 0].tolist()
            top = lp.topk(p.logprobs, dim=-1) if p.logprobs > 0 else None
            for i, t in enumerate(kept):
                alts = dict(zip(top.indices[i].tolist(), top.values[i].tolist())) if top is not None else {}
                seq.logprobs.append((t, chosen[i], alts))
        return StepEvent(seq, kept, seq.finished)

    def _finish(self, seq: Sequence, reason: str) -> None:
        seq.finish_reason = reason
        if seq in self.running:
            self.running.remove(seq)
        else:
            self.prefilling.remove(seq)
        self.cache.free(seq.slot)
        if self.drafter is not None:
            self.drafter.release(seq)


def make_policy(config: EngineConfig, model: CausalLM, drafter: Drafter | None) -> DraftLengthPolicy:
    """The draft-length policy the config names. The adaptive ones load the verify cost profile
    when the engine starts (measured once per machine and model, then cached: adaptive/costs.py)."""
    if config.draft_policy == "fixed" or drafter is None or config.num_draft_tokens == 0:
        return FixedDraftLength()
    from .adaptive.policy import AdaptiveDraftLength

    planner = "topb" if config.draft_policy == "adaptive-topb" else "greedy"
    return AdaptiveDraftLength(profile_loader(config, model), planner, max_depth=max(1, config.num_draft_tokens))


def profile_tokens(config: EngineConfig) -> int:
    """How far the adaptive policy's cost profile must reach: the largest forward this engine runs,
    every request's root and k draft nodes, plus a prompt chunk riding along where several requests
    run (a lone request's prompt is prefilled before it decodes), rounded up to a power of two (so
    that a policy carried up a load sweep measures a longer profile twice, not at every level),
    at most 1024 (past its last point a profile is extrapolated along its last segment)."""
    c = config
    need = c.max_batch_size * (c.num_draft_tokens + 1) + (c.prefill_chunk if c.max_batch_size > 1 else 0)
    return min(1024, 1 << max(0, need - 1).bit_length())


def profile_loader(config: EngineConfig, model: CausalLM):
    """The engine's cost profile, loaded (or measured, once per machine and model) when called: the
    engine calls it as it starts (a carried policy's, if its own profile stops short)."""
    from .adaptive.costs import load_or_measure

    max_tokens = profile_tokens(config)
    return lambda: load_or_measure(model, max_tokens, config.max_batch_size)


class LLM:
    """The Python API: `LLM("gemma3-270m", drafter="ngram").generate(["def f(x):"], SamplingParams())`."""

    def __init__(self, model: str = DEFAULT_MODEL, tokenizer=None, **kwargs):
        self.config = EngineConfig(model=model, **kwargs)
        c = self.config
        target = load_model(c.model, DTYPES[c.dtype], c.device, c.quant)
        if "max_model_len" in kwargs and c.max_model_len > target.config.max_position_embeddings:
            raise ValueError(f"max_model_len {c.max_model_len} exceeds the context of {model} "
                             f"({target.config.max_position_embeddings} tokens)")
        self.tokenizer = tokenizer if tokenizer is not None else load_tokenizer(c.model)
        max_len = min(c.max_model_len, target.config.max_position_embeddings) + c.num_draft_tokens + 1
        drafter = make_drafter(c.drafter, target, c.max_batch_size, max_len, DTYPES[c.dtype], c.device) if c.drafter else None
        self.engine = Engine(target, self.tokenizer, c, drafter)

    def encode(self, prompt: str | list[int]) -> list[int]:
        return list(prompt) if not isinstance(prompt, str) else self.tokenizer(prompt).input_ids

    def generate(
        self,
        prompts: list[str | list[int]] | str,
        params: SamplingParams | list[SamplingParams] | None = None,
        speculative: bool = True,
        num_draft_tokens: int | None = None,
        tree: str | None = None,
    ) -> GenerateResult:
        """Run the prompts to completion as one continuously batched workload."""
        if isinstance(prompts, str):
            prompts = [prompts]
        params = params or SamplingParams()
        plist = params if isinstance(params, list) else [params] * len(prompts)
        k = 0 if not speculative else num_draft_tokens
        eng = self.engine
        t0 = time.perf_counter()
        seqs = [eng.add_request(self.encode(p), sp, k, tree) for p, sp in zip(prompts, plist)]
        while eng.has_work:
            eng.step()
        seconds = time.perf_counter() - t0
        total = SpecStats()
        outs = []
        for s in seqs:
            total.merge(s.stats)
            text = self.tokenizer.decode(s.output_ids, skip_special_tokens=True)
            outs.append(RequestOutput(s.id, s.prompt_ids, s.output_ids, text, s.finish_reason, s.stats, seconds))
        return GenerateResult(outs, seconds, total)
