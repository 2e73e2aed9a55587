"""Constrained decoding: a token mask per request, from a grammar (JSON Schema, regex, Lark).

One mechanism for every format a reply must follow (``response_format`` json_object and
json_schema, forced tool calls): a ``Grammar`` is compiled once from its source, and each request
that follows it gets its own ``GrammarConstraint`` (``grammar.start(stop_ids)``), which says at each
step which tokens may come next. The engine masks the request's logits to those tokens (the other
logits become -inf; allowed logits are left exactly as they are, so a model that writes allowed
tokens anyway gets the tokens it would get unconstrained), then samples as usual and advances the
constraint with the chosen token.

The masks come from llguidance (guidance-ai/llguidance; a structured-output backend of vLLM,
SGLang and llama.cpp): an Earley parser over the grammar's lexemes with a trie walk of the
vocabulary, which computes a 262K-token mask in 0.03-0.1 ms, with no per-schema precompilation
(benchmarks/bench_constraints.py measured it against outlines-core and xgrammar; see
benchmarks/README.md). Greedy requests skip the mask's unpacking when the model's own choice is
allowed (``constrained_token``). The masks of all constrained rows of a step are computed in one call, in
llguidance's threads, before any row samples (``fill_masks``); rows without a constraint compute
nothing.

Any object with ``allowed_mask(vocab_size) -> (V,) bool tensor`` and ``advance(token_id)`` can be a
constraint too (``TokenConstraint``), e.g. a scripted one in tests.

Stop tokens: a grammar says when the reply may end (llguidance allows its end-of-sequence token);
the request's own stop ids are then allowed instead, and only then. Special tokens are never
allowed unless the grammar names them (Lark's ``<[id]>``: the tool-call markers and ``<|"|>``).
"""

from __future__ import annotations

import functools
import json
import threading
import weakref
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from ..notices import slow_notice
from ..replies.tool_grammar import tool_call_lark
from .sampling import SamplingParams, check_scores, next_token, process_logits

NEG_INF = float("-inf")
# Whitespace between JSON tokens: none, one space, or a line break and an indentation of at most
# MAX_INDENT spaces or tabs (llama.cpp's json-schema-to-grammar rule): pretty-printed JSON fits,
# while a model cannot pad a reply with runs of blanks (the 270M, greedy, did).
MAX_INDENT = 20
_JSON_OPTIONS = {"whitespace_pattern": f"(?:\\x20|\\x0A[\\x20\\x09]{{0,{MAX_INDENT}}})?"}
_BITS = torch.arange(32, dtype=torch.int32)


def _llguidance():
    try:
        import llguidance
    except ImportError as error:
        raise ImportError(
            "constrained decoding (response_format, forced tool calls, grammars) needs llguidance: "
            "pip install 'torchgemma[constraints]'"
        ) from error
    return llguidance


class TokenConstraint(Protocol):
    """What the engine asks of a request's constraint at each step."""

    def allowed_mask(self, vocab_size: int) -> torch.Tensor:
        """The tokens that may come next: a (vocab_size,) bool tensor."""

    def advance(self, token_id: int) -> None:
        """The token was chosen."""


# ── the vocabulary, as llguidance reads it ───────────────────────────────────────────────────

_VOCABULARIES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_LOCK = threading.Lock()


def vocabulary_of(tokenizer) -> Vocabulary:
    """llguidance's view of a torchgemma ``Tokenizer`` (its ``tokenizers`` backend), made once per
    tokenizer: seconds for a 262K vocabulary. Every added token written like a control token
    (``<...>``: control, media, ``<unusedN>``) is marked special there, so that no text lexeme (a
    JSON string, an argument) takes one: a grammar allows one only by naming it."""
    with _LOCK:
        found = _VOCABULARIES.get(tokenizer)
        if found is None:
            with slow_notice(
                "torchgemma: reading the vocabulary for constrained output (once per tokenizer: seconds "
                "for a 262K vocabulary)..."
            ):
                found = _VOCABULARIES[tokenizer] = _read_vocabulary(tokenizer)
        return found


