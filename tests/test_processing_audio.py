"""Audio preprocessing against transformers' Gemma4AudioFeatureExtractor, plus WAV reading and resampling."""

from __future__ import annotations

import struct
import sys
import wave
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from torchgemma.processing import num_audio_tokens, process_audio
from torchgemma.processing.audio import _hann_window, _mel_filter_bank, load_audio, resample

transformers = pytest.importorskip("transformers")
from transformers.models.gemma4.feature_extraction_gemma4 import Gemma4AudioFeatureExtractor  # noqa: E402
from transformers.models.gemma4.processing_gemma4 import Gemma4Processor  # noqa: E402

TOLERANCE = 1e-5  # the contract is 1e-4; the float32 pipeline mirrors the reference (0 in practice)


@pytest.fixture(scope="module")
def reference():
    return Gemma4AudioFeatureExtractor()


def speech_like(num_samples: int, seed: int = 0) -> np.ndarray:
    """Tones, noise and a stretch of silence, with loudness varying over time."""
    rng = np.random.default_rng(seed)
    t = np.arange(num_samples) / 16000
    x = 0.3 * np.sin(2 * np.pi * 220 * t) * (1 + np.sin(2 * np.pi * 3 * t)) + 0.05 * rng.standard_normal(
        num_samples
    )
    x[num_samples // 3 : num_samples // 2] *= 1e-4
    return x


def assert_matches(ours: dict, ref) -> float:
    features = np.asarray(ref["input_features"])
    assert ours["input_features"].shape == features.shape
    assert ours["input_features"].dtype == torch.float32
    assert torch.equal(ours["input_features_mask"], torch.from_numpy(np.asarray(ref["input_features_mask"])))
    diff = float(np.abs(ours["input_features"].numpy() - features).max()) if features.size else 0.0
    assert diff <= TOLERANCE
    return diff


def test_window_and_filter_bank_equal_reference(reference):
    assert np.array_equal(_hann_window(), reference.window)
    assert np.array_equal(_mel_filter_bank(), reference.mel_filters)


# From 161 samples, the shortest clip with an audio token (shorter ones: test_audio_limits.py).
LENGTHS = [161, 200, 320, 321, 481, 1000, 4000, 16000, 38560, 99360, 480000, 480001, 520000]


def test_single_clips_of_many_lengths(reference):
    for length in LENGTHS:
        clip = speech_like(length, seed=length)
        assert_matches(process_audio(clip), reference([clip], return_tensors="np"))


def test_batch_of_different_lengths(reference):
    clips = [speech_like(n, seed=n).astype(np.float32) for n in (16000, 3000, 48123, 200, 500000)]
    ours = process_audio(clips)
    assert_matches(ours, reference(clips, return_tensors="np"))
    assert ours["input_features"].shape == (5, 2999, 128)  # 30 s cap, padded to the longest


def test_input_forms_give_the_same_features(reference):
    clip = speech_like(5000, seed=3)
    expected = process_audio(clip)
    for form in (clip.tolist(), torch.from_numpy(clip), clip.astype(np.float32), [clip]):
        got = process_audio(form)
        assert torch.equal(got["input_features"], expected["input_features"])
    batch = np.stack([clip, clip[::-1].copy()])  # a 2-D array is a batch, as in the reference
    assert_matches(process_audio(batch), reference(batch, return_tensors="np"))
    assert_matches(process_audio(torch.from_numpy(batch)), reference(batch, return_tensors="np"))


# --- Token counts -------------------------------------------------------------------------------------


def test_token_count_goldens():
    # transformers tests/models/gemma4/test_processing_gemma4.py
    for samples, tokens in [(38560, 60), (48000, 75), (48800, 76), (99360, 155), (640000, 750)]:
        assert num_audio_tokens(samples) == tokens


def test_token_count_matches_the_reference_processor(reference):
    # The processor expands <|audio|> from the extractor's frame mask (replace_audio_token).
    tokens = SimpleNamespace(boa_token="<boa>", audio_token="@", eoa_token="<eoa>")
    lengths = [1, 160, 161, 320, 481, 641, 642, 801, 1000, 16000, 16001, 479_999, 480_000, 600_000]
    lengths += [int(n) for n in np.random.default_rng(4).integers(1, 50_000, 12)]
    for n in lengths:
        masks = reference([np.zeros(n, np.float32)])["input_features_mask"]
        expansion = Gemma4Processor.replace_audio_token(tokens, {"input_features_mask": masks}, 0)
        assert num_audio_tokens(n) == expansion.count("@"), n
    assert num_audio_tokens(0) == 0
    assert num_audio_tokens(44100, sampling_rate=44100) == num_audio_tokens(16000) == 25


# --- Files --------------------------------------------------------------------------------------------


def write_pcm_wav(path, samples: np.ndarray, rate: int, width: int) -> None:
    """samples: (n, channels) integers already in the sample width's range (unsigned for 8-bit)."""
    with wave.open(str(path), "wb") as f:
        f.setnchannels(samples.shape[1])
        f.setsampwidth(width)
        f.setframerate(rate)
        if width == 3:
            raw = samples.astype("<i4").tobytes()
            f.writeframes(b"".join(raw[i : i + 3] for i in range(0, len(raw), 4)))
        else:
            f.writeframes(samples.astype({1: "u1", 2: "<i2", 4: "<i4"}[width]).tobytes())


def write_float_wav(path, samples: np.ndarray, rate: int, extensible: bool = False) -> None:
    data = samples.astype("<f4").tobytes()
    channels = samples.shape[1]
    if extensible:  # WAVE_FORMAT_EXTENSIBLE with the IEEE-float sub-format GUID
        guid = struct.pack("<H", 3) + b"\x00\x00\x00\x00\x10\x00\x80\x00\x00\xaa\x00\x38\x9b\x71"
        fmt = struct.pack(
            "<HHIIHHHHI", 0xFFFE, channels, rate, rate * 4 * channels, 4 * channels, 32, 22, 32, 0
        )
        fmt += guid
    else:
        fmt = struct.pack("<HHIIHH", 3, channels, rate, rate * 4 * channels, 4 * channels, 32)
    body = (
        b"WAVE" + b"fmt " + struct.pack("<I", len(fmt)) + fmt + b"data" + struct.pack("<I", len(data)) + data
    )
    path.write_bytes(b"RIFF" + struct.pack("<I", len(body)) + body)


@pytest.mark.parametrize("width", [1, 2, 3, 4])
def test_pcm_wav_files(reference, tmp_path, width):
    rng = np.random.default_rng(width)
    full_scale = 2 ** (8 * width - 1)
    ints = rng.integers(-full_scale, full_scale, (3000, 2))
    stored = ints + 128 if width == 1 else ints
    write_pcm_wav(tmp_path / "a.wav", stored, 16000, width)
    decoded, rate = load_audio(tmp_path / "a.wav")
    assert rate == 16000
    np.testing.assert_allclose(decoded, ints.mean(axis=1) / full_scale, rtol=0, atol=1e-12)  # stereo averaged
    ours = process_audio(tmp_path / "a.wav")
    assert_matches(ours, reference([decoded], return_tensors="np"))


def test_float_wav_files(tmp_path):
    samples = speech_like(4000, seed=7)[:, None].astype(np.float32)
    for extensible in (False, True):
        path = tmp_path / f"f{int(extensible)}.wav"
        write_float_wav(path, samples, 16000, extensible=extensible)
        decoded, rate = load_audio(str(path))
        assert rate == 16000 and np.array_equal(decoded, samples[:, 0].astype(np.float64))


def test_files_and_arrays_at_other_rates_are_resampled(tmp_path):
    clip = speech_like(8000, seed=8) * 0.5
    write_pcm_wav(tmp_path / "8k.wav", np.round(clip * 32767)[:, None], 8000, 2)
    decoded, _ = load_audio(tmp_path / "8k.wav")
    from_file = process_audio([tmp_path / "8k.wav", clip])  # a file and an array in one batch
    expected = process_audio([resample(decoded, 8000, 16000), resample(clip, 8000, 16000)])
    assert torch.equal(from_file["input_features"][0], expected["input_features"][0])
    from_array = process_audio(clip, sampling_rate=8000)
    assert torch.equal(from_array["input_features"][0], expected["input_features"][1])
    assert from_array["input_features_mask"].shape == (1, 99)  # 1 s at 16 kHz


# --- Resampler quality ----------------------------------------------------------------------------------


# 15999, 44101 and 191999 Hz have too many phases for an exact table: interpolated filters.
@pytest.mark.parametrize("rate", [8000, 15999, 22050, 44100, 44101, 48000, 191999])
def test_resampler_reproduces_in_band_tones(rate):
    t = np.arange(rate) / rate
    for freq in (100.0, 1000.0, 3500.0) + ((7000.0,) if rate > 16000 else ()):
        out = resample(np.sin(2 * np.pi * freq * t + 0.3), rate, 16000)
        assert len(out) == 16000
        expected = np.sin(2 * np.pi * freq * np.arange(16000) / 16000 + 0.3)
        assert np.abs(out - expected)[300:-300].max() < 1e-4, freq  # edges see the zero padding


@pytest.mark.parametrize("rate", [22050, 44100, 44101, 48000, 191999])
def test_resampler_rejects_aliases(rate):
    t = np.arange(rate // 2) / rate
    for freq in (8300.0, 9000.0, 10000.0, 0.45 * rate):
        out = resample(np.sin(2 * np.pi * freq * t), rate, 16000)
        assert np.abs(out[300:-300]).max() < 10 ** (-80 / 20), freq  # at least 80 dB down


def test_resampler_lengths_and_identity():
    x = np.random.default_rng(9).standard_normal(1001)
    assert len(resample(x, 44100, 16000)) == -(-1001 * 160 // 441)
    assert len(resample(x, 44100, 16000, max_samples=100)) == 100
    # Only the first outputs are computed, from the same inputs (BLAS may sum in another order).
    np.testing.assert_allclose(
        resample(x, 44100, 16000, max_samples=100), resample(x, 44100, 16000)[:100], atol=1e-12
    )
    assert np.array_equal(resample(x, 16000, 16000), x)


# --- Errors -------------------------------------------------------------------------------------------


def test_bad_arrays():
    with pytest.raises(ValueError, match="empty"):
        process_audio(np.zeros(0))
    with pytest.raises(ValueError, match="clip 1 is empty"):
        process_audio([np.zeros(1000), []])
    with pytest.raises(ValueError, match="at least one"):
        process_audio([])
    with pytest.raises(ValueError, match="NaN"):
        process_audio(np.array([0.0, np.nan, 0.1]))
    with pytest.raises(ValueError, match="NaN"):
        process_audio([np.array([0.0, np.inf])])
    with pytest.raises(ValueError, match="1-D"):
        process_audio([np.zeros((2, 100))])
    with pytest.raises(ValueError, match="sampling_rate"):
        process_audio(np.zeros(100), sampling_rate=0)
    with pytest.raises(ValueError, match="real numbers"):
        process_audio([np.array(["a", "b"])])


def test_bad_files(tmp_path, monkeypatch):
    with pytest.raises(FileNotFoundError, match="nothere.wav"):
        process_audio(tmp_path / "nothere.wav")
    text = tmp_path / "notes.wav"
    text.write_text("just some text")
    with pytest.raises(ValueError, match="notes.wav"):
        process_audio(str(text))
    broken = tmp_path / "broken.wav"
    broken.write_bytes(b"RIFF\x10\x00\x00\x00WAVEfmt \x02\x00\x00\x00\x01\x00")
    with pytest.raises(ValueError, match="broken.wav"):
        process_audio(broken)
    empty = tmp_path / "empty.wav"
    write_pcm_wav(empty, np.zeros((0, 1), np.int16), 16000, 2)
    with pytest.raises(ValueError, match="empty.wav.*empty"):
        process_audio(empty)
    mulaw = tmp_path / "mulaw.wav"
    fmt = struct.pack("<HHIIHH", 7, 1, 8000, 8000, 1, 8)
    mulaw.write_bytes(
        b"RIFF"
        + struct.pack("<I", 36 + 4)
        + b"WAVEfmt "
        + struct.pack("<I", 16)
        + fmt
        + b"data\x04\x00\x00\x00abcd"
    )
    with pytest.raises(ValueError, match="mulaw.wav.*format tag 0x7"):
        process_audio(mulaw)
    flac = tmp_path / "clip.flac"
    flac.write_bytes(b"fLaC" + bytes(64))
    monkeypatch.setitem(sys.modules, "soundfile", None)  # as if the optional package were missing
    with pytest.raises(ImportError, match="pip install soundfile"):
        process_audio(flac)


def test_compressed_files_with_soundfile(tmp_path):
    soundfile = pytest.importorskip("soundfile")
    clip = (np.round(speech_like(3000, seed=10) * 32767) / 32768)[:, None]
    soundfile.write(str(tmp_path / "a.flac"), np.repeat(clip, 2, axis=1), 22050, subtype="PCM_16")
    decoded, rate = load_audio(tmp_path / "a.flac")
    assert rate == 22050
    np.testing.assert_allclose(decoded, clip[:, 0], atol=1e-9)
    expected = process_audio(clip[:, 0], sampling_rate=22050)
    assert torch.equal(process_audio(tmp_path / "a.flac")["input_features"], expected["input_features"])
