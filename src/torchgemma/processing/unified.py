"""Audio for Gemma 4 12B Unified (``gemma4_unified``): raw waveform frames, no spectrogram.

Each soft token is ``samples_per_token`` consecutive 16 kHz samples (640 = 40 ms). As transformers'
``Gemma4UnifiedAudioFeatureExtractor``: a clip's last frame is zero-padded to full length (all its
frames are valid), and a batch is padded with zero frames to its longest clip (those are invalid).
Image preprocessing for this model (resize, 3x3 patch merge) is not implemented here yet.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch


def frame_audio(
    waveforms: Sequence[np.ndarray | torch.Tensor | Sequence[float]] | np.ndarray | torch.Tensor,
    samples_per_token: int = 640,
) -> dict[str, torch.Tensor]:
    """Mono 16 kHz clips -> ``input_features`` (n_clips, frames, samples_per_token) float32 and
    ``input_features_mask`` (n_clips, frames) bool, as the model's ``forward`` takes them."""
    if isinstance(waveforms, np.ndarray | torch.Tensor) and waveforms.ndim == 1:
        waveforms = [waveforms]
    clips = []
    for clip in waveforms:
        clip = clip.detach().cpu().numpy() if isinstance(clip, torch.Tensor) else np.asarray(clip)
        if clip.ndim != 1:
            raise ValueError(f"each audio clip must be 1-D (mono samples), got shape {clip.shape}")
        clip = np.pad(clip, (0, (-len(clip)) % samples_per_token))
        clips.append(clip.reshape(-1, samples_per_token).astype(np.float32))
    frames = max((len(c) for c in clips), default=0)
    features = torch.zeros(len(clips), frames, samples_per_token)
    mask = torch.zeros(len(clips), frames, dtype=torch.bool)
    for i, clip in enumerate(clips):
        features[i, : len(clip)] = torch.from_numpy(clip)
        mask[i, : len(clip)] = True
    return {"input_features": features, "input_features_mask": mask}