def _read_vocabulary(tokenizer) -> Vocabulary:
    """llguidance's tokenizer for ``tokenizer`` (``vocabulary_of``'s work, done once per tokenizer)."""
    llguidance = _llguidance()
    try:
        eos = tokenizer.named_id("eos_token")
    except Exception:  # noqa: BLE001 - no eos token: any special id stands for the end
        eos = min(tokenizer.special_ids) if tokenizer.special_ids else 0
    spec = json.loads(tokenizer.backend.to_str())
    for added in spec.get("added_tokens", ()):
        content = added["content"]
        added["special"] = added["special"] or (content.startswith("<") and content.endswith(">"))
    lltokenizer = llguidance.LLTokenizer(json.dumps(spec), n_vocab=tokenizer.vocab_size, eos_token=eos)
    found = Vocabulary(
        lltokenizer,
        sorted(set(lltokenizer.eos_tokens) | {lltokenizer.eos_token}),
        *_duplicates(tokenizer.token_bytes, lltokenizer),
    )
    # The spec's temporaries (its JSON, twice) back to the OS: the 270M's vocabulary left
    # the process 484 MiB larger, 254 after the trim (measured). (Imported here: importing
    # torchgemma leaves the tokenizer libraries for first use.)
    from ..tokenizer.loading import release_freed_heap

    release_freed_heap()
    return found


@dataclass(frozen=True)
class Vocabulary:
    """llguidance's tokenizer, and the ids that share their bytes with others: llguidance's token
    trie keeps one id per byte string (e.g. the byte-fallback piece <0x2F> and the piece "/"), so
    the others are allowed with it (a model may prefer either)."""

    lltokenizer: Any
    eos_ids: list[int]  # what llguidance allows where a reply may end
    duplicate_ids: torch.Tensor  # (M,) ids whose bytes another id has too
    duplicate_groups: torch.Tensor  # (M,) the group (one byte string) of each

    @functools.cached_property
    def duplicate_set(self) -> frozenset[int]:
        return frozenset(self.duplicate_ids.tolist())

    def share(self, allowed: torch.Tensor) -> None:
        """Allow, in place, every id of a byte string of which one id is allowed."""
        if self.duplicate_ids.numel():
            groups = int(self.duplicate_groups.max()) + 1
            members = allowed[self.duplicate_ids]
            any_allowed = torch.zeros(groups, dtype=torch.bool).index_put_(
                (self.duplicate_groups,), members, accumulate=True
            )
            allowed[self.duplicate_ids] = any_allowed[self.duplicate_groups]


def _duplicates(token_bytes, lltokenizer) -> tuple[torch.Tensor, torch.Tensor]:
    by_bytes: dict[bytes, list[int]] = {}
    for token, data in enumerate(token_bytes):
        if data and not lltokenizer.is_special_token(token):
            by_bytes.setdefault(data, []).append(token)
    groups = [ids for ids in by_bytes.values() if len(ids) > 1]
    ids = [token for group in groups for token in group]
    numbers = [number for number, group in enumerate(groups) for _ in group]
    return torch.tensor(ids, dtype=torch.long), torch.tensor(numbers, dtype=torch.long)


def _lark_source(lark: str) -> str:
    """llguidance's grammar for Lark text, forcing nothing: by default, text a grammar fixes (a
    key, a tool's name) is allowed only in the tokenizer's canonical tokenization, which need not
    be the model's (greedy output would then differ where the model writes allowed text anyway)."""
    return _llguidance().LLMatcher.grammar_from_lark('%llguidance {"no_forcing": true}\n' + lark)


# ── grammars and their per-request state ─────────────────────────────────────────────────────


