"""Gemma 3n's audio path against transformers: the feature extractor, the conformer encoder, the
audio embedder, logits and greedy generation with audio in the prompt."""

import numpy as np
import pytest
import torch

from torchgemma.processing.gemma3n_audio import process_audio_gemma3n

pytestmark = pytest.mark.usefixtures("one_thread")


def clips(lengths, seed=0, dtype=np.float32):
    rng = np.random.default_rng(seed)
    return [(rng.standard_normal(n) * 0.3).astype(dtype) for n in lengths]


# One clip, the shortest (one frame), a padded batch, one truncated to 30 s, float64 input.
@pytest.mark.parametrize(
    "lengths, dtype",
    [
        ([16000], np.float32),
        ([513], np.float32),
        ([700, 16000, 3001], np.float32),
        ([480_200], np.float32),
        ([5000, 999], np.float64),
    ],
)
def test_features_equal_transformers(lengths, dtype):
    from transformers import Gemma3nAudioFeatureExtractor

    waves = clips(lengths, seed=len(lengths), dtype=dtype)
    ref = Gemma3nAudioFeatureExtractor()(waves, return_tensors="pt")
    ours = process_audio_gemma3n(waves)
    assert ours["input_features"].dtype == torch.float32
    assert ours["input_features"].shape == ref["input_features"].shape
    assert (ours["input_features"] - ref["input_features"]).abs().max().item() == 0.0
    assert torch.equal(ours["input_features_mask"], ref["input_features_mask"])


def test_per_bin_normalisation_equals_transformers():
    from transformers import Gemma3nAudioFeatureExtractor

    rng = np.random.default_rng(3)
    mean, stddev = rng.standard_normal(128), rng.random(128) + 0.5
    waves = clips([4000, 2500], seed=5)
    ref = Gemma3nAudioFeatureExtractor(per_bin_mean=mean, per_bin_stddev=stddev)(waves, return_tensors="pt")
    ours = process_audio_gemma3n(waves, per_bin_mean=mean, per_bin_stddev=stddev)
    assert torch.equal(ours["input_features"], ref["input_features"])


def test_bad_audio_is_named():
    with pytest.raises(ValueError, match="too short.*513"):
        process_audio_gemma3n(clips([400])[0])
    with pytest.raises(ValueError, match="per_bin_mean must be 128"):
        process_audio_gemma3n(clips([1000])[0], per_bin_mean=[0.0] * 3)
