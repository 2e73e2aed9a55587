"""`load_tokenizer(folder)`: a checkpoint's tokenizer files -> a `Tokenizer`, as transformers 5.23's
`AutoTokenizer.from_pretrained(folder)` builds it for the same files, because ids must match the
reference exactly:

* `tokenizer_class: GemmaTokenizer` (every Gemma checkpoint) makes transformers keep only the BPE
  vocabulary/merges and the post-processor of tokenizer.json and rebuild the rest with Gemma's fixed
  pipeline (spaces -> "▁", no pre-split, byte fallback, decoder "▁"->" " + bytes + fuse). We rebuild
  the same way; other classes use tokenizer.json as is (what transformers' TokenizersBackend does).
* Whether `<bos>` is prepended is decided by tokenizer.json's post-processor alone: transformers
  drops `add_bos_token`/`add_eos_token` from tokenizer_config.json whenever tokenizer.json exists.
  Gemma 4 checkpoints put `<bos>` in the chat template instead.
* Added tokens come from tokenizer_config.json's `added_tokens_decoder` when present, otherwise from
  added_tokens.json and tokenizer.json (the latter's win for the same id; plus special_tokens_map.json
  for the named tokens), and every named or extra special token missing from them is added as a
  special token, in transformers' order. Added tokens may reach past the model's embedding table
  (EmbeddingGemma's `<image_soft_token>`, 262144): the tokenizer keeps them, the model refuses them
  when used.
* chat_template.jinja (and additional_chat_templates/*.jinja) take precedence over a
  `chat_template` entry in tokenizer_config.json.
"""

from __future__ import annotations

import ctypes
import json
import os
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tokenizers import AddedToken
from tokenizers import Tokenizer as BackendTokenizer

from .tokenizer import Tokenizer, _content

# What load_tokenizer fetches from the hub (and reads from a folder).
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.jinja",
    "additional_chat_templates/*.jinja",
)

# transformers' standard named special tokens, in the order it registers them.
_STANDARD_SPECIAL = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)

# GemmaTokenizer's constructor defaults, used when tokenizer_config.json leaves a name out.
_GEMMA_DEFAULT_SPECIAL = {
    "bos_token": "<bos>",
    "eos_token": "<eos>",
    "unk_token": "<unk>",
    "pad_token": "<pad>",
    "mask_token": "<mask>",
}

_GEMMA_CLASSES = ("GemmaTokenizer", "GemmaTokenizerFast")


def load_tokenizer(path_or_id: str | os.PathLike, *, revision: str | None = None) -> Tokenizer:
    """Load the tokenizer of a checkpoint folder, a hub repo id (tokenizer files only), a GGUF file
    (built from its vocabulary) or a named model such as ``gemma3-270m``."""
    tokenizer = _load_tokenizer(path_or_id, revision)
    release_freed_heap()
    return tokenizer


def release_freed_heap() -> None:
    """Hand the C heap's free pages back to the OS (glibc's ``malloc_trim``; elsewhere nothing).
    Reading a 262K-token vocabulary (tokenizer.json parsed in Python, then again in Rust) frees
    hundreds of MB that glibc otherwise keeps for the process: the real 270M's tokenizer left RSS
    at 612 MiB, 330 after the trim (measured; 224 before it was loaded)."""
    if not sys.platform.startswith("linux"):
        return
    try:
        trim = ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):  # not glibc
        return
    trim(0)


