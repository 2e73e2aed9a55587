"""Attention backends: how a layer's queries attend to its keys, by name (``ATTENTION``).

A backend takes query (B, H, T, D), key and value (B, Hkv, S, D), the layer type's
``AttentionInputs`` (RoPE tables, mask, key ranges: ``masks.py`` builds them) and the scale, and
returns (B, T, H, D). ``"eager"`` is transformers' eager arithmetic, bit for bit; ``"sdpa"`` is
``scaled_dot_product_attention``, as transformers' sdpa path. When the rows of a batch read
different key ranges (``AttentionInputs.rows``), both attend row by row, as each row would alone.
The text decoder's ``Attention`` module looks its backend up here (``Attention.backends``); a
transform may give it another table (``acceleration.fuse_cpu_ops``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from .layers import eager_attention, repeat_heads


@dataclass
class AttentionInputs:
    """What the layers of one attention type attend with, besides their keys and values.

    ``mask`` (B, 1, T, S): additive (eager) or True-to-attend (sdpa); None means ``causal`` over
    T == S keys, or every key. ``key_slice``: the keys all rows read, when it is the same slice for
    every row. ``rows``: each row's own keys ``(start, end, causal_alone)`` when they differ; both
    backends then attend row by row to exactly those, as the row would alone, so a sequence gets
    the same bits whatever its neighbours in the batch (``causal_alone``: sdpa would skip the mask).
    """

    cos: torch.Tensor  # (B, T, D)
    sin: torch.Tensor
    mask: torch.Tensor | None
    causal: bool = False
    key_slice: slice | None = None
    rows: list[tuple[int, int, bool]] | None = None
    # Queries apart (a speculative verify pass): for each row, each real query's ``(start, end,
    # causal_alone)`` as a one-token call would read them; see ``attend_apart``.
    queries: list[list[tuple[int, int, bool]]] | None = None

    def last(self, n: int) -> AttentionInputs:
        """The same for the last ``n`` queries only."""
        return replace(
            self,
            cos=self.cos[:, -n:],
            sin=self.sin[:, -n:],
            mask=None if self.mask is None else self.mask[:, :, -n:],
            # One query of a causal block sees every key (callers keep n == 1 without a mask).
            causal=False,
        )


def eager_backend(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, inputs: AttentionInputs, scale: float
) -> torch.Tensor:
    """Transformers' eager attention: repeated KV heads, float32 softmax. Returns (B, T, H, D)."""
    if inputs.key_slice is not None:
        key, value = key[:, :, inputs.key_slice], value[:, :, inputs.key_slice]
    if inputs.rows is None:
        return eager_attention(query, key, value, inputs.mask, scale)
    mask = inputs.mask
    return torch.cat(
        [
            eager_attention(
                query[b : b + 1],
                key[b : b + 1, :, s:e],
                value[b : b + 1, :, s:e],
                mask[b : b + 1, ..., s:e],
                scale,
            )
            for b, (s, e, _) in enumerate(inputs.rows)
        ]
    )


def sdpa_backend(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, inputs: AttentionInputs, scale: float
) -> torch.Tensor:
    """``scaled_dot_product_attention`` as transformers calls it (``sdpa_attention``), memory
    bounded by the kernel's blocking rather than T x S scores. Returns (B, T, H, D)."""
    if inputs.key_slice is not None:
        key, value = key[:, :, inputs.key_slice], value[:, :, inputs.key_slice]
    if inputs.rows is not None:
        return torch.cat(
            [
                _sdpa(
                    query[b : b + 1],
                    key[b : b + 1, :, s:e],
                    value[b : b + 1, :, s:e],
                    None if alone else inputs.mask[b : b + 1, ..., s:e],
                    alone,
                    scale,
                )
                for b, (s, e, alone) in enumerate(inputs.rows)
            ]
        )
    return _sdpa(query, key, value, inputs.mask, inputs.causal, scale)


