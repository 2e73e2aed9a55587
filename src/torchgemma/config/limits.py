"""The limits a config.json must keep: the largest size of each field, the rules for float fields,
and the checks that apply them, each error naming the field (and the sub-config it sits in).
"""

from __future__ import annotations

import math
from typing import Any

from .schema import ConfigError

# Largest accepted value of each size field, in any sub-config. Published Gemma 3/4 reach 62 layers,
# width 5376, MLP 21504, vocabulary 262208, 32 heads, head_dim 512, 128 experts, window 1024, context
# 262144, a vision position table of 10240: the caps sit 8x or more above, so that an absurd
# config.json is refused by name before anything (a per-layer list, a model) is sized from it.
MAX_SIZES: dict[str, int] = {
    "num_hidden_layers": 512,  # llama.cpp's LLAMA_MAX_LAYERS
    "hidden_size": 65_536,
    "hidden_size_per_layer_input": 65_536,
    "output_proj_dims": 65_536,
    "intermediate_size": 262_144,
    "moe_intermediate_size": 262_144,
    "vocab_size": 2_097_152,
    "vocab_size_per_layer_input": 2_097_152,
    "num_attention_heads": 1024,
    "num_key_value_heads": 1024,
    "num_global_key_value_heads": 1024,
    "head_dim": 8192,
    "global_head_dim": 8192,
    "num_experts": 4096,
    "top_k_experts": 4096,
    "sliding_window": 16_777_216,
    "max_position_embeddings": 16_777_216,
    "sliding_window_pattern": 512,
    "patch_size": 1024,
    "pooling_kernel_size": 64,
    "position_embedding_size": 262_144,
    "mm_embed_dim": 65_536,
    "mm_posemb_size": 262_144,
    "audio_embed_dim": 65_536,
    "conv_kernel_size": 1024,
    "subsampling_conv_channels": 65_536,
    "attention_chunk_size": 65_536,
    "attention_context_left": 65_536,
    "attention_context_right": 65_536,
    "laurel_rank": 65_536,
    "altup_num_inputs": 64,
    "altup_active_idx": 64,
    "vocab_offset": 2_097_152,
}

# A published config.json is a few KiB; parsing gigabytes of one would cost what MAX_SIZES guards.
MAX_CONFIG_BYTES = 16 * 2**20


def positive_int(data: dict, key: str, where: str = "", minimum: int = 1) -> int:
    """``data[key]`` as an int in [minimum, MAX_SIZES[key]]; ``where`` names the sub-config."""
    value = data.get(key)
    prefix = f"{where}: " if where else ""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        kind = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"
        raise ConfigError(f"{prefix}{key} must be {kind}, got {value!r}")
    cap = MAX_SIZES.get(key)
    if cap is not None and value > cap:
        raise ConfigError(
            f"{prefix}{key}={value} exceeds the largest supported value {cap:,} "
            "(published Gemma models are far smaller: is config.json corrupt?)"
        )
    return value


# Rules for the float fields we read. NaN and inf never pass: Python's json module reads both.
POSITIVE, FRACTION, FINITE = "a positive finite number", "a number in (0, 1]", "a finite number"
TEXT_NUMBERS = {
    "rms_norm_eps": POSITIVE,
    # Soft-capping divides by the cap: 0 would make every logit NaN.
    "final_logit_softcapping": POSITIVE,
    "attn_logit_softcapping": POSITIVE,
    "query_pre_attn_scalar": POSITIVE,
    "rope_theta": POSITIVE,  # Gemma 3's older RoPE keys
    "rope_local_base_freq": POSITIVE,
}
ROPE_NUMBERS = {"rope_theta": POSITIVE, "factor": POSITIVE, "partial_rotary_factor": FRACTION}
VISION_NUMBERS = {"rms_norm_eps": POSITIVE, "rope_theta": POSITIVE}
AUDIO_NUMBERS = {
    "rms_norm_eps": POSITIVE,
    "residual_weight": FINITE,
    "attention_logit_cap": POSITIVE,
    "attention_invalid_logits_value": FINITE,
    "gradient_clipping": POSITIVE,
}


def check_numbers(data: dict, rules: dict[str, str], where: str = "") -> None:
    """Every field of ``rules`` present (and not null) in ``data`` is a number obeying its rule."""
    prefix = f"{where}: " if where else ""
    for key, rule in rules.items():
        value = data.get(key)
        if value is None:
            continue
        ok = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
        if ok and rule == POSITIVE:
            ok = value > 0
        elif ok and rule == FRACTION:
            ok = 0 < value <= 1
        if not ok:
            raise ConfigError(f"{prefix}{key} must be {rule}, got {value!r}")


def check_text_numbers(data: dict) -> None:
    """The text config's float fields, its RoPE parameters in both spellings included."""
    check_numbers(data, TEXT_NUMBERS)
    scaling = data.get("rope_scaling")
    if isinstance(scaling, dict):
        check_numbers(scaling, ROPE_NUMBERS, "rope_scaling")
    params = data.get("rope_parameters")
    if isinstance(params, dict):
        for layer_type, p in params.items():
            if isinstance(p, dict):
                check_numbers(p, ROPE_NUMBERS, f"rope_parameters[{layer_type!r}]")


def token_id(value: Any, key: str, vocab_size: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < vocab_size:
        raise ConfigError(f"{key}={value!r} is not a token id of the vocabulary (vocab_size={vocab_size})")
    return value
