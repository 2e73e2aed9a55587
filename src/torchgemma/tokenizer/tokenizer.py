"""Gemma 4 tokenizer: ids in and out through `tokenizers`, special tokens, the chat template, streaming
decode. `loading.py` builds it from a checkpoint's files as transformers does.

* Control tokens typed in chat messages stay text (`apply_chat_template(sanitize_control_tokens=...)`,
  on by default here, off by default in transformers), with transformers' rules for which added
  tokens are control tokens (`Tokenizer.control_tokens`) and how marked text is encoded; stricter
  than transformers, neither can a control token form where the template joins caller strings.
"""

from __future__ import annotations

import functools
import os
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from tokenizers import AddedToken, processors
from tokenizers import Tokenizer as BackendTokenizer

from ..replies import parse_reply
from .chat_template import (
    control_token_set,
    mark_control_tokens,
    marked_token_pattern,
    render_chat_template,
    resolve_cuts,
    select_chat_template,
    template_literal_text,
)

# Gemma 4's control tokens: attribute stem -> (tokenizer_config.json key, text). The text is used when
# the config does not name the token; ids always come from the vocabulary.
GEMMA4_TOKENS: dict[str, tuple[str | None, str]] = {
    "turn_start": ("sot_token", "<|turn>"),
    "turn_end": ("eot_token", "<turn|>"),
    "image": ("image_token", "<|image|>"),
    "image_start": ("boi_token", "<|image>"),
    "image_end": ("eoi_token", "<image|>"),
    "audio": ("audio_token", "<|audio|>"),
    "audio_start": ("boa_token", "<|audio>"),
    "audio_end": ("eoa_token", "<audio|>"),
    "video": (None, "<|video|>"),  # not a named token in the config; the processor adds it
    "channel_start": ("soc_token", "<|channel>"),
    "channel_end": ("eoc_token", "<channel|>"),
    "think": ("think_token", "<|think|>"),
    "escape": ("escape_token", '<|"|>'),
    "tool_start": ("std_token", "<|tool>"),
    "tool_end": ("etd_token", "<tool|>"),
    "tool_call_start": ("stc_token", "<|tool_call>"),
    "tool_call_end": ("etc_token", "<tool_call|>"),
    "tool_response_start": ("str_token", "<|tool_response>"),
    "tool_response_end": ("etr_token", "<tool_response|>"),
}

# The same roles under Gemma 1-3n's names, used when the vocabulary has these and not Gemma 4's: their
# tokenizer configs (and GGUF files) name no turn tokens, yet a chat turn ends with <end_of_turn>.
EARLIER_GEMMA_TOKENS: dict[str, str] = {"turn_start": "<start_of_turn>", "turn_end": "<end_of_turn>"}

# apply_chat_template options of transformers that are not reproduced here (not template variables).
_TRANSFORMERS_ONLY_CHAT_OPTIONS = frozenset(
    {
        "continue_final_message",
        "return_assistant_tokens_mask",
        "return_dict",
        "return_tensors",
        "padding",
        "truncation",
        "max_length",
        "tokenizer_kwargs",
    }
)

# tokenizers' ByteFallback decoder recognises exactly "<0xHH>" (either hex case).
_BYTE_TOKEN = re.compile(r"<0x[0-9A-Fa-f]{2}>")


class UnknownTokenError(KeyError):
    """A special token that the tokenizer does not define, or text that is not in the vocabulary."""

    def __str__(self) -> str:  # KeyError would print the message quoted
        return str(self.args[0]) if self.args else ""


