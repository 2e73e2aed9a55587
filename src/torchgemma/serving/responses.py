"""POST /v1/responses: OpenAI's Responses API, over the chat path.

A request's ``instructions``, ``input`` items (messages with text, image and audio parts; earlier
``function_call`` and ``function_call_output`` items), flat function ``tools``, ``tool_choice``,
``reasoning`` and ``text.format`` become one ``ChatCompletionRequest`` (``responses_input``), checked and rendered by
``chat.prepare_chat`` as a chat completion is; the reply runs through ``streaming.generate`` and
comes back as Responses output items: a ``reasoning`` item (Gemma's thinking), a ``message`` with
one ``output_text`` part, and a ``function_call`` item per call, in the order the model wrote them.
Streamed, each item has OpenAI's event sequence (``ResponseEvents``).

Replies with ``store`` (the default) are kept in the server's bounded ``ResponseStore`` (the last
``--responses-store`` of them, in memory): ``previous_response_id`` continues one's conversation,
GET and DELETE /v1/responses/{id} read and forget one.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import StreamingResponse
from pydantic import ValidationError

from .chat import check_chat_request, prepare_chat
from .errors import APIError, bad_request
from .metrics import log_request
from .protocol import ChatCompletionRequest, ResponsesRequest
from .responses_input import chat_response_format, chat_tool, chat_tool_choice, input_messages
from .state import ServerState
from .streaming import Outcome, Prepared, collect, generate

# The ``include`` value this server acts on; the others name outputs it never makes (hosted tools'
# results, encrypted reasoning: earlier thinking is dropped from the prompt anyway), so there is
# nothing to add for them.
LOGPROBS_INCLUDE = "message.output_text.logprobs"
# Fields of OpenAI's that need what this server does not have: refused by name, not ignored.
REFUSED_FIELDS = {
    "conversation": "conversations are not kept here; send previous_response_id or the whole input",
    "prompt": "stored prompt templates are not kept here; send instructions and input",
    "max_tool_calls": "max_tool_calls is not enforced here (Gemma's replies end after their calls)",
    # Chat's, not this API's: a response is one reply.
    "n": "n is not a Responses API field: a response is one reply; send separate requests",
}
# Chat request fields -> this API's names, for the errors the chat path raises.
CHAT_NAMES = {
    "max_tokens": "max_output_tokens",
    "max_completion_tokens": "max_output_tokens",
    "response_format": "text.format",
    "reasoning_effort": "reasoning.effort",
}


async def create_response(
    state: ServerState, body: ResponsesRequest, request: Request | None = None
) -> dict | StreamingResponse:
    """The reply as a ``response`` object, or as its event stream when ``body.stream``."""
    state.check_model(body.model)
    conversation, chat = chat_request(state, body)
    try:
        check_chat_request(state, chat)
        prepared = await state.prepare(prepare_chat, state, chat)
    except APIError as error:
        # The chat path names its own fields ("messages.2.content.0", "max_tokens"): here, ours.
        if error.param is not None:
            error.param = our_name(error.param)
        raise
    prepared.ident, prepared.endpoint = f"resp_{uuid.uuid4().hex}", "responses"
    log_request(request, prepared)
    draft = ResponseDraft(state, body, prepared, conversation)
    if body.stream:
        events = stream_events(state, request, draft)
        first = await anext(events)  # a refusal before the first token is a plain error
        return StreamingResponse(_prepend(first, events), media_type="text/event-stream")
    outcome = await collect(state, request, prepared, "responses")
    return draft.finish(output_items(outcome), outcome.finish_reason, outcome.tokens, outcome.reasoning)


def our_name(param: str) -> str:
    """A chat request's field as this API names it ("messages.2.content.0" is in the input)."""
    return "input" if param.startswith("messages") else CHAT_NAMES.get(param, param)


def retrieve_response(state: ServerState, response_id: str) -> dict:
    entry = state.responses.get(response_id)
    if entry is None:
        raise _not_stored(response_id, "response_id")
    return entry[0]


def delete_response(state: ServerState, response_id: str) -> dict:
    if not state.responses.delete(response_id):
        raise _not_stored(response_id, "response_id")
    return {"id": response_id, "object": "response.deleted", "deleted": True}


def _not_stored(response_id: str, param: str) -> APIError:
    return APIError(
        404,
        f"no response with id {response_id!r} is stored here (this server keeps its last "
        "--responses-store replies made with store true, in memory, until it restarts)",
        param=param,
        code="response_not_found",
    )


