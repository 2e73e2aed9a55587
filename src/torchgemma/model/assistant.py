"""Gemma 4's MTP drafter ("assistant"), in reading order.

    target's embedding of the last token ─┐
    target's last hidden state (normed) ──┴─ concat ─ pre_projection ─┐
                                                                      ▼
    for each layer: the text decoder's layer, its attention reading the TARGET's keys and values
                    of its type (the target's last full / last sliding layer), no cache of its own
    final norm ─┬─ head: tied embeddings, or (E2B/E4B) centroid-masked ─ logits
                └─ post_projection ─ the next step's "hidden state", in the target's width

One step drafts one token. The query sits at the position of the token it reads, and stays there
while the drafter drafts on: each step feeds back its own token and projected state, against the
same target keys (transformers' ``SinglePositionMultiTokenCandidateGenerator``). Every numerics
choice follows transformers 5.23 (``models/gemma4_assistant/modeling_gemma4_assistant.py``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from ..config.assistant import AssistantConfig
from .attention import AttentionInputs
from .text import TextModel


class MaskedEmbedder(nn.Module):
    """The centroid-masked head (E2B/E4B; checkpoint prefix ``masked_embedding.``).

    The vocabulary is split into ``num_centroids`` clusters of equal size (``token_ordering``, the
    token ids cluster by cluster). A hidden state scores the clusters (``centroids``), and only the
    tokens of its top ``centroid_intermediate_top_k`` get logits, from the tied embedding rows; every
    other token gets the row's lowest logit less one.
    """

    def __init__(self, config: AssistantConfig):
        super().__init__()
        vocab = config.text.vocab_size
        self.top_k = config.centroid_intermediate_top_k
        self.num_centroids = config.num_centroids
        self.centroids = nn.Linear(config.text.hidden_size, config.num_centroids, bias=False)
        self.register_buffer("token_ordering", torch.empty(vocab, dtype=torch.long))

    def forward(self, hidden: torch.Tensor, rows_of: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """hidden (B, T, H) -> logits (B, T, V); ``rows_of(ids)``: the head's rows (..., H) of token ids
        (an embedding lookup: a quantized table gives them dequantized)."""
        batch, length, width = hidden.shape
        _, top = torch.topk(self.centroids(hidden), k=self.top_k, dim=-1)  # (B, T, k)
        clusters = self.token_ordering.view(self.num_centroids, -1)  # (C, V / C)
        tokens = clusters[top].reshape(batch, length, -1)  # (B, T, k * V / C)
        rows = rows_of(tokens.reshape(-1)).view(batch, length, -1, width)
        # One (1, H) x (H, k * V / C) product per position, as the reference computes them.
        selected = (hidden.unsqueeze(-2) @ rows.transpose(-1, -2)).squeeze(-2)
        # The reference fills with the minimum over the whole call; per row here, so that a
        # request's logits do not depend on its neighbours (the same for one row).
        floor = selected.amin(dim=-1, keepdim=True) - 1.0
        logits = floor.expand(batch, length, self.token_ordering.shape[0]).clone()
        return logits.scatter_(-1, tokens, selected)


class Assistant(nn.Module):
    """A drafter checkpoint as a module: ``model.*`` is its decoder (embedding table, layers, final
    norm), beside ``pre_projection``, ``post_projection`` and, for E2B/E4B, ``masked_embedding``.

    ``step`` drafts one token for B rows; the caller (``generation/mtp.py``) supplies the target's
    embedding of each row's last token, its last hidden state, the position, and the target's keys
    and values per attention type.
    """

    def __init__(self, config: AssistantConfig, attention: str = "sdpa"):
        super().__init__()
        self.config = config
        text = config.text
        backbone = config.backbone_hidden_size
        # The decoder's own embedding table is only the tied head: the input is the target's.
        self.model = TextModel(text, attention)
        self.pre_projection = nn.Linear(2 * backbone, text.hidden_size, bias=False)
        self.post_projection = nn.Linear(text.hidden_size, backbone, bias=False)
        if config.use_ordered_embeddings:
            self.masked_embedding = MaskedEmbedder(config)

    @property
    def dtype(self) -> torch.dtype:
        return self.model.dtype

    @property
    def device(self) -> torch.device:
        return self.model.norm.weight.device

    def set_attention(self, backend: str) -> None:
        self.model.set_attention(backend)

    def step(
        self,
        token_embeds: torch.Tensor,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        target_kv: dict[str, tuple[torch.Tensor, torch.Tensor]],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One drafting step.

        token_embeds (B, 1, Hb): the target's embedding of the token read; hidden (B, 1, Hb): the
        target's final-normed hidden state that produced it (or the previous step's projected
        one); positions (B, 1): that token's position. ``target_kv``: per attention type, the keys
        and values (B, Hkv, S, D) every row attends to, all of them (no mask).
        Returns logits (B, 1, V) and the next step's hidden state (B, 1, Hb).
        """
        x = self.pre_projection(torch.cat([token_embeds, hidden], dim=-1))  # (B, 1, H)
        rope = self.model.rotary(positions, x.dtype)
        layout = {kind: AttentionInputs(cos, sin, None) for kind, (cos, sin) in rope.items()}
        for spec, layer in zip(self.config.text.layers, self.model.layers):
            # The layer's KV source is the target's last layer of its type (TARGET_KV_SOURCE).
            shared = {spec.kv_source: target_kv[spec.attention_type]}
            x = layer(x, None, layout[spec.attention_type], shared, None, None)
        normed = self.model.norm(x)
        return self.head(normed), self.post_projection(normed)

    def head(self, normed: torch.Tensor) -> torch.Tensor:
        """Logits (B, T, V) of final-normed states: not soft-capped (the reference's drafter is not)."""
        text = self.model
        tied = self.config.text.tie_word_embeddings
        if self.config.use_ordered_embeddings:
            return self.masked_embedding(
                normed, text.embed_tokens if tied else lambda ids: text.lm_head.weight[ids]
            )
        return text.embed_tokens.as_linear(normed) if tied else text.lm_head(normed)