@dataclass(frozen=True)
class Grammar:
    """A compiled format for replies, shared by every request that follows it.

    Build one with ``Grammar.json_schema``, ``json_object``, ``regex`` or ``lark`` (or, for tool
    calls, ``torchgemma.replies.tool_call_lark`` through ``Grammar.lark``); pass it as
    ``constraint=`` to ``Engine.add_request``, ``generate`` or ``stream`` (each request gets its own
    state), or call ``start`` for a ``GrammarConstraint``. A grammar that llguidance cannot compile
    is a ValueError naming the problem.
    """

    vocabulary: Vocabulary = field(repr=False)
    source: str = field(repr=False)  # llguidance's grammar (JSON text)
    description: str = ""

    def __post_init__(self) -> None:
        llguidance = _llguidance()
        error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(self.source, self.lltokenizer)
        if error:
            raise ValueError(f"{self.description or 'the grammar'} cannot be enforced: {messages[0]}")

    @classmethod
    def json_schema(cls, tokenizer, schema: Mapping[str, Any] | str, *, strict: bool = True) -> Grammar:
        """Replies that are JSON documents valid against ``schema``. ``strict=False`` ignores the
        keywords llguidance does not enforce (e.g. ``format`` values it does not know) instead of
        refusing the schema, as OpenAI's non-strict mode does not promise them either."""
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as error:
                raise ValueError(f"the JSON schema is not JSON: {error}") from error
        if not isinstance(schema, Mapping):
            raise ValueError(f"a JSON schema is an object, got {type(schema).__name__}")
        # (Options for llguidance's JSON compiler go in the schema's "x-guidance".)
        options = {**schema.get("x-guidance", {}), **_JSON_OPTIONS, "lenient": not strict}
        text = json.dumps({**schema, "x-guidance": options})
        return cls(vocabulary_of(tokenizer), _lark_source(f"start: %json {text}"), "the JSON schema")

    @classmethod
    def json_object(cls, tokenizer) -> Grammar:
        """Replies that are one JSON object (OpenAI's ``response_format: json_object``)."""
        return cls.json_schema(tokenizer, {"type": "object"})

    @classmethod
    def regex(cls, tokenizer, pattern: str) -> Grammar:
        """Replies that match the regular expression ``pattern`` whole."""
        body = pattern.replace("/", "\\/")
        return cls(vocabulary_of(tokenizer), _lark_source(f"start: /{body}/"), "the regex")

    @classmethod
    def lark(cls, tokenizer, text: str) -> Grammar:
        """Replies in the language of a Lark grammar (llguidance's dialect: ``start`` is the top
        rule, ``<[id]>`` is the special token ``id``, ``%json{...}`` embeds a JSON schema)."""
        return cls(vocabulary_of(tokenizer), _lark_source(text), "the grammar")

    @classmethod
    def tool_calls(
        cls,
        tokenizer,
        tools: Sequence[Mapping[str, Any]],
        *,
        name: str | None = None,
        parallel: bool = True,
        thinking: bool = False,
        optional: bool = False,
    ) -> Grammar:
        """Replies that call the ``tools`` (OpenAI's ``{"type": "function", "function": {...}}``
        items or the function specs alone) in Gemma's syntax, with arguments valid against each
        tool's ``parameters`` schema (``replies/tool_grammar.py`` says which keywords are
        enforced). ``name``: only that tool; ``parallel=False``: exactly one call; ``thinking``: a
        thought may come first; ``optional``: text, then at most one call."""
        functions = [tool.get("function", tool) for tool in tools]
        markers = ("<|tool_call>", "<tool_call|>", '<|"|>') + (
            ("<|channel>", "<channel|>") if thinking else ()
        )
        ids = {marker: tokenizer.token_id(marker) for marker in markers}
        lark = tool_call_lark(
            functions, tokens=ids, name=name, parallel=parallel, thinking=thinking, optional=optional
        )
        return cls(vocabulary_of(tokenizer), _lark_source(lark), "the tools' schemas")

    @property
    def lltokenizer(self) -> Any:
        return self.vocabulary.lltokenizer

    def start(self, stop_ids: Iterable[int] = ()) -> GrammarConstraint:
        """A fresh constraint for one request whose reply ends with one of ``stop_ids``."""
        return GrammarConstraint(self, stop_ids)


