"""Safetensors checkpoints: the files of a folder (single or sharded), read memory-mapped.

Pickled checkpoints (``.bin``, ``.pt``) are never opened: a folder with only those is an error that
says so.
"""

from __future__ import annotations

import json
import math
import mmap
import struct
import warnings
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from pathlib import Path

import torch

from .source import CheckpointError

TensorSource = Iterator[tuple[str, Callable[[], torch.Tensor], tuple[int, ...], str]]


def safetensors_files(folder: Path) -> list[Path]:
    """The checkpoint's safetensors files: ``model.safetensors`` or the shards of its index."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = _weight_map(index)
        shards = list(dict.fromkeys(weight_map.values()))
        for shard in shards:
            if not (folder / shard).is_file():
                example = next(k for k, v in weight_map.items() if v == shard)
                raise CheckpointError(
                    f"shard {shard} listed in {index.name} is missing from {folder} (it holds e.g. {example})"
                )
        return [folder / shard for shard in shards]
    single = folder / "model.safetensors"
    if single.is_file():
        return [single]
    others = sorted(p.name for p in folder.glob("*.safetensors"))
    if others:
        # Loose files without an index: accept them, in name order.
        return [folder / name for name in others]
    pickles = sorted(p.name for p in folder.glob("*.bin")) + sorted(p.name for p in folder.glob("*.pt"))
    hint = (
        f" (found {', '.join(pickles)}: pickled checkpoints are never loaded; convert them to safetensors)"
        if pickles
        else ""
    )
    raise CheckpointError(f"no model.safetensors or model.safetensors.index.json in {folder}{hint}")


def _weight_map(index: Path) -> dict[str, str]:
    """An index's ``weight_map`` (tensor name -> shard file), each shard a plain path inside its folder."""
    try:
        data = json.loads(index.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise CheckpointError(f"{index} is not valid JSON: {err}") from err
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise CheckpointError(
            f"{index}: 'weight_map' must be a non-empty object of tensor name -> shard file"
        )
    for name, shard in weight_map.items():
        if not isinstance(shard, str) or not shard:
            raise CheckpointError(f"{index}: weight_map[{name!r}] must be a shard file name, got {shard!r}")
        # Shards sit beside the index: an absolute path or a '..' would read a file from elsewhere.
        if Path(shard).is_absolute() or ".." in Path(shard).parts:
            raise CheckpointError(
                f"{index}: weight_map[{name!r}] = {shard!r} points outside the checkpoint folder"
            )
    return weight_map


# safetensors' own limit on the JSON header (its MAX_HEADER_SIZE).
MAX_HEADER_BYTES = 100_000_000


def check_header(path: Path) -> tuple[dict, int]:
    """Check a safetensors file's header against the file itself, naming the file and the tensor.

    The format: an 8-byte little-endian header length, a JSON object ``{name: {"dtype", "shape",
    "data_offsets": [begin, end]}}``, then the data, offsets counted from its start. Returns the
    header and the byte where the data starts.
    """
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise CheckpointError(f"{path} is not a safetensors file: {size} bytes, too short for a header")
        (length,) = struct.unpack("<Q", head)
        if length > min(size - 8, MAX_HEADER_BYTES):
            raise CheckpointError(
                f"{path}: the header claims {length:,} bytes but the file has {size - 8:,} after its length "
                "field (truncated, or not a safetensors file?)"
            )
        raw = f.read(length)
    try:
        header = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise CheckpointError(
            f"{path}: the header is not valid JSON ({err}); is this a safetensors file?"
        ) from err
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: the header is a JSON {type(header).__name__}, not an object")
    data_bytes = size - 8 - length
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if not isinstance(info, dict):
            raise CheckpointError(f"{path}: tensor {name}: header entry is not an object")
        shape, offsets = info.get("shape"), info.get("data_offsets")
        if not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape):
            raise CheckpointError(f"{path}: tensor {name}: shape {shape!r} is not a list of sizes")
        if (
            not isinstance(offsets, list)
            or len(offsets) != 2
            or not all(isinstance(o, int) for o in offsets)
            or not 0 <= offsets[0] <= offsets[1] <= data_bytes
        ):
            raise CheckpointError(
                f"{path}: tensor {name}: data_offsets {offsets!r} lie outside the file's {data_bytes:,} bytes "
                "of tensor data (truncated?)"
            )
        itemsize = ITEMSIZE.get(info.get("dtype"))
        if itemsize is not None and offsets[1] - offsets[0] != math.prod(shape) * itemsize:
            raise CheckpointError(
                f"{path}: tensor {name}: {info['dtype']} {shape} needs {math.prod(shape) * itemsize:,} bytes "
                f"but data_offsets {offsets} span {offsets[1] - offsets[0]:,}"
            )
    return header, 8 + length


