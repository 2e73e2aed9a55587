"""Generation: sampling as pure functions; the engine; prefill, decode step, streaming iterator, ``generate``."""

from .config import GenerationConfig
from .constraints import Grammar
from .engine import MEDIA_INPUTS, EmbeddedPrompt, Engine, StepOutput, TokenLogprobs
from .generate import GenerationStats, decode_step, generate, prefill, stream
from .requests import NonFiniteLogits
from .sampling import (
    SamplingParams,
    apply_logit_bias,
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
    "EmbeddedPrompt",
    "Engine",
    "GenerationConfig",
    "GenerationStats",
    "Grammar",
    "NonFiniteLogits",
    "SamplingParams",
    "StepOutput",
    "TokenLogprobs",
    "apply_logit_bias",
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