class _NamedTokenId:
    """Class attribute `<stem>_id` -> id of the Gemma 4 control token `<stem>` (see GEMMA4_TOKENS)."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.stem = name.removesuffix("_id")

    def __get__(self, obj: Tokenizer | None, objtype: type | None = None) -> int:
        if obj is None:
            return self  # type: ignore[return-value]  # class access shows the descriptor
        return obj.named_id(self.stem)


class Tokenizer:
    """A `tokenizers.Tokenizer` plus the metadata transformers keeps beside it.

    Build it with `load_tokenizer(folder)`, or directly from a backend (e.g. one made from a GGUF
    vocabulary): `Tokenizer(backend, bos_id=2, eos_id=1, pad_id=0, add_bos=False, chat_template=...)`.
    The backend is adopted, not copied: missing special tokens are registered on it, truncation and
    padding are switched off, and an explicit `add_bos`/`add_eos` installs a matching post-processor
    (None keeps the backend's own).
    """

    def __init__(
        self,
        backend: BackendTokenizer,
        *,
        special_tokens: Mapping[str, str | AddedToken] | None = None,
        bos_id: int | None = None,
        eos_id: int | None = None,
        pad_id: int | None = None,
        unk_id: int | None = None,
        add_bos: bool | None = None,
        add_eos: bool | None = None,
        chat_template: str | Mapping[str, str] | None = None,
        extra_special_tokens: Sequence[str | AddedToken] = (),
        clean_up_tokenization_spaces: bool = False,
        chat_control_tokens: Sequence[str] | None = None,
        name_or_path: str = "",
    ) -> None:
        if not isinstance(backend, BackendTokenizer):
            raise TypeError(f"backend must be a tokenizers.Tokenizer, got {type(backend).__name__}")
        self.backend = backend
        self.name_or_path = name_or_path
        # Named special tokens as transformers exposes them (bos_token, eos_token, image_token, ...);
        # their strings are also the template variables apply_chat_template passes.
        named: dict[str, str | AddedToken] = dict(special_tokens or {})
        for key, token_id in (
            ("bos_token", bos_id),
            ("eos_token", eos_id),
            ("pad_token", pad_id),
            ("unk_token", unk_id),
        ):
            if token_id is None:
                continue
            text = backend.id_to_token(int(token_id))
            if text is None:
                raise ValueError(
                    f"{key[:-6]}_id={token_id} is outside the vocabulary ({backend.get_vocab_size()} ids)"
                )
            if key in named and _content(named[key]) != text:
                raise ValueError(
                    f"{key}={_content(named[key])!r} disagrees with {key[:-6]}_id={token_id} ({text!r})"
                )
            named.setdefault(key, text)
        _register_special_tokens(backend, named, list(extra_special_tokens))
        self.special_tokens: dict[str, str] = {k: _content(v) for k, v in named.items()}
        self.extra_special_tokens: list[str] = [_content(t) for t in extra_special_tokens]
        self.chat_template = chat_template
        # Added tokens that count as control tokens besides the special ones (tokenizer_config.json's
        # `chat_control_tokens`); None: those the chat template writes (see `control_tokens`).
        self.chat_control_tokens = None if chat_control_tokens is None else tuple(chat_control_tokens)
        self._control_token_cache: dict[tuple, tuple[str, ...]] = {}
        self._marked_pattern: tuple[int, re.Pattern[str]] | None = None  # (vocab size, pattern)
        self.clean_up_tokenization_spaces = clean_up_tokenization_spaces

        # transformers resets truncation/padding around every call; a single encode never uses them.
        backend.no_truncation()
        backend.no_padding()
        if add_bos is not None or add_eos is not None:
            backend.post_processor = self._template_processor(bool(add_bos), bool(add_eos))
        probe = backend.encode("", add_special_tokens=True).ids
        bos = self._lookup_named("bos_token")
        self._add_bos = bool(probe) and bos is not None and probe[0] == bos

        # Ids the backend treats as special: what decode(skip_special_tokens=True) drops.
        added = backend.get_added_tokens_decoder()
        self.special_ids: frozenset[int] = frozenset(i for i, t in added.items() if t.special)
        # Byte-fallback pieces, which only decode to text in complete UTF-8 runs (see StreamDecoder).
        byte_ids = (backend.token_to_id(f"<0x{b:02{case}}>") for b in range(256) for case in "Xx")
        self.byte_ids: frozenset[int] = frozenset(i for i in byte_ids if i is not None)

    def _template_processor(self, add_bos: bool, add_eos: bool) -> processors.TemplateProcessing:
        # Same shape as transformers' update_post_processor.
        bos, eos = self.special_tokens.get("bos_token"), self.special_tokens.get("eos_token")
        add_bos, add_eos = add_bos and bos is not None, add_eos and eos is not None
        single = f"{bos + ':0 ' if add_bos else ''}$A:0{' ' + eos + ':0' if add_eos else ''}"
        pair = f"{single}{' ' + bos + ':1' if add_bos else ''} $B:1{' ' + eos + ':1' if add_eos else ''}"
        specials = [(t, self.token_id(t)) for t, on in ((bos, add_bos), (eos, add_eos)) if on]
        return processors.TemplateProcessing(single=single, pair=pair, special_tokens=specials)

    # ---- vocabulary and special tokens -------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        """Number of ids including added tokens (`len(tokenizer)` in transformers)."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    def __len__(self) -> int:
        return self.vocab_size

    @functools.cached_property
    def token_bytes(self) -> list[bytes | None]:
        """Each id's bytes in generated text, None for special tokens (for constrained decoding).

        Gemma pieces write a space as "▁" and unknown bytes as byte-fallback pieces ``<0xNN>``; added
        tokens that are not special are their own text. Read from the vocabulary, not by decoding
        ids one at a time (a lone byte piece decodes to U+FFFD).
        """
        table: list[bytes | None] = []
        for i in range(self.vocab_size):
            piece = self.backend.id_to_token(i)
            if piece is None or i in self.special_ids:
                table.append(None)
            elif i in self.byte_ids:
                table.append(bytes([int(piece[3:5], 16)]))
            else:
                table.append(piece.replace("\u2581", " ").encode("utf-8"))
        return table

    @property
    def add_bos(self) -> bool:
        """Whether encode(..., add_special_tokens=True) prepends <bos>."""
        return self._add_bos

    def token_id(self, token: str) -> int:
        """Id of a token given by its text (e.g. "<|turn>")."""
        token_id = self.backend.token_to_id(token)
        if token_id is None:
            raise UnknownTokenError(
                f"token {token!r} is not in the vocabulary of {self.name_or_path or 'this tokenizer'}"
            )
        return token_id

    def id_to_token(self, token_id: int) -> str:
        text = self.backend.id_to_token(int(token_id))
        if text is None:
            raise UnknownTokenError(f"id {token_id} is outside the vocabulary ({self.vocab_size} ids)")
        return text

    def special_token(self, name: str) -> str:
        """Text of a named special token: a config name ("eos_token", "image_token") or a Gemma 4 stem
        from GEMMA4_TOKENS ("turn_end", "channel_start"). The turn stems fall back to Gemma 1-3n's
        "<start_of_turn>" / "<end_of_turn>" where the vocabulary has those and not Gemma 4's."""
        if name in self.special_tokens:
            return self.special_tokens[name]
        if name in GEMMA4_TOKENS:
            key, default = GEMMA4_TOKENS[name]
            if key is not None and key in self.special_tokens:
                return self.special_tokens[key]
            earlier = EARLIER_GEMMA_TOKENS.get(name)
            if (
                earlier is not None
                and self.backend.token_to_id(default) is None
                and self.backend.token_to_id(earlier) is not None
            ):
                return earlier
            return default
        known = sorted(set(self.special_tokens) | set(GEMMA4_TOKENS))
        raise UnknownTokenError(f"unknown special token {name!r}; this tokenizer knows {known}")

    def named_id(self, name: str) -> int:
        """Id of a named special token (see `special_token`), looked up in the vocabulary."""
        return self.token_id(self.special_token(name))

    def _lookup_named(self, key: str) -> int | None:
        text = self.special_tokens.get(key)
        return None if text is None else self.backend.token_to_id(text)

    def _required(self, key: str) -> int:
        if key not in self.special_tokens:
            raise UnknownTokenError(f"this tokenizer defines no {key}")
        return self.token_id(self.special_tokens[key])

    @property
    def bos_id(self) -> int:
        return self._required("bos_token")

    @property
    def eos_id(self) -> int:
        return self._required("eos_token")

    @property
    def pad_id(self) -> int:
        return self._required("pad_token")

    @property
    def unk_id(self) -> int:
        return self._required("unk_token")

    turn_start_id = _NamedTokenId()
    turn_end_id = _NamedTokenId()
    image_id = _NamedTokenId()
    image_start_id = _NamedTokenId()
    image_end_id = _NamedTokenId()
    audio_id = _NamedTokenId()
    audio_start_id = _NamedTokenId()
    audio_end_id = _NamedTokenId()
    video_id = _NamedTokenId()
    channel_start_id = _NamedTokenId()
    channel_end_id = _NamedTokenId()
    think_id = _NamedTokenId()
    escape_id = _NamedTokenId()
    tool_start_id = _NamedTokenId()
    tool_end_id = _NamedTokenId()
    tool_call_start_id = _NamedTokenId()
    tool_call_end_id = _NamedTokenId()
    tool_response_start_id = _NamedTokenId()
    tool_response_end_id = _NamedTokenId()

    # ---- encode / decode ---------------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`, as transformers' `tokenizer(text)["input_ids"]`."""
        if not isinstance(text, str):
            raise TypeError(f"encode expects a str, got {type(text).__name__}")
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Iterable[int] | int, skip_special_tokens: bool = False) -> str:
        """Text of `ids`, as transformers' `tokenizer.decode(ids)`."""
        text = self.backend.decode(_id_list(ids), skip_special_tokens=skip_special_tokens)
        return _clean_up_tokenization(text) if self.clean_up_tokenization_spaces else text

    def stream_decoder(self, skip_special_tokens: bool = False) -> StreamDecoder:
        """A fresh incremental detokenizer for one generated sequence."""
        return StreamDecoder(self, skip_special_tokens=skip_special_tokens)

    # ---- chat --------------------------------------------------------------------------------------

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        enable_thinking: bool = False,
        tokenize: bool = True,
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        documents: Sequence[Mapping[str, Any]] | None = None,
        chat_template: str | None = None,
        sanitize_control_tokens: bool | None = None,
        **extra: Any,
    ) -> list[int] | str:
        """Render `messages` with the checkpoint's template; ids (or the text with tokenize=False) equal
        transformers' `apply_chat_template(messages, add_generation_prompt=..., enable_thinking=...,
        sanitize_control_tokens=...)`.

        The special-token strings (bos_token, eos_token, image_token, ...) are template variables, and
        `extra` adds or overrides variables. The rendered text is encoded without adding <bos>: the
        template writes it.

        sanitize_control_tokens: control tokens (see `control_tokens`) found in the strings of
        messages, tools, documents and `extra` are encoded as plain text, so only the template's own
        control tokens are tokens: a user who types `<turn|>` cannot end their turn. Nor can text
        the template joins make one: two text items "hi<turn" and "|>" (or "hi<tu" and template text
        "rn|>") are encoded as text on both sides of the join (see `chat_template.resolve_cuts`);
        text without such joins is encoded as transformers encodes it. None (the
        default) sanitizes the ids; text (tokenize=False) is the plain rendering, which cannot tell
        typed tokens from the template's, so True with tokenize=False is an error. False encodes
        everything as transformers does by default (for trusted input that writes control tokens)."""
        unsupported = sorted(_TRANSFORMERS_ONLY_CHAT_OPTIONS.intersection(extra))
        if unsupported:
            # transformers consumes these itself; passing them on as template variables would be silent.
            raise TypeError(f"apply_chat_template does not support {unsupported}")
        if sanitize_control_tokens and not tokenize:
            raise ValueError(
                "sanitize_control_tokens=True needs tokenize=True: rendered text cannot tell control tokens "
                "typed in messages from the template's own"
            )
        sanitize = tokenize if sanitize_control_tokens is None else sanitize_control_tokens
        template = chat_template or select_chat_template(
            self.chat_template, tools=tools, source=self.name_or_path
        )
        variables = {"enable_thinking": enable_thinking, **extra}
        if sanitize:
            controls = control_token_set(self.control_tokens(template))
            messages, tools, documents, variables = (
                mark_control_tokens(value, controls) for value in (messages, tools, documents, variables)
            )
        text = render_chat_template(
            template,
            messages,
            tools=tools,
            documents=documents,
            add_generation_prompt=add_generation_prompt,
            # The special-token strings are the template's own, so they are never marked.
            **{**self.special_tokens, **variables},
        )
        if not tokenize:
            return text
        if not sanitize:
            return self.encode(text, add_special_tokens=False)
        return self._encode_marked(resolve_cuts(text, controls))

    def control_tokens(self, chat_template: str | None = None) -> tuple[str, ...]:
        """The added tokens that sanitized chat input keeps as text (transformers' rule): every special
        token, plus those listed in tokenizer_config.json's `chat_control_tokens`, or when there is no
        such list, those the template's text or string constants contain (whitespace tokens such as
        Gemma's "\\n" excepted: templates hold them as ordinary text)."""
        template = chat_template or select_chat_template(self.chat_template, source=self.name_or_path)
        # Adding tokens to the backend grows the vocabulary, so the size keys the cache too.
        key = (template, self.vocab_size, self.chat_control_tokens)
        if key not in self._control_token_cache:
            added = self.backend.get_added_tokens_decoder().values()
            if self.chat_control_tokens is not None:
                listed = set(self.chat_control_tokens)
                found = tuple(t.content for t in added if t.special or t.content in listed)
            else:
                literal = template_literal_text(template)
                found = tuple(
                    t.content
                    for t in added
                    if t.special or (t.content in literal and not t.content.isspace())
                )
            if len(self._control_token_cache) >= 32:  # templates passed per call: keep the cache small
                self._control_token_cache.clear()
            self._control_token_cache[key] = found
        return self._control_token_cache[key]

    def _encode_without_added_tokens(self, text: str) -> list[int]:
        # The backend's pipeline minus its added-token matching (encode_special_tokens only skips the
        # special ones): a control token's text comes out as ordinary pieces.
        if self.backend.normalizer is not None:
            text = self.backend.normalizer.normalize_str(text)
        splits = [text]
        if self.backend.pre_tokenizer is not None:
            splits = [piece for piece, _ in self.backend.pre_tokenizer.pre_tokenize_str(text)]
        return [token.id for split in splits for token in self.backend.model.tokenize(split)]

    def _encode_marked(self, text: str) -> list[int]:
        """Ids of a chat rendered from marked input: marked tokens as plain text, the rest as usual.

        The text is cut at the markers and each piece encoded on its own, as transformers does, so
        the ids match its `apply_chat_template(..., sanitize_control_tokens=True)`; a lone marker
        still cuts, so the text around it cannot join into a control token."""
        if self._marked_pattern is None or self._marked_pattern[0] != self.vocab_size:
            # Every added token, as transformers has it (only control tokens are ever marked, but a
            # template's string methods decide what ends up between two markers).
            added = self.backend.get_added_tokens_decoder()
            texts = tuple(added[i].content for i in sorted(added))
            self._marked_pattern = (self.vocab_size, marked_token_pattern(texts))
        pieces = self._marked_pattern[1].split(text)
        newline = self.encode("\n", add_special_tokens=False)
        ids = self.encode(pieces[0], add_special_tokens=False)
        # re.split with one group: [text, token or None, text, token or None, ..., text].
        for index, piece in enumerate(pieces[1:], start=1):
            if not piece:
                continue
            as_text = index % 2 == 1
            encode = (
                self._encode_without_added_tokens
                if as_text
                else functools.partial(self.encode, add_special_tokens=False)
            )
            # Encoded after a newline that is then dropped, so a SentencePiece-style pre-tokenizer does
            # not add the word-start space it adds at the start of a string (transformers' trick).
            piece_ids = encode("\n" + piece)
            piece_ids = piece_ids[len(newline) :] if piece_ids[: len(newline)] == newline else encode(piece)
            if as_text and self.backend.token_to_id(piece) in piece_ids:
                raise ValueError(
                    f"cannot sanitize {piece!r}: {self.name_or_path or 'this tokenizer'} encodes its plain "
                    f"text as the control token itself (id {self.backend.token_to_id(piece)})"
                )
            ids += piece_ids
        return ids

    def parse_reply(self, text: str) -> tuple[str | None, str]:
        """(thinking, answer) of a reply decoded with special tokens kept, by Gemma 4's reply grammar
        (``torchgemma.replies.parse_reply``, tool calls left as text: no tools were offered)."""
        reply = parse_reply(text, tools=False)
        return reply.reasoning, reply.content

    def __repr__(self) -> str:
        return (
            f"Tokenizer({self.name_or_path!r}, vocab_size={self.vocab_size}, add_bos={self.add_bos}, "
            f"chat_template={'yes' if self.chat_template else 'no'})"
        )


