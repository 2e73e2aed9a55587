"""EmbeddingGemma 2 (``embedding_gemma2``, ``embedding_gemma2_text``): a Gemma 4 text stack used as
an encoder, with Gemma 4's vision and audio towers in front of it.

What its text config changes, as Gemma 4 fields: attention is bidirectional on every layer, sliding
layers seeing ``|q - k| <= sliding_window`` (a radius: ``LayerSpec.window`` is one more); full
layers take ``global_head_dim`` and ``num_global_key_value_heads`` (no K=V needed); both RoPE
tables are the default kind; per-layer inputs come from the context projection alone (no token
table); the final states are projected to ``embedding_dim``. No KV sharing, MoE or LM head. Its
top level is Gemma 4's (towers, media token ids). Tensor names group the per-layer-input parts
(``ple.*``, ``layers.N.ple_block.*``), which map onto the Gemma 4 decoder's own names.
"""

from __future__ import annotations

from typing import Any

from .gemma4 import top_level
from .limits import positive_int
from .schema import FULL, SLIDING, Family

# transformers' EmbeddingGemma2TextConfig defaults for the fields a config.json may leave out.
TEXT_DEFAULTS: dict[str, Any] = {
    "vocab_size": 262_144,
    "hidden_size": 512,
    "intermediate_size": 2048,
    "num_hidden_layers": 24,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 256,
    "max_position_embeddings": 262_144,
    "sliding_window": 512,
    "hidden_size_per_layer_input": 512,
    "embedding_dim": 768,
    "global_head_dim": 512,
    "num_global_key_value_heads": 1,
}
ROPE_DEFAULTS = {
    SLIDING: {"rope_type": "default", "rope_theta": 10_000.0},
    FULL: {"rope_type": "default", "rope_theta": 1_000_000.0},
}
# Gemma 4 fields EmbeddingGemma 2 does not have: off whatever the json says.
FORCED: dict[str, Any] = {
    "use_bidirectional_attention": None,  # every layer is bidirectional (TextConfig.bidirectional)
    "num_kv_shared_layers": 0,
    "enable_moe_block": False,
    "attention_k_eq_v": False,
    "use_double_wide_mlp": False,
    "final_logit_softcapping": None,
    "tie_word_embeddings": True,  # no LM head
}


def text_fields(data: dict, num_layers: int) -> tuple[dict, dict[str, Any], dict[str, list]]:
    """EmbeddingGemma2TextConfig's fields as Gemma 4's, plus the numerics in which it differs."""
    d = {**data, **FORCED}
    if d.get("layer_types") is None:
        pattern = positive_int({"sliding_window_pattern": 6, **d}, "sliding_window_pattern")
        d["layer_types"] = [FULL if (i + 1) % pattern == 0 else SLIDING for i in range(num_layers)]
    if d.get("per_layer_config") is None:
        # The published style: every full layer takes the global geometry (transformers writes it
        # out as per_layer_config on save).
        geometry = {
            "head_dim": positive_int(d, "global_head_dim"),
            "num_key_value_heads": positive_int(d, "num_global_key_value_heads"),
        }
        d["per_layer_config"] = {str(i): geometry for i, t in enumerate(d["layer_types"]) if t == FULL}
    d["global_head_dim"] = d["num_global_key_value_heads"] = None  # said by per_layer_config now
    d["rope_parameters"] = d.get("rope_parameters") or ROPE_DEFAULTS
    # The window is an inclusive radius; our bidirectional rule is |q - k| < window.
    d["sliding_window"] = positive_int(d, "sliding_window") + 1
    numerics = dict(
        bidirectional=True,
        ple_token_table=False,
        embedding_dim=positive_int(d, "embedding_dim"),
    )
    return d, numerics, {}


# A layer's per-layer-input parts, which the checkpoint groups under ``ple_block``.
PLE_BLOCK = ("per_layer_input_gate", "per_layer_projection", "post_per_layer_input_norm")


def module_path(name: str) -> str | None:
    """The per-layer-input parts sit on the decoder and its layers here, not in sub-modules."""
    name = name.replace("language_model.ple.", "language_model.", 1)
    if name.startswith("language_model.layers."):
        name = name.replace(".ple_block.", ".", 1)
    return name


def checkpoint_path(path: str) -> str:
    parts = path.split(".")
    if parts[:2] == ["language_model", "layers"] and len(parts) > 3 and parts[3] in PLE_BLOCK:
        return ".".join([*parts[:3], "ple_block", *parts[3:]])
    if parts[:2] in (
        ["language_model", "per_layer_model_projection"],
        ["language_model", "per_layer_projection_norm"],
    ):
        return ".".join([parts[0], "ple", *parts[1:]])
    return path


FAMILY = Family(
    name="embedding_gemma2",
    top_level=top_level,
    text_defaults=TEXT_DEFAULTS,
    text_fields=text_fields,
    module_path=module_path,
    checkpoint_path=checkpoint_path,
    takes_media=True,
)
