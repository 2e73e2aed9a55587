"""Gemma 4 12B "unified" (``gemma4_unified``, ``gemma4_unified_text``), encoder-free: the gemma4
decoder without PLE or MoE; image patches and audio frames are projected straight into it
(model/unified.py) by the embedders its top level describes.
"""

from __future__ import annotations

from typing import Any

from .gemma4 import token_ids, tower_configs
from .limits import POSITIVE, check_numbers, positive_int
from .schema import ConfigError, Family, TextConfig, UnifiedAudioConfig, UnifiedVisionConfig

UNIFIED_MODEL_TYPES = ("gemma4_unified", "gemma4_unified_text")

# Where transformers' Gemma4UnifiedTextConfig defaults differ from Gemma4TextConfig's. It has no
# per-layer-input or MoE fields at all: those are off whatever the json says.
UNIFIED_TEXT_DEFAULTS: dict[str, Any] = {
    "sliding_window": 1024,
    "max_position_embeddings": 262_144,
    "use_bidirectional_attention": "vision",
    "final_logit_softcapping": None,
}
UNIFIED_TEXT_FORCED: dict[str, Any] = {"hidden_size_per_layer_input": 0, "enable_moe_block": False}

# transformers' Gemma4UnifiedVisionConfig / Gemma4UnifiedAudioConfig defaults.
UNIFIED_VISION_DEFAULTS: dict[str, Any] = {
    "patch_size": 16,
    "pooling_kernel_size": 3,
    "mm_embed_dim": 3840,
    "mm_posemb_size": 1120,
    "rms_norm_eps": 1e-6,
    "output_proj_dims": 3840,
}
UNIFIED_AUDIO_DEFAULTS: dict[str, Any] = {"audio_embed_dim": 640, "rms_norm_eps": 1e-6}


def text_fields(data: dict, num_layers: int) -> tuple[dict, dict[str, Any], dict[str, list]]:
    """Gemma4UnifiedTextConfig's defaults and absent fields; an image's tokens see each other both
    ways on every layer (vision_block_layers "all", as transformers' forward builds its masks)."""
    return {**UNIFIED_TEXT_DEFAULTS, **data, **UNIFIED_TEXT_FORCED}, {"vision_block_layers": "all"}, {}


def top_level(data: dict, text: TextConfig) -> tuple[TextConfig, dict[str, Any]]:
    """The image and audio embedders config.json describes (null: none) and the media token ids."""
    ids = token_ids(data)
    vision, audio = tower_configs(data)
    return text, {
        "token_ids": ids,
        "unified_vision": None if vision is None else _unified_vision_from_hf(vision),
        "unified_audio": None if audio is None else _unified_audio_from_hf(audio),
    }


def _unified_vision_from_hf(data: dict) -> UnifiedVisionConfig:
    v = {**UNIFIED_VISION_DEFAULTS, **{k: val for k, val in data.items() if val is not None}}
    check_numbers(v, {"rms_norm_eps": POSITIVE}, "vision_config")
    ints = {
        key: positive_int(v, key, "vision_config")
        for key in ("patch_size", "pooling_kernel_size", "mm_embed_dim", "mm_posemb_size", "output_proj_dims")
    }
    if ints["output_proj_dims"] != ints["mm_embed_dim"]:
        # transformers builds the projection from output_proj_dims and feeds it mm_embed_dim values.
        raise ConfigError(
            f"vision_config: output_proj_dims={ints['output_proj_dims']} must equal "
            f"mm_embed_dim={ints['mm_embed_dim']} (the embedder's output feeds the projection)"
        )
    return UnifiedVisionConfig(**ints, rms_norm_eps=float(v["rms_norm_eps"]))


def _unified_audio_from_hf(data: dict) -> UnifiedAudioConfig:
    a = {**UNIFIED_AUDIO_DEFAULTS, **{k: val for k, val in data.items() if val is not None}}
    check_numbers(a, {"rms_norm_eps": POSITIVE}, "audio_config")
    return UnifiedAudioConfig(
        audio_embed_dim=positive_int(a, "audio_embed_dim", "audio_config"),
        rms_norm_eps=float(a["rms_norm_eps"]),
    )


FAMILY = Family(
    name="gemma4_unified", top_level=top_level, text_fields=text_fields, takes_media=True, encoder_free=True
)
