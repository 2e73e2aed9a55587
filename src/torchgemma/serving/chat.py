"""POST /v1/chat/completions: messages (text, images, audio), tools, thinking, streaming.

OpenAI's messages become the chat template's (media decoded, tool calls with dict arguments, tool
results named after their call), the template renders them with the client's strings kept as text,
and the reply goes through ``streaming``'s pipeline.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any

from fastapi import Request
from fastapi.responses import StreamingResponse

from ..generation.constraints import ConstraintError, chat_grammar
from ..replies import template_tool_call
from .errors import bad_request
from .limits import MediaBudget
from .media import audio_bytes, check_wav, decode_wav_upload, load_image, open_image
from .protocol import ChatCompletionRequest, ContentPart, Message
from .sampling import refuse_unsupported, sampling_args, stop_list
from .state import ServerState
from .streaming import Outcome, Prepared, respond, whole_reply

TOOL_NAME = re.compile(r"[A-Za-z0-9_.\-]{1,64}")


async def create_chat_completion(
    state: ServerState, body: ChatCompletionRequest, request: Request | None = None
) -> dict | StreamingResponse:
    """The reply as a chat.completion object, or as a stream of chunks when ``body.stream``.
    ``request``, when given, is watched for the client going away."""
    state.check_model(body.model)
    check_chat_request(state, body)
    # Template, tokenizer and media decoding off the event loop (a large request must not stall
    # /health or other clients' streams).
    prepared = await state.prepare(prepare_chat, state, body)
    return await respond(state, request, body, prepared, chat=True, whole=chat_response)


def check_chat_request(state: ServerState, body: ChatCompletionRequest) -> None:
    """What is refused before any work: media the model has no tower for, more media than a
    request may hold, and text too long for the context whatever its tokens."""
    budget = MediaBudget(state.limits)
    chars = 0
    for index, message in enumerate(body.messages):
        if isinstance(message.content, str):
            chars += len(message.content)
        for part_index, part in enumerate(message.content if isinstance(message.content, list) else ()):
            at = f"messages.{index}.content.{part_index}"
            if part.type == "text":
                chars += len(part.text or "")
            elif part.type == "image_url":
                if not state.takes_images:
                    raise bad_request(
                        f"this model has no vision tower ({state.llm.model.config.towers_note}): "
                        "it cannot take images",
                        at,
                    )
                budget.count(at)
            elif part.type == "input_audio":
                if not state.takes_audio:
                    raise bad_request(
                        f"this model has no audio tower ({state.llm.model.config.towers_note}): "
                        "it cannot take audio",
                        at,
                    )
                budget.count(at)
        for call in message.tool_calls or ():
            arguments = call.function.arguments
            chars += len(call.function.name) + (len(arguments) if isinstance(arguments, str) else 0)
    state.check_prompt_chars(chars, "messages")


def prepare_chat(state: ServerState, body: ChatCompletionRequest) -> Prepared:
    """Check the request and render its prompt: the ids, media tensors and sampling settings."""
    refuse_unsupported(body)
    tokenizer = state.tokenizer
    if tokenizer.chat_template is None:
        raise bad_request(
            "this checkpoint has no chat template (a base model): use /v1/completions with a raw prompt",
            "messages",
        )
    thinking = bool(body.chat_template_kwargs and body.chat_template_kwargs.enable_thinking)
    if body.reasoning_effort is not None:
        thinking = body.reasoning_effort != "none"
    response_format = body.response_format
    if response_format is not None and response_format.type == "text":
        response_format = None
    if response_format is not None:
        thinking = False  # the format's constraint starts at the first generated token
    tools = declared_tools(body)
    try:
        # One mechanism for every format (generation/constraints.py): a JSON object or schema, a
        # forced call of a declared tool with schema-valid arguments, at most one call.
        grammar = chat_grammar(
            tokenizer,
            response_format=None
            if response_format is None
            else response_format.model_dump(exclude_none=True),
            tools=tools,
            tool_choice=None if body.tool_choice is None else _plain(body.tool_choice),
            parallel_tool_calls=body.parallel_tool_calls,
            thinking=thinking,
        )
    except ConstraintError as error:
        raise bad_request(str(error), error.field) from error
    except ImportError as error:  # the server was installed without its constraints extra
        raise bad_request(str(error), "response_format" if response_format else "tool_choice") from error
    messages, images, audio = template_messages(body.messages, MediaBudget(state.limits))
    processor = state.llm.processor
    try:
        # Clients are untrusted: control tokens typed in any message, tool or result stay text.
        ids = processor.render_chat(
            messages,
            enable_thinking=thinking,
            tools=tools,
            sanitize_control_tokens=True,
            audio=audio,
            images=images,
        )
    except Exception as error:  # noqa: BLE001 - the template's own message says what is wrong
        raise bad_request(f"the chat template rejected the messages: {error}", "messages") from error
    # (After the template: placeholders are expanded here and the limit checked on the result.)
    try:
        processed = processor.process(ids, images, audio)
    except (ValueError, OSError) as error:
        raise bad_request(str(error), "messages") from error
    ids = processed.input_ids
    max_tokens = body.max_completion_tokens or body.max_tokens
    engine_args = sampling_args(state, body, len(ids), max_tokens, state.chat_stops)
    if processed.media:
        engine_args["media"] = processed.media
    if grammar is not None:
        engine_args["constraint"] = grammar  # the engine starts its own state of it
    if body.logprobs:
        engine_args["logprobs"] = body.top_logprobs or 0
    return Prepared(
        ids,
        engine_args,
        stop_list(body.stop),
        tools=tools is not None,
        logprobs=bool(body.logprobs),
        n=body.n,
        ignore_eos=body.ignore_eos,
    )


def _plain(choice):
    return choice if isinstance(choice, str) else choice.model_dump()


def declared_tools(body: ChatCompletionRequest) -> list[dict] | None:
    """The tools the template declares (None when tool_choice is "none"), checked: names the
    template can write, a named tool_choice among them."""
    for legacy, current in (("functions", "tools"), ("function_call", "tool_choice")):
        if (body.model_extra or {}).get(legacy) is not None:
            # Dropping them would answer without the tools the client offered.
            raise bad_request(f"{legacy} (deprecated by OpenAI) is not supported: use {current}", legacy)
    choice = body.tool_choice or ("auto" if body.tools else "none")
    tools = [tool.function.model_dump(exclude_none=True) for tool in body.tools or []]
    for tool in tools:
        # A name is written into the prompt as it is (and forced after `call:`): no room for
        # control tokens or delimiters. OpenAI's rule, plus '.', which Gemma's parser accepts.
        if not TOOL_NAME.fullmatch(tool["name"]):
            raise bad_request(
                f"tool name {tool['name']!r} must be 1-64 letters, digits, '_', '-' or '.'", "tools"
            )
    if choice != "none" and not tools:
        raise bad_request(f"tool_choice {choice!r} needs tools", "tool_choice")
    if not isinstance(choice, str):
        name = choice.function.get("name", "")
        if name not in {tool["name"] for tool in tools}:
            raise bad_request(f"tool_choice names {name!r}, which is not among the tools", "tool_choice")
    return tools if choice != "none" else None


def template_messages(
    messages: Sequence[Message], budget: MediaBudget | None = None
) -> tuple[list[dict], list, list]:
    """OpenAI messages -> the template's: content items with decoded media, tool calls with dict
    arguments, tool results named after the call they answer. Also the images and audio, in order.

    Every image and clip is sized from its header against ``budget`` before any is decoded."""
    call_names: dict[str, str] = {}
    out, media = [], []
    for index, message in enumerate(messages):
        entry: dict[str, Any] = {"role": message.role}
        if isinstance(message.content, list):
            entry["content"] = content_items(message.content, f"messages.{index}.content", media, budget)
        else:
            entry["content"] = message.content or ""
        if message.tool_calls:
            calls = []
            for call in message.tool_calls:
                arguments = call.function.arguments
                if isinstance(arguments, str):
                    try:
                        arguments = json.loads(arguments or "{}")
                    except json.JSONDecodeError as error:
                        raise bad_request(
                            f"tool call arguments are not JSON: {error}", f"messages.{index}.tool_calls"
                        ) from error
                if call.id:
                    call_names[call.id] = call.function.name
                calls.append(template_tool_call(call.function.name, arguments))
            entry["tool_calls"] = calls
        if message.role == "tool":
            entry["name"] = message.name or call_names.get(message.tool_call_id or "", "tool")
            content = entry["content"]
            if isinstance(content, list):
                entry["content"] = "".join(item.get("text", "") for item in content)
        out.append(entry)
    # Every header passed: decode, in order.
    images, audio = [], []
    for item, at, raw in media:
        if item["type"] == "image":
            images.append(load_image(item["image"], at))
        else:
            item["audio"] = decode_wav_upload(raw, at)
            audio.append(item["audio"])
    return out, images, audio


def content_items(
    parts: Sequence[ContentPart], where: str, media: list, budget: MediaBudget | None = None
) -> list[dict]:
    """One message's content parts as the template's items. Media are only opened and checked
    here; their items go to ``media`` as (item, where, WAV bytes or None), to be decoded after."""
    items = []
    for part_index, part in enumerate(parts):
        at = f"{where}.{part_index}"
        if part.type == "text":
            items.append({"type": "text", "text": part.text or ""})
        elif part.type == "image_url" and part.image_url is not None:
            items.append({"type": "image", "image": open_image(part.image_url.url, at, budget)})
            media.append((items[-1], at, None))
        elif part.type == "input_audio" and part.input_audio is not None:
            data = audio_bytes(part.input_audio.data, part.input_audio.format, at)
            check_wav(data, at, budget)
            items.append({"type": "audio", "audio": None})
            media.append((items[-1], at, data))
        else:
            raise bad_request(f"unsupported content part of type {part.type!r}", at)
    return items


def chat_response(state: ServerState, outcome: Outcome, prepared: Prepared) -> dict:
    content = "".join(outcome.content) or None
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if outcome.reasoning:
        message["reasoning_content"] = "".join(outcome.reasoning)
    if outcome.tool_calls:
        message["tool_calls"] = [
            {k: v for k, v in call.items() if k != "index"} for call in outcome.tool_calls
        ]
    choice = {
        "index": 0,
        "message": message,
        "logprobs": {"content": outcome.logprobs} if prepared.logprobs else None,
        "finish_reason": outcome.finish_reason,
    }
    return whole_reply(state, "chatcmpl", "chat.completion", choice, prepared, outcome.tokens)
