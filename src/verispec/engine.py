"""The engine: requests in, tokens out, one speculative step at a time for the whole batch.

    step():  admit + prefill new requests   (KV slots permitting; the rest wait)
             draft   -> drafter.propose(running, ks)
             verify  -> ONE target forward over [last token, d_1..d_k] per request
             accept  -> greedy match or lossless rejection sampling (verify.py)
             commit  -> kv.commit(slot, 1 + accepted); rejected rows are simply left behind

Requests may join and leave between steps; each has its own sampling parameters, generator and
draft length, so a batch mixes greedy and sampled requests freely.
"""

from __future__ import annotations

import random
import time
from collections import deque
from dataclasses import dataclass, field

import torch

from .drafters import Draft, Drafter, make_drafter
from .kv import CacheFullError, KVCache
from .models import DEFAULT_MODEL, CausalLM, load_model, load_tokenizer
from .sequence import Sequence, SpecStats
from .verify import SamplingParams, accept_greedy, accept_sampled, probs, sample

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16}


@dataclass
class EngineConfig:
    model: str = DEFAULT_MODEL
    drafter: str | None = "ngram"  # ngram | draft:<path> | layerskip:<N> | None
    num_draft_tokens: int = 5
    dtype: str = "bfloat16"
    device: str = "cpu"
    max_batch_size: int = 8
    max_model_len: int = 2048  # KV rows per sequence (prompt + output + draft)
    exact: bool = False  # same numerics for every position: fixed-width verify window, static KV length
    prefill_chunk: int = 512

    def __post_init__(self):
        if self.dtype not in DTYPES:
            raise ValueError(f"unknown dtype {self.dtype!r}; choose one of {', '.join(DTYPES)}")
        if self.num_draft_tokens < 0:
            raise ValueError(f"num_draft_tokens must be >= 0, got {self.num_draft_tokens}")
        if self.max_batch_size < 1 or self.max_model_len < 2:
            raise ValueError("max_batch_size must be >= 1 and max_model_len >= 2")


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


