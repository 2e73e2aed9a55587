"""Tensor parallelism with images, audio and constraints (gloo on the CPU): an E2B-like checkpoint
with both towers, split over 2 (and, slow, 4) ranks, against one process. tests/tp_media_worker.py
says what runs: ``LLM`` calls made alike on every rank, and an ``Engine`` batch led by rank 0 (the
server's way) with media, a JSON schema, a regex, seeded sampling, log-probabilities and a
constraint that allows nothing.

fp32: the row-parallel sums run in another order than one device's, so logits and
log-probabilities are equal to one process within float32 rounding (measured 6e-6 and 7e-6 on
logits of magnitude ~1), not to the bit; every token and finish reason must be the same.
"""

import re

import pytest
import torch

from distributed_fixtures import Ranks
from tp_media_worker import run

REASONS = ["stop", "length", "error"]


def compare(tmp_path, folder, size: int) -> dict[str, torch.Tensor]:
    with Ranks(tmp_path, size, [str(folder)], timeout=300, worker="tp_media_worker.py") as ranks:
        ref = run(folder)  # one process, while the ranks run
        got = ranks.results()
    assert sorted(got) == sorted(ref)
    for key, value in ref.items():
        if key.endswith(("logits", "logprobs")):
            assert got[key].shape == value.shape, key
            assert torch.allclose(got[key], value, rtol=0, atol=5e-5), key
        else:
            assert torch.equal(got[key], value), (key, got[key].tolist(), value.tolist())
    return got


def test_media_and_constraints_on_two_ranks_match_one_process(media_llm_checkpoints, tmp_path, one_thread):
    from torchgemma.tokenizer import load_tokenizer

    got = compare(tmp_path, media_llm_checkpoints["e2b"], 2)
    # What the comparison alone would not show: the constraints held over the whole vocabulary
    # (rank 0 masks the gathered logits), and the refused request failed without stalling the
    # ranks' batch.
    tokenizer = load_tokenizer(media_llm_checkpoints["e2b"])
    regex = got["engine.regex.tokens"].tolist()
    assert REASONS[int(got["engine.regex.reason"])] == "stop"
    assert re.fullmatch(r"[a-z]{2,5} [0-9]{1,3}!", tokenizer.decode(regex[:-1])), tokenizer.decode(regex)
    assert REASONS[int(got["engine.refused.reason"])] == "error"
    assert got["engine.refused.tokens"].numel() == 0
    assert got["engine.json.tokens"].numel() > 0 and got["engine.media.tokens"].numel() == 10


@pytest.mark.slow
def test_media_and_constraints_on_four_ranks_match_one_process(media_llm_checkpoints, tmp_path, one_thread):
    compare(tmp_path, media_llm_checkpoints["e2b"], 4)
