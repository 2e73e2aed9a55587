"""What a checkpoint costs, from its config.json alone: parameter counts and memory.

The text tower is counted by building our own model on the meta device (no memory, no weights),
so the count is exactly what ``load`` will allocate. The vision and audio towers are counted from
the tensor shapes their checkpoints carry (reference notes §7.2, §7.3).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .config import ModelConfig
from .model import Gemma

GIB = 2**30

# transformers' Gemma4VisionConfig / Gemma4AudioConfig defaults, for fields a config.json omits.
VISION_DEFAULTS = dict(
    hidden_size=768,
    intermediate_size=3072,
    num_hidden_layers=16,
    num_attention_heads=12,
    num_key_value_heads=12,
    head_dim=64,
    patch_size=16,
    position_embedding_size=10240,
    use_clipped_linears=False,
    standardize=False,
)
AUDIO_DEFAULTS = dict(
    hidden_size=1024,
    num_hidden_layers=12,
    num_attention_heads=8,
    subsampling_conv_channels=[128, 32],
    conv_kernel_size=5,
    output_proj_dims=1536,
    use_clipped_linears=True,
)
CLIP_BOUNDS = ("input_min", "input_max", "output_min", "output_max")


@dataclass(frozen=True)
class TensorShape:
    name: str
    shape: tuple[int, ...]
    # Persistent buffers (layer scalars, clip bounds, standardisation) are loaded but not trained.
    buffer: bool = False

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def text_tensors(config: ModelConfig) -> list[TensorShape]:
    with torch.device("meta"):
        model = Gemma(config)
    persistent = set(model.state_dict())
    params = [TensorShape(n, tuple(p.shape)) for n, p in model.named_parameters()]
    buffers = [TensorShape(n, tuple(b.shape), True) for n, b in model.named_buffers() if n in persistent]
    return params + buffers


def _clippable(prefix: str, out_features: int, in_features: int, clipped: bool) -> list[TensorShape]:
    tensors = [TensorShape(f"{prefix}.linear.weight", (out_features, in_features))]
    if clipped:
        tensors += [TensorShape(f"{prefix}.{bound}", (), True) for bound in CLIP_BOUNDS]
    return tensors


def vision_tensors(vision: dict, text_hidden: int) -> list[TensorShape]:
    v = {**VISION_DEFAULTS, **{k: val for k, val in vision.items() if val is not None}}
    d, mlp, heads, kv, hd = (
        v["hidden_size"],
        v["intermediate_size"],
        v["num_attention_heads"],
        v["num_key_value_heads"],
        v["head_dim"],
    )
    clipped = bool(v["use_clipped_linears"])
    t = [
        TensorShape("vision_tower.patch_embedder.input_proj.weight", (d, 3 * v["patch_size"] ** 2)),
        TensorShape(
            "vision_tower.patch_embedder.position_embedding_table", (2, v["position_embedding_size"], d)
        ),
    ]
    for i in range(v["num_hidden_layers"]):
        p = f"vision_tower.encoder.layers.{i}"
        for name, out_f, in_f in (
            ("q_proj", heads * hd, d),
            ("k_proj", kv * hd, d),
            ("v_proj", kv * hd, d),
            ("o_proj", d, heads * hd),
        ):
            t += _clippable(f"{p}.self_attn.{name}", out_f, in_f, clipped)
        t += [TensorShape(f"{p}.self_attn.{n}.weight", (hd,)) for n in ("q_norm", "k_norm")]
        for name, out_f, in_f in (("gate_proj", mlp, d), ("up_proj", mlp, d), ("down_proj", d, mlp)):
            t += _clippable(f"{p}.mlp.{name}", out_f, in_f, clipped)
        norms = (
            "input_layernorm",
            "post_attention_layernorm",
            "pre_feedforward_layernorm",
            "post_feedforward_layernorm",
        )
        t += [TensorShape(f"{p}.{n}.weight", (d,)) for n in norms]
    if v["standardize"]:
        t += [
            TensorShape("vision_tower.std_bias", (d,), True),
            TensorShape("vision_tower.std_scale", (d,), True),
        ]
    t.append(TensorShape("embed_vision.embedding_projection.weight", (text_hidden, d)))
    return t


def audio_tensors(audio: dict, text_hidden: int) -> list[TensorShape]:
    a = {**AUDIO_DEFAULTS, **{k: val for k, val in audio.items() if val is not None}}
    h, heads, kernel = a["hidden_size"], a["num_attention_heads"], a["conv_kernel_size"]
    c0, c1 = a["subsampling_conv_channels"]
    clipped = bool(a["use_clipped_linears"])
    s = "audio_tower.subsample_conv_projection"
    t = [
        TensorShape(f"{s}.layer0.conv.weight", (c0, 1, 3, 3)),
        TensorShape(f"{s}.layer0.norm.weight", (c0,)),
        TensorShape(f"{s}.layer1.conv.weight", (c1, c0, 3, 3)),
        TensorShape(f"{s}.layer1.norm.weight", (c1,)),
        TensorShape(f"{s}.input_proj_linear.weight", (h, (c0 // 4) * c1)),
    ]
    for i in range(a["num_hidden_layers"]):
        p = f"audio_tower.layers.{i}"
        for ffw in ("feed_forward1", "feed_forward2"):
            t += _clippable(f"{p}.{ffw}.ffw_layer_1", 4 * h, h, clipped)
            t += _clippable(f"{p}.{ffw}.ffw_layer_2", h, 4 * h, clipped)
            t += [TensorShape(f"{p}.{ffw}.{n}.weight", (h,)) for n in ("pre_layer_norm", "post_layer_norm")]
        for name in ("q_proj", "k_proj", "v_proj", "post"):
            t += _clippable(f"{p}.self_attn.{name}", h, h, clipped)
        t += [
            TensorShape(f"{p}.self_attn.relative_k_proj.weight", (h, h)),
            TensorShape(f"{p}.self_attn.per_dim_scale", (h // heads,)),
        ]
        t += _clippable(f"{p}.lconv1d.linear_start", 2 * h, h, clipped)
        t += _clippable(f"{p}.lconv1d.linear_end", h, h, clipped)
        t += [
            TensorShape(f"{p}.lconv1d.depthwise_conv1d.weight", (h, 1, kernel)),
            TensorShape(f"{p}.lconv1d.pre_layer_norm.weight", (h,)),
            TensorShape(f"{p}.lconv1d.conv_norm.weight", (h,)),
        ]
        t += [TensorShape(f"{p}.{n}.weight", (h,)) for n in ("norm_pre_attn", "norm_post_attn", "norm_out")]
    out = a["output_proj_dims"]
    t += [
        TensorShape("audio_tower.output_proj.weight", (out, h)),
        TensorShape("audio_tower.output_proj.bias", (out,)),
    ]
    t.append(TensorShape("embed_audio.embedding_projection.weight", (text_hidden, out)))
    return t


def weight_bytes(tensors: list[TensorShape], scheme: str) -> int:
    """Bytes of ``tensors`` stored as bf16, or weight-only int8 / int4 for every matrix.

    int8: one byte per weight plus a bf16 scale per output row; int4: half a byte per weight plus a
    bf16 scale per group of 32. Vectors (norms, scalars) stay bf16.
    """
    total = 0
    for t in tensors:
        if scheme == "bf16" or len(t.shape) < 2:
            total += 2 * t.numel
        elif scheme == "int8":
            total += t.numel + 2 * (t.numel // t.shape[-1])
        elif scheme == "int4":
            total += t.numel // 2 + 2 * math.ceil(t.numel / 32)
        else:
            raise ValueError(f"unknown weight scheme {scheme!r}")
    return total


def kv_cache_bytes(config: ModelConfig, context: int, batch: int, dtype: torch.dtype) -> int:
    """What ``make_cache(batch, context)`` allocates: full layers ``context`` slots, sliding layers
    ``min(window, context)``, KV-shared layers none; keys and values."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    total = 0
    for spec in config.text.layers:
        if spec.kv_role == "reuse":
            continue
        slots = min(spec.window, context) if spec.is_sliding else context
        total += 2 * batch * spec.num_kv_heads * spec.head_dim * slots * itemsize
    return total


