"""Which slice of every text-decoder tensor one rank holds: ``ShardPlan``.

Tensor parallelism over ``size`` ranks, Megatron's split of a transformer layer:

* attention: each rank takes ``H / size`` query heads (q_proj rows, o_proj columns) and the KV heads
  those queries read (k_proj/v_proj rows). A layer with fewer KV heads than ranks (the 31B's and
  26B-A4B's full layers, E2B's single KV head) gives every rank the one KV head its queries belong
  to: that head is replicated on ``size / Hkv`` ranks, as vLLM does. KV-shared layers own no k/v and
  read their source layer's shard, which holds the same heads (same layer type, same KV heads);
* the dense MLP: gate/up rows (columns of the product) and down columns (rows of the product);
* the experts (26B-A4B): either split as the MLP, each expert's ``moe_intermediate_size`` divided
  (tensor parallel), or whole experts, ``E / size`` per rank (``expert_parallel``), exchanged by
  ``"all-reduce"`` (each rank computes its experts for every token, the sums reduced) or
  ``"all-to-all"`` (each token's rows sent to its experts' ranks and back: ``routed.py``);
* with a ``granule`` (quantized weights: 32, their groups), the MLP's and experts' intermediate
  features are split in whole granules, unevenly where their count is not a multiple of ``size``
  (the 26B-A4B's 704 expert features at 4 ranks: 192, 192, 160, 160), so that each rank's down
  columns are whole quantization groups; where the width is not whole granules, or has fewer than
  ``size``, the split is the even one, and a quantized down_proj whose share is not whole groups is
  kept in float (``quantization.choose_formats`` warns);
* the token table, tied LM head and PLE table: split by vocabulary rows;
* everything else (norms, router, PLE projections, layer scalars, the towers) is replicated.

The plan is plain data from the config; ``transform.py`` builds the rank's modules from it and
``slices`` tells the loader which part of each checkpoint tensor the rank reads.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import cached_property

from ..config import LayerSpec, ModelConfig, TextConfig

# How expert-parallel ranks exchange tokens (see the module docstring); the first is the default.
EXPERT_EXCHANGES = ("all-reduce", "all-to-all")


class ParallelError(ValueError):
    """A model that cannot be split as asked (sizes not divisible, a family not supported)."""


@dataclass(frozen=True)
class LayerShard:
    """One decoder layer's slices on one rank: query heads, KV heads, MLP and expert columns."""

    q_heads: tuple[int, int]  # [first, end) of the query heads
    kv_heads: tuple[int, int]  # [first, end) of the KV heads those queries read
    mlp: tuple[int, int]  # [first, end) of the dense MLP's intermediate features


def _part(total: int, size: int, rank: int, what: str) -> tuple[int, int]:
    if total % size:
        raise ParallelError(f"{what} ({total}) is not divisible by the tensor-parallel size {size}")
    step = total // size
    return rank * step, (rank + 1) * step


def _share(total: int, size: int, rank: int, granule: int, what: str) -> tuple[int, int]:
    """[first, end) of ``total`` features on ``rank``: whole granules (the first ``units % size``
    ranks one more) where ``total`` is whole granules, at least one per rank; else ``_part``."""
    units, rest = divmod(total, granule)
    if granule == 1 or rest or units < size:
        return _part(total, size, rank, what)
    base, extra = divmod(units, size)
    first = rank * base + min(rank, extra)
    return first * granule, (first + base + (rank < extra)) * granule


