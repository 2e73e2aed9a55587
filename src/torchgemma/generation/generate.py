"""Generation as a small stack: a prefill and a decode step, a streaming iterator, a wrapper.

    prefill(model, prompt)     -> next-token logits      (one forward over the prompt, with its media)
    decode_step(model, tokens) -> next-token logits      (one forward over one token per row)
    stream(model, prompt, ...) -> yields (B,) tokens     (an Engine with one request per row)
    generate(model, prompt, ...) -> (B, L + N) ids       (stream, collected)

Every row is its own sequence (``Engine``): left padding is dropped, and a row gets what it would get
alone. Greedy decoding gives transformers' ``generate`` tokens: the prefill keeps only the last
position's logits (``logits_to_keep=1``), logits are cast to float32 before sampling, rows that have
stopped are reported as pad, and the loop ends when every row has stopped or ``max_new_tokens``
were produced. Images, video and audio (and ``mm_token_type_ids``) go to the prefill only, as
transformers' ``prepare_inputs_for_generation`` drops them after the first step.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..cache import KVCache
from ..model import Gemma
from ..model.inputs import MediaInputs
from ..model.multimodal import vision_block_ids
from .config import GenerationConfig
from .constraints import Grammar
from .engine import EmbeddedPrompt, Engine, StepOutput
from .prefix_cache import PrefixCache
from .sampling import SamplingParams


@dataclass
class GenerationStats:
    """Counts and compute time of one ``stream`` run (time spent by the consumer is excluded).

    Prefill time runs up to the first new token; decode time covers the steps after it.
    ``prompt_tokens`` counts real prompt tokens of all rows, ``steps`` new tokens per row,
    ``cached_tokens`` the prompt tokens of all rows taken from a prefix cache (not prefilled);
    with ``speculative=``, ``drafted_tokens`` and ``accepted_tokens`` count the draft tokens scored
    and kept.
    """

    batch: int = 0
    prompt_tokens: int = 0
    steps: int = 0
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    cached_tokens: int = 0
    drafted_tokens: int = 0
    accepted_tokens: int = 0

    @property
    def prefill_tokens_per_second(self) -> float:
        return self.prompt_tokens / self.prefill_seconds if self.prefill_seconds > 0 else float("nan")

    @property
    def decode_tokens_per_second(self) -> float:
        """New tokens of all rows per second, over the steps after the first."""
        decoded = self.batch * (self.steps - 1)
        return decoded / self.decode_seconds if decoded > 0 and self.decode_seconds > 0 else float("nan")


@torch.inference_mode()
def prefill(
    model: Gemma,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    cache: KVCache,
    media: MediaInputs | None = None,
) -> torch.Tensor:
    """Run the prompt (B, L) and its ``media`` into ``cache``; float32 logits (B, V) of the token
    after it."""
    extra = {} if media is None else media.as_dict()
    logits = model(input_ids, attention_mask=attention_mask, cache=cache, logits_to_keep=1, **extra)
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
    input_ids: torch.Tensor | Sequence[Sequence[int]],
    *,
    attention_mask: torch.Tensor | None = None,
    max_new_tokens: int,
    sampling: SamplingParams | None = None,
    media: MediaInputs | None = None,
    stop_token_ids: Sequence[int] | None = None,
    generation_config: GenerationConfig | Mapping[str, Any] | None = None,
    cache: KVCache | None = None,
    stats: GenerationStats | None = None,
    prefill_chunk: int | None = None,
    prefix_cache: PrefixCache | None = None,
    constraint: Grammar | None = None,
    speculative: Any = None,
) -> Iterator[torch.Tensor]:
    """An iterator over the next token of every row (B,), one step at a time; see ``generate``.

    Arguments are checked (and the cache allocated) at the call, before the first step runs.
    """
    rows = _prompt_rows(input_ids, attention_mask)
    if constraint is not None and not isinstance(constraint, Grammar):
        raise TypeError(
            "constraint must be a Grammar (generation.constraints): each row follows its own copy"
        )
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    gen_config = resolve_generation_config(model, generation_config)
    if sampling is None:
        sampling = gen_config.sampling()
    device = model.device
    batch = len(rows)
    context = model.config.text.max_position_embeddings
    longest = max(len(row) for row in rows)
    if longest >= context:
        raise ValueError(
            f"prompt of {longest} tokens does not fit the model's context of {context} tokens "
            "(at least one token must be left to generate)"
        )
    # Every row gets the same budget: what the context leaves after the longest prompt.
    max_new_tokens = min(max_new_tokens, context - longest)

    stops = gen_config.eos_token_ids if stop_token_ids is None else tuple(stop_token_ids)
    pad_id = gen_config.pad_token_id
    if pad_id is None:
        # transformers pads finished rows with the first eos id when no pad id is set.
        pad_id = stops[0] if stops else 0

    if cache is not None and (cache.num_slots < batch or cache.max_len < longest + max_new_tokens):
        raise ValueError(
            f"cache for {cache.num_slots} rows of {cache.max_len} tokens cannot hold "
            f"{batch} rows of {longest} + {max_new_tokens} tokens"
        )
    stats = stats if stats is not None else GenerationStats()
    stats.batch, stats.prompt_tokens, stats.steps = batch, sum(len(row) for row in rows), 0
    stats.prefill_seconds = stats.decode_seconds = 0.0
    stats.cached_tokens = stats.drafted_tokens = stats.accepted_tokens = 0
    if max_new_tokens == 0:
        return iter(())
    engine = Engine(
        model,
        max_batch_size=batch,
        max_len=longest + max_new_tokens,
        prefill_chunk=prefill_chunk,
        generation_config=gen_config,
        cache=cache,
        # Room for the whole budget is reserved as the rows grow, not up front: a request for
        # 10^9 new tokens that stops after one allocates for one.
        preallocate=False,
        prefix_cache=prefix_cache,
        speculative=speculative,
    )
    embedded = [None] * batch
    row_media = None
    unpadded = isinstance(input_ids, torch.Tensor) and batch == 1 and len(rows[0]) == input_ids.shape[-1]
    if media and prefix_cache is not None and unpadded:
        # One unpadded row: the engine embeds it itself (the same call as _embed_rows makes), and
        # can then reuse the text before its first media token (never an embedded prompt's).
        _check_types(media, input_ids)
        row_media = media
    elif media:
        embedded = _embed_rows(model, input_ids, attention_mask, media)
    for row, (prompt, row_embedded) in enumerate(zip(rows, embedded)):
        # Every row is its own request; a seed gives each the generator it would have alone.
        engine.add_request(
            row,
            prompt,
            sampling=sampling,
            max_new_tokens=max_new_tokens,
            stop_token_ids=stops,
            embedded=row_embedded,
            media=row_media,
            constraint=constraint,
        )
    return _loop(engine, batch, torch.full((batch,), pad_id, dtype=torch.long, device=device), stats)


def _loop(engine: Engine, batch: int, pad: torch.Tensor, stats: GenerationStats) -> Iterator[torch.Tensor]:
    """Yield step i once every row has its i-th token or has finished (finished rows get ``pad``)."""
    produced: list[list[int]] = [[] for _ in range(batch)]
    finished = [False] * batch
    yielded = 0
    while True:
        started = time.perf_counter()
        for output in engine.step():
            _raise_failure(output)
            produced[output.request_id].append(output.token_id)
            stats.cached_tokens += output.cached_tokens
            finished[output.request_id] = finished[output.request_id] or output.finished
        elapsed = time.perf_counter() - started
        stats.drafted_tokens = engine.speculative_stats.drafted_tokens
        stats.accepted_tokens = engine.speculative_stats.accepted_tokens
        if yielded == 0:
            stats.prefill_seconds += elapsed
        else:
            stats.decode_seconds += elapsed
        while all(len(p) > yielded or f for p, f in zip(produced, finished)):
            if all(f and len(p) <= yielded for p, f in zip(produced, finished)):
                return
            tokens = pad.clone()
            for row, tokens_of_row in enumerate(produced):
                if len(tokens_of_row) > yielded:
                    tokens[row] = tokens_of_row[yielded]
            yielded += 1
            stats.steps += 1
            yield tokens
        if not engine.has_unfinished_requests() and all(len(p) <= yielded for p in produced):
            return


def _raise_failure(output: StepOutput) -> None:
    # A row fails for reasons that are the call's own here (its media were embedded before the first
    # step; its sampling settings are every row's; non-finite logits come from the model's
    # weights): the whole call fails with the row's error (e.g. NonFiniteLogits), as a forward
    # pass would, instead of reporting a token chosen from NaN.
    if output.error is not None:
        raise output.error


def _prompt_rows(input_ids, attention_mask) -> list[list[int]]:
    """Each row's real tokens: a (B, L) tensor with its left-padding mask, or a list of id lists."""
    if not isinstance(input_ids, torch.Tensor):
        if attention_mask is not None:
            raise ValueError("attention_mask goes with a (batch, length) tensor, not with a list of prompts")
        rows = [list(row) for row in input_ids]
        if not rows or any(len(row) == 0 for row in rows):
            raise ValueError("every prompt needs at least one token")
        return rows
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids must be (batch, length), got shape {tuple(input_ids.shape)}")
    if attention_mask is None:
        mask = torch.ones_like(input_ids, dtype=torch.bool)
    else:
        mask = attention_mask.to(dtype=torch.bool, device=input_ids.device)
    if mask.shape != input_ids.shape:
        raise ValueError(f"attention_mask has shape {tuple(mask.shape)}, input_ids {tuple(input_ids.shape)}")
    ids, mask = input_ids.tolist(), mask.tolist()
    rows = [[t for t, real in zip(row, keep) if real] for row, keep in zip(ids, mask)]
    if input_ids.shape[1] == 0 or any(len(row) == 0 for row in rows):
        raise ValueError("every prompt needs at least one token")
    return rows


