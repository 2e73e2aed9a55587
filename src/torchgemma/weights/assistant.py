"""Loading an MTP drafter checkpoint (``gemma4_assistant``, ``gemma4_unified_assistant``): a folder,
a hub repository id or a GGUF file, strictly, as ``torchgemma.load`` loads a model (every missing,
unexpected or mis-shaped tensor is an error naming it, found before any memory is allocated).
"""

from __future__ import annotations

from contextlib import ExitStack
from pathlib import Path

import torch

from ..config.assistant import AssistantConfig
from ..model.assistant import Assistant
from ..model.attention import ATTENTION_BACKENDS
from .loading import checkpoint_dtype, fill, match_tensors, model_dtype
from .safetensors import read_safetensors, safetensors_files
from .source import CheckpointError, resolve_source


def load_assistant(
    source: str | Path,
    *,
    dtype: torch.dtype | str | None = None,
    device: torch.device | str | None = None,
    attention: str = "sdpa",
) -> Assistant:
    """The drafter at ``source`` (folder, hub id, or ``.gguf`` file), in ``dtype`` (default: the
    checkpoint's own) on ``device`` (default: the CPU), attending with ``attention``."""
    if attention not in ATTENTION_BACKENDS:
        raise ValueError(f"unknown attention {attention!r}; use one of {', '.join(ATTENTION_BACKENDS)}")
    requested = model_dtype(dtype)
    path = resolve_source(source)
    device = torch.device(device or "cpu")
    if path.suffix == ".gguf":
        from .gguf.assistant import read_assistant_gguf

        # GGUF blocks are dequantized into float32 unless another dtype is asked for.
        dtype = requested or torch.float32
        config, tensors, _ = read_assistant_gguf(path, dtype)
        return _build(config, tensors, dtype, device, attention, path)
    with ExitStack() as stack:  # the safetensors files stay mapped until the model is filled
        config = AssistantConfig.from_file(path)
        tensors = list(read_safetensors(safetensors_files(path), stack))
        dtype = requested or checkpoint_dtype(config, (dt for *_, dt in tensors))
        return _build(config, tensors, dtype, device, attention, path)


def _build(config: AssistantConfig, tensors: list[tuple], dtype, device, attention, path: Path) -> Assistant:
    """The drafter of ``config`` filled from ``tensors`` ((key, load, shape, dtype name) each)."""
    with torch.device("meta"):
        model = Assistant(config, attention).to(dtype=dtype)
    # Every missing, unexpected or mis-shaped tensor is found on the meta model, before allocating.
    loads = match_tensors(model, config, tensors)
    model = model._apply(lambda t: torch.empty(t.shape, dtype=t.dtype, device=device))
    fill(model, loads)
    if config.use_ordered_embeddings:
        ordering = model.masked_embedding.token_ordering
        vocab = config.text.vocab_size
        if int(ordering.min()) < 0 or int(ordering.max()) >= vocab:
            raise CheckpointError(
                f"{path}: masked_embedding.token_ordering holds ids outside the vocabulary [0, {vocab}) "
                f"(from {int(ordering.min())} to {int(ordering.max())})"
            )
    return model.eval()
