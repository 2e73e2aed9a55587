import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))

from checkpoints import STYLES, build_multimodal_checkpoint, build_text_checkpoint  # noqa: E402


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
