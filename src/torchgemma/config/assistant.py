"""Gemma 4's MTP drafters (``gemma4_assistant``, ``gemma4_unified_assistant``): a few decoder layers
that speculate the target's next tokens, read from their ``config.json``.

The drafter's ``text_config`` describes its decoder as any Gemma 4 text config does, less what it
cannot have (per-layer inputs, MoE, the double-wide MLP), and every layer shares keys and values:
it owns no k/v weights and no cache, and attends to the *target's* keys and values of its attention
type. Its top level says how wide the target is (``backbone_hidden_size``) and whether its head is
the centroid-masked one of E2B/E4B (``use_ordered_embeddings``).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .gemma4 import FAMILY as GEMMA4
from .gemma4_unified import FAMILY as GEMMA4_UNIFIED
from .hf import TEXT_DEFAULTS, config_from_file, text_config_from_hf
from .limits import positive_int
from .schema import ConfigError, TextConfig

# model_type -> the family its decoder's text config belongs to.
ASSISTANT_FAMILIES = {"gemma4_assistant": GEMMA4, "gemma4_unified_assistant": GEMMA4_UNIFIED}
ASSISTANT_MODEL_TYPES = tuple(ASSISTANT_FAMILIES)

# transformers' Gemma4AssistantConfig / Gemma4UnifiedAssistantConfig defaults.
ASSISTANT_DEFAULTS: dict[str, Any] = {
    "use_ordered_embeddings": False,
    "num_centroids": 2048,
    "centroid_intermediate_top_k": 32,
    "tie_word_embeddings": True,
}
BACKBONE_DEFAULTS = {"gemma4_assistant": 1536, "gemma4_unified_assistant": 3840}

# The layers' key/value source: not a layer of the drafter but the target's last layer of the same
# attention type (generation/mtp.py hands those keys to each layer under this index).
TARGET_KV_SOURCE = -1


@dataclass(frozen=True)
class AssistantConfig:
    """A drafter checkpoint: its decoder (every layer KV-shared with the target) and head."""

    model_type: str
    text: TextConfig
    # Hidden size of the target: the drafter reads its last hidden state and writes one back.
    backbone_hidden_size: int
    # E2B/E4B: logits only for the tokens of the top ``centroid_intermediate_top_k`` of
    # ``num_centroids`` token clusters (``masked_embedding``); the others are masked.
    use_ordered_embeddings: bool
    num_centroids: int
    centroid_intermediate_top_k: int
    dtype: str | None
    source: dict | None = dataclasses.field(default=None, repr=False, compare=False)

    @classmethod
    def from_file(cls, path: str | Path) -> AssistantConfig:
        return config_from_file(path, cls.from_hf)

    @classmethod
    def from_hf(cls, data: dict) -> AssistantConfig:
        """From the dict of a drafter's ``config.json``."""
        if not isinstance(data, dict):
            raise ConfigError(f"config must be a JSON object, got {type(data).__name__}")
        model_type = data.get("model_type")
        if model_type not in ASSISTANT_FAMILIES:
            raise ConfigError(
                f"model_type {model_type!r} is not an MTP drafter; drafters are "
                f"{', '.join(ASSISTANT_MODEL_TYPES)}"
            )
        text_data = data.get("text_config")
        if not isinstance(text_data, dict):
            raise ConfigError(f"model_type {model_type!r} needs a 'text_config' object")
        top = {**ASSISTANT_DEFAULTS, **{k: v for k, v in data.items() if v is not None}}
        text = _shared_decoder(dict(text_data), ASSISTANT_FAMILIES[model_type], top["tie_word_embeddings"])
        ordered = top["use_ordered_embeddings"]
        if not isinstance(ordered, bool):
            raise ConfigError(f"use_ordered_embeddings must be true or false, got {ordered!r}")
        centroids = positive_int(top, "num_centroids")
        top_k = positive_int(top, "centroid_intermediate_top_k")
        if ordered and text.vocab_size % centroids:
            raise ConfigError(
                f"num_centroids={centroids} must divide vocab_size={text.vocab_size} (each centroid "
                "holds vocab_size / num_centroids tokens)"
            )
        if ordered and top_k > centroids:
            raise ConfigError(f"centroid_intermediate_top_k={top_k} exceeds num_centroids={centroids}")
        backbone = {"backbone_hidden_size": data.get("backbone_hidden_size", BACKBONE_DEFAULTS[model_type])}
        return cls(
            model_type=model_type,
            text=text,
            backbone_hidden_size=positive_int(backbone, "backbone_hidden_size"),
            use_ordered_embeddings=ordered,
            num_centroids=centroids,
            centroid_intermediate_top_k=top_k,
            dtype=data.get("dtype") or data.get("torch_dtype") or text_data.get("dtype"),
            source=data,
        )

    def module_path(self, name: str) -> str | None:
        """The module path a checkpoint tensor loads into (the names are the modules'), or None."""
        if name == "lm_head.weight":
            # Tied to the drafter's embed_tokens (transformers' state dict lists the copy).
            return None if self.text.tie_word_embeddings else "model.lm_head.weight"
        return name


# What transformers' Gemma4AssistantConfig.validate_architecture refuses, with the value it needs
# (its text config's defaults, 256 and 262144 per-layer-input fields, are refused too). The unified
# text config has no per-layer inputs or MoE, and its assistant config no such check.
_REFUSED = {
    "hidden_size_per_layer_input": 0,
    "vocab_size_per_layer_input": 0,
    "enable_moe_block": False,
    "use_double_wide_mlp": False,
}


def _shared_decoder(text_data: dict, family, tie_word_embeddings: bool) -> TextConfig:
    """The drafter's decoder: its text config read as the family reads one, then every layer made
    KV-shared with the target (``TARGET_KV_SOURCE``)."""
    num_layers = positive_int(text_data, "num_hidden_layers", "text_config")
    if family is GEMMA4:
        for key, needed in _REFUSED.items():
            value = text_data.get(key, TEXT_DEFAULTS[key])
            if value != needed:
                raise ConfigError(
                    f"text_config: an MTP drafter needs {key}={json.dumps(needed)}, got {json.dumps(value)}"
                )
    shared = text_data.get("num_kv_shared_layers") or num_layers
    if shared != num_layers:
        raise ConfigError(
            f"text_config: every layer of an MTP drafter shares the target's keys and values "
            f"(num_kv_shared_layers={num_layers}), got num_kv_shared_layers={shared}"
        )
    # Read as a plain decoder, then given its KV roles: no layer of the drafter computes K/V, and
    # the double-wide MLP (allowed by the unified assistant) is on every KV-shared layer, so on all.
    plain = {**text_data, "num_kv_shared_layers": 0, "tie_word_embeddings": tie_word_embeddings}
    text = text_config_from_hf(plain, family)
    width = 2 if text.use_double_wide_mlp else 1
    layers = tuple(
        dataclasses.replace(
            spec,
            kv_role="reuse",
            kv_source=TARGET_KV_SOURCE,
            intermediate_size=spec.intermediate_size * width,
        )
        for spec in text.layers
    )
    return dataclasses.replace(text, layers=layers, num_kv_shared_layers=num_layers)
