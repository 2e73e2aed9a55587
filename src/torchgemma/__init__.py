"""torchgemma: Gemma 4 in PyTorch, exact against Hugging Face transformers."""

import importlib

from .acceleration import compile, fuse_cpu_ops
from .cache import KVCache
from .config import ConfigError, LayerSpec, ModelConfig, TextConfig
from .generation import Engine, Grammar, SamplingParams, StepOutput, generate, stream
from .model import Gemma
from .model.inputs import MediaInputs
from .quantization import quantize
from .version import __version__
from .weights.loading import load
from .weights.saving import save
from .weights.source import CheckpointError

# Imported on first use: the tokenizer (the `tokenizers` library, jinja2), media processing (PIL)
# and what builds on them. A process that only loads a model and generates from token ids does not
# pay their ~7 MB and import time.
_LAZY = {
    "embed": ".llm",
    "LLM": ".llm",
    "Video": ".processing",
    "process_audio": ".processing",
    "process_images": ".processing",
    "process_videos": ".processing",
    "Tokenizer": ".tokenizer",
    "load_tokenizer": ".tokenizer",
}


def __getattr__(name: str):
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name], __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


__all__ = [
    "CheckpointError",
    "ConfigError",
    "Engine",
    "Gemma",
    "Grammar",
    "KVCache",
    "LLM",
    "LayerSpec",
    "MediaInputs",
    "ModelConfig",
    "SamplingParams",
    "StepOutput",
    "TextConfig",
    "Tokenizer",
    "Video",
    "compile",
    "embed",
    "fuse_cpu_ops",
    "generate",
    "load",
    "load_tokenizer",
    "process_audio",
    "process_images",
    "process_videos",
    "quantize",
    "save",
    "stream",
    "__version__",
]
