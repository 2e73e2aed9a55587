"""Chat templates rendered the way transformers 5.23 renders them (replies are read by ``torchgemma.replies``).

A checkpoint's chat template is Jinja written against transformers' environment, so the output only
matches if the environment matches: a sandbox with `trim_blocks`/`lstrip_blocks`, loop controls, a
`{% generation %}` tag, a `tojson` that neither escapes HTML nor forces ASCII, and the globals
`raise_exception`, `strftime_now`, `dict` and `namespace`. Inputs are reduced to plain JSON-like data
first, as transformers does, so templates see the same values (and no live objects).

Control tokens typed by a caller (`<turn|>` in a user message) must not become control tokens:
`mark_control_tokens` wraps each one found in the inputs in two private-use characters before
rendering, and the tokenizer encodes marked tokens as plain text (transformers 5.23's
`apply_chat_template(..., sanitize_control_tokens=True)`, same markers and rules). Unlike
transformers, a token the template would join from two caller strings (text items "hi<end_of" and
"_turn>", printed with nothing between them) or from a caller string and the template's text is
not made either: a caller string whose edge could be part of a control token gets a cut mark there,
and after rendering `resolve_cuts` keeps the marks where a control token would form across them.
"""

from __future__ import annotations

import dataclasses
import json
import re
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment

__all__ = [
    "ChatTemplateError",
    "ControlTokens",
    "control_token_pattern",
    "control_token_set",
    "mark_control_tokens",
    "marked_token_pattern",
    "render_chat_template",
    "resolve_cuts",
    "select_chat_template",
    "template_literal_text",
]

# Names a message's reasoning may come under; transformers copies it to `reasoning_content` (what
# templates read) and `thinking`.
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")

# Private-use characters wrapped around a control token found in caller input; the pair transformers
# uses (chat_template_utils._CONTROL_TOKEN_START / _END), so rendered text means the same to both.
MARK_START = "\U000f0000"
MARK_END = "\U000f0001"
# Private-use character placed at the edge of a caller string where that edge could be part of a
# control token (the string ends with "<end_of", or starts with "_turn>"). Rendered text keeps it only
# where a control token would form across it (`resolve_cuts`); the tokenizer encodes the text on
# either side of it separately, so the token is not made. torchgemma's own, not transformers'.
CUT = "\U000f0002"


class ChatTemplateError(ValueError):
    """The checkpoint has no usable chat template, or the inputs cannot be rendered."""