class StreamDecoder:
    """Incremental detokenizer: `push(id)` returns the newly completed text, `flush()` the rest.

    The pieces concatenate to exactly `tokenizer.decode(all_ids, skip_special_tokens)`. Text is only
    released at boundaries where decoding is additive: never after a byte-fallback piece (`<0xE2>`),
    because tokenizers decodes a whole run of byte pieces at once and a later invalid byte would turn
    the run, already-complete characters included, into U+FFFD; and never while the text ends in
    U+FFFD (a byte-level decoder mid-character). Each step decodes only the tokens since the last
    release plus one release of context, so the cost per token stays constant, and the context keeps
    decoder effects that depend on the preceding token (e.g. a stripped leading space) right.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = False) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self._ids: list[int] = []  # tokens from the context start on
        self._read = 0  # index in _ids of the first token whose text is not released yet

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    def push(self, token_id: int) -> str:
        token_id = int(token_id)
        if self.skip_special_tokens and token_id in self.tokenizer.special_ids:
            return ""  # decode(skip_special_tokens=True) drops these before decoding anything
        self._ids.append(token_id)
        if token_id in self.tokenizer.byte_ids:
            return ""
        released = self._decode(self._ids[: self._read])
        text = self._decode(self._ids)
        if text.endswith("\ufffd") or len(text) <= len(released) or not text.startswith(released):
            return ""
        # Keep the just-released tokens as context for the next step.
        self._ids = self._ids[self._read :]
        self._read = len(self._ids)
        return text[len(released) :]

    def flush(self) -> str:
        """Text of the tokens still held back (end of generation); resets the decoder."""
        released = self._decode(self._ids[: self._read])
        text = self._decode(self._ids)
        self._ids, self._read = [], 0
        # A decoder that rewrote already-released text cannot be undone; release only what is new.
        return text[len(os.path.commonprefix([text, released])) :]

    def __call__(self, token_id: int) -> str:
        return self.push(token_id)


def _register_special_tokens(
    backend: BackendTokenizer, named: Mapping[str, str | AddedToken], extra: Sequence[str | AddedToken]
) -> None:
    """Add named and extra special tokens the backend does not have yet, as transformers does: a plain
    string becomes a special, non-normalized token; a named AddedToken is forced special."""
    present = {t.content for t in backend.get_added_tokens_decoder().values()}
    to_add = []
    for value, is_named in [(v, True) for v in named.values()] + [(v, False) for v in extra]:
        content = _content(value)
        if content in present:
            continue
        present.add(content)
        if isinstance(value, AddedToken):
            token = AddedToken(
                value.content,
                single_word=value.single_word,
                lstrip=value.lstrip,
                rstrip=value.rstrip,
                normalized=value.normalized,
                special=value.special or is_named,
            )
        else:
            token = AddedToken(content, special=True)
        to_add.append(token)
    if to_add:
        backend.add_tokens(to_add)


def _content(token: str | AddedToken) -> str:
    return token.content if isinstance(token, AddedToken) else str(token)


def _id_list(ids: Iterable[int] | int) -> list[int]:
    if hasattr(ids, "tolist"):  # torch / numpy
        ids = ids.tolist()
    if isinstance(ids, int):
        return [ids]
    return [int(i) for i in ids]


def _clean_up_tokenization(text: str) -> str:
    # transformers' legacy WordPiece clean-up: drop the space before punctuation and contractions.
    for before, after in (
        (" .", "."),
        (" ?", "?"),
        (" !", "!"),
        (" ,", ","),
        (" ' ", "'"),
        (" n't", "n't"),
        (" 'm", "'m"),
        (" 's", "'s"),
        (" 've", "'ve"),
        (" 're", "'re"),
    ):
        text = text.replace(before, after)
    return text
