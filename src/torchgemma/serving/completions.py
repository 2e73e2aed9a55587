"""POST /v1/completions: raw prompts (text or token ids, one or a list) continued; no chat template,
no reply parsing.

Each prompt gets ``n`` choices, indexed prompt by prompt (prompt i's choice j is ``i * n + j``), as
OpenAI orders them. ``echo`` gives the prompt back before its completion; with ``logprobs``, also
its tokens' log-probabilities (the first token's None: nothing precedes it), from one forward pass
over the prompt; with ``max_tokens: 0`` nothing is generated (the prompt's log-probabilities
alone, as evaluation harnesses ask).
"""

from __future__ import annotations

import torch
from fastapi import Request
from fastapi.responses import StreamingResponse

from .errors import bad_request, context_overflow
from .protocol import CompletionRequest
from .sampling import refuse_unsupported, sampling_args, stop_list
from .sequences import described
from .state import ServerState
from .streaming import Outcome, Prepared, completion_logprobs, respond, whole_reply

# Tokens generated when a request gives no max_tokens: OpenAI's default for /v1/completions (a raw
# prompt has no end of turn to stop at: without a limit one curl ran 302 s to the context's end).
DEFAULT_MAX_TOKENS = 16
# Prompt positions whose logits (vocabulary-wide) are computed at once for echo's logprobs.
PROMPT_LOGPROB_ROWS = 64


async def create_completion(
    state: ServerState, body: CompletionRequest, request: Request | None = None
) -> dict | StreamingResponse:
    """The reply as a text_completion object, or as a stream of them when ``body.stream``.
    ``request``, when given, is watched for the client going away."""
    state.check_model(body.model)
    prompts = prompt_list(body.prompt)
    for index, prompt in enumerate(prompts):
        where = "prompt" if len(prompts) == 1 else f"prompt.{index}"
        if isinstance(prompt, str):
            state.check_prompt_chars(len(prompt), where)
        elif len(prompt) > state.context_limit:
            raise context_overflow(state.context_limit, len(prompt), where)
    # Tokenizing off the event loop (a long prompt must not stall /health or other streams).
    prepared = await state.prepare(prepare_completions, state, body, prompts)
    return await respond(state, request, body, prepared, chat=False, whole=completion_response)


def prompt_list(prompt: str | list) -> list[str | list[int]]:
    """OpenAI's four prompt forms as a list of prompts: text, token ids, texts, lists of token ids."""
    if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
        return [prompt]
    if not prompt:
        raise bad_request("the prompt is empty", "prompt")
    return list(prompt)


def prepare_completions(state: ServerState, body: CompletionRequest, prompts: list) -> list[Prepared]:
    refuse_unsupported(body)
    return [
        prepare_completion(state, body, prompt, index if len(prompts) > 1 else None)
        for index, prompt in enumerate(prompts)
    ]


def prepare_completion(
    state: ServerState, body: CompletionRequest, prompt=None, index: int | None = None
) -> Prepared:
    """One prompt's ``Prepared`` (``prompt`` None: the body's single prompt)."""
    prompt = body.prompt if prompt is None else prompt
    where = "prompt" if index is None else f"prompt.{index}"
    if isinstance(prompt, str):
        ids = state.llm.processor.encode(prompt)  # <bos> first, as LLM.generate encodes it
    else:
        ids = list(prompt)
    if not ids:
        raise bad_request("the prompt is empty", where)
    vocab = state.llm.model.config.text.vocab_size
    bad = next((t for t in ids if not 0 <= t < vocab), None)
    if bad is not None:
        raise bad_request(f"prompt token {bad} is outside the vocabulary [0, {vocab})", where)
    max_tokens = body.max_tokens
    if max_tokens is None:  # OpenAI's default for text completions (chat's is the context left)
        max_tokens = max(1, min(DEFAULT_MAX_TOKENS, state.context_limit - len(ids)))
    engine_args = sampling_args(state, body, len(ids), max_tokens, None)
    if body.logprobs is not None:
        engine_args["logprobs"] = body.logprobs
    prepared = Prepared(
        ids,
        engine_args,
        stop_list(body.stop),
        logprobs=body.logprobs is not None,
        raw=True,
        n=body.n,
        ignore_eos=body.ignore_eos,
    )
    if body.echo:
        prepared.echo = prompt if isinstance(prompt, str) else state.tokenizer.decode(ids)
        if body.logprobs is not None:
            prepared.prompt_logprobs = prompt_logprobs(state, ids, body.logprobs, isinstance(prompt, str))
    return prepared


def prompt_logprobs(state: ServerState, ids: list[int], top: int, text: bool = False) -> list[dict]:
    """Each prompt token's entry: its log-probability after the tokens before it (log-softmax of
    the model's float32 logits) and the ``top`` most likely tokens there; the first token's are
    None (OpenAI's null). One forward pass over the prompt, without the engine's cache."""
    model = state.llm.model
    lm = model.language_model
    with torch.inference_mode():
        normed = lm(model.text_ids(torch.tensor([ids], device=model.device)), head=False)[0]
        entries = [{**described(state, ids[0], None), "top_logprobs": None}]
        for start in range(0, len(ids) - 1, PROMPT_LOGPROB_ROWS):
            end = min(start + PROMPT_LOGPROB_ROWS, len(ids) - 1)
            logprobs = torch.log_softmax(lm.logits(normed[start:end]).float(), dim=-1)
            chosen = logprobs.gather(
                -1, torch.tensor(ids[start + 1 : end + 1], device=logprobs.device)[:, None]
            )
            values, tops = logprobs.topk(top, dim=-1) if top else (logprobs[:, :0], logprobs[:, :0].long())
            for row, token in enumerate(ids[start + 1 : end + 1]):
                entries.append(
                    {
                        **described(state, token, float(chosen[row, 0])),
                        "top_logprobs": [
                            described(state, t, v) for t, v in zip(tops[row].tolist(), values[row].tolist())
                        ],
                    }
                )
    # text_offset: where each token's text begins in the echoed prompt (a <bos> the encoding added
    # is not in it: it begins, empty, at 0).
    decoder, decoded = state.tokenizer.stream_decoder(), 0
    for index, (entry, token) in enumerate(zip(entries, ids)):
        entry["text_offset"] = decoded
        if not (index == 0 and text and token == state.tokenizer.bos_id):
            decoded += len(decoder.push(token))
    return entries


def completion_response(state: ServerState, outcome: Outcome, prepared: Prepared) -> dict:
    logprobs = None
    if prepared.logprobs:
        logprobs = completion_logprobs((prepared.prompt_logprobs or []) + outcome.logprobs)
    choice = {
        "index": 0,
        "text": prepared.echo + "".join(outcome.content),
        "logprobs": logprobs,
        "finish_reason": outcome.finish_reason,
    }
    return whole_reply(state, "cmpl", "text_completion", choice, prepared, outcome.tokens)
