"""OpenAI's sampling fields -> ``Engine.add_request``'s arguments, checked against the server's limits.

Shared by chat and text completions and transcription: a field we cannot honour, a prompt that
leaves no room for a reply, or settings the sampler refuses are a 400 naming the field.
"""

from __future__ import annotations

from typing import Any

from .errors import bad_request
from .state import ServerState


def sampling_args(
    state: ServerState, body, prompt_len: int, max_tokens: int | None, stop_ids
) -> dict[str, Any]:
    """``body``'s sampling fields (temperature, top_k, top_p, min_p, repetition_penalty, seed,
    logit_bias) as one ``SamplingParams`` (the checkpoint's defaults for those unset), the reply's
    length and stop ids, as the engine takes them; counts the prompt's tokens once accepted.

    Values that could make the sampler's numbers NaN are refused by ``SamplingParams`` (a 400
    naming the field); a temperature below 0.01 decodes greedily (OpenAI's range is 0..2 and
    accepts such values)."""
    room = state.context_limit - prompt_len
    if room <= 0:
        raise bad_request(
            f"the prompt has {prompt_len} tokens; this server's limit is {state.max_len} tokens of prompt "
            "and reply together",
            "messages",
            "context_length_exceeded",
        )
    if max_tokens is not None and max_tokens > room:
        raise bad_request(
            f"max_tokens={max_tokens} does not fit: the prompt has {prompt_len} tokens and the limit is "
            f"{state.max_len}, so at most {room} can be generated",
            "max_tokens",
            "context_length_exceeded",
        )
    vocab = state.llm.model.config.text.vocab_size
    bias = getattr(body, "logit_bias", None)  # (transcriptions take no bias)
    outside = sorted(t for t in bias or {} if not 0 <= t < vocab)
    if outside:
        raise bad_request(
            f"logit_bias names token {outside[0]}, outside the vocabulary [0, {vocab})", "logit_bias"
        )
    try:
        sampling = state.llm.generation_config.sampling(
            temperature=body.temperature,
            top_k=body.top_k,
            top_p=body.top_p,
            min_p=body.min_p,
            repetition_penalty=body.repetition_penalty,
            seed=body.seed,
            logit_bias=bias,
        )
    except ValueError as error:
        # SamplingParams' messages start with the field's name ("temperature must be ...").
        field = str(error).split(" ", 1)[0].split("[", 1)[0]
        raise bad_request(str(error), field if hasattr(body, field) else None) from error
    state.metrics.prompt_tokens.inc(prompt_len)
    return {"sampling": sampling, "max_new_tokens": max_tokens or room, "stop_token_ids": stop_ids}


# Other servers' ways to constrain the output (llama.cpp, vLLM, SGLang, TGI): refused by name, since
# ignoring one would return unconstrained text to a client that asked for a format.
GRAMMAR_FIELDS = (
    "grammar",
    "json_schema",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
    "structured_outputs",
    "regex",
    "ebnf",
)


def refuse_unsupported(body) -> None:
    """Fields of chat and text completions that we accept but cannot honour: a 400 with the reason."""
    extras = body.model_extra or {}
    for name in GRAMMAR_FIELDS:
        if extras.get(name) is not None:
            raise bad_request(
                f"{name} is not supported: output constraints here are response_format "
                '{"type": "json_object"} or {"type": "json_schema", ...} (chat completions)',
                name,
            )
    if body.n not in (None, 1):
        raise bad_request("n > 1 is not supported: send n separate requests", "n")
    for name in ("presence_penalty", "frequency_penalty"):
        if getattr(body, name) not in (None, 0, 0.0):
            raise bad_request(f"{name} is not supported; use repetition_penalty", name)


def stop_list(stop: str | list[str] | None) -> list[str]:
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else list(stop)
    if len(stops) > 16:
        raise bad_request("at most 16 stop strings", "stop")
    return [s for s in stops if s]
