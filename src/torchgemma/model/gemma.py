"""The whole model: the text decoder and its head (the vision and audio towers join here later).

Module names follow the checkpoint's tensor names with the ``model.`` prefix removed
(``language_model.layers.3.self_attn.q_proj.weight``), so loading is an identity mapping.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..cache import KVCache
from ..config import ModelConfig
from .text import TextModel


class Gemma(nn.Module):
    """A Gemma 4 checkpoint as a module.

    ``model(input_ids, attention_mask=None)`` returns soft-capped logits ``(B, T, vocab)``. For
    incremental decoding pass a cache from ``make_cache``: each call appends its tokens to it.
    """

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        text = config.text
        self.language_model = TextModel(text)
        if not text.tie_word_embeddings:
            self.lm_head = nn.Linear(text.hidden_size, text.vocab_size, bias=False)

    @property
    def device(self) -> torch.device:
        return self.language_model.embed_tokens.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.language_model.embed_tokens.weight.dtype

    def make_cache(self, batch_size: int, max_len: int) -> KVCache:
        """An empty KV cache for ``batch_size`` sequences of up to ``max_len`` tokens (prompt included)."""
        return KVCache(self.config.text, batch_size, max_len, dtype=self.dtype, device=self.device)

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        *,
        cache: KVCache | None = None,
        logits_to_keep: int = 0,
    ) -> torch.Tensor:
        """Logits ``(B, T, vocab)`` for ``input_ids`` ``(B, T)``.

        ``attention_mask`` ``(B, T)`` marks real tokens (1) and left padding (0) of this call's tokens;
        with a cache, earlier tokens' padding is remembered by the cache. ``logits_to_keep=n > 0``
        computes only the last ``n`` positions (and skips the rest through the KV-shared layers,
        which write no cache).
        """
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be (batch, length), got shape {tuple(input_ids.shape)}")
        hidden = self.language_model(input_ids, attention_mask, cache, keep_last=logits_to_keep)
        weight = (
            self.language_model.embed_tokens.weight
            if self.config.text.tie_word_embeddings
            else self.lm_head.weight
        )
        logits = F.linear(hidden, weight)
        cap = self.config.text.final_logit_softcapping
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits
