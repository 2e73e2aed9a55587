"""The KV cache: preallocated, passed in explicitly, sized to what the architecture needs.

* Full-attention layers keep every token: ``max_len`` slots.
* Sliding-window layers keep a ring buffer of exactly ``sliding_window`` slots.
* KV-shared layers keep nothing: they attend to their source layer's keys and values, produced in
  the same forward pass.

Every layer cache has one method, ``update(key, value, start)``: store the new keys/values of this
call (which begin at absolute slot ``start``) and return the keys/values the call attends to, in
chronological order. ``key_slots(start, length)`` names the absolute slots of those keys, so the
model builds one mask per layer type. For a sliding layer that is the ``window - 1`` slots before the
call plus the call's own: the same keys, in the same order, as the reference's dynamic cache, so the
cached and uncached paths agree to the last bit on the same kernels.
"""

from __future__ import annotations

from typing import Protocol

import torch

from .config import TextConfig


class LayerCache(Protocol):
    def update(
        self, key: torch.Tensor, value: torch.Tensor, start: int
    ) -> tuple[torch.Tensor, torch.Tensor]: ...

    def key_slots(self, start: int, length: int, device: torch.device) -> torch.Tensor: ...


class FullLayerCache:
    """Every token of the sequence, in slot order."""

    def __init__(self, batch: int, heads: int, max_len: int, head_dim: int, dtype: torch.dtype, device):
        shape = (batch, heads, max_len, head_dim)
        self.keys = torch.zeros(shape, dtype=dtype, device=device)
        self.values = torch.zeros(shape, dtype=dtype, device=device)

    def update(self, key: torch.Tensor, value: torch.Tensor, start: int) -> tuple[torch.Tensor, torch.Tensor]:
        end = start + key.shape[2]
        self.keys[:, :, start:end] = key
        self.values[:, :, start:end] = value
        return self.keys[:, :, :end], self.values[:, :, :end]

    @staticmethod
    def key_slots(start: int, length: int, device) -> torch.Tensor:
        return torch.arange(start + length, device=device)


class SlidingLayerCache:
    """A ring buffer of ``window`` slots: slot ``p % window`` holds the token at absolute slot ``p``."""

    def __init__(self, batch: int, heads: int, window: int, head_dim: int, dtype: torch.dtype, device):
        self.window = window
        shape = (batch, heads, window, head_dim)
        self.keys = torch.zeros(shape, dtype=dtype, device=device)
        self.values = torch.zeros(shape, dtype=dtype, device=device)

    def update(self, key: torch.Tensor, value: torch.Tensor, start: int) -> tuple[torch.Tensor, torch.Tensor]:
        length = key.shape[2]
        # A query sees `window` keys including itself: the earliest query of this call needs the
        # window - 1 tokens before it. Read them before the new tokens overwrite their slots.
        past = min(start, self.window - 1)
        if past:
            ring = torch.arange(start - past, start, device=key.device) % self.window
            key_all = torch.cat((self.keys[:, :, ring], key), dim=2)
            value_all = torch.cat((self.values[:, :, ring], value), dim=2)
        else:
            key_all, value_all = key, value
        kept = min(length, self.window)
        ring = torch.arange(start + length - kept, start + length, device=key.device) % self.window
        self.keys[:, :, ring] = key[:, :, length - kept :]
        self.values[:, :, ring] = value[:, :, length - kept :]
        return key_all, value_all

    def key_slots(self, start: int, length: int, device) -> torch.Tensor:
        return torch.arange(start - min(start, self.window - 1), start + length, device=device)


class KVCache:
    """The cache of one batch of sequences for a text decoder.

    ``length`` slots have been written (the same for every row: left padding occupies slots too).
    ``key_valid[b, s]`` says whether slot ``s`` of row ``b`` holds a real token rather than padding;
    ``next_position[b]`` is the RoPE position the next real token of row ``b`` gets.
    """

    def __init__(
        self,
        config: TextConfig,
        batch_size: int,
        max_len: int,
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ):
        if batch_size <= 0 or max_len <= 0:
            raise ValueError(f"batch_size and max_len must be positive, got {batch_size} and {max_len}")
        self.batch_size = batch_size
        self.max_len = max_len
        self.layers: list[LayerCache | None] = []
        for spec in config.layers:
            if spec.kv_role == "reuse":
                self.layers.append(None)
            elif spec.is_sliding:
                # Never more slots than the sequence can have.
                slots = min(spec.window, max_len)
                self.layers.append(
                    SlidingLayerCache(batch_size, spec.num_kv_heads, slots, spec.head_dim, dtype, device)
                )
            else:
                self.layers.append(
                    FullLayerCache(batch_size, spec.num_kv_heads, max_len, spec.head_dim, dtype, device)
                )
        self.key_valid = torch.zeros(batch_size, max_len, dtype=torch.bool, device=device)
        self.next_position = torch.zeros(batch_size, dtype=torch.long, device=device)
        self.length = 0

    @property
    def nbytes(self) -> int:
        """Bytes held by the key/value buffers."""
        return sum(c.keys.nbytes + c.values.nbytes for c in self.layers if c is not None)

    def reset(self) -> None:
        """Forget every sequence (the buffers are kept for reuse)."""
        self.key_valid.zero_()
        self.next_position.zero_()
        self.length = 0