def _sdpa(query, key, value, mask, causal: bool, scale: float) -> torch.Tensor:
    return sdpa_attention(query, key, value, mask, causal and query.shape[2] > 1, scale)


def sdpa_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor | None,
    causal: bool,
    scale: float,
) -> torch.Tensor:
    """``scaled_dot_product_attention`` as transformers' sdpa path calls it
    (``integrations/sdpa_attention.py``), so that the kernel runs the same products in the same
    order: query (B, H, T, D), key/value (B, Hkv, S, D), mask (B, 1, T, S) True-to-attend or None
    (``causal``: no mask, causal attention). Returns (B, T, H, D). The text decoder and the vision
    tower both call it.

    Shared KV heads reach the kernel as there: one query's heads (a decode step) "packed" as the
    queries of their KV head (B, Hkv, H/Hkv, D) where transformers packs them (with a mask: a step
    past the sliding window; head dims over 256), else in place (``enable_gqa``). Packing changes
    the kernel's product shapes and so the rounding (float32 and bf16, measured). Where
    transformers repeats the KV heads instead (several queries with a mask or head dims over 256)
    the kernel runs the same products on the same values as in place on the CPU (bit-identical,
    measured), and in place needs no H/Hkv copies of the keys: a long prompt's chunks stay in bounded
    memory. Other devices repeat them where transformers does (CUDA picks its kernel by the layout).
    """
    batch, heads, length, dim = query.shape
    groups = heads // key.shape[1]
    extra = {}
    if groups > 1:
        in_place = mask is None and key.shape[-1] == value.shape[-1] <= 256  # transformers' use_gqa_in_sdpa
        if length == 1 and not in_place:
            query = query.reshape(batch, heads // groups, groups, dim)  # a mask (B, 1, 1, S) broadcasts
        elif in_place or query.device.type == "cpu":
            extra["enable_gqa"] = True
        else:
            # Repeated as transformers repeats them: on CUDA, enable_gqa with a mask takes another
            # kernel than repeated heads do (float32 logits 1e-5 apart on an H200; the same bits with
            # only the math kernel enabled).
            key, value = repeat_heads(key, groups), repeat_heads(value, groups)
    out = F.scaled_dot_product_attention(
        query, key, value, attn_mask=mask, is_causal=mask is None and causal, scale=scale, **extra
    )
    # Unpacks the packed heads (a no-op otherwise).
    return out.reshape(batch, heads, length, value.shape[-1]).transpose(1, 2)


def attend_apart(
    backend,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    inputs: AttentionInputs,
    scale: float,
) -> torch.Tensor:
    """Each real query of each row through ``backend`` as the query of a one-token call at its
    position (a decode step) would go: the same keys in the same order, the same mask or none, so
    the same bits. A speculative verify pass scores k + 1 tokens of a sequence this way; padded
    queries (past a row's real ones) get zeros. Returns (B, T, H, D)."""
    batch, heads, length, _ = query.shape
    out = query.new_zeros(batch, length, heads, value.shape[-1])
    for b, ranges in enumerate(inputs.queries):
        n = len(ranges)
        if not n:
            continue
        # The row's queries as n one-token rows over the row's keys (a view: no copy of the keys).
        sub = AttentionInputs(
            inputs.cos[b : b + 1],
            inputs.sin[b : b + 1],
            inputs.mask[b, :, :n, None].transpose(0, 1),
            rows=ranges,
        )
        q = query[b, :, :n, None].transpose(0, 1)  # (n, H, 1, D)
        k = key[b : b + 1].expand(n, -1, -1, -1)
        v = value[b : b + 1].expand(n, -1, -1, -1)
        out[b, :n] = backend(q, k, v, sub, scale)[:, 0]
    return out


# What each backend name runs.
ATTENTION = {"eager": eager_backend, "sdpa": sdpa_backend}
ATTENTION_BACKENDS = tuple(ATTENTION)
