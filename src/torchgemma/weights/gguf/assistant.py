"""llama.cpp's ``gemma4-assistant`` GGUF files as an MTP drafter checkpoint (``read_assistant_gguf``).

llama.cpp's converter (``Gemma4AssistantModel``, registered for both ``Gemma4AssistantForCausalLM``
and ``Gemma4UnifiedAssistantForCausalLM``) writes a drafter as a Gemma 4 decoder whose every layer is
KV-shared, with the target's width as ``embedding_length_out`` and the two projections as
``nextn.pre_projection`` / ``nextn.post_projection``. It leaves out the E2B/E4B centroid head
(``masked_embedding.*``: llama.cpp's ``gemma4-assistant`` graph scores the whole vocabulary), so a
drafter read from GGUF has the plain tied head, as llama.cpp runs it. A file that carries the
centroid tensors anyway has them skipped, each named with the reason (no metadata key states how
many clusters to score).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import torch

from ...config.assistant import AssistantConfig
from ..source import CheckpointError
from .blocks import SUPPORTED_TYPES, NonFiniteWeights, dequantize
from .metadata import (
    _common,
    _gemma4_eos,
    _gemma4_kv_heads,
    _layer_types,
    _Meta,
    _partial_rotary_factor,
    _swa_layers,
    gemma4_rope,
)
from .names import _GEMMA4_LAYER_NAMES
from .reader import GGUFError, _GGUFFile, _TensorInfo

ARCH = "gemma4-assistant"

# GGUF name -> the drafter's checkpoint name (gguf.constants: TOKEN_EMBD, OUTPUT_NORM, NEXTN_PROJ_*).
_GLOBALS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    "nextn.pre_projection.weight": "pre_projection.weight",
    "nextn.post_projection.weight": "post_projection.weight",
}
# In the file but not checkpoint tensors of the drafter built from it.
_SKIPPED = {
    "rope_freqs.weight": "llama.cpp's RoPE frequency factors, read into rope_parameters",
    "masked_embd_centroids.weight": "the centroid head, which llama.cpp's gemma4-assistant graph does not run",
    "masked_embd_ordering": "the centroid head, which llama.cpp's gemma4-assistant graph does not run",
    "masked_embd_ordering.weight": "the centroid head, which llama.cpp's gemma4-assistant graph does not run",
}
_BLOCK = re.compile(r"blk\.(\d{1,9})\.(.+)")


def read_assistant_gguf(path: Path, dtype: torch.dtype) -> tuple[AssistantConfig, list[tuple], list[str]]:
    """The drafter's config, its tensors as ``(name, load, shape, "")`` (each ``load()`` dequantizes
    one tensor into ``dtype``), and the GGUF tensors skipped, each with the reason."""
    file = _GGUFFile(Path(path))
    arch = file.metadata.get("general.architecture")
    if arch != ARCH:
        raise GGUFError(f"{file.name} has architecture {arch!r}; an MTP drafter's GGUF file is {ARCH!r}")
    file.check_tensors()  # types, sizes, alignment, bounds, and no shared bytes
    config = AssistantConfig.from_hf(_config(file))
    layers = config.text.num_hidden_layers
    tensors, skipped, unknown = [], [], []
    for name, info in file.tensors.items():  # file order
        if name in _SKIPPED:
            skipped.append(f"{name}: {_SKIPPED[name]}")
            continue
        hf = _GLOBALS.get(name)
        match = _BLOCK.fullmatch(name)
        if hf is None and match and int(match.group(1)) < layers and match.group(2) in _GEMMA4_LAYER_NAMES:
            hf = f"model.layers.{match.group(1)}.{_GEMMA4_LAYER_NAMES[match.group(2)]}"
        if hf is None:
            unknown.append(name)
            continue
        if info.qtype not in SUPPORTED_TYPES:
            raise GGUFError(
                f"{file.name}: tensor {name} is stored as {info.type_name}, which cannot be dequantized"
            )
        tensors.append((hf, _loader(file, info, hf, dtype), info.shape, ""))
    if unknown:
        raise CheckpointError(
            f"{file.name}: {len(unknown)} tensor(s) with no place in an MTP drafter, e.g. {', '.join(unknown[:5])}"
        )
    return config, tensors, skipped


def _loader(file: _GGUFFile, info: _TensorInfo, hf_name: str, dtype: torch.dtype):
    def load() -> torch.Tensor:
        try:
            tensor = dequantize(file.raw(info), info.qtype, info.shape, dtype, finite=True)
        except NonFiniteWeights as err:
            raise GGUFError(f"{file.name}: tensor {info.name} ({hf_name}) holds {err}") from None
        file.release(info)
        return tensor

    return load


def _config(file: _GGUFFile) -> dict[str, Any]:
    """The drafter's config.json dict from the file's ``gemma4-assistant.*`` keys (those
    ``Gemma4Model.set_gguf_parameters`` and ``Gemma4AssistantModel`` write)."""
    meta = _Meta(file.metadata, ARCH, file.name)
    text = _common(meta, file.tensors, "gemma4_text", "Gemma4TextModel")
    n_layers, heads = text["num_hidden_layers"], text["num_attention_heads"]
    if not isinstance(meta.get("attention.sliding_window_pattern"), list):
        raise GGUFError(f"{file.name} lacks {ARCH}.attention.sliding_window_pattern (one bool per layer)")
    swa = _swa_layers(meta, n_layers, 0)
    global_head_dim = meta.need("attention.key_length")
    num_kv, global_kv = _gemma4_kv_heads(meta, swa, heads)
    width = meta.uniform("feed_forward_length", required=True)
    text.update(
        intermediate_size=width,
        num_key_value_heads=num_kv,
        head_dim=meta.get("attention.key_length_swa", global_head_dim),
        global_head_dim=global_head_dim,
        # A global KV-head count of its own is how HF's config says the full layers read K=V keys.
        attention_k_eq_v=global_kv is not None and global_kv != num_kv,
        num_global_key_value_heads=global_kv,
        max_position_embeddings=meta.get("context_length", 131072),
        sliding_window=meta.need("attention.sliding_window"),
        layer_types=_layer_types(swa),
        rope_parameters=gemma4_rope(meta, _partial_rotary_factor(file, global_head_dim)),
        final_logit_softcapping=meta.get("final_logit_softcapping"),
        hidden_size_per_layer_input=0,
        vocab_size_per_layer_input=0,
        num_kv_shared_layers=n_layers,
    )
    text["eos_token_id"] = _gemma4_eos(file.metadata, text["eos_token_id"])
    return {
        "model_type": "gemma4_assistant",
        "text_config": text,
        "backbone_hidden_size": meta.need("embedding_length_out"),
        "use_ordered_embeddings": False,
        "tie_word_embeddings": text["tie_word_embeddings"],
    }
