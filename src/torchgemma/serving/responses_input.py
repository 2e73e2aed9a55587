"""/v1/responses' input as the chat path's: input items -> chat messages (text, image, audio and
video parts; function calls and their outputs), flat function tools -> chat tools, tool_choice and
text.format -> chat's. Anything not understood is a 400 naming the item (``input.3.content.1``).
"""

from __future__ import annotations

from .errors import bad_request


def input_messages(items: list[dict]) -> list[dict]:
    """Responses input items -> chat messages: a function call joins the assistant turn before it
    (an assistant's text and calls are one turn to the template); earlier ``reasoning`` items are
    dropped (Gemma's template drops earlier thinking)."""
    messages: list[dict] = []
    for index, item in enumerate(items):
        at = f"input.{index}"
        kind = item.get("type", "message")
        if kind == "message":
            messages.append(input_message(item, at))
        elif kind == "function_call":
            call = {
                "id": _text_field(item, "call_id", at),
                "type": "function",
                "function": {
                    "name": _text_field(item, "name", at),
                    "arguments": item.get("arguments") or "{}",
                },
            }
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            if isinstance(output, list):
                output = "".join(_part_text(part, f"{at}.output.{i}") for i, part in enumerate(output))
            if not isinstance(output, str):
                raise bad_request("a function_call_output's output must be a string or text parts", at)
            messages.append(
                {"role": "tool", "tool_call_id": _text_field(item, "call_id", at), "content": output}
            )
        elif kind == "reasoning":
            continue
        elif kind == "item_reference":
            raise bad_request(
                "item_reference is not supported: send the item itself, or previous_response_id", at
            )
        else:
            raise bad_request(f"input item of type {kind!r} is not supported here", at)
    return messages


def input_message(item: dict, at: str) -> dict:
    role = item.get("role")
    if role not in ("user", "assistant", "system", "developer"):
        raise bad_request(f"a message's role must be user, assistant, system or developer, not {role!r}", at)
    content = item.get("content")
    if isinstance(content, str):
        return {"role": role, "content": content}
    if not isinstance(content, list):
        raise bad_request("a message's content must be a string or a list of parts", f"{at}.content")
    parts = [content_part(part, f"{at}.content.{i}") for i, part in enumerate(content)]
    if role != "user" and all(part["type"] == "text" for part in parts):
        return {"role": role, "content": "".join(part["text"] for part in parts)}
    return {"role": role, "content": parts}


def content_part(part: dict, at: str) -> dict:
    """One Responses content part as the chat path's (text, image_url, input_audio, video_url)."""
    kind = part.get("type") if isinstance(part, dict) else None
    if kind in ("input_text", "output_text", "refusal"):
        return {"type": "text", "text": _part_text(part, at)}
    if kind == "input_image":
        url = part.get("image_url")
        if not isinstance(url, str):
            raise bad_request(
                "input_image needs image_url (a data: or http(s) URL); file_id is not supported", at
            )
        return {"type": "image_url", "image_url": {"url": url, "detail": part.get("detail")}}
    if kind == "input_audio":
        return {"type": "input_audio", "input_audio": part.get("input_audio")}
    if kind in ("input_video", "video_url"):
        # OpenAI's Responses API has no video part: input_video mirrors input_image (video_url a
        # data URL string); chat's own video_url part ({"url": ...}) is taken as well.
        url = part.get("video_url")
        url = url.get("url") if isinstance(url, dict) else url
        if not isinstance(url, str):
            raise bad_request(f"{kind} needs video_url (a data: URL)", at)
        return {"type": "video_url", "video_url": {"url": url}}
    if kind == "input_file":
        raise bad_request("input_file is not supported here (no Files API): send text, images or audio", at)
    raise bad_request(f"content part of type {kind!r} is not supported here", at)


def _part_text(part: dict, at: str) -> str:
    text = (
        part.get("refusal" if part.get("type") == "refusal" else "text") if isinstance(part, dict) else None
    )
    if not isinstance(text, str):
        raise bad_request("a text part needs its text", at)
    return text


def _text_field(item: dict, name: str, at: str) -> str:
    value = item.get(name)
    if not isinstance(value, str) or not value:
        raise bad_request(f"{item.get('type')} needs {name}", f"{at}.{name}")
    return value


def chat_tool(tool: dict, at: str) -> dict:
    """A flat Responses function tool ({"type": "function", "name", "parameters", ...}) as chat's."""
    if tool.get("type") != "function":
        raise bad_request(f"only function tools are supported here, not {tool.get('type')!r}", at)
    if not isinstance(tool.get("name"), str):
        raise bad_request("a function tool needs its name", f"{at}.name")
    spec = {key: tool[key] for key in ("name", "description", "parameters") if tool.get(key) is not None}
    return {"type": "function", "function": spec}


def chat_tool_choice(choice: str | dict) -> str | dict:
    if isinstance(choice, str):
        return choice
    if choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise bad_request(
        f"tool_choice of type {choice.get('type')!r} is not supported: use auto, none, required or "
        '{"type": "function", "name": ...}',
        "tool_choice",
    )


def chat_response_format(format: dict) -> dict:
    """text.format as chat's response_format: json_schema's name and schema move into its
    ``json_schema`` object; the chat path then decides (and refuses what it cannot enforce)."""
    kind = format.get("type")
    if kind == "json_schema":
        spec = {key: format[key] for key in ("name", "schema", "strict", "description") if key in format}
        return {"type": "json_schema", "json_schema": spec}
    return {"type": kind}
