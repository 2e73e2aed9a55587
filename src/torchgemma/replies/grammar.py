"""Gemma 4's reply format, read whole (`parse_reply`) or piece by piece (`ReplyStream`), and the
tool-call syntax written for the model (`forced_call_prefix`, `template_tool_call`).

The input is generated text decoded with special tokens kept. Gemma 4 writes

    <|channel>thought\\n…<channel|>               thinking; the first line of the block is a label
    <|tool_call>call:NAME{key:value,…}<tool_call|>  a tool call, arguments in Gemma's own syntax
    answer text                                     everything else

and ends with `<turn|>`, `<eos>` or `<|tool_response>` (stop markers: nothing after one is read).

Rules shared by `parse_reply` (a whole reply) and `ReplyStream` (the same, piece by piece):

- Special tokens never reach content or reasoning. A stray `<|"|>` reads as `"`; other stray specials
  are dropped. An unterminated thinking block is all reasoning.
- A tool call's body runs from `<|tool_call>` to `<tool_call|>`; when the closing marker is missing it
  ends at the next special token (other than `<|"|>`), a stop marker or the end of generation. Either
  way the body is a call if it is exactly `call:NAME{ARGS}` with parseable ARGS; otherwise its text
  (specials removed, `<|"|>` as `"`) stays where it was, as content (or reasoning inside a thinking
  block). Calls are recognized inside thinking blocks too; the block goes on after them.
- A bare `call:NAME{ARGS}` (models sometimes drop the markers) is a call only at the start of the
  answer: at the start of the text, right after `<channel|>` or right after another call, whitespace
  allowed before it. It ends at its balanced closing brace; if a special token other than `<|"|>`
  comes first, or generation ends, or ARGS do not parse, it is ordinary text.
- With `tools=False` (no tools offered) no call is parsed: tool-call markers are dropped like other
  specials, and the call's text stays content.
- content is all answer text, joined, stripped of surrounding whitespace. reasoning is each thinking
  block without its label line, stripped; non-empty blocks joined by a blank line ("\\n\\n"); None
  when there is no block.

The other direction: `forced_call_prefix` is the text that makes the model's reply open with a tool
call (written after the generation prompt, fed to the parser before the first generated token), and
`ToolCall.template_entry` a parsed call as the chat template reads it back in an assistant message.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

from .arguments import QUOTE, ArgumentSyntaxError, parse_arguments

CHANNEL_START, CHANNEL_END = "<|channel>", "<channel|>"
CALL_START, CALL_END = "<|tool_call>", "<tool_call|>"
STOP_MARKERS = ("<turn|>", "<eos>", "<|tool_response>")
SPECIAL_TOKENS = (
    QUOTE,
    CHANNEL_START,
    CHANNEL_END,
    CALL_START,
    CALL_END,
    *STOP_MARKERS,
    "<|tool>",
    "<tool|>",
    "<tool_response|>",
    "<|turn>",
    "<bos>",
    "<pad>",
    "<|think|>",
)
_SPECIAL = re.compile("|".join(re.escape(t) for t in SPECIAL_TOKENS))
_STOP = re.compile("|".join(re.escape(t) for t in STOP_MARKERS))
# What ends a tool call whose closing marker is missing: any special that is not part of the arguments.
_CALL_BOUNDARY = re.compile("|".join(re.escape(t) for t in SPECIAL_TOKENS if t != QUOTE))
_LONGEST_SPECIAL = max(len(t) for t in SPECIAL_TOKENS)

_NAME = r"[\w.\-]+"  # e.g. get_weather, searxng-search, files.read
_CALL = re.compile(rf"\s*call:({_NAME})(\{{.*\}})\s*", re.DOTALL)
_BARE_CALL_HEAD = re.compile(rf"call:{_NAME}\{{")
_BARE_CALL_PREFIX = re.compile(r"c(?:a(?:l(?:l(?::[\w.\-]*)?)?)?)?")  # what may still become a head


# --- Whole replies -----------------------------------------------------------------------------


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: dict

    def arguments_json(self) -> str:
        return json.dumps(self.arguments, ensure_ascii=False)

    def template_entry(self) -> dict:
        """The call as an assistant message's ``tool_calls`` item, which the chat template writes
        back as ``<|tool_call>call:NAME{…}<tool_call|>`` (see ``template_tool_call``)."""
        return template_tool_call(self.name, self.arguments)


def template_tool_call(name: str, arguments: dict) -> dict:
    """A tool call as Gemma's chat template reads it from a message (``function.name``, and
    ``function.arguments`` as a dict: the template writes each key and value in Gemma's syntax)."""
    return {"type": "function", "function": {"name": name, "arguments": arguments}}


