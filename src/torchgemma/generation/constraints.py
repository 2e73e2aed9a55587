"""Constrained decoding: only tokens that keep the reply a valid prefix of a JSON object.

A constraint is a small stateful object the engine consults for one request:

    constraint.allows(token_id) -> bool    would the reply still be valid with this token?
    constraint.advance(token_id)           the token was chosen
    constraint.complete -> bool            the reply is a whole JSON object
    constraint.allowed_tokens(budget)      the allowed ids, found with at most ~budget steps of work

The engine draws a token as usual (greedy or sampled, after every filter); if the constraint refuses
it, the engine draws again from the same distribution (rejection sampling: exactly the distribution
restricted to the allowed tokens), which costs nothing while the model writes valid JSON anyway
(the usual case when asked for JSON). Only when many draws are refused does it ask for the allowed
set (``Engine._constrained``): a walk of the vocabulary sorted by bytes, which feeds each shared
prefix once and stops at the first refused byte, so its cost follows the allowed prefixes, not the
vocabulary's size, and is capped per step.

``JSONObject`` checks bytes with a pushdown recognizer of RFC 8259 JSON whose top-level value must be
an object. Stop tokens are allowed only once the object is closed; special tokens never; runs of
whitespace are capped so that the model cannot pad forever, and nesting at ``MAX_DEPTH`` levels.
"""

from __future__ import annotations

import bisect
from collections import OrderedDict
from collections.abc import Iterable, Sequence

# Longest run of whitespace allowed between JSON tokens.
MAX_WHITESPACE = 16
# Deepest nesting of objects and arrays: each level is a new recognizer state (a new walk of the
# vocabulary when the engine needs the allowed set), and no reply needs more.
MAX_DEPTH = 64

_WHITESPACE = frozenset(b" \t\n\r")
_DIGITS = frozenset(b"0123456789")
_HEX = frozenset(b"0123456789abcdefABCDEF")
_ESCAPES = frozenset(b'"\\/bfnrtu')
_LITERALS = {ord("t"): b"rue", ord("f"): b"alse", ord("n"): b"ull"}


