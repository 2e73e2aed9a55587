"""Gemma's tool-call syntax as a grammar: what a reply forced to call a tool may be, token by token.

    <|tool_call>call:NAME{key:value,...}<tool_call|>

``tool_call_lark`` writes it in Lark (llguidance's dialect, see generation/constraints.py) for the
declared tools: NAME is one of theirs (or the one named), and the arguments follow that tool's
JSON Schema in Gemma's argument syntax (``arguments.py``): bare keys, in the order the chat
template writes them (sorted, its ``dictsort``), strings between ``<|"|>`` tokens, JSON numbers,
``true`` / ``false`` / ``null``, ``[...]`` and nested ``{...}``, no whitespace.

Enforced from a schema: ``type`` (and lists of types), ``properties`` with ``required`` (optional
properties may be left out; no other keys), ``items``, ``minItems`` >= 1, ``enum``, ``const``,
``anyOf`` / ``oneOf``, ``$ref`` into ``$defs`` / ``definitions``, an integer's ``minimum`` >= 0
(no sign), a string's ``pattern`` or ``minLength`` / ``maxLength`` (then without "<"). Other
keywords (numeric bounds, formats) are not enforced. Strings never contain ``<|`` (the start of
every control token's text).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from typing import Any

from .arguments import QUOTE

# Text without "<|": a string value, a thought, an answer before a call.
_TEXT = r"/(?:[^<]|<+[^<|])*<*/"
_NUMBER = r"/-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?/"
_INTEGER = r"/-?(?:0|[1-9][0-9]*)/"
_NATURAL = r"/(?:0|[1-9][0-9]*)/"
_KEY = r"/[A-Za-z_][A-Za-z0-9_.\-]*/"


def _literal(text: str) -> str:
    return json.dumps(text)


class _Builder:
    """JSON Schemas -> Lark rules over Gemma's argument syntax."""

    def __init__(self, quote: int, root: Mapping[str, Any]) -> None:
        self.quote = f"<[{quote}]>"
        self.root = root
        self.rules: dict[str, str] = {}
        self.refs: dict[str, str] = {}
        self.any_rule: str | None = None
        self.any_obj: str | None = None

    def rule(self, body: str) -> str:
        name = f"r{len(self.rules)}"
        self.rules[name] = body
        return name

    def string(self, body: str = _TEXT) -> str:
        return f"{self.quote} {body} {self.quote}"

    def constant(self, value: Any) -> str:
        """A value written as the chat template writes it (``format_argument``)."""
        if isinstance(value, str):
            return f"{self.quote} {_literal(value)} {self.quote}" if value else f"{self.quote} {self.quote}"
        if isinstance(value, Mapping):
            items = [f"{_literal(str(k) + ':')} {self.constant(v)}" for k, v in sorted(value.items())]
            return '"{" ' + ' "," '.join(items) + ' "}"'
        if isinstance(value, list):
            return '"[" ' + ' "," '.join(self.constant(v) for v in value) + ' "]"'
        return _literal(json.dumps(value))

    def value(self, schema: Any) -> str:
        """The rule (or inline expression) for a value valid against ``schema``."""
        if schema is True or schema is None or schema == {}:
            return self.any_value()
        if not isinstance(schema, Mapping):
            raise ValueError(f"a JSON schema must be an object, got {schema!r}")
        if "$ref" in schema:
            return self.reference(schema["$ref"])
        if "const" in schema:
            return self.constant(schema["const"])
        if "enum" in schema:
            return "(" + " | ".join(self.constant(v) for v in schema["enum"]) + ")"
        for key in ("anyOf", "oneOf"):
            if key in schema:
                return "(" + " | ".join(self.value(option) for option in schema[key]) + ")"
        if "allOf" in schema and len(schema["allOf"]) == 1:
            return self.value(schema["allOf"][0])
        kind = schema.get("type")
        if isinstance(kind, list):
            return "(" + " | ".join(self.value({**schema, "type": k}) for k in kind) + ")"
        if kind is None:
            kind = "object" if "properties" in schema else "array" if "items" in schema else None
        if kind is None:
            return self.any_value()
        if kind == "string":
            pattern = schema.get("pattern")
            lengths = schema.get("minLength", 0), schema.get("maxLength")
            if pattern is None and lengths != (0, None):
                low, high = lengths
                return self.string(f"/[^<]{{{low},{'' if high is None else high}}}/")
            if pattern is None:
                return self.string()
            body = pattern.removeprefix("^").removesuffix("$").replace("/", "\\/")
            return self.string(f"/{body}/")
        if kind == "integer":
            minimum = schema.get("minimum", schema.get("exclusiveMinimum"))
            return _NATURAL if isinstance(minimum, (int, float)) and minimum >= 0 else _INTEGER
        if kind == "number":
            return _NUMBER
        if kind == "boolean":
            return '("true" | "false")'
        if kind == "null":
            return '"null"'
        if kind == "array":
            return self.array(schema)
        if kind == "object":
            return self.object(schema)
        raise ValueError(f"unknown JSON schema type {kind!r}")

    def reference(self, ref: str) -> str:
        if ref not in self.refs:
            match = re.fullmatch(r"#/(\$defs|definitions)/(.+)", ref)
            target = None if match is None else self.root.get(match.group(1), {}).get(match.group(2))
            if target is None:
                raise ValueError(f"unresolvable $ref {ref!r}")
            name = self.refs[ref] = self.rule("")  # named first: references may recurse
            self.rules[name] = self.value(target)
        return self.refs[ref]

    def array(self, schema: Mapping[str, Any]) -> str:
        item = self.value(schema.get("items", {}))
        more = f'("," {item})*'
        if schema.get("minItems", 0) >= 1:
            return self.rule(f'"[" {item} {more} "]"')
        return self.rule(f'"[" ({item} {more})? "]"')

    def object(self, schema: Mapping[str, Any]) -> str:
        properties = schema.get("properties")
        if not properties:
            return self.any_object()
        required = set(schema.get("required", ()))
        names = sorted(properties)  # the order the chat template writes keys in
        # after: the properties from here on, some already written (each then comes after a comma);
        # first: the same, none written yet. Two rules per property.
        after, first = "", None
        for name in reversed(names):
            pair = f"{_literal(name + ':')} {self.value(properties[name])}"
            if name in required:
                after, first = self.rule(f'"," {pair} {after}'), self.rule(f"{pair} {after}")
            else:
                written = f"{pair} {after}"
                after = self.rule(f'("," {pair})? {after}')
                first = self.rule(f"{written} | {first}" if first else f"({written})?")
        return self.rule(f'"{{" {first} "}}"')

    def any_value(self) -> str:
        if self.any_rule is None:
            self.any_rule = self.rule("")
            obj = self.any_obj = self.rule("")
            arr = self.rule("")
            pair = f'{_KEY} ":" {self.any_rule}'
            self.rules[obj] = f'"{{" ({pair} ("," {pair})*)? "}}"'
            self.rules[arr] = f'"[" ({self.any_rule} ("," {self.any_rule})*)? "]"'
            self.rules[self.any_rule] = (
                f'{self.string()} | {_NUMBER} | "true" | "false" | "null" | {obj} | {arr}'
            )
        return self.any_rule

    def any_object(self) -> str:
        self.any_value()
        return self.any_obj