def select_chat_template(
    chat_template: str | Mapping[str, str] | None, *, tools: Sequence[Any] | None = None, source: str = ""
) -> str:
    """Pick the template string: a single template, or from named templates "tool_use" when tools are
    given and it exists, else "default" (transformers' rule)."""
    where = f" ({source})" if source else ""
    if chat_template is None:
        raise ChatTemplateError(
            f"This tokenizer has no chat template{where}: neither chat_template.jinja nor a 'chat_template' "
            "entry in tokenizer_config.json was found (a base model: continue raw text with generate). "
            "To chat anyway, give it one: tokenizer.chat_template = '<a Jinja template>' (llm.tokenizer "
            "for an LLM; `torchgemma chat --chat-template FILE`), or apply_chat_template(..., chat_template=...)."
        )
    if isinstance(chat_template, str):
        return chat_template
    if tools is not None and "tool_use" in chat_template:
        return chat_template["tool_use"]
    if "default" in chat_template:
        return chat_template["default"]
    raise ChatTemplateError(
        f"This tokenizer has several chat templates and none is named 'default'{where}; "
        f"choose one of {sorted(chat_template)}: tokenizer.chat_template = tokenizer.chat_template[NAME] "
        "(llm.tokenizer for an LLM), or apply_chat_template(..., chat_template=...) with its text"
    )


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}…{% endgeneration %}` marks assistant text for masks; rendering just emits it."""

    tags = {"generation"}

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_emit"), [], [], body).set_lineno(lineno)

    def _emit(self, caller: Any) -> str:
        return caller()


class _SafeDict:
    """`dict(...)` for templates without exposing the type itself (no attribute tricks)."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
        return dict.fromkeys(*args, **kwargs)


class _SafeNamespace(jinja2.utils.Namespace):
    """Jinja's namespace, refusing underscore names so templates cannot reach interpreter internals."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # noqa: N805 - mirrors Namespace's signature trick
        self, rest = args[0], args[1:]
        attrs = dict(*rest, **kwargs)
        for name in attrs:
            _SafeNamespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _SafeNamespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"chat templates may not set underscore attributes ({name!r})"
            )


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: Any = None,
    sort_keys: bool = False,
) -> str:
    # Jinja's own tojson escapes <, >, & and ' for HTML; chat templates expect plain JSON.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@lru_cache(maxsize=32)
def _compile(template: str) -> jinja2.Template:
    major_minor_patch = tuple(int(p) for p in jinja2.__version__.split(".")[:3] if p.isdigit())
    if major_minor_patch < (3, 1, 6):
        # Earlier releases have known sandbox escapes; hub templates are untrusted code.
        raise ImportError(f"chat templates need jinja2>=3.1.6, found {jinja2.__version__}")
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _SafeDict()
    env.globals["namespace"] = _SafeNamespace
    return env.from_string(template)


def _plain(value: Any) -> Any:
    """Rebuild `value` from plain JSON-like types; anything else becomes "<TypeName>".

    Templates only test whether media keys exist, so an image or tensor can become a placeholder
    without changing the output, and the sandbox never sees objects with side-effecting methods."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    numpy = sys.modules.get("numpy")
    if numpy is not None and isinstance(value, numpy.generic):
        # np.bool_(False) must stay falsy, not become a truthy placeholder string.
        return _plain(value.item())
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if callable(getattr(value, "model_dump", None)):  # pydantic models
        return _plain(value.model_dump())
    return f"<{type(value).__name__}>"


@lru_cache(maxsize=32)
def template_literal_text(template: str) -> str:
    """The template's raw text and string constants, joined with NULs so no match spans two of them.

    An added token found here is one the template writes, so it counts as a control token (see
    `Tokenizer.control_tokens`). Tokens the template builds from pieces (`'<|' + role + '|>'`) are
    missed; special tokens are control tokens regardless, and `chat_control_tokens` can list others."""
    tree = _compile(template).environment.parse(template)
    literals = {node.data for node in tree.find_all(jinja2.nodes.TemplateData)}
    literals |= {node.value for node in tree.find_all(jinja2.nodes.Const) if isinstance(node.value, str)}
    return "\0".join(sorted(literals))


def _alternation(tokens: Sequence[str]) -> str:
    """A regex for any of `tokens`, taking the longest where several match at one position (what
    transformers' longest-first alternation does), written as a trie: real vocabularies have
    thousands of added tokens, and a flat alternation tries each of them at every "<"."""
    trie: dict[str, dict] = {}
    for token in filter(None, tokens):  # an empty token would match everywhere
        node = trie
        for char in token:
            node = node.setdefault(char, {})
        node[""] = {}  # a token ends here

    def pattern(node: dict[str, dict]) -> str:
        branches = [re.escape(char) + pattern(child) for char, child in node.items() if char]
        if not branches:
            return ""
        body = branches[0] if len(branches) == 1 else f"(?:{'|'.join(branches)})"
        # Where a token ends but longer ones go on, the greedy ? tries the longer ones first.
        return f"(?:{body})?" if "" in node else body

    return pattern(trie) if any(tokens) else "(?!)"  # (?!) never matches


@lru_cache(maxsize=64)
def control_token_pattern(control_tokens: tuple[str, ...]) -> re.Pattern[str]:
    """A regex matching any of `control_tokens` (never matching when there are none)."""
    return re.compile(_alternation(control_tokens))


@lru_cache(maxsize=8)
def marked_token_pattern(added_tokens: tuple[str, ...]) -> re.Pattern[str]:
    """A regex matching a marked added token (group 1: the token), or a lone marker or cut (group 1:
    None), each a place where the text is encoded in separate pieces.

    Lone markers appear when a template's string methods cut a marked token apart (`split`); cuts
    are left by `resolve_cuts`."""
    return re.compile(f"{MARK_START}({_alternation(added_tokens)}){MARK_END}|[{MARK_START}{MARK_END}{CUT}]")


@dataclass(frozen=True)
class ControlTokens:
    """One tokenizer's control tokens for a template, in the forms sanitizing looks them up in."""

    pattern: re.Pattern[str]  # any of them, the longest where several start at one place
    prefixes: frozenset[str]  # every proper, non-empty prefix ("<", "<t", ... "<turn|")
    suffixes: frozenset[str]  # every proper, non-empty suffix (">", "|>", ... "turn|>")
    longest: int  # characters in the longest one

    def ends_partway(self, text: str, end: int) -> bool:
        """Whether `text[:end]` ends with the beginning of a control token (text after it could
        complete one)."""
        return any(text[end - k : end] in self.prefixes for k in range(1, min(self.longest, end + 1)))

    def starts_partway(self, text: str, start: int) -> bool:
        """Whether `text[start:]` starts with the end of a control token."""
        room = len(text) - start
        return any(text[start : start + k] in self.suffixes for k in range(1, min(self.longest, room + 1)))

    def straddles(self, text: str, position: int) -> bool:
        """Whether a control token in `text` begins before `position` and ends after it."""
        for start in range(max(0, position - self.longest + 1), position):
            match = self.pattern.match(text, start)
            if match is not None and match.end() > position:
                return True
        return False


@lru_cache(maxsize=64)
def control_token_set(control_tokens: tuple[str, ...]) -> ControlTokens:
    """`control_tokens` as a `ControlTokens` (empty strings ignored)."""
    tokens = [token for token in control_tokens if token]
    return ControlTokens(
        pattern=control_token_pattern(control_tokens),
        prefixes=frozenset(token[:k] for token in tokens for k in range(1, len(token))),
        suffixes=frozenset(token[k:] for token in tokens for k in range(1, len(token))),
        longest=max((len(token) for token in tokens), default=0),
    )


def _mark_string(text: str, controls: ControlTokens) -> str:
    """A caller string with its control tokens marked and cuts at its edges where they could be part
    of one (see `mark_control_tokens`)."""
    # Markers and cuts typed by the caller are dropped: they could forge a marked token or a cut.
    text = text.replace(MARK_START, "").replace(MARK_END, "").replace(CUT, "")
    text = controls.pattern.sub(lambda match: f"{MARK_START}{match.group()}{MARK_END}", text)
    # Edges both with and without the surrounding whitespace: templates often print strings trimmed
    # (`| trim`), and a cut inside the whitespace keeps the whitespace trimmable, the cut in place.
    core_start, core_end = len(text) - len(text.lstrip()), len(text.rstrip())
    cuts = {end for end in (core_end, len(text)) if end > 0 and controls.ends_partway(text, end)}
    cuts |= {start for start in (core_start, 0) if start < len(text) and controls.starts_partway(text, start)}
    for position in sorted(cuts, reverse=True):
        text = text[:position] + CUT + text[position:]
    return text


def mark_control_tokens(value: Any, controls: ControlTokens) -> Any:
    """`value` with every control token in its strings wrapped in markers, and a cut at each string
    edge that could be part of a control token (the string ends with "<end_of" or starts with
    "_turn>"), for `resolve_cuts` to keep where the rendered text would join it into one.

    Strings are found in mappings (keys too, unlike transformers: Gemma's template prints the keys
    of tool-call arguments and tool schemas), lists and tuples (both become lists, as in
    transformers), dataclasses and pydantic models (made plain first); other values are returned
    as they are. Markers and cuts already in a string are dropped first, so input cannot forge them.
    Strings without such edges are only changed where they hold control tokens, so templates that
    compare them (`role == 'user'`) see the caller's text.
    """
    if isinstance(value, str):
        return _mark_string(value, controls)
    if isinstance(value, Mapping):
        return {mark_control_tokens(k, controls): mark_control_tokens(v, controls) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [mark_control_tokens(v, controls) for v in value]
    if not isinstance(value, type) and (
        dataclasses.is_dataclass(value) or callable(getattr(value, "model_dump", None))
    ):
        return mark_control_tokens(_plain(value), controls)
    return value


def resolve_cuts(text: str, controls: ControlTokens) -> str:
    """Text rendered from input marked by `mark_control_tokens`, with each cut kept only where a
    control token would otherwise form across it (from two caller strings the template printed side
    by side, or a caller string and the template's text).

    Every other cut is dropped, so input without such joins is encoded exactly as before. Marked
    tokens and lone markers already separate the text (no control token spans one). A control token
    the template writes whole, or builds around a caller string from its own text (`'<|' + role +
    '|>'`), has no caller edge inside it: it stays a token."""
    if CUT not in text:
        return text
    pieces = text.split(CUT)
    plain = "".join(pieces)
    kept, position = [pieces[0]], len(pieces[0])
    for piece in pieces[1:]:
        if controls.straddles(plain, position):
            kept.append(CUT)
        kept.append(piece)
        position += len(piece)
    return "".join(kept)


def _prepare_messages(messages: Sequence[Any]) -> list[dict]:
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise TypeError("messages must be a list of {'role': ..., 'content': ...} dicts")
    if len(messages) == 0:
        raise ChatTemplateError("cannot apply a chat template to an empty conversation")
    # Keys whose value is None are dropped: templates handle a missing key but often print "None".
    chat = _plain(
        [{k: v for k, v in m.items() if v is not None} if isinstance(m, Mapping) else m for m in messages]
    )
    prepared = []
    for message in chat:
        if not isinstance(message, dict):
            raise TypeError(f"chat messages must be dicts, got {message!r}")
        reasoning = next((message[k] for k in _REASONING_FIELDS if message.get(k) is not None), None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        prepared.append(message)
    return prepared


def render_chat_template(
    template: str,
    messages: Sequence[Mapping[str, Any]],
    *,
    tools: Sequence[Mapping[str, Any]] | None = None,
    documents: Sequence[Mapping[str, Any]] | None = None,
    add_generation_prompt: bool = False,
    **template_kwargs: Any,
) -> str:
    """Render one conversation with `template` as transformers' `apply_chat_template(tokenize=False)`.

    `template_kwargs` are the extra template variables (special-token strings, `enable_thinking`, …).
    Tools must already be JSON-schema dicts (transformers can also build them from Python functions;
    that conversion is not reproduced here)."""
    compiled = _compile(template)
    if tools is not None:
        for tool in tools:
            if not isinstance(tool, Mapping):
                raise TypeError(f"tools must be JSON-schema dicts, got {type(tool).__name__}")
    if documents is not None:
        for document in documents:
            if not isinstance(document, Mapping):
                raise TypeError("documents must be dicts (e.g. with 'title' and 'text' keys)")
    return compiled.render(
        messages=_prepare_messages(messages),
        tools=_plain(list(tools)) if tools is not None else None,
        documents=_plain(list(documents)) if documents is not None else None,
        add_generation_prompt=add_generation_prompt,
        **_plain(template_kwargs),
    )