def _embed_rows(model, input_ids, attention_mask, media: MediaInputs) -> list[EmbeddedPrompt]:
    """Embeddings of a padded multimodal batch, made at once (as transformers does), split by row."""
    if not isinstance(input_ids, torch.Tensor):
        raise ValueError("media go with a (batch, length) tensor of prompts, as the processor returns them")
    _check_types(media, input_ids)
    media = media.as_dict()
    types = media.pop("mm_token_type_ids", None)
    device = model.device
    ids = input_ids.to(device)
    with torch.inference_mode():
        embeds, text_ids = model.embed_multimodal(ids, **media)
    blocks = None
    if types is not None and model.config.text.use_bidirectional_attention == "vision":
        blocks = vision_block_ids(types.to(device))
    mask = (
        torch.ones_like(ids, dtype=torch.bool) if attention_mask is None else attention_mask.to(device).bool()
    )
    return [
        EmbeddedPrompt(
            embeds[b][mask[b]][None],
            text_ids[b][mask[b]][None],
            None if blocks is None else blocks[b][mask[b]][None],
        )
        for b in range(ids.shape[0])
    ]


def _check_types(media: MediaInputs, input_ids: torch.Tensor) -> None:
    types = media.mm_token_type_ids
    if types is not None and types.shape != input_ids.shape:
        raise ValueError(
            f"mm_token_type_ids has shape {tuple(types.shape)}, input_ids {tuple(input_ids.shape)}"
        )