# ── request: Responses -> chat ──────────────────────────────────────────────────────────────


def chat_request(state: ServerState, body: ResponsesRequest) -> tuple[list[dict], ChatCompletionRequest]:
    """The conversation so far (earlier responses' and this input's messages, without
    ``instructions``, which OpenAI does not carry over) and the chat request to run."""
    extras = dict(body.model_extra or {})
    for name, reason in REFUSED_FIELDS.items():
        if extras.pop(name, None) is not None:
            raise bad_request(reason, name)
    if body.background:
        raise bad_request("background responses are not supported here; use stream", "background")
    if body.truncation == "auto":
        raise bad_request(
            "truncation 'auto' is not supported: input that does not fit is refused (400), not cut",
            "truncation",
        )
    conversation: list[dict] = []
    if body.previous_response_id is not None:
        entry = state.responses.get(body.previous_response_id)
        if entry is None:
            raise _not_stored(body.previous_response_id, "previous_response_id")
        conversation = list(entry[1])
    items = [{"role": "user", "content": body.input}] if isinstance(body.input, str) else body.input
    conversation += input_messages(items)
    if not conversation:
        raise bad_request("input has no messages", "input")
    system = [{"role": "system", "content": body.instructions}] if body.instructions else []
    fields: dict[str, Any] = {
        **extras,
        "messages": system + conversation,
        "max_completion_tokens": body.max_output_tokens,
        "temperature": body.temperature,
        "top_p": body.top_p,
        "user": body.user,
    }
    if body.tools:
        fields["tools"] = [chat_tool(tool, f"tools.{i}") for i, tool in enumerate(body.tools)]
    if body.tool_choice is not None:
        fields["tool_choice"] = chat_tool_choice(body.tool_choice)
    if body.parallel_tool_calls is not None:
        fields["parallel_tool_calls"] = body.parallel_tool_calls
    if body.reasoning is not None and body.reasoning.effort is not None:
        fields["reasoning_effort"] = body.reasoning.effort  # "none": no thinking; any other: thinking
    if body.text is not None and body.text.format is not None:
        fields["response_format"] = chat_response_format(body.text.format)
    if LOGPROBS_INCLUDE in (body.include or ()) or body.top_logprobs:
        fields["logprobs"] = True
        fields["top_logprobs"] = body.top_logprobs
    try:
        chat = ChatCompletionRequest.model_validate(fields)
    except ValidationError as error:
        first = error.errors()[0]
        where = our_name(".".join(str(part) for part in first["loc"]))
        raise bad_request(f"{where}: {first['msg']}", where) from error
    return conversation, chat


# ── reply: outcome -> Responses objects ─────────────────────────────────────────────────────


def reasoning_item(text: str, status: str = "completed") -> dict:
    content = [{"type": "reasoning_text", "text": text}] if text else []
    return {
        "id": f"rs_{uuid.uuid4().hex}",
        "type": "reasoning",
        "summary": [],
        "content": content,
        "status": status,
    }


