"""What each query may attend to: the keys of a call, as a mask in the form its backend takes.

``allowed_keys`` is the rule (causal, the sliding window, padding, image blocks, encoders'
bidirectionality); ``uncached_keys`` and ``cached_keys`` apply it to a call without and with a KV
cache, with the key ranges each row reads; ``attention_inputs`` puts the result in the form of the
layer's backend (sdpa: True-to-attend, or no mask where causality says it all, as transformers
decides; eager: additive).
"""

from __future__ import annotations

import torch

from ..cache import CacheStep, KVCache
from .attention import AttentionInputs

# (allowed (B, 1, T, S), the key slice every row reads or None, each row's key range or None,
# whether causality alone says it all, each query's key range when queries attend apart or None):
# what uncached_keys and cached_keys return.
Keys = tuple[
    torch.Tensor,
    slice | None,
    list[tuple[int, int, bool]] | None,
    bool,
    list[list[tuple[int, int, bool]]] | None,
]


def allowed_keys(
    query_index: torch.Tensor,
    key_index: torch.Tensor,
    key_valid: torch.Tensor,
    window: int | None,
    blocks: tuple[torch.Tensor, torch.Tensor] | None = None,
    bidirectional: bool = False,
    blocks_past_window: bool = False,
) -> torch.Tensor:
    """(B, 1, T, S) True where a query may attend to a key.

    Indices (B or 1, T) / (B or 1, S) are the positions in the sequence the mask is causal in (with
    left padding and no cache, the padded columns, as in the reference). A query sees keys at or
    before it, within ``window`` keys including itself on sliding layers, and never invalid keys.
    ``blocks`` = (query block ids (B, T), key block ids (B, S)): a query also sees later keys of
    its own block (id >= 0), still within the window's reach into the past. ``bidirectional``
    (encoder models): every key on full layers, keys with |q - k| < window on sliding layers.
    ``blocks_past_window`` (gemma4_unified): a block's keys are seen even beyond the window.
    """
    q, k = query_index[:, :, None], key_index[:, None, :]
    if bidirectional:
        allowed = torch.ones_like(k <= q) if window is None else (q - k).abs() < window
    else:
        allowed = k <= q  # (B, T, S)
        same_block = None
        if blocks is not None:
            query_block, key_block = blocks
            same_block = (query_block[:, :, None] == key_block[:, None, :]) & (query_block[:, :, None] >= 0)
            if not blocks_past_window:
                allowed = allowed | same_block
        if window is not None:
            allowed = allowed & (k > q - window)
        if same_block is not None and blocks_past_window:
            allowed = allowed | same_block
    return (allowed & key_valid[:, None, :])[:, None]


def uncached_keys(length, valid, window, vision_blocks, bidirectional, device, block_layers="sliding"):
    """Keys of a call without cache: its own tokens, causal in columns (padding included).
    ``block_layers``: where image blocks apply (``TextConfig.vision_block_layers``)."""
    index = torch.arange(length, device=device)[None]
    key_valid = torch.ones_like(index, dtype=torch.bool) if valid is None else valid
    with_blocks = vision_blocks is not None and (window is not None or block_layers != "sliding")
    blocks = (vision_blocks, vision_blocks) if with_blocks else None
    past_window = block_layers == "all"
    allowed = allowed_keys(index, index, key_valid, window, blocks, bidirectional, past_window)
    # transformers skips the sdpa mask only without padding, blocks or bidirectionality, and on
    # sliding layers only while the keys fit in the window. (A bidirectional Gemma 3 builds its
    # masks with an or_mask_function, which turns the skip off: a mask even on full layers without
    # padding, all True; tests/test_bidirectional_sdpa.py checks the calls against transformers'.)
    trivial = (
        vision_blocks is None
        and not bidirectional
        and (window is None or length < window)
        and (valid is None or bool(valid.all()))
    )
    return allowed, None, None, trivial, None


