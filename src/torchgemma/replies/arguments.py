"""Gemma's tool-call argument syntax, `{key:value,...}`, read into JSON-compatible values.

Strings are wrapped in `<|"|>` (Gemma's string delimiter, one added token); everything else is
JSON-like: objects, arrays, numbers, `true` / `false` / `null`, with bare keys. What a model writes
sloppily (bare words, JSON quotes, trailing commas) is read as the grammar's tests pin down.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass

QUOTE = '<|"|>'  # Gemma's string delimiter, in arguments and tool results


class ArgumentSyntaxError(ValueError):
    """Tool-call arguments that are not Gemma's `{key:value,...}` syntax."""


_PUNCTUATION = "{}[]:,"
_NUMBER = re.compile(r"-?(?:0|[1-9]\d*)(?:\.\d+)?(?:[eE][+-]?\d+)?")  # JSON's number grammar
_MAX_DEPTH = 100  # deeper nesting is an error, not a RecursionError
_JSON = json.JSONDecoder()


@dataclass(frozen=True)
class _Token:
    kind: str  # one of "{}[]:,", "string" (quoted) or "word" (bare)
    value: str
    start: int
    end: int


def _lex(text: str) -> list[_Token]:
    tokens = []
    i = 0
    while i < len(text):
        if text[i].isspace():
            i += 1
        elif text.startswith(QUOTE, i):
            close = text.find(QUOTE, i + len(QUOTE))
            if close < 0:
                raise ArgumentSyntaxError(f"unterminated string at character {i}")
            tokens.append(_Token("string", text[i + len(QUOTE) : close], i, close + len(QUOTE)))
            i = close + len(QUOTE)
        elif text[i] in _PUNCTUATION:
            tokens.append(_Token(text[i], text[i], i, i + 1))
            i += 1
        else:
            if text[i] == '"':
                # Models trained on JSON sometimes quote strings the JSON way.
                try:
                    value, end = _JSON.raw_decode(text, i)
                except ValueError:
                    pass
                else:
                    tokens.append(_Token("string", value, i, end))
                    i = end
                    continue
            end = i
            while (
                end < len(text)
                and not text[end].isspace()
                and text[end] not in _PUNCTUATION
                and not text.startswith(QUOTE, end)
            ):
                end += 1
            tokens.append(_Token("word", text[i:end], i, end))
            i = end
    return tokens


def _bare_value(word: str) -> object:
    if word in ("true", "false"):
        return word == "true"
    if word == "null":
        return None
    if _NUMBER.fullmatch(word):
        if word.lstrip("-").isdigit():
            return int(word)
        number = float(word)
        if math.isfinite(number):  # 1e999 would become Infinity, which is not JSON
            return number
    return word


class _ArgumentParser:
    """Recursive descent over `_lex` tokens: object := { [key : value (, key : value)* [,]] }."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.tokens = _lex(text)
        self.pos = 0

    def parse(self) -> dict:
        if self._peek() != "{":
            raise self._error("'{'")
        arguments = self._object(1)
        if self.pos != len(self.tokens):
            raise self._error("the end of the arguments")
        return arguments

    def _peek(self) -> str:
        return self.tokens[self.pos].kind if self.pos < len(self.tokens) else "end"

    def _next(self) -> _Token:
        token = self.tokens[self.pos]
        self.pos += 1
        return token

    def _expect(self, kind: str) -> None:
        if self._peek() != kind:
            raise self._error(f"'{kind}'")
        self.pos += 1

    def _error(self, expected: str) -> ArgumentSyntaxError:
        if self.pos < len(self.tokens):
            token = self.tokens[self.pos]
            found = f"{token.value!r} at character {token.start}"
        else:
            found = "the end"
        return ArgumentSyntaxError(f"expected {expected}, found {found} in {self.text!r}")

    def _words(self, *, colons: bool) -> str:
        # Sloppy bare text: `hello world`, and in values `http://x` (lexed as word : word), kept verbatim.
        first = last = self._next()
        while self._peek() == "word" or (colons and self._peek() == ":"):
            last = self._next()
        return self.text[first.start : last.end]

    def _key(self) -> str:
        if self._peek() == "string":
            return self._next().value
        if self._peek() == "word":
            return self._words(colons=False)
        raise self._error("a key")

    def _value(self, depth: int) -> object:
        kind = self._peek()
        if kind == "{":
            return self._object(depth + 1)
        if kind == "[":
            return self._array(depth + 1)
        if kind == "string":
            return self._next().value
        if kind == "word":
            return _bare_value(self._words(colons=True))
        raise self._error("a value")

    def _object(self, depth: int) -> dict:
        if depth > _MAX_DEPTH:
            raise ArgumentSyntaxError(f"arguments nested deeper than {_MAX_DEPTH} levels")
        self._expect("{")
        result = {}
        while self._peek() != "}":
            key = self._key()
            self._expect(":")
            result[key] = self._value(depth)
            if self._peek() != ",":
                break
            self.pos += 1  # a trailing comma before '}' is tolerated
        self._expect("}")
        return result

    def _array(self, depth: int) -> list:
        if depth > _MAX_DEPTH:
            raise ArgumentSyntaxError(f"arguments nested deeper than {_MAX_DEPTH} levels")
        self._expect("[")
        result = []
        while self._peek() != "]":
            result.append(self._value(depth))
            if self._peek() != ",":
                break
            self.pos += 1
        self._expect("]")
        return result


def parse_arguments(text: str) -> dict:
    """Gemma's `{key:value,...}` argument syntax -> a dict of JSON-compatible values.

    Strings are `<|"|>…<|"|>` (or JSON-quoted); keys may be bare or quoted. A bare value is `true`,
    `false`, `null`, a JSON number, or else a string (sloppy `{path:a.txt}`). Whitespace between
    tokens and trailing commas are tolerated. Raises ArgumentSyntaxError."""
    return _ArgumentParser(text).parse()
