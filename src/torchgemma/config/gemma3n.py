"""Gemma 3n (``gemma3n``, ``gemma3n_text``): Gemma 4's attention, PLE and KV sharing inside AltUp's
several residual streams and LAuReL, its first layers' MLP gates sparsified.

Of the multimodal checkpoint, the audio conformer and the MobileNet-V5 vision tower
(config/gemma3n_vision.py) are built, with both embedders; their token tables embed the towers' own
ids, which text-only prompts and generated ids may use too (the text model holds the embedders:
``language_model.embed_vision``, ``language_model.embed_audio``).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from .gemma3 import rope_from_older_keys
from .gemma3n_vision import vision_config_from_hf
from .limits import FINITE, POSITIVE, check_numbers, positive_int
from .schema import FULL, SLIDING, ConfigError, Family, Gemma3nAudioConfig, MediaVocabulary, TextConfig

# transformers' Gemma3nTextConfig defaults, where they differ from Gemma 4's.
GEMMA3N_DEFAULTS: dict[str, Any] = {
    "sliding_window": 512,
    "final_logit_softcapping": 30.0,
    "max_position_embeddings": 32_768,
    "hidden_size_per_layer_input": 256,
    "vocab_size_per_layer_input": 262_144,
    "num_kv_shared_layers": 15,
    "laurel_rank": 64,
    "altup_num_inputs": 4,
    "altup_active_idx": 0,
    "altup_correct_scale": True,
}


def text_fields(data: dict, num_layers: int) -> tuple[dict, dict[str, Any], dict[str, list]]:
    """A Gemma 3n text config as Gemma 4's fields, the numerics in which Gemma 3n differs, and its
    per-layer MLP widths and activation sparsities.

    Gemma 3n has Gemma 4's attention (QK and V norms, scale 1), PLE and KV sharing, with one head
    geometry and default RoPE on both layer types (its RoPE in Gemma 3's older keys); around them
    AltUp's several residual streams and LAuReL; the first layers' MLP gates sparsified.
    """
    d = {**GEMMA3N_DEFAULTS, **data}
    if d.get("layer_types") is None:
        # transformers' default: every fifth layer is full attention (4:1).
        d["layer_types"] = [FULL if (i + 1) % 5 == 0 else SLIDING for i in range(num_layers)]
    widths = d["intermediate_size"]
    if not isinstance(widths, list | tuple):
        widths = [widths] * num_layers
    if len(widths) != num_layers:
        raise ConfigError(
            f"intermediate_size has {len(widths)} entries but num_hidden_layers is {num_layers}"
        )
    widths = [positive_int({"intermediate_size": w}, "intermediate_size") for w in widths]
    sparsity = d.get("activation_sparsity_pattern")
    if sparsity is None:
        # transformers' default: the first 10 layers keep 5% of their gate activations.
        sparse = 10 if num_layers > 10 else 0
        sparsity = [0.95] * sparse + [0.0] * (num_layers - sparse)
    if not isinstance(sparsity, list | tuple) or len(sparsity) != num_layers:
        raise ConfigError(f"activation_sparsity_pattern must list one value per layer ({num_layers})")
    for value in sparsity:
        if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value < 1:
            raise ConfigError(f"activation_sparsity_pattern values must be in [0, 1), got {value!r}")
    altup = positive_int(d, "altup_num_inputs")
    active = positive_int(d, "altup_active_idx", minimum=0)
    if active >= altup:
        raise ConfigError(f"altup_active_idx={active} is not one of the {altup} AltUp streams")
    if not positive_int(d, "hidden_size_per_layer_input"):
        raise ConfigError("Gemma 3n needs hidden_size_per_layer_input > 0")
    d.update(
        intermediate_size=widths[0],
        rope_parameters=rope_from_older_keys(d),
        global_head_dim=d["head_dim"],
        num_global_key_value_heads=None,
        use_bidirectional_attention=None,
        enable_moe_block=False,
        attention_k_eq_v=False,
        use_double_wide_mlp=False,
    )
    d.pop("per_layer_config", None)
    numerics = dict(
        use_layer_scalar=False,
        altup_num_inputs=altup,
        altup_active_idx=active,
        altup_correct_scale=bool(d["altup_correct_scale"]),
        laurel_rank=positive_int(d, "laurel_rank"),
        ple_scales_in_model_dtype=True,
        trim_kv_shared_layers=False,
    )
    return d, numerics, {"intermediate_size": widths, "activation_sparsity": [float(p) for p in sparsity]}


def _media_vocabularies(vision: Any, audio: Any) -> tuple[MediaVocabulary, ...]:
    """Gemma 3n's embedders' token tables, from its vision and audio configs (transformers' defaults:
    vision ids from 262144, audio ids from 262272, 128 each)."""
    out = []
    defaults = {"vision": (262_144, 2048), "audio": (262_144 + 128, 1536)}
    for name, sub in (("vision", vision), ("audio", audio)):
        if sub is None:
            sub = {}
        if not isinstance(sub, dict):
            raise ConfigError(f"{name}_config must be an object or null, got {type(sub).__name__}")
        offset, hidden = defaults[name]
        v = {"vocab_offset": offset, "vocab_size": 128, "hidden_size": hidden, "rms_norm_eps": 1e-6}
        v.update({k: val for k, val in sub.items() if val is not None})
        where = f"{name}_config"
        check_numbers(v, {"rms_norm_eps": POSITIVE}, where)
        out.append(
            MediaVocabulary(
                name=name,
                offset=positive_int(v, "vocab_offset", where, minimum=0),
                end=None,
                size=positive_int(v, "vocab_size", where),
                hidden_size=positive_int(v, "hidden_size", where),
                rms_norm_eps=float(v["rms_norm_eps"]),
            )
        )
    # transformers: vision ids run up to the first audio id; audio ids are every id from there.
    # Both towers are built: their soft tokens go through embed_vision and embed_audio.
    vision, audio = out
    return (
        dataclasses.replace(vision, end=audio.offset, soft_tokens=True),
        dataclasses.replace(audio, soft_tokens=True),
    )


# transformers' Gemma3nAudioConfig defaults (the published E2B/E4B conformer) for omitted fields.
GEMMA3N_AUDIO_DEFAULTS: dict[str, Any] = {
    "input_feat_size": 128,
    "hidden_size": 1536,
    "rms_norm_eps": 1e-6,
    "gradient_clipping": 1e10,
    "conf_attention_chunk_size": 12,
    "conf_attention_context_left": 13,
    "conf_attention_context_right": 0,
    "conf_attention_logit_cap": 50.0,
    "conf_num_attention_heads": 8,
    "conf_num_hidden_layers": 12,
    "conf_conv_kernel_size": 5,
    "conf_reduction_factor": 4,
    "conf_residual_weight": 0.5,
    "sscp_conv_channel_size": [128, 32],
    "sscp_conv_group_norm_eps": 1e-3,
    "sscp_conv_kernel_size": [[3, 3], [3, 3]],
    "sscp_conv_stride_size": [[2, 2], [2, 2]],
}


def _gemma3n_audio_from_hf(data: Any, top: dict) -> Gemma3nAudioConfig:
    """Gemma 3n's audio_config (null: transformers' defaults) and the top level's audio fields."""
    where = "audio_config"
    a = {**GEMMA3N_AUDIO_DEFAULTS, **{k: v for k, v in (data or {}).items() if v is not None}}
    numbers = {
        "rms_norm_eps": POSITIVE,
        "gradient_clipping": POSITIVE,
        "conf_attention_logit_cap": POSITIVE,
        "conf_residual_weight": FINITE,
        "sscp_conv_group_norm_eps": POSITIVE,
    }
    check_numbers(a, numbers, where)
    ints = {
        key: positive_int(a, key, where)
        for key in (
            "input_feat_size",
            "hidden_size",
            "conf_num_hidden_layers",
            "conf_num_attention_heads",
            "conf_conv_kernel_size",
            "conf_reduction_factor",
            "conf_attention_chunk_size",
            "conf_attention_context_left",
        )
    }
    right = positive_int(a, "conf_attention_context_right", where, minimum=0)
    if ints["hidden_size"] % ints["conf_num_attention_heads"]:
        raise ConfigError(f"{where}: hidden_size must be a multiple of conf_num_attention_heads")

    def pairs(key: str, count: int, depth: int) -> tuple:
        value = a[key]
        ok = isinstance(value, list | tuple) and len(value) == count
        if ok and depth == 2:
            ok = all(isinstance(v, list | tuple) and len(v) == 2 for v in value)
        flat = [x for v in value for x in (v if depth == 2 else [v])] if ok else []
        if not ok or not all(isinstance(x, int) and not isinstance(x, bool) and x > 0 for x in flat):
            shape = "two positive ints" if depth == 1 else "two [time, frequency] pairs of positive ints"
            raise ConfigError(f"{where}: {key} must be {shape}, got {value!r}")
        return tuple(tuple(v) for v in value) if depth == 2 else tuple(value)

    top = {k: v for k, v in top.items() if v is not None}
    soft = positive_int(
        {"n": top.get("audio_soft_tokens_per_image", 188)}, "n", "audio_soft_tokens_per_image"
    )
    token = positive_int({"id": top.get("audio_token_id", 262_273)}, "id", "audio_token_id", minimum=0)
    return Gemma3nAudioConfig(
        input_feat_size=ints["input_feat_size"],
        hidden_size=ints["hidden_size"],
        num_hidden_layers=ints["conf_num_hidden_layers"],
        num_attention_heads=ints["conf_num_attention_heads"],
        conv_kernel_size=ints["conf_conv_kernel_size"],
        reduction_factor=ints["conf_reduction_factor"],
        residual_weight=float(a["conf_residual_weight"]),
        attention_chunk_size=ints["conf_attention_chunk_size"],
        attention_context_left=ints["conf_attention_context_left"],
        attention_context_right=right,
        attention_logit_cap=float(a["conf_attention_logit_cap"]),
        gradient_clipping=float(a["gradient_clipping"]),
        rms_norm_eps=float(a["rms_norm_eps"]),
        conv_channels=pairs("sscp_conv_channel_size", 2, 1),
        conv_kernels=pairs("sscp_conv_kernel_size", 2, 2),
        conv_strides=pairs("sscp_conv_stride_size", 2, 2),
        conv_group_norm_eps=float(a["sscp_conv_group_norm_eps"]),
        soft_tokens_per_clip=soft,
        audio_token_id=token,
    )