def forced_call_prefix(name: str | None = None) -> str:
    """Text that makes the reply a tool call: of any tool (``name`` None; OpenAI's
    ``tool_choice="required"``) or of the tool ``name``, whose arguments the model then writes.

    It goes after the generation prompt, and the same text is pushed into ``ReplyStream`` before the
    first generated token, so the parse sees the whole call."""
    return f"{CALL_START}call:" if name is None else f"{CALL_START}call:{name}{{"


@dataclass(frozen=True)
class ParsedReply:
    reasoning: str | None  # None when the reply had no channel block
    content: str  # stripped of surrounding whitespace
    tool_calls: list[ToolCall]


def _new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


def _parse_call(body: str) -> ToolCall | None:
    """`call:NAME{ARGS}` -> a ToolCall; None when it is not one (the caller keeps it as text)."""
    match = _CALL.fullmatch(body)
    if match is None:
        return None
    try:
        arguments = parse_arguments(match.group(2))
    except ArgumentSyntaxError:
        return None
    return ToolCall(_new_call_id(), match.group(1), arguments)


def _plain_text(text: str) -> str:
    return _SPECIAL.sub(lambda m: '"' if m.group() == QUOTE else "", text)


def _bare_call_end(text: str, start: int) -> int | None:
    """End of a bare `call:NAME{…}` at `start` (after its balanced closing brace), or None."""
    head = _BARE_CALL_HEAD.match(text, start)
    if head is None:
        return None
    depth, in_string, i = 1, False, head.end()
    while i < len(text):
        if text.startswith(QUOTE, i):
            in_string = not in_string
            i += len(QUOTE)
            continue
        if _SPECIAL.match(text, i):
            return None
        if not in_string and text[i] in "{[":
            depth += 1
        elif not in_string and text[i] in "}]":
            depth -= 1
            if depth == 0:
                return i + 1
        i += 1
    return None


def _thinking(fragments: list[str]) -> str:
    block = "".join(fragments)
    # The first line names the channel ("thought"); it is a label, not part of the thinking.
    newline = block.find("\n")
    return "" if newline < 0 else block[newline + 1 :].strip()


def parse_reply(text: str, *, tools: bool = True) -> ParsedReply:
    """A whole reply. tools=False: tool-call markup is not parsed (its text, without specials, stays
    content). A tool call whose arguments do not parse stays text (see the module docstring)."""
    stop = _STOP.search(text)
    if stop is not None:
        text = text[: stop.start()]
    content: list[str] = []
    blocks: list[list[str]] = []  # text fragments of each thinking block, label included
    calls: list[ToolCall] = []
    in_block = False
    at_call_start = True  # where a bare `call:NAME{…}` counts as a call
    pos = 0

    def emit(fragment: str) -> None:
        nonlocal at_call_start
        (blocks[-1] if in_block else content).append(fragment)
        if fragment and not fragment.isspace():
            at_call_start = False

    while pos < len(text):
        special = _SPECIAL.search(text, pos)
        end = special.start() if special else len(text)
        if pos < end:
            chunk = text[pos:end]
            if tools and at_call_start and not in_block and not chunk.isspace():
                lead = len(chunk) - len(chunk.lstrip())
                emit(chunk[:lead])
                pos += lead
                call_end = _bare_call_end(text, pos)
                call = None if call_end is None else _parse_call(text[pos:call_end])
                if call is not None:
                    calls.append(call)
                    pos = call_end
                    continue
            emit(text[pos:end])
            pos = end
            continue
        token = special.group()
        pos = special.end()
        if token == QUOTE:
            emit('"')
        elif token == CHANNEL_START and not in_block:
            in_block = True
            blocks.append([])
        elif token == CHANNEL_END and in_block:
            in_block = False
            at_call_start = True
        elif token == CALL_START and tools:
            boundary = _CALL_BOUNDARY.search(text, pos)
            body_end = boundary.start() if boundary else len(text)
            body = text[pos:body_end]
            pos = boundary.end() if boundary and boundary.group() == CALL_END else body_end
            call = _parse_call(body)
            if call is None:
                emit(_plain_text(body))
            else:
                calls.append(call)
                at_call_start = True
        # Any other special token here is stray: dropped.

    reasoning = None if not blocks else "\n\n".join(t for t in map(_thinking, blocks) if t)
    return ParsedReply(reasoning, "".join(content).strip(), calls)


