import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))

from checkpoints import (  # noqa: E402
    STYLES,
    build_multimodal_checkpoint,
    build_text_checkpoint,
    randomize_,
    text_config,
)

# Fixture modules whose fixtures every test file can use (llm_checkpoint, gemma4_tokenizer_dir,
# real_270m, ...).
pytest_plugins = [
    "tokenizer_fixtures",
    "llm_fixtures",
    "real_model_fixtures",
    "row_kernels",
    "published_files",
]

if os.environ.get("PYTEST_XDIST_WORKER"):
    # The default run has two workers (pytest-xdist, one per core of the 2-core machines it is
    # timed on): one torch thread each, or the two oversubscribe the cores and stall.
    torch.set_num_threads(1)


@pytest.fixture(scope="session")
def text_checkpoints(tmp_path_factory) -> dict[str, Path]:
    """One tiny random ``gemma4_text`` checkpoint per variant style, built once per session."""
    root = tmp_path_factory.mktemp("ckpt")
    return {style: build_text_checkpoint(root / style, style, seed=i + 1) for i, style in enumerate(STYLES)}


@pytest.fixture(scope="session")
def multimodal_checkpoint(tmp_path_factory) -> Path:
    """A tiny ``gemma4`` (multimodal layout) checkpoint of the E2B style with a vision tower."""
    return build_multimodal_checkpoint(tmp_path_factory.mktemp("mm") / "e2b-mm", "e2b", seed=11)


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models gain nothing from threads, and on a shared 2-core machine their syncs stall badly
    (token-by-token tests took minutes with 2 threads, seconds with 1)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def gen_checkpoints(tmp_path_factory) -> dict[str, Path]:
    """One checkpoint per style, randomised like tests/checkpoints.py but with small embeddings.

    With large tied embeddings every token predicts itself, so greedy decoding just repeats the last
    prompt token; at 0.05x the continuations vary, which is what makes token parity meaningful.
    """
    from transformers import Gemma4ForCausalLM

    root = tmp_path_factory.mktemp("gen")
    folders = {}
    for i, style in enumerate(STYLES):
        torch.manual_seed(i)
        model = Gemma4ForCausalLM(text_config(style))
        randomize_(model, seed=3 + i)
        with torch.no_grad():
            model.model.embed_tokens.weight.mul_(0.05)
        model.save_pretrained(root / style)
        folders[style] = root / style
    return folders
