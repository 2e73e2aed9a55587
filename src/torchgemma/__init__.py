"""torchgemma: Gemma 4 in PyTorch, exact against Hugging Face transformers."""

from .acceleration import compile
from .cache import KVCache
from .config import ConfigError, LayerSpec, ModelConfig, TextConfig
from .embedding import embed
from .generation import Engine, generate, stream
from .llm import LLM
from .model import Gemma
from .processing import Video, process_audio, process_images, process_videos
from .quantization import quantize
from .tokenizer import Tokenizer, load_tokenizer
from .weights.loading import load
from .weights.saving import save
from .weights.source import CheckpointError

__version__ = "0.1.0"

__all__ = [
    "CheckpointError",
    "ConfigError",
    "Engine",
    "Gemma",
    "KVCache",
    "LLM",
    "LayerSpec",
    "ModelConfig",
    "TextConfig",
    "Tokenizer",
    "Video",
    "compile",
    "embed",
    "generate",
    "load",
    "load_tokenizer",
    "process_audio",
    "process_images",
    "process_videos",
    "quantize",
    "save",
    "stream",
]
