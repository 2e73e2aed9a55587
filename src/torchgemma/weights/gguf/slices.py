"""A GGUF tensor's stored blocks read a few rows at a time: all of them, or one rank's piece of the
tensor (tensor parallelism), reading only that piece's bytes.

A tensor of shape (..., K) is stored as rows of K values (its leading dimensions flattened), each
row ``K / block`` blocks of ``type_size`` bytes. A rank's piece (``distributed.ShardPlan.slices``:
``(dim, first, end)`` ranges along one dimension, concatenated) is either

* rows (split along a leading dimension: q/k/v, gate/up, the token table; an expert stack's rows or
  whole experts): whole rows of blocks, read as they are; or
* columns (split along K: o_proj, down_proj): in every row, the blocks that hold columns
  ``[first, end)``, read whole and cut back to ``[first, end)`` once decoded. A block type's values
  come out of a 256-wide super-block (Q4_K, Q6_K) in groups of 32 or 16 with their own scale
  (``blocks.grouped_ints``), so a piece whose ends are whole groups keeps its blocks' integers.
"""

from __future__ import annotations

import math

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from .reader import GGUFError

Pieces = list[tuple[int, int, int]]


def piece_rows(shape: tuple[int, ...], pieces: Pieces) -> tuple[np.ndarray | None, int, int, tuple[int, ...]]:
    """(rows, first column, end column, the piece's shape) of ``pieces`` of a tensor of ``shape``:
    the row indices in the (rows, K) view, in the piece's order (None: every row), and its columns."""
    dims = {dim for dim, _, _ in pieces}
    if len(dims) != 1:
        raise GGUFError(f"a tensor piece is cut along one dimension, got pieces {pieces}")
    (dim,) = dims
    local = list(shape)
    local[dim] = sum(end - first for _, first, end in pieces)
    if any(not 0 <= first < end <= shape[dim] for _, first, end in pieces):
        raise GGUFError(f"pieces {pieces} lie outside a tensor of shape {list(shape)}")
    if dim == len(shape) - 1:
        if len(pieces) != 1:
            raise GGUFError(f"a tensor's columns are read as one range, got pieces {pieces}")
        return None, pieces[0][1], pieces[0][2], tuple(local)
    grid = np.arange(math.prod(shape[:-1]), dtype=np.int64).reshape(shape[:-1])
    rows = np.concatenate([grid.take(np.arange(first, end), axis=dim) for _, first, end in pieces], axis=dim)
    return rows.reshape(-1), 0, shape[-1], tuple(local)


class BlockRows:
    """The blocks of a tensor's rows (``pieces``: of a piece of it), handed out a few rows at a time.

    ``take(start, stop)``: rows ``[start, stop)`` of the piece, ``(n * blocks per row, type_size)``
    bytes (a view of the file where the piece is whole rows in file order, else a copy of just
    those bytes); ``cut(values)``: decoded ``(n, values per row read)`` values cut to the piece's
    columns; ``span``: the file bytes a range of rows lies in (to release once read)."""

    def __init__(self, data: np.ndarray, qtype: GGMLQuantizationType, shape: tuple[int, ...], pieces=None):
        block, self.type_size = GGML_QUANT_SIZES[qtype]
        total, cols = math.prod(shape[:-1]), shape[-1]
        raw = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
        if cols % block or raw.size != total * (cols // block) * self.type_size:
            raise GGUFError(
                f"{raw.size} bytes of {qtype.name} data do not hold a tensor of shape {list(shape)}"
            )
        self.blocks_per_row = cols // block
        self.raw = raw.reshape(total, self.blocks_per_row * self.type_size)
        if pieces is None:
            self.rows, first, end, self.shape = None, 0, cols, tuple(shape)
        else:
            self.rows, first, end, self.shape = piece_rows(tuple(shape), pieces)
        self.first, self.end = first, end
        self.n_rows = total if self.rows is None else len(self.rows)
        self.b0, self.b1 = first // block, -(-end // block)  # the blocks holding the columns
        self.lead, self.width = first - self.b0 * block, end - first  # the columns within them
        self.values = (self.b1 - self.b0) * block  # values per row read
        self.is_cut = self.lead != 0 or self.width != self.values
        self.row_bytes = (self.b1 - self.b0) * self.type_size  # bytes per row read

    def take(self, start: int, stop: int) -> np.ndarray:
        columns = slice(self.b0 * self.type_size, self.b1 * self.type_size)
        part = (
            self.raw[start:stop, columns] if self.rows is None else self.raw[self.rows[start:stop], columns]
        )
        return np.ascontiguousarray(part).reshape(-1, self.type_size)

    def cut(self, values: np.ndarray, per_value: float = 1.0) -> np.ndarray:
        """(n, values read * per_value) -> the piece's columns (``per_value``: array columns per
        value, 1/2 for packed 4-bit integers, 1/group for scales)."""
        if not self.is_cut:
            return values
        return values[:, round(self.lead * per_value) : round((self.lead + self.width) * per_value)]

    def span(self, start: int, stop: int) -> tuple[int, int]:
        """The tensor's bytes ``[begin, end)`` that rows ``[start, stop)`` of the piece lie within."""
        if self.rows is None:
            first, last = start, stop - 1
        else:
            taken = self.rows[start:stop]
            first, last = int(taken.min()), int(taken.max())
        length = self.raw.shape[1]
        return first * length, (last + 1) * length

    def block_index(self, start: int, index: int) -> int:
        """The tensor's block number of block ``index`` of ``take(start, ...)`` (error messages)."""
        per_row = self.b1 - self.b0
        row = start + index // per_row
        file_row = row if self.rows is None else int(self.rows[row])
        return file_row * self.blocks_per_row + self.b0 + index % per_row