def _check_media(media: tuple[MediaVocabulary, ...], vocab_size: int) -> tuple[MediaVocabulary, ...]:
    """Every id a media vocabulary takes (below vocab_size) must be a row of its table."""
    for vocab in media:
        end = vocab_size if vocab.end is None else min(vocab.end, vocab_size)
        if end - vocab.offset > vocab.size:
            raise ConfigError(
                f"{vocab.name}_config: ids {vocab.offset}..{end - 1} go to its embedder, whose table has "
                f"only {vocab.size} rows (vocab_size)"
            )
    return media


def top_level(data: dict, text: TextConfig) -> tuple[TextConfig, dict[str, Any]]:
    """The embedders' token tables (into the text config), the audio conformer and the vision tower;
    no token ids."""
    vision, audio = data.get("vision_config"), data.get("audio_config")
    media = _media_vocabularies(vision, audio)
    gemma3n_audio = _gemma3n_audio_from_hf(audio, data)
    gemma3n_vision = vision_config_from_hf(vision, data)
    text = dataclasses.replace(text, media_vocabularies=_check_media(media, text.vocab_size))
    return text, {"gemma3n_audio": gemma3n_audio, "gemma3n_vision": gemma3n_vision}


# The embedders the text model holds (their ids are text-model ids), as checkpoint names.
TEXT_MODEL_EMBEDDERS = ("embed_vision.", "embed_audio.")


def module_path(name: str) -> str | None:
    if name.startswith(TEXT_MODEL_EMBEDDERS):
        return "language_model." + name
    return name


def checkpoint_path(module_path: str) -> str:
    embedder = module_path.removeprefix("language_model.")
    return embedder if embedder.startswith(TEXT_MODEL_EMBEDDERS) else module_path


FAMILY = Family(
    name="gemma3n",
    top_level=top_level,
    text_fields=text_fields,
    last_layer_full=False,
    module_path=module_path,
    checkpoint_path=checkpoint_path,
)
