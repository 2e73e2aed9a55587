"""``torchgemma.load``: a checkpoint folder or hub id -> a ready ``Gemma`` module."""

from __future__ import annotations

import re
from contextlib import ExitStack
from pathlib import Path

import torch
from tqdm.auto import tqdm

from .config import ModelConfig
from .model import Gemma
from .weights import CheckpointError, load_into, read_safetensors, safetensors_files

# What a model download needs from a hub repository.
HUB_PATTERNS = ["*.json", "*.safetensors", "*.jinja", "tokenizer*"]
HUB_ID = re.compile(r"^[\w.-]+/[\w.-]+$")
DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
}
# Below this size a progress bar is noise.
PROGRESS_MIN_BYTES = 256 * 2**20


def resolve_dtype(dtype: torch.dtype | str | None) -> torch.dtype | None:
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    key = str(dtype).removeprefix("torch.")
    if key not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; use one of {', '.join(sorted(DTYPES))}")
    return DTYPES[key]


def resolve_source(source: str | Path) -> Path:
    """A local checkpoint folder for ``source``: the folder itself, or a hub snapshot."""
    path = Path(source).expanduser()
    if path.exists():
        if not path.is_dir():
            raise CheckpointError(f"{path} is a file; pass the checkpoint folder (with config.json)")
        return path
    if isinstance(source, str) and HUB_ID.match(source):
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(source, allow_patterns=HUB_PATTERNS))
    raise FileNotFoundError(f"{source} is neither a local folder nor a hub repository id (owner/name)")


def load(
    source: str | Path,
    *,
    dtype: torch.dtype | str | None = None,
    device: torch.device | str | None = None,
) -> Gemma:
    """Load a Gemma 4 checkpoint from a local folder or a hub repository id.

    ``dtype`` defaults to the checkpoint's own (``config.json``'s ``dtype``, else the tensors'),
    ``device`` to the CPU. Tensors are read memory-mapped one at a time into the built model, so
    memory peaks at the model plus its largest tensor. The model is returned in eval mode.
    """
    folder = resolve_source(source)
    config = ModelConfig.from_file(folder)
    files = safetensors_files(folder)
    device = torch.device(device or "cpu")

    with ExitStack() as stack:
        tensors = list(read_safetensors(files, stack))
        target_dtype = resolve_dtype(dtype) or _checkpoint_dtype(config, tensors)
        with torch.device("meta"):
            model = Gemma(config)
        # Allocate once, directly in the target dtype and device; loading fills it in place.
        model = model.to(dtype=target_dtype).to_empty(device=device)
        total = sum(_nbytes(shape, dt) for _, _, shape, dt in tensors)
        with tqdm(
            total=total,
            unit="B",
            unit_scale=True,
            desc=f"loading {folder.name}",
            disable=total < PROGRESS_MIN_BYTES,
        ) as bar:
            load_into(model, config, iter(tensors), bar.update)
    return model.eval()


def _checkpoint_dtype(config: ModelConfig, tensors) -> torch.dtype:
    if config.dtype is not None:
        return resolve_dtype(config.dtype)
    for _, _, _, dt in tensors:
        if dt in _SAFETENSORS_FLOATS:
            return _SAFETENSORS_FLOATS[dt]
    return torch.float32


_SAFETENSORS_FLOATS = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}
_SAFETENSORS_ITEMSIZE = {
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


def _nbytes(shape: tuple[int, ...], dtype: str) -> int:
    n = 1
    for d in shape:
        n *= d
    return n * _SAFETENSORS_ITEMSIZE.get(dtype, 2)
