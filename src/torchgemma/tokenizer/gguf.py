"""A ``tokenizers.Tokenizer`` built from the vocabulary stored in a Gemma GGUF file.

A GGUF carries no ``tokenizer.json``: llama.cpp writes the vocabulary as ``tokenizer.ggml.*``
metadata (tokens, scores, token types, special ids, flags, sometimes merges and the chat template).
This module rebuilds the tokenizer transformers 5.23 builds from the same metadata
(``integrations/gguf/gguf_tokenizer_mapping.py``), so that ids and decoded text match it:

* Gemma's pipeline: a byte-fallback BPE over the whole text, spaces turned into "▁" by the
  normalizer, no real pre-tokenization, and a decoder that turns "▁" back into spaces and byte
  tokens (``<0x0A>``) back into bytes.
* Gemma 1-3 files (``tokenizer.ggml.model == "llama"``, SentencePiece) list no merges. They are
  derived from the vocabulary: every split of a token into two tokens, ranked by the token's position
  in the file (earlier = merged first), longer left part first. Whitespace tokens that llama.cpp
  stores with real spaces ("  ") are spelled with "▁" again first.
* Gemma 4 files (``"gemma4"``) carry their merges; without them the scores rank the splits.
* Tokens typed CONTROL become special added tokens, USER_DEFINED ones (``"\\n"``, ``"<h1>"``...) plain
  added tokens, so both are matched whole in the text.
* A BOS is prepended when ``tokenizer.ggml.add_bos_token`` says so (default True for SentencePiece
  files), except for Gemma 4, whose chat template writes ``<bos>`` itself (transformers follows the
  reference tokenizer there; llama.cpp forces BOS on).

Decode with ``skip_special_tokens=False`` to match ``transformers``' default ``decode``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import sys
from bisect import bisect_left
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

from ..weights.gguf import GGUFError, check_metadata_types, read_gguf_metadata

__all__ = [
    "GGUFTokenizerInfo",
    "cached_tokenizer_from_gguf",
    "tokenizer_from_gguf",
    "tokenizer_from_metadata",
]

# Bump when what is built (or how) changes: older cache entries are then ignored.
_CACHE_VERSION = 1

# llama.cpp token types (gguf.TokenType); BYTE tokens (<0x0A>) are plain vocabulary for byte fallback.
_NORMAL, _CONTROL, _USER_DEFINED = 1, 3, 4
# Architectures whose SentencePiece vocabulary transformers reads the Gemma way.
_GEMMA_SENTENCEPIECE = ("gemma", "gemma2", "gemma3", "gemma3n")


@dataclass(frozen=True)
class GGUFTokenizerInfo:
    """What the wrapper around the ``tokenizers.Tokenizer`` needs to know beyond the pipeline."""

    bos_id: int | None
    eos_id: int | None
    pad_id: int | None
    unk_id: int | None
    add_bos: bool  # the post-processor prepends bos_id
    add_eos: bool  # the post-processor appends eos_id
    chat_template: str | None
    tokenizer_model: str  # tokenizer.ggml.model: "llama" (SentencePiece) or "gemma4"
    bos_token: str | None
    eos_token: str | None
    pad_token: str | None
    unk_token: str | None


def tokenizer_from_gguf(path: str | Path) -> tuple[Tokenizer, GGUFTokenizerInfo]:
    """The tokenizer of a Gemma GGUF file, and its special ids, BOS/EOS flags and chat template."""
    path = Path(path)
    return tokenizer_from_metadata(read_gguf_metadata(path), source=path.name)


def cached_tokenizer_from_gguf(
    path: str | Path, cache_dir: Path | None = None
) -> tuple[Tokenizer, GGUFTokenizerInfo]:
    """``tokenizer_from_gguf``, built once per file and then read back from a cache.

    Deriving a SentencePiece vocabulary's merges takes seconds (9.5 s for Gemma 3's 262144 tokens):
    the built tokenizer.json and its info are kept under ``~/.cache/torchgemma/gguf-tokenizers``
    (``$XDG_CACHE_HOME`` respected), keyed by the file's path, size and modification time. A cache
    that cannot be read or written is skipped, never trusted half-written.
    """
    path = Path(path).resolve()
    stat = path.stat()
    key = hashlib.sha256(f"{_CACHE_VERSION}|{path}|{stat.st_size}|{stat.st_mtime_ns}".encode()).hexdigest()[
        :32
    ]
    folder = (
        cache_dir
        or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "torchgemma" / "gguf-tokenizers"
    )
    entry = folder / f"{key}.json"
    try:
        saved = json.loads(entry.read_text(encoding="utf-8"))
        return Tokenizer.from_str(saved["tokenizer"]), GGUFTokenizerInfo(**saved["info"])
    except Exception:  # noqa: BLE001 - a missing, stale or damaged entry is rebuilt
        pass
    # Seconds of work for a real vocabulary: said, not left as a silent wait.
    print(f"torchgemma: building the tokenizer of {path.name} (one time)...", file=sys.stderr)
    tokenizer, info = tokenizer_from_gguf(path)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        partial = entry.with_suffix(f".{os.getpid()}.tmp")
        partial.write_text(
            json.dumps({"tokenizer": tokenizer.to_str(), "info": dataclasses.asdict(info)}), encoding="utf-8"
        )
        os.replace(partial, entry)  # atomic: readers see the whole entry or none
    except OSError:
        pass
    return tokenizer, info


def tokenizer_from_metadata(
    metadata: Mapping[str, Any], source: str = "GGUF file"
) -> tuple[Tokenizer, GGUFTokenizerInfo]:
    """As ``tokenizer_from_gguf``, from metadata already read (``read_gguf_metadata`` / ``GGUFCheckpoint.metadata``)."""
    check_metadata_types(metadata, source)
    tokens: list[str] | None = metadata.get("tokenizer.ggml.tokens")
    if not tokens:
        raise GGUFError(f"{source} has no vocabulary (tokenizer.ggml.tokens)")
    model = metadata.get("tokenizer.ggml.model")
    types: Sequence[int] = metadata.get("tokenizer.ggml.token_type") or [_NORMAL] * len(tokens)
    if len(types) != len(tokens):
        raise GGUFError(f"{source}: {len(types)} token types for {len(tokens)} tokens")

    vocab_tokens, merges, add_bos = _vocabulary(metadata, tokens, source)
    add_eos = bool(metadata.get("tokenizer.ggml.add_eos_token", False))

    ids = _special_ids(metadata, len(tokens), source)
    unk = tokens[ids["unk"]] if ids["unk"] is not None else "<unk>"

    vocab = {t: i for i, t in enumerate(vocab_tokens)}
    tokenizer = Tokenizer(
        models.BPE(vocab=vocab, merges=merges, unk_token=unk, fuse_unk=True, byte_fallback=True, dropout=None)
    )
    tokenizer.normalizer = normalizers.Replace(" ", "\u2581")
    # A split on " " after the normalizer has replaced every space: the text stays one piece, as in
    # transformers' GemmaTokenizer.
    tokenizer.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_previous")
    tokenizer.decoder = decoders.Sequence(
        [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    )

    # Control tokens are matched whole and are special; user-defined ones are matched whole but are
    # text. Both are matched in the raw text, before the normalizer.
    control = [AddedToken(t, special=True, normalized=False) for t, k in zip(tokens, types) if k == _CONTROL]
    tokenizer.add_special_tokens(control)
    user = [
        AddedToken(t, special=False, normalized=False)
        for t, k in zip(tokens, types)
        if k == _USER_DEFINED and t in vocab
    ]
    tokenizer.add_tokens(user)

    bos = tokens[ids["bos"]] if ids["bos"] is not None else None
    eos = tokens[ids["eos"]] if ids["eos"] is not None else None
    add_bos = bool(add_bos) and bos is not None
    add_eos = add_eos and eos is not None
    tokenizer.post_processor = _template(bos, ids["bos"], eos, ids["eos"], add_bos, add_eos)

    chat_template = metadata.get("tokenizer.chat_template")
    info = GGUFTokenizerInfo(
        bos_id=ids["bos"],
        eos_id=ids["eos"],
        pad_id=ids["pad"],
        unk_id=ids["unk"],
        add_bos=add_bos,
        add_eos=add_eos,
        chat_template=chat_template or None,
        tokenizer_model=model,
        bos_token=bos,
        eos_token=eos,
        pad_token=tokens[ids["pad"]] if ids["pad"] is not None else None,
        unk_token=tokens[ids["unk"]] if ids["unk"] is not None else None,
    )
    return tokenizer, info


def _vocabulary(
    metadata: Mapping[str, Any], tokens: list[str], source: str
) -> tuple[list[str], list[tuple[str, str]], bool]:
    """The BPE vocabulary, its merges and whether BOS is added, by the file's tokenizer model."""
    model = metadata.get("tokenizer.ggml.model")
    arch = metadata.get("general.architecture")
    if model == "llama" and arch in _GEMMA_SENTENCEPIECE:
        # llama.cpp stores SentencePiece's whitespace pieces with real spaces ("  "), while the
        # normalizer turns the text's spaces into "▁": spell them with "▁" again, one per character
        # (as transformers does, newlines in a space-and-newline piece included).
        vocab_tokens = ["\u2581" * len(t) if " " in t and not t.strip() else t for t in tokens]
        # SentencePiece merges in the order its pieces are listed, not by the scores llama.cpp writes.
        merges = _derive_merges(vocab_tokens, {t: -i for i, t in enumerate(vocab_tokens)})
        return vocab_tokens, merges, metadata.get("tokenizer.ggml.add_bos_token", True)
    if model == "gemma4":
        vocab_tokens = list(tokens)
        if "tokenizer.ggml.merges" in metadata:
            merges = [tuple(m.split(" ")) for m in metadata["tokenizer.ggml.merges"]]
            for i, merge in enumerate(merges):
                if len(merge) != 2:
                    raise GGUFError(
                        f"{source}: tokenizer.ggml.merges entry {i} is {' '.join(merge)!r}, not two tokens "
                        f"joined by one space"
                    )
        else:
            scores = metadata.get("tokenizer.ggml.scores") or [0.0] * len(tokens)
            merges = _derive_merges(vocab_tokens, dict(zip(vocab_tokens, scores)))
        # The reference Gemma 4 tokenizer adds no BOS: its chat template writes <bos>.
        return vocab_tokens, merges, False
    raise GGUFError(
        f"{source}: tokenizer model {model!r} for architecture {arch!r} is not a Gemma vocabulary "
        f"(expected 'llama' with gemma/gemma2/gemma3/gemma3n, or 'gemma4')"
    )


