"""Drafting with a language model: an independent small model, or the target's first N layers.

The drafter keeps its own KV cache (one slot per running sequence) and remembers which tokens its
rows hold. Before drafting it finds the longest prefix those rows share with the sequence's
committed tokens, rolls back to it (O(1)), feeds the tokens it has not seen in one batched
forward, then drafts k tokens one forward at a time. Sampled requests draw each draft token from
the processed draft distribution q with the request's own generator; q goes to the verifier.

Layer-skip self-drafting is the same thing with the target itself run for its first N layers
(then the final norm and LM head): no weights are copied and no training is needed.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..models import CausalLM
from ..sequence import Sequence
from ..sampling import probs, sample
from .base import Draft, DrafterBase, register


@dataclass
class _State:
    slot: int
    cached: list[int] = field(default_factory=list)  # tokens whose KV rows the draft cache holds


@register("layerskip", "layerskip:N", "the target's first N layers + final norm + LM head (self-drafting)")
def _layerskip(arg: str, ctx) -> "ModelDrafter":
    L = ctx.target.config.num_layers
    try:
        n = int(arg)
    except ValueError:
        raise ValueError(f"layerskip needs a layer count between 1 and {L - 1}, e.g. layerskip:6, got {arg!r}") from None
    if not 1 <= n < L:
        raise ValueError(f"layerskip needs a layer count between 1 and {L - 1} (the target has {L} layers), got {n}")
    return ModelDrafter(ctx.target, ctx.max_batch, ctx.max_len, num_layers=n, name=f"layerskip:{n}")


@register("draft", "draft:PATH", "an independent smaller model with the target's tokenizer (folder or .gguf)")
def _draft_model(arg: str, ctx) -> "ModelDrafter":
    from ..models import load_model

    if not arg:
        raise ValueError("draft needs a model path, e.g. draft:/models/small")
    model = load_model(arg, ctx.dtype, ctx.device)
    if model.config.vocab_size != ctx.target.config.vocab_size:
        raise ValueError(
            f"draft model vocabulary ({model.config.vocab_size}) differs from the target's "
            f"({ctx.target.config.vocab_size}); a draft model must share the target's tokenizer"
        )
    return ModelDrafter(model, ctx.max_batch, ctx.max_len, name=f"draft:{arg}")


class ModelDrafter(DrafterBase):
    def __init__(self, model: CausalLM, max_batch: int, max_len: int, num_layers: int | None = None, name: str = "draft-model"):
        n = model.config.num_layers if num_layers is None else num_layers
        if not 1 <= n <= model.config.num_layers:
            raise ValueError(f"layer-skip needs 1 <= layers <= {model.config.num_layers}, got {n}")
        self.model, self.num_layers, self.name = model, n, name
        self.cache = model.new_cache(max_batch, max_len, n)

    def _state(self, seq: Sequence) -> _State:
        if seq.drafter_state is None:
            seq.drafter_state = _State(self.cache.allocate(len(seq.prompt_ids) + seq.params.max_tokens + 1))
        return seq.drafter_state

    @torch.inference_mode()
    def propose(self, seqs: list[Sequence], ks: list[int]) -> list[Draft]:
        idx = [i for i, k in enumerate(ks) if k > 0]
        drafts = [Draft([]) for _ in seqs]
        if not idx:
            return drafts
        run = [seqs[i] for i in idx]
        kmax = max(ks[i] for i in idx)
        states = [self._state(s) for s in run]
        # 1. catch up: feed the committed tokens the draft cache does not hold yet
        feeds = []
        for s, st in zip(run, states):
            c = _common_prefix(st.cached, s.tokens, len(s.tokens) - 1)
            self.cache.rollback(st.slot, c)
            del st.cached[c:]
            feeds.append(s.tokens[c:])
        # short feeds (the accepted tokens of the last step) go in one padded batch; a long one
        # (a new prompt) alone, so padding never writes past any slot's end
        short = [b for b, f in enumerate(feeds) if len(f) <= kmax + 1]
        groups = ([short] if short else []) + [[b] for b in range(len(feeds)) if b not in short]
        last = [None] * len(feeds)
        for g in groups:
            T = max(len(feeds[b]) for b in g)
            ids = torch.tensor([feeds[b] + [0] * (T - len(feeds[b])) for b in g], device=self.model.device)
            rows = torch.tensor([[len(feeds[b]) - 1] for b in g], device=self.model.device)
            for b, lg in zip(g, self._forward(ids, [states[b] for b in g], logit_rows=rows)[:, 0]):
                last[b] = lg
        last = torch.stack(last)  # [B, V]
        for st, f in zip(states, feeds):
            self.cache.commit(st.slot, len(f))
            st.cached += f
        # 2. draft one token at a time
        toks = [[] for _ in run]
        qs = [[] for _ in run]
        for j in range(kmax):
            nxt = []
            for b, s in enumerate(run):
                if s.params.greedy:
                    t = int(last[b].argmax())
                else:
                    q = probs(last[b : b + 1], s.params)[0]
                    t = sample(q, s.generator) if j < ks[idx[b]] else 0
                    qs[b].append(q)
                nxt.append(t)
                if j < ks[idx[b]]:
                    toks[b].append(t)
            if j == kmax - 1:
                break
            last = self._forward(torch.tensor(nxt, device=self.model.device)[:, None], states)[:, 0]
            for b, st in enumerate(states):
                if j + 1 < ks[idx[b]]:  # that token's row is kept only if the draft goes on
                    self.cache.commit(st.slot, 1)
                    st.cached.append(nxt[b])
        for b, i in enumerate(idx):
            q = torch.stack(qs[b][: ks[i]]) if qs[b] else None
            drafts[i] = Draft(toks[b], q)
        return drafts

    def _forward(self, ids, states, logit_rows=None):
        slots = [st.slot for st in states]
        starts = torch.tensor([self.cache.lengths[s] for s in slots])
        out = self.model(ids, self.cache, slots, starts, logit_rows=logit_rows, num_layers=self.num_layers)
        return out.logits

    def release(self, seq: Sequence) -> None:
        if seq.drafter_state is not None:
            self.cache.free(seq.drafter_state.slot)
            seq.drafter_state = None


def _common_prefix(a: list[int], b: list[int], limit: int) -> int:
    n = min(len(a), len(b), limit)
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i
