"""llama.cpp's ``mmproj`` names for Gemma 3n's vision tower -> Hugging Face checkpoint names.

llama.cpp ships a multimodal model's towers as a separate ``mmproj`` GGUF file. Its converter
(``convert_hf_to_gguf.py``, ``Gemma3nVisionAudioModel``; projector type ``gemma3nv``) writes
MobileNet-V5's blocks as ``v.blk.{stage}.{block}.<timm's own suffix>``, the stem, the adapter and the
vision embedder through ``gguf.tensor_mapping`` (``v.conv_stem.conv``, ``v.msfa.*``, ``mm.*``), and
stores the stem's bias as (1, C, 1, 1) (it means to do so for layer scales too, but those are all
in blocks, which it names and writes before that step). Its block table has no ``dw_end`` (the
published blocks have none). Checked against that converter's output for a tiny checkpoint
(llama-cpp-python 0.3.36's, by hand: CI has no llama.cpp): every tensor maps back, values equal.

This module only names the tensors (``gemma3n_vision_name``) and undoes that reshape
(``gemma3n_vision_tensor``); loading an ``mmproj`` file with a model GGUF is the ``mmproj=`` path's
job, which is not on this branch.
"""

from __future__ import annotations

import re

import torch

_TOWER = "model.vision_tower.timm_model."
# gguf.tensor_mapping's Gemma 3n entries (the converter maps these names through it).
GEMMA3N_VISION_NAMES = {
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
}
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
_BLOCK = re.compile(r"v\.blk\.(\d{1,4})\.(\d{1,4})\.(.+)")
# Stored as (1, C, 1, 1) by the converter; (C,) in the checkpoint.
_UNSQUEEZED = "conv_stem.conv.bias"


def gemma3n_vision_name(gguf_name: str) -> str | None:
    """The Hugging Face name of a Gemma 3n ``mmproj`` vision tensor, None if it is not one."""
    if gguf_name in GEMMA3N_VISION_NAMES:
        return GEMMA3N_VISION_NAMES[gguf_name]
    match = _BLOCK.fullmatch(gguf_name)
    if match and match[3] in GEMMA3N_BLOCK_SUFFIXES:
        return f"{_TOWER}blocks.{match[1]}.{match[2]}.{match[3]}"
    return None


def gemma3n_vision_tensor(hf_name: str, tensor: torch.Tensor) -> torch.Tensor:
    """A tensor as read from the ``mmproj`` file, in the checkpoint's shape."""
    if hf_name.endswith(_UNSQUEEZED):
        if tensor.dim() != 4 or tensor.shape[0] != 1 or tensor.shape[2:] != (1, 1):
            raise ValueError(f"{hf_name}: expected the converter's (1, C, 1, 1), got {tuple(tensor.shape)}")
        return tensor.reshape(-1)
    return tensor
