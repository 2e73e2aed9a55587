"""Generation as a small stack: a prefill and a decode step, a streaming iterator, a wrapper.

    prefill(model, prompt)     -> next-token logits      (one forward over the prompt, with its media)
    decode_step(model, tokens) -> next-token logits      (one forward over one token per row)
    stream(model, prompt, ...) -> yields (B,) tokens     (the loop: pick, stop, step)
    generate(model, prompt, ...) -> (B, L + N) ids       (stream, collected)

It follows transformers' ``generate`` step for step, so that greedy decoding gives the same tokens:
prefill keeps only the last position's logits (``logits_to_keep=1``), logits are cast to float32
before sampling, rows that have stopped keep being fed the pad token (and are reported as pad), and
the loop ends when every row has stopped or ``max_new_tokens`` were produced. Images and audio
(and ``mm_token_type_ids``) go to the prefill only, as transformers' ``prepare_inputs_for_generation``
drops them after the first step: their soft tokens are in the cache from then on.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..cache import KVCache
from ..model import Gemma
from .config import GenerationConfig
from .sampling import SamplingParams, next_token


@dataclass
class GenerationStats:
    """Counts and compute time of one ``stream`` run (time spent by the consumer is excluded).

    Prefill time runs up to the first new token; decode time covers the steps after it.
    ``prompt_tokens`` counts real prompt tokens of all rows, ``steps`` new tokens per row.
    """

    batch: int = 0
    prompt_tokens: int = 0
    steps: int = 0
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0

    @property
    def prefill_tokens_per_second(self) -> float:
        return self.prompt_tokens / self.prefill_seconds if self.prefill_seconds > 0 else float("nan")

    @property
    def decode_tokens_per_second(self) -> float:
        """New tokens of all rows per second, over the steps after the first."""
        decoded = self.batch * (self.steps - 1)
        return decoded / self.decode_seconds if decoded > 0 and self.decode_seconds > 0 else float("nan")


# The model's multimodal inputs, as transformers' Gemma 4 processor names them.
MEDIA_INPUTS = (
    "pixel_values",
    "image_position_ids",
    "input_features",
    "input_features_mask",
    "mm_token_type_ids",
)


@torch.inference_mode()
def prefill(
    model: Gemma,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    cache: KVCache,
    **media: torch.Tensor | None,
) -> torch.Tensor:
    """Run the prompt (B, L) and its ``media`` (see ``MEDIA_INPUTS``) into ``cache``; float32 logits
    (B, V) of the token after it."""
    logits = model(input_ids, attention_mask=attention_mask, cache=cache, logits_to_keep=1, **media)
    return logits[:, -1].float()


@torch.inference_mode()
def decode_step(model: Gemma, tokens: torch.Tensor, cache: KVCache) -> torch.Tensor:
    """Append one token per row (B,) to ``cache``; float32 logits (B, V) of the next one."""
    return model(tokens[:, None], cache=cache)[:, -1].float()


def resolve_generation_config(
    model: Gemma, generation_config: GenerationConfig | Mapping[str, Any] | None
) -> GenerationConfig:
    """A ``GenerationConfig`` from ours, a ``generation_config.json`` dict, or the model config alone."""
    if isinstance(generation_config, GenerationConfig):
        return generation_config
    return GenerationConfig.from_dict(generation_config or {}, model.config.text)


def stream(
    model: Gemma,
    input_ids: torch.Tensor,
    *,
    attention_mask: torch.Tensor | None = None,
    max_new_tokens: int,
    temperature: float | None = None,
    top_k: int | None = None,
    top_p: float | None = None,
    min_p: float | None = None,
    repetition_penalty: float | None = None,
    seed: int | None = None,
    stop_token_ids: Sequence[int] | None = None,
    generation_config: GenerationConfig | Mapping[str, Any] | None = None,
    cache: KVCache | None = None,
    stats: GenerationStats | None = None,
    pixel_values: torch.Tensor | None = None,
    image_position_ids: torch.Tensor | None = None,
    input_features: torch.Tensor | None = None,
    input_features_mask: torch.Tensor | None = None,
    mm_token_type_ids: torch.Tensor | None = None,
) -> Iterator[torch.Tensor]:
    """An iterator over the next token of every row (B,), one step at a time; see ``generate``.

    Arguments are checked (and the cache allocated) at the call, before the first step runs.
    """
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids must be (batch, length), got shape {tuple(input_ids.shape)}")
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    gen_config = resolve_generation_config(model, generation_config)
    params = gen_config.sampling(
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        min_p=min_p,
        repetition_penalty=repetition_penalty,
    )
    device = model.device
    input_ids = input_ids.to(device)
    batch, length = input_ids.shape
    mask = (
        torch.ones_like(input_ids, dtype=torch.bool)
        if attention_mask is None
        else attention_mask.to(device=device, dtype=torch.bool)
    )
    if mask.shape != input_ids.shape:
        raise ValueError(f"attention_mask has shape {tuple(mask.shape)}, input_ids {tuple(input_ids.shape)}")
    real = mask.sum(-1)
    if length == 0 or bool((real == 0).any()):
        raise ValueError("every prompt needs at least one token")

    context = model.config.text.max_position_embeddings
    longest = int(real.max())
    if longest >= context:
        raise ValueError(
            f"prompt of {longest} tokens does not fit the model's context of {context} tokens "
            "(at least one token must be left to generate)"
        )
    # Positions count real tokens, so the longest prompt decides how many new tokens still fit.
    max_new_tokens = min(max_new_tokens, context - longest)

    stops = gen_config.eos_token_ids if stop_token_ids is None else tuple(stop_token_ids)
    stop_ids = torch.tensor(stops, dtype=torch.long, device=device)
    pad_id = gen_config.pad_token_id
    if pad_id is None:
        # transformers pads finished rows with the first eos id when no pad id is set.
        pad_id = stops[0] if stops else 0
    pad = torch.full((batch,), pad_id, dtype=torch.long, device=device)

    if cache is None:
        cache = model.make_cache(batch, length + max_new_tokens)
    else:
        if cache.batch_size != batch or cache.max_len < length + max_new_tokens:
            raise ValueError(
                f"cache for {cache.batch_size} rows of {cache.max_len} tokens cannot hold "
                f"{batch} rows of {length} + {max_new_tokens} tokens"
            )
        cache.reset()
    if mm_token_type_ids is not None and mm_token_type_ids.shape != input_ids.shape:
        raise ValueError(
            f"mm_token_type_ids has shape {tuple(mm_token_type_ids.shape)}, input_ids {tuple(input_ids.shape)}"
        )
    media = {
        "pixel_values": pixel_values,
        "image_position_ids": image_position_ids,
        "input_features": input_features,
        "input_features_mask": input_features_mask,
        "mm_token_type_ids": mm_token_type_ids,
    }
    media = {name: value for name, value in media.items() if value is not None}
    generator = None if seed is None else torch.Generator(device=device).manual_seed(seed)
    stats = stats if stats is not None else GenerationStats()
    stats.batch, stats.prompt_tokens, stats.steps = batch, int(real.sum()), 0
    stats.prefill_seconds = stats.decode_seconds = 0.0
    return _loop(
        model, input_ids, mask, cache, params, generator, stop_ids, pad, max_new_tokens, stats, media
    )


def _loop(
    model: Gemma,
    input_ids: torch.Tensor,
    mask: torch.Tensor,
    cache: KVCache,
    params: SamplingParams,
    generator: torch.Generator | None,
    stop_ids: torch.Tensor,
    pad: torch.Tensor,
    max_new_tokens: int,
    stats: GenerationStats,
    media: dict[str, torch.Tensor],
) -> Iterator[torch.Tensor]:
    # The penalty looks at the prompt's real tokens and everything generated so far.
    history, history_mask = input_ids, mask
    unfinished = torch.ones(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
    if max_new_tokens == 0:
        return
    started = time.perf_counter()
    logits = prefill(model, input_ids, mask, cache, **media)
    for step in range(max_new_tokens):
        tokens = next_token(logits, params, generator=generator, history=history, history_mask=history_mask)
        tokens = torch.where(unfinished, tokens, pad)
        unfinished = unfinished & ~torch.isin(tokens, stop_ids)
        done = step == max_new_tokens - 1 or not bool(unfinished.any())
        _account(stats, started, first=step == 0)
        yield tokens
        if done:
            return
        started = time.perf_counter()
        if params.repetition_penalty not in (None, 1.0):
            history = torch.cat((history, tokens[:, None]), dim=1)
            history_mask = torch.cat((history_mask, torch.ones_like(tokens[:, None], dtype=torch.bool)), 1)
        logits = decode_step(model, tokens, cache)


def _account(stats: GenerationStats, started: float, first: bool) -> None:
    elapsed = time.perf_counter() - started
    if first:
        stats.prefill_seconds += elapsed
    else:
        stats.decode_seconds += elapsed
    stats.steps += 1


def generate(
    model: Gemma,
    input_ids: torch.Tensor,
    *,
    attention_mask: torch.Tensor | None = None,
    max_new_tokens: int,
    temperature: float | None = None,
    top_k: int | None = None,
    top_p: float | None = None,
    min_p: float | None = None,
    repetition_penalty: float | None = None,
    seed: int | None = None,
    stop_token_ids: Sequence[int] | None = None,
    generation_config: GenerationConfig | Mapping[str, Any] | None = None,
    cache: KVCache | None = None,
    stats: GenerationStats | None = None,
    pixel_values: torch.Tensor | None = None,
    image_position_ids: torch.Tensor | None = None,
    input_features: torch.Tensor | None = None,
    input_features_mask: torch.Tensor | None = None,
    mm_token_type_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """Continue the prompts ``input_ids`` (B, L); returns (B, L + N): the prompts, then new tokens.

    * ``attention_mask`` (B, L): 1 for real tokens, 0 for left padding (default: all real).
    * Sampling: a parameter left as None takes ``generation_config``'s value (a ``GenerationConfig``
      or the dict of a ``generation_config.json``); without one, decoding is greedy.
      ``temperature=0`` is always greedy. ``seed`` makes sampling reproducible (a private
      ``torch.Generator``); without it sampling draws from torch's global RNG.
    * ``stop_token_ids``: a row stops after producing one of these. None means
      ``generation_config``'s ``eos_token_id`` list, else the model config's; ``[]`` never stops.
      Rows that stopped are filled with the pad id; N < ``max_new_tokens`` when all rows stop.
    * ``max_new_tokens`` is cut to what the model's context leaves after the longest prompt; a
      prompt that fills the context raises ValueError.
    * ``cache``: a ``model.make_cache(B, >= L + N)`` to reuse (it is reset first).
    * Media, as transformers' Gemma 4 processor returns them (``torchgemma.processing.
      prepare_media_prompts`` builds them, placeholders expanded): ``pixel_values`` with
      ``image_position_ids``, ``input_features`` with ``input_features_mask``, and
      ``mm_token_type_ids`` (B, L). They are used by the prefill only, so
      ``generate(model, **processor_outputs, ...)`` works as with transformers.
    """
    tokens = list(
        stream(
            model,
            input_ids,
            attention_mask=attention_mask,
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            min_p=min_p,
            repetition_penalty=repetition_penalty,
            seed=seed,
            stop_token_ids=stop_token_ids,
            generation_config=generation_config,
            cache=cache,
            stats=stats,
            pixel_values=pixel_values,
            image_position_ids=image_position_ids,
            input_features=input_features,
            input_features_mask=input_features_mask,
            mm_token_type_ids=mm_token_type_ids,
        )
    )
    input_ids = input_ids.to(model.device)
    if not tokens:
        return input_ids.clone()
    return torch.cat((input_ids, torch.stack(tokens, dim=1)), dim=1)
