"""Logits parity with transformers 5.23 (eager attention, default experts) on tiny random checkpoints."""

import pytest
import torch

import torchgemma
from checkpoints import STYLES, assert_match, padded_batch, reference_logits, reference_model

DTYPES = [torch.float32, torch.bfloat16]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("style", list(STYLES))
def test_logits_match_transformers(text_checkpoints, style, dtype):
    folder = text_checkpoints[style]
    ref = reference_model(folder, dtype)
    model = torchgemma.load(folder, dtype=dtype, attention="eager")
    ids, mask = padded_batch(seed=list(STYLES).index(style))
    with torch.no_grad():
        ours = model(ids, attention_mask=mask)
        ours_unpadded = model(ids[:1])
    assert ours.shape == (2, ids.shape[1], 300)
    assert_match(ours, reference_logits(ref, ids, mask), dtype)
    with torch.no_grad():
        assert_match(ours_unpadded, ref(input_ids=ids[:1]).logits, dtype)


@pytest.mark.parametrize("style", ["e2b", "26b"])
def test_logits_to_keep_matches_transformers(text_checkpoints, style):
    """Keeping only the last position skips it through the KV-shared layers, as generate() does."""
    folder = text_checkpoints[style]
    ref = reference_model(folder, torch.bfloat16)
    model = torchgemma.load(folder, dtype=torch.bfloat16, attention="eager")
    ids, mask = padded_batch(seed=5)
    with torch.no_grad():
        ours = model(ids, attention_mask=mask, logits_to_keep=1)
    assert ours.shape == (2, 1, 300)
    assert torch.equal(ours, reference_logits(ref, ids, mask, logits_to_keep=1))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_multimodal_layout_text_logits(multimodal_checkpoint, dtype):
    """A gemma4 (multimodal) checkpoint: text-only logits equal Gemma4ForConditionalGeneration's."""
    ref = reference_model(multimodal_checkpoint, dtype)
    assert type(ref).__name__ == "Gemma4ForConditionalGeneration"
    model = torchgemma.load(multimodal_checkpoint, dtype=dtype, attention="eager")
    ids, mask = padded_batch(seed=9)
    with torch.no_grad():
        ours = model(ids, attention_mask=mask)
    assert_match(ours, reference_logits(ref, ids, mask), dtype)
