"""Gemma 3's mmproj GGUF: llama.cpp's file for the SigLIP tower and projector (projector type
``gemma3``), read into the module paths of ``model/siglip.py`` with the tower's config.

llama.cpp ships a multimodal model's vision tower apart from its text model, as an "mmproj" GGUF
(``general.architecture`` "clip") that ``convert_hf_to_gguf.py --mmproj`` writes. The names below
are those of the converter llama-cpp-python 0.3.36 vendors (``conversion/gemma.py``:
``Gemma3VisionModel``; gguf-py's ``constants.py``; ``tools/mtmd/clip.cpp`` reads them), checked
against its own conversion of a tiny checkpoint (tests/data/gemma3_mmproj/make_fixture.py). The
converter stores ``mm.soft_emb_norm`` as ``1 + w`` (Gemma 3's RMSNorm scale), which is undone here;
every other tensor is stored as transformers holds it (the GGUF dimension order reversed, as always).

Not wired into ``load`` yet: ``load(..., mmproj=)`` is another change's (Gemma 4's); its loader can
take Gemma 3's tower through ``read_gemma3_mmproj``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from ...config import SiglipVisionConfig
from .blocks import dequantize
from .reader import GGUFError, _GGUFFile

PROJECTOR_TYPE = "gemma3"

# v.blk.N.{GGUF} -> vision_tower.encoder.layers.N.{module}
LAYER_NAMES = {
    "ln1": "layer_norm1",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_out": "self_attn.out_proj",
    "ln2": "layer_norm2",
    "ffn_up": "mlp.fc1",
    "ffn_down": "mlp.fc2",
}
GLOBAL_NAMES = {
    "v.patch_embd": "vision_tower.embeddings.patch_embedding",
    "v.position_embd": "vision_tower.embeddings.position_embedding",
    "v.post_ln": "vision_tower.post_layernorm",
    "mm.soft_emb_norm": "multi_modal_projector.mm_soft_emb_norm",
}
# A bare parameter in transformers (mm_input_projection_weight), a ".weight" in the GGUF.
PROJECTION = ("mm.input_projection.weight", "multi_modal_projector.mm_input_projection_weight")
SHIFTED = "multi_modal_projector.mm_soft_emb_norm.weight"  # stored as 1 + w


def module_path(name: str) -> str:
    """The module path (``Gemma``'s, as ``state_dict`` names it) of an mmproj tensor name."""
    if name == PROJECTION[0]:
        return PROJECTION[1]
    stem, _, leaf = name.rpartition(".")
    parts = stem.split(".")
    if len(parts) == 4 and parts[:2] == ["v", "blk"] and parts[2].isdigit() and parts[3] in LAYER_NAMES:
        return f"vision_tower.encoder.layers.{parts[2]}.{LAYER_NAMES[parts[3]]}.{leaf}"
    if stem in GLOBAL_NAMES:
        return f"{GLOBAL_NAMES[stem]}.{leaf}"
    raise GGUFError(f"mmproj tensor {name!r} is not part of Gemma 3's vision tower")


def siglip_config(metadata: dict[str, Any]) -> SiglipVisionConfig:
    """The tower's config from an mmproj file's ``clip.*`` metadata."""
    projector = metadata.get("clip.projector_type", metadata.get("clip.vision.projector_type"))
    if projector != PROJECTOR_TYPE:
        raise GGUFError(f"mmproj projector type {projector!r} is not Gemma 3's ({PROJECTOR_TYPE!r})")

    def get(key: str) -> Any:
        if f"clip.vision.{key}" not in metadata:
            raise GGUFError(f"mmproj metadata lacks clip.vision.{key}")
        return metadata[f"clip.vision.{key}"]

    image_size, patch_size = int(get("image_size")), int(get("patch_size"))
    # Patches per side over soft tokens per side; clip.cpp's default (4) is Gemma 3's 64 -> 16.
    scale = int(metadata.get("clip.vision.projector.scale_factor", 4))
    side = image_size // patch_size // scale
    return SiglipVisionConfig(
        hidden_size=int(get("embedding_length")),
        intermediate_size=int(get("feed_forward_length")),
        num_hidden_layers=int(get("block_count")),
        num_attention_heads=int(get("attention.head_count")),
        image_size=image_size,
        patch_size=patch_size,
        layer_norm_eps=float(get("attention.layer_norm_epsilon")),
        mm_tokens_per_image=side * side,
    )


def read_gemma3_mmproj(
    path: str | Path, dtype: torch.dtype = torch.float32
) -> tuple[SiglipVisionConfig, dict[str, torch.Tensor]]:
    """An mmproj file's config and tensors by module path, dequantized to ``dtype``."""
    file = _GGUFFile(Path(path))
    config = siglip_config(file.metadata)
    tensors = {}
    for name, info in file.tensors.items():
        file.check(info)
        tensor = dequantize(file.raw(info), info.qtype, info.shape, torch.float32)
        path_name = module_path(name)
        if path_name == SHIFTED:
            tensor = tensor - 1.0  # the model computes 1 + w again: the stored value comes back
        tensors[path_name] = tensor.to(dtype)
    # Per layer: two LayerNorms and six linears (attention, MLP), each with a bias; then the patch embedding
    # (with bias), positions, post_layernorm (with bias), the projector's norm and matrix.
    expected = 16 * config.num_hidden_layers + 7
    if len(tensors) != expected:
        raise GGUFError(f"{Path(path).name}: {len(tensors)} tensors, Gemma 3's tower has {expected}")
    return config, tensors
