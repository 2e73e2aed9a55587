"""POST /v1/audio/transcriptions: an uploaded WAV clip transcribed (checkpoints with an audio tower).

``response_format``: ``json`` ({"text"}), ``text``, ``verbose_json``, ``srt`` and ``vtt``. Gemma writes
a transcript without timestamps, so the last three have one segment: the part of the clip the
model heard (its first 30 s), from 0 to its end, with the whole transcript. ``duration`` is the
clip's own length.
"""

from __future__ import annotations

import zlib
from types import SimpleNamespace

from fastapi import Request
from fastapi.responses import PlainTextResponse

from ..processing.audio import SAMPLING_RATE
from .errors import APIError, bad_request
from .limits import MediaBudget
from .media import check_wav, decode_wav_upload, wav_seconds
from .metrics import log_request
from .sampling import sampling_args
from .state import ServerState
from .streaming import Outcome, Prepared, collect

TRANSCRIBE_PROMPT = "Transcribe this audio."
# At most this many tokens per transcript (Whisper's cap; 30 s of speech needs far fewer).
TRANSCRIPTION_MAX_TOKENS = 448
RESPONSE_FORMATS = ("json", "text", "verbose_json", "srt", "vtt")


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
    timestamp_granularities: list[str] | None = None,
    request: Request | None = None,
) -> dict | PlainTextResponse:
    """``data``, a WAV file, transcribed in ``response_format``; the form's other fields as keywords."""
    state.check_model(model)
    llm = state.llm
    if not llm.takes_audio:
        raise no_audio_tower()
    if response_format not in RESPONSE_FORMATS:
        raise bad_request(f"response_format must be one of {', '.join(RESPONSE_FORMATS)}", "response_format")
    if "word" in (timestamp_granularities or ()):
        raise bad_request(
            "word timestamps are not available: Gemma writes a transcript without timestamps",
            "timestamp_granularities",
        )
    instruction = prompt or TRANSCRIBE_PROMPT
    if language:
        instruction += f" The speech is in {language}."
    state.check_prompt_chars(len(instruction), "prompt")
    sampling = SimpleNamespace(
        temperature=temperature, top_k=None, top_p=None, min_p=None, repetition_penalty=None, seed=None
    )
    # Decoding, template and features off the event loop.
    prepared, heard = await state.prepare(
        _prepare_transcription, state, data, instruction, sampling, response_format == "verbose_json"
    )
    log_request(request, prepared)
    outcome = await collect(state, request, prepared, "transcription")
    text = "".join(outcome.content).strip()
    if response_format == "json":
        return {"text": text}
    if response_format == "text":
        return PlainTextResponse(text)
    if response_format == "verbose_json":
        duration = wav_seconds(data) or heard
        segment = verbose_segment(state, text, heard, outcome, temperature)
        return {
            "task": "transcribe",
            "language": language,
            "duration": duration,
            "text": text,
            "segments": [segment],
        }
    return PlainTextResponse(subtitles(text, heard, response_format), media_type="text/plain; charset=utf-8")


def verbose_segment(
    state: ServerState, text: str, heard: float, outcome: Outcome, temperature: float
) -> dict:
    """The one segment: the heard part of the clip. ``tokens``: the transcript's tokens as the
    tokenizer encodes it; ``avg_logprob``: the mean log-probability of the generated tokens;
    ``compression_ratio``: Whisper's (the text's bytes over their zlib size); ``no_speech_prob``:
    null (the model gives no such estimate)."""
    raw = text.encode("utf-8")
    logprobs = [entry["logprob"] for entry in outcome.logprobs]
    return {
        "id": 0,
        "seek": 0,
        "start": 0.0,
        "end": heard,
        "text": text,
        "tokens": state.tokenizer.encode(text, add_special_tokens=False) if text else [],
        "temperature": temperature,
        "avg_logprob": sum(logprobs) / len(logprobs) if logprobs else 0.0,
        "compression_ratio": len(raw) / len(zlib.compress(raw)) if raw else 0.0,
        "no_speech_prob": None,
    }


def subtitles(text: str, seconds: float, kind: str) -> str:
    """SubRip or WebVTT: one cue from 0 to ``seconds`` (none for an empty transcript)."""

    def stamp(value: float, comma: bool) -> str:
        millis = round(value * 1000)
        hours, rest = divmod(millis, 3_600_000)
        minutes, rest = divmod(rest, 60_000)
        secs, millis = divmod(rest, 1000)
        return f"{hours:02d}:{minutes:02d}:{secs:02d}{',' if comma else '.'}{millis:03d}"

    srt = kind == "srt"
    cue = f"{stamp(0, srt)} --> {stamp(seconds, srt)}\n{text}\n" if text else ""
    if srt:
        return f"1\n{cue}" if cue else ""
    return "WEBVTT\n\n" + cue


def _prepare_transcription(
    state: ServerState, data: bytes, instruction: str, sampling, logprobs: bool = False
) -> tuple[Prepared, float]:
    """The prepared request and the seconds of the clip the model hears."""
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
    if logprobs:
        engine_args["logprobs"] = 0
    return Prepared(ids, engine_args, [], tools=False, logprobs=logprobs), len(clip) / SAMPLING_RATE