class JSONPrefix:
    """A byte-by-byte recognizer: ``feed`` returns False as soon as the bytes cannot start a JSON object."""

    def __init__(self) -> None:
        # What comes next: "value", "key_or_end" (after '{'), "key" (after ',' in an object),
        # "colon", "after" (after a value), "value_or_end" (after '['), "done", or inside a scalar.
        self.expect = "top"
        self.stack: list[int] = []  # b"{" / b"[" of the open containers
        self.scalar: str | None = None  # "string", "number", "literal"
        self.string_is_key = False
        self.escape = 0  # 1 after a backslash, 2..5 while reading \uXXXX
        self.number = ""  # the number's grammar state
        self.literal = b""  # the literal's remaining bytes
        self.whitespace = 0

    @property
    def complete(self) -> bool:
        return self.expect == "done"

    def copy(self) -> JSONPrefix:
        # (A plain __dict__ copy: copy.copy's generic path doubled the cost of a vocabulary walk.)
        clone = type(self).__new__(type(self))
        clone.__dict__.update(self.__dict__)
        clone.stack = list(self.stack)  # the one mutable field
        return clone

    def feed_all(self, data: bytes) -> bool:
        return all(self.feed(byte) for byte in data)

    def feed(self, byte: int) -> bool:
        if self.scalar == "string":
            return self._string(byte)
        if self.scalar == "literal":
            if not self.literal or byte != self.literal[0]:
                return False
            self.literal = self.literal[1:]
            if not self.literal:
                self.scalar = None
                self.expect = "after"
            return True
        if self.scalar == "number":
            if self._number(byte):
                return True
            if self.number not in ("int", "zero", "frac", "exp"):
                return False  # a number cannot end here ("-", "1.", "1e", "1e+")
            self.scalar = None
            self.expect = "after"
            # The byte that ended the number is read as what follows it.
        if byte in _WHITESPACE:
            if self.expect not in ("value", "key_or_end", "key", "colon", "after", "value_or_end", "done"):
                return False
            self.whitespace += 1
            return self.whitespace <= MAX_WHITESPACE
        self.whitespace = 0
        expect = self.expect
        if expect == "top":
            if byte != ord("{"):
                return False
            self.stack.append(byte)
            self.expect = "key_or_end"
            return True
        if expect in ("key_or_end", "key"):
            if byte == ord('"'):
                self.scalar, self.string_is_key = "string", True
                return True
            return expect == "key_or_end" and self._close(byte)
        if expect == "colon":
            if byte != ord(":"):
                return False
            self.expect = "value"
            return True
        if expect in ("value", "value_or_end"):
            if expect == "value_or_end" and byte == ord("]"):
                return self._close(byte)
            return self._start_value(byte)
        if expect == "after":
            if byte == ord(","):
                self.expect = "key" if self.stack[-1] == ord("{") else "value"
                return True
            return self._close(byte)
        return False  # "done": nothing but whitespace

    def _start_value(self, byte: int) -> bool:
        if byte == ord('"'):
            self.scalar, self.string_is_key = "string", False
            return True
        if byte in (ord("{"), ord("[")):
            if len(self.stack) >= MAX_DEPTH:
                return False
            self.stack.append(byte)
            self.expect = "key_or_end" if byte == ord("{") else "value_or_end"
            return True
        if byte in _LITERALS:
            self.scalar, self.literal = "literal", _LITERALS[byte]
            return True
        if byte == ord("-") or byte in _DIGITS:
            self.scalar = "number"
            self.number = "sign" if byte == ord("-") else ("zero" if byte == ord("0") else "int")
            return True
        return False

    def _close(self, byte: int) -> bool:
        if not self.stack or byte != {ord("{"): ord("}"), ord("["): ord("]")}[self.stack[-1]]:
            return False
        self.stack.pop()
        self.expect = "after" if self.stack else "done"
        return True

    def _string(self, byte: int) -> bool:
        if self.escape == 1:
            if byte not in _ESCAPES:
                return False
            self.escape = 2 if byte == ord("u") else 0
            return True
        if self.escape >= 2:
            if byte not in _HEX:
                return False
            self.escape = 0 if self.escape == 5 else self.escape + 1
            return True
        if byte == ord("\\"):
            self.escape = 1
            return True
        if byte == ord('"'):
            self.scalar = None
            self.expect = "colon" if self.string_is_key else "after"
            return True
        return byte >= 0x20  # control characters must be escaped

    def _number(self, byte: int) -> bool:
        state, digit = self.number, byte in _DIGITS
        transitions = {
            "sign": {"digit": "int"} if byte != ord("0") else {"digit": "zero"},
            "zero": {".": "dot", "e": "e"},
            "int": {"digit": "int", ".": "dot", "e": "e"},
            "dot": {"digit": "frac"},
            "frac": {"digit": "frac", "e": "e"},
            "e": {"sign": "esign", "digit": "exp"},
            "esign": {"digit": "exp"},
            "exp": {"digit": "exp"},
        }[state]
        if digit:
            key = "digit"
        elif byte in (ord("e"), ord("E")):
            key = "e"
        elif byte in (ord("+"), ord("-")):
            key = "sign"
        elif byte == ord("."):
            key = "."
        else:
            return False
        if key not in transitions:
            return False
        self.number = transitions[key]
        return True

    def key(self) -> tuple:
        """Everything that decides what may follow: equal keys accept the same bytes."""
        return (
            self.expect,
            self.scalar,
            self.string_is_key,
            self.escape,
            self.number,
            self.literal,
            self.whitespace,
            tuple(self.stack),
        )