def read_safetensors(files: list[Path], stack: ExitStack) -> TensorSource:
    """Yield (name, load, shape, dtype) for every tensor, memory-mapped, loading on demand.

    ``load()`` returns a read-only view of the mapped file (copy it before the stack closes), and
    ``load.release()`` drops its pages from the process once it has been copied: loading then holds
    one tensor's pages at a time, not the whole file's, so quantizing while loading peaks near the
    quantized size.
    """
    for path in files:
        header, start = check_header(path)
        try:
            with open(path, "rb") as file:  # the mapping outlives the file descriptor
                mapped = stack.enter_context(mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ))
        except (OSError, ValueError) as err:
            raise CheckpointError(f"cannot map {path}: {err}") from err
        for key, info in header.items():
            if key == "__metadata__":
                continue
            dtype = TORCH_DTYPES.get(info["dtype"])
            if dtype is None:
                raise CheckpointError(
                    f"{path}: tensor {key} has dtype {info['dtype']}, which torch cannot hold"
                )
            begin, end = (start + offset for offset in info["data_offsets"])
            yield (
                key,
                _MappedTensor(mapped, begin, end, dtype, tuple(info["shape"])),
                tuple(info["shape"]),
                info["dtype"],
            )


class _MappedTensor:
    """One tensor of a mapped safetensors file: called, a view of its bytes; released, its pages dropped."""

    def __init__(self, mapped: mmap.mmap, begin: int, end: int, dtype: torch.dtype, shape: tuple[int, ...]):
        self.mapped, self.begin, self.end, self.dtype, self.shape = mapped, begin, end, dtype, shape

    def __call__(self) -> torch.Tensor:
        if self.end == self.begin:
            return torch.empty(self.shape, dtype=self.dtype)
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the mapping is read-only: the view is never written to
            if self.begin % itemsize:  # writers align tensors; a file that does not gets an aligned copy
                raw = torch.frombuffer(
                    self.mapped, dtype=torch.uint8, count=self.end - self.begin, offset=self.begin
                )
                return raw.clone().view(self.dtype).view(self.shape)
            flat = torch.frombuffer(
                self.mapped, dtype=self.dtype, count=math.prod(self.shape), offset=self.begin
            )
        return flat.view(self.shape)

    def release(self) -> None:
        if not hasattr(mmap, "MADV_DONTNEED") or self.end == self.begin:
            return
        first = self.begin - self.begin % mmap.PAGESIZE
        self.mapped.madvise(mmap.MADV_DONTNEED, first, self.end - first)


# Safetensors dtype names of the float dtypes a model can be built in.
FLOAT_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}
# Every safetensors dtype name torch holds.
TORCH_DTYPES = {
    **FLOAT_DTYPES,
    "F64": torch.float64,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "U16": torch.uint16,
    "U32": torch.uint32,
    "U64": torch.uint64,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}


ITEMSIZE = {
    "F64": 8,
    "F32": 4,
    "I64": 8,
    "U64": 8,
    "I32": 4,
    "U32": 4,
    "BF16": 2,
    "F16": 2,
    "I16": 2,
    "U16": 2,
    "U8": 1,
    "I8": 1,
    "BOOL": 1,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
}


def tensor_nbytes(shape: tuple[int, ...], dtype: str) -> int:
    """Bytes of a tensor of ``shape`` in safetensors dtype ``dtype`` (2 if unknown)."""
    n = 1
    for d in shape:
        n *= d
    return n * ITEMSIZE.get(dtype, 2)
