"""Audio -> log-mel features for the Gemma 4 audio tower.

Matches transformers' ``Gemma4AudioFeatureExtractor`` (5.23): 16 kHz mono, clips truncated to 30 s,
batch right-padded to the longest clip rounded up to 128 samples, 160 zeros prepended ("semicausal"),
frames of 321 samples every 160 (the first 320 used), periodic Hann window, |rfft| with n=512,
HTK mel filter bank (128 filters, 0-8000 Hz, no normalisation), ``log(mel + 1e-3)``, and frames that
reach past the real audio zeroed.

Also reads WAV files (any PCM width, float, mono or multichannel) without extra dependencies,
other formats through the optional ``soundfile`` package, and resamples to 16 kHz.

Hostile input stays cheap: every entry point accepts rates from 1 Hz to 384 kHz only, reads and
converts only the samples the first 30 s need (from a file, bytes or an array), resamples in
bounded memory, and refuses clips too short to give one audio token.
"""

from __future__ import annotations

import io
import math
import struct
from collections.abc import Callable, Sequence
from functools import lru_cache
from numbers import Real
from pathlib import Path
from typing import BinaryIO

import numpy as np
import torch
from numpy.lib.stride_tricks import sliding_window_view

SAMPLING_RATE = 16_000
# Arrays, files, uploads and ``resample`` all accept 1 Hz to this (hi-res masters, the highest rate
# in common use). It bounds what reading 30 s costs: a forged header above it is refused, not read.
MAX_SAMPLING_RATE = 384_000
MAX_SAMPLES = 30 * SAMPLING_RATE  # longer clips are truncated, as in the reference
PAD_MULTIPLE = 128  # batch length is rounded up to a multiple of this many samples
FRAME_LENGTH = 320  # 20 ms
HOP_LENGTH = 160  # 10 ms
# The first frame (321 samples, the first 160 of them left padding) ends on clip sample 160: a
# shorter clip has no valid frame, hence no audio token (and under 129 samples no frame at all,
# on which the tower's first convolution fails).
MIN_SAMPLES = FRAME_LENGTH // 2 + 1
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

    Only the first 30 s of each clip are kept (as in the reference), so only the samples they need
    are read from a file or converted from an array. Rates must be 1 Hz to ``MAX_SAMPLING_RATE``;
    a clip under ``MIN_SAMPLES`` (161) samples at 16 kHz, about 10 ms, gives no audio token and
    is refused with an error naming it.
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
    num_valid_frames = max(0, (n - MIN_SAMPLES) // HOP_LENGTH + 1)
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
        wave, rate = _load_audio(clip, _frames_kept)
        name = f"audio clip {index} (file {str(clip)!r})"
    else:
        _check_rate(sampling_rate)
        wave, rate = _as_1d_array(clip, index, _frames_kept(sampling_rate)), sampling_rate
        name = f"audio clip {index}"
    if wave.size == 0:
        raise ValueError(f"{name} is empty")
    if not np.isfinite(wave).all():
        raise ValueError(f"{name} contains NaN or infinite samples")
    num_samples = len(wave)
    if rate != SAMPLING_RATE:
        # Only the first 30 s are kept anyway: resample just those.
        wave = resample(wave, rate, SAMPLING_RATE, max_samples=MAX_SAMPLES)
    _check_long_enough(name, len(wave), num_samples, rate)
    # The reference computes in float32 (a float64 input is cast down before framing).
    return wave.astype(np.float32)


def _frames_kept(rate: int) -> int:
    """Samples at ``rate`` that the first 30 s at 16 kHz are made from (later ones are never read)."""
    return _input_length_needed(MAX_SAMPLES, rate, SAMPLING_RATE)


def _as_1d_array(clip: AudioInput, index: int, max_length: int) -> np.ndarray:
    if isinstance(clip, torch.Tensor):
        clip = clip.detach()
        if clip.ndim == 1:
            clip = clip[:max_length]  # copy and convert only the kept samples
        clip = clip.cpu()
        clip = (clip.float() if clip.dtype in (torch.bfloat16, torch.float16) else clip).numpy()
    array = np.asarray(clip)
    if array.ndim != 1:
        raise ValueError(f"audio clip {index} must be 1-D (samples), got shape {array.shape}")
    if not (np.issubdtype(array.dtype, np.floating) or np.issubdtype(array.dtype, np.integer)):
        raise ValueError(f"audio clip {index} must hold real numbers, got dtype {array.dtype}")
    return array[:max_length]


def _check_rate(sampling_rate: int, what: str = "sampling_rate") -> None:
    if not isinstance(sampling_rate, (int, np.integer)) or not 1 <= sampling_rate <= MAX_SAMPLING_RATE:
        raise ValueError(f"{what} must be an integer from 1 to {MAX_SAMPLING_RATE} Hz, got {sampling_rate!r}")


def _check_long_enough(name: str, num_samples: int, original_samples: int, rate: int) -> None:
    """``num_samples`` at 16 kHz, from ``original_samples`` at ``rate``."""
    if num_samples < MIN_SAMPLES:
        source = "" if rate == SAMPLING_RATE else f" (from {original_samples} at {rate} Hz)"
        raise ValueError(
            f"{name} is too short: {num_samples} samples at 16 kHz{source}; the audio encoder needs at "
            f"least {MIN_SAMPLES} (about 10 ms) to make one audio token"
        )


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
# The filter spans ~101 * down / up input samples, so downsampling by at most 24 (384 kHz -> 16 kHz)
# keeps it under 2,430 taps.
MAX_DOWNSAMPLING = MAX_SAMPLING_RATE // SAMPLING_RATE
# Coefficients (8 bytes each) in one filter table, and in one chunk of gathered inputs.
RESAMPLE_TABLE_SIZE = 1 << 18


def resample(
    wave: np.ndarray, orig_rate: int, target_rate: int, max_samples: int | None = None
) -> np.ndarray:
    """Band-limited resampling of a 1-D signal (polyphase windowed sinc, zeros outside the signal).

    The output has ``ceil(len * target_rate / orig_rate)`` samples (at most ``max_samples``),
    output sample n sits at input time ``n * orig_rate / target_rate``. Only the inputs those
    outputs read are converted to float64.

    Both rates must be integers from 1 Hz to ``MAX_SAMPLING_RATE`` (384 kHz), and ``orig_rate`` at
    most ``MAX_DOWNSAMPLING`` (24) times ``target_rate``. Memory beyond the input and the output
    stays within a few ``RESAMPLE_TABLE_SIZE`` tables (2 MiB each) whatever the ratio: when the
    gcd-reduced ratio up/down has so many phases that one exact filter per phase would not fit in
    one table (uncommon rates such as 44,101 Hz), the filter is interpolated linearly between
    phases spaced at most 1/100 of an input sample apart, within 1e-6 of the exact filter's output.
    Common rates (8 to 384 kHz, 44.1 kHz family included) use exact tables, cached. Time is about
    100 multiply-adds per input sample when downsampling, per output sample when upsampling.
    """
    _check_rate(orig_rate, "orig_rate")
    _check_rate(target_rate, "target_rate")
    if orig_rate > MAX_DOWNSAMPLING * target_rate:
        raise ValueError(
            f"cannot resample {orig_rate} Hz to {target_rate} Hz: downsampling by more than "
            f"{MAX_DOWNSAMPLING} is not supported"
        )
    wave = np.asarray(wave)
    num_out = _resampled_length(len(wave), orig_rate, target_rate)
    if max_samples is not None:
        num_out = max(0, min(num_out, max_samples))
    wave = wave[: _input_length_needed(num_out, orig_rate, target_rate)]  # the rest is never read
    if orig_rate == target_rate:
        return wave.astype(np.float64)
    up, down = _reduced_ratio(orig_rate, target_rate)
    half = _filter_size(up, down)[2]
    padded = np.zeros(half + len(wave) + half + 1)
    padded[half : half + len(wave)] = wave  # the one float64 copy of the inputs
    windows = sliding_window_view(padded, 2 * half + 1)  # windows[b] = wave[b - half : b + half + 1]
    if up * (2 * half + 1) <= RESAMPLE_TABLE_SIZE:
        return _resample_exact(windows, up, down, num_out)
    return _resample_interpolated(windows, up, down, num_out)


def _resample_exact(windows: np.ndarray, up: int, down: int, num_out: int) -> np.ndarray:
    """One exact filter per output phase (the table has up rows)."""
    taps = _phase_filters(up, down)  # (up, 2*half + 1)
    out = np.empty(num_out)
    chunk = min(8192, RESAMPLE_TABLE_SIZE // taps.shape[1])  # bounds the (chunk, taps) rows read at once
    # Outputs n, n + up, n + 2*up, ... share one filter phase and step `down` inputs at a time.
    for first in range(min(up, num_out)):
        phase, base = (first * down) % up, (first * down) // up
        count = len(range(first, num_out, up))
        rows = windows[base::down][:count]
        for start in range(0, count, chunk):
            stop = min(start + chunk, count)
            out[first + start * up : first + stop * up : up] = rows[start:stop] @ taps[phase]
    return out


def _resample_interpolated(windows: np.ndarray, up: int, down: int, num_out: int) -> np.ndarray:
    """Filters for phases 0, 1/P, ..., 1 of an input sample, linearly interpolated in between.

    The table holds RESAMPLE_TABLE_SIZE coefficients whatever up/down is: P >= 100 phases (the
    filter has at most ~2,430 taps), so interpolation errors are ~(pi * cutoff / P)^2 / 8 < 2e-7.
    """
    num_taps = windows.shape[1]
    phases = RESAMPLE_TABLE_SIZE // num_taps - 1
    table = _filters_at(np.arange(phases + 1) / phases, up, down)  # (P + 1, taps), not cached
    slope = np.diff(table, axis=0)  # (P, taps)
    out = np.empty(num_out)
    chunk = RESAMPLE_TABLE_SIZE // num_taps
    for start in range(0, num_out, chunk):
        n = np.arange(start, min(start + chunk, num_out), dtype=np.int64)
        base, remainder = np.divmod(n * down, up)  # output n sits at input base + remainder / up
        row, part = np.divmod(remainder * phases, up)  # between table rows row and row + 1
        inputs = windows[base][:, None, :]  # (chunk, 1, taps)
        at_row = (inputs @ table[row][..., None])[:, 0, 0]  # row-by-row dot products
        out[start : start + len(n)] = at_row + part / up * (inputs @ slope[row][..., None])[:, 0, 0]
    return out


def _reduced_ratio(orig_rate: int, target_rate: int) -> tuple[int, int]:
    g = math.gcd(orig_rate, target_rate)
    return target_rate // g, orig_rate // g


def _resampled_length(num_samples: int, orig_rate: int, target_rate: int) -> int:
    up, down = _reduced_ratio(orig_rate, target_rate)
    return -(-num_samples * up // down)


def _input_length_needed(num_out: int, orig_rate: int, target_rate: int) -> int:
    """How many input samples the first ``num_out`` outputs of ``resample`` read."""
    if orig_rate == target_rate or num_out <= 0:
        return max(0, num_out)
    up, down = _reduced_ratio(orig_rate, target_rate)
    return (num_out - 1) * down // up + _filter_size(up, down)[2] + 1


def _filter_size(up: int, down: int) -> tuple[float, float, int]:
    """The cutoff, the filter's half-length in input samples, and that rounded up (taps per side)."""
    cutoff = RESAMPLE_ROLLOFF * min(1.0, up / down)  # in units of the input Nyquist frequency
    half_width = RESAMPLE_ZERO_CROSSINGS / cutoff
    return cutoff, half_width, math.ceil(half_width)


# Only called for tables of at most RESAMPLE_TABLE_SIZE coefficients: the cache holds <= 16 MiB.
@lru_cache(maxsize=8)
def _phase_filters(up: int, down: int) -> np.ndarray:
    return _filters_at(np.arange(up) / up, up, down)


def _filters_at(phase: np.ndarray, up: int, down: int) -> np.ndarray:
    """(len(phase), 2*half + 1) filters, unit DC gain each, for outputs ``phase`` input samples
    after their base input; tap i reads input base - half + i."""
    cutoff, half_width, half = _filter_size(up, down)
    offset = phase[:, None] + half - np.arange(2 * half + 1)[None, :]
    ratio = np.clip(offset / half_width, -1.0, 1.0)
    kaiser = np.i0(RESAMPLE_KAISER_BETA * np.sqrt(1.0 - ratio**2)) / np.i0(RESAMPLE_KAISER_BETA)
    taps = cutoff * np.sinc(cutoff * offset) * kaiser * (np.abs(offset) <= half_width)
    taps /= taps.sum(axis=1, keepdims=True)
    return taps


# --- Reading files --------------------------------------------------------------------------------

_WAVE_FORMAT_PCM = 1
_WAVE_FORMAT_IEEE_FLOAT = 3
_WAVE_FORMAT_EXTENSIBLE = 0xFFFE


def load_audio(path: str | Path, max_frames: int | None = None) -> tuple[np.ndarray, int]:
    """Read an audio file as mono float64 in [-1, 1] and its sampling rate.

    WAV is parsed here (8/16/24/32-bit PCM, 32/64-bit float, extensible headers; channels averaged).
    FLAC, OGG and MP3 need the optional ``soundfile`` package. With ``max_frames``, only that many
    frames from the start are read and decoded. Rates outside 1 Hz to ``MAX_SAMPLING_RATE`` are
    refused.
    """
    return _load_audio(path, lambda rate: max_frames)


def decode_wav(data: bytes) -> np.ndarray:
    """WAV file bytes (e.g. an upload) -> mono float64 samples at 16 kHz, ready for ``process_audio``.

    Only the first 30 s are decoded and returned: all that ``process_audio`` keeps. Rates outside
    1 Hz to ``MAX_SAMPLING_RATE`` and clips too short for one audio token are refused.
    """
    if data[:4] != b"RIFF" or data[8:12] != b"WAVE":
        raise ValueError("not a WAV file (no RIFF/WAVE header)")
    try:
        wave, rate = _read_wav(io.BytesIO(data), _frames_kept)  # BytesIO shares the bytes, no copy
    except (ValueError, struct.error) as error:
        raise ValueError(f"cannot read WAV data: {error}") from error
    num_samples = len(wave)
    if rate != SAMPLING_RATE:
        wave = resample(wave, rate, SAMPLING_RATE, max_samples=MAX_SAMPLES)
    _check_long_enough("the audio", len(wave), num_samples, rate)
    return wave


def _load_audio(path: str | Path, frames_for_rate: Callable[[int], int | None]) -> tuple[np.ndarray, int]:
    """``load_audio`` reading at most ``frames_for_rate(rate)`` frames, the rate read from the header."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"audio file not found: {str(path)!r}")
    with path.open("rb") as file:
        head = file.read(12)
        if head[:4] == b"RIFF" and head[8:12] == b"WAVE":
            try:
                return _read_wav(file, frames_for_rate)
            except (ValueError, struct.error) as error:
                raise ValueError(f"cannot read WAV file {str(path)!r}: {error}") from error
    mpeg_frame = len(head) > 1 and head[0] == 0xFF and head[1] & 0xE0 == 0xE0
    if head[:4] in (b"fLaC", b"OggS") or head[:3] == b"ID3" or mpeg_frame:
        return _read_with_soundfile(path, frames_for_rate)
    raise ValueError(f"unsupported audio file {str(path)!r}: not WAV, FLAC, OGG or MP3")


_READ_BLOCK_BYTES = 1 << 20  # WAV data is decoded this much at a time


def _read_wav(stream: BinaryIO, frames_for_rate: Callable[[int], int | None]) -> tuple[np.ndarray, int]:
    """Walk the RIFF chunks of a seekable stream, then read and decode only the frames asked for."""
    size = stream.seek(0, io.SEEK_END)
    fmt, data_start, data_size = None, None, 0
    offset = 12
    while offset + 8 <= size and (fmt is None or data_start is None):
        stream.seek(offset)
        chunk_id, chunk_size = struct.unpack("<4sI", stream.read(8))
        if chunk_id == b"fmt ":
            fmt = stream.read(min(chunk_size, 64))  # 26 bytes at most are used
        elif chunk_id == b"data":
            # A streamed file may claim more than it holds.
            data_start, data_size = offset + 8, min(chunk_size, size - offset - 8)
        offset += 8 + chunk_size + (chunk_size & 1)  # chunks are word-aligned
    if fmt is None or data_start is None:
        raise ValueError("missing 'fmt ' or 'data' chunk")
    tag, channels, rate, _, block_align, bits = struct.unpack_from("<HHIIHH", fmt)
    if tag == _WAVE_FORMAT_EXTENSIBLE and len(fmt) >= 26:
        tag = struct.unpack_from("<H", fmt, 24)[0]  # first two bytes of the sub-format GUID
    if channels == 0 or block_align == 0 or block_align % channels:
        raise ValueError(f"invalid header ({channels} channels, {block_align} bytes per frame)")
    _check_rate(rate, "the sampling rate in the header")
    decode = _sample_decoder(tag, block_align // channels, bits)
    num_frames = data_size // block_align
    limit = frames_for_rate(rate)
    if limit is not None:
        num_frames = min(num_frames, limit)
    wave = np.empty(num_frames)
    stream.seek(data_start)
    block = max(1, _READ_BLOCK_BYTES // block_align)
    for start in range(0, num_frames, block):
        count = min(block, num_frames - start)
        raw = stream.read(count * block_align)
        wave[start : start + count] = decode(raw).reshape(count, channels).mean(axis=1)
    return wave, rate


def _sample_decoder(tag: int, width: int, bits: int) -> Callable[[bytes], np.ndarray]:
    """Interleaved little-endian samples -> float64 in [-1, 1]."""
    if tag == _WAVE_FORMAT_PCM:
        if width == 1:  # 8-bit WAV is unsigned
            return lambda raw: (np.frombuffer(raw, np.uint8).astype(np.float64) - 128.0) / 128.0
        if width in (2, 3, 4):
            scale = float(2 ** (8 * width - 1))
            return lambda raw: _pcm_integers(raw, width).astype(np.float64) / scale
        raise ValueError(f"unsupported PCM sample width of {width} bytes")
    if tag == _WAVE_FORMAT_IEEE_FLOAT and width in (4, 8):
        return lambda raw: np.frombuffer(raw, f"<f{width}").astype(np.float64)
    raise ValueError(f"unsupported WAV encoding (format tag {tag:#x}, {bits} bits)")


def _pcm_integers(raw: bytes, width: int) -> np.ndarray:
    if width == 3:
        b = np.frombuffer(raw, np.uint8).reshape(-1, 3).astype(np.int32)
        return (b[:, 0] | (b[:, 1] << 8) | (b[:, 2] << 16)) << 8 >> 8  # sign-extend 24 bits
    return np.frombuffer(raw, f"<i{width}")


def _read_with_soundfile(path: Path, frames_for_rate: Callable[[int], int | None]) -> tuple[np.ndarray, int]:
    try:
        import soundfile
    except ImportError as error:
        raise ImportError(
            f"reading {path.suffix or 'this'} audio ({str(path)!r}) needs the optional package soundfile: "
            "pip install soundfile (or convert the file to WAV)"
        ) from error
    try:
        rate = soundfile.info(str(path)).samplerate
        _check_rate(rate, "the sampling rate in the header")
        limit = frames_for_rate(rate)
        wave, _ = soundfile.read(
            str(path), frames=-1 if limit is None else limit, dtype="float64", always_2d=True
        )
    except Exception as error:  # soundfile raises its own LibsndfileError / RuntimeError types
        raise ValueError(f"cannot read audio file {str(path)!r}: {error}") from error
    return wave.mean(axis=1), int(rate)
