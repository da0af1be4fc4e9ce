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
from ..models.paths import PathViews
from . import expand
from .base import CHAIN, Draft, DrafterBase, register


TREE_SCRATCH = 128  # KV rows past a sequence's end for the nodes a dynamic tree runs (width x depth)


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
        self.cache = model.new_cache(max_batch, max_len + TREE_SCRATCH, n)

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
        # 2. chains or trees, one drafter forward per depth (expand.py decides which nodes run)
        chain = all((s.tree or CHAIN).is_chain for s in run)
        out = expand.draft(run, [ks[i] for i in idx], last, self._chain_step(states) if chain else self._tree_step(states))
        for b, i in enumerate(idx):
            drafts[i] = out[b]
        return drafts

    def _chain_step(self, states):
        """Run each chain's newest token and keep its row (the next step's catch-up keeps what
        the target accepted and rolls back the rest)."""

        def step(run, nodes):
            live = [b for b, r in enumerate(run) if r]
            ids = torch.tensor([[nodes[b][run[b][0]].token] for b in live], device=self.model.device)
            logits = self._forward(ids, [states[b] for b in live])[:, 0]
            out = [None] * len(run)
            for j, b in enumerate(live):
                self.cache.commit(states[b].slot, 1)
                states[b].cached.append(nodes[b][run[b][0]].token)
                out[b] = logits[j : j + 1]
            return out

        return step

    def _tree_step(self, states):
        """Run tree nodes in scratch rows past the committed ones: each attends the committed rows
        and its own ancestors (one path view per node); nothing is committed."""
        used = [0] * len(states)  # scratch rows taken per sequence
        row_of: list[dict[int, int]] = [{} for _ in states]
        dev = self.model.device

        def step(run, nodes):
            live = [b for b, r in enumerate(run) if r]
            T = max(len(run[b]) for b in live)
            slots, views, queries, ids, pos, starts = [], [], [], [], [], []
            for j, b in enumerate(live):
                st, L = states[b], self.cache.lengths[states[b].slot]
                if L + used[b] + len(run[b]) > self.cache.max_len:
                    raise RuntimeError(f"draft tree needs more than the {self.cache.max_len} KV rows of the drafter")
                starts.append(L + used[b])
                for t, i in enumerate(run[b]):
                    row_of[b][i] = L + used[b] + t
                    path, a = [], i
                    while a >= 0:
                        path.append(row_of[b][a])
                        a = nodes[b][a].parent
                    slots.append(st.slot)
                    views.append(list(range(L)) + path[::-1])
                    queries.append(j * T + t)
                ids.append([nodes[b][i].token for i in run[b]] + [0] * (T - len(run[b])))
                pos.append([L + nodes[b][i].depth - 1 for i in run[b]] + [L] * (T - len(run[b])))
                used[b] += len(run[b])
            Lk = max(len(v) for v in views)
            paths = PathViews.per_query(slots, views, queries, Lk, dev)
            logits = self.model(torch.tensor(ids, device=dev), self.cache, [states[b].slot for b in live],
                                torch.tensor(starts), positions=torch.tensor(pos, device=dev), paths=paths,
                                num_layers=self.num_layers, kv_len=Lk).logits  # [live, T, V]
            out = [None] * len(run)
            for j, b in enumerate(live):
                out[b] = logits[j, : len(run[b])]
            return out

        return step

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
