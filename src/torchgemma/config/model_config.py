"""``ModelConfig``: a whole checkpoint's config, read from its ``config.json`` (``from_file``,
``from_hf``), and what follows from its family: which layout its tensor names take.

It sits apart from the other records (config/schema.py) because it is the entry point that reads:
``from_hf`` calls config/hf.py, which builds those records.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

from .gemma3n_vision import Gemma3nVisionConfig
from .hf import config_from_file, fields_from_hf
from .schema import (
    AudioConfig,
    Family,
    Gemma3nAudioConfig,
    SiglipVisionConfig,
    TextConfig,
    UnifiedAudioConfig,
    UnifiedVisionConfig,
    VisionConfig,
)

# Parameters a KV-shared layer does not have (it reads another layer's keys and values).
SHARED_KV_PARAMS = ("k_proj", "v_proj", "k_norm", "v_norm")


@dataclass(frozen=True)
class ModelConfig:
    """A whole checkpoint: the text decoder plus, for ``gemma4``, its vision and audio towers."""

    model_type: str
    text: TextConfig
    token_ids: dict[str, int]
    # The checkpoint's own dtype ("bfloat16", ...), when config.json names one.
    dtype: str | None
    # The family's rules (config/gemma4.py, ...), chosen by model_type.
    family: Family = dataclasses.field(repr=False, compare=False)
    # The towers the model builds (None when config.json has none).
    vision_config: VisionConfig | None = None
    audio_config: AudioConfig | None = None
    # gemma4_unified: the encoder-free image and audio embedders (no vision or audio tower).
    unified_vision: UnifiedVisionConfig | None = None
    unified_audio: UnifiedAudioConfig | None = None
    # gemma3n: its audio conformer and MobileNet-V5 vision tower.
    gemma3n_audio: Gemma3nAudioConfig | None = None
    # gemma3: its SigLIP vision tower and projector.
    siglip_vision: SiglipVisionConfig | None = None
    gemma3n_vision: Gemma3nVisionConfig | None = None
    # A model saved quantized by torchgemma: {"mode": ..., "layers": {module: {bits, group_size,
    # has_mins, scale_dtype?}}} (config.json's "quantization_config", quant_method "torchgemma").
    quantization: dict | None = None
    # The config.json dict this was built from, kept to write it out again (torchgemma.save).
    source: dict | None = dataclasses.field(default=None, repr=False, compare=False)

    @classmethod
    def from_file(cls, path: str | Path) -> ModelConfig:
        return config_from_file(path, cls.from_hf)

    @classmethod
    def from_hf(cls, data: dict) -> ModelConfig:
        """Build from the dict of a Hugging Face ``config.json`` (any of ``SUPPORTED_MODEL_TYPES``)."""
        return cls(**fields_from_hf(data))

    # -- what the family implies -------------------------------------------------------------------

    @property
    def text_only(self) -> bool:
        """A ``*ForCausalLM`` / ``*TextModel`` checkpoint (model_type ``{family}_text``): the decoder
        alone, its tensors named ``model.*`` (or bare, as sentence-transformers saves EmbeddingGemma)."""
        return self.model_type.endswith("_text")

    @property
    def takes_media(self) -> bool:
        """A multimodal layout (gemma4, gemma4_unified): placeholders and soft tokens apply."""
        return self.family.takes_media and not self.text_only

    @property
    def encoder_free(self) -> bool:
        """gemma4_unified: images and audio are projected into the decoder by embedders, no towers."""
        return self.family.encoder_free and not self.text_only

    @property
    def towers_note(self) -> str:
        """Why a tower is missing: config.json has none, or torchgemma does not build it."""
        if self.family.towers_note is not None and not self.text_only:
            return self.family.towers_note
        return "config.json describes none"

    def module_path(self, name: str) -> str | None:
        """The module path a checkpoint tensor loads into, or None to skip it."""
        text = self.text
        if name.startswith("model.language_model."):  # gemma4 (multimodal) checkpoints
            name = "language_model." + name[len("model.language_model.") :]
        elif name.startswith("language_model.model."):  # gemma3 multimodal checkpoints, as published
            name = "language_model." + name[len("language_model.model.") :]
        elif name.startswith("model.") and self.text_only:  # *ForCausalLM
            name = "language_model." + name[len("model.") :]
        elif name.startswith("model."):  # gemma4 towers and embedders: model.vision_tower.*, ...
            name = name[len("model.") :]
        elif self.text_only and name != "lm_head.weight":
            # *TextModel (no model. prefix, no head): EmbeddingGemma, as sentence-transformers saves it
            name = "language_model." + name
        name = self.family.module_path(name)  # a family's parts not built, or held elsewhere
        if name is None:
            return None
        if name == "lm_head.weight":
            # Tied to embed_tokens (some exports write the copy anyway); else the text model's own head.
            return None if text.tie_word_embeddings else "language_model.lm_head.weight"
        parts = name.split(".")
        if len(parts) > 4 and parts[:2] == ["language_model", "layers"] and parts[3] == "self_attn":
            layer = int(parts[2]) if parts[2].isdigit() else -1
            if (
                0 <= layer < text.num_hidden_layers
                and text.layers[layer].kv_role == "reuse"
                and parts[4] in SHARED_KV_PARAMS
            ):
                return (
                    None  # KV-shared layers reuse another layer's K/V: published files may carry unused k/v
                )
        return name

    def checkpoint_name(self, module_path: str) -> str:
        """The checkpoint tensor name of a module path (``language_model.norm.weight``), as published:
        ``model.`` + the path, except that ``*ForCausalLM`` text checkpoints drop ``language_model.``."""
        named = self.family.checkpoint_path(module_path)
        return "model." + (named.removeprefix("language_model.") if self.text_only else named)
