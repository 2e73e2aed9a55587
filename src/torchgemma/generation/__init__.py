"""Generation: sampling as pure functions; prefill, decode step, streaming iterator and ``generate``."""

from .config import GenerationConfig
from .generate import MEDIA_INPUTS, GenerationStats, decode_step, generate, prefill, stream
from .sampling import (
    SamplingParams,
    apply_repetition_penalty,
    apply_temperature,
    min_p_filter,
    next_token,
    process_logits,
    top_k_filter,
    top_p_filter,
)

__all__ = [
    "MEDIA_INPUTS",
    "GenerationConfig",
    "GenerationStats",
    "SamplingParams",
    "apply_repetition_penalty",
    "apply_temperature",
    "decode_step",
    "generate",
    "min_p_filter",
    "next_token",
    "prefill",
    "process_logits",
    "stream",
    "top_k_filter",
    "top_p_filter",
]
