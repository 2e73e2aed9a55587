"""Checks made from a checkpoint's config and tokenizer files before its weights load (9-12 s for
E2B from disk, minutes from the hub): a chat without a chat template, media a text model cannot
take, sentence embeddings from a model without a sentence-transformers head. Each fails with the
error the check after loading gives, only sooner; a hub id fetches these small files first."""

from __future__ import annotations

import argparse
from pathlib import Path

from .common import CLIError

# What the checks read from a hub repository (the weights come later, with the model).
CHECK_FILES = [
    "config.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    "additional_chat_templates/*.jinja",
    "modules.json",
]


def checkpoint_files(source: str) -> Path:
    """The local folder or GGUF file ``source`` names, with at least ``CHECK_FILES`` in it."""
    from ..weights.source import resolve_source

    return resolve_source(source, hub_files=CHECK_FILES)


def check_chat_template(args: argparse.Namespace) -> None:
    """``torchgemma chat`` on a checkpoint without a chat template (and no --chat-template)."""
    from ..tokenizer.loading import chat_templates_of

    if args.chat_template is None and not chat_templates_of(checkpoint_files(args.model)):
        raise CLIError(
            f"{args.model} is a base model without a chat template; use `torchgemma generate`, "
            "or pass --chat-template FILE"
        )


def check_media(args: argparse.Namespace) -> None:
    """--image, --audio or --video given to a checkpoint without the tower (or embedder) for it (a
    .gguf: with the towers of its --mmproj, if any)."""
    if not (args.image or args.audio or args.video):
        return
    from ..info import checkpoint_config
    from ..processing.processor import check_media_towers

    path = checkpoint_files(args.model)
    mmproj = getattr(args, "mmproj", None)
    if mmproj is not None and path.suffix == ".gguf":
        from ..weights.gguf import read_gguf_with_mmproj

        # The pair's config, from the two files' metadata (no tensor is read).
        config = read_gguf_with_mmproj(path, mmproj, check_shapes=False).model_config
    else:
        config = checkpoint_config(path)
    note = config.towers_note
    if path.suffix == ".gguf" and mmproj is None:
        note += "; a .gguf model's towers come in llama.cpp's mmproj file: pass --mmproj"
    check_media_towers(config, args.image, args.audio, args.video, towers_note=note)


def check_sentence_head(args: argparse.Namespace) -> None:
    """``torchgemma embed`` on a checkpoint that is not a sentence-transformers folder."""
    from ..embedding import MODULES_FILE

    path = checkpoint_files(args.model)
    if not (path / MODULES_FILE).is_file():
        raise CLIError(f"{args.model} has no sentence-transformers modules (modules.json): it cannot embed")
