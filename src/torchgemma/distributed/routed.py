"""Expert parallelism with each token sent to the ranks holding its experts: ``RoutedExperts``.

``ExpertShard`` (transform.py) computes a rank's experts for every token where the weights are and
all-reduces the partial sums. Here each rank computes only the rows routed to its experts, for the
tokens of one rank's share, and the tokens travel instead (what GShard / DeepSpeed-MoE call
dispatch and combine):

1. every rank holds every token (the layers around are tensor parallel) and the router's choices
   (the router is replicated): rank r takes the tokens ``[r n / N, (r+1) n / N)`` as its own;
2. dispatch: each rank sends the rows of its own tokens' (token, slot) pairs to the rank holding
   the pair's expert (``all_to_all_single``; the split sizes come from the routing every rank
   holds, so no exchange of counts);
3. each rank runs its experts on the rows it received, one product per expert;
4. combine: each output row goes back to the rank the token came from (a second all-to-all), which
   weights and sums its tokens' K outputs as one device does, and rounds once;
5. an all-gather gives every rank every token's sum again, for the tensor-parallel layers after.

Under tensor-parallel layers step 2 moves rows the receiving rank already holds: it is the dispatch
a data-parallel attention would need, kept so the mode measures what token routing costs.

Exactness: a rank receives its experts' pairs in ascending (token, slot) order (the ranks' shares
are ascending runs of tokens, received in rank order), so every expert's product has the rows one
device gives it, in the same order; the K outputs of a token are weighted and summed on one rank
in the reference's order (``grouped_mm``: in float32 over the slots; ``eager``: rounded and added
in ascending expert id). The experts' outputs are those of one process to the bit, in bf16 too.
"""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.distributed as dist

from ..model.layers import gelu_tanh
from ..model.text import Experts, expert_linear


class RoutedExperts(Experts):
    """A rank's whole experts ``[first, end)``, fed by all-to-all (see the module docstring)."""

    def __init__(self, config, first: int, end: int, implementation: str):
        super().__init__(replace(config, num_experts=end - first), implementation)
        self.first, self.end = first, end
        self.group = None  # set by ``connect``

    def forward(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        n, k = experts.shape
        size, rank = dist.get_world_size(self.group), dist.get_rank(self.group)
        # 1. rank r's own tokens: [bounds[r], bounds[r+1]); every rank knows every pair's expert
        bounds = [r * n // size for r in range(size + 1)]
        flat = experts.reshape(-1)
        owner = torch.div(flat, self.end - self.first, rounding_mode="floor")
        home = torch.bucketize(
            torch.arange(n * k, device=x.device) // k, x.new_tensor(bounds[1:-1]), right=True
        )
        # pairs[r, s]: how many (token, slot) pairs of rank r's tokens go to rank s's experts
        pairs = torch.bincount(home * size + owner, minlength=size * size).view(size, size).tolist()
        sends, receives = pairs[rank], [row[rank] for row in pairs]

        # 2. dispatch: this rank's pairs in (owner, token, slot) order
        first, last = bounds[rank] * k, bounds[rank + 1] * k
        sent = torch.sort(owner[first:last], stable=True).indices + first
        rows = x.new_empty(sum(receives), x.shape[-1])
        dist.all_to_all_single(rows, x[sent // k].contiguous(), receives, sends, group=self.group)

        # 3. this rank's experts on what it received: its pairs, in ascending (token, slot) order
        received = torch.nonzero(owner == rank).squeeze(1)
        y = self.compute(rows, flat[received] - self.first, received, experts.shape)

        # 4. combine: the outputs back to their tokens' rank, weighted and summed there
        back = y.new_empty(last - first, y.shape[-1])
        dist.all_to_all_single(back, y, sends, receives, group=self.group)
        mine = slice(bounds[rank], bounds[rank + 1])
        own = self.combine(back, sent - first, weights[mine], experts[mine], x.dtype)

        # 5. every token's sum on every rank
        return _gather_rows(own.to(x.dtype), bounds, self.group)

    def compute(self, rows: torch.Tensor, local: torch.Tensor, received: torch.Tensor, shape) -> torch.Tensor:
        """The expert outputs (unweighted) of the received rows (pair ``received[i]`` for this
        rank's expert ``local[i]``), in the order received. Each expert's rows are multiplied in
        the order one device uses: (token, slot) for ``grouped_mm``, (slot, token) for ``eager``."""
        n, k = shape
        if self.implementation == "eager":
            slot, token = received % k, received // k
            order = torch.argsort(local * (n * k) + slot * n + token)
        else:
            order = torch.sort(local, stable=True).indices
        ids, counts = torch.unique_consecutive(local[order], return_counts=True)
        starts = [0, *torch.cumsum(counts, 0).tolist()]
        y = None
        for expert, a, b in zip(ids.tolist(), starts, starts[1:]):
            picked = order[a:b]
            gate, up = expert_linear(self.gate_up_proj, expert, rows[picked]).chunk(2, dim=-1)
            out = expert_linear(self.down_proj, expert, gelu_tanh(gate) * up)
            if y is None:
                y = out.new_empty(rows.shape[0], out.shape[-1])
            y[picked] = out
        if y is None:  # no pair routed to this rank's experts
            y = rows.new_empty(0, rows.shape[1])  # the down product is as wide as its input row
        return y

    def combine(self, back, pairs, weights, experts, dtype) -> torch.Tensor:
        """This rank's tokens' sums from their K outputs ``back`` (of pair ``pairs[i]``, counted
        from its first token's first slot; ``weights``/``experts`` its tokens' routing), weighted
        and summed as the reference does."""
        count, k = weights.shape
        hidden = back.shape[-1]
        w = weights.reshape(-1)[pairs, None]
        if self.implementation == "eager":  # each weighted output rounded, added in ascending expert id
            rounded = back.new_empty(count * k, hidden, dtype=dtype)
            rounded[pairs] = (back * w).to(dtype)
            ascending = experts.argsort(dim=-1)[..., None].expand(-1, -1, hidden)
            by_id = rounded.view(count, k, hidden).gather(1, ascending)
            out = torch.zeros_like(by_id[:, 0])
            for slot in range(k):
                out = out + by_id[:, slot]
            return out
        weighted = back.new_empty(count * k, hidden, dtype=torch.promote_types(back.dtype, weights.dtype))
        weighted[pairs] = back * w
        return weighted.view(count, k, hidden).sum(dim=1)


def _gather_rows(own: torch.Tensor, bounds: list[int], group) -> torch.Tensor:
    """Every rank's rows ``own`` (rank r's are rows [bounds[r], bounds[r+1]) of the whole),
    concatenated in rank order on every rank (shares padded to the largest for the all-gather)."""
    size = len(bounds) - 1
    counts = [b - a for a, b in zip(bounds, bounds[1:])]
    share = max(counts)
    padded = (
        own if own.shape[0] == share else torch.cat([own, own.new_zeros(share - own.shape[0], own.shape[1])])
    )
    whole = own.new_empty(size * share, own.shape[1])
    dist.all_gather_into_tensor(whole, padded.contiguous(), group=group)
    if all(c == share for c in counts):
        return whole
    return torch.cat([whole[r * share : r * share + c] for r, c in enumerate(counts)])