class SortedVocabulary:
    """A vocabulary's tokens sorted by their bytes: the tokens that start with a prefix are one
    contiguous run, so a recognizer can walk all tokens as a trie without building one."""

    def __init__(self, vocabulary: Sequence[bytes | None]):
        self.ids = sorted(
            (token for token, data in enumerate(vocabulary) if data), key=vocabulary.__getitem__
        )
        self.keys = [vocabulary[token] for token in self.ids]
        # Allowed sets already found whole, by recognizer state (shared by every request).
        self.found: OrderedDict[tuple, list[int]] = OrderedDict()

    def accepted(self, start: JSONPrefix, budget: int) -> tuple[list[int], bool]:
        """The ids whose bytes ``start`` accepts, feeding at most ``budget`` bytes; and whether the
        walk finished (False: the ids found before the budget ran out)."""
        keys, ids, out = self.keys, self.ids, []
        # (recognizer after the prefix, prefix length, run [lo, hi) of tokens with that prefix)
        pending = [(start, 0, 0, len(keys))]
        while pending:
            state, depth, lo, hi = pending.pop()
            while lo < hi and len(keys[lo]) == depth:  # tokens that are exactly the prefix
                out.append(ids[lo])
                lo += 1
            while lo < hi:
                byte = keys[lo][depth]
                prefix = keys[lo][: depth + 1]
                end = hi if byte == 255 else bisect.bisect_left(keys, prefix[:-1] + bytes([byte + 1]), lo, hi)
                if budget <= 0:
                    return out, False
                budget -= 1
                child = state.copy()
                if child.feed(byte):
                    pending.append((child, depth + 1, lo, end))
                lo = end
        return out, True


# One sorted vocabulary per tokenizer vocabulary in use (kept with it, so the id stays its own).
_SORTED: dict[int, tuple[Sequence, SortedVocabulary]] = {}
MAX_CACHED_STATES = 256


def sorted_vocabulary(vocabulary: Sequence[bytes | None]) -> SortedVocabulary:
    entry = _SORTED.get(id(vocabulary))
    if entry is None or entry[0] is not vocabulary:
        if len(_SORTED) >= 4:
            _SORTED.clear()
        entry = _SORTED[id(vocabulary)] = (vocabulary, SortedVocabulary(vocabulary))
    return entry[1]


class JSONObject:
    """The constraint for ``response_format: json_object`` over a vocabulary given as bytes.

    ``vocabulary[i]`` is token ``i``'s bytes, or None for a special token (never allowed);
    ``stop_ids`` end the reply and are allowed only once the object is complete.
    """

    def __init__(self, vocabulary: Sequence[bytes | None], stop_ids: Iterable[int]):
        self.vocabulary = vocabulary
        self.stop_ids = frozenset(stop_ids)
        self.prefix = JSONPrefix()

    def allowed_tokens(self, budget: int) -> list[int]:
        """Every id allowed now, or if finding them all would feed more than ``budget`` bytes, those
        found within it (sets found whole are remembered per recognizer state)."""
        index = sorted_vocabulary(self.vocabulary)
        key = self.prefix.key()
        accepted = index.found.get(key)
        if accepted is None:
            accepted, whole = index.accepted(self.prefix, budget)
            if whole:
                index.found[key] = accepted
                if len(index.found) > MAX_CACHED_STATES:
                    index.found.popitem(last=False)
        else:
            index.found.move_to_end(key)
        # Stop ids are this request's: allowed once the object is complete, whatever their bytes.
        allowed = [t for t in accepted if t not in self.stop_ids]
        return allowed + sorted(self.stop_ids) if self.prefix.complete else allowed

    @property
    def complete(self) -> bool:
        return self.prefix.complete

    def allows(self, token_id: int) -> bool:
        if token_id in self.stop_ids:
            return self.prefix.complete
        data = self.vocabulary[token_id] if 0 <= token_id < len(self.vocabulary) else None
        if not data:
            return False
        return self.prefix.copy().feed_all(data)

    def advance(self, token_id: int) -> None:
        if token_id in self.stop_ids:
            return
        data = self.vocabulary[token_id]
        if data is None or not self.prefix.feed_all(data):
            raise ValueError(f"token {token_id} does not continue the JSON object")