def _load_tokenizer(path_or_id: str | os.PathLike, revision: str | None) -> Tokenizer:
    from ..weights.source import resolve_source

    folder = resolve_source(path_or_id, revision=revision, hub_files=list(TOKENIZER_FILES))
    if folder.is_file():  # a .gguf file (resolve_source refuses other files)
        return _gguf_tokenizer(folder)
    config = _read_json(folder, "tokenizer_config.json")
    data = _read_json(folder, "tokenizer.json")
    gemma = config.get("tokenizer_class") in _GEMMA_CLASSES

    named, extra = _named_special_tokens(folder, config, gemma)
    # transformers' legacy added_tokens.json reading counts the standard names and the extra list.
    specials = {_content(named[k]) for k in _STANDARD_SPECIAL if k in named} | {_content(t) for t in extra}
    decoder_tokens = _added_tokens_decoder(folder, config, data, specials)
    backend = _build_backend(folder, data, gemma, unk_token=_content(named.get("unk_token", "<unk>")))
    # transformers adds the listed added tokens that the backend lacks (by content and flags), in id
    # order, before the named/extra special tokens; the Tokenizer constructor then adds those.
    present = {repr(t) for t in backend.get_added_tokens_decoder().values()}
    backend.add_tokens([t for _, t in sorted(decoder_tokens.items()) if repr(t) not in present])
    backend.encode_special_tokens = bool(config.get("split_special_tokens", False))

    # transformers skips the clean-up for BPE models (it would delete real spaces) unless forced.
    clean_up = bool(config.get("clean_up_tokenization_spaces", False)) and (
        type(backend.model).__name__ != "BPE"
        or bool(config.get("clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output", False))
    )
    control = config.get("chat_control_tokens")
    if control is not None and (
        not isinstance(control, list) or not all(isinstance(t, str) for t in control)
    ):
        raise TypeError(
            f"{folder}/tokenizer_config.json: chat_control_tokens should be a list of strings, got {control!r}"
        )
    return Tokenizer(
        backend,
        special_tokens=named,
        extra_special_tokens=extra,
        chat_template=_chat_templates(folder, config),
        clean_up_tokenization_spaces=clean_up,
        chat_control_tokens=control,
        name_or_path=str(path_or_id),
    )


def _gguf_tokenizer(path: Path) -> Tokenizer:
    from .gguf import cached_tokenizer_from_gguf

    backend, info = cached_tokenizer_from_gguf(path)
    return Tokenizer(
        backend,
        bos_id=info.bos_id,
        eos_id=info.eos_id,
        pad_id=info.pad_id,
        unk_id=info.unk_id,
        add_bos=info.add_bos,
        add_eos=info.add_eos,
        chat_template=info.chat_template,
        name_or_path=str(path),
    )


def chat_templates_of(path: Path) -> str | dict[str, str] | None:
    """The chat template(s) ``load_tokenizer`` gives a local checkpoint folder or GGUF file, read
    from its template files (or the GGUF metadata) alone: no vocabulary is built."""
    if path.is_file():
        from ..weights.gguf.reader import read_gguf_metadata

        return read_gguf_metadata(path).get("tokenizer.chat_template") or None
    return _chat_templates(path, _read_json(path, "tokenizer_config.json"))


def _read_json(folder: Path, name: str) -> dict:
    path = folder / name
    if not path.is_file():
        raise FileNotFoundError(f"{folder}: missing {name} (needed to load the tokenizer)")
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as error:
        raise ValueError(f"{path} is not valid JSON: {error}") from error


def _chat_templates(folder: Path, config: Mapping[str, Any]) -> str | dict[str, str] | None:
    """chat_template.jinja (+ additional_chat_templates/*.jinja) win over tokenizer_config.json."""
    templates: dict[str, str] = {}
    default = folder / "chat_template.jinja"
    if default.is_file():
        templates["default"] = default.read_text(encoding="utf-8")
    extra_dir = folder / "additional_chat_templates"
    if extra_dir.is_dir():
        for path in sorted(extra_dir.glob("*.jinja")):
            templates[path.stem] = path.read_text(encoding="utf-8")
    if templates:
        return templates["default"] if list(templates) == ["default"] else templates
    entry = config.get("chat_template")
    if isinstance(entry, list):  # saved as [{"name": ..., "template": ...}, ...]
        return {item["name"]: item["template"] for item in entry}
    return entry


def _added_token(value: Any) -> str | AddedToken:
    """A token value from a JSON file: a string, or a serialized AddedToken."""
    if isinstance(value, Mapping):
        fields = {
            k: v
            for k, v in value.items()
            if k in ("content", "single_word", "lstrip", "rstrip", "normalized", "special")
        }
        return AddedToken(**fields)
    return value


