"""Model configuration: frozen data built from a checkpoint's ``config.json``.

``ModelConfig.from_hf`` is the only place that knows Hugging Face key names and defaults. Everything
the model needs per layer (attention type, head geometry, RoPE table, KV role, MLP width, MoE) is
derived once here into ``LayerSpec`` records; modules read their spec and never re-derive it.

Two field styles are accepted for the full-attention geometry:

* the published one: ``global_head_dim`` and ``num_global_key_value_heads`` at the top level, and
* the one transformers 5.23 writes on save: ``per_layer_config = {"<layer>": {"head_dim": ...,
  "num_key_value_heads": ...}}`` with overrides for the full-attention layers only.
"""

from __future__ import annotations

import dataclasses
import json
import math
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch

SLIDING = "sliding_attention"
FULL = "full_attention"
LayerType = Literal["sliding_attention", "full_attention"]

# "own": computes and caches its K/V. "store": the same, and later layers reuse what it attended to.
# "reuse": no k/v weights and no cache; attends to its source layer's keys and values.
KVRole = Literal["own", "store", "reuse"]

SUPPORTED_MODEL_TYPES = ("gemma4", "gemma4_text", "gemma3", "gemma3_text", "gemma3n", "gemma3n_text")
# Gemma 4 12B "unified" (encoder-free): the gemma4 decoder without PLE or MoE; image patches and audio
# frames are projected straight into it (model/unified.py).
UNIFIED_MODEL_TYPES = ("gemma4_unified", "gemma4_unified_text")
SUPPORTED_MODEL_TYPES += UNIFIED_MODEL_TYPES
SUPPORTED_ROPE_TYPES = ("default", "proportional", "linear")

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


class ConfigError(ValueError):
    """A config.json that cannot describe a model we can build."""


