"""OpenAI's sampling fields -> ``Engine.add_request``'s arguments, checked against the server's limits.

Shared by chat and text completions and transcription: a field we cannot honour, a prompt that
leaves no room for a reply, or settings the sampler refuses are a 400 naming the field.
"""

from __future__ import annotations

from typing import Any

from .errors import bad_request, context_overflow
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
    where = "messages" if hasattr(body, "messages") else "prompt"
    if room <= 0:
        raise context_overflow(state.context_limit, prompt_len, where)
    if max_tokens is not None and max_tokens > room:
        raise context_overflow(state.context_limit, prompt_len, where, max_tokens)
    if max_tokens == 0 and not getattr(body, "echo", False):
        raise bad_request("max_tokens must be at least 1 (0 only with echo: the prompt alone)", "max_tokens")
    n = getattr(body, "n", 1)
    if n > state.runner.engine.max_batch_size:
        raise bad_request(
            f"n={n} sequences run at once, and this server runs {state.runner.engine.max_batch_size} "
            "(--max-batch-size)",
            "n",
        )
    if getattr(body, "ignore_eos", False):
        stop_ids = []
    vocab = state.llm.model.config.text.vocab_size
    bias = getattr(body, "logit_bias", None)  # (transcriptions take no bias)
    outside = sorted(t for t in bias or {} if not 0 <= t < vocab)
    if outside:
        raise bad_request(
            f"logit_bias names token {outside[0]}, outside the vocabulary [0, {vocab})", "logit_bias"
        )
    top_k, top_p = body.top_k, body.top_p
    if top_p == 0:  # OpenAI's range includes 0: only the most likely token stays, as top_k=1 keeps
        top_k, top_p = 1, None
    try:
        sampling = state.llm.generation_config.sampling(
            temperature=body.temperature,
            top_k=top_k,
            top_p=top_p,
            min_p=body.min_p,
            repetition_penalty=body.repetition_penalty,
            seed=body.seed,
            logit_bias=bias,
            presence_penalty=getattr(body, "presence_penalty", None),
            frequency_penalty=getattr(body, "frequency_penalty", None),
        )
    except ValueError as error:
        # SamplingParams' messages start with the field's name ("temperature must be ...").
        field = str(error).split(" ", 1)[0].split("[", 1)[0]
        raise bad_request(str(error), field if hasattr(body, field) else None) from error
    state.metrics.prompt_tokens.inc(prompt_len)
    return {
        "sampling": sampling,
        "max_new_tokens": room if max_tokens is None else max_tokens,
        "stop_token_ids": stop_ids,
    }


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
    if getattr(body, "top_logprobs", None) is not None and not body.logprobs:
        raise bad_request("top_logprobs needs logprobs: true", "top_logprobs")
    if getattr(body, "suffix", None):
        raise bad_request("suffix is not supported: Gemma has no fill-in-the-middle format", "suffix")
    best_of = getattr(body, "best_of", None)
    if best_of not in (None, body.n):
        raise bad_request(
            f"best_of={best_of} is not supported: only best_of equal to n ({body.n}), which returns every "
            "sequence generated (ranking sequences by likelihood is not done here)",
            "best_of",
        )


def stop_list(stop: str | list[str] | None) -> list[str]:
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else list(stop)
    if len(stops) > 16:
        raise bad_request("at most 16 stop strings", "stop")
    return [s for s in stops if s]