def message_item(text: str | None, logprobs: list[dict] | None, status: str = "completed") -> dict:
    content = []
    if text is not None:
        content.append({"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []})
    return {
        "id": f"msg_{uuid.uuid4().hex}",
        "type": "message",
        "role": "assistant",
        "status": status,
        "content": content,
    }


def function_call_item(call: dict, arguments: str | None = None, status: str = "completed") -> dict:
    """A chat tool call (``streaming.tool_call_dict``) as a ``function_call`` item."""
    return {
        "id": f"fc_{uuid.uuid4().hex}",
        "type": "function_call",
        "call_id": call["id"],
        "name": call["function"]["name"],
        "arguments": call["function"]["arguments"] if arguments is None else arguments,
        "status": status,
    }


def output_items(outcome: Outcome) -> list[dict]:
    """A whole reply's items, in the order Gemma writes them: thinking, text, calls. The logprobs
    (of every generated token, as chat's) go with the text."""
    items = []
    if outcome.reasoning:
        items.append(reasoning_item("".join(outcome.reasoning)))
    if outcome.content:
        status = "incomplete" if outcome.finish_reason == "length" else "completed"
        items.append(message_item("".join(outcome.content), outcome.logprobs, status))
    items += [function_call_item(call) for call in outcome.tool_calls]
    return items


class ResponseDraft:
    """What a response object says besides its output: the request's settings as used, and once
    the reply ended, its status and usage. ``finish`` also stores the response when asked to."""

    def __init__(
        self, state: ServerState, body: ResponsesRequest, prepared: Prepared, conversation: list[dict]
    ):
        self.state, self.body, self.prepared, self.conversation = state, body, prepared, conversation
        self.created = int(time.time())

    def response(self, status: str, output: list[dict], usage: dict | None = None, **extra) -> dict:
        body, sampling = self.body, self.prepared.engine_args["sampling"]
        effort = body.reasoning.effort if body.reasoning is not None else None
        return {
            "id": self.prepared.ident,
            "object": "response",
            "created_at": self.created,
            "status": status,
            "background": False,
            "error": None,
            "incomplete_details": None,
            "instructions": body.instructions,
            "max_output_tokens": body.max_output_tokens,
            "max_tool_calls": None,
            "model": self.state.model_name,
            "output": output,
            "parallel_tool_calls": body.parallel_tool_calls is not False,
            "previous_response_id": body.previous_response_id,
            "reasoning": {"effort": effort, "summary": None},
            "store": body.store,
            "temperature": sampling.temperature,
            "text": {"format": (body.text.format if body.text else None) or {"type": "text"}},
            "tool_choice": body.tool_choice or ("auto" if body.tools else "none"),
            "tools": body.tools or [],
            "top_logprobs": body.top_logprobs,
            "top_p": sampling.top_p if sampling.top_p is not None else 1.0,
            "truncation": "disabled",
            "usage": usage,
            "user": body.user,
            "metadata": body.metadata or {},
            **extra,
        }

    def finish(self, output: list[dict], finish_reason: str, tokens: int, reasoning: list[str]) -> dict:
        extra: dict[str, Any] = {"completed_at": int(time.time())}
        status = "completed"
        if finish_reason == "length":
            status, extra["incomplete_details"] = "incomplete", {"reason": "max_output_tokens"}
        response = self.response(status, output, self.usage(tokens, reasoning), **extra)
        if self.body.store:
            self.state.responses.put(response, self.conversation + [assistant_turn(output)])
        return response

    def usage(self, tokens: int, reasoning: list[str]) -> dict:
        """OpenAI's usage; ``reasoning_tokens`` re-counted from the thinking's text (the engine's
        tokens are not labelled), ``cached_tokens`` the prompt tokens the prefix cache held."""
        prompt = len(self.prepared.input_ids)
        thought = "".join(reasoning)
        reasoning_tokens = (
            len(self.state.tokenizer.encode(thought, add_special_tokens=False)) if thought else 0
        )
        return {
            "input_tokens": prompt,
            "input_tokens_details": {"cached_tokens": self.prepared.cached_tokens, "cache_write_tokens": 0},
            "output_tokens": tokens,
            "output_tokens_details": {"reasoning_tokens": min(reasoning_tokens, tokens)},
            "total_tokens": prompt + tokens,
        }


def assistant_turn(output: list[dict]) -> dict:
    """A response's output as the chat message that continues its conversation (thinking left out)."""
    text = "".join(part["text"] for item in output if item["type"] == "message" for part in item["content"])
    calls = [
        {
            "id": item["call_id"],
            "type": "function",
            "function": {"name": item["name"], "arguments": item["arguments"]},
        }
        for item in output
        if item["type"] == "function_call"
    ]
    turn: dict[str, Any] = {"role": "assistant", "content": text or None}
    if calls:
        turn["tool_calls"] = calls
    return turn


# ── streaming: OpenAI's event sequence ──────────────────────────────────────────────────────


class ResponseEvents:
    """One response's server-sent events, numbered in order. An item opens when the reply's kind
    of output changes (thinking, text, a call) and closes before the next opens:

        output_item.added, content_part.added, (output_text | reasoning_text).delta...,
        (output_text | reasoning_text).done, content_part.done, output_item.done
        output_item.added, function_call_arguments.delta, .done, output_item.done   (a call)
    """

    def __init__(self):
        self.sequence = 0
        self.output: list[dict] = []  # closed items
        self.open: dict | None = None  # the item being written
        self.text: list[str] = []
        self.logprobs: list[dict] = []  # of the open message's text
        self.pending: list[dict] = []  # logprobs that arrived before their text

    def event(self, kind: str, **fields) -> str:
        data = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return f"event: {kind}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"

    def _place(self, item: dict | None = None) -> dict:
        return {"item_id": (item or self.open)["id"], "output_index": len(self.output)}

    def _start(self, item: dict, part: dict | None) -> list[str]:
        self.open, self.text = item, []
        events = [self.event("response.output_item.added", output_index=len(self.output), item=item)]
        if part is not None:
            events.append(
                self.event("response.content_part.added", **self._place(), content_index=0, part=part)
            )
        return events

    def reasoning(self, text: str) -> list[str]:
        events = [] if self.open and self.open["type"] == "reasoning" else self.close()
        if not self.open:
            events += self._start(reasoning_item("", "in_progress"), {"type": "reasoning_text", "text": ""})
        self.text.append(text)
        events.append(
            self.event("response.reasoning_text.delta", **self._place(), content_index=0, delta=text)
        )
        return events

    def content(self, text: str) -> list[str]:
        events = [] if self.open and self.open["type"] == "message" else self.close()
        if not self.open:
            self.logprobs = []
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            events += self._start(message_item(None, None, "in_progress"), part)
        self.text.append(text)
        logprobs, self.pending = self.pending, []
        self.logprobs += logprobs
        events.append(
            self.event(
                "response.output_text.delta", **self._place(), content_index=0, delta=text, logprobs=logprobs
            )
        )
        return events

    def tool_call(self, call: dict) -> list[str]:
        events = self.close()
        item = function_call_item(call, arguments="", status="in_progress")
        events += self._start(item, None)
        arguments = call["function"]["arguments"]
        events.append(self.event("response.function_call_arguments.delta", **self._place(), delta=arguments))
        events.append(
            self.event("response.function_call_arguments.done", **self._place(), arguments=arguments)
        )
        done = {**item, "arguments": arguments, "status": "completed"}
        events.append(self.event("response.output_item.done", output_index=len(self.output), item=done))
        self.output.append(done)
        self.open = None
        return events

    def close(self, status: str = "completed") -> list[str]:
        """End the open reasoning or message item (its text's done events, then the item's)."""
        item, self.open = self.open, None
        if item is None:
            return []
        text, place, events = "".join(self.text), self._place(item), []
        if item["type"] == "reasoning":
            part = {"type": "reasoning_text", "text": text}
            events.append(self.event("response.reasoning_text.done", **place, content_index=0, text=text))
            done = reasoning_item(text, "completed") | {"id": item["id"]}
        else:
            part = {"type": "output_text", "text": text, "annotations": [], "logprobs": self.logprobs}
            events.append(
                self.event(
                    "response.output_text.done", **place, content_index=0, text=text, logprobs=self.logprobs
                )
            )
            done = {**item, "status": status, "content": [part]}
        events.append(self.event("response.content_part.done", **place, content_index=0, part=part))
        events.append(self.event("response.output_item.done", output_index=place["output_index"], item=done))
        self.output.append(done)
        return events


async def stream_events(
    state: ServerState, request: Request | None, draft: ResponseDraft
) -> AsyncIterator[str]:
    """response.created and .in_progress, each item's events, then response.completed (or
    .incomplete when the reply ran out of tokens); an error once begun: an ``error`` event and
    response.failed."""
    writer, prepared = ResponseEvents(), draft.prepared
    events = generate(state, request, prepared)  # (counted in /metrics by the sequence's endpoint)
    first = await anext(events)  # before the response begins: a refusal is a plain error
    yield writer.event("response.created", response=draft.response("in_progress", []))
    yield writer.event("response.in_progress", response=draft.response("in_progress", []))
    finish, tokens, reasoning = "stop", 0, []
    try:
        async for name, value in _chain(first, events):
            lines: list[str] = []
            if name == "content":
                lines = writer.content(value)
            elif name == "reasoning":
                reasoning.append(value)
                lines = writer.reasoning(value)
            elif name == "tool_call":
                lines = writer.tool_call(value)
            elif name == "logprob":
                writer.pending.append(value)
            elif name == "finish":
                finish, tokens = value
            for line in lines:
                yield line
    except APIError as error:
        yield writer.event(
            "error", code=error.code or "server_error", message=error.message, param=error.param
        )
        failed = draft.response(
            "failed", writer.output, error={"code": error.code or "server_error", "message": error.message}
        )
        yield writer.event("response.failed", response=failed)
        return
    for line in writer.close("incomplete" if finish == "length" else "completed"):
        yield line
    response = draft.finish(writer.output, finish, tokens, reasoning)
    kind = "response.incomplete" if response["status"] == "incomplete" else "response.completed"
    yield writer.event(kind, response=response)


async def _chain(first, rest: AsyncIterator):
    yield first
    async for item in rest:
        yield item


async def _prepend(first: str, rest: AsyncIterator[str]) -> AsyncIterator[str]:
    yield first
    async for item in rest:
        yield item
