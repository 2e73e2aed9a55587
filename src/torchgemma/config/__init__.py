"""Model configuration: frozen data built from a checkpoint's ``config.json``.

schema.py          the records: TextConfig, LayerSpec, RopeSpec, the tower configs, Family
model_config.py    ModelConfig (from_file, from_hf) and the checkpoint names its family implies
hf.py              reading config.json: the one place that knows its key names and defaults
gemma4.py, gemma4_unified.py, gemma3.py, gemma3n.py
                   each family's field rules (gemma3n_vision.py: Gemma 3n's MobileNet-V5 blocks) and checkpoint-name rules
limits.py          the largest sizes and the number rules a config.json must keep
assistant.py       AssistantConfig: an MTP drafter's (gemma4_assistant, gemma4_unified_assistant)
"""

from .gemma4 import _audio_config_from_hf, _vision_config_from_hf
from .gemma4_unified import UNIFIED_MODEL_TYPES
from .hf import SUPPORTED_MODEL_TYPES, SUPPORTED_ROPE_TYPES
from .limits import MAX_CONFIG_BYTES, MAX_SIZES
from .model_config import ModelConfig
from .schema import (
    FULL,
    SLIDING,
    AudioConfig,
    ConfigError,
    Family,
    Gemma3nAudioConfig,
    KVRole,
    LayerSpec,
    LayerType,
    MediaVocabulary,
    RopeSpec,
    SiglipVisionConfig,
    TextConfig,
    UnifiedAudioConfig,
    UnifiedVisionConfig,
    VisionConfig,
)

__all__ = [
    "FULL",
    "MAX_CONFIG_BYTES",
    "MAX_SIZES",
    "SLIDING",
    "SUPPORTED_MODEL_TYPES",
    "SUPPORTED_ROPE_TYPES",
    "UNIFIED_MODEL_TYPES",
    "AudioConfig",
    "ConfigError",
    "Family",
    "Gemma3nAudioConfig",
    "KVRole",
    "LayerSpec",
    "LayerType",
    "MediaVocabulary",
    "ModelConfig",
    "RopeSpec",
    "TextConfig",
    "UnifiedAudioConfig",
    "SiglipVisionConfig",
    "UnifiedVisionConfig",
    "VisionConfig",
    # the tower readers tests call directly
    "_audio_config_from_hf",
    "_vision_config_from_hf",
]
