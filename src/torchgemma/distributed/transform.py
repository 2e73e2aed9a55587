"""A built model made into one rank's share of a tensor-parallel model (``plan.py`` says which share).

Two steps, around loading:

* ``shard_model`` (on the meta model, before the checkpoint is matched): the text decoder is built
  from the rank's ``local_text`` config (its heads, KV heads and MLP widths), and the vocabulary
  tables and expert stacks are replaced by the rank's rows. Module names stay the checkpoint's, so
  the loader fills the rank's slices by the usual names.
* ``connect`` (on the filled model): the collectives. The model code itself is unchanged; what is
  added is where a partial result must be summed or gathered:

  - attention: each rank's o_proj sums over its heads only: one all-reduce of its output, before
    ``post_attention_layernorm`` (``RowParallel``: in bf16 the parts are summed in float32);
  - dense MLP: down_proj sums over the rank's features: one all-reduce of its output;
  - mixture of experts (26B-A4B): the dense MLP and the experts each end in their own norm
    (``post_feedforward_layernorm_1`` / ``_2``) before they are added, and an RMSNorm of a partial
    sum is not the partial of the norm: the two are reduced separately, two all-reduces in an MoE
    layer (what transformers' plan does too). Tensor-parallel experts (``ExpertShard``) reduce each
    routed pair's down output in float32, then round and combine the K of a token as one device
    does; whole experts reduce the ranks' weighted sums;
  - token table (and PLE table): each rank looks up the ids in its rows, zeros for the others, and
    an all-reduce sums them (adding zeros is exact: the same bits as one table);
  - LM head: each rank's logits for its rows, all-gathered (``logits``) or reduced to a greedy
    token by an all-gather of each rank's best value and id (``argmax``).
"""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ..model import Gemma
from ..model.layers import gelu_tanh
from ..model.text import Experts, _embedding, expert_linear
from .plan import ShardPlan
from .routed import RoutedExperts


def build_sharded(config, plan: ShardPlan, attention: str) -> Gemma:
    """The rank's model for ``config`` on the current (meta) device: ``Gemma`` built from the
    rank's text config, then ``shard_model``."""
    model = Gemma(replace(config, text=plan.local_text()), attention)
    return shard_model(model, plan)


def shard_model(model: Gemma, plan: ShardPlan) -> Gemma:
    """Replace the vocabulary tables and (expert parallel) the expert stacks of a model built from
    ``plan.local_text()`` by the rank's rows; the model records its plan as ``model.shard_plan``."""
    text = model.language_model
    hidden = text.config.hidden_size
    first, end = plan.vocab
    text.embed_tokens = _embedding(end - first, hidden)
    if hasattr(text, "lm_head"):
        text.lm_head = nn.Linear(hidden, end - first, bias=False)
    if plan.per_layer_vocab is not None:
        first, end = plan.per_layer_vocab
        text.embed_tokens_per_layer = _embedding(end - first, text.embed_tokens_per_layer.embedding_dim)
    for layer in text.layers:
        if layer.spec.moe:
            # Whole experts [first, end) (expert parallel), or every expert's slice of features.
            first, end = plan.experts or (0, text.config.num_experts)
            implementation = layer.experts.implementation
            if plan.expert_exchange == "all-to-all":  # the tokens sent to their experts (routed.py)
                layer.experts = RoutedExperts(text.config, first, end, implementation)
            else:
                layer.experts = ExpertShard(text.config, first, end, implementation, plan.experts is None)
    model.shard_plan = plan
    return model


def connect(model: Gemma, group: dist.ProcessGroup | None = None) -> Gemma:
    """Add the collectives (see the module docstring) to a filled ``shard_model`` model, over
    ``group`` (None: the default group)."""
    plan: ShardPlan = model.shard_plan
    text = model.language_model
    text.embed_tokens = VocabShard(text.embed_tokens, plan.vocab, plan.text.vocab_size, group)
    if hasattr(text, "lm_head"):
        text.lm_head = VocabShardHead(text.lm_head, plan.vocab, plan.text.vocab_size, group)
    if plan.per_layer_vocab is not None:
        text.embed_tokens_per_layer = VocabShard(
            text.embed_tokens_per_layer, plan.per_layer_vocab, plan.text.vocab_size_per_layer_input, group
        )
    for layer in text.layers:
        layer.self_attn.o_proj = RowParallel(layer.self_attn.o_proj, group)
        layer.mlp.down_proj = RowParallel(layer.mlp.down_proj, group)
        if layer.spec.moe:
            layer.experts.group = group  # reduces in float32 itself
    model.process_group = text.process_group = group
    return model