def _special_ids(metadata: Mapping[str, Any], vocab_size: int, source: str) -> dict[str, int | None]:
    """The bos, eos, pad and unk ids the file names (None where it names none), each checked."""
    ids = {
        name: metadata.get(f"tokenizer.ggml.{key}")
        for name, key in (
            ("bos", "bos_token_id"),
            ("eos", "eos_token_id"),
            ("pad", "padding_token_id"),
            ("unk", "unknown_token_id"),
        )
    }
    for name, token_id in ids.items():
        if token_id is not None and not 0 <= token_id < vocab_size:
            raise GGUFError(
                f"{source}: {name} token id {token_id} is outside the {vocab_size}-token vocabulary"
            )
    return ids


def _template(
    bos: str | None, bos_id: int | None, eos: str | None, eos_id: int | None, add_bos: bool, add_eos: bool
):
    single = f"{bos}:0 " * add_bos + "$A:0" + f" {eos}:0" * add_eos
    pair = single + f" {bos}:1" * add_bos + " $B:1" + f" {eos}:1" * add_eos
    special = [(bos, bos_id)] * add_bos + [(eos, eos_id)] * add_eos
    return processors.TemplateProcessing(single=single, pair=pair, special_tokens=special)


def _derive_merges(tokens: Sequence[str], rank: Mapping[str, float]) -> list[tuple[str, str]]:
    """BPE merges implied by a vocabulary: each way to cut a token into two tokens.

    Ordered by the token's rank (higher first), then longer left part, then longer right part, then
    the order of the tokens in ``rank``. This is the order transformers' ``generate_merges`` produces
    (it lists a token's cuts by the ids of their parts, then sorts stably by those three keys; two
    cuts of one token never tie, their left parts differ in length, so the ids never decide).
    """
    vocab = {t: i for i, t in enumerate(tokens)}
    # A cut can only yield two tokens where both parts have the length of some token. Trying only those
    # cuts keeps a long token (100,000 characters) near linear in its length; trying every cut would
    # slice it at every position, quadratic in time and memory.
    lengths = sorted({len(t) for t in vocab if t})
    length_set = set(lengths)
    found: list[tuple[float, int, int, int, str, str]] = []
    for order, (piece, score) in enumerate(rank.items()):
        n = len(piece)
        for k in lengths[: bisect_left(lengths, n)]:
            if n - k in length_set and (a := piece[:k]) in vocab and (b := piece[k:]) in vocab:
                found.append((-score, -k, k - n, order, a, b))
    # The first four entries are unique, so the strings are never compared: one sort of plain tuples
    # (Gemma 3's 262144 tokens: 2.4 s, against 3.5 s with a key function per token and per merge).
    found.sort()
    return [(a, b) for *_, a, b in found]
