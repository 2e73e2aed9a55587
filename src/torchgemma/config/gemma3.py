"""Gemma 3 (``gemma3``, ``gemma3_text``), EmbeddingGemma included (a ``gemma3_text`` checkpoint with
``use_bidirectional_attention``: an encoder). Only the text model is built: the multimodal
checkpoint's SigLIP tower and projector are not.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from .limits import positive_int
from .schema import FULL, SLIDING, ConfigError, Family, TextConfig

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


def top_level(data: dict, text: TextConfig) -> tuple[TextConfig, dict[str, Any]]:
    """Nothing beside the text model is built, and no media token ids apply."""
    if text.final_logit_softcapping is not None:
        # transformers 5.23's Gemma3ForConditionalGeneration never soft-caps its logits (only
        # Gemma3ForCausalLM does; published Gemma 3 configs set the cap to null): follow it.
        text = dataclasses.replace(text, final_logit_softcapping=None)
    return text, {}


def module_path(name: str) -> str | None:
    return None if name.startswith(("vision_tower.", "multi_modal_projector.")) else name


FAMILY = Family(
    name="gemma3",
    top_level=top_level,
    text_defaults=GEMMA3_DEFAULTS,
    text_fields=text_fields,
    last_layer_full=False,
    module_path=module_path,
    towers_note="torchgemma builds only the text model of model_type 'gemma3'",
)