class GrammarConstraint:
    """One request's position in a ``Grammar``: the tokens allowed next, the chosen ones fed in.

    ``stop_ids`` are allowed once the grammar is complete (and never before); with none, the
    tokenizer's eos token ends the reply then, and ``ended`` says that it did.
    """

    def __init__(self, grammar: Grammar, stop_ids: Iterable[int] = ()) -> None:
        llguidance = _llguidance()
        self.grammar = grammar
        self.matcher = llguidance.LLMatcher(grammar.lltokenizer, grammar.source, log_level=0)
        if self.matcher.is_error():
            raise ValueError(f"{grammar.description or 'the grammar'}: {self.matcher.get_error()}")
        self.stop_ids = tuple(sorted(set(stop_ids)))
        self.end_ids = self.stop_ids or (grammar.lltokenizer.eos_token,)
        self.ended = False
        words = (grammar.lltokenizer.vocab_size + 31) // 32
        self.bitmask = torch.zeros(1, words, dtype=torch.int32)
        self._filled = False

    @property
    def complete(self) -> bool:
        """Whether the reply may end here."""
        return self.matcher.is_accepting()

    def fill(self) -> None:
        """Compute the allowed tokens now (``fill_masks`` does it for many constraints at once)."""
        row = self.bitmask[0]
        self.matcher.unsafe_compute_mask_ptr(row.data_ptr(), row.numel() * row.element_size())
        self._filled = True

    def allows(self, token_id: int) -> bool | None:
        """Whether the mask computed for this step allows ``token_id``, read from its bits; None
        when the bits alone cannot say (an id sharing its bytes with others)."""
        if not self._filled or self.matcher.is_error():
            return None
        vocabulary = self.grammar.vocabulary
        if token_id in vocabulary.duplicate_set or token_id >= vocabulary.lltokenizer.vocab_size:
            return None
        words = self.bitmask[0]
        if token_id in self.end_ids:
            return any((int(words[e >> 5]) >> (e & 31)) & 1 for e in vocabulary.eos_ids)
        if token_id in vocabulary.eos_ids:
            return False
        return bool((int(words[token_id >> 5]) >> (token_id & 31)) & 1)

    def allowed_mask(self, vocab_size: int) -> torch.Tensor:
        if self.matcher.is_error():
            raise ValueError(f"the constraint failed: {self.matcher.get_error()}")
        if not self._filled:
            self.fill()
        self._filled = False
        words = self.bitmask[0]
        # Bit i of word j is token 32 j + i.
        allowed = ((words.unsqueeze(-1) >> _BITS) & 1).view(-1).bool()
        self.grammar.vocabulary.share(allowed)
        # llguidance allows its end-of-sequence ids where the reply may end: this request's own
        # stop ids instead.
        ends = self.grammar.vocabulary.eos_ids
        may_end = bool(allowed[ends].any())
        allowed[ends] = False
        if may_end:
            allowed[list(self.end_ids)] = True
        if vocab_size <= allowed.numel():
            return allowed[:vocab_size]
        return torch.cat((allowed, allowed.new_zeros(vocab_size - allowed.numel())))

    def advance(self, token_id: int) -> None:
        self._filled = False  # the next step needs its own mask
        if token_id in self.end_ids:
            self.ended = True
            return
        if not self.matcher.consume_token(token_id):
            raise ValueError(f"token {token_id} does not follow the grammar: {self.matcher.get_error()}")


_EXECUTOR = None


def fill_masks(constraints: Sequence[object]) -> None:
    """Compute the masks of every ``GrammarConstraint`` among ``constraints`` at once, in
    llguidance's threads (the GIL released); other constraints compute theirs when asked."""
    global _EXECUTOR
    grammars = [c for c in constraints if isinstance(c, GrammarConstraint) and not c.matcher.is_error()]
    if len(grammars) < 2:
        for constraint in grammars:
            constraint.fill()
        return
    if _EXECUTOR is None:
        _EXECUTOR = _llguidance().LLExecutor()
    words = grammars[0].bitmask.shape[1]
    if any(c.bitmask.shape[1] != words for c in grammars):
        for constraint in grammars:
            constraint.fill()
        return
    masks = torch.zeros(len(grammars), words, dtype=torch.int32)
    _EXECUTOR.unsafe_compute_mask_ptr(
        [(c.matcher, i) for i, c in enumerate(grammars)], masks.data_ptr(), words * 4, len(grammars)
    )
    for i, constraint in enumerate(grammars):
        constraint.bitmask[0] = masks[i]
        constraint._filled = True


def constrained_token(
    constraint: TokenConstraint,
    logits: torch.Tensor,
    params: SamplingParams,
    generator: torch.Generator | None,
    history: torch.Tensor | None,
    generated: torch.Tensor | None = None,
) -> tuple[int, bool]:
    """The next token of a constrained request from its logits (1, V), and whether its reply ends
    there (the end token of a constraint given no stop ids). A constraint that allows nothing is a
    ValueError (the request fails alone).

    The refused tokens' logits become -inf before every other filter (logit bias, penalty,
    temperature, top-k/p, min-p), so the filters work on the allowed tokens; the allowed logits
    are untouched. Greedy, the unconstrained choice is taken when the mask's bits allow it: the
    argmax over the allowed tokens is then that token (bias and penalty change each logit on its
    own), without unpacking the mask over the vocabulary (the usual case of a model that follows
    the format)."""
    allows = getattr(constraint, "allows", None)
    if params.greedy and allows is not None:
        scores = process_logits(logits, params, history, generated=generated)
        check_scores(scores)
        token = int(scores[0].argmax())
        if allows(token):
            constraint.advance(token)
            return token, bool(getattr(constraint, "ended", False))
    allowed = constraint.allowed_mask(logits.shape[-1]).to(logits.device)
    if not bool(allowed.any()):
        raise ValueError("the constraint allows no token here (and no stop token ends the reply)")
    masked = torch.where(allowed, logits, NEG_INF)
    token = int(next_token(masked, params, generator=generator, history=history, generated=generated)[0])
    constraint.advance(token)
    return token, bool(getattr(constraint, "ended", False))