def describe(
    config: ModelConfig, *, context: int | None = None, batch: int = 1, dtype: torch.dtype | None = None
) -> dict:
    """Parameter counts and memory of a checkpoint, as a JSON-ready dict."""
    text = config.text
    context = context or text.max_position_embeddings
    kv_dtype = dtype or {"float32": torch.float32, "float16": torch.float16}.get(
        config.dtype or "", torch.bfloat16
    )
    towers = {"language_model": text_tensors(config)}
    if config.vision is not None:
        towers["vision"] = vision_tensors(config.vision, text.hidden_size)
    if config.audio is not None:
        towers["audio"] = audio_tensors(config.audio, text.hidden_size)
    everything = [t for tensors in towers.values() for t in tensors]

    def count(tensors):
        return sum(t.numel for t in tensors if not t.buffer)

    ple = sum(t.numel for t in towers["language_model"] if t.name.endswith("embed_tokens_per_layer.weight"))
    total = count(everything)
    kv_layers = [s for s in text.layers if s.kv_role != "reuse"]
    return {
        "model_type": config.model_type,
        "layers": text.num_hidden_layers,
        "sliding_layers": sum(s.is_sliding for s in text.layers),
        "full_layers": sum(not s.is_sliding for s in text.layers),
        "kv_shared_layers": text.num_kv_shared_layers,
        "sliding_window": text.sliding_window,
        "params_total": total,
        "params_by_tower": {name: count(tensors) for name, tensors in towers.items()},
        "params_ple_table": ple,
        "params_effective": total - ple,
        "buffers_total": sum(t.numel for t in everything if t.buffer),
        "weights_bytes": {scheme: weight_bytes(everything, scheme) for scheme in ("bf16", "int8", "int4")},
        "ple_table_bytes_bf16": 2 * ple,
        "context": context,
        "batch": batch,
        "kv_cache_dtype": str(kv_dtype).removeprefix("torch."),
        "kv_cache_layers": {
            "sliding": sum(s.is_sliding for s in kv_layers),
            "full": sum(not s.is_sliding for s in kv_layers),
        },
        "kv_cache_bytes": kv_cache_bytes(config, context, batch, kv_dtype),
    }


