"""``torchgemma.load``: checkpoint tensors -> a ready ``Gemma`` module.

Loading is the identity on names except for the few exceptions in ``sanitize``, each one line with
its reason. Anything missing, unexpected or mis-shaped is an error that names the tensor. Tensors are
read one at a time (memory-mapped safetensors, or dequantized GGUF blocks) into a model allocated
once in the target dtype and device.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from contextlib import ExitStack
from functools import partial
from pathlib import Path

import torch
from torch import nn
from tqdm.auto import tqdm

from ..config import ConfigError, ModelConfig
from ..model import Gemma
from ..model.text import ATTENTION_BACKENDS
from .safetensors import FLOAT_DTYPES, TensorSource, read_safetensors, safetensors_files, tensor_nbytes
from .source import CheckpointError, resolve_source

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
        total = sum(tensor_nbytes(shape, dt) for _, _, shape, dt in tensors)
        with _progress(total, path.name) as bar:
            load_into(model, config, iter(tensors), bar.update)
    return model.eval()


def _load_gguf(path: Path, dtype: torch.dtype, device: torch.device, attention: str) -> Gemma:
    from .gguf import read_gguf

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
        if dt in FLOAT_DTYPES:
            return FLOAT_DTYPES[dt]
    return torch.float32


SHARED_KV_PARAMS = ("k_proj", "v_proj", "k_norm", "v_norm")


def sanitize(name: str, config: ModelConfig) -> str | None:
    """The module path a checkpoint tensor loads into, or None to skip it."""
    text = config.text
    if name.startswith("model.language_model."):  # gemma4 (multimodal) checkpoints
        name = "language_model." + name[len("model.language_model.") :]
    elif name.startswith("language_model.model."):  # gemma3 multimodal checkpoints, as published
        name = "language_model." + name[len("language_model.model.") :]
    elif name.startswith("model.") and config.model_type in ("gemma4_text", "gemma3_text"):  # *ForCausalLM
        name = "language_model." + name[len("model.") :]
    elif name.startswith("model."):  # gemma4 towers and embedders: model.vision_tower.*, ...
        name = name[len("model.") :]
    if config.model_type == "gemma3" and name.startswith(("vision_tower.", "multi_modal_projector.")):
        return None  # Gemma 3: only the text model is built
    if name == "lm_head.weight":
        # Tied to embed_tokens (some exports write the copy anyway); else the text model's own head.
        return None if text.tie_word_embeddings else "language_model.lm_head.weight"
    parts = name.split(".")
    if len(parts) > 4 and parts[:2] == ["language_model", "layers"] and parts[3] == "self_attn":
        layer = int(parts[2]) if parts[2].isdigit() else -1
        if (
            0 <= layer < text.num_hidden_layers
            and text.layers[layer].kv_role == "reuse"
            and parts[4] in SHARED_KV_PARAMS
        ):
            return None  # KV-shared layers reuse another layer's K/V: published files may carry unused k/v
    return name


def load_into(
    model: nn.Module, config: ModelConfig, source: TensorSource, progress: Callable[[int], None]
) -> None:
    """Copy every tensor of ``source`` into ``model``; every parameter and buffer must be covered once."""
    targets: dict[str, torch.Tensor] = dict(model.named_parameters())
    targets.update(model.named_buffers())
    persistent = set(model.state_dict().keys())
    targets = {k: v for k, v in targets.items() if k in persistent}

    loaded: dict[str, str] = {}
    unexpected: list[str] = []
    for key, load, shape, _ in source:
        name = sanitize(key, config)
        if name is None:
            continue
        target = targets.get(name)
        if target is None:
            unexpected.append(key)
            continue
        if name in loaded:
            raise CheckpointError(f"tensor {key} appears twice in the checkpoint (also as {loaded[name]})")
        if tuple(target.shape) != shape:
            raise CheckpointError(
                f"tensor {key} has shape {list(shape)} but the config implies {list(target.shape)} for {name}"
            )
        tensor = load()
        with torch.no_grad():
            target.copy_(tensor)
        loaded[name] = key
        progress(tensor.numel() * tensor.element_size())
        del tensor

    if unexpected:
        raise CheckpointError(
            f"{len(unexpected)} checkpoint tensor(s) have no place in the model built from config.json: "
            + ", ".join(unexpected[:8])
            + (" ..." if len(unexpected) > 8 else "")
        )
    missing = [name for name in targets if name not in loaded]
    if missing:
        raise CheckpointError(
            f"{len(missing)} model tensor(s) missing from the checkpoint: "
            + ", ".join(missing[:8])
            + (" ..." if len(missing) > 8 else "")
        )
