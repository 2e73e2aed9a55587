"""Audio -> log-mel features for the Gemma 4 audio tower.

Matches transformers' ``Gemma4AudioFeatureExtractor`` (5.23): 16 kHz mono, clips truncated to 30 s,
batch right-padded to the longest clip rounded up to 128 samples, 160 zeros prepended ("semicausal"),
frames of 321 samples every 160 (the first 320 used), periodic Hann window, |rfft| with n=512,
HTK mel filter bank (128 filters, 0-8000 Hz, no normalisation), ``log(mel + 1e-3)``, and frames that
reach past the real audio zeroed.

Also reads WAV files (any PCM width, float, mono or multichannel) without extra dependencies,
other formats through the optional ``soundfile`` package, and resamples to 16 kHz.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Sequence
from functools import lru_cache
from numbers import Real
from pathlib import Path

import numpy as np
import torch
from numpy.lib.stride_tricks import sliding_window_view

SAMPLING_RATE = 16_000
# The highest rate audio in common use is recorded at; uploads above it are refused.
MAX_UPLOAD_RATE = 192_000
MAX_SAMPLES = 30 * SAMPLING_RATE  # longer clips are truncated, as in the reference
PAD_MULTIPLE = 128  # batch length is rounded up to a multiple of this many samples
FRAME_LENGTH = 320  # 20 ms
HOP_LENGTH = 160  # 10 ms
FFT_LENGTH = 512
NUM_MEL_BINS = 128
MEL_FLOOR = 1e-3
MAX_AUDIO_TOKENS = 750

AudioInput = str | Path | np.ndarray | torch.Tensor | Sequence[float]


# --- Public API -----------------------------------------------------------------------------------


def process_audio(
    waveforms: AudioInput | Sequence[AudioInput], sampling_rate: int = SAMPLING_RATE
) -> dict[str, torch.Tensor]:
    """Log-mel features for one clip or a batch of clips.

    A clip is a 1-D array / tensor / list of floats at ``sampling_rate`` (resampled to 16 kHz if
    different), or a path to an audio file (read at its own rate, mixed to mono, resampled).
    A 2-D array is a batch of equal-length clips. Returns ``input_features`` (B, T, 128) float32
    and ``input_features_mask`` (B, T) bool (True = frame made of real audio only).
    """
    clips = [_clip_at_16k(clip, sampling_rate, index) for index, clip in enumerate(_split_batch(waveforms))]
    batch, sample_mask = _pad_batch(clips)
    features, frame_mask = _log_mel(batch, sample_mask)
    return {"input_features": torch.from_numpy(features), "input_features_mask": torch.from_numpy(frame_mask)}


def num_audio_tokens(num_samples: int, sampling_rate: int = SAMPLING_RATE) -> int:
    """Number of audio soft tokens a clip of ``num_samples`` samples becomes.

    The encoder subsamples the mel frames by 4, so the count is the number of valid frames at
    indices divisible by 4 (25 tokens per second, at most 750), after resampling to 16 kHz and
    truncation to 30 s.
    """
    if num_samples < 0:
        raise ValueError(f"num_samples must be >= 0, got {num_samples}")
    _check_rate(sampling_rate)
    n = min(_resampled_length(num_samples, sampling_rate, SAMPLING_RATE), MAX_SAMPLES)
    # Frame i is valid when its last sample, i*160 + 320 - 160 (left pad) < n.
    num_valid_frames = max(0, (n - (FRAME_LENGTH + 1 - FRAME_LENGTH // 2)) // HOP_LENGTH + 1)
    return min(-(-num_valid_frames // 4), MAX_AUDIO_TOKENS)


# --- Inputs -> list of float32 clips at 16 kHz --------------------------------------------------------


def _split_batch(waveforms: AudioInput | Sequence[AudioInput]) -> list[AudioInput]:
    if isinstance(waveforms, (str, Path)):
        return [waveforms]
    if isinstance(waveforms, (np.ndarray, torch.Tensor)):
        if waveforms.ndim == 2:  # (batch, samples), as in the reference
            return list(waveforms)
        return [waveforms]
    if isinstance(waveforms, Sequence):
        if len(waveforms) == 0:
            raise ValueError("process_audio needs at least one clip (got an empty list)")
        if all(isinstance(x, Real) for x in waveforms):
            return [waveforms]  # one clip given as a list of numbers
        return list(waveforms)
    raise TypeError(f"unsupported audio input type {type(waveforms).__name__}")


def _clip_at_16k(clip: AudioInput, sampling_rate: int, index: int) -> np.ndarray:
    if isinstance(clip, (str, Path)):
        wave, rate = load_audio(clip)
        name = f"audio file {str(clip)!r}"
    else:
        _check_rate(sampling_rate)
        wave, rate, name = _as_1d_array(clip, index), sampling_rate, f"audio clip {index}"
    if wave.size == 0:
        raise ValueError(f"{name} is empty")
    if not np.isfinite(wave).all():
        raise ValueError(f"{name} contains NaN or infinite samples")
    if rate != SAMPLING_RATE:
        # Only the first 30 s are kept anyway: resample just those.
        wave = resample(wave, rate, SAMPLING_RATE, max_samples=MAX_SAMPLES)
    # The reference computes in float32 (a float64 input is cast down before framing).
    return wave.astype(np.float32)


def _as_1d_array(clip: AudioInput, index: int) -> np.ndarray:
    if isinstance(clip, torch.Tensor):
        clip = clip.detach().cpu()
        clip = (clip.float() if clip.dtype in (torch.bfloat16, torch.float16) else clip).numpy()
    array = np.asarray(clip)
    if array.ndim != 1:
        raise ValueError(f"audio clip {index} must be 1-D (samples), got shape {array.shape}")
    if not (np.issubdtype(array.dtype, np.floating) or np.issubdtype(array.dtype, np.integer)):
        raise ValueError(f"audio clip {index} must hold real numbers, got dtype {array.dtype}")
    return array


def _check_rate(sampling_rate: int) -> None:
    if not isinstance(sampling_rate, (int, np.integer)) or sampling_rate <= 0:
        raise ValueError(f"sampling_rate must be a positive integer (Hz), got {sampling_rate!r}")


# --- Log-mel features -----------------------------------------------------------------------------


def _pad_batch(clips: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """Truncate to 30 s, right-pad with zeros to the longest clip rounded up to 128 samples."""
    clips = [clip[:MAX_SAMPLES] for clip in clips]
    length = -(-max(len(clip) for clip in clips) // PAD_MULTIPLE) * PAD_MULTIPLE
    batch = np.zeros((len(clips), length), dtype=np.float32)
    sample_mask = np.zeros((len(clips), length), dtype=bool)
    for i, clip in enumerate(clips):
        batch[i, : len(clip)] = clip
        sample_mask[i, : len(clip)] = True
    return batch, sample_mask


def _log_mel(batch: np.ndarray, sample_mask: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(B, N) float32 samples -> features (B, T, 128) float32 and frame mask (B, T) bool."""
    # Semicausal padding: the first frame is centred on the first sample.
    pad = FRAME_LENGTH // 2
    batch = np.pad(batch, ((0, 0), (pad, 0)))
    sample_mask = np.pad(sample_mask, ((0, 0), (pad, 0)))
    window_size = FRAME_LENGTH + 1  # the reference frames 321 samples and uses the first 320
    num_frames = max(0, (batch.shape[1] - window_size) // HOP_LENGTH + 1)
    if num_frames == 0:  # under ~10 ms of audio: no complete frame, as in the reference
        return np.zeros((len(batch), 0, NUM_MEL_BINS), np.float32), np.zeros((len(batch), 0), bool)
    frames = sliding_window_view(batch, window_size, axis=-1)[:, ::HOP_LENGTH][:, :num_frames, :FRAME_LENGTH]

    # float32 window product and float32 FFT, as numpy does in the reference; the filter bank
    # product and the log run in float64, as there.
    spectrum = np.abs(np.fft.rfft(frames * _hann_window(), n=FFT_LENGTH, axis=-1))  # (B, T, 257)
    log_mel = np.log(np.matmul(spectrum, _mel_filter_bank()) + MEL_FLOOR).astype(np.float32)

    # A frame is valid only if its last sample is real audio.
    frame_mask = sample_mask[:, window_size - 1 :: HOP_LENGTH][:, :num_frames]
    return log_mel * frame_mask[..., None], frame_mask


@lru_cache(maxsize=1)
def _hann_window() -> np.ndarray:
    """Periodic Hann window of 320 samples, computed in float64 and stored as float32."""
    n = np.arange(FRAME_LENGTH)
    return (0.5 - 0.5 * np.cos(2 * np.pi * n / FRAME_LENGTH)).astype(np.float32)


@lru_cache(maxsize=1)
def _mel_filter_bank() -> np.ndarray:
    """(257, 128) triangular filters, HTK mel scale, 0-8000 Hz, peak 1 (no area normalisation)."""
    max_mel = 2595.0 * np.log10(1.0 + (SAMPLING_RATE / 2) / 700.0)
    edges_hz = 700.0 * (10.0 ** (np.linspace(0.0, max_mel, NUM_MEL_BINS + 2) / 2595.0) - 1.0)
    lower, center, upper = edges_hz[:-2], edges_hz[1:-1], edges_hz[2:]
    bin_hz = np.linspace(0, SAMPLING_RATE // 2, FFT_LENGTH // 2 + 1)[:, None]
    rising = (bin_hz - lower) / (center - lower)
    falling = (upper - bin_hz) / (upper - center)
    return np.maximum(0.0, np.minimum(rising, falling))


# --- Resampling -----------------------------------------------------------------------------------

# Kaiser-windowed sinc. Measured (44.1/48/22.05/32 kHz -> 16 kHz): sine error <= 2e-5 of full scale
# up to 7 kHz (-0.0002 dB), -6 dB at 0.95 * 8 kHz, aliases above 8.2 kHz attenuated by >= 93 dB.
RESAMPLE_ZERO_CROSSINGS = 48  # per side; sets the transition width
RESAMPLE_ROLLOFF = 0.95  # cutoff as a fraction of the lower Nyquist frequency
RESAMPLE_KAISER_BETA = 8.6  # sets the stopband attenuation


def resample(
    wave: np.ndarray, orig_rate: int, target_rate: int, max_samples: int | None = None
) -> np.ndarray:
    """Band-limited resampling of a 1-D signal (polyphase windowed sinc, zeros outside the signal).

    The output has ``ceil(len * target_rate / orig_rate)`` samples (at most ``max_samples``),
    output sample n sits at input time ``n * orig_rate / target_rate``.
    """
    _check_rate(orig_rate)
    _check_rate(target_rate)
    wave = np.asarray(wave, dtype=np.float64)
    if orig_rate == target_rate:
        return wave[:max_samples].copy()
    g = math.gcd(orig_rate, target_rate)
    up, down = target_rate // g, orig_rate // g
    num_out = _resampled_length(len(wave), orig_rate, target_rate)
    if max_samples is not None:
        num_out = min(num_out, max_samples)

    taps, half = _sinc_table(up, down)  # (up, 2*half + 1): one filter per output phase
    last_input = (num_out - 1) * down // up + half + 1  # inputs past this are never used
    padded = np.concatenate([np.zeros(half), wave[:last_input], np.zeros(half + 1)])
    windows = sliding_window_view(padded, 2 * half + 1)  # windows[b] = wave[b - half : b + half + 1]
    out = np.empty(num_out)
    chunk = 8192  # bounds the temporary (chunk, taps) copy
    # Outputs n, n + up, n + 2*up, ... share one filter phase and step `down` inputs at a time.
    for first in range(min(up, num_out)):
        phase, base = (first * down) % up, (first * down) // up
        count = len(range(first, num_out, up))
        rows = windows[base::down][:count]
        for start in range(0, count, chunk):
            stop = min(start + chunk, count)
            out[first + start * up : first + stop * up : up] = rows[start:stop] @ taps[phase]
    return out


def _resampled_length(num_samples: int, orig_rate: int, target_rate: int) -> int:
    g = math.gcd(orig_rate, target_rate)
    return -(-num_samples * (target_rate // g) // (orig_rate // g))


@lru_cache(maxsize=8)
def _sinc_table(up: int, down: int) -> tuple[np.ndarray, int]:
    cutoff = RESAMPLE_ROLLOFF * min(1.0, up / down)  # in units of the input Nyquist frequency
    half_width = RESAMPLE_ZERO_CROSSINGS / cutoff  # filter half-length in input samples
    half = math.ceil(half_width)
    # Output phase p sits p/up input samples after its base input; tap i reads input base - half + i.
    offset = np.arange(up)[:, None] / up + half - np.arange(2 * half + 1)[None, :]
    ratio = np.clip(offset / half_width, -1.0, 1.0)
    kaiser = np.i0(RESAMPLE_KAISER_BETA * np.sqrt(1.0 - ratio**2)) / np.i0(RESAMPLE_KAISER_BETA)
    taps = cutoff * np.sinc(cutoff * offset) * kaiser * (np.abs(offset) <= half_width)
    taps /= taps.sum(axis=1, keepdims=True)  # unit DC gain for every phase
    return taps, half


# --- Reading files --------------------------------------------------------------------------------

_WAVE_FORMAT_PCM = 1
_WAVE_FORMAT_IEEE_FLOAT = 3
_WAVE_FORMAT_EXTENSIBLE = 0xFFFE


def load_audio(path: str | Path) -> tuple[np.ndarray, int]:
    """Read an audio file as mono float64 in [-1, 1] and its sampling rate.

    WAV is parsed here (8/16/24/32-bit PCM, 32/64-bit float, extensible headers; channels averaged).
    FLAC, OGG and MP3 need the optional ``soundfile`` package.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"audio file not found: {str(path)!r}")
    data = path.read_bytes()
    if data[:4] == b"RIFF" and data[8:12] == b"WAVE":
        try:
            return _parse_wav(data)
        except (ValueError, struct.error) as error:
            raise ValueError(f"cannot read WAV file {str(path)!r}: {error}") from error
    mpeg_frame = len(data) > 1 and data[0] == 0xFF and data[1] & 0xE0 == 0xE0
    if data[:4] in (b"fLaC", b"OggS") or data[:3] == b"ID3" or mpeg_frame:
        return _read_with_soundfile(path)
    raise ValueError(f"unsupported audio file {str(path)!r}: not WAV, FLAC, OGG or MP3")


def decode_wav(data: bytes) -> np.ndarray:
    """WAV file bytes (e.g. an upload) -> mono float64 samples at 16 kHz, ready for ``process_audio``."""
    if data[:4] != b"RIFF" or data[8:12] != b"WAVE":
        raise ValueError("not a WAV file (no RIFF/WAVE header)")
    try:
        wave, rate = _parse_wav(data)
    except (ValueError, struct.error) as error:
        raise ValueError(f"cannot read WAV data: {error}") from error
    if rate > MAX_UPLOAD_RATE:
        # The resampler's filter table grows with the rate ratio: a forged header must not cost gigabytes.
        raise ValueError(f"WAV sampling rate {rate} Hz is above the {MAX_UPLOAD_RATE} Hz this accepts")
    return wave if rate == SAMPLING_RATE else resample(wave, rate, SAMPLING_RATE)


def _parse_wav(data: bytes) -> tuple[np.ndarray, int]:
    fmt, samples = None, None
    offset = 12
    while offset + 8 <= len(data):
        chunk_id, size = struct.unpack_from("<4sI", data, offset)
        body = data[offset + 8 : offset + 8 + size]  # a streamed file may claim more than it holds
        if chunk_id == b"fmt ":
            fmt = body
        elif chunk_id == b"data":
            samples = body
        offset += 8 + size + (size & 1)  # chunks are word-aligned
    if fmt is None or samples is None:
        raise ValueError("missing 'fmt ' or 'data' chunk")
    tag, channels, rate, _, block_align, bits = struct.unpack_from("<HHIIHH", fmt)
    if tag == _WAVE_FORMAT_EXTENSIBLE and len(fmt) >= 26:
        tag = struct.unpack_from("<H", fmt, 24)[0]  # first two bytes of the sub-format GUID
    if channels == 0 or rate == 0 or block_align == 0:
        raise ValueError(f"invalid header ({channels} channels, {rate} Hz)")
    width = block_align // channels
    samples = samples[: len(samples) - len(samples) % block_align]
    wave = _decode_samples(samples, tag, width, bits)
    return wave.reshape(-1, channels).mean(axis=1), rate


def _decode_samples(raw: bytes, tag: int, width: int, bits: int) -> np.ndarray:
    """Interleaved little-endian samples -> float64 in [-1, 1]."""
    if tag == _WAVE_FORMAT_PCM:
        if width == 1:  # 8-bit WAV is unsigned
            return (np.frombuffer(raw, np.uint8).astype(np.float64) - 128.0) / 128.0
        if width in (2, 4):
            ints = np.frombuffer(raw, f"<i{width}")
        elif width == 3:
            b = np.frombuffer(raw, np.uint8).reshape(-1, 3).astype(np.int32)
            ints = (b[:, 0] | (b[:, 1] << 8) | (b[:, 2] << 16)) << 8 >> 8  # sign-extend 24 bits
        else:
            raise ValueError(f"unsupported PCM sample width of {width} bytes")
        return ints.astype(np.float64) / float(2 ** (8 * width - 1))
    if tag == _WAVE_FORMAT_IEEE_FLOAT and width in (4, 8):
        return np.frombuffer(raw, f"<f{width}").astype(np.float64)
    raise ValueError(f"unsupported WAV encoding (format tag {tag:#x}, {bits} bits)")


def _read_with_soundfile(path: Path) -> tuple[np.ndarray, int]:
    try:
        import soundfile
    except ImportError as error:
        raise ImportError(
            f"reading {path.suffix or 'this'} audio ({str(path)!r}) needs the optional package soundfile: "
            "pip install soundfile (or convert the file to WAV)"
        ) from error
    try:
        wave, rate = soundfile.read(str(path), dtype="float64", always_2d=True)
    except Exception as error:  # soundfile raises its own LibsndfileError / RuntimeError types
        raise ValueError(f"cannot read audio file {str(path)!r}: {error}") from error
    return wave.mean(axis=1), int(rate)