def generate(
    model: Gemma,
    input_ids: torch.Tensor | Sequence[Sequence[int]],
    *,
    attention_mask: torch.Tensor | None = None,
    max_new_tokens: int,
    sampling: SamplingParams | None = None,
    media: MediaInputs | None = None,
    stop_token_ids: Sequence[int] | None = None,
    generation_config: GenerationConfig | Mapping[str, Any] | None = None,
    cache: KVCache | None = None,
    stats: GenerationStats | None = None,
    prefix_cache: PrefixCache | None = None,
    constraint: Grammar | None = None,
    speculative: Any = None,
) -> torch.Tensor | list[list[int]]:
    """Continue the prompts ``input_ids`` (B, L); returns (B, L + N): the prompts, then new tokens.

    * ``input_ids`` may also be a list of prompts of any lengths (lists of ids, no padding): the
      result is then a list of lists, each prompt followed by its new tokens up to its stop token.
    * ``attention_mask`` (B, L): 1 for real tokens, 0 for left padding (default: all real).
    * ``sampling``: a ``SamplingParams`` for every row; None takes ``generation_config``'s defaults
      (a ``GenerationConfig`` or the dict of a ``generation_config.json``; without one, decoding is
      greedy). ``GenerationConfig.sampling(temperature=...)`` sets some and takes the config's
      defaults for the rest. ``temperature=0`` (or below 0.01) is always greedy. Its ``seed`` makes sampling
      reproducible (a private ``torch.Generator`` per row); without it sampling draws from torch's
      global RNG.
    * ``stop_token_ids``: a row stops after producing one of these. None means
      ``generation_config``'s ``eos_token_id`` list, else the model config's; ``[]`` never stops.
      Rows that stopped are filled with the pad id; N < ``max_new_tokens`` when all rows stop.
    * ``max_new_tokens`` is cut to what the model's context leaves after the longest prompt; a
      prompt that fills the context raises ValueError.
    * ``cache``: a ``model.make_cache(B, >= L + N)`` to reuse (it is reset first).
    * ``prefix_cache``: a ``PrefixCache`` (``generation/prefix_cache.py``) to take the prompts'
      stored beginnings from and store them in, across calls; the results are the same without it.
      ``stats.cached_tokens`` says how many prompt tokens it saved.
    * ``constraint``: a ``Grammar`` (``generation.constraints``: JSON Schema, regex, Lark, tool
      calls) every row's reply follows, each row with its own state: only tokens it allows are
      drawn, the other logits masked to -inf (allowed ones unchanged); a row whose grammar is
      complete may only stop (without stop ids: it ends with the tokenizer's eos token).
    * ``media``: a ``MediaInputs`` of transformers' Gemma 4 processor outputs (``torchgemma.
      processing.prepare_media_prompts`` builds them, placeholders expanded): ``pixel_values`` with
      ``image_position_ids``, ``input_features`` with ``input_features_mask``,
      ``pixel_values_videos`` with ``video_position_ids`` and ``num_frames_per_video``, and
      ``mm_token_type_ids`` (B, L); ``MediaInputs.from_dict`` takes them by name. They are used by
      the prefill only, as transformers' ``generate`` uses them.
    * ``speculative``: speculative decoding (``generation/speculative.py``): ``"ngram"`` (prompt
      lookup), ``{"method": "ngram", "num_tokens": k}`` or ``{"method": "mtp", "model": drafter,
      "num_tokens": k}``; greedy output is the same token for token, sampling the same distribution.
    """
    tokens = list(
        stream(
            model,
            input_ids,
            attention_mask=attention_mask,
            max_new_tokens=max_new_tokens,
            sampling=sampling,
            media=media,
            stop_token_ids=stop_token_ids,
            generation_config=generation_config,
            cache=cache,
            stats=stats,
            prefix_cache=prefix_cache,
            constraint=constraint,
            speculative=speculative,
        )
    )
    if not isinstance(input_ids, torch.Tensor):
        return _rows_with_replies(input_ids, tokens, stop_token_ids, generation_config, model)
    input_ids = input_ids.to(model.device)
    if not tokens:
        return input_ids.clone()
    return torch.cat((input_ids, torch.stack(tokens, dim=1)), dim=1)


def _rows_with_replies(prompts, steps, stop_token_ids, generation_config, model) -> list[list[int]]:
    """Each prompt followed by its own new tokens, cut after its stop token (no padding)."""
    stops = set(resolve_generation_config(model, generation_config).eos_token_ids)
    if stop_token_ids is not None:
        stops = set(stop_token_ids)
    rows = []
    for row, prompt in enumerate(prompts):
        reply = []
        for step in steps:
            reply.append(int(step[row]))
            if reply[-1] in stops:
                break
        rows.append(list(prompt) + reply)
    return rows


def left_pad(rows: Sequence[Sequence[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of different lengths as one (B, L) batch padded on the left, and its attention mask."""
    width = max(len(r) for r in rows)
    input_ids = torch.full((len(rows), width), pad, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for row, ids in enumerate(rows):
        input_ids[row, width - len(ids) :] = torch.tensor(list(ids), dtype=torch.long)
        mask[row, width - len(ids) :] = 1
    return input_ids, mask