class Engine:
    def __init__(self, model: CausalLM, tokenizer, config: EngineConfig, drafter: Drafter | None = None):
        self.model, self.tokenizer, self.config = model, tokenizer, config
        self.drafter = drafter
        model.set_batch_invariant(config.exact)
        self.max_len = min(config.max_model_len, model.config.max_position_embeddings)
        self.cache: KVCache = model.new_cache(config.max_batch_size, self.max_len + config.num_draft_tokens + 1)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._ids = 0
        self.eos = set(model.config.eos_token_ids)
        if tokenizer is not None and tokenizer.eos_token_id is not None:
            self.eos.add(tokenizer.eos_token_id)

    # ---- requests -------------------------------------------------------------------------
    def add_request(self, prompt_ids: list[int], params: SamplingParams, num_draft_tokens: int | None = None) -> Sequence:
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
        seq.num_draft_tokens = k if self.drafter is not None else 0
        self._ids += 1
        self.waiting.append(seq)
        return seq

    def abort(self, seq: Sequence) -> None:
        """Cancel a request: its KV slot is free at once."""
        if seq in self.waiting:
            self.waiting.remove(seq)
        if seq in self.running:
            self._finish(seq, "abort")

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- the step -------------------------------------------------------------------------
    @torch.inference_mode()
    def step(self) -> list[Sequence]:
        """One engine step; returns the sequences that finished in it."""
        done = self._admit()
        seqs = [s for s in self.running]
        if not seqs:
            return done
        kcap = self.config.num_draft_tokens  # the KV slack and the exact-mode window are sized for it
        ks = [max(0, min(s.num_draft_tokens, kcap, s.params.max_tokens - s.num_output - 1)) for s in seqs]
        drafts = self._propose(seqs, ks)
        width = 1 + (self.config.num_draft_tokens if self.config.exact else max(len(d.tokens) for d in drafts))
        ids = torch.tensor([[s.tokens[-1]] + d.tokens + [0] * (width - 1 - len(d.tokens)) for s, d in zip(seqs, drafts)])
        starts = torch.tensor([self.cache.lengths[s.slot] for s in seqs])
        out = self.model(
            ids.to(self.model.device), self.cache, [s.slot for s in seqs], starts, taps=self._taps,
            kv_len=self.cache.max_len if self.config.exact else None,
        )
        logits = out.logits  # [B, width, V]
        greedy_next = logits.argmax(-1).tolist() if any(s.params.greedy for s in seqs) else None
        for b, (s, d) in enumerate(zip(seqs, drafts)):
            k = len(d.tokens)
            if s.params.greedy:
                v = accept_greedy(greedy_next[b][: k + 1], d.tokens)
            else:
                v = accept_sampled(probs(logits[b, : k + 1], s.params), d.tokens, d.q, s.generator)
            s.stats.record(k, v.accepted, len(v.tokens))
            self.cache.commit(s.slot, 1 + v.accepted)
            self._observe(s, out, b, int(starts[b]), 1 + v.accepted)
            if self._append(s, v.tokens):
                done.append(s)
        return done

    @property
    def _taps(self) -> tuple[int, ...]:
        return tuple(t for t in self.drafter.target_taps if t >= 0) if self.drafter else ()

    def _observe(self, seq: Sequence, out, b: int, start: int, n: int) -> None:
        """Hand the drafter the target hidden states of the n rows just committed for seq."""
        if self.drafter is None or not self.drafter.target_taps or seq.finished:
            return
        hidden = {i: h[b, :n] for i, h in out.hidden.items()}
        if -1 in self.drafter.target_taps:
            hidden[-1] = out.last_hidden[b, :n]
        self.drafter.observe(seq, start, hidden)

    def _propose(self, seqs: list[Sequence], ks: list[int]) -> list[Draft]:
        if self.drafter is None or not any(k > 0 for k in ks):
            return [Draft([]) for _ in seqs]
        drafts = self.drafter.propose(seqs, ks)
        return [Draft(d.tokens[:k], None if d.q is None else d.q[:k]) for d, k in zip(drafts, ks)]

    def _admit(self) -> list[Sequence]:
        """Move waiting requests into free KV slots and prefill them (their first token comes from it)."""
        done = []
        while self.waiting and self.cache.num_free:
            seq = self.waiting.popleft()
            seq.slot = self.cache.allocate(len(seq.prompt_ids) + seq.params.max_tokens)
            self.running.append(seq)
            logits = self._prefill(seq)
            p = seq.params
            first = int(logits.argmax()) if p.greedy else sample(probs(logits[None], p)[0], seq.generator)
            if self._append(seq, [first]):
                done.append(seq)
        return done

    def _prefill(self, seq: Sequence) -> torch.Tensor:
        """Feed the prompt in chunks; returns the logits [V] for the first new token."""
        ids = seq.prompt_ids
        C = self.config.prefill_chunk
        for i in range(0, len(ids), C):
            chunk = torch.tensor([ids[i : i + C]], device=self.model.device)
            out = self.model(
                chunk, self.cache, [seq.slot], torch.tensor([i]),
                logit_rows=torch.tensor([[chunk.shape[1] - 1]]),
                want_logits=i + C >= len(ids), taps=self._taps,
                kv_len=self.cache.max_len if self.config.exact else None,
            )
            self.cache.commit(seq.slot, chunk.shape[1])
            self._observe(seq, out, 0, i, chunk.shape[1])
        return out.logits[0, 0]

    def _append(self, seq: Sequence, tokens: list[int]) -> bool:
        """Append emitted tokens up to a stop condition; finishes the sequence if one is met."""
        p = seq.params
        for t in tokens:
            seq.tokens.append(t)
            if (t in self.eos and not p.ignore_eos) or t in p.stop_token_ids:
                self._finish(seq, "stop")
                return True
            if seq.num_output >= p.max_tokens:
                self._finish(seq, "length")
                return True
        return False

    def _finish(self, seq: Sequence, reason: str) -> None:
        seq.finish_reason = reason
        self.running.remove(seq)
        self.cache.free(seq.slot)
        if self.drafter is not None:
            self.drafter.release(seq)


class LLM:
    """The Python API: `LLM("gemma3-270m", drafter="ngram").generate(["def f(x):"], SamplingParams())`."""

    def __init__(self, model: str = DEFAULT_MODEL, **kwargs):
        self.config = EngineConfig(model=model, **kwargs)
        c = self.config
        target = load_model(c.model, DTYPES[c.dtype], c.device)
        self.tokenizer = load_tokenizer(c.model)
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
    ) -> GenerateResult:
        """Run the prompts to completion as one continuously batched workload."""
        if isinstance(prompts, str):
            prompts = [prompts]
        params = params or SamplingParams()
        plist = params if isinstance(params, list) else [params] * len(prompts)
        k = 0 if not speculative else num_draft_tokens
        eng = self.engine
        t0 = time.perf_counter()
        seqs = [eng.add_request(self.encode(p), sp, k) for p, sp in zip(prompts, plist)]
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
