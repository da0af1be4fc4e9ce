"""Tree verification whose accepted path has the bits of plain decoding.

A token tree is verified in one forward: its nodes are new rows `start + t` of the request's KV
slot (t = 0 is the last committed token, the root). A tree mask over those rows would be enough
mathematically, but not bit for bit: the CPU attention kernel sums keys in vector lanes and GEMM
blocks chosen by the key's *row*, so a path whose keys sit at rows start+0, start+3, start+7
rounds differently from the same path at start+0, start+1, start+2, where plain decoding (and
the KV cache after compaction) puts it.

So each query row attends a *view* of its slot: the committed rows [0, start) followed by its own
root-to-node path, contiguous, exactly the keys plain decoding would see at that position, then
padding rows that the mask hides. One view per leaf path serves every node on that path; each
node is answered by exactly one view (the first leaf below it, in node order). Views are gathered
copies (one per leaf), which costs leaves x key length rows per layer: cheap for the few-leaf trees
that pay on a CPU. A chain is a tree with one leaf and takes the ordinary path instead.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class PathViews:
    slots: torch.Tensor  # [P] long: KV slot of each view
    rows: torch.Tensor  # [P, Lk] long: the cache rows that make up each view, in order
    queries: torch.Tensor  # [P, Tq] long: flat index b * T + t of the query answered by each view row
    real: torch.Tensor  # [P, Tq] bool: False for padding queries (repeats of a real one, output dropped)
    query_pos: torch.Tensor  # [P, Tq] long: RoPE position of each query = its row in the view

    @classmethod
    def build(cls, slots: list[int], starts: list[int], parents: list[list[int]], T: int, Lk: int, device) -> "PathViews":
        """slots/starts per request; parents[b][i] is the parent of node i + 1 (node 0 is the root
        at row start; a parent index is a node index, -1 is not used: node i + 1 >= 1 has parent
        < i + 1). T is the padded window width of the batch, Lk the attended key length."""
        views_slot, views_rows, views_q, views_pos = [], [], [], []
        for b, (slot, start, par) in enumerate(zip(slots, starts, parents)):
            n = len(par) + 1  # nodes, root included
            parent = [-1] + list(par)
            depth = [0] * n
            has_child = [False] * n
            for i in range(1, n):
                depth[i] = depth[parent[i]] + 1
                has_child[parent[i]] = True
            answered = [False] * n
            for leaf in (i for i in range(n) if not has_child[i]):
                path = [leaf]
                while path[-1] != 0:
                    path.append(parent[path[-1]])
                path.reverse()  # root .. leaf, one node per depth
                mine = [i for i in path if not answered[i]]
                for i in mine:
                    answered[i] = True
                rows = list(range(start)) + [start + i for i in path]
                rows += [rows[-1]] * (Lk - len(rows))
                views_slot.append(slot)
                views_rows.append(rows)
                views_q.append([b * T + i for i in mine])
                views_pos.append([start + depth[i] for i in mine])
        Tq = max(len(q) for q in views_q)
        real = [[True] * len(q) + [False] * (Tq - len(q)) for q in views_q]
        views_q = [q + [q[-1]] * (Tq - len(q)) for q in views_q]
        views_pos = [p + [p[-1]] * (Tq - len(p)) for p in views_pos]
        t = lambda x, **kw: torch.tensor(x, device=device, **kw)  # noqa: E731
        return cls(t(views_slot), t(views_rows), t(views_q), t(real, dtype=torch.bool), t(views_pos))

    @classmethod
    def per_query(cls, slots: list[int], rows: list[list[int]], queries: list[int], Lk: int, device) -> "PathViews":
        """One view per query (drafters expanding a tree): query i (flat index queries[i]) attends
        the cache rows rows[i] of slot slots[i], the last of which is its own; its RoPE position
        is len(rows[i]) - 1."""
        t = lambda x, **kw: torch.tensor(x, device=device, **kw)  # noqa: E731
        pos = [[len(r) - 1] for r in rows]
        padded = [r + [r[-1]] * (Lk - len(r)) for r in rows]
        return cls(t(slots), t(padded), t([[q] for q in queries]), t([[True]] * len(rows), dtype=torch.bool), t(pos))

    def masks(self, sliding_windows) -> dict:
        """{window: [P, 1, Tq, Lk] bool}: view row j is at RoPE position j, so a query at position
        p sees rows j <= p (and j > p - window on sliding-window layers)."""
        j = torch.arange(self.rows.shape[1], device=self.rows.device)[None, None, :]
        p = self.query_pos[:, :, None]
        out = {}
        for w in set(sliding_windows):
            m = j <= p
            if w is not None:
                m = m & (j > p - w)
            out[w] = m.unsqueeze(1)
        return out

    def keys(self, cache: torch.Tensor) -> torch.Tensor:
        """[P, kvh, Lk, hd]: each view's rows of a layer's key (or value) cache."""
        return cache[self.slots[:, None], :, self.rows].permute(0, 2, 1, 3)

    def gather_queries(self, q: torch.Tensor) -> torch.Tensor:
        """q [B, h, T, hd] -> [P, h, Tq, hd], each view's queries (dense)."""
        B, h, T, hd = q.shape
        return q.transpose(1, 2).reshape(B * T, h, hd)[self.queries].transpose(1, 2).contiguous()

    def scatter_outputs(self, o: torch.Tensor, B: int, T: int) -> torch.Tensor:
        """o [P, h, Tq, hd] -> [B, h, T, hd]: each real query's output back at its place."""
        P, h, Tq, hd = o.shape
        out = o.new_zeros(B * T, h, hd)
        out[self.queries[self.real]] = o.transpose(1, 2)[self.real]
        return out.reshape(B, T, h, hd).transpose(1, 2)
