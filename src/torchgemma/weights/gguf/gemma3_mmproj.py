"""Gemma 3's mmproj GGUF on its own: llama.cpp's file for the SigLIP tower and projector (projector
type ``gemma3``), read into the module paths of ``model/siglip.py`` with the tower's config.

The names and the converter's one change (``mm.soft_emb_norm`` stored as ``1 + w``) are
``mmproj_names.GEMMA3_VISION``'s, the table through which ``load(model.gguf, mmproj=...)`` reads the
file beside a Gemma 3 model GGUF (mmproj.py); this module reads the tower alone (tested against
llama.cpp's own conversion of a tiny checkpoint: tests/data/gemma3_mmproj/).
"""

from __future__ import annotations

from pathlib import Path

import torch

from ...config import SiglipVisionConfig
from ...config.gemma3 import siglip_from_hf
from .mmproj import MmprojFile
from .mmproj_names import GEMMA3_VISION
from .reader import GGUFError, _GGUFFile


def module_path(name: str) -> str:
    """The module path (``Gemma``'s, as ``state_dict`` names it) of an mmproj tensor name."""
    found = GEMMA3_VISION.hf_name(name)
    if found is None:
        raise GGUFError(f"mmproj tensor {name!r} is not part of Gemma 3's vision tower")
    return found[0].removeprefix("model.")


def read_gemma3_mmproj(
    path: str | Path, dtype: torch.dtype = torch.float32
) -> tuple[SiglipVisionConfig, dict[str, torch.Tensor]]:
    """An mmproj file's config and tensors by module path, dequantized to ``dtype``."""
    mmproj = MmprojFile(_GGUFFile(Path(path)))  # refuses names outside the tower
    if mmproj.towers != [GEMMA3_VISION]:
        kinds = ", ".join(tower.projector for tower in mmproj.towers)
        raise GGUFError(f"{mmproj.name}: projector type {kinds}, not Gemma 3's ({GEMMA3_VISION.projector!r})")
    config = siglip_from_hf(mmproj.configs())
    tensors = {e.hf_name.removeprefix("model."): mmproj.load(e, dtype) for e in mmproj.entries}
    # Per layer: two LayerNorms and six linears (attention, MLP), each with a bias; then the patch embedding
    # (with bias), positions, post_layernorm (with bias), the projector's norm and matrix.
    expected = 16 * config.num_hidden_layers + 7
    if len(tensors) != expected:
        raise GGUFError(f"{mmproj.name}: {len(tensors)} tensors, Gemma 3's tower has {expected}")
    return config, tensors