def cached_keys(cache: KVCache, step: CacheStep, window, vision_blocks, device, block_layers="sliding"):
    """Keys of a cached call: the rows' stored keys (full layers) or the window's past plus this
    call's own keys (sliding layers), with each row's range when the call knows its lengths."""
    blocks_past_window = block_layers == "all"
    batch, length = step.positions.shape
    this_call = torch.ones_like(step.positions, dtype=torch.bool) if step.written is None else step.written
    if window is None:
        key_index = torch.arange(step.full_span, device=device)[None]
        key_valid = key_index < step.ends
        blocks = None
        if vision_blocks is not None and block_layers != "sliding":
            # Full layers' keys are columns = positions; keys from earlier calls belong to no block.
            # amax: a padding token (block -1) sharing a column with a real one never overwrites it.
            key_block = torch.full((batch, step.full_span), -1, dtype=vision_blocks.dtype, device=device)
            key_block = key_block.scatter_reduce(1, step.positions, vision_blocks, "amax")
            blocks = (vision_blocks, key_block)
        ranges = (
            None if step.starts is None else [(0, max(s + c, 1)) for s, c in zip(step.starts, step.counts)]
        )
    else:
        key_index = torch.cat((step.past, step.positions), dim=1)
        key_valid = torch.cat((step.past >= 0, this_call), dim=1)
        blocks = None
        if vision_blocks is not None:
            # Keys from earlier calls belong to no block: blocks are this call's tokens.
            earlier = torch.full_like(step.past, -1)
            blocks = (vision_blocks, torch.cat((earlier, vision_blocks), dim=1))
        past = cache.past_len
        ranges = None if step.starts is None else [(past - min(s, past), past + length) for s in step.starts]
    allowed = allowed_keys(step.positions, key_index, key_valid, window, blocks, False, blocks_past_window)
    if step.apart:
        return allowed, None, None, False, apart_ranges(step, window, cache.past_len)

    key_slice, rows, trivial = None, None, False
    if ranges is not None:
        # Would the row alone skip the sdpa mask? Only if all its keys are real and causality (or
        # "every key", for one query) says it all, as transformers decides.
        alone = [
            step.written is None
            and vision_blocks is None
            and (length == 1 or length == end - start)
            and (window is None or end - start < window)
            for start, end in ranges
        ]
        if len(set(ranges)) == 1:
            start, end = ranges[0]
            if (start, end) != (0, key_index.shape[1]):
                key_slice = slice(start, end)
            trivial = alone[0]
        else:
            rows = [(start, end, a) for (start, end), a in zip(ranges, alone)]
    return allowed, key_slice, rows, trivial, None


def apart_ranges(step: CacheStep, window: int | None, past: int) -> list[list[tuple[int, int, bool]]]:
    """For each row, each real query's key range in this call's keys, as a one-token call at the
    query's position would read them (``cached_keys``), and whether that call would skip the sdpa
    mask. Full layers: columns [0, q]; sliding layers: the ``past`` keys before the call, then the
    call's own, of which query ``i`` (position ``q``) sees positions ``max(0, q - W + 1) .. q``."""
    queries = []
    for start, count in zip(step.starts, step.counts):
        ranges = []
        for i in range(count):
            q = start + i
            if window is None:
                ranges.append((0, q + 1, True))
            else:
                first = past + max(0, q - window + 1) - start
                ranges.append((first, past + i + 1, past + i + 1 - first < window))
        queries.append(ranges)
    return queries


def attention_inputs(
    keys: Keys, cos: torch.Tensor, sin: torch.Tensor, backend: str, dtype: torch.dtype
) -> AttentionInputs:
    """``keys`` and a layer type's RoPE tables (B, T, D) as the attention ``backend`` takes them."""
    allowed, key_slice, rows, trivial, queries = keys
    if key_slice is not None:
        allowed = allowed[..., key_slice]
    if backend == "sdpa" and trivial:
        # As transformers' sdpa path: no mask when causality alone says it all.
        return AttentionInputs(cos, sin, None, causal=True, key_slice=key_slice)
    if backend == "sdpa":
        return AttentionInputs(cos, sin, allowed, key_slice=key_slice, rows=rows, queries=queries)
    zero = torch.zeros((), dtype=dtype, device=allowed.device)
    additive = torch.where(allowed, zero, torch.finfo(dtype).min)
    return AttentionInputs(cos, sin, additive, key_slice=key_slice, rows=rows, queries=queries)
