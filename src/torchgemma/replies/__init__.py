"""Gemma 4's reply grammar: generated text -> thinking, content and tool calls, whole or streamed.

One set of rules for every reader of a reply (``LLM.chat`` / ``LLM.stream_chat``,
``Tokenizer.parse_reply``, the server), and the tool-call syntax written for the model.

    grammar.py        the reply format: parse_reply, ReplyStream, forced_call_prefix, template_tool_call
    arguments.py      tool-call arguments, Gemma's `{key:<|"|>value<|"|>,...}` syntax
    stop_strings.py   user stop strings (OpenAI's `stop`) cut out of streamed text

It depends on nothing else in torchgemma (the tokenizer reads replies through it).
"""

from .arguments import QUOTE, ArgumentSyntaxError, parse_arguments
from .grammar import (
    SPECIAL_TOKENS,
    STOP_MARKERS,
    Delta,
    ParsedReply,
    ReplyStream,
    ToolCall,
    forced_call_prefix,
    parse_reply,
    template_tool_call,
)
from .stop_strings import StopStrings

__all__ = [
    "QUOTE",
    "SPECIAL_TOKENS",
    "STOP_MARKERS",
    "ArgumentSyntaxError",
    "Delta",
    "ParsedReply",
    "ReplyStream",
    "StopStrings",
    "ToolCall",
    "forced_call_prefix",
    "parse_arguments",
    "parse_reply",
    "template_tool_call",
]
