"""Gemma 4 (``gemma4``, ``gemma4_text``): the family the text config's fields are named after.

Its text config needs no rewriting (config/hf.py reads Gemma 4's fields). Its multimodal top level
holds the media token ids and, for E2B/E4B and 26B/31B, a vision tower (a ViT over patch grids) and
for E2B/E4B an audio tower (a conformer): read here with transformers' defaults.
"""

from __future__ import annotations

from typing import Any

from .limits import AUDIO_NUMBERS, VISION_NUMBERS, check_numbers, positive_int
from .schema import AudioConfig, ConfigError, Family, TextConfig, VisionConfig

# transformers' Gemma4VisionConfig defaults (the "on-device" tower of E2B/E4B) for omitted fields.
VISION_DEFAULTS: dict[str, Any] = {
    "hidden_size": 768,
    "intermediate_size": 3072,
    "num_hidden_layers": 16,
    "num_attention_heads": 12,
    "num_key_value_heads": 12,
    "head_dim": 64,
    "hidden_activation": "gelu_pytorch_tanh",
    "rms_norm_eps": 1e-6,
    "pooling_kernel_size": 3,
    "patch_size": 16,
    "position_embedding_size": 10 * 1024,
    "use_clipped_linears": False,
    "standardize": False,
}
VISION_ROPE_THETA = 100.0  # transformers' default for the vision tower's axial RoPE

# transformers' Gemma4AudioConfig defaults (the E2B/E4B conformer) for omitted fields.
AUDIO_DEFAULTS: dict[str, Any] = {
    "hidden_size": 1024,
    "num_hidden_layers": 12,
    "num_attention_heads": 8,
    "hidden_act": "silu",
    "subsampling_conv_channels": [128, 32],
    "conv_kernel_size": 5,
    "residual_weight": 0.5,
    "attention_chunk_size": 12,
    "attention_context_left": 13,
    "attention_context_right": 0,
    "attention_logit_cap": 50.0,
    "attention_invalid_logits_value": -1.0e9,
    "use_clipped_linears": True,
    "rms_norm_eps": 1e-6,
    "gradient_clipping": 1e10,
    "output_proj_dims": 1536,
}

# Multimodal token ids of the gemma4 top-level config (transformers' defaults).
MULTIMODAL_TOKEN_DEFAULTS = {
    "image_token_id": 258_880,
    "audio_token_id": 258_881,
    "video_token_id": 258_884,
    "boi_token_id": 255_999,
    "eoi_token_id": 258_882,
    "boa_token_id": 256_000,
    "eoa_token_id": 258_883,
}


def token_ids(data: dict) -> dict[str, int]:
    """The multimodal top level's media token ids (transformers' defaults for those it omits)."""
    # transformers spells the end-of-audio id `eoa_token_index`; a null id takes the default.
    spelled = {**data, "eoa_token_id": data.get("eoa_token_id", data.get("eoa_token_index"))}
    return {k: int(v if spelled.get(k) is None else spelled[k]) for k, v in MULTIMODAL_TOKEN_DEFAULTS.items()}


def tower_configs(data: dict) -> tuple[dict | None, dict | None]:
    """The top level's ``vision_config`` and ``audio_config``, each an object or null."""
    vision, audio = data.get("vision_config"), data.get("audio_config")
    for name, sub in (("vision_config", vision), ("audio_config", audio)):
        if sub is not None and not isinstance(sub, dict):
            raise ConfigError(f"{name} must be an object or null, got {type(sub).__name__}")
    return vision, audio


def top_level(data: dict, text: TextConfig) -> tuple[TextConfig, dict[str, Any]]:
    """The towers config.json describes (null: none) and the media token ids."""
    ids = token_ids(data)
    vision, audio = tower_configs(data)
    return text, {
        "token_ids": ids,
        "vision_config": None if vision is None else _vision_config_from_hf(vision),
        "audio_config": None if audio is None else _audio_config_from_hf(audio),
    }


def _vision_config_from_hf(data: dict) -> VisionConfig:
    v = {**VISION_DEFAULTS, **{k: val for k, val in data.items() if val is not None}}
    ints = {
        key: positive_int(v, key, "vision_config")
        for key in (
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "patch_size",
            "pooling_kernel_size",
            "position_embedding_size",
        )
    }
    if v["hidden_activation"] not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise ConfigError(f"vision_config: unsupported hidden_activation {v['hidden_activation']!r}")
    if ints["num_attention_heads"] % ints["num_key_value_heads"]:
        raise ConfigError("vision_config: num_attention_heads must be a multiple of num_key_value_heads")
    if ints["head_dim"] % 4:
        # The head is split in two halves (x, y), each rotated in half-split pairs.
        raise ConfigError(f"vision_config: head_dim must be a multiple of 4, got {ints['head_dim']}")
    rope = v.get("rope_parameters") or {}
    if not isinstance(rope, dict):
        raise ConfigError(f"vision_config: rope_parameters must be an object, got {type(rope).__name__}")
    # transformers rewrites the json's "default" to "axial" for the vision tower.
    if rope.get("rope_type", "axial") not in ("axial", "default"):
        raise ConfigError(f"vision_config: unsupported rope_type {rope.get('rope_type')!r} (axial only)")
    theta = rope.get("rope_theta", VISION_ROPE_THETA)
    check_numbers({"rms_norm_eps": v["rms_norm_eps"], "rope_theta": theta}, VISION_NUMBERS, "vision_config")
    return VisionConfig(
        **ints,
        rms_norm_eps=float(v["rms_norm_eps"]),
        rope_theta=float(theta),
        use_clipped_linears=bool(v["use_clipped_linears"]),
        standardize=bool(v["standardize"]),
    )


def _audio_config_from_hf(data: dict) -> AudioConfig:
    a = {**AUDIO_DEFAULTS, **{k: val for k, val in data.items() if val is not None}}
    check_numbers(a, AUDIO_NUMBERS, "audio_config")
    ints = {
        key: positive_int(a, key, "audio_config")
        for key in (
            "hidden_size",
            "num_hidden_layers",
            "num_attention_heads",
            "conv_kernel_size",
            "attention_chunk_size",
            "attention_context_left",
            "output_proj_dims",
        )
    }
    right = positive_int(a, "attention_context_right", "audio_config", minimum=0)
    channels = a["subsampling_conv_channels"]
    if not isinstance(channels, list | tuple) or len(channels) != 2:
        raise ConfigError(
            f"audio_config: subsampling_conv_channels must be two positive ints, got {channels!r}"
        )
    for channel in channels:
        positive_int({"subsampling_conv_channels": channel}, "subsampling_conv_channels", "audio_config")
    if a["hidden_act"] != "silu":
        raise ConfigError(f"audio_config: unsupported hidden_act {a['hidden_act']!r} (silu only)")
    if ints["hidden_size"] % ints["num_attention_heads"]:
        raise ConfigError("audio_config: hidden_size must be a multiple of num_attention_heads")
    return AudioConfig(
        **ints,
        attention_context_right=right,
        subsampling_conv_channels=(int(channels[0]), int(channels[1])),
        residual_weight=float(a["residual_weight"]),
        attention_logit_cap=float(a["attention_logit_cap"]),
        attention_invalid_logits_value=float(a["attention_invalid_logits_value"]),
        use_clipped_linears=bool(a["use_clipped_linears"]),
        rms_norm_eps=float(a["rms_norm_eps"]),
        gradient_clipping=float(a["gradient_clipping"]),
    )


FAMILY = Family(name="gemma4", top_level=top_level, takes_media=True)
