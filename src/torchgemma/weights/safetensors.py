"""Safetensors checkpoints: the files of a folder (single or sharded), read memory-mapped.

Pickled checkpoints (``.bin``, ``.pt``) are never opened: a folder with only those is an error that
says so.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from .source import CheckpointError

TensorSource = Iterator[tuple[str, Callable[[], torch.Tensor], tuple[int, ...], str]]


def safetensors_files(folder: Path) -> list[Path]:
    """The checkpoint's safetensors files: ``model.safetensors`` or the shards of its index."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as err:
            raise CheckpointError(f"{index} is not a valid safetensors index: {err}") from err
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


def read_safetensors(files: list[Path], stack: ExitStack) -> TensorSource:
    """Yield (name, load, shape, dtype) for every tensor, memory-mapped, loading on demand."""
    for path in files:
        try:
            handle = stack.enter_context(safe_open(str(path), framework="pt", device="cpu"))
            keys = list(handle.keys())
        except (SafetensorError, OSError) as err:
            raise CheckpointError(
                f"cannot read {path}: {err} (is the file truncated or not safetensors?)"
            ) from err
        for key in keys:
            view = handle.get_slice(key)
            yield key, _loader(handle, key, path), tuple(view.get_shape()), view.get_dtype()


def _loader(handle, key: str, path: Path) -> Callable[[], torch.Tensor]:
    def load() -> torch.Tensor:
        try:
            return handle.get_tensor(key)
        except (SafetensorError, OSError, RuntimeError) as err:
            raise CheckpointError(f"cannot read tensor {key} from {path}: {err}") from err

    return load


# Safetensors dtype names of the float dtypes a model can be built in.
FLOAT_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}


ITEMSIZE = {
    "F64": 8,
    "F32": 4,
    "I64": 8,
    "I32": 4,
    "BF16": 2,
    "F16": 2,
    "I16": 2,
    "U8": 1,
    "I8": 1,
    "BOOL": 1,
}


def tensor_nbytes(shape: tuple[int, ...], dtype: str) -> int:
    """Bytes of a tensor of ``shape`` in safetensors dtype ``dtype`` (2 if unknown)."""
    n = 1
    for d in shape:
        n *= d
    return n * ITEMSIZE.get(dtype, 2)
