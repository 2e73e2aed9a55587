"""Hostile audio input stays cheap: forged sampling rates, hours-long files and bytes, too-short clips.

Memory bounds are tracemalloc peaks (numpy reports its buffers to it) over what the call itself
allocates; before these limits the same inputs took gigabytes (see each test).
"""

from __future__ import annotations

import struct
import sys
import time
import tracemalloc
from types import SimpleNamespace

import numpy as np
import pytest

from torchgemma.processing import audio, num_audio_tokens, process_audio
from torchgemma.processing.audio import decode_wav, load_audio, resample

MB = 1 << 20


def wav_header(rate: int, channels: int, data_bytes: int) -> bytes:
    """44-byte header of a 16-bit PCM WAV whose data chunk holds ``data_bytes`` bytes."""
    fmt = struct.pack("<HHIIHH", 1, channels, rate, rate * channels * 2, channels * 2, 16)
    riff_size = min(36 + data_bytes, 0xFFFFFFFF)
    return (
        b"RIFF"
        + struct.pack("<I", riff_size)
        + b"WAVEfmt "
        + struct.pack("<I", 16)
        + fmt
        + b"data"
        + struct.pack("<I", data_bytes)
    )


def pcm16(samples: np.ndarray) -> bytes:
    """(frames, channels) floats in [-1, 1) -> interleaved 16-bit PCM."""
    return np.round(samples * 32767).astype("<i2").tobytes()


class Measured:
    """Peak traced memory above the start (bytes) and wall time (seconds) of a ``with`` block."""

    def __enter__(self):
        tracemalloc.start()
        self.start = tracemalloc.get_traced_memory()[0]
        self.clock = time.perf_counter()
        return self

    def __exit__(self, *exc):
        self.seconds = time.perf_counter() - self.clock
        current, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        self.peak, self.retained = peak - self.start, current - self.start


# --- Finding 1: sampling rates --------------------------------------------------------------------


def test_a_forged_rate_is_refused_before_any_work(tmp_path):
    # Before: this 244-byte file took 7.9 GB and 44 s (a 16000 x 6317 filter table per phase).
    data = pcm16(np.sin(np.arange(100))[:, None] * 0.5)
    blob = wav_header(1_000_003, 1, len(data)) + data
    path = tmp_path / "forged.wav"
    path.write_bytes(blob)
    assert path.stat().st_size == 244
    calls = [
        lambda: load_audio(path),
        lambda: process_audio(path),
        lambda: process_audio([np.zeros(16000), str(path)]),
        lambda: decode_wav(blob),
        lambda: process_audio(np.zeros(100), sampling_rate=1_000_003),
        lambda: resample(np.zeros(100), 1_000_003, 16_000),
        lambda: resample(np.zeros(100), 16_000, 1_000_003),
        lambda: num_audio_tokens(100, sampling_rate=1_000_003),
    ]
    with Measured() as cost:
        for call in calls:
            with pytest.raises(ValueError, match="1000003") as error:
                call()
            assert "384000" in str(error.value)  # names the limit too
    assert cost.peak < 2 * MB and cost.seconds < 2
    with pytest.raises(ValueError, match="forged.wav"):
        process_audio(path)