def _named_special_tokens(
    folder: Path, config: Mapping[str, Any], gemma: bool
) -> tuple[dict[str, str | AddedToken], list[str | AddedToken]]:
    """Named special tokens (standard first, then model-specific like image_token) and extra ones."""
    standard: dict[str, Any] = dict(_GEMMA_DEFAULT_SPECIAL) if gemma else {}
    model_specific: dict[str, Any] = {}
    for key, value in config.items():
        if key in _STANDARD_SPECIAL:
            standard[key] = value
        elif key.endswith("_token") and (
            isinstance(value, str) or (isinstance(value, Mapping) and "content" in value)
        ):
            model_specific[key] = value
    extra_entry = config.get("extra_special_tokens") or config.get("additional_special_tokens") or []
    if isinstance(extra_entry, Mapping):  # a dict of extra tokens names them
        model_specific.update(extra_entry)
        extra_entry = []
    extra = [_added_token(t) for t in extra_entry]

    # special_tokens_map.json is only read when tokenizer_config.json has no added_tokens_decoder.
    # Its standard names override the config; model-specific names only add (the config's win).
    map_path = folder / "special_tokens_map.json"
    if "added_tokens_decoder" not in config and map_path.is_file():
        new_model_specific: dict[str, Any] = {}
        for key, value in _read_json(folder, "special_tokens_map.json").items():
            if key in ("extra_special_tokens", "additional_special_tokens") and isinstance(value, list):
                if key == "extra_special_tokens" or not extra:
                    extra += [
                        t
                        for t in (_special_added(v) for v in value)
                        if _content(t) not in {_content(e) for e in extra}
                    ]
            elif key in _STANDARD_SPECIAL:
                standard[key] = _special_added(value)
            elif key.endswith("_token") and key not in model_specific and value is not None:
                new_model_specific[key] = _special_added(value)
        model_specific = {**new_model_specific, **model_specific}

    named: dict[str, str | AddedToken] = {}
    for key in _STANDARD_SPECIAL:
        if standard.get(key) is not None:
            named[key] = _added_token(standard[key])
    for key, value in model_specific.items():
        if value is not None:
            named[key] = _added_token(value)
    return named, extra


def _special_added(value: Any) -> str | AddedToken:
    # special_tokens_map.json entries given as objects are special by definition.
    if isinstance(value, Mapping):
        token = _added_token({**value, "special": True})
        return token
    return value


def _added_tokens_decoder(
    folder: Path, config: Mapping[str, Any], data: Mapping[str, Any], specials: set[str]
) -> dict[int, AddedToken]:
    """The added tokens transformers starts from: the config's list, else added_tokens.json's
    (legacy: a token is special when it is a named or extra special token, ``specials``) overridden
    by tokenizer.json's, id by id."""
    if "added_tokens_decoder" in config:
        entries = list(config["added_tokens_decoder"].items())
    else:
        entries = []
        if (folder / "added_tokens.json").is_file():
            for content, index in _read_json(folder, "added_tokens.json").items():
                special = content in specials
                entries.append((index, {"content": content, "normalized": not special, "special": special}))
        entries += [(t["id"], t) for t in data.get("added_tokens", [])]
    tokens = {}
    for index, entry in entries:
        token = _added_token(entry)
        if not isinstance(token, AddedToken):
            raise ValueError(f"{folder}: added token {index} should be an object, got {entry!r}")
        tokens[int(index)] = token
    return tokens


def _build_backend(folder: Path, data: Mapping[str, Any], gemma: bool, unk_token: str) -> BackendTokenizer:
    data = dict(data)
    data["added_tokens"] = []  # re-added afterwards from the list transformers uses
    data["truncation"] = None
    data["padding"] = None
    if gemma:
        model = data.get("model") or {}
        if model.get("type") != "BPE":
            raise ValueError(
                f"{folder}/tokenizer.json: GemmaTokenizer needs a BPE model, found {model.get('type')!r}"
            )
        # transformers' GemmaTokenizer keeps vocab, merges and post-processor and fixes everything else.
        data["model"] = {
            "type": "BPE",
            "dropout": None,
            "unk_token": unk_token,
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": True,
            "byte_fallback": True,
            "ignore_merges": False,
            "vocab": model.get("vocab", {}),
            "merges": model.get("merges", []),
        }
        data["normalizer"] = {"type": "Replace", "pattern": {"String": " "}, "content": "▁"}
        data["pre_tokenizer"] = {
            "type": "Split",
            "pattern": {"String": " "},
            "behavior": "MergedWithPrevious",
            "invert": False,
        }
        data["decoder"] = {
            "type": "Sequence",
            "decoders": [
                {"type": "Replace", "pattern": {"String": "▁"}, "content": " "},
                {"type": "ByteFallback"},
                {"type": "Fuse"},
            ],
        }
    try:
        return BackendTokenizer.from_str(json.dumps(data))
    except Exception as error:  # tokenizers raises a bare Exception on bad JSON structure
        raise ValueError(f"{folder}/tokenizer.json could not be loaded by tokenizers: {error}") from error