class RowParallel(nn.Module):
    """A layer split by input features (o_proj, down_proj): each rank's product over its features,
    summed over the ranks. In bf16 the partial products stay in float32 until the sum, rounded once
    as one device's product is (rounding each rank's part first moved bf16 logits by up to ~1 and
    parted greedy tokens); the weight is widened to float32 for the product (a quantized layer's own
    product is reduced in its output dtype)."""

    def __init__(self, inner: nn.Module, group):
        super().__init__()
        self.inner = inner
        self.group = group
        self.weight_shape = tuple(inner.weight.shape) if isinstance(inner, nn.Linear) else inner.weight_shape
        # generation/invariance.py probes ``matmul`` as it probes a quantized product, by this name.
        self.format = "row-parallel"

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's part of the product (float32 for a reduced-precision float layer)."""
        if isinstance(self.inner, nn.Linear) and x.dtype in (torch.bfloat16, torch.float16):
            return F.linear(x.float(), self.inner.weight.float())
        return self.inner(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.matmul(x)
        dist.all_reduce(y, group=self.group)
        return y.to(x.dtype)


class VocabShard(nn.Module):
    """A rank's rows ``[first, end)`` of a token table of ``vocab`` rows, used as the whole table:
    lookups summed over the ranks, and (tied LM head) logits gathered."""

    def __init__(self, table: nn.Module, rows: tuple[int, int], vocab: int, group):
        super().__init__()
        self.table = table
        self.first, self.end = rows
        self.num_embeddings = vocab
        self.group = group

    @property
    def weight(self) -> torch.Tensor:
        return self.table.weight

    @property
    def embedding_dim(self) -> int:
        return self.table.embedding_dim

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        mine = (input_ids >= self.first) & (input_ids < self.end)
        rows = self.table(torch.where(mine, input_ids - self.first, 0))
        rows = rows.masked_fill(~mine[..., None], 0)
        dist.all_reduce(rows, group=self.group)
        return rows

    def local_logits(self, x: torch.Tensor) -> torch.Tensor:
        linear = getattr(self.table, "as_linear", None)
        return linear(x) if linear is not None else self.table(x)

    def as_linear(self, x: torch.Tensor) -> torch.Tensor:
        """The whole vocabulary's logits (..., vocab), each rank's columns gathered in rank order."""
        local = self.local_logits(x).contiguous()
        parts = [torch.empty_like(local) for _ in range(dist.get_world_size(self.group))]
        dist.all_gather(parts, local, group=self.group)
        return torch.cat(parts, dim=-1)

    def argmax(self, x: torch.Tensor, transform=None) -> torch.Tensor:
        """(M, H) -> (M,): the argmax over the whole vocabulary of ``transform(logits)`` (default:
        the logits in float32), from each rank's best value and id; ties go to the lowest id, as
        one argmax over the gathered logits."""
        local = self.local_logits(x)
        values = transform(local) if transform is not None else local.float()
        best = values.argmax(-1)
        top = values.gather(-1, best[..., None])[..., 0].contiguous()
        ids = (best + self.first).contiguous()
        size = dist.get_world_size(self.group)
        tops, all_ids = (
            [torch.empty_like(top) for _ in range(size)],
            [torch.empty_like(ids) for _ in range(size)],
        )
        dist.all_gather(tops, top, group=self.group)
        dist.all_gather(all_ids, ids, group=self.group)
        winner = torch.stack(tops).argmax(0)  # the first rank holding the highest value
        return torch.stack(all_ids).gather(0, winner[None])[0]


class VocabShardHead(VocabShard):
    """An untied LM head's rows: called, the gathered logits."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.as_linear(x)


class ExpertShard(Experts):
    """A rank's experts: whole experts ``[first, end)`` (expert parallelism), or every expert's
    slice of intermediate features (``sliced``: tensor parallelism). Each rank computes the (token,
    slot) pairs routed to the experts it holds, where their weights are; nothing else moves (no
    all-to-all: every rank holds every token, since the layers around are tensor parallel and their
    outputs replicated).

    Whole experts: each rank weights and sums its pairs' outputs in float32 (``"grouped_mm"``; its
    K of a token in slot order) or rounds each and adds them in ascending expert id (``"eager"``),
    and the ranks' sums are all-reduced (in float32, or the model dtype for ``"eager"``) and rounded
    once: one device's products, summed in another order.

    A slice of features: a pair's down product is only a float32 part of its sum, and one device
    rounds that sum to the model dtype before weighting it, so what is all-reduced is each pair's
    part, unweighted, in float32 (K rows per token: K times the bytes of a rank's sums); the sum is
    rounded as one device's product is, and the K of a token weighted and combined as ``Experts``
    combines them. Only the order of the down product's float32 sum differs from one device (in
    bf16 this moved the 26B-like model's logits by 1 unit, where reducing the ranks' weighted sums
    moved them by 0.55).
    """

    def __init__(self, config, first: int, end: int, implementation: str, sliced: bool = False):
        super().__init__(replace(config, num_experts=end - first), implementation)
        self.first, self.end, self.sliced = first, end, sliced
        self.group = None

    def down(self, expert: int, x: torch.Tensor) -> torch.Tensor:
        """The down product; a slice of features (``sliced``) gives a float32 part of the sum."""
        if self.sliced and isinstance(self.down_proj, torch.Tensor) and x.dtype != torch.float32:
            return F.linear(x.float(), self.down_proj[expert].float())
        return expert_linear(self.down_proj, expert, x)

    def forward(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        n, k = experts.shape
        flat = experts.reshape(-1)
        pairs = torch.nonzero((flat >= self.first) & (flat < self.end)).squeeze(1)  # token * k + slot
        local, order = torch.sort(flat[pairs] - self.first, stable=True)
        pairs = pairs[order]
        ids, counts = torch.unique_consecutive(local, return_counts=True)
        starts = [0, *torch.cumsum(counts, 0).tolist()]
        eager = self.implementation == "eager"
        wide = torch.promote_types(x.dtype, weights.dtype)
        # Each pair's down output (sliced: its float32 part), or (whole experts) weighted.
        outputs = torch.zeros(n * k, x.shape[-1], dtype=wide, device=x.device)
        out = torch.zeros_like(x)  # whole experts, "eager": rounded and added in ascending id
        for expert, a, b in zip(ids.tolist(), starts, starts[1:]):
            rows = pairs[a:b]
            gate, up = expert_linear(self.gate_up_proj, expert, x[rows // k]).chunk(2, dim=-1)
            y = self.down(expert, gelu_tanh(gate) * up)
            if self.sliced:
                outputs[rows] = y.to(wide)
            elif eager:
                out.index_add_(0, rows // k, (y * weights.reshape(-1)[rows, None]).to(x.dtype))
            else:
                outputs[rows] = y * weights.reshape(-1)[rows, None]
        if self.sliced:
            dist.all_reduce(outputs, group=self.group)
            return self.combine(outputs.to(x.dtype).view(n, k, -1), weights, experts)
        out = out if eager else outputs.view(n, k, -1).sum(dim=1)
        dist.all_reduce(out, group=self.group)
        return out.to(x.dtype)

    def combine(self, outputs: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """(N, K, H) expert outputs, as one device rounds them, weighted and combined as one
        device combines them (``Experts``)."""
        if self.implementation == "eager":  # each weighted output rounded, added in ascending id
            experts, order = experts.sort(dim=-1)
            weights = weights.gather(-1, order)
            outputs = outputs.gather(1, order[..., None].expand_as(outputs))
            out = torch.zeros_like(outputs[:, 0])
            for slot in range(outputs.shape[1]):
                out = out + (outputs[:, slot] * weights[:, slot, None]).to(out.dtype)
            return out
        return (outputs * weights[..., None]).sum(dim=1).to(outputs.dtype)


def shard_source(source: list[tuple], plan: ShardPlan, module_path) -> list[tuple]:
    """A checkpoint's tensor table ``(key, load, shape, dtype)`` as the rank reads it: each split
    tensor's load returns only the rank's slice (of a memory-mapped file: only the slice's bytes
    are copied; a load with a ``narrow(pieces)`` of its own, a GGUF tensor's, reads only the
    slice's blocks), its shape the slice's. ``module_path``: the config's key -> module path rule."""
    sharded = []
    for key, load, shape, dtype in source:
        name = module_path(key)
        pieces = plan.slices(name) if name is not None else None
        if pieces is None:
            sharded.append((key, load, shape, dtype))
            continue
        local = list(shape)
        local[pieces[0][0]] = sum(end - first for _, first, end in pieces)
        narrow = getattr(load, "narrow", None)
        sliced = narrow(pieces) if narrow is not None else _SliceLoad(load, pieces)
        sharded.append((key, sliced, tuple(local), dtype))
    return sharded


class _SliceLoad:
    """A tensor's load narrowed to the rank's pieces; ``release`` passed on (mapped pages dropped)."""

    def __init__(self, load, pieces: list[tuple[int, int, int]]):
        self.load, self.pieces = load, pieces
        release = getattr(load, "release", None)
        if release is not None:
            self.release = release

    def __call__(self) -> torch.Tensor:
        tensor = self.load()
        parts = [tensor.narrow(dim, first, end - first) for dim, first, end in self.pieces]
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=self.pieces[0][0])