def test_every_rate_up_to_the_limit_is_accepted():
    for rate in (1, 7, 8000, 44100, audio.MAX_SAMPLING_RATE):
        features = process_audio(np.full(rate // 20 + 2000, 0.1), sampling_rate=rate)
        assert features["input_features_mask"].any()
    with pytest.raises(ValueError, match="downsampling by more than 24"):
        resample(np.zeros(1000), 384_000, 8_000)  # the filter would be 48x longer than for 16 kHz


@pytest.mark.parametrize("rate", [15_999, 191_999, 383_999])
def test_uncommon_rates_resample_in_bounded_memory(rate):
    # Reduced ratios 16000/15999, 16000/191999, 16000/383999: an exact table per phase would take
    # 13, 148 and 296 MB (before: 1.5 GB peak and 9 s for 191999 Hz, over 3 GB for 383999 Hz).
    x = np.random.default_rng(rate).uniform(-1, 1, rate)  # 1 s
    with Measured() as cost:
        out = resample(x, rate, 16_000)
        size = out.nbytes
        del out
    # A float64 copy of the input, the output, and ~20 MB for the 2 MiB table while it is built
    # and the 2 MiB chunks it is applied to.
    assert cost.peak < x.nbytes + size + 48 * MB, cost.peak / MB
    assert cost.retained < MB  # nothing large stays cached
    assert cost.seconds < 10


@pytest.mark.parametrize("rate", [8001, 22051])
def test_interpolated_filters_match_exact_ones(rate, monkeypatch):
    """The bounded fallback against the exact polyphase filter (13 and 17 MB tables, forced)."""
    x = np.random.default_rng(rate).uniform(-1, 1, rate // 2)
    interpolated = resample(x, rate, 16_000)
    up, down = audio._reduced_ratio(rate, 16_000)
    assert up * (2 * audio._filter_size(up, down)[2] + 1) > audio.RESAMPLE_TABLE_SIZE  # took the fallback
    monkeypatch.setattr(audio, "RESAMPLE_TABLE_SIZE", 1 << 26)
    try:
        exact = resample(x, rate, 16_000)
    finally:
        audio._phase_filters.cache_clear()
    assert exact.shape == interpolated.shape
    assert np.abs(exact - interpolated).max() < 1e-6


# --- Finding 2: long inputs -------------------------------------------------------------------------


def test_an_hours_long_file_is_read_only_as_far_as_kept(tmp_path):
    # Before: a 2-hour 48 kHz stereo WAV was read whole and decoded to float64: 10.8 GB peak.
    rate, frames = 48_000, 2 * 3600 * 48_000
    head = np.random.default_rng(0).uniform(-0.5, 0.5, (31 * rate, 2))  # audio in the first 31 s
    path = tmp_path / "two_hours.wav"
    with path.open("wb") as f:
        f.write(wav_header(rate, 2, frames * 4) + pcm16(head))
        f.truncate(44 + frames * 4)  # the rest is a hole: zeros, without writing 1.4 GB
    decoded_head = np.round(head * 32767).astype(np.int16) / 32768.0
    expected = process_audio(decoded_head.mean(axis=1), sampling_rate=rate)
    with Measured() as cost:
        got = process_audio(path)
    assert cost.peak < 96 * MB and cost.seconds < 15, (cost.peak / MB, cost.seconds)
    for name in expected:
        np.testing.assert_array_equal(got[name].numpy(), expected[name].numpy())
    with Measured() as cost:
        wave, found_rate = load_audio(path, max_frames=1000)
    assert found_rate == rate and cost.peak < 4 * MB
    np.testing.assert_allclose(wave, decoded_head[:1000].mean(axis=1), rtol=0, atol=1e-15)


def test_long_wav_bytes_and_arrays_are_converted_only_as_far_as_kept():
    # Before: decode_wav of 10 minutes of 48 kHz stereo (115 MB) peaked at 770 MB more.
    rate, frames = 48_000, 10 * 60 * 48_000
    head = np.random.default_rng(1).uniform(-0.5, 0.5, (31 * rate, 2))
    blob = wav_header(rate, 2, frames * 4) + pcm16(head) + bytes((frames - len(head)) * 4)
    mono = (np.round(head * 32767).astype(np.int16) / 32768.0).mean(axis=1)
    with Measured() as cost:
        wave = decode_wav(blob)
    assert cost.peak < 96 * MB and cost.seconds < 15, (cost.peak / MB, cost.seconds)
    assert len(wave) == audio.MAX_SAMPLES
    np.testing.assert_allclose(wave, resample(mono, rate, 16_000, max_samples=len(wave)), rtol=0, atol=1e-12)

    long_array = np.zeros(frames, np.float32)  # 115 MB; as float64 it would be 230 MB
    long_array[: len(mono)] = mono
    with Measured() as cost:
        features = process_audio(long_array, sampling_rate=rate)
    assert cost.peak < 96 * MB, cost.peak / MB
    assert features["input_features"].shape[1] == 2999  # 30 s of frames


def test_soundfile_reads_only_the_kept_frames(tmp_path, monkeypatch):
    calls = []

    def read(path, frames=-1, dtype="float64", always_2d=False):
        calls.append(frames)
        assert frames >= 0, "soundfile asked for the whole file"
        return np.full((frames, 2), 0.25), 48_000

    rates = {"a.flac": 48_000, "forged.flac": 1_000_003}
    fake = SimpleNamespace(
        info=lambda path: SimpleNamespace(samplerate=rates[path.split("/")[-1]]), read=read
    )
    monkeypatch.setitem(sys.modules, "soundfile", fake)
    for name in rates:
        (tmp_path / name).write_bytes(b"fLaC" + bytes(64))
    features = process_audio(tmp_path / "a.flac")
    assert features["input_features"].shape[1] == 2999
    # 30 s at 48 kHz plus the resampling filter's reach past the last output, nothing more.
    assert 30 * 48_000 <= calls[0] <= 30 * 48_000 + 1000
    wave, rate = load_audio(tmp_path / "a.flac", max_frames=123)
    assert calls[-1] == 123 and wave.shape == (123,) and rate == 48_000
    with pytest.raises(ValueError, match="forged.flac.*1000003"):
        process_audio(tmp_path / "forged.flac")
    assert len(calls) == 2  # the forged file was not read


# --- Finding 3: too-short clips ---------------------------------------------------------------------


def reference_minimum() -> int:
    """The fewest samples for which transformers' extractor and processor give an audio token."""
    pytest.importorskip("transformers")
    from transformers.models.gemma4.feature_extraction_gemma4 import Gemma4AudioFeatureExtractor
    from transformers.models.gemma4.processing_gemma4 import Gemma4Processor

    extractor = Gemma4AudioFeatureExtractor()
    tokens = SimpleNamespace(boa_token="<boa>", audio_token="@", eoa_token="<eoa>")

    def has_token(n: int) -> bool:
        masks = extractor([np.zeros(n, np.float32)])["input_features_mask"]
        return Gemma4Processor.replace_audio_token(tokens, {"input_features_mask": masks}, 0).count("@") > 0

    low, high = 1, 1000  # the count grows with the length: bisect for the first length with a token
    assert not has_token(low) and has_token(high)
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (low, middle) if has_token(middle) else (middle, high)
    return high


def test_too_short_clips_are_refused_with_their_index_and_the_minimum(tmp_path):
    # Before: up to 128 samples gave no mel frame and the tower's first convolution failed
    # ("Kernel size can't be greater than actual input size"); 129-160 gave zero audio tokens.
    minimum = reference_minimum()
    short = minimum - 1
    with Measured() as cost, pytest.raises(ValueError) as error:
        process_audio([np.full(16000, 0.1), np.full(short, 0.1)])
    message = str(error.value)
    assert "audio clip 1" in message and f"{short} samples" in message and f"at least {minimum}" in message
    assert cost.peak < 2 * MB
    with pytest.raises(ValueError, match=f"audio clip 0 is too short: 1 samples.*at least {minimum}"):
        process_audio([0.5])
    # At another rate the clip is measured after resampling to 16 kHz.
    at_8k = short // 2  # twice as many at 16 kHz: still short
    with pytest.raises(ValueError, match=rf"{2 * at_8k} samples at 16 kHz \(from {at_8k} at 8000 Hz\)"):
        process_audio(np.full(at_8k, 0.1), sampling_rate=8000)
    path = tmp_path / "blip.wav"
    path.write_bytes(wav_header(16000, 1, 2 * short) + pcm16(np.full((short, 1), 0.1)))
    with pytest.raises(
        ValueError, match=f"audio clip 0 \\(file .*blip.wav'\\) is too short: {short} samples"
    ):
        process_audio(path)
    with pytest.raises(ValueError, match=f"too short: {short} samples"):
        decode_wav(path.read_bytes())

    # The shortest accepted clip gives exactly one token, as in the reference.
    features = process_audio(np.full(minimum, 0.1))
    assert int(features["input_features_mask"][:, ::4].sum()) == 1 == num_audio_tokens(minimum)
    assert num_audio_tokens(short) == 0