@dataclass(frozen=True)
class ShardPlan:
    """Rank ``rank``'s share of a text decoder split over ``size`` ranks."""

    text: TextConfig
    size: int
    rank: int
    expert_parallel: bool | str = False  # True: the default of EXPERT_EXCHANGES, or one by name
    granule: int = 1  # intermediate features split in whole multiples of this (quantization groups)

    def __post_init__(self) -> None:
        text = self.text
        if not 0 <= self.rank < self.size:
            raise ParallelError(f"rank {self.rank} outside a group of {self.size}")
        if text.has_altup or any(spec.activation_sparsity for spec in text.layers) or text.media_vocabularies:
            # AltUp mixes whole streams and the sparse gate's top-k needs every MLP feature's statistics.
            raise ParallelError("tensor parallelism does not split Gemma 3n (AltUp, sparse MLP gates)")
        if isinstance(self.expert_parallel, str) and self.expert_parallel not in EXPERT_EXCHANGES:
            raise ParallelError(
                f"unknown expert exchange {self.expert_parallel!r}; use one of {', '.join(EXPERT_EXCHANGES)}"
            )
        if self.expert_parallel and not text.enable_moe_block:
            raise ParallelError("expert_parallel needs a mixture of experts (26B-A4B); this model has none")
        # Every divisibility error raised now, before anything is built.
        _ = self.layers, self.vocab, self.per_layer_vocab, self.experts

    # ── the slices ─────────────────────────────────────────────────────────────────────────────

    @cached_property
    def layers(self) -> tuple[LayerShard, ...]:
        return tuple(self._layer(spec) for spec in self.text.layers)

    def _layer(self, spec: LayerSpec) -> LayerShard:
        heads, kv, size, rank = self.text.num_attention_heads, spec.num_kv_heads, self.size, self.rank
        q = _part(heads, size, rank, "num_attention_heads")
        if kv % size == 0:
            kv_heads = _part(kv, size, rank, "KV heads")
        elif size % kv == 0:
            # Fewer KV heads than ranks: this rank's queries all read one KV head (size/kv ranks share it).
            first = q[0] // (heads // kv)
            kv_heads = (first, first + 1)
        else:
            raise ParallelError(
                f"layer {spec.index}: {kv} KV heads can be neither split over nor replicated on {size} ranks"
            )
        mlp = _share(
            spec.intermediate_size, size, rank, self.granule, f"layer {spec.index}'s intermediate_size"
        )
        return LayerShard(q, kv_heads, mlp)

    @property
    def vocab(self) -> tuple[int, int]:
        """[first, end) of the token table's (and LM head's) rows."""
        return _part(self.text.vocab_size, self.size, self.rank, "vocab_size")

    @property
    def per_layer_vocab(self) -> tuple[int, int] | None:
        """[first, end) of the PLE table's rows (E2B/E4B), None without one."""
        if not self.text.has_per_layer_inputs:
            return None
        return _part(self.text.vocab_size_per_layer_input, self.size, self.rank, "vocab_size_per_layer_input")

    @property
    def experts(self) -> tuple[int, int] | None:
        """Expert parallel: [first, end) of the experts this rank holds; None otherwise."""
        if not self.text.enable_moe_block:
            return None
        if self.expert_parallel:
            return _part(self.text.num_experts, self.size, self.rank, "num_experts")
        _ = self.expert_features
        return None

    @property
    def expert_exchange(self) -> str | None:
        """Expert parallel: how the ranks exchange tokens (``EXPERT_EXCHANGES``); None otherwise."""
        if not self.expert_parallel:
            return None
        return EXPERT_EXCHANGES[0] if self.expert_parallel is True else self.expert_parallel

    @property
    def expert_features(self) -> tuple[int, int] | None:
        """Tensor-parallel experts: [first, end) of each expert's intermediate features."""
        if not self.text.enable_moe_block or self.expert_parallel:
            return None
        return _share(
            self.text.moe_intermediate_size, self.size, self.rank, self.granule, "moe_intermediate_size"
        )

    def local_text(self) -> TextConfig:
        """The text config of the rank's own modules: its heads, KV heads and MLP widths (a KV cache
        made from it holds the rank's heads). Vocabulary and expert count stay whole: the router and
        the ids still speak of all of them."""
        text = self.text
        shards = self.layers
        layers = tuple(
            replace(
                spec,
                num_kv_heads=shard.kv_heads[1] - shard.kv_heads[0],
                intermediate_size=shard.mlp[1] - shard.mlp[0],
            )
            for spec, shard in zip(text.layers, shards)
        )
        features = self.expert_features
        try:  # the config's default width (each layer's own is in its spec)
            first, end = _share(text.intermediate_size, self.size, self.rank, self.granule, "")
        except ParallelError:
            first, end = 0, text.intermediate_size // self.size
        return replace(
            text,
            num_attention_heads=text.num_attention_heads // self.size,
            intermediate_size=end - first,
            moe_intermediate_size=text.moe_intermediate_size
            if features is None
            else features[1] - features[0],
            layers=layers,
        )

    def slices(self, name: str) -> list[tuple[int, int, int]] | None:
        """The pieces ``(dim, first, end)`` of the text-decoder tensor at module path ``name`` this
        rank reads, concatenated along ``dim`` in order; None for a tensor every rank reads whole."""
        parts = name.split(".")
        if parts[0] != "language_model":
            return None  # the towers and their embedders: replicated
        if name in ("language_model.embed_tokens.weight", "language_model.lm_head.weight"):
            return [(0, *self.vocab)]
        if name == "language_model.embed_tokens_per_layer.weight":
            return [(0, *self.per_layer_vocab)]
        if parts[1] != "layers":
            return None
        spec, shard = self.text.layers[int(parts[2])], self.layers[int(parts[2])]
        module, leaf = ".".join(parts[3:-1]), parts[-1]
        dim = spec.head_dim
        rows = {
            "self_attn.q_proj": (0, shard.q_heads[0] * dim, shard.q_heads[1] * dim),
            "self_attn.k_proj": (0, shard.kv_heads[0] * dim, shard.kv_heads[1] * dim),
            "self_attn.v_proj": (0, shard.kv_heads[0] * dim, shard.kv_heads[1] * dim),
            "self_attn.o_proj": (1, shard.q_heads[0] * dim, shard.q_heads[1] * dim),
            "mlp.gate_proj": (0, *shard.mlp),
            "mlp.up_proj": (0, *shard.mlp),
            "mlp.down_proj": (1, *shard.mlp),
        }
        if module in rows and leaf == "weight":
            return [rows[module]]
        if module == "experts":
            if self.expert_parallel:
                return [(0, *self.experts)]
            first, end = self.expert_features
            if leaf == "gate_up_proj":  # (E, 2I, H): the gate's rows, then the up rows
                whole = self.text.moe_intermediate_size
                return [(1, first, end), (1, whole + first, whole + end)]
            return [(2, first, end)]  # down_proj (E, H, I)
        return None


def shard_plan(
    config: ModelConfig, size: int, rank: int, expert_parallel: bool | str = False, granule: int = 1
) -> ShardPlan:
    return ShardPlan(config.text, size, rank, expert_parallel, granule)
