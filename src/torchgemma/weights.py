"""Checkpoint tensors -> model parameters: read safetensors, sanitize names, load strictly.

Loading is the identity on names except for the few exceptions in ``sanitize``, each one line with
its reason. Anything missing, unexpected or mis-shaped is an error that names the tensor.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from .config import ModelConfig

SHARED_KV_PARAMS = ("k_proj", "v_proj", "k_norm", "v_norm")


class CheckpointError(ValueError):
    """A checkpoint that does not match its config or cannot be read."""


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
