"""Gemma 3 (``gemma3``, ``gemma3_text``), EmbeddingGemma included (a ``gemma3_text`` checkpoint with
``use_bidirectional_attention``: an encoder). The multimodal checkpoint (4B-27B) adds a SigLIP
vision tower and its projector (model/siglip.py); its image tokens see each other both ways.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from .limits import positive_int
from .schema import FULL, SLIDING, ConfigError, Family, SiglipVisionConfig, TextConfig

# transformers' Gemma3TextConfig defaults for the fields Gemma 3 4B/12B/27B's published config.json
# leaves out of its text_config (it writes only sizes, RoPE scaling and the window).
GEMMA3_DEFAULTS: dict[str, Any] = {
    "vocab_size": 262_208,
    "hidden_size": 2304,
    "intermediate_size": 9216,
    "num_hidden_layers": 26,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 256,
    "query_pre_attn_scalar": 256,
    "sliding_window": 4096,
    "max_position_embeddings": 131_072,
    "final_logit_softcapping": None,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1_000_000.0,
    "rope_local_base_freq": 10_000.0,
}


def text_fields(data: dict, num_layers: int) -> tuple[dict, dict[str, Any], dict[str, list]]:
    """A Gemma 3 text config as Gemma 4's fields, plus the numerics in which Gemma 3 differs.

    Gemma 3 has one head geometry for both layer types, no PLE, KV sharing or MoE, and carries its
    RoPE settings in older keys (``rope_theta``, ``rope_local_base_freq``, ``rope_scaling``) that
    transformers folds into per-type ``rope_parameters``; so do we.
    """
    d = dict(data)
    bidirectional = bool(d.get("use_bidirectional_attention") or False)
    if d.get("sliding_window", 4096) is None:
        raise ConfigError("sliding_window must be set for Gemma 3")
    window = positive_int({"sliding_window": 4096, **d}, "sliding_window")
    if bidirectional:
        # EmbeddingGemma: transformers halves the window of bidirectional models (and writes the
        # original back on save).
        window = window // 2 + 1
    if d.get("layer_types") is None:
        pattern = positive_int({"sliding_window_pattern": 6, **d}, "sliding_window_pattern")
        d["layer_types"] = [
            FULL if (i + 1) % pattern == 0 else SLIDING for i in range(d["num_hidden_layers"])
        ]
    d.update(
        sliding_window=window,
        rope_parameters=rope_from_older_keys(d),
        global_head_dim=d["head_dim"],
        num_global_key_value_heads=None,
        use_bidirectional_attention=None,
        hidden_size_per_layer_input=0,
        num_kv_shared_layers=0,
        enable_moe_block=False,
        attention_k_eq_v=False,
        use_double_wide_mlp=False,
    )
    d.pop("per_layer_config", None)
    # attn_logit_softcapping is read by transformers 5.23 but never applied (published Gemma 3
    # configs set it to null): the reference ignores it, and so do we.
    numerics = dict(
        norm_plus_one=True,
        attention_scale=float(d.get("query_pre_attn_scalar", 256)) ** -0.5,
        use_v_norm=False,
        use_layer_scalar=False,
        bidirectional=bidirectional,
    )
    return d, numerics, {}


def rope_from_older_keys(d: dict) -> dict:
    """Per-type ``rope_parameters`` from Gemma 3 / 3n's older keys (``rope_theta``,
    ``rope_local_base_freq``, ``rope_scaling``), folded as transformers folds them."""
    rope = {k: dict(v) for k, v in (d.get("rope_parameters") or {}).items() if isinstance(v, dict)}
    full = rope.setdefault(FULL, {"rope_type": "default"})
    if isinstance(d.get("rope_scaling"), dict):
        full.update(d["rope_scaling"])
    full.setdefault("rope_theta", d.get("rope_theta", 1_000_000.0))
    rope.setdefault(SLIDING, {"rope_type": "default"}).setdefault(
        "rope_theta", d.get("rope_local_base_freq", 10_000.0)
    )
    for params in rope.values():
        if "type" in params and "rope_type" not in params:  # the oldest spelling
            params["rope_type"] = params.pop("type")
    return rope


# transformers' SiglipVisionConfig defaults, for the fields a vision_config leaves out.
SIGLIP_DEFAULTS: dict[str, Any] = {
    "hidden_size": 768,
    "intermediate_size": 3072,
    "num_hidden_layers": 12,
    "num_attention_heads": 12,
    "num_channels": 3,
    "image_size": 224,
    "patch_size": 16,
    "hidden_act": "gelu_pytorch_tanh",
    "layer_norm_eps": 1e-6,
}
# Gemma3Config's defaults for its media token ids (config.json spells them *_index).
TOKEN_DEFAULTS = {"image_token_index": 262_144, "boi_token_index": 255_999, "eoi_token_index": 256_000}


def top_level(data: dict, text: TextConfig) -> tuple[TextConfig, dict[str, Any]]:
    """The SigLIP tower with its projector, the media token ids, and image blocks on every layer."""
    if text.final_logit_softcapping is not None:
        # transformers 5.23's Gemma3ForConditionalGeneration never soft-caps its logits (only
        # Gemma3ForCausalLM does; published Gemma 3 configs set the cap to null): follow it.
        text = dataclasses.replace(text, final_logit_softcapping=None)
    # The tokens of one image attend to each other both ways on every layer, a sliding layer's
    # window still bounding them (transformers' create_masks_for_vision_model).
    text = dataclasses.replace(text, use_bidirectional_attention="vision", vision_block_layers="windowed")
    ids = {}
    for key, default in TOKEN_DEFAULTS.items():
        value = data.get(key, data.get(key.replace("_index", "_id"), default))
        ids[key.replace("_index", "_id")] = positive_int({key: value}, key)
    return text, {"token_ids": ids, "siglip_vision": siglip_from_hf(data)}


def siglip_from_hf(data: dict) -> SiglipVisionConfig:
    raw = data.get("vision_config") or {}
    if not isinstance(raw, dict):
        raise ConfigError(f"vision_config must be an object, got {type(raw).__name__}")
    v = {**SIGLIP_DEFAULTS, **{k: val for k, val in raw.items() if val is not None}}
    sizes = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
    ints = {key: positive_int(v, key, "vision_config") for key in (*sizes, "image_size", "patch_size")}
    if v["hidden_act"] not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise ConfigError(f"vision_config: unsupported hidden_act {v['hidden_act']!r} (gelu_pytorch_tanh)")
    if v["num_channels"] != 3:
        raise ConfigError(f"vision_config: num_channels must be 3 (RGB), got {v['num_channels']!r}")
    if ints["hidden_size"] % ints["num_attention_heads"]:
        raise ConfigError("vision_config: hidden_size must be a multiple of num_attention_heads")
    if ints["image_size"] % ints["patch_size"]:
        raise ConfigError("vision_config: image_size must be a multiple of patch_size")
    tokens = positive_int({"mm_tokens_per_image": 256, **data}, "mm_tokens_per_image")
    side, patches = math.isqrt(tokens), ints["image_size"] // ints["patch_size"]
    if side * side != tokens or patches % side:
        raise ConfigError(
            f"mm_tokens_per_image ({tokens}) must be a square whose side divides the {patches} patches "
            "per side (the projector average-pools the patch grid into it)"
        )
    return SiglipVisionConfig(**ints, layer_norm_eps=float(v["layer_norm_eps"]), mm_tokens_per_image=tokens)


def module_path(name: str) -> str | None:
    # Checkpoints saved before transformers 5 nest the tower's parts under vision_model.
    name = name.replace("vision_tower.vision_model.", "vision_tower.", 1)
    # SigLIP's pooling head (vision_use_head) is built by transformers but unused by Gemma 3.
    return None if name.startswith("vision_tower.head.") else name


FAMILY = Family(
    name="gemma3",
    top_level=top_level,
    text_defaults=GEMMA3_DEFAULTS,
    text_fields=text_fields,
    last_layer_full=False,
    module_path=module_path,
    takes_media=True,
)
