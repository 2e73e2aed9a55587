"""Reading a Hugging Face ``config.json``: the one place that knows its key names and defaults.

``fields_from_hf`` turns the dict into ``ModelConfig``'s fields. The text config is read as Gemma 4's
fields; a family whose fields differ (config/gemma3.py, gemma3n.py, gemma4_unified.py) first rewrites
its own into those, and reads its top level's towers itself.

Two field styles are accepted for the full-attention geometry:

* the published one: ``global_head_dim`` and ``num_global_key_value_heads`` at the top level, and
* the one transformers 5.23 writes on save: ``per_layer_config = {"<layer>": {"head_dim": ...,
  "num_key_value_heads": ...}}`` with overrides for the full-attention layers only.
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .embedding_gemma2 import FAMILY as EMBEDDING_GEMMA2
from .gemma3 import FAMILY as GEMMA3
from .gemma3n import FAMILY as GEMMA3N
from .gemma4 import FAMILY as GEMMA4
from .gemma4_unified import FAMILY as GEMMA4_UNIFIED
from .limits import MAX_CONFIG_BYTES, check_text_numbers, positive_int, token_id
from .schema import FULL, SLIDING, ConfigError, Family, KVRole, LayerSpec, RopeSpec, TextConfig

# By multimodal model_type; "{name}_text" is the family's text-only checkpoint.
FAMILIES: dict[str, Family] = {
    family.name: family for family in (GEMMA4, GEMMA3, GEMMA3N, GEMMA4_UNIFIED, EMBEDDING_GEMMA2)
}
SUPPORTED_MODEL_TYPES = tuple(t for name in FAMILIES for t in (name, f"{name}_text"))
SUPPORTED_ROPE_TYPES = ("default", "proportional", "linear")

# The text model's shape: without these a checkpoint cannot be built, so no default is guessed.
REQUIRED_TEXT_FIELDS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
)

# Defaults of transformers' Gemma4TextConfig for the optional fields we read.
TEXT_DEFAULTS: dict[str, Any] = {
    "rms_norm_eps": 1e-6,
    "sliding_window": 512,
    "final_logit_softcapping": None,
    "tie_word_embeddings": True,
    "pad_token_id": 0,
    "bos_token_id": 2,
    "eos_token_id": 1,
    "hidden_activation": "gelu_pytorch_tanh",
    "max_position_embeddings": 131_072,
    "use_bidirectional_attention": None,
    "vocab_size_per_layer_input": 262_144,
    "hidden_size_per_layer_input": 256,
    "attention_k_eq_v": False,
    "num_kv_shared_layers": 0,
    "enable_moe_block": False,
    "use_double_wide_mlp": False,
    "num_experts": None,
    "top_k_experts": None,
    "moe_intermediate_size": None,
    "attention_bias": False,
}

DEFAULT_ROPE_PARAMETERS = {
    SLIDING: {"rope_type": "default", "rope_theta": 10_000.0},
    FULL: {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1_000_000.0},
}


def fields_from_hf(data: dict) -> dict[str, Any]:
    """``ModelConfig``'s fields from the dict of a Hugging Face ``config.json``."""
    if not isinstance(data, dict):
        raise ConfigError(f"config must be a JSON object, got {type(data).__name__}")
    model_type = data.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ConfigError(
            f"unsupported model_type {model_type!r}; torchgemma builds {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    family = FAMILIES[model_type.removesuffix("_text")]
    multimodal = model_type == family.name
    if multimodal:
        text_data = data.get("text_config")
        if not isinstance(text_data, dict):
            raise ConfigError(f"model_type {model_type!r} needs a 'text_config' object")
        text_data = dict(text_data)
        # The top level decides weight tying for the multimodal model.
        if "tie_word_embeddings" in data:
            text_data["tie_word_embeddings"] = data["tie_word_embeddings"]
    else:
        text_data = data
    dtype = data.get("dtype") or data.get("torch_dtype") or text_data.get("dtype")
    text = text_config_from_hf(text_data, family)
    beside: dict[str, Any] = {"token_ids": {}}
    if multimodal:
        text, towers = family.top_level(data, text)
        beside.update(towers)
    return dict(
        model_type=model_type,
        text=text,
        dtype=dtype,
        family=family,
        **beside,
        quantization=quantization_from_hf(data.get("quantization_config")),
        source=data,
    )


def quantization_from_hf(data: Any) -> dict | None:
    """config.json's ``quantization_config``: only torchgemma's own (``torchgemma.save``) is read."""
    if data is None:
        return None
    method = data.get("quant_method") if isinstance(data, dict) else None
    if method != "torchgemma":
        raise ConfigError(
            f"quantization_config with quant_method {method!r} is not supported: torchgemma loads "
            "full-precision checkpoints (quantize with torchgemma.load(..., quantize=...)), GGUF files "
            "and checkpoints saved by torchgemma.save"
        )
    layers = data.get("layers")
    if not isinstance(layers, dict) or not all(
        isinstance(spec, dict)
        and spec.get("bits") in (4, 5, 8)
        and isinstance(spec.get("group_size"), int)
        and spec["group_size"] > 0
        and isinstance(spec.get("has_mins"), bool)
        and spec.get("scale_dtype", "float32") in ("float32", "float16")
        and set(spec) <= {"bits", "group_size", "has_mins", "scale_dtype"}
        for spec in layers.values()
    ):
        raise ConfigError(
            "quantization_config.layers must map module names to {bits: 4, 5 or 8, group_size: int > 0, "
            "has_mins: bool, scale_dtype (optional): float32 or float16}"
        )
    kept = data.get("kept", {})
    if not isinstance(kept, dict):
        raise ConfigError("quantization_config.kept must map module names to reasons")
    return {"mode": str(data.get("mode", "")), "layers": layers, "kept": kept}


def text_config_from_hf(data: dict, family: Family = GEMMA4) -> TextConfig:
    """The decoder's config; ``family`` rewrites its own text fields into Gemma 4's first."""
    data = {**family.text_defaults, **data}  # only absent keys: an explicit null stays null
    missing = [key for key in REQUIRED_TEXT_FIELDS if data.get(key) is None]
    if missing:
        raise ConfigError(f"text config is missing required field(s): {', '.join(missing)}")
    # Checked before anything is sized from them: a per-layer list of 10^9 entries takes minutes.
    num_layers = positive_int(data, "num_hidden_layers")
    check_text_numbers(data)
    numerics: dict[str, Any] = {}
    per_layer: dict[str, list] = {}
    if family.text_fields is not None:
        data, numerics, per_layer = family.text_fields(data, num_layers)
    get = {**TEXT_DEFAULTS, **{k: v for k, v in data.items() if v is not None or k in TEXT_DEFAULTS}}.get

    hidden = positive_int(data, "hidden_size")
    num_heads = positive_int(data, "num_attention_heads")
    num_kv_heads = positive_int(data, "num_key_value_heads")
    head_dim = positive_int(data, "head_dim")
    if get("hidden_activation") not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise ConfigError(f"unsupported hidden_activation {get('hidden_activation')!r}")
    if get("attention_bias"):
        raise ConfigError("attention_bias=true is not part of Gemma 4 and is not supported")

    bidirectional = get("use_bidirectional_attention")
    if bidirectional not in (None, "vision"):
        raise ConfigError(
            f"use_bidirectional_attention={bidirectional!r} is not supported (None or 'vision' are)"
        )

    layer_types = _layer_types(data, num_layers, force_last_full=family.last_layer_full)
    rope = _rope_specs(data, layer_types, head_dim)
    geometry = _per_layer_geometry(data, layer_types, head_dim, num_kv_heads)
    _check_heads(num_heads, geometry, layer_types, rope)

    num_shared = get("num_kv_shared_layers")
    if isinstance(num_shared, bool) or not isinstance(num_shared, int) or not 0 <= num_shared < num_layers:
        raise ConfigError(f"num_kv_shared_layers={num_shared} must be in [0, num_hidden_layers={num_layers})")
    kv = _kv_roles(layer_types, num_shared)
    moe = _moe_fields(data, get)
    per_layer_input, per_layer_vocab = _per_layer_input_fields(get)
    intermediate = positive_int(data, "intermediate_size")
    double_wide = bool(get("use_double_wide_mlp"))
    k_eq_v = bool(get("attention_k_eq_v"))
    window = positive_int({"sliding_window": get("sliding_window")}, "sliding_window")
    layers = _layer_specs(
        layer_types,
        geometry,
        kv,
        widths=per_layer.get("intermediate_size", [intermediate] * num_layers),
        sparsity=per_layer.get("activation_sparsity", [0.0] * num_layers),
        double_wide=double_wide,
        k_eq_v=k_eq_v,
        moe=moe["enable_moe_block"],
        window=window,
    )

    # Ids outside the vocabulary would be an IndexError in the middle of generation.
    vocab_size = positive_int(data, "vocab_size")
    eos = get("eos_token_id")
    eos_list = eos if isinstance(eos, list | tuple) else ([] if eos is None else [eos])
    eos_ids = tuple(token_id(t, "eos_token_id", vocab_size) for t in eos_list)
    bos = get("bos_token_id")
    softcap = get("final_logit_softcapping")
    return TextConfig(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=head_dim,
        rms_norm_eps=float(get("rms_norm_eps")),
        sliding_window=window,
        layer_types=tuple(layer_types),
        rope=rope,
        final_logit_softcapping=None if softcap is None else float(softcap),
        tie_word_embeddings=bool(get("tie_word_embeddings")),
        pad_token_id=token_id(get("pad_token_id"), "pad_token_id", vocab_size),
        bos_token_id=None if bos is None else token_id(bos, "bos_token_id", vocab_size),
        eos_token_id=eos_ids,
        max_position_embeddings=positive_int(
            {"max_position_embeddings": get("max_position_embeddings")}, "max_position_embeddings"
        ),
        use_bidirectional_attention=bidirectional,
        hidden_size_per_layer_input=per_layer_input,
        vocab_size_per_layer_input=per_layer_vocab,
        num_kv_shared_layers=num_shared,
        use_double_wide_mlp=double_wide,
        attention_k_eq_v=k_eq_v,
        layers=layers,
        **moe,
        **numerics,
    )


def _check_heads(
    num_heads: int, geometry: list[tuple[int, int]], layer_types: list[str], rope: dict[str, RopeSpec]
) -> None:
    """Each layer's query heads share its key/value heads evenly, and its head_dim is its RoPE table's."""
    for index, (layer_head_dim, layer_kv_heads) in enumerate(geometry):
        if num_heads % layer_kv_heads:
            raise ConfigError(
                f"layer {index}: num_attention_heads={num_heads} is not a multiple of its "
                f"{layer_kv_heads} key/value heads"
            )
        rope_dim = rope[layer_types[index]].head_dim
        if layer_head_dim != rope_dim:
            raise ConfigError(
                f"layer {index} ({layer_types[index]}) has head_dim {layer_head_dim} but other layers of "
                f"that type have {rope_dim}; one RoPE table per type needs one head_dim per type"
            )


def _moe_fields(data: dict, get: Callable[[str], Any]) -> dict[str, Any]:
    """TextConfig's mixture-of-experts fields (all None when ``enable_moe_block`` is off)."""
    moe = bool(get("enable_moe_block"))
    if moe:
        for key in ("num_experts", "top_k_experts", "moe_intermediate_size"):
            positive_int(data, key, "enable_moe_block=true")
        if data["top_k_experts"] > data["num_experts"]:
            raise ConfigError(
                f"top_k_experts={data['top_k_experts']} exceeds num_experts={data['num_experts']}"
            )
    return dict(
        enable_moe_block=moe,
        num_experts=data.get("num_experts") if moe else None,
        top_k_experts=data.get("top_k_experts") if moe else None,
        moe_intermediate_size=data.get("moe_intermediate_size") if moe else None,
    )


def _per_layer_input_fields(get: Callable[[str], Any]) -> tuple[int, int]:
    """(hidden_size_per_layer_input, vocab_size_per_layer_input): PLE's width (0: none) and table rows."""
    per_layer_input = positive_int(
        {"hidden_size_per_layer_input": get("hidden_size_per_layer_input") or 0},
        "hidden_size_per_layer_input",
        minimum=0,
    )
    per_layer_vocab = positive_int(
        {"vocab_size_per_layer_input": get("vocab_size_per_layer_input")},
        "vocab_size_per_layer_input",
        f"hidden_size_per_layer_input={per_layer_input}" if per_layer_input else "",
        minimum=1 if per_layer_input else 0,
    )
    return per_layer_input, per_layer_vocab


def _layer_specs(
    layer_types: list[str],
    geometry: list[tuple[int, int]],
    kv: tuple[list[KVRole], list[int]],
    *,
    widths: list[int],
    sparsity: list[float],
    double_wide: bool,
    k_eq_v: bool,
    moe: bool,
    window: int,
) -> tuple[LayerSpec, ...]:
    roles, sources = kv
    return tuple(
        LayerSpec(
            index=i,
            attention_type=layer_types[i],
            head_dim=geometry[i][0],
            num_kv_heads=geometry[i][1],
            kv_role=roles[i],
            kv_source=sources[i],
            k_eq_v=k_eq_v and layer_types[i] == FULL,
            # The double-wide MLP is only on the KV-shared layers.
            intermediate_size=widths[i] * (2 if double_wide and roles[i] == "reuse" else 1),
            moe=moe,
            window=window if layer_types[i] == SLIDING else None,
            activation_sparsity=sparsity[i],
        )
        for i in range(len(layer_types))
    )


def _layer_types(data: dict, num_layers: int, force_last_full: bool = True) -> list[str]:
    types = data.get("layer_types")
    if types is None:
        # transformers' default: every sixth layer is full attention (5:1).
        types = [FULL if (i + 1) % 6 == 0 else SLIDING for i in range(num_layers)]
    if not isinstance(types, list | tuple):
        raise ConfigError(f"layer_types must be a list, got {type(types).__name__}")
    types = list(types)
    if len(types) != num_layers:
        raise ConfigError(f"layer_types has {len(types)} entries but num_hidden_layers is {num_layers}")
    unknown = sorted({t for t in types if t not in (SLIDING, FULL)})
    if unknown:
        raise ConfigError(f"unknown layer type(s) {unknown}; expected {SLIDING!r} or {FULL!r}")
    if force_last_full and types[-1] != FULL:
        # Gemma 4: transformers forces the last layer to full attention (with a warning); do the same so that
        # the same config.json describes the same model.
        warnings.warn(
            "the last layer must be full attention; treating it as full, as transformers does", stacklevel=3
        )
        types[-1] = FULL
    return types


def _per_layer_geometry(
    data: dict, layer_types: list[str], head_dim: int, num_kv_heads: int
) -> list[tuple[int, int]]:
    """(head_dim, num_kv_heads) of every layer, from either field style."""
    per_layer = data.get("per_layer_config")
    if per_layer is not None:
        if not isinstance(per_layer, dict):
            raise ConfigError("per_layer_config must be an object keyed by layer index")
        overrides: dict[int, dict] = {}
        for key, value in per_layer.items():
            try:
                index = int(key)
            except ValueError:
                raise ConfigError(f"per_layer_config key {key!r} is not a layer index") from None
            if not 0 <= index < len(layer_types):
                raise ConfigError(f"per_layer_config names layer {index}, outside [0, {len(layer_types)})")
            if not isinstance(value, dict):
                raise ConfigError(f"per_layer_config[{key}] must be an object, got {type(value).__name__}")
            unsupported = sorted(set(value) - {"head_dim", "num_key_value_heads"})
            if unsupported:
                raise ConfigError(f"per_layer_config[{key}] overrides unsupported field(s) {unsupported}")
            overrides[index] = {
                field: positive_int(value, field, f"per_layer_config[{key}]") for field in value
            }
        geometry = [
            (
                overrides.get(i, {}).get("head_dim", head_dim),
                overrides.get(i, {}).get("num_key_value_heads", num_kv_heads),
            )
            for i in range(len(layer_types))
        ]
        _check_against_published_style(data, layer_types, geometry)
        return geometry

    global_head_dim = 512  # transformers' default when the field is absent
    if data.get("global_head_dim") is not None:
        global_head_dim = positive_int(data, "global_head_dim")
    global_kv_heads = num_kv_heads
    # The global kv-head count only applies to K=V checkpoints; E2B/E4B full layers keep theirs.
    if data.get("attention_k_eq_v", False) and data.get("num_global_key_value_heads") is not None:
        global_kv_heads = positive_int(data, "num_global_key_value_heads")
    return [
        (global_head_dim, global_kv_heads) if t == FULL else (head_dim, num_kv_heads) for t in layer_types
    ]


def _check_against_published_style(
    data: dict, layer_types: list[str], geometry: list[tuple[int, int]]
) -> None:
    """A config carrying both styles must say the same thing in both."""
    for i, layer_type in enumerate(layer_types):
        if layer_type != FULL:
            continue
        if data.get("global_head_dim") is not None and data["global_head_dim"] != geometry[i][0]:
            raise ConfigError(
                f"global_head_dim={data['global_head_dim']} contradicts per_layer_config head_dim "
                f"{geometry[i][0]} of full layer {i}"
            )
        kv = data.get("num_global_key_value_heads")
        if kv is not None and data.get("attention_k_eq_v") and kv != geometry[i][1]:
            raise ConfigError(
                f"num_global_key_value_heads={kv} contradicts per_layer_config num_key_value_heads "
                f"{geometry[i][1]} of full layer {i}"
            )


def _rope_specs(data: dict, layer_types: list[str], head_dim: int) -> dict[str, RopeSpec]:
    params = data.get("rope_parameters") or DEFAULT_ROPE_PARAMETERS
    if not isinstance(params, dict):
        raise ConfigError("rope_parameters must be an object keyed by layer type")
    # The table of a type is built for the head_dim of that type's layers.
    geometry = _per_layer_geometry(
        {k: v for k, v in data.items() if k != "rope_parameters"},
        layer_types,
        head_dim,
        positive_int(data, "num_key_value_heads"),
    )
    specs = {}
    for layer_type in dict.fromkeys(layer_types):
        p = params.get(layer_type)
        if not isinstance(p, dict):
            raise ConfigError(f"rope_parameters has no entry for {layer_type!r}")
        rope_type = p.get("rope_type", "default")
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ConfigError(
                f"rope_parameters[{layer_type!r}]: unsupported rope_type {rope_type!r} "
                f"(supported: {', '.join(SUPPORTED_ROPE_TYPES)})"
            )
        theta = p.get("rope_theta")
        if theta is None:  # its value, like the other RoPE numbers, was checked by _check_text_numbers
            raise ConfigError(f"rope_parameters[{layer_type!r}] needs a positive rope_theta, got None")
        first = layer_types.index(layer_type)
        specs[layer_type] = RopeSpec(
            rope_type=rope_type,
            theta=float(theta),
            head_dim=geometry[first][0],
            partial_rotary_factor=float(p.get("partial_rotary_factor", 1.0)),
            factor=float(p.get("factor", 1.0)),
        )
    return specs


def _kv_roles(layer_types: list[str], num_shared: int) -> tuple[list[KVRole], list[int]]:
    """Which layers cache their own K/V, which store it for sharing, which reuse it, and from where.

    Every layer from ``num_layers - num_shared`` on reuses the K/V of the *last* earlier layer of the
    same attention type (not a one-to-one mapping).
    """
    num_layers = len(layer_types)
    roles: list[KVRole] = ["own"] * num_layers
    sources = list(range(num_layers))
    if num_shared == 0:
        return roles, sources
    first_shared = num_layers - num_shared
    producer: dict[str, int] = {}
    for i in range(first_shared):
        producer[layer_types[i]] = i
    orphaned = sorted(set(layer_types[first_shared:]) - set(producer))
    if orphaned:
        raise ConfigError(
            f"KV-shared layers of type(s) {orphaned} have no earlier layer of that type to share from "
            f"(num_kv_shared_layers={num_shared})"
        )
    for index in producer.values():
        roles[index] = "store"
    for i in range(first_shared, num_layers):
        roles[i] = "reuse"
        sources[i] = producer[layer_types[i]]
    return roles, sources


def config_from_file(path: str | Path, build: Callable[[dict], Any]) -> Any:
    """``build`` of the ``config.json`` at ``path`` (the file, or its folder): a missing file, one
    larger than any config, invalid JSON and the builder's ConfigError each named with the path."""
    path = Path(path)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"no config.json at {path}")
    size = path.stat().st_size
    if size > MAX_CONFIG_BYTES:
        raise ConfigError(f"{path} is {size:,} bytes, more than any config.json (limit {MAX_CONFIG_BYTES:,})")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ConfigError(f"{path} is not valid JSON: {err}") from err
    try:
        return build(data)
    except ConfigError as err:
        raise ConfigError(f"{path}: {err}") from err
