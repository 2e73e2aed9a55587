"""The KV cache: a fixed number of slots, each holding one sequence; preallocated, passed in explicitly.

Each slot has its own length: a forward call appends the real tokens of each of its rows to that
row's slot, at positions ``length, length + 1, ...`` (a sequence has no holes; left padding in a call
is skipped). A slot can be freed and reused at once, and its last tokens can be taken back.

Per layer, for ``S`` slots:

* Full attention: ``(S, Hkv, C, D)``; position ``p`` lives in column ``p``. ``C`` is ``max_len``
  when the cache is preallocated; otherwise the buffers start small and grow (at least doubling,
  in multiples of ``GROWTH_QUANTUM`` columns, never past ``max_len``) when a call needs more, so a
  request for 10^9 new tokens that stops after one costs what one token costs.
* Sliding window: a ring of ``min(max_len, W + max_rollback)`` columns; position ``p`` lives
  in column ``p % ring``.
* KV-shared: nothing. Those layers attend to their source layer's keys and values, produced in the
  same forward pass.

**The ring rule.** A query sees ``W`` keys ending at itself. A call reads the ``W - 1`` keys before
its first token from the ring *before* writing its own, and attends to those plus its own keys
straight from the projection. So the ring only has to keep the ``W - 1`` keys the next call
needs: chunked prefill needs no slack, whatever the chunk size. One column more lets a decode step
(one new token per row) write its key first and attend to all ``W`` keys where they lie in the ring
(``RingKeys``: no copy of the window per layer and step). Taking back ``k`` tokens moves the next
call's start back by ``k``, so ``k`` more old keys must survive: ``max_rollback`` columns of slack,
and that is all.

A slot's keys and values can be read out (``read``: positions a sliding ring still holds) and a
sequence's first positions written back into a freed slot (``load_prefix``): the prefix cache
(``generation/prefix_cache.py``) keeps them between requests. ``min_ring`` widens the rings so
that a whole prefill chunk is still there to be read after its call.

The cache keeps its bookkeeping (lengths) on the host, where the scheduler needs it; a call's
positions, write columns and key layout are built from it once per call as a ``CacheStep``, which
every layer reads. ``decode_step`` builds one from tensors alone, with static shapes, for a
compiled decode over every slot.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from .config import TextConfig

# Full-attention buffers that grow do so in multiples of this many columns.
GROWTH_QUANTUM = 256


@dataclass
class CacheStep:
    """Where one forward call's tokens go, and which cached keys each row reads.

    ``rows`` (B,) are the slots of the call's rows (``row_slice`` when they are a range, so reads
    are views); ``positions`` (B, T) the position of every token (padding: any valid index);
    ``written`` (B, T) which tokens are stored (None: all of them). ``ends`` (B, 1) is each row's
    length after the call. Full layers read columns ``[0, full_span)``; sliding layers read the
    ``past`` positions before each row's first token (B, P), valid where ``>= 0``.
    ``active`` (B,) is set by ``decode_step``: rows it is False for write back what is there.
    """

    rows: torch.Tensor
    row_slice: slice | None
    positions: torch.Tensor
    written: torch.Tensor | None
    ends: torch.Tensor
    full_span: int
    past: torch.Tensor
    active: torch.Tensor | None = None
    # Host-side: each row's slot, real tokens and length before the call (None in decode_step).
    slots: list[int] | None = None
    counts: list[int] | None = None
    starts: list[int] | None = None
    # Each query attends as a one-token call at its position would (a speculative verify pass:
    # ``model.attention.attend_apart``), rather than as one causal block.
    apart: bool = False
    # The sliding layers' (slots, first columns) of a decode step read in place, by ring size: made
    # once per step for all of them (ring_window).
    _ring_windows: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def ring_window(self, ring: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's slot and the ring column of its first key (``RingKeys``), for rings of ``ring``
        columns: its ``past`` positions then its new one."""
        if ring not in self._ring_windows:
            past = self.past.shape[1]
            slots = torch.tensor(self.slots, device=device)
            offsets = torch.tensor([(start - past) % ring for start in self.starts], device=device)
            self._ring_windows[ring] = (slots, offsets)
        return self._ring_windows[ring]

    @property
    def common_start(self) -> int | None:
        """The length before the call when the rows are a range of slots that all hold that many
        tokens and store every token of the call (a batch-1 decode step, always): the call's keys
        then go to the same columns of every row, written as slices, without index tensors."""
        # (A plain property, not cached_property: a compiled decode step traces it, and dynamo
        # cannot trace cached_property's lock.)
        starts = self.starts
        if self.row_slice is None or starts is None or self.written is not None or self.active is not None:
            return None
        first = starts[0]
        return first if all(start == first for start in starts) else None


