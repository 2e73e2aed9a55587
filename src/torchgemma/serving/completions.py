"""POST /v1/completions: a raw prompt (text or token ids) continued; no chat template, no reply parsing."""

from __future__ import annotations

from fastapi import Request
from fastapi.responses import StreamingResponse

from .errors import bad_request
from .protocol import CompletionRequest
from .sampling import refuse_unsupported, sampling_args, stop_list
from .state import ServerState
from .streaming import Outcome, Prepared, completion_logprobs, respond, whole_reply

# Tokens generated when a request gives no max_tokens: OpenAI's default for /v1/completions (a raw
# prompt has no end of turn to stop at: without a limit one curl ran 302 s to the context's end).
DEFAULT_MAX_TOKENS = 16


async def create_completion(
    state: ServerState, body: CompletionRequest, request: Request | None = None
) -> dict | StreamingResponse:
    """The reply as a text_completion object, or as a stream of them when ``body.stream``.
    ``request``, when given, is watched for the client going away."""
    state.check_model(body.model)
    if isinstance(body.prompt, str):
        state.check_prompt_chars(len(body.prompt), "prompt")
    elif len(body.prompt) > state.context_limit:
        raise bad_request(
            f"the prompt has {len(body.prompt)} tokens; this server's limit is {state.max_len} tokens of "
            "prompt and reply together",
            "prompt",
            "context_length_exceeded",
        )
    # Tokenizing off the event loop (a long prompt must not stall /health or other streams).
    prepared = await state.prepare(prepare_completion, state, body)
    return await respond(state, request, body, prepared, chat=False, whole=completion_response)


def prepare_completion(state: ServerState, body: CompletionRequest) -> Prepared:
    refuse_unsupported(body)
    if isinstance(body.prompt, str):
        ids = state.llm.processor.encode(body.prompt)  # <bos> first, as LLM.generate encodes it
    else:
        ids = list(body.prompt)
    if not ids:
        raise bad_request("the prompt is empty", "prompt")
    vocab = state.llm.model.config.text.vocab_size
    bad = next((t for t in ids if not 0 <= t < vocab), None)
    if bad is not None:
        raise bad_request(f"prompt token {bad} is outside the vocabulary [0, {vocab})", "prompt")
    max_tokens = body.max_tokens
    if max_tokens is None:  # OpenAI's default for text completions (chat's is the context left)
        max_tokens = max(1, min(DEFAULT_MAX_TOKENS, state.context_limit - len(ids)))
    engine_args = sampling_args(state, body, len(ids), max_tokens, None)
    if body.logprobs is not None:
        engine_args["logprobs"] = body.logprobs
    prepared = Prepared(ids, engine_args, stop_list(body.stop), logprobs=body.logprobs is not None, raw=True)
    if body.echo:
        prepared.echo = body.prompt if isinstance(body.prompt, str) else state.tokenizer.decode(ids)
    return prepared


def completion_response(state: ServerState, outcome: Outcome, prepared: Prepared) -> dict:
    choice = {
        "index": 0,
        "text": prepared.echo + "".join(outcome.content),
        "logprobs": completion_logprobs(outcome.logprobs) if prepared.logprobs else None,
        "finish_reason": outcome.finish_reason,
    }
    return whole_reply(state, "cmpl", "text_completion", choice, prepared, outcome.tokens)