@dataclass(frozen=True)
class RopeSpec:
    """One rotary table: the frequencies of ``rope_type`` over a ``head_dim``-wide head."""

    rope_type: str
    theta: float
    head_dim: int
    partial_rotary_factor: float = 1.0
    factor: float = 1.0

    def inv_freq(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Inverse frequencies, ``head_dim // 2`` entries, as the reference computes them: in float32
        (``dtype``: float64 for a float64 model, which computes without float32 steps).

        On the CPU whatever the default device: a model built on the meta device would otherwise
        run these through torch's reference ops, which import torch._dynamo (seconds).
        """
        if self.rope_type == "default":
            exponents = torch.arange(0, self.head_dim, 2, dtype=dtype, device="cpu") / self.head_dim
            inv = 1.0 / (self.theta**exponents)
        elif self.rope_type == "proportional":
            # Only the first `partial_rotary_factor` of the frequencies rotate; their exponents are
            # still over the full head_dim, and the remaining ones are zero (cos 1, sin 0).
            rotated = int(self.partial_rotary_factor * self.head_dim // 2)
            exponents = (
                torch.arange(0, 2 * rotated, 2, dtype=torch.int64, device="cpu").to(dtype) / self.head_dim
            )
            inv = 1.0 / (self.theta**exponents)
            still = self.head_dim // 2 - rotated
            if still > 0:
                inv = torch.cat((inv, torch.zeros(still, dtype=dtype, device="cpu")))
        elif self.rope_type == "linear":
            # Position interpolation (Gemma 3's global layers): default frequencies / factor.
            exponents = (
                torch.arange(0, self.head_dim, 2, dtype=torch.int64, device="cpu").to(dtype) / self.head_dim
            )
            inv = 1.0 / (self.theta**exponents)
        else:
            raise ConfigError(f"unsupported rope_type {self.rope_type!r}")
        # The reference's default rope ignores any `factor`; the scaled types divide by it.
        return inv if self.rope_type == "default" else inv / self.factor


@dataclass(frozen=True)
class LayerSpec:
    """Everything that differs between decoder layers, written down once."""

    index: int
    attention_type: LayerType
    head_dim: int
    num_kv_heads: int
    kv_role: KVRole
    # The layer whose keys/values this layer attends to (itself unless kv_role == "reuse").
    kv_source: int
    # Full layers of K=V checkpoints have no v_proj: values are the raw k_proj output.
    k_eq_v: bool
    intermediate_size: int
    moe: bool
    # Keys a query may see, itself included; None for full attention.
    window: int | None
    # Gemma 3n: the fraction of MLP gate activations zeroed by a Gaussian top-k (0: dense).
    activation_sparsity: float = 0.0

    @property
    def is_sliding(self) -> bool:
        return self.attention_type == SLIDING

    @property
    def has_kv_weights(self) -> bool:
        return self.kv_role != "reuse"


@dataclass(frozen=True)
class MediaVocabulary:
    """Gemma 3n: token ids in [offset, end) (end None: every id from offset) that a tower's embedder
    (``embed_{name}``) embeds from its own table, row ``id - offset`` of ``size`` rows of width
    ``hidden_size``, instead of the text embedding table."""

    name: str  # "vision" or "audio"
    offset: int
    end: int | None
    size: int
    hidden_size: int
    rms_norm_eps: float
    # Also embeds a built tower's soft tokens (Gemma 3n's audio conformer): a soft_embedding_norm.
    soft_tokens: bool = False


@dataclass(frozen=True)
class TextConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    sliding_window: int
    layer_types: tuple[str, ...]
    rope: dict[str, RopeSpec]
    final_logit_softcapping: float | None
    tie_word_embeddings: bool
    pad_token_id: int
    bos_token_id: int | None
    eos_token_id: tuple[int, ...]
    max_position_embeddings: int
    use_bidirectional_attention: str | None
    hidden_size_per_layer_input: int
    vocab_size_per_layer_input: int
    num_kv_shared_layers: int
    use_double_wide_mlp: bool
    attention_k_eq_v: bool
    enable_moe_block: bool
    num_experts: int | None
    top_k_experts: int | None
    moe_intermediate_size: int | None
    layers: tuple[LayerSpec, ...]
    # Numerics in which Gemma 3 differs from Gemma 4, written down as data (Gemma 4 values by default).
    # Gemma 1-3 RMSNorm: rsqrt and a (1 + w) scale, the checkpoint storing w.
    norm_plus_one: bool = False
    # Multiplies q·k: 1 in Gemma 4 (the QK norms replace 1/sqrt(d)); query_pre_attn_scalar^-1/2 in Gemma 3.
    attention_scale: float = 1.0
    use_v_norm: bool = True
    use_layer_scalar: bool = True
    # Encoder-style attention (EmbeddingGemma): full layers see every key, sliding layers |q - k| < window.
    bidirectional: bool = False
    # Gemma 3n: AltUp keeps this many copies of the residual stream; the layers compute on the
    # `altup_active_idx` one and predict/correct the others (0: a single stream, no AltUp).
    altup_num_inputs: int = 0
    altup_active_idx: int = 0
    # Gemma 3n: the corrected active stream is scaled (correct_output_scale) before the PLE gate.
    altup_correct_scale: bool = False
    # Gemma 3n: LAuReL, a low-rank learned residual beside attention (0: none).
    laurel_rank: int = 0
    # Gemma 3n keeps the PLE scales (H^-1/2 and 2^-1/2) as tensors of the model dtype; Gemma 4
    # multiplies by Python floats.
    ple_scales_in_model_dtype: bool = False
    # Gemma 4 runs the KV-shared layers on the kept positions only when logits_to_keep > 0 (as
    # transformers' generate does); transformers' Gemma 3n always runs every position.
    trim_kv_shared_layers: bool = True
    # Gemma 3n (model_type gemma3n): ids the vision and audio embedders embed from their own tables
    # instead of embed_tokens, in the order they are applied.
    media_vocabularies: tuple[MediaVocabulary, ...] = ()
    # Which layers let an image's tokens see each other both ways (use_bidirectional_attention "vision"):
    # "sliding" (gemma4: sliding layers, within the window) or "all" (gemma4_unified, as transformers'
    # forward builds its masks: every layer, and a block is seen whole even past the window).
    vision_block_layers: Literal["sliding", "all"] = "sliding"

    @property
    def has_per_layer_inputs(self) -> bool:
        return self.hidden_size_per_layer_input > 0

    @property
    def has_altup(self) -> bool:
        return self.altup_num_inputs > 0

    @property
    def first_kv_shared_layer(self) -> int:
        return self.num_hidden_layers - self.num_kv_shared_layers


@dataclass(frozen=True)
class VisionConfig:
    """The vision encoder: a ViT over 2-D patch grids, pooled k x k into soft tokens."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    patch_size: int
    pooling_kernel_size: int
    # Rows of the learned (x, y) position table: the widest/tallest grid in patches it can place.
    position_embedding_size: int
    rope_theta: float
    # E2B/E4B: every linear clamps its input and output to bounds stored in the checkpoint.
    use_clipped_linears: bool
    # 26B/31B: soft tokens are standardised with a stored bias and scale.
    standardize: bool


@dataclass(frozen=True)
class AudioConfig:
    """The audio encoder: convolutional subsampling, then conformer layers with chunked local attention."""

    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    subsampling_conv_channels: tuple[int, int]
    conv_kernel_size: int
    residual_weight: float
    attention_chunk_size: int
    attention_context_left: int
    attention_context_right: int
    attention_logit_cap: float
    attention_invalid_logits_value: float
    use_clipped_linears: bool
    rms_norm_eps: float
    gradient_clipping: float
    output_proj_dims: int

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads


@dataclass(frozen=True)
class UnifiedVisionConfig:
    """The 12B unified model's image embedder: no encoder; k x k merged patches go through
    LayerNorm, Linear, LayerNorm, a factorised (x, y) position table and a LayerNorm."""

    patch_size: int
    pooling_kernel_size: int
    mm_embed_dim: int
    # Rows of the (x, y) position table: the widest/tallest grid in merged patches it can place.
    mm_posemb_size: int
    rms_norm_eps: float
    # Input width of the projection into the decoder (transformers reads it from here, not from
    # mm_embed_dim: the two must agree for a checkpoint to run).
    output_proj_dims: int

    @property
    def model_patch_size(self) -> int:
        """Pixels per side of one merged patch (one soft token)."""
        return self.patch_size * self.pooling_kernel_size


@dataclass(frozen=True)
class UnifiedAudioConfig:
    """The 12B unified model's audio embedder: raw waveform frames of ``audio_embed_dim`` samples."""

    audio_embed_dim: int
    rms_norm_eps: float


@dataclass(frozen=True)
class Gemma3nAudioConfig:
    """Gemma 3n's audio encoder (a USM conformer) and how its soft tokens enter the prompt."""

    input_feat_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    conv_kernel_size: int
    reduction_factor: int
    residual_weight: float
    attention_chunk_size: int
    attention_context_left: int
    attention_context_right: int
    attention_logit_cap: float
    gradient_clipping: float
    rms_norm_eps: float
    # The two subsampling convolutions: output channels, (time, frequency) kernels and strides.
    conv_channels: tuple[int, int]
    conv_kernels: tuple[tuple[int, int], tuple[int, int]]
    conv_strides: tuple[tuple[int, int], tuple[int, int]]
    conv_group_norm_eps: float
    # Every clip fills this many placeholders (audio_token_id), its padding with embed_audio's last row.
    soft_tokens_per_clip: int
    audio_token_id: int

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def max_past_horizon(self) -> int:
        return max(0, self.attention_context_left - 1)

    @property
    def context_right(self) -> int:
        return self.attention_context_right


@dataclass(frozen=True)
class ModelConfig:
    """A whole checkpoint: the text decoder plus, for ``gemma4``, its vision and audio towers."""

    model_type: str
    text: TextConfig
    token_ids: dict[str, int]
    # The checkpoint's own dtype ("bfloat16", ...), when config.json names one.
    dtype: str | None
    # The towers the model builds (None when config.json has none).
    vision_config: VisionConfig | None = None
    audio_config: AudioConfig | None = None
    # gemma4_unified: the encoder-free image and audio embedders (no vision or audio tower).
    unified_vision: UnifiedVisionConfig | None = None
    unified_audio: UnifiedAudioConfig | None = None
    # gemma3n: its audio conformer (its MobileNet-V5 vision tower is not built).
    gemma3n_audio: Gemma3nAudioConfig | None = None
    # A model saved quantized by torchgemma: {"mode": ..., "layers": {module: {bits, group_size,
    # has_mins, scale_dtype?}}} (config.json's "quantization_config", quant_method "torchgemma").
    quantization: dict | None = None
    # The config.json dict this was built from, kept to write it out again (torchgemma.save).
    source: dict | None = dataclasses.field(default=None, repr=False, compare=False)

    @classmethod
    def from_file(cls, path: str | Path) -> ModelConfig:
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        if not path.is_file():
            raise FileNotFoundError(f"no config.json at {path}")
        size = path.stat().st_size
        if size > MAX_CONFIG_BYTES:
            raise ConfigError(
                f"{path} is {size:,} bytes, more than any config.json (limit {MAX_CONFIG_BYTES:,})"
            )
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError as err:
            raise ConfigError(f"{path} is not valid JSON: {err}") from err
        try:
            return cls.from_hf(data)
        except ConfigError as err:
            raise ConfigError(f"{path}: {err}") from err

    @classmethod
    def from_hf(cls, data: dict) -> ModelConfig:
        """Build from the dict of a Hugging Face ``config.json`` (``gemma4`` or ``gemma4_text``)."""
        if not isinstance(data, dict):
            raise ConfigError(f"config must be a JSON object, got {type(data).__name__}")
        model_type = data.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ConfigError(
                f"unsupported model_type {model_type!r}; torchgemma builds {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        media: tuple[MediaVocabulary, ...] = ()
        gemma3n_audio = None
        unified = model_type in UNIFIED_MODEL_TYPES
        if model_type in ("gemma4", "gemma3", "gemma3n", "gemma4_unified"):
            text_data = data.get("text_config")
            if not isinstance(text_data, dict):
                raise ConfigError(f"model_type {model_type!r} needs a 'text_config' object")
            text_data = dict(text_data)
            # The top level decides weight tying for the multimodal model.
            if "tie_word_embeddings" in data:
                text_data["tie_word_embeddings"] = data["tie_word_embeddings"]
            vision = data.get("vision_config")
            audio = data.get("audio_config")
            # transformers spells the end-of-audio id `eoa_token_index`; a null id takes the default.
            spelled = {**data, "eoa_token_id": data.get("eoa_token_id", data.get("eoa_token_index"))}
            token_ids = {
                k: int(v if spelled.get(k) is None else spelled[k])
                for k, v in MULTIMODAL_TOKEN_DEFAULTS.items()
            }
            if model_type == "gemma3":
                # Only Gemma 3's text model is built; its (SigLIP) vision tower is not.
                vision, audio, token_ids = None, None, {}
            elif model_type == "gemma3n":
                # Gemma 3n's audio conformer is built, its MobileNet-V5 vision tower is not; both
                # embedders' token tables are, as text-only prompts and generated ids may use those ids.
                media = _media_vocabularies(vision, audio)
                gemma3n_audio = _gemma3n_audio_from_hf(audio, data)
                vision, audio, token_ids = None, None, {}
        else:
            text_data, vision, audio, token_ids = data, None, None, {}
        dtype = data.get("dtype") or data.get("torch_dtype") or text_data.get("dtype")
        for name, sub in (("vision_config", vision), ("audio_config", audio)):
            if sub is not None and not isinstance(sub, dict):
                raise ConfigError(f"{name} must be an object or null, got {type(sub).__name__}")
        if unified:
            text_data = {**UNIFIED_TEXT_DEFAULTS, **text_data, **UNIFIED_TEXT_FORCED}
        family = next((f for f in ("gemma3n", "gemma3") if model_type.startswith(f)), "gemma4")
        text = _text_config_from_hf(text_data, family)
        if media:
            text = dataclasses.replace(text, media_vocabularies=_check_media(media, text.vocab_size))
        if unified:
            text = dataclasses.replace(text, vision_block_layers="all")
        if model_type == "gemma3" and text.final_logit_softcapping is not None:
            # transformers 5.23's Gemma3ForConditionalGeneration never soft-caps its logits (only
            # Gemma3ForCausalLM does; published Gemma 3 configs set the cap to null): follow it.
            text = dataclasses.replace(text, final_logit_softcapping=None)
        return cls(
            model_type=model_type,
            text=text,
            token_ids=token_ids,
            dtype=dtype,
            vision_config=None if vision is None or unified else _vision_config_from_hf(vision),
            audio_config=None if audio is None or unified else _audio_config_from_hf(audio),
            unified_vision=_unified_vision_from_hf(vision) if unified and vision is not None else None,
            unified_audio=_unified_audio_from_hf(audio) if unified and audio is not None else None,
            gemma3n_audio=gemma3n_audio,
            quantization=_quantization_from_hf(data.get("quantization_config")),
            source=data,
        )


def _quantization_from_hf(data: Any) -> dict | None:
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


def _text_config_from_hf(data: dict, family: str = "gemma4") -> TextConfig:
    """``family``: "gemma4", "gemma3" or "gemma3n", whose text configs are read as Gemma 4's fields."""
    missing = [key for key in REQUIRED_TEXT_FIELDS if data.get(key) is None]
    if missing:
        raise ConfigError(f"text config is missing required field(s): {', '.join(missing)}")
    # Checked before anything is sized from them: a per-layer list of 10^9 entries takes minutes.
    num_layers = _positive_int(data, "num_hidden_layers")
    _check_text_numbers(data)
    numerics: dict[str, Any] = {}
    per_layer: dict[str, list] = {}
    if family == "gemma3":
        data, numerics = _gemma3_as_gemma4_fields(data)
    elif family == "gemma3n":
        data, numerics, per_layer = _gemma3n_as_gemma4_fields(data, num_layers)
    get = {**TEXT_DEFAULTS, **{k: v for k, v in data.items() if v is not None or k in TEXT_DEFAULTS}}.get

    hidden = _positive_int(data, "hidden_size")
    num_heads = _positive_int(data, "num_attention_heads")
    num_kv_heads = _positive_int(data, "num_key_value_heads")
    head_dim = _positive_int(data, "head_dim")
    if get("hidden_activation") not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise ConfigError(f"unsupported hidden_activation {get('hidden_activation')!r}")
    if get("attention_bias"):
        raise ConfigError("attention_bias=true is not part of Gemma 4 and is not supported")

    bidirectional = get("use_bidirectional_attention")
    if bidirectional not in (None, "vision"):
        raise ConfigError(
            f"use_bidirectional_attention={bidirectional!r} is not supported (None or 'vision' are)"
        )

    # Only Gemma 4 forces a full-attention last layer.
    layer_types = _layer_types(data, num_layers, force_last_full=family == "gemma4")
    rope = _rope_specs(data, layer_types, head_dim)
    geometry = _per_layer_geometry(data, layer_types, head_dim, num_kv_heads)
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

    num_shared = get("num_kv_shared_layers")
    if isinstance(num_shared, bool) or not isinstance(num_shared, int) or not 0 <= num_shared < num_layers:
        raise ConfigError(f"num_kv_shared_layers={num_shared} must be in [0, num_hidden_layers={num_layers})")
    roles, sources = _kv_roles(layer_types, num_shared)

    moe = bool(get("enable_moe_block"))
    if moe:
        for key in ("num_experts", "top_k_experts", "moe_intermediate_size"):
            _positive_int(data, key, "enable_moe_block=true")
        if data["top_k_experts"] > data["num_experts"]:
            raise ConfigError(
                f"top_k_experts={data['top_k_experts']} exceeds num_experts={data['num_experts']}"
            )

    per_layer_input = _positive_int(
        {"hidden_size_per_layer_input": get("hidden_size_per_layer_input") or 0},
        "hidden_size_per_layer_input",
        minimum=0,
    )
    per_layer_vocab = _positive_int(
        {"vocab_size_per_layer_input": get("vocab_size_per_layer_input")},
        "vocab_size_per_layer_input",
        f"hidden_size_per_layer_input={per_layer_input}" if per_layer_input else "",
        minimum=1 if per_layer_input else 0,
    )

    intermediate = _positive_int(data, "intermediate_size")
    widths = per_layer.get("intermediate_size", [intermediate] * num_layers)
    sparsity = per_layer.get("activation_sparsity", [0.0] * num_layers)
    double_wide = bool(get("use_double_wide_mlp"))
    k_eq_v = bool(get("attention_k_eq_v"))
    window = _positive_int({"sliding_window": get("sliding_window")}, "sliding_window")
    layers = tuple(
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
        for i in range(num_layers)
    )

    # Ids outside the vocabulary would be an IndexError in the middle of generation.
    vocab_size = _positive_int(data, "vocab_size")
    eos = get("eos_token_id")
    eos_list = eos if isinstance(eos, list | tuple) else ([] if eos is None else [eos])
    eos_ids = tuple(_token_id(t, "eos_token_id", vocab_size) for t in eos_list)
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
        pad_token_id=_token_id(get("pad_token_id"), "pad_token_id", vocab_size),
        bos_token_id=None if bos is None else _token_id(bos, "bos_token_id", vocab_size),
        eos_token_id=eos_ids,
        max_position_embeddings=_positive_int(
            {"max_position_embeddings": get("max_position_embeddings")}, "max_position_embeddings"
        ),
        use_bidirectional_attention=bidirectional,
        hidden_size_per_layer_input=per_layer_input,
        vocab_size_per_layer_input=per_layer_vocab,
        num_kv_shared_layers=num_shared,
        use_double_wide_mlp=double_wide,
        attention_k_eq_v=k_eq_v,
        enable_moe_block=moe,
        num_experts=data.get("num_experts") if moe else None,
        top_k_experts=data.get("top_k_experts") if moe else None,
        moe_intermediate_size=data.get("moe_intermediate_size") if moe else None,
        layers=layers,
        **numerics,
    )


def _gemma3_as_gemma4_fields(data: dict) -> tuple[dict, dict[str, Any]]:
    """A Gemma 3 text config as the fields above, plus the numerics in which Gemma 3 differs.

    Gemma 3 has one head geometry for both layer types, no PLE, KV sharing or MoE, and carries its
    RoPE settings in older keys (``rope_theta``, ``rope_local_base_freq``, ``rope_scaling``) that
    transformers folds into per-type ``rope_parameters``; so do we.
    """
    d = dict(data)
    bidirectional = bool(d.get("use_bidirectional_attention") or False)
    if d.get("sliding_window", 4096) is None:
        raise ConfigError("sliding_window must be set for Gemma 3")
    window = _positive_int({"sliding_window": 4096, **d}, "sliding_window")
    if bidirectional:
        # transformers halves the window of bidirectional models (and writes the original back on save).
        window = window // 2 + 1
    if d.get("layer_types") is None:
        pattern = _positive_int({"sliding_window_pattern": 6, **d}, "sliding_window_pattern")
        d["layer_types"] = [
            FULL if (i + 1) % pattern == 0 else SLIDING for i in range(d["num_hidden_layers"])
        ]
    d.update(
        sliding_window=window,
        rope_parameters=_rope_from_older_keys(d),
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
    return d, numerics


def _rope_from_older_keys(d: dict) -> dict:
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


def _gemma3n_as_gemma4_fields(data: dict, num_layers: int) -> tuple[dict, dict[str, Any], dict[str, list]]:
    """A Gemma 3n text config as the fields above, the numerics in which Gemma 3n differs, and its
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
    widths = [_positive_int({"intermediate_size": w}, "intermediate_size") for w in widths]
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
    altup = _positive_int(d, "altup_num_inputs")
    active = _positive_int(d, "altup_active_idx", minimum=0)
    if active >= altup:
        raise ConfigError(f"altup_active_idx={active} is not one of the {altup} AltUp streams")
    if not _positive_int(d, "hidden_size_per_layer_input"):
        raise ConfigError("Gemma 3n needs hidden_size_per_layer_input > 0")
    d.update(
        intermediate_size=widths[0],
        rope_parameters=_rope_from_older_keys(d),
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
        laurel_rank=_positive_int(d, "laurel_rank"),
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
        _check_numbers(v, {"rms_norm_eps": POSITIVE}, where)
        out.append(
            MediaVocabulary(
                name=name,
                offset=_positive_int(v, "vocab_offset", where, minimum=0),
                end=None,
                size=_positive_int(v, "vocab_size", where),
                hidden_size=_positive_int(v, "hidden_size", where),
                rms_norm_eps=float(v["rms_norm_eps"]),
            )
        )
    # transformers: vision ids run up to the first audio id; audio ids are every id from there.
    # The audio tower is built, its soft tokens go through embed_audio; the vision tower is not.
    vision, audio = out
    return (dataclasses.replace(vision, end=audio.offset), dataclasses.replace(audio, soft_tokens=True))


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
    _check_numbers(a, numbers, where)
    ints = {
        key: _positive_int(a, key, where)
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
    right = _positive_int(a, "conf_attention_context_right", where, minimum=0)
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
    soft = _positive_int(
        {"n": top.get("audio_soft_tokens_per_image", 188)}, "n", "audio_soft_tokens_per_image"
    )
    token = _positive_int({"id": top.get("audio_token_id", 262_273)}, "id", "audio_token_id", minimum=0)
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


def _vision_config_from_hf(data: dict) -> VisionConfig:
    v = {**VISION_DEFAULTS, **{k: val for k, val in data.items() if val is not None}}
    ints = {
        key: _positive_int(v, key, "vision_config")
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
    _check_numbers({"rms_norm_eps": v["rms_norm_eps"], "rope_theta": theta}, VISION_NUMBERS, "vision_config")
    return VisionConfig(
        **ints,
        rms_norm_eps=float(v["rms_norm_eps"]),
        rope_theta=float(theta),
        use_clipped_linears=bool(v["use_clipped_linears"]),
        standardize=bool(v["standardize"]),
    )


def _audio_config_from_hf(data: dict) -> AudioConfig:
    a = {**AUDIO_DEFAULTS, **{k: val for k, val in data.items() if val is not None}}
    _check_numbers(a, AUDIO_NUMBERS, "audio_config")
    ints = {
        key: _positive_int(a, key, "audio_config")
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
    right = _positive_int(a, "attention_context_right", "audio_config", minimum=0)
    channels = a["subsampling_conv_channels"]
    if not isinstance(channels, list | tuple) or len(channels) != 2:
        raise ConfigError(
            f"audio_config: subsampling_conv_channels must be two positive ints, got {channels!r}"
        )
    for channel in channels:
        _positive_int({"subsampling_conv_channels": channel}, "subsampling_conv_channels", "audio_config")
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


def _unified_vision_from_hf(data: dict) -> UnifiedVisionConfig:
    v = {**UNIFIED_VISION_DEFAULTS, **{k: val for k, val in data.items() if val is not None}}
    _check_numbers(v, {"rms_norm_eps": POSITIVE}, "vision_config")
    ints = {
        key: _positive_int(v, key, "vision_config")
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
    _check_numbers(a, {"rms_norm_eps": POSITIVE}, "audio_config")
    return UnifiedAudioConfig(
        audio_embed_dim=_positive_int(a, "audio_embed_dim", "audio_config"),
        rms_norm_eps=float(a["rms_norm_eps"]),
    )


def _positive_int(data: dict, key: str, where: str = "", minimum: int = 1) -> int:
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


def _check_numbers(data: dict, rules: dict[str, str], where: str = "") -> None:
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


def _check_text_numbers(data: dict) -> None:
    """The text config's float fields, its RoPE parameters in both spellings included."""
    _check_numbers(data, TEXT_NUMBERS)
    scaling = data.get("rope_scaling")
    if isinstance(scaling, dict):
        _check_numbers(scaling, ROPE_NUMBERS, "rope_scaling")
    params = data.get("rope_parameters")
    if isinstance(params, dict):
        for layer_type, p in params.items():
            if isinstance(p, dict):
                _check_numbers(p, ROPE_NUMBERS, f"rope_parameters[{layer_type!r}]")


def _token_id(value: Any, key: str, vocab_size: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < vocab_size:
        raise ConfigError(f"{key}={value!r} is not a token id of the vocabulary (vocab_size={vocab_size})")
    return value


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
                field: _positive_int(value, field, f"per_layer_config[{key}]") for field in value
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
        global_head_dim = _positive_int(data, "global_head_dim")
    global_kv_heads = num_kv_heads
    # The global kv-head count only applies to K=V checkpoints; E2B/E4B full layers keep theirs.
    if data.get("attention_k_eq_v", False) and data.get("num_global_key_value_heads") is not None:
        global_kv_heads = _positive_int(data, "num_global_key_value_heads")
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
        _positive_int(data, "num_key_value_heads"),
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