def grammar_for_response_format(tokenizer, response_format: Mapping[str, Any] | Any) -> Grammar | None:
    """OpenAI's ``response_format`` (``{"type": "text" | "json_object" | "json_schema", ...}``, a
    pydantic model class, or a ``Grammar``) as a ``Grammar``; None for plain text."""
    if response_format is None or isinstance(response_format, Grammar):
        return response_format
    schema_of = getattr(response_format, "model_json_schema", None)
    if isinstance(response_format, type) and schema_of is not None:  # a pydantic model class
        # Its fields only, as OpenAI's SDK makes a model's schema strict for parse().
        return Grammar.json_schema(tokenizer, _closed(schema_of()))
    if isinstance(response_format, str):
        response_format = {"type": response_format}
    if not isinstance(response_format, Mapping):
        raise ValueError(
            "response_format is a dict such as {'type': 'json_object'}, a pydantic model class or a "
            f"Grammar, got {type(response_format).__name__}"
        )
    kind = response_format.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return Grammar.json_object(tokenizer)
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if (
            not isinstance(spec, Mapping)
            or not spec.get("name")
            or not isinstance(spec.get("schema", {}), (Mapping, str))
        ):
            # (OpenAI's rule: a name, and a schema object, which may be left out for any JSON.)
            raise ValueError("response_format json_schema needs json_schema: {'name': ..., 'schema': {...}}")
        schema = spec.get("schema") or {}
        return Grammar.json_schema(tokenizer, schema, strict=bool(spec.get("strict", False)))
    raise ValueError(f"response_format type must be text, json_object or json_schema, got {kind!r}")


def _closed(schema: Any) -> Any:
    """``schema`` with ``additionalProperties: false`` on every object that lists its properties
    and does not say."""
    if isinstance(schema, list):
        return [_closed(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    closed = {key: _closed(value) for key, value in schema.items()}
    if "properties" in closed and "additionalProperties" not in closed:
        closed["additionalProperties"] = False
    return closed


class ConstraintError(ValueError):
    """A request's format or tool choice that cannot be enforced; ``field`` names the request field."""

    def __init__(self, message: str, field: str) -> None:
        super().__init__(message)
        self.field = field


def chat_grammar(
    tokenizer,
    *,
    response_format: Any = None,
    tools: Sequence[Mapping[str, Any]] | None = None,
    tool_choice: Any = None,
    parallel_tool_calls: bool | None = None,
    thinking: bool = False,
) -> Grammar | None:
    """The grammar a chat reply must follow under OpenAI's ``response_format``, ``tool_choice``
    (``"auto"``, ``"none"``, ``"required"``, ``{"type": "function", "function": {"name": ...}}``)
    and ``parallel_tool_calls``; None when the reply is free. Shared by ``LLM.chat`` and the
    server. A forced call (required, named) is always one well-formed call (or several, unless
    ``parallel_tool_calls`` is False) of a declared tool with schema-valid arguments;
    ``parallel_tool_calls=False`` with ``auto`` allows text and at most one call. Raises
    ``ConstraintError`` naming the field at fault."""
    choice = tool_choice or ("auto" if tools else "none")
    name = None
    if isinstance(choice, Mapping):
        name = (choice.get("function") or {}).get("name") or choice.get("name")
        if not name:
            raise ConstraintError("tool_choice names no function", "tool_choice")
    elif choice not in ("auto", "none", "required"):
        raise ConstraintError(
            f"tool_choice must be auto, none, required or a function, got {choice!r}", "tool_choice"
        )
    forced = choice == "required" or name is not None
    if forced and not tools:
        raise ConstraintError(f"tool_choice {tool_choice!r} needs tools", "tool_choice")
    try:
        grammar = grammar_for_response_format(tokenizer, response_format)
    except ValueError as error:
        raise ConstraintError(str(error), "response_format") from error
    if grammar is not None:
        if forced:
            raise ConstraintError(
                "a response_format reply cannot also be a forced tool call", "response_format"
            )
        return grammar
    if choice == "none" or not tools or (choice == "auto" and parallel_tool_calls is not False):
        return None
    try:
        return Grammar.tool_calls(
            tokenizer,
            tools,
            name=name,
            parallel=parallel_tool_calls is not False,
            thinking=thinking,
            optional=not forced,
        )
    except ValueError as error:
        field = "tool_choice" if name is not None and "no tool named" in str(error) else "tools"
        raise ConstraintError(str(error), field) from error
