"""mmproj tensor names -> Hugging Face names: one ``TowerNames`` table per llama.cpp projector type.

llama.cpp ships a model's vision and audio towers apart from its text model, in an "mmproj" GGUF
(``general.architecture`` "clip") that ``convert_hf_to_gguf.py --mmproj`` writes. Each tower is
named by its projector type (``clip.vision.projector_type`` / ``clip.audio.projector_type``). The
tables here are those of the converter that llama-cpp-python 0.3.36 vendors
(conversion/gemma.py: ``Gemma4VisionAudioModel``, ``Gemma3VisionModel``; gguf-py's tensor_mapping; tools/mtmd/clip.cpp,
which reads them), checked against that converter's own output of a tiny checkpoint
(tests/data/make_mmproj_fixture.py).

Adding a tower (Gemma 3n's ``gemma3nv`` / ``gemma3na``): write its
``TowerNames`` (the converter's per-layer and global names to the checkpoint's, the converter's
changes undone by ``Transform``s, e.g. Gemma 3's ``soft_emb_norm`` stored as ``1 + w``, and the
Hugging Face ``{vision,audio}_config`` its metadata and tensor shapes give), register it in
``TOWERS``, and give its ``layout`` a ``MultimodalLayout`` in ``LAYOUTS`` (the top-level
``model_type``, the media token texts, the text config fields the pair decides). Strictness comes
with it: mmproj.py refuses tensors no table names and checks every tensor against the model the
config builds. Test it on llama.cpp's own conversion: tests/data/make_mmproj_fixture.py.

Gemma 3n's vision tower (``GEMMA3N_VISION``, below) is named but not yet registered in ``TOWERS``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from .reader import GGUFError, _TensorInfo

BOUNDS = ("input_min", "input_max", "output_min", "output_max")


@dataclass(frozen=True)
class Transform:
    """How the converter changed a tensor, undone: ``apply`` on values, ``shape`` on shapes."""

    apply: Callable[[torch.Tensor], torch.Tensor]
    shape: Callable[[tuple[int, ...]], tuple[int, ...]]


def _inverse_softplus(y: torch.Tensor) -> torch.Tensor:
    """The float32 x with softplus(x) == y: the converter stores softplus(per_dim_scale) and the model
    computes softplus of what it loads. log(expm1(y)) in float64, then the nearest float32 neighbour
    whose float32 softplus gives y back exactly (the closest one where none does)."""
    wide = y.double()
    guess = torch.where(wide > 20, wide, torch.log(torch.expm1(wide))).float()
    best = guess
    for step in (1, -1, 2, -2):
        candidate = guess
        for _ in range(abs(step)):
            candidate = torch.nextafter(candidate, torch.full_like(candidate, math.copysign(math.inf, step)))
        exact = torch.nn.functional.softplus(candidate) == y
        best = torch.where(exact & (torch.nn.functional.softplus(best) != y), candidate, best)
    return best


SCALAR = Transform(lambda t: t.reshape(()), lambda s: ())  # the converter makes scalars 1-D
# Gemma 4 vision: input_proj [D, P*P*3] (pixels in (row, column, channel) order) is stored as a
# [D, 3, P, P] convolution kernel.
PATCH_KERNEL = Transform(
    lambda t: t.permute(0, 2, 3, 1).reshape(t.shape[0], -1),
    lambda s: (s[0], s[1] * s[2] * s[3]) if len(s) == 4 else s,
)
DEPTHWISE = Transform(lambda t: t.unsqueeze(1), lambda s: (s[0], 1, *s[1:]))  # [C, 1, K] stored [C, K]
SOFTPLUS = Transform(_inverse_softplus, lambda s: s)


def _hwc_order(t: torch.Tensor, dim: int) -> torch.Tensor:
    """Gemma 4 12B Unified: the converter reorders the patch values of patch_dense's columns and
    patch_ln1 from (row, column, channel) to (channel, row, column), ggml's im2col order; put back."""
    n = t.shape[dim]
    p = math.isqrt(n // 3)
    i = torch.arange(n)
    hwc = (i % (p * p)) // p * p * 3 + i % p * 3 + i // (p * p)  # the HWC index of CHW position i
    return torch.empty_like(t).index_copy_(dim, hwc, t)


PATCH_COLUMNS = Transform(lambda t: _hwc_order(t, t.dim() - 1), lambda s: s)
# The unified position table [P, 2, D] is stored [2, P, D].
POSITION_PAIRS = Transform(lambda t: t.permute(1, 0, 2).contiguous(), lambda s: (s[1], s[0], *s[2:]))


@dataclass(frozen=True)
class TowerNames:
    """How llama.cpp's converter names (and stores) one tower of an mmproj file."""

    projector: str  # the projector type, e.g. "gemma4v"
    modality: str  # "vision" or "audio"
    models: tuple[str, ...]  # the text architectures (general.architecture) it pairs with
    # {layer_prefix}N.{GGUF suffix} -> {hf_layer_prefix}N.{HF suffix}
    layer_prefix: str
    hf_layer_prefix: str
    layer: dict[str, str]
    # GGUF name -> HF name, outside the layers
    globals: dict[str, str]
    # GGUF suffix or global name -> the converter's change, undone
    transforms: dict[str, Transform] = field(default_factory=dict)
    # The HF config key and dict of this tower, from the file's metadata and tensor shapes.
    config: Callable[[Mapping[str, Any], Mapping[str, _TensorInfo], str], tuple[str, dict]] | None = None
    # HF clippable linears (".linear.weight"): their bounds sit beside the GGUF weight.
    clip_bounds: bool = False
    # The MultimodalLayout (LAYOUTS) the towers and the text model make together.
    layout: str = "gemma4"
    # Top-level config.json fields of this tower (Gemma 3's mm_tokens_per_image), as ``config``.
    top_level: Callable[[Mapping[str, Any], Mapping[str, _TensorInfo], str], dict] | None = None
    # How many indices number a layer: 2 for MobileNet-V5's blocks (stage.block).
    layer_depth: int = 1

    def owns(self, name: str) -> bool:
        return name in self.globals or name.startswith(self.layer_prefix)

    def hf_name(self, name: str) -> tuple[str, Transform | None] | None:
        """The Hugging Face name of one mmproj tensor of this tower and the transform that undoes
        the converter's change, or None if the table has no such name."""
        if name in self.globals:
            return self.globals[name], self.transforms.get(name)
        if not name.startswith(self.layer_prefix):
            return None
        parts = name.removeprefix(self.layer_prefix).split(".", self.layer_depth)
        if len(parts) <= self.layer_depth or not all(p.isdigit() and str(int(p)) == p for p in parts[:-1]):
            return None
        layer, suffix = ".".join(parts[:-1]), parts[-1]
        if suffix in self.layer:
            return f"{self.hf_layer_prefix}{layer}.{self.layer[suffix]}", self.transforms.get(suffix)
        base, _, bound = suffix.rpartition(".")
        hf_weight = self.layer.get(f"{base}.weight", "")
        if self.clip_bounds and bound in BOUNDS and hf_weight.endswith(".linear.weight"):
            return f"{self.hf_layer_prefix}{layer}.{hf_weight.removesuffix('linear.weight')}{bound}", SCALAR
        return None


def clip_meta(metadata: Mapping[str, Any], modality: str, key: str, fname: str, default: Any = None) -> Any:
    full = f"clip.{modality}.{key}"
    if full in metadata:
        return metadata[full]
    if default is None:
        raise GGUFError(f"{fname} lacks the metadata key {full}")
    return default


def _shape(tensors: Mapping[str, _TensorInfo], name: str, fname: str) -> tuple[int, ...]:
    if name not in tensors:
        raise GGUFError(f"{fname} lacks tensor {name}")
    return tensors[name].shape


def _gemma4_vision_config(meta: Mapping[str, Any], tensors: Mapping[str, _TensorInfo], fname: str):
    """Gemma4VisionAudioModel writes the ViT's sizes; head size, KV heads and the position table's
    rows come from tensor shapes. llama.cpp (clip.cpp, PROJECTOR_TYPE_GEMMA4V) fixes the pooling at
    3 x 3 unless ``clip.vision.projector.scale_factor`` says otherwise, and the RoPE base at 100."""
    m = lambda key, default=None: clip_meta(meta, "vision", key, fname, default)  # noqa: E731
    head_dim = _shape(tensors, "v.blk.0.attn_q_norm.weight", fname)[0]
    patch = _shape(tensors, "v.patch_embd.weight", fname)
    return "vision_config", {
        "hidden_size": m("embedding_length"),
        "intermediate_size": m("feed_forward_length"),
        "num_hidden_layers": m("block_count"),
        "num_attention_heads": m("attention.head_count"),
        "num_key_value_heads": _shape(tensors, "v.blk.0.attn_k.weight", fname)[0] // head_dim,
        "head_dim": head_dim,
        "patch_size": patch[-1],
        "pooling_kernel_size": m("projector.scale_factor", 3),
        "position_embedding_size": _shape(tensors, "v.position_embd.weight", fname)[1],
        "rms_norm_eps": m("attention.layer_norm_epsilon", 1e-6),
        "rope_parameters": {"rope_type": "default", "rope_theta": 100.0},
        "use_clipped_linears": any(n.startswith("v.") and n.endswith(".input_max") for n in tensors),
        "standardize": "v.std_bias" in tensors,
    }


def _gemma4_audio_config(meta: Mapping[str, Any], tensors: Mapping[str, _TensorInfo], fname: str):
    """The conformer's sizes; its attention chunking, logit cap and residual weight are not written
    (llama.cpp's graph, models/gemma4a.cpp, fixes them at transformers' defaults, as do we), and its
    norm epsilon is 1e-6 whatever the file says (clip.cpp: the converter once wrote a wrong value)."""
    m = lambda key, default=None: clip_meta(meta, "audio", key, fname, default)  # noqa: E731
    return "audio_config", {
        "hidden_size": m("embedding_length"),
        "num_hidden_layers": m("block_count"),
        "num_attention_heads": m("attention.head_count"),
        "subsampling_conv_channels": [
            _shape(tensors, "a.conv1d.0.weight", fname)[0],
            _shape(tensors, "a.conv1d.1.weight", fname)[0],
        ],
        "conv_kernel_size": _shape(tensors, "a.blk.0.conv_dw.weight", fname)[-1],
        "output_proj_dims": _shape(tensors, "a.pre_encode.out.weight", fname)[0],
        "rms_norm_eps": 1e-6,
        "use_clipped_linears": any(n.startswith("a.") and n.endswith(".input_max") for n in tensors),
    }


GEMMA4_VISION = TowerNames(
    projector="gemma4v",
    modality="vision",
    models=("gemma4",),
    layer_prefix="v.blk.",
    hf_layer_prefix="model.vision_tower.encoder.layers.",
    layer={
        "ln1.weight": "input_layernorm.weight",
        "attn_q.weight": "self_attn.q_proj.linear.weight",
        "attn_k.weight": "self_attn.k_proj.linear.weight",
        "attn_v.weight": "self_attn.v_proj.linear.weight",
        "attn_out.weight": "self_attn.o_proj.linear.weight",
        "attn_q_norm.weight": "self_attn.q_norm.weight",
        "attn_k_norm.weight": "self_attn.k_norm.weight",
        "attn_post_norm.weight": "post_attention_layernorm.weight",
        "ln2.weight": "pre_feedforward_layernorm.weight",
        "ffn_gate.weight": "mlp.gate_proj.linear.weight",
        "ffn_up.weight": "mlp.up_proj.linear.weight",
        "ffn_down.weight": "mlp.down_proj.linear.weight",
        "ffn_post_norm.weight": "post_feedforward_layernorm.weight",
    },
    globals={
        "v.patch_embd.weight": "model.vision_tower.patch_embedder.input_proj.weight",
        "v.position_embd.weight": "model.vision_tower.patch_embedder.position_embedding_table",
        "v.std_bias": "model.vision_tower.std_bias",
        "v.std_scale": "model.vision_tower.std_scale",
        "mm.input_projection.weight": "model.embed_vision.embedding_projection.weight",
    },
    transforms={"v.patch_embd.weight": PATCH_KERNEL},
    config=_gemma4_vision_config,
    clip_bounds=True,
)

GEMMA4_AUDIO = TowerNames(
    projector="gemma4a",
    modality="audio",
    models=("gemma4",),
    layer_prefix="a.blk.",
    hf_layer_prefix="model.audio_tower.layers.",
    layer={
        "ffn_norm.weight": "feed_forward1.pre_layer_norm.weight",
        "ffn_up.weight": "feed_forward1.ffw_layer_1.linear.weight",
        "ffn_down.weight": "feed_forward1.ffw_layer_2.linear.weight",
        "ffn_post_norm.weight": "feed_forward1.post_layer_norm.weight",
        "attn_pre_norm.weight": "norm_pre_attn.weight",
        "attn_q.weight": "self_attn.q_proj.linear.weight",
        "attn_k.weight": "self_attn.k_proj.linear.weight",
        "attn_v.weight": "self_attn.v_proj.linear.weight",
        "attn_out.weight": "self_attn.post.linear.weight",
        "attn_k_rel.weight": "self_attn.relative_k_proj.weight",
        "per_dim_scale.weight": "self_attn.per_dim_scale",
        "attn_post_norm.weight": "norm_post_attn.weight",
        # The converter's mapping swaps these two names (clip.cpp reads them swapped back).
        "conv_norm.weight": "lconv1d.pre_layer_norm.weight",
        "norm_conv.weight": "lconv1d.conv_norm.weight",
        "conv_pw1.weight": "lconv1d.linear_start.linear.weight",
        "conv_dw.weight": "lconv1d.depthwise_conv1d.weight",
        "conv_pw2.weight": "lconv1d.linear_end.linear.weight",
        "ffn_norm_1.weight": "feed_forward2.pre_layer_norm.weight",
        "ffn_up_1.weight": "feed_forward2.ffw_layer_1.linear.weight",
        "ffn_down_1.weight": "feed_forward2.ffw_layer_2.linear.weight",
        "ffn_post_norm_1.weight": "feed_forward2.post_layer_norm.weight",
        "ln2.weight": "norm_out.weight",
    },
    globals={
        "a.conv1d.0.weight": "model.audio_tower.subsample_conv_projection.layer0.conv.weight",
        "a.conv1d.0.norm.weight": "model.audio_tower.subsample_conv_projection.layer0.norm.weight",
        "a.conv1d.1.weight": "model.audio_tower.subsample_conv_projection.layer1.conv.weight",
        "a.conv1d.1.norm.weight": "model.audio_tower.subsample_conv_projection.layer1.norm.weight",
        "a.input_projection.weight": "model.audio_tower.subsample_conv_projection.input_proj_linear.weight",
        "a.pre_encode.out.weight": "model.audio_tower.output_proj.weight",
        "a.pre_encode.out.bias": "model.audio_tower.output_proj.bias",
        "mm.a.input_projection.weight": "model.embed_audio.embedding_projection.weight",
    },
    transforms={"conv_dw.weight": DEPTHWISE, "per_dim_scale.weight": SOFTPLUS},
    config=_gemma4_audio_config,
    clip_bounds=True,
)


def _unified_vision_config(meta: Mapping[str, Any], tensors: Mapping[str, _TensorInfo], fname: str):
    """The 12B's encoder-free image embedder: llama.cpp (clip.cpp, PROJECTOR_TYPE_GEMMA4UV) merges
    3 x 3 patches unless ``clip.vision.projector.scale_factor`` says otherwise."""
    m = lambda key, default=None: clip_meta(meta, "vision", key, fname, default)  # noqa: E731
    width = m("embedding_length")
    return "vision_config", {
        "patch_size": m("patch_size"),
        "pooling_kernel_size": m("projector.scale_factor", 3),
        "mm_embed_dim": width,
        "mm_posemb_size": _shape(tensors, "v.position_embd.weight", fname)[1],
        "output_proj_dims": width,
        "rms_norm_eps": m("attention.layer_norm_epsilon", 1e-6),
    }


def _unified_audio_config(meta: Mapping[str, Any], tensors: Mapping[str, _TensorInfo], fname: str):
    m = lambda key, default=None: clip_meta(meta, "audio", key, fname, default)  # noqa: E731
    return "audio_config", {
        "audio_embed_dim": m("embedding_length"),
        "rms_norm_eps": m("attention.layer_norm_epsilon", 1e-6),
    }


# Gemma 4 12B Unified (Gemma4UnifiedVisionAudioModel): no encoder layers, only the embedders.
UNIFIED_VISION = TowerNames(
    projector="gemma4uv",
    modality="vision",
    models=("gemma4",),
    layer_prefix="v.blk.",
    hf_layer_prefix="model.vision_embedder.layers.",  # none: the embedder has no layers
    layer={},
    globals={
        "v.patch_norm.1.weight": "model.vision_embedder.patch_ln1.weight",
        "v.patch_norm.1.bias": "model.vision_embedder.patch_ln1.bias",
        "v.patch_embd.weight": "model.vision_embedder.patch_dense.weight",
        "v.patch_embd.bias": "model.vision_embedder.patch_dense.bias",
        "v.patch_norm.2.weight": "model.vision_embedder.patch_ln2.weight",
        "v.patch_norm.2.bias": "model.vision_embedder.patch_ln2.bias",
        "v.position_embd.weight": "model.vision_embedder.pos_embedding",
        # The converter renames pos_norm to patch_ln3 (so to patch_norm.3) to reuse the name scheme.
        "v.patch_norm.3.weight": "model.vision_embedder.pos_norm.weight",
        "v.patch_norm.3.bias": "model.vision_embedder.pos_norm.bias",
        "mm.input_projection.weight": "model.embed_vision.embedding_projection.weight",
    },
    transforms={
        "v.patch_embd.weight": PATCH_COLUMNS,
        "v.patch_norm.1.weight": PATCH_COLUMNS,
        "v.patch_norm.1.bias": PATCH_COLUMNS,
        "v.position_embd.weight": POSITION_PAIRS,
    },
    config=_unified_vision_config,
    layout="gemma4_unified",
)
UNIFIED_AUDIO = TowerNames(
    projector="gemma4ua",
    modality="audio",
    models=("gemma4",),
    layer_prefix="a.blk.",
    hf_layer_prefix="model.embed_audio.layers.",  # none
    layer={},
    globals={"mm.a.input_projection.weight": "model.embed_audio.embedding_projection.weight"},
    config=_unified_audio_config,
    layout="gemma4_unified",
)


def _gemma3_vision_config(meta: Mapping[str, Any], tensors: Mapping[str, _TensorInfo], fname: str):
    """SigLIP's sizes (Gemma3VisionModel writes them); transformers' SiglipVisionConfig fields."""
    m = lambda key, default=None: clip_meta(meta, "vision", key, fname, default)  # noqa: E731
    return "vision_config", {
        "hidden_size": m("embedding_length"),
        "intermediate_size": m("feed_forward_length"),
        "num_hidden_layers": m("block_count"),
        "num_attention_heads": m("attention.head_count"),
        "image_size": m("image_size"),
        "patch_size": m("patch_size"),
        "layer_norm_eps": m("attention.layer_norm_epsilon", 1e-6),
    }


def _gemma3_soft_tokens(meta: Mapping[str, Any], tensors: Mapping[str, _TensorInfo], fname: str) -> dict:
    """Soft tokens per image: the patch grid average-pooled by ``clip.vision.projector.scale_factor``
    per side (the converter writes it only when it is not 4, Gemma 3's 64 -> 16; clip.cpp's default)."""
    m = lambda key, default=None: clip_meta(meta, "vision", key, fname, default)  # noqa: E731
    side = m("image_size") // m("patch_size") // m("projector.scale_factor", 4)
    return {"mm_tokens_per_image": side * side}


# Gemma 3 4B-27B (Gemma3VisionModel): SigLIP's layers, then the projector (a (1 + w) RMSNorm, which
# the converter stores as 1 + w, and a bare matrix, written with ".weight").
_SIGLIP_LAYER = {
    "ln1": "layer_norm1",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_out": "self_attn.out_proj",
    "ln2": "layer_norm2",
    "ffn_up": "mlp.fc1",
    "ffn_down": "mlp.fc2",
}
_SIGLIP_GLOBAL = {
    "v.patch_embd": "model.vision_tower.embeddings.patch_embedding",
    "v.position_embd": "model.vision_tower.embeddings.position_embedding",
    "v.post_ln": "model.vision_tower.post_layernorm",
}
GEMMA3_VISION = TowerNames(
    projector="gemma3",
    modality="vision",
    models=("gemma3",),
    layer_prefix="v.blk.",
    hf_layer_prefix="model.vision_tower.encoder.layers.",
    layer={f"{g}.{leaf}": f"{hf}.{leaf}" for g, hf in _SIGLIP_LAYER.items() for leaf in ("weight", "bias")},
    globals={
        **{f"{g}.{leaf}": f"{hf}.{leaf}" for g, hf in _SIGLIP_GLOBAL.items() for leaf in ("weight", "bias")},
        "mm.soft_emb_norm.weight": "model.multi_modal_projector.mm_soft_emb_norm.weight",
        "mm.input_projection.weight": "model.multi_modal_projector.mm_input_projection_weight",
    },
    transforms={"mm.soft_emb_norm.weight": Transform(lambda t: t - 1.0, lambda s: s)},
    config=_gemma3_vision_config,
    layout="gemma3",
    top_level=_gemma3_soft_tokens,
)

TOWERS: dict[str, TowerNames] = {
    t.projector: t for t in (GEMMA4_VISION, GEMMA4_AUDIO, UNIFIED_VISION, UNIFIED_AUDIO, GEMMA3_VISION)
}


@dataclass(frozen=True)
class MultimodalLayout:
    """The multimodal checkpoint a text architecture's GGUF and an mmproj make together."""

    model_type: str  # the top-level config.json model_type
    architecture: str
    # config.json field -> the token text llama.cpp's vocabulary holds (looked up by text)
    media_tokens: dict[str, str]
    # The text model's tensors under the multimodal checkpoint: "model." + this + the rest.
    text_prefix: str = "language_model."
    # The text config fields the pair decides (given the text config dict and the towers' configs).
    text_fields: Callable[[dict, dict], dict] = lambda text, towers: {}


def _gemma4_text_fields(text: dict, towers: dict) -> dict:
    """Image tokens attend to each other on 26B/31B, not on E2B/E4B: llama.cpp decides by the text
    width (mtmd_decode_use_non_causal: causal for 1536 and 2560, E2B's and E4B's); transformers'
    config says ``use_bidirectional_attention: "vision"``. GGUF records neither: the published models
    that take per-layer embeddings (E2B, E4B) are the causal ones, so that is the rule here."""
    return {"use_bidirectional_attention": None if text.get("hidden_size_per_layer_input") else "vision"}


GEMMA4_MEDIA_TOKENS = {
    "boi_token_id": "<|image>",
    "eoi_token_id": "<image|>",
    "image_token_id": "<|image|>",
    "audio_token_id": "<|audio|>",
    "boa_token_id": "<|audio>",
    "eoa_token_id": "<audio|>",
    "video_token_id": "<|video|>",
}

# By TowerNames.layout.
LAYOUTS: dict[str, MultimodalLayout] = {
    "gemma4": MultimodalLayout(
        model_type="gemma4",
        architecture="Gemma4ForConditionalGeneration",
        media_tokens=GEMMA4_MEDIA_TOKENS,
        text_fields=_gemma4_text_fields,
    ),
    # 12B Unified: its text model converts as gemma4; images attend both ways (llama.cpp:
    # mtmd_decode_use_non_causal is true for gemma4uv; transformers' default "vision").
    "gemma4_unified": MultimodalLayout(
        model_type="gemma4_unified",
        architecture="Gemma4UnifiedForConditionalGeneration",
        media_tokens=GEMMA4_MEDIA_TOKENS,
        text_fields=lambda text, towers: {"use_bidirectional_attention": "vision"},
    ),
    # Gemma 3 4B-27B: image blocks attend both ways on every layer (config/gemma3.py sets that for
    # every gemma3 checkpoint; llama.cpp: mtmd_decode_use_non_causal for gemma3).
    "gemma3": MultimodalLayout(
        model_type="gemma3",
        architecture="Gemma3ForConditionalGeneration",
        media_tokens={
            "boi_token_index": "<start_of_image>",
            "eoi_token_index": "<end_of_image>",
            "image_token_index": "<image_soft_token>",
        },
    ),
}


# ── Gemma 3n's vision tower (projector type gemma3nv) ────────────────────────────────────────────
# The converter (convert_hf_to_gguf.py, Gemma3nVisionAudioModel) writes MobileNet-V5's blocks as
# v.blk.{stage}.{block}.<timm's own suffix>, the stem, the adapter and the vision embedder through
# gguf.tensor_mapping (v.conv_stem.conv, v.msfa.*, mm.*), and stores the stem's bias as (1, C, 1, 1)
# (it means to do so for layer scales too, but those are all in blocks, which it names and writes
# before that step). Its block table has no dw_end (the published blocks have none). Checked against
# that converter's output for a tiny checkpoint (llama-cpp-python 0.3.36's, by hand: CI has no
# llama.cpp): every tensor maps back, values equal. Not in TOWERS yet, and not testable against
# llama.cpp's own conversion, because (checked 2026-11-28 on llama.cpp 0c1e570):
# * that converter stops on any Gemma 3n checkpoint with "Can not map tensor
#   'model.audio_tower.subsample_conv_projection.conv_0.norm.weight'": the audio subsampler's two
#   group-norm scales (conv_0, conv_1; transformers has named them so since 4.53) are the only
#   audio tensors gguf.tensor_mapping has no name for, and the converter writes vision and audio
#   into one file, so no Gemma 3n mmproj comes out at all;
# * llama.cpp runs no Gemma 3n audio (clip.cpp skips a gemma3nv file's audio tower), so gemma3na
#   has no reader whose layout a table here could follow (Gemma 3n's conformer has no batch norm:
#   the converter's folding is for lfm2's names and never applies);
# * a copy of a checkpoint without its audio tensors converts, vision only, when its blocks have
#   no dw_end; the block list (strides, kernel sizes, heads), which llama.cpp infers from the
#   tensors (clip.cpp, mobilenetv5.cpp), still has no config function here.

_TOWER = "model.vision_tower.timm_model."
# The converter's block_tensor_mapping: timm's suffix kept as it is.
GEMMA3N_BLOCK_SUFFIXES = frozenset(
    [f"{part}.weight" for part in ("conv_exp", "bn1", "conv_pwl", "bn2", "norm")]
    + [
        f"{conv}.{kind}.weight"
        for conv in ("dw_start", "dw_mid", "pw_exp", "pw_proj")
        for kind in ("conv", "bn")
    ]
    + [f"attn.{head}.proj.weight" for head in ("query", "key", "value", "output")]
    + [f"attn.{head}.{part}.weight" for head in ("key", "value") for part in ("down_conv", "norm")]
    + ["layer_scale.gamma"]
)


def _stem_bias(tensor: torch.Tensor) -> torch.Tensor:
    if tensor.dim() != 4 or tensor.shape[0] != 1 or tensor.shape[2:] != (1, 1):
        raise ValueError(
            f"conv_stem.conv.bias: expected the converter's (1, C, 1, 1), got {tuple(tensor.shape)}"
        )
    return tensor.reshape(-1)


GEMMA3N_VISION = TowerNames(
    projector="gemma3nv",
    modality="vision",
    models=("gemma3n",),
    layer_prefix="v.blk.",
    hf_layer_prefix=_TOWER + "blocks.",
    layer={suffix: suffix for suffix in GEMMA3N_BLOCK_SUFFIXES},
    # gguf.tensor_mapping's Gemma 3n entries (the converter maps these names through it).
    globals={
        "v.conv_stem.conv.weight": _TOWER + "conv_stem.conv.weight",
        "v.conv_stem.conv.bias": _TOWER + "conv_stem.conv.bias",
        "v.conv_stem.bn.weight": _TOWER + "conv_stem.bn.weight",
        "v.msfa.ffn.pw_exp.conv.weight": _TOWER + "msfa.ffn.pw_exp.conv.weight",
        "v.msfa.ffn.pw_exp.bn.weight": _TOWER + "msfa.ffn.pw_exp.bn.weight",
        "v.msfa.ffn.pw_proj.conv.weight": _TOWER + "msfa.ffn.pw_proj.conv.weight",
        "v.msfa.ffn.pw_proj.bn.weight": _TOWER + "msfa.ffn.pw_proj.bn.weight",
        "v.msfa.norm.weight": _TOWER + "msfa.norm.weight",
        "mm.embedding.weight": "model.embed_vision.embedding.weight",
        "mm.hard_emb_norm.weight": "model.embed_vision.hard_embedding_norm.weight",
        "mm.input_projection.weight": "model.embed_vision.embedding_projection.weight",
        "mm.soft_emb_norm.weight": "model.embed_vision.soft_embedding_norm.weight",
    },
    transforms={"v.conv_stem.conv.bias": Transform(_stem_bias, lambda s: (s[1],) if len(s) == 4 else s)},
    layout="gemma3n",
    layer_depth=2,
)
