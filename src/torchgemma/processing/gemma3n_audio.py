"""Audio -> log-mel features for Gemma 3n's audio encoder.

Matches transformers' ``Gemma3nAudioFeatureExtractor`` (5.23), defaults as published: 16 kHz mono,
clips truncated to 30 s, the batch right-padded to the longest clip rounded up to 128 samples, frames
of 513 samples every 160 (no left padding), HTK pre-emphasis (0.97) turning each into 512, periodic
Hann window, |rfft| with n=1024 (twice the next power of two, "FFT overdrive"), an HTK mel filter
bank (128 filters, 125-7600 Hz, no normalisation), ``log(max(mel, 1e-5))``, then optional per-bin
mean and standard deviation. A frame is valid when its first sample is real audio; padded frames
keep their values (the encoder masks them).

Reading clips (arrays, tensors, files), resampling and the 30 s limit are Gemma 4's
(``processing/audio.py``); only the spectrogram differs.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np
import torch
from numpy.lib.stride_tricks import sliding_window_view

from .audio import SAMPLING_RATE, AudioInput, _clip_at_16k, _pad_batch, _split_batch

FRAME_LENGTH = 512  # 32 ms
HOP_LENGTH = 160  # 10 ms
FFT_LENGTH = 1024
NUM_MEL_BINS = 128
MIN_FREQUENCY = 125.0
MAX_FREQUENCY = 7600.0
PREEMPHASIS = 0.97
MEL_FLOOR = 1e-5
# One frame is FRAME_LENGTH + 1 samples (the first one feeds the pre-emphasis): shorter clips give
# no frame, hence nothing for the encoder.
MIN_SAMPLES = FRAME_LENGTH + 1
# The processor puts this many audio placeholders per clip (30 s at 16 kHz: 2,997 frames, 750
# after the encoder's two stride-2 convolutions, 188 after its reduction by 4).
AUDIO_SEQ_LENGTH = 188


def process_audio_gemma3n(
    waveforms: AudioInput | Sequence[AudioInput],
    sampling_rate: int = SAMPLING_RATE,
    *,
    per_bin_mean: Sequence[float] | None = None,
    per_bin_stddev: Sequence[float] | None = None,
) -> dict[str, torch.Tensor]:
    """Log-mel features for one clip or a batch, as ``Gemma3nAudioFeatureExtractor`` returns them.

    Clips are what ``process_audio`` takes (arrays, tensors, lists of floats, file paths; resampled
    to 16 kHz). Returns ``input_features`` (B, T, 128) float32 and ``input_features_mask`` (B, T)
    bool (True = the frame starts on real audio). ``per_bin_mean`` / ``per_bin_stddev``
    (128 values each) are the preprocessor config's, when it has them. A clip under 513 samples at
    16 kHz gives no frame and is refused.
    """
    clips = []
    for index, clip in enumerate(_split_batch(waveforms)):
        need = f"Gemma 3n's audio encoder needs at least {MIN_SAMPLES} samples at 16 kHz (one 32 ms frame)"
        try:
            wave = _clip_at_16k(clip, sampling_rate, index)
        except ValueError as error:
            if "too short" in str(error):  # under Gemma 4's minimum, which reading checks
                raise ValueError(f"audio clip {index} is too short: {need}") from error
            raise
        if len(wave) < MIN_SAMPLES:
            raise ValueError(f"audio clip {index} is too short ({len(wave)} samples): {need}")
        clips.append(wave)
    mean = _per_bin(per_bin_mean, "per_bin_mean")
    stddev = _per_bin(per_bin_stddev, "per_bin_stddev")
    batch, sample_mask = _pad_batch(clips)
    features, masks = [], []
    for wave, mask in zip(batch, sample_mask):
        feature, frame_mask = _log_mel(wave, mask, mean, stddev)
        features.append(feature)
        masks.append(frame_mask)
    return {
        "input_features": torch.from_numpy(np.stack(features)),
        "input_features_mask": torch.from_numpy(np.stack(masks)),
    }


def _per_bin(values: Sequence[float] | None, name: str) -> np.ndarray | None:
    if values is None:
        return None
    array = np.asarray(values, dtype=np.float64)  # any shape of 128 values, as the reference reshapes
    if array.size != NUM_MEL_BINS or not np.isfinite(array).all():
        raise ValueError(f"{name} must be {NUM_MEL_BINS} finite numbers, got shape {array.shape}")
    return array.reshape(1, 1, NUM_MEL_BINS)


def _log_mel(
    wave: np.ndarray, sample_mask: np.ndarray, mean: np.ndarray | None, stddev: np.ndarray | None
) -> tuple[np.ndarray, np.ndarray]:
    """One padded float32 clip (N,) -> features (T, 128) float32 and frame mask (T,) bool."""
    # (1, T, 513), one clip at a time with a batch of one: the reference's exact array shapes.
    frames = sliding_window_view(wave[None], FRAME_LENGTH + 1, axis=-1)[:, ::HOP_LENGTH]
    # HTK pre-emphasis: the first sample scaled by 1 - 0.97, every next one less 0.97 x its predecessor.
    first = frames[..., :1] * (1.0 - PREEMPHASIS)
    rest = frames[..., 1:-1] - PREEMPHASIS * frames[..., :-2]
    frames = np.concatenate([first, rest], axis=-1) * _hann_window()  # float32
    spectrum = np.abs(np.fft.rfft(frames, n=FFT_LENGTH, axis=-1))  # float32 FFT, as numpy does there
    log_mel = np.log(np.maximum(np.matmul(spectrum, _mel_filter_bank()), np.float64(MEL_FLOOR)))
    if mean is not None:
        log_mel = log_mel - mean
    if stddev is not None:
        log_mel = log_mel / stddev
    log_mel = log_mel[0]
    return log_mel.astype(np.float32), sample_mask[::HOP_LENGTH][: len(log_mel)]


@lru_cache(maxsize=1)
def _hann_window() -> np.ndarray:
    """Periodic Hann window of 512 samples, float32 arguments (as the reference builds it)."""
    n = np.arange(FRAME_LENGTH, dtype=np.float32)
    return (0.5 * (1 - np.cos(2 * np.pi * n / FRAME_LENGTH))).astype(np.float32)


@lru_cache(maxsize=1)
def _mel_filter_bank() -> np.ndarray:
    """(513, 128) float64 triangles on the HTK mel scale, 125-7600 Hz, peak 1; the bins' frequencies
    are float32, as the reference computes them."""
    bin_hz = np.arange(FFT_LENGTH // 2 + 1, dtype=np.float32) * (SAMPLING_RATE / FFT_LENGTH)
    low = 2595.0 * math.log10(1.0 + MIN_FREQUENCY / 700.0)
    high = 2595.0 * math.log10(1.0 + MAX_FREQUENCY / 700.0)
    edges_hz = 700.0 * (10 ** (np.linspace(low, high, NUM_MEL_BINS + 2) / 2595.0) - 1.0)
    widths = edges_hz[1:] - edges_hz[:-1]
    slopes = edges_hz[None, :] - bin_hz[:, None]  # (513, 130)
    rising = (-1.0 * slopes[:, :-2]) / widths[:-1]
    falling = slopes[:, 2:] / widths[1:]
    return np.maximum(np.zeros(1, dtype=np.float32), np.minimum(rising, falling))


# ── prompts: what Gemma3nProcessor writes for each clip ─────────────────────────────────────────


def audio_sequence(tokenizer: Any, soft_tokens: int = AUDIO_SEQ_LENGTH) -> str:
    """The text Gemma3nProcessor puts in place of each audio placeholder: ``"\\n\\n"`` + the
    start-of-audio token + ``soft_tokens`` placeholders + the end-of-audio token + ``"\\n\\n"``. The
    whole prompt is then tokenized at once, so the newlines merge with their neighbours as there."""
    audio, start, end = (
        tokenizer.backend.id_to_token(i)
        for i in (tokenizer.audio_id, tokenizer.audio_start_id, tokenizer.audio_end_id)
    )
    return f"\n\n{start}{audio * soft_tokens}{end}\n\n"


def expand_audio_text(text: str, tokenizer: Any, soft_tokens: int = AUDIO_SEQ_LENGTH) -> str:
    """A raw prompt with every audio placeholder expanded as Gemma3nProcessor does."""
    audio = tokenizer.backend.id_to_token(tokenizer.audio_id)
    return text.replace(audio, audio_sequence(tokenizer, soft_tokens))


def expand_audio_in_template(template: str, tokenizer: Any, soft_tokens: int = AUDIO_SEQ_LENGTH) -> str:
    """A chat template whose own audio placeholder literal (``'<audio_soft_token>'``, as Gemma 3n's
    template writes an audio item) renders expanded: the rendered text is then what the processor
    tokenizes, and a placeholder typed in a message stays what sanitizing makes of it."""
    audio = tokenizer.backend.id_to_token(tokenizer.audio_id)
    literal = json.dumps(audio_sequence(tokenizer, soft_tokens))  # a valid Jinja string literal
    expanded = template
    for quote in ("'", '"'):
        expanded = expanded.replace(f"{quote}{audio}{quote}", literal)
    if expanded == template:
        raise ValueError(f"the chat template writes no {audio!r} for audio items: cannot place audio")
    return expanded


# ── the checkpoint's feature extractor config ───────────────────────────────────────────────────

# What process_audio_gemma3n computes, in the keys transformers saves (preprocessor_config.json).
SUPPORTED_SETTINGS: dict[str, Any] = {
    "feature_size": NUM_MEL_BINS,
    "sampling_rate": SAMPLING_RATE,
    "padding_value": 0.0,
    "padding_side": "right",
    "frame_length": FRAME_LENGTH,
    "hop_length": HOP_LENGTH,
    "frame_length_ms": 32.0,
    "hop_length_ms": 10.0,
    "fft_length": FFT_LENGTH,
    "fft_overdrive": True,
    "min_frequency": MIN_FREQUENCY,
    "max_frequency": MAX_FREQUENCY,
    "preemphasis": PREEMPHASIS,
    "preemphasis_htk_flavor": True,
    "dither": 0.0,
    "input_scale_factor": 1.0,
    "mel_floor": MEL_FLOOR,
}


def feature_settings(folder: Path) -> dict[str, Any]:
    """``process_audio_gemma3n``'s keyword arguments from a checkpoint folder's feature extractor
    config (``preprocessor_config.json``, or ``processor_config.json``'s ``feature_extractor``): the
    per-bin mean and standard deviation. A setting other than the ones computed here (another
    frame length, dithering, ...) is refused by name rather than silently ignored."""
    config: dict[str, Any] = {}
    nested, alone = folder / "processor_config.json", folder / "preprocessor_config.json"
    if nested.is_file():
        config = json.loads(nested.read_text(encoding="utf-8")).get("feature_extractor") or {}
    if not config and alone.is_file():
        config = json.loads(alone.read_text(encoding="utf-8"))
    for key, value in SUPPORTED_SETTINGS.items():
        if config.get(key) is not None and config[key] != value:
            raise ValueError(
                f"{folder}: the audio feature extractor's {key} is {config[key]!r}; torchgemma computes "
                f"Gemma 3n's features with {key}={value!r} only"
            )
    return {"per_bin_mean": config.get("per_bin_mean"), "per_bin_stddev": config.get("per_bin_stddev")}