def _write(buffer: torch.Tensor, step: CacheStep, cols: torch.Tensor, new: torch.Tensor, keep) -> None:
    """Store ``new`` (B, Hkv, T, D) at columns ``cols`` (B, T) of the rows' slots, where ``keep``."""
    new = new.transpose(1, 2)  # (B, T, Hkv, D)
    rows = step.rows[:, None].expand_as(cols)
    if step.active is not None:
        # Static decode over every slot: idle rows store what their column already holds.
        old = buffer[rows, :, cols]
        buffer[rows, :, cols] = torch.where(step.active[:, None, None, None], new, old)
    elif keep is None:
        buffer[rows, :, cols] = new
    else:
        buffer[rows[keep], :, cols[keep]] = new[keep]


def _read(buffer: torch.Tensor, step: CacheStep, columns) -> torch.Tensor:
    """The rows' slots of ``buffer`` at ``columns`` (a slice, or (B, P) indices): (B, Hkv, *, D)."""
    if isinstance(columns, slice):
        if step.row_slice is not None:
            return buffer[step.row_slice, :, columns]
        return buffer[step.rows, :, columns]
    return buffer[step.rows[:, None], :, columns].transpose(1, 2)


class FullLayerCache:
    """Every position of each slot's sequence, in column order."""

    def __init__(self, slots: int, heads: int, columns: int, head_dim: int, dtype: torch.dtype, device):
        shape = (slots, heads, columns, head_dim)
        self.keys = torch.zeros(shape, dtype=dtype, device=device)
        self.values = torch.zeros(shape, dtype=dtype, device=device)

    def grow(self, columns: int) -> None:
        """Hold ``columns`` columns, keeping what is stored (new columns are zero: attention reads
        them masked, and masked values must be finite)."""
        old = self.keys.shape[2]
        for name in ("keys", "values"):
            buffer = getattr(self, name)
            grown = buffer.new_zeros((*buffer.shape[:2], columns, buffer.shape[3]))
            grown[:, :, :old] = buffer
            setattr(self, name, grown)

    def update(
        self, key: torch.Tensor, value: torch.Tensor, step: CacheStep, in_place: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store this call's keys/values, then return columns ``[0, full_span)`` of the rows' slots
        (views where the rows are a range: ``in_place`` changes nothing here)."""
        span = slice(0, step.full_span)
        start = step.common_start
        if start is not None:
            rows, columns = step.row_slice, slice(start, start + key.shape[2])
            self.keys[rows, :, columns] = key
            self.values[rows, :, columns] = value
            return self.keys[rows, :, span], self.values[rows, :, span]
        cols = step.positions.clamp(max=self.keys.shape[2] - 1)
        _write(self.keys, step, cols, key, step.written)
        _write(self.values, step, cols, value, step.written)
        return _read(self.keys, step, span), _read(self.values, step, span)


@dataclass
class RingKeys:
    """The keys (or values) of a decode step's rows where they lie in a ring buffer, not copied:
    row ``b`` reads sequence ``slots[b]`` at columns ``(offsets[b] + j) % ring``, j = 0..length-1
    (its ``length - 1`` past positions in order, then its new token). Attention backends that read
    rings in place take it as it is (``reads_rings``); ``gather`` gives the (B, Hkv, length, D)
    tensor the others take. A ring as long as the cache may be shorter than ``length``: the first
    ``unheld`` keys are then positions before 0, never visible, and readers skip them."""

    buffer: torch.Tensor  # (slots, Hkv, ring, D)
    slots: torch.Tensor  # (B,) int64
    offsets: torch.Tensor  # (B,) int64
    length: int

    @property
    def unheld(self) -> int:
        return max(0, self.length - self.buffer.shape[2])

    def gather(self) -> torch.Tensor:
        columns = (
            self.offsets[:, None] + torch.arange(self.length, device=self.offsets.device)
        ) % self.buffer.shape[2]
        return self.buffer[self.slots[:, None], :, columns].transpose(1, 2)


class SlidingLayerCache:
    """A ring buffer: column ``p % ring`` holds position ``p`` (see the ring rule above)."""

    def __init__(self, slots: int, heads: int, ring: int, head_dim: int, dtype: torch.dtype, device):
        self.ring = ring
        shape = (slots, heads, ring, head_dim)
        self.keys = torch.zeros(shape, dtype=dtype, device=device)
        self.values = torch.zeros(shape, dtype=dtype, device=device)

    def update(
        self, key: torch.Tensor, value: torch.Tensor, step: CacheStep, in_place: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor] | tuple[RingKeys, RingKeys]:
        """The ``P`` keys before the call (read first), then this call's own: (B, Hkv, P + T, D).
        ``in_place``: a decode step's keys and values as ``RingKeys`` where the ring can hold them
        all (the new ones written first)."""
        if in_place and self._in_place(key, step):
            start = step.common_start
            if start is None:
                self._store(key, value, step)
            else:  # every row's key to the same column: slices, no index tensors
                column = slice(start % self.ring, start % self.ring + 1)
                self.keys[step.row_slice, :, column] = key
                self.values[step.row_slice, :, column] = value
            slots, offsets = step.ring_window(self.ring, self.keys.device)
            length = step.past.shape[1] + 1
            return RingKeys(self.keys, slots, offsets, length), RingKeys(self.values, slots, offsets, length)
        if step.row_slice is not None and step.starts is not None and len(set(step.starts)) == 1:
            # Every row's past starts at the same ring column: the ring read as (at most) two
            # slices, in position order, copied with this call's keys in one cat (no gather).
            past = step.past.shape[1]
            first = (step.starts[0] - past) % self.ring
            spans = [(first, min(first + past, self.ring)), (0, max(first + past - self.ring, 0))]
            rows = step.row_slice
            keys = [self.keys[rows, :, a:b] for a, b in spans if b > a] + [key]
            values = [self.values[rows, :, a:b] for a, b in spans if b > a] + [value]
            if len(keys) > 1:  # (no past: this call's own keys as they are, not a copy)
                keys, values = torch.cat(keys, dim=2), torch.cat(values, dim=2)
            else:
                keys, values = key, value
            start, length = step.common_start, key.shape[2]
            if start is not None and length <= self.ring:
                # Every token stored, at (at most) two slices of ring columns.
                column = start % self.ring
                head = min(length, self.ring - column)
                for buffer, new in ((self.keys, key), (self.values, value)):
                    buffer[rows, :, column : column + head] = new[:, :, :head]
                    if head < length:
                        buffer[rows, :, : length - head] = new[:, :, head:]
            else:
                self._store(key, value, step)
            return keys, values
        columns = step.past % self.ring
        past_keys, past_values = _read(self.keys, step, columns), _read(self.values, step, columns)
        self._store(key, value, step)
        return torch.cat((past_keys, key), dim=2), torch.cat((past_values, value), dim=2)

    def _in_place(self, key: torch.Tensor, step: CacheStep) -> bool:
        """A decode step (one token per row, every row storing it, host-side starts known) whose
        rows' keys fit the ring beside the new key: the whole window, or, in a ring as long as the
        cache (shorter than the window), every position from 0 (``RingKeys.unheld``). Not a verify
        pass's (``apart``): ``attend_apart`` slices its keys, even for one query per row."""
        return (
            key.shape[2] == 1
            and not step.apart
            and step.active is None
            and step.written is None
            and step.starts is not None
            and step.slots is not None
            and min(step.past.shape[1], max(step.starts)) + 1 <= self.ring
            and not torch.compiler.is_compiling()
        )

    def _store(self, key: torch.Tensor, value: torch.Tensor, step: CacheStep) -> None:
        # Only each sequence's last `ring` positions need storing (a chunk may be longer than the ring).
        keep = step.positions >= step.ends - self.ring
        if step.written is not None:
            keep = keep & step.written
        if step.active is not None or (step.written is None and key.shape[2] <= self.ring):
            keep = None  # every token stays: no boolean selection (and no host sync)
        cols = step.positions % self.ring
        _write(self.keys, step, cols, key, keep)
        _write(self.values, step, cols, value, keep)


class KVCache:
    """The caches of ``num_slots`` sequences of up to ``max_len`` tokens each, for a text decoder.

    ``lengths[s]`` is the number of tokens slot ``s`` holds. Free a slot with ``free`` (it can be
    reused at once) and take back its last tokens with ``rollback``; ``reset`` frees every slot.
    With ``preallocate=False`` the full-attention buffers grow as sequences do (see the module
    docstring); ``reserve`` grows them ahead of time.
    """

    def __init__(
        self,
        config: TextConfig,
        num_slots: int,
        max_len: int,
        *,
        max_rollback: int = 0,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
        preallocate: bool = True,
        min_ring: int = 0,
    ):
        if num_slots <= 0 or max_len <= 0:
            raise ValueError(f"num_slots and max_len must be positive, got {num_slots} and {max_len}")
        if max_rollback < 0:
            raise ValueError(f"max_rollback must be >= 0, got {max_rollback}")
        self.num_slots = num_slots
        self.max_len = max_len
        self.max_rollback = max_rollback
        self.window = config.sliding_window
        self.ring = sliding_ring(config.sliding_window, max_len, max_rollback, min_ring)
        # The past a sliding layer reads: W - 1 keys (fewer if the whole sequence fits in less). A
        # wider ring (min_ring) holds more, and the calls read the same keys.
        self.past_len = min(config.sliding_window - 1, self.ring)
        # Columns the full-attention buffers hold now.
        self.capacity = max_len if preallocate else min(max_len, GROWTH_QUANTUM)
        self.layers: list[FullLayerCache | SlidingLayerCache | None] = []
        for spec in config.layers:
            if spec.kv_role == "reuse":
                self.layers.append(None)
            elif spec.is_sliding:
                self.layers.append(
                    SlidingLayerCache(num_slots, spec.num_kv_heads, self.ring, spec.head_dim, dtype, device)
                )
            else:
                self.layers.append(
                    FullLayerCache(num_slots, spec.num_kv_heads, self.capacity, spec.head_dim, dtype, device)
                )
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.lengths = [0] * num_slots
        # The longest each slot has been since it was freed: rollback may not go below
        # high_water - max_rollback, or the ring would have lost keys the next call needs.
        self._high_water = [0] * num_slots

    @property
    def batch_size(self) -> int:
        return self.num_slots

    @property
    def nbytes(self) -> int:
        """Bytes held by the key/value buffers."""
        return sum(c.keys.nbytes + c.values.nbytes for c in self.layers if c is not None)

    def reserve(self, tokens: int) -> None:
        """Make room for sequences of ``tokens`` tokens (at most ``max_len``) in every slot now."""
        tokens = min(tokens, self.max_len)
        if tokens <= self.capacity:
            return
        columns = max(tokens, 2 * self.capacity)
        columns = min(self.max_len, -(-columns // GROWTH_QUANTUM) * GROWTH_QUANTUM)
        for layer in self.layers:
            if isinstance(layer, FullLayerCache):
                layer.grow(columns)
        self.capacity = columns

    def reset(self) -> None:
        """Free every slot (the buffers are kept for reuse)."""
        for slot in range(self.num_slots):
            self.free(slot)

    def free(self, slot: int) -> None:
        """Forget slot ``slot``'s sequence; the next call on it starts a new one at position 0."""
        self._check_slot(slot)
        self.lengths[slot] = 0
        self._high_water[slot] = 0

    def rollback(self, slot: int, count: int) -> None:
        """Take back the last ``count`` tokens of slot ``slot`` (e.g. rejected draft tokens)."""
        self._check_slot(slot)
        length = self.lengths[slot]
        if not 0 <= count <= length:
            raise ValueError(f"slot {slot} holds {length} tokens; cannot take back {count}")
        floor = self._high_water[slot] - self.max_rollback
        if self.ring < self.max_len and length - count < floor:
            raise ValueError(
                f"slot {slot} can go back to {max(floor, 0)} tokens at most (it reached "
                f"{self._high_water[slot]}; the cache was made with max_rollback={self.max_rollback}), "
                f"not to {length - count}"
            )
        self.lengths[slot] = length - count

    def read(self, slot: int, start: int, end: int) -> list[tuple[torch.Tensor, torch.Tensor] | None]:
        """Copies of slot ``slot``'s keys and values at positions ``[start, end)``: per layer
        (Hkv, end - start, D) each, None for KV-shared layers. A sliding ring must still hold them."""
        self._check_slot(slot)
        length = self.lengths[slot]
        if not 0 <= start <= end <= length:
            raise ValueError(f"slot {slot} holds {length} tokens; cannot read positions [{start}, {end})")
        # The ring holds the last `ring` positions written, which after a rollback end past `length`.
        newest = max(self._high_water[slot], length)
        if start < newest - self.ring:
            raise ValueError(
                f"slot {slot}'s sliding layers hold its last {self.ring} positions written "
                f"({newest - self.ring} to {newest}); position {start} is gone"
            )
        columns = torch.arange(start, end, device=self.device) % self.ring
        out: list[tuple[torch.Tensor, torch.Tensor] | None] = []
        for layer in self.layers:
            if layer is None:
                out.append(None)
            elif isinstance(layer, SlidingLayerCache):
                # Advanced indexing copies: (Hkv, n, D), the positions in order.
                out.append((layer.keys[slot][:, columns], layer.values[slot][:, columns]))
            else:
                out.append((layer.keys[slot, :, start:end].clone(), layer.values[slot, :, start:end].clone()))
        return out

    def layer_keys(self, slot: int, layer: int, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``layer``'s keys and values of slot ``slot`` at positions ``[start, end)``, (1, Hkv,
        n, D) each, uncopied where they can be: a view of a full layer's buffer, a sliding ring's
        columns in position order (one slice, or two joined). A ring holds the positions from its
        slot's longest length less ``ring`` on: a rollback does not bring back what later tokens
        overwrote. (The MTP drafter reads the target's last layers so, once per drafting round.)"""
        self._check_slot(slot)
        cache = self.layers[layer]
        if cache is None:
            raise ValueError(f"layer {layer} is KV-shared: it holds no keys of its own")
        if not 0 <= start <= end <= self.lengths[slot]:
            raise ValueError(
                f"slot {slot} holds {self.lengths[slot]} tokens; cannot read positions [{start}, {end})"
            )
        if isinstance(cache, FullLayerCache):
            rows = slice(slot, slot + 1)
            return cache.keys[rows, :, start:end], cache.values[rows, :, start:end]
        oldest = self._high_water[slot] - cache.ring
        if start < oldest:
            raise ValueError(
                f"slot {slot}'s sliding layers hold positions {oldest} on (a ring of {cache.ring}); "
                f"position {start} is gone: make the cache with a larger min_ring"
            )
        first = start % cache.ring
        spans = [(first, min(first + end - start, cache.ring)), (0, max(first + end - start - cache.ring, 0))]
        parts = [
            (cache.keys[slot : slot + 1, :, a:b], cache.values[slot : slot + 1, :, a:b]) for a, b in spans
        ]
        if spans[1][1] == 0:
            return parts[0]
        return torch.cat([parts[0][0], parts[1][0]], dim=2), torch.cat([parts[0][1], parts[1][1]], dim=2)

    def load_prefix(
        self, slot: int, layers: Sequence[tuple[torch.Tensor, torch.Tensor] | None], length: int
    ) -> None:
        """Make free slot ``slot`` hold a sequence's first ``length`` positions, from their keys and
        values per layer (``read``'s layout): full layers need all ``length`` positions, sliding
        layers their last ``min(length, ring)`` at least (given as the last positions of theirs)."""
        self._check_slot(slot)
        if self.lengths[slot]:
            raise ValueError(
                f"slot {slot} holds {self.lengths[slot]} tokens: free it before loading a prefix"
            )
        if not 0 < length <= self.max_len:
            raise ValueError(f"a prefix of {length} tokens does not fit slots of {self.max_len}")
        if len(layers) != len(self.layers):
            raise ValueError(f"{len(layers)} layers given for a cache of {len(self.layers)}")
        self.reserve(length)
        kept = min(length, self.ring)
        columns = torch.arange(length - kept, length, device=self.device) % self.ring
        for index, (layer, given) in enumerate(zip(self.layers, layers)):
            if layer is None:
                continue
            keys, values = given
            have = keys.shape[1]
            if isinstance(layer, SlidingLayerCache):
                if have < kept:
                    raise ValueError(f"layer {index} needs the last {kept} positions, got {have}")
                # As the ring rule has them: position p in column p % ring.
                layer.keys[slot][:, columns] = keys[:, have - kept :]
                layer.values[slot][:, columns] = values[:, have - kept :]
            else:
                if have != length:
                    raise ValueError(f"layer {index} (full attention) needs {length} positions, got {have}")
                layer.keys[slot, :, :length] = keys
                layer.values[slot, :, :length] = values
        self.lengths[slot] = length
        self._high_water[slot] = length

    def advance(self, slots: Sequence[int], counts: Sequence[int] | int = 1) -> None:
        """Record that ``counts`` tokens were appended to each of ``slots`` (``decode_step`` callers)."""
        counts = [counts] * len(slots) if isinstance(counts, int) else counts
        for slot, count in zip(slots, counts):
            self.lengths[slot] += count
            self._high_water[slot] = max(self._high_water[slot], self.lengths[slot])

    # ── steps ────────────────────────────────────────────────────────────────────────────────

    def step(
        self, slots: Sequence[int], length: int, valid: torch.Tensor | None = None, apart: bool = False
    ) -> CacheStep:
        """A call of ``length`` tokens per row, row ``b`` appending to slot ``slots[b]``.

        ``valid`` (B, T) marks real tokens (None: all); padding is neither stored nor counted.
        ``apart``: see ``CacheStep.apart``.
        """
        slots = [int(s) for s in slots]
        for slot in slots:
            self._check_slot(slot)
        if valid is not None:
            valid = valid.to(device=self.device, dtype=torch.bool)  # an int or float mask: nonzero is real
        if len(set(slots)) != len(slots):
            raise ValueError(f"a call cannot append to one slot twice: slots {slots}")
        counts = [length] * len(slots) if valid is None else valid.sum(-1).tolist()
        starts = [self.lengths[s] for s in slots]
        for slot, start, count in zip(slots, starts, counts):
            if start + count > self.max_len:
                raise ValueError(
                    f"cache holds {self.max_len} tokens; {start} are used in slot {slot} and this call "
                    f"adds {count}"
                )
        self.reserve(max(start + count for start, count in zip(starts, counts)))
        device = self.device
        start = torch.tensor(starts, device=device)[:, None]
        if valid is None:
            positions = start + torch.arange(length, device=device)
        else:
            # Padding takes the position of the token before it (any stored column would do).
            positions = (start + valid.long().cumsum(-1) - 1).clamp(min=0)
        ends = [s + c for s, c in zip(starts, counts)]
        first = slots[0]
        contiguous = slots == list(range(first, first + len(slots)))
        return CacheStep(
            rows=torch.tensor(slots, device=device),
            row_slice=slice(first, first + len(slots)) if contiguous else None,
            positions=positions,
            written=None if valid is None else valid.to(device=device, dtype=torch.bool),
            ends=torch.tensor(ends, device=device)[:, None],
            # Rows with no tokens at all read one (masked) column rather than none.
            full_span=max(max(ends), 1),
            past=start - self.past_len + torch.arange(self.past_len, device=device),
            slots=slots,
            counts=counts,
            starts=starts,
            apart=apart,
        )

    def decode_step(self, positions: torch.Tensor, active: torch.Tensor) -> CacheStep:
        """One token for every slot, from tensors alone (static shapes, no host sync).

        ``positions`` (S,): each slot's length (where its token goes); ``active`` (S,) bool: slots
        that really decode. Idle slots compute on whatever they are fed and change nothing. The
        caller records the new lengths with ``advance``. The buffers must be at full size (a
        compiled step cannot grow them): call ``reserve(max_len)`` first.
        """
        if self.capacity != self.max_len:
            raise RuntimeError(
                "decode_step needs the whole cache allocated: call cache.reserve(cache.max_len) first"
            )
        positions = positions[:, None]
        return CacheStep(
            rows=torch.arange(self.num_slots, device=positions.device),
            row_slice=slice(0, self.num_slots),
            positions=positions,
            written=None,
            ends=positions + 1,
            full_span=self.max_len,
            past=positions - self.past_len + torch.arange(self.past_len, device=positions.device),
            active=active,
        )

    def commit(self, step: CacheStep) -> None:
        """Record the tokens a ``step`` call stored."""
        self.advance(step.slots, step.counts)

    def _check_slot(self, slot: int) -> None:
        if not 0 <= slot < self.num_slots:
            raise ValueError(f"slot {slot} does not exist: the cache has slots 0..{self.num_slots - 1}")


def sliding_ring(window: int, max_len: int, max_rollback: int, min_ring: int = 0) -> int:
    """Columns a sliding layer keeps: the W - 1 keys the next call reads and the column a decode
    step writes its own key to first (see the ring rule), plus the rollback slack (at least
    ``min_ring``, never more than ``max_len``)."""
    return max(1, min(max_len, max(window + max_rollback, min_ring)))
