"""The records a model's config is made of: frozen data, read from a checkpoint's ``config.json`` by
``config/hf.py`` (``ModelConfig``, in ``config/model_config.py``, holds one of each).

Everything the model needs per layer (attention type, head geometry, RoPE table, KV role, MLP width,
MoE) is derived once into ``LayerSpec`` records; modules read their spec and never re-derive it.
What a model family changes (Gemma 3's numerics, Gemma 3n's AltUp, the unified model's embedders)
is written down as data here too: fields of ``TextConfig``, tower configs, and a ``Family``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

import torch

SLIDING = "sliding_attention"
FULL = "full_attention"
LayerType = Literal["sliding_attention", "full_attention"]

# "own": computes and caches its K/V. "store": the same, and later layers reuse what it attended to.
# "reuse": no k/v weights and no cache; attends to its source layer's keys and values.
KVRole = Literal["own", "store", "reuse"]


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
    # "windowed" (gemma3, as transformers' create_masks_for_vision_model): every layer, but a sliding
    # layer's window still bounds what an image token sees.
    vision_block_layers: Literal["sliding", "all", "windowed"] = "sliding"
    # EmbeddingGemma 2: per-layer inputs from the context projection alone (no token table, no
    # 2^-1/2 blend), and the final states projected to this width (0: none) as the sentence states.
    ple_token_table: bool = True
    embedding_dim: int = 0

    @property
    def states_width(self) -> int:
        """The width of the states ``TextModel(..., head=False)`` returns (sentence embeddings pool them)."""
        return self.embedding_dim or self.hidden_size

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
class SiglipVisionConfig:
    """Gemma 3's vision tower (a SigLIP ViT over a fixed square image) and its projector, which
    average-pools the patch grid into ``mm_tokens_per_image`` soft tokens."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    image_size: int
    patch_size: int
    layer_norm_eps: float
    mm_tokens_per_image: int

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def patches_per_side(self) -> int:
        return self.image_size // self.patch_size

    @property
    def tokens_per_side(self) -> int:
        return math.isqrt(self.mm_tokens_per_image)


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


def _same(name: str) -> str:
    return name


@dataclass(frozen=True)
class Family:
    """What one model family changes in how its ``config.json`` reads and its checkpoint names its
    tensors (config/gemma4.py, gemma4_unified.py, gemma3.py, gemma3n.py). Code outside the config
    asks ``ModelConfig.family`` (or the properties built on it) instead of comparing ``model_type``.
    """

    # The multimodal model_type; the family's text-only checkpoints are "{name}_text".
    name: str
    # A multimodal config.json's top level, once its text config is read: (top level, text) -> the
    # text config (adjusted) and the ModelConfig fields of what is built beside it (towers, token ids).
    top_level: Callable[[dict, TextConfig], tuple[TextConfig, dict[str, Any]]]
    # transformers' defaults for the text fields a published config.json may leave out (Gemma 3 4B
    # and up write only the fields that differ from Gemma3TextConfig's), filled in before reading.
    text_defaults: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    # The text config as the Gemma 4 fields config/hf.py reads, plus the TextConfig fields (numerics)
    # in which the family differs and its per-layer lists: (text config, layers) -> the three.
    text_fields: Callable[[dict, int], tuple[dict, dict[str, Any], dict[str, list]]] | None = None
    # transformers forces the last decoder layer to full attention (with a warning).
    last_layer_full: bool = True
    # The module path of a checkpoint tensor (layout prefixes already mapped), None for a part that
    # is not built; and back, the checkpoint name (less "model.") of a module path.
    module_path: Callable[[str], str | None] = _same
    checkpoint_path: Callable[[str], str] = _same
    # Images and audio enter as placeholders expanded into soft tokens (a multimodal layout).
    takes_media: bool = False
    # Media are projected into the decoder by embedders, without towers (model/unified.py).
    encoder_free: bool = False
    # Why config.json's towers are not all built (None: whatever it describes is built).
    towers_note: str | None = None
