"""Drafting with Gemma 4's MTP drafters: ``MTPDrafter`` proposes each request's next tokens from the
target's own state, for the speculative engine to verify.

A drafter reads, for one request: the target's embedding of the last token (the one the target
reads next), the target's final-normed hidden state that produced it, and the target's keys and
values of its last full and last sliding layer in the request's KV-cache slot: every position
before that token on full layers, the last ``W + 1`` on sliding ones (transformers' drafter mask is
``|q - k| <= W``, inclusive). It then drafts greedily, one token per step, each step feeding back
its token and its projected state, the query held at the same position: transformers 5.23's
``SinglePositionMultiTokenCandidateGenerator``, which ``generate(..., assistant_model=...)`` runs.

The target's keys are read from its cache as views where the layout allows (``KVCache.layer_keys``),
once per drafting round; the drafter has no cache of its own.

One difference from transformers' ``generate``: after a verification that rejected drafts, it hands
its drafter the keys its target computed in that pass, cut to the new length, so the drafter also
attends to the key of the first rejected draft (at the position of the token it reads; on sliding
layers, to every rejected one). Here the drafter reads only what the target accepted: the state
transformers' candidate generator sees after a prefill, which is what the tests compare with.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch

from ..cache import KVCache
from ..config import ModelConfig, TextConfig
from ..config.assistant import AssistantConfig
from ..model import Gemma
from ..model.assistant import Assistant
from ..weights.assistant import load_assistant


class DrafterMismatch(ValueError):
    """A drafter that was not made for this target."""


def source_layers(target: TextConfig, drafter: TextConfig) -> dict[str, int]:
    """Per attention type the drafter uses, the target layer whose keys and values it reads: the
    KV source of the target's last layer of that type (its last full / last sliding layer, or the
    layer those share their keys with)."""
    sources = {}
    for kind in dict.fromkeys(spec.attention_type for spec in drafter.layers):
        last = [spec for spec in target.layers if spec.attention_type == kind]
        if not last:
            raise DrafterMismatch(f"the drafter has {kind} layers but the target has none")
        sources[kind] = last[-1].kv_source
    return sources


def check_pair(target: ModelConfig, drafter: AssistantConfig) -> None:
    """Raise ``DrafterMismatch`` naming the first thing in which ``drafter`` does not fit ``target``:
    hidden size, vocabulary, or the geometry of the target layers it reads."""
    text, own = target.text, drafter.text
    if drafter.backbone_hidden_size != text.hidden_size:
        raise DrafterMismatch(
            f"the drafter was made for a target of hidden size {drafter.backbone_hidden_size}; this "
            f"target's is {text.hidden_size}"
        )
    if own.vocab_size != text.vocab_size:
        raise DrafterMismatch(
            f"the drafter's vocabulary has {own.vocab_size} tokens; the target's {text.vocab_size}"
        )
    for kind, index in source_layers(text, own).items():
        theirs = text.layers[index]
        mine = next(spec for spec in own.layers if spec.attention_type == kind)
        if (mine.head_dim, mine.num_kv_heads) != (theirs.head_dim, theirs.num_kv_heads):
            raise DrafterMismatch(
                f"the drafter's {kind} layers attend to keys of head_dim {mine.head_dim} in "
                f"{mine.num_kv_heads} heads; the target's layer {index}, which they read, has head_dim "
                f"{theirs.head_dim} in {theirs.num_kv_heads} heads"
            )
        if own.rope[kind] != text.rope[kind]:
            raise DrafterMismatch(
                f"the drafter rotates {kind} queries with {own.rope[kind]}; the target rotated the keys "
                f"they read with {text.rope[kind]}"
            )


def check_split(target: Gemma, drafter: AssistantConfig) -> None:
    """Under tensor parallelism (``target.shard_plan``, ``torchgemma.distributed``), raise
    ``DrafterMismatch`` unless each rank holds all the KV heads of the target layers the drafter
    reads. Every rank runs the whole drafter on its own share of the target's cache, and the ranks
    must draft the same tokens to verify them in the same forward passes (``generation/ranks.py``):
    that holds where those layers' KV heads are whole on every rank (a single KV head, replicated:
    E2B's), not where they are split (each rank would attend to other heads, and the drafter was
    made for all of them)."""
    plan = getattr(target, "shard_plan", None)
    if plan is None:
        return
    for kind, index in source_layers(plan.text, drafter.text).items():
        total = plan.text.layers[index].num_kv_heads
        first, end = plan.layers[index].kv_heads
        if end - first != total:
            raise DrafterMismatch(
                f"speculative decoding with an MTP drafter (--speculative mtp:...) cannot run on a model "
                f"split over {plan.size} ranks (--tensor-parallel-size {plan.size}): the drafter reads all "
                f"{total} KV heads of the target's layer {index} ({kind}), and each rank holds {end - first} "
                "of them. Use --speculative ngram (speculative='ngram'), or the model in one process"
            )


class MTPDrafter:
    """Drafts with a Gemma 4 MTP drafter: ``propose(requests, cache)`` for the speculative engine.

    ``target`` is the model being decoded (its cache is read, never written); ``drafter`` an
    ``Assistant`` in the same dtype and on the same device (``load_drafter`` loads one so).
    """

    # The engine hands each request the target's final-normed hidden state (DraftRequest.hidden).
    needs_hidden = True

    def __init__(self, target: Gemma, drafter: Assistant):
        check_split(target, drafter.config)
        check_pair(target.config, drafter.config)
        if (drafter.dtype, drafter.device) != (target.dtype, target.device):
            raise DrafterMismatch(
                f"the drafter is in {drafter.dtype} on {drafter.device}, the target in {target.dtype} on "
                f"{target.device}: load them in one dtype, on one device"
            )
        self.target = target
        self.drafter = drafter
        self.sources = source_layers(target.config.text, drafter.config.text)
        # Sliding layers read the last W + 1 positions.
        self.sliding_keys = drafter.config.text.sliding_window + 1

    def min_ring(self, max_rollback: int) -> int:
        """The sliding rings a target cache needs (``KVCache(min_ring=...)``) so that the keys this
        drafter reads survive a rollback of ``max_rollback`` tokens."""
        return self.sliding_keys + max_rollback

    @torch.no_grad()
    def propose(self, requests: Sequence, cache: KVCache) -> list[list[int]]:
        """Up to ``num_tokens`` greedy draft tokens per request (``DraftRequest``), request by
        request (each gets the bits it gets alone)."""
        needed = min(cache.max_len, self.min_ring(cache.max_rollback))
        if cache.ring < needed:
            raise ValueError(
                f"the MTP drafter reads the last {self.sliding_keys} positions of the target's sliding "
                f"layers: make the cache with KVCache(..., min_ring={needed}) (its rings hold {cache.ring})"
            )
        return [self.draft(r.tokens, r.num_tokens, r.slot, r.hidden, cache) for r in requests]

    def draft(
        self, tokens: Sequence[int], num_tokens: int, slot: int, hidden: torch.Tensor | None, cache: KVCache
    ) -> list[int]:
        """``num_tokens`` greedy draft tokens after ``tokens``, whose slot holds all but the last."""
        length = len(tokens) - 1
        if num_tokens <= 0 or length <= 0:
            return []
        if cache.lengths[slot] != length:
            raise ValueError(
                f"slot {slot} holds {cache.lengths[slot]} tokens; the drafter needs the target to have read "
                f"all {length} tokens before the last one (rejected drafts rolled back)"
            )
        width = self.drafter.config.backbone_hidden_size
        if hidden is None or hidden.numel() != width:
            shape = None if hidden is None else tuple(hidden.shape)
            raise ValueError(f"the drafter needs the target's last hidden state ({width},), got {shape}")
        target_kv = {}
        for kind, layer in self.sources.items():
            start = max(0, length - self.sliding_keys) if kind == "sliding_attention" else 0
            target_kv[kind] = cache.layer_keys(slot, layer, start, length)
        device = self.drafter.device
        token = torch.tensor([[tokens[-1]]], device=device)
        state = hidden.reshape(1, 1, width).to(device=device, dtype=self.drafter.dtype)
        position = torch.tensor([[length]], device=device)
        drafted = []
        for _ in range(num_tokens):
            embeds = self.target.language_model.embed(token)  # the target's scaled embedding
            logits, state = self.drafter.step(embeds, state, position, target_kv)
            token = logits.argmax(dim=-1)  # (1, 1)
            drafted.append(token)
        return torch.cat(drafted, dim=1)[0].tolist()


def load_drafter(
    source_or_model: str | Path | Assistant, target: Gemma, *, attention: str | None = None
) -> MTPDrafter:
    """An ``MTPDrafter`` for ``target``: a loaded ``Assistant``, or one loaded from a folder, hub id
    or GGUF file in the target's dtype, on its device, with its attention backend (or
    ``attention``). The pair is checked from the configs before any weight is read."""
    if isinstance(source_or_model, Assistant):
        return MTPDrafter(target, source_or_model)
    path = Path(source_or_model).expanduser()
    if path.is_dir():
        config = AssistantConfig.from_file(path)
        check_split(target, config)
        check_pair(target.config, config)
    drafter = load_assistant(
        source_or_model, dtype=target.dtype, device=target.device, attention=attention or target.attention
    )
    return MTPDrafter(target, drafter)
