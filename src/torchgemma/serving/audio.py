"""POST /v1/audio/transcriptions: an uploaded WAV clip transcribed (checkpoints with an audio tower)."""

from __future__ import annotations

from types import SimpleNamespace

from fastapi import Request
from fastapi.responses import PlainTextResponse

from .errors import APIError, bad_request
from .limits import MediaBudget
from .media import check_wav, decode_wav_upload
from .metrics import log_request
from .sampling import sampling_args
from .state import ServerState
from .streaming import Prepared, collect

TRANSCRIBE_PROMPT = "Transcribe this audio."
# At most this many tokens per transcript (Whisper's cap; 30 s of speech needs far fewer).
TRANSCRIPTION_MAX_TOKENS = 448


def no_audio_tower() -> APIError:
    return APIError(404, "this checkpoint has no audio tower: it cannot transcribe", param="model")


async def create_transcription(
    state: ServerState,
    data: bytes,
    *,
    model: str | None = None,
    prompt: str | None = None,
    language: str | None = None,
    response_format: str = "json",
    temperature: float = 0.0,
    request: Request | None = None,
) -> dict | PlainTextResponse:
    """``data``, a WAV file, as {"text": ...} (or plain text); the form's other fields as keywords."""
    state.check_model(model)
    llm = state.llm
    if not llm.takes_audio:
        raise no_audio_tower()
    if response_format not in ("json", "text"):
        raise bad_request("response_format must be 'json' or 'text'", "response_format")
    instruction = prompt or TRANSCRIBE_PROMPT
    if language:
        instruction += f" The speech is in {language}."
    state.check_prompt_chars(len(instruction), "prompt")
    sampling = SimpleNamespace(
        temperature=temperature, top_k=None, top_p=None, min_p=None, repetition_penalty=None, seed=None
    )
    # Decoding, template and features off the event loop.
    prepared = await state.prepare(_prepare_transcription, state, data, instruction, sampling)
    log_request(request, prepared)
    outcome = await collect(state, request, prepared, "transcription")
    text = "".join(outcome.content).strip()
    return PlainTextResponse(text) if response_format == "text" else {"text": text}


def _prepare_transcription(state: ServerState, data: bytes, instruction: str, sampling) -> Prepared:
    check_wav(data, "file", MediaBudget(state.limits))
    clip = decode_wav_upload(data)
    messages = [
        {
            "role": "user",
            "content": [{"type": "audio", "audio": clip}, {"type": "text", "text": instruction}],
        }
    ]
    processor = state.llm.processor
    ids = processor.render_chat(messages, sanitize_control_tokens=True, audio=[clip])
    try:
        processed = processor.process(ids, [], [clip])
    except ValueError as error:  # e.g. samples that are not finite
        raise bad_request(f"file: {error}", "file") from error
    ids = processed.input_ids
    room = state.context_limit - len(ids)
    max_tokens = min(TRANSCRIPTION_MAX_TOKENS, room)
    engine_args = sampling_args(state, sampling, len(ids), max_tokens, state.chat_stops)
    engine_args["media"] = processed.media
    return Prepared(ids, engine_args, [], tools=False)