# --- Streaming ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Delta:
    kind: str  # "content", "reasoning" or "tool_call"
    text: str = ""
    tool_call: ToolCall | None = None
    index: int = 0  # for tool_call: 0, 1, 2... in order


def _partial_special_length(text: str) -> int:
    """Length of the longest tail of `text` that could still grow into a special token."""
    for length in range(min(len(text), _LONGEST_SPECIAL - 1), 0, -1):
        tail = text[-length:]
        if tail[0] == "<" and any(token.startswith(tail) for token in SPECIAL_TOKENS):
            return length
    return 0


class ReplyStream:
    """Incremental parse_reply: push text pieces as they are decoded, get deltas that never contain a
    special token or half of one; the concatenated deltas equal parse_reply of the whole text.

    Whitespace, exactly: content drops whitespace before its first character and holds any later
    whitespace back until more content follows, so whitespace at its end is never emitted. Reasoning
    does the same per thinking block (label line dropped), and sends "\\n\\n" before the first text of
    every non-empty block after the first. Hence `"".join(content deltas) == parse_reply(text).content`
    and `"".join(reasoning deltas) == (parse_reply(text).reasoning or "")`, exactly, for any split.

    Each tool call is one delta (index, id, name and complete arguments), emitted when its end is
    seen. Text that could still become a special token or a bare call is held back until it is known.
    Once a stop marker is seen, `stopped` is True and further pieces are ignored."""

    def __init__(self, *, tools: bool = True) -> None:
        self._tools = tools
        self._pending = ""  # not yet read: a tail that may be the start of a special token
        self._stopped = False
        self._ended = False
        self._deltas: list[Delta] = []
        self._calls = 0
        self._in_block = False
        self._at_call_start = True
        # The tool call being read: None, "wrapped" (after <|tool_call>) or "bare" (`call:` at the start).
        self._call: str | None = None
        self._call_text = ""
        self._bare_depth = 0  # 0 while the bare call's `call:NAME{` head is still incomplete
        self._bare_in_string = False
        # Whitespace held back (see the class docstring).
        self._content_started = False
        self._content_space = ""
        self._label_done = False
        self._block_started = False
        self._reasoning_started = False
        self._reasoning_space = ""

    @property
    def stopped(self) -> bool:
        return self._stopped

    def push(self, piece: str) -> list[Delta]:
        if not self._ended:
            self._pending += piece
            self._read(final=False)
        return self._take()

    def finish(self) -> list[Delta]:
        """End of generation: flush what was held back (an unterminated call becomes a call if it
        parses, else text); trailing whitespace is dropped."""
        if not self._ended:
            self._read(final=True)
            self._end()
        return self._take()

    def _take(self) -> list[Delta]:
        deltas, self._deltas = self._deltas, []
        return deltas

    def _read(self, *, final: bool) -> None:
        while self._pending and not self._ended:
            special = _SPECIAL.search(self._pending)
            if special is None:
                keep = 0 if final else _partial_special_length(self._pending)
                text = self._pending[: len(self._pending) - keep]
                self._pending = self._pending[len(text) :]
                self._text(text)
                return
            text, self._pending = self._pending[: special.start()], self._pending[special.end() :]
            self._text(text)
            self._special(special.group())

    def _text(self, text: str) -> None:
        while text:
            if self._call == "wrapped":
                self._call_text += text
                return
            if self._call == "bare":
                text = self._bare_text(text)
                continue
            if self._tools and self._at_call_start and not self._in_block:
                stripped = text.lstrip()
                self._emit(text[: len(text) - len(stripped)])
                if stripped:
                    self._call, self._call_text, self._bare_depth = "bare", "", 0
                text = stripped
                continue
            self._emit(text)
            return

    def _bare_text(self, text: str) -> str:
        """Read `text` into the bare call; returns what follows the call once it has ended."""
        if self._bare_depth == 0:
            candidate = self._call_text + text
            head = _BARE_CALL_HEAD.match(candidate)
            if head is None:
                if _BARE_CALL_PREFIX.fullmatch(candidate):
                    self._call_text = candidate
                else:
                    self._call = None
                    self._emit(candidate)
                return ""
            self._call_text, self._bare_depth, self._bare_in_string = head.group(), 1, False
            text = candidate[head.end() :]
        if not self._bare_in_string:
            for i, char in enumerate(text):
                if char in "{[":
                    self._bare_depth += 1
                elif char in "}]":
                    self._bare_depth -= 1
                    if self._bare_depth == 0:
                        body, self._call, self._call_text = self._call_text + text[: i + 1], None, ""
                        call = _parse_call(body)
                        if call is None:
                            self._emit(_plain_text(body))
                        else:
                            self._tool_call(call)
                        return text[i + 1 :]
        self._call_text += text
        return ""

    def _special(self, token: str) -> None:
        if token in STOP_MARKERS:
            self._stopped = True
            self._end()
            return
        if self._call == "wrapped":
            if token == QUOTE:
                self._call_text += token
                return
            self._end_wrapped_call()
            if token == CALL_END:
                return
        elif self._call == "bare":
            if token == QUOTE and self._bare_depth > 0:
                self._bare_in_string = not self._bare_in_string
                self._call_text += token
                return
            self._call = None
            self._emit(_plain_text(self._call_text))
        if token == QUOTE:
            self._emit('"')
        elif token == CHANNEL_START and not self._in_block:
            self._in_block, self._label_done, self._block_started = True, False, False
            self._reasoning_space = ""
        elif token == CHANNEL_END and self._in_block:
            self._in_block, self._at_call_start = False, True
        elif token == CALL_START and self._tools:
            self._call, self._call_text = "wrapped", ""
        # Any other special token here is stray: dropped.

    def _end_wrapped_call(self) -> None:
        body, self._call, self._call_text = self._call_text, None, ""
        call = _parse_call(body)
        if call is None:
            self._emit(_plain_text(body))
        else:
            self._tool_call(call)

    def _end(self) -> None:
        if self._call == "wrapped":
            self._end_wrapped_call()
        elif self._call == "bare":
            self._call = None
            self._emit(_plain_text(self._call_text))
        self._ended = True
        self._pending = ""

    def _tool_call(self, call: ToolCall) -> None:
        self._deltas.append(Delta("tool_call", tool_call=call, index=self._calls))
        self._calls += 1
        self._at_call_start = True

    def _emit(self, text: str) -> None:
        """Text of the current part (content or reasoning), special tokens already resolved."""
        if not text:
            return
        if not text.isspace():
            self._at_call_start = False
        if self._in_block:
            self._reasoning(text)
        else:
            self._content(text)

    def _content(self, text: str) -> None:
        if not self._content_started:
            text = text.lstrip()
            if not text:
                return
            self._content_started = True
        core = text.rstrip()
        if core:
            self._out("content", self._content_space + core)
            self._content_space = text[len(core) :]
        else:
            self._content_space += text

    def _reasoning(self, text: str) -> None:
        if not self._label_done:
            newline = text.find("\n")
            if newline < 0:
                return
            text = text[newline + 1 :]
            self._label_done = True
        if not self._block_started:
            text = text.lstrip()
            if not text:
                return
            self._block_started = True
            self._reasoning_space = "\n\n" if self._reasoning_started else ""
            self._reasoning_started = True
        core = text.rstrip()
        if core:
            self._out("reasoning", self._reasoning_space + core)
            self._reasoning_space = text[len(core) :]
        else:
            self._reasoning_space += text

    def _out(self, kind: str, text: str) -> None:
        # Text that arrived in one push goes out as one delta per run of a kind.
        if self._deltas and self._deltas[-1].kind == kind:
            text = self._deltas.pop().text + text
        self._deltas.append(Delta(kind, text))