def tool_call_lark(
    tools: Sequence[Mapping[str, Any]],
    *,
    tokens: Mapping[str, int],
    name: str | None = None,
    parallel: bool = True,
    thinking: bool = False,
    optional: bool = False,
) -> str:
    """A Lark grammar of replies that call the ``tools`` (OpenAI function specs: ``name``,
    ``parameters``), for llguidance.

    ``tokens`` maps ``<|tool_call>``, ``<tool_call|>``, ``<|"|>`` (and, with ``thinking``,
    ``<|channel>`` and ``<channel|>``) to their ids. ``name``: only that tool (OpenAI's named
    ``tool_choice``). ``parallel=False``: exactly one call. ``thinking``: a thought may come first.
    ``optional``: answer text may come first and the call may be left out, but at most one call
    comes (``tool_choice: auto`` with ``parallel_tool_calls: false``).
    """
    start, end = f"<[{tokens['<|tool_call>']}]>", f"<[{tokens['<tool_call|>']}]>"
    chosen = [tool for tool in tools if name is None or tool["name"] == name]
    if not chosen:
        raise ValueError(f"no tool named {name!r}" if name else "no tools to call")
    lines = []
    alternatives = []
    for index, tool in enumerate(chosen):
        parameters = tool.get("parameters") or {"type": "object", "properties": {}}
        builder = _Builder(tokens[QUOTE], parameters)
        if parameters.get("type", "object") != "object":
            raise ValueError(f"tool {tool['name']!r}: parameters must be an object schema")
        arguments = builder.value(parameters) if parameters.get("properties") else '"{" "}"'
        prefix = f"t{index}_"
        for rule, body in builder.rules.items():
            lines.append(f"{prefix}{rule}: {_prefixed(body, prefix)}")
        alternatives.append(f"{_literal(tool['name'])} {_prefixed(arguments, prefix)}")
    lines.insert(0, f'call: {start} "call:" ({" | ".join(alternatives)}) {end}')
    calls = "call+" if parallel and not optional else "call"
    head = ""
    if thinking:
        head = f"(<[{tokens['<|channel>']}]> {_TEXT} <[{tokens['<channel|>']}]>)? "
    body = f"{_TEXT}? {calls}?" if optional else calls
    return "\n".join([f"start: {head}{body}", *lines]) + "\n"


def _prefixed(expression: str, prefix: str) -> str:
    """Rule references r<N> made unique to one tool (t<i>_r<N>); literals and regexes untouched."""
    parts = re.split(r'("(?:[^"\\]|\\.)*"|/(?:[^/\\]|\\.)*/)', expression)
    return "".join(
        part if part.startswith(('"', "/")) else re.sub(r"\br(\d+)\b", rf"{prefix}r\1", part)
        for part in parts
    )