def format_report(info: dict) -> str:
    def n(x):
        return f"{x / 1e9:.3f} B" if x >= 1e8 else f"{x / 1e6:.3f} M"

    def b(x):
        return f"{x / GIB:.2f} GiB"

    lines = [
        f"{info['model_type']}: {info['layers']} layers ({info['sliding_layers']} sliding, {info['full_layers']} full, "
        f"{info['kv_shared_layers']} KV-shared), sliding window {info['sliding_window']}",
        "",
        "parameters",
        f"  total                {n(info['params_total']):>12}  ({info['params_total']:,})",
    ]
    for name, count in info["params_by_tower"].items():
        lines.append(f"  {name:<20} {n(count):>12}")
    if info["params_ple_table"]:
        lines.append(
            f"  per-layer embeddings {n(info['params_ple_table']):>12}  (a lookup table; can live off the accelerator)"
        )
        lines.append(
            f"  effective            {n(info['params_effective']):>12}  (total without the PLE table)"
        )
    lines += ["", "weights"]
    for scheme, size in info["weights_bytes"].items():
        lines.append(f"  {scheme:<20} {b(size):>12}")
    lines += [
        "",
        f"KV cache ({info['kv_cache_dtype']}, context {info['context']:,}, batch {info['batch']}: "
        f"{info['kv_cache_layers']['sliding']} sliding + {info['kv_cache_layers']['full']} full layers cache K/V)",
        f"  {'total':<20} {b(info['kv_cache_bytes']):>12}  ({info['kv_cache_bytes']:,} bytes)",
    ]
    return "\n".join(lines)
