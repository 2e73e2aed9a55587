"""The whole model: the text decoder and its head, with the vision and audio towers of ``gemma4``
and ``gemma3n`` (MobileNet-V5 and a conformer), and the SigLIP tower of ``gemma3``.

Module names follow the checkpoint's tensor names with the ``model.`` prefix removed
(``language_model.layers.3.self_attn.q_proj.weight``, ``vision_tower.encoder.layers.0...``,
``embed_audio.embedding_projection.weight``), so loading is an identity mapping.
"""

from __future__ import annotations

import torch
from torch import nn

from ..cache import KVCache
from ..config import ModelConfig
from .audio import AudioTower
from .gemma3n_audio import Gemma3nAudioEncoder
from .gemma3n_vision import Gemma3nVisionTower
from .multimodal import MultimodalEmbedder, placeholder_masks, scatter_soft_tokens, vision_block_ids
from .siglip import MultiModalProjector, SiglipVisionTower
from .text import TextModel
from .unified import VisionEmbedder
from .vision import VisionTower


class Gemma(nn.Module):
    """A Gemma 4 checkpoint as a module.

    ``model(input_ids, attention_mask=None)`` returns soft-capped logits ``(B, T, vocab)``. For
    incremental decoding pass a cache from ``make_cache``: each call appends its tokens to it.
    Images, video frames and audio are passed as transformers' Gemma 4 processor returns them.
    """

    def __init__(self, config: ModelConfig, attention: str = "sdpa"):
        super().__init__()
        self.config = config
        text = config.text
        self.language_model = TextModel(text, attention)
        # Set by torchgemma.compile: a compiled static-shape decode step the engine uses.
        self.compiled_decode = None
        if config.vision_config is not None:
            vision = config.vision_config
            self.vision_tower = VisionTower(vision, attention)
            self.embed_vision = MultimodalEmbedder(vision.hidden_size, text.hidden_size, vision.rms_norm_eps)
        if config.audio_config is not None:
            audio = config.audio_config
            self.audio_tower = AudioTower(audio)
            self.embed_audio = MultimodalEmbedder(
                audio.output_proj_dims, text.hidden_size, audio.rms_norm_eps
            )
        if config.unified_vision is not None:  # gemma4_unified: no tower, see model/unified.py
            vision = config.unified_vision
            self.vision_embedder = VisionEmbedder(vision)
            self.embed_vision = MultimodalEmbedder(
                vision.output_proj_dims, text.hidden_size, vision.rms_norm_eps
            )
        if config.unified_audio is not None:
            audio = config.unified_audio
            self.embed_audio = MultimodalEmbedder(audio.audio_embed_dim, text.hidden_size, audio.rms_norm_eps)
        if config.gemma3n_audio is not None:  # its soft tokens go through language_model.embed_audio
            self.audio_tower = Gemma3nAudioEncoder(config.gemma3n_audio)
        if config.siglip_vision is not None:  # gemma3
            self.vision_tower = SiglipVisionTower(config.siglip_vision, attention)
            self.multi_modal_projector = MultiModalProjector(config.siglip_vision, text.hidden_size)
        if config.gemma3n_vision is not None:  # its soft tokens go through language_model.embed_vision
            self.vision_tower = Gemma3nVisionTower(config.gemma3n_vision)

    @property
    def takes_media(self) -> bool:
        """A multimodal layout (gemma4, gemma4_unified): placeholders and soft tokens apply."""
        return self.config.takes_media

    @property
    def towers_note(self) -> str:
        """Why a tower is missing: config.json has none, or torchgemma does not build it."""
        return self.config.towers_note

    @property
    def device(self) -> torch.device:
        return self.language_model.norm.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.language_model.dtype

    @property
    def attention(self) -> str:
        """The attention backend: ``"sdpa"`` or ``"eager"``, of the text decoder and the vision
        tower. The audio towers have one path, the reference's eager one (transformers' audio
        towers have no sdpa; with ``attn_implementation="sdpa"`` they run eager)."""
        return self.language_model.attention

    def set_attention(self, backend: str) -> None:
        self.language_model.set_attention(backend)
        if self.config.vision_config is not None or self.config.siglip_vision is not None:
            self.vision_tower.set_attention(backend)

    def make_cache(
        self, batch_size: int, max_len: int, *, max_rollback: int = 0, preallocate: bool = True
    ) -> KVCache:
        """An empty KV cache of ``batch_size`` slots, each for a sequence of up to ``max_len`` tokens
        (prompt included), whose last ``max_rollback`` tokens can be taken back; allocated whole,
        or (``preallocate=False``) growing with the sequences."""
        return KVCache(
            self.config.text,
            batch_size,
            max_len,
            max_rollback=max_rollback,
            preallocate=preallocate,
            dtype=self.dtype,
            device=self.device,
        )

    # ── soft tokens ──────────────────────────────────────────────────────────────────────────

    def text_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The ids the text decoder embeds: in ``gemma4`` checkpoints a media placeholder reads as the
        pad token (its soft token, if any, is scattered in afterwards), also when it is generated."""
        if not self.takes_media:
            return input_ids
        if self.config.siglip_vision is not None:
            # Gemma 3 embeds its image token's own row, unless it lies past the table (as the reference).
            image = self.config.token_ids["image_token_id"]
            return (
                input_ids.masked_fill(input_ids == image, 0)
                if image >= self.config.text.vocab_size
                else input_ids
            )
        masks = placeholder_masks(input_ids, self.config.token_ids)
        placeholders = masks["image"] | masks["video"] | masks["audio"]
        return input_ids.masked_fill(placeholders, self.config.text.pad_token_id)

    def image_features(self, pixel_values: torch.Tensor, position_ids: torch.Tensor | None) -> torch.Tensor:
        """Patches (n_images, N, 3p²) and positions (n_images, N, 2) -> soft tokens (n_soft, H).
        Gemma 3 and 3n: images (n_images, 3, S, S) -> soft tokens (n_images * m, H)."""
        if self.config.siglip_vision is not None:  # gemma3
            soft = self.multi_modal_projector(self.vision_tower(pixel_values.to(self.device)))
            return soft.reshape(-1, soft.shape[-1])
        if self.config.gemma3n_vision is not None:
            soft = self.language_model.embed_vision.soft(self.vision_tower(pixel_values))
            return soft.reshape(-1, soft.shape[-1])
        if self.config.unified_vision is not None:
            if position_ids is None:
                raise ValueError("pixel values need their patch positions (image_position_ids)")
            position_ids = position_ids.to(self.device)
            soft = self.embed_vision(self.vision_embedder(pixel_values.to(self.device), position_ids))
            # Padding patches (at (-1, -1)) have no placeholder: only the real ones are scattered.
            return soft[(position_ids != -1).all(dim=-1)]
        if self.config.vision_config is None:
            raise ValueError(f"this checkpoint has no vision tower torchgemma builds ({self.towers_note})")
        if position_ids is None:
            raise ValueError(
                "pixel values need their patch positions (image_position_ids / video_position_ids)"
            )
        soft = self.vision_tower(pixel_values.to(self.device), position_ids.to(self.device))
        return self.embed_vision(soft)

    def audio_features(self, input_features: torch.Tensor, input_features_mask: torch.Tensor) -> torch.Tensor:
        """Log-mel features (B, T, F) and frame mask (B, T) -> the valid frames' soft tokens (n, H).
        gemma4_unified: raw waveform frames (B, T, 640) projected directly, without a tower."""
        if self.config.gemma3n_audio is not None:
            return self.gemma3n_audio_features(input_features, input_features_mask)
        if self.config.unified_audio is not None:
            frames = input_features.to(self.device, self.dtype)  # cast before the norm, as the reference
            return self.embed_audio(frames)[input_features_mask.to(self.device).bool()]
        if self.config.audio_config is None:
            raise ValueError(f"this checkpoint has no audio tower torchgemma builds ({self.towers_note})")
        frames, valid = self.audio_tower(input_features.to(self.device), input_features_mask.to(self.device))
        # Projected over the whole padded batch, then the valid frames kept, as the reference.
        return self.embed_audio(frames)[valid]

    def gemma3n_audio_features(
        self, input_features: torch.Tensor, input_features_mask: torch.Tensor
    ) -> torch.Tensor:
        """Gemma 3n: log-mel features (B, T, F) and frame mask (B, T) -> soft tokens (B * n, H), n per
        clip (``audio_soft_tokens_per_image``): the encoder's, its padded frames and the rest up to n
        embed_audio's row for id ``vocab_size - 1``, as the reference."""
        cfg = self.config.gemma3n_audio
        if input_features_mask is None:
            raise ValueError("input_features need their input_features_mask (the processor returns both)")
        embedder = self.language_model.embed_audio
        encodings, valid = self.audio_tower(
            input_features.to(self.device), input_features_mask.to(self.device)
        )
        soft = embedder.soft(encodings)  # (B, T'', H)
        clips, length, width = soft.shape
        if length > cfg.soft_tokens_per_clip:
            raise ValueError(
                f"audio of {input_features.shape[1]} frames gives {length} soft tokens per clip, more than "
                f"the {cfg.soft_tokens_per_clip} placeholders a clip has (audio is at most 30 s)"
            )
        pad_row = torch.full(
            (1, 1), self.config.text.vocab_size - 1 - embedder.vocab.offset, device=self.device
        )
        pad = embedder.hard(pad_row)  # (1, 1, H), embedded alone as the reference does
        soft = torch.where(valid[..., None], soft, pad)
        soft = torch.cat([soft, pad.expand(clips, cfg.soft_tokens_per_clip - length, width)], dim=1)
        return soft.to(self.dtype).reshape(-1, width)

    def embed_multimodal(
        self,
        input_ids: torch.Tensor,
        pixel_values: torch.Tensor | None = None,
        image_position_ids: torch.Tensor | None = None,
        input_features: torch.Tensor | None = None,
        input_features_mask: torch.Tensor | None = None,
        pixel_values_videos: torch.Tensor | None = None,
        video_position_ids: torch.Tensor | None = None,
        num_frames_per_video: torch.Tensor | list[int] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Text embeddings with soft tokens scattered in (B, T, H), and the ids for the per-layer table.

        Placeholder positions are embedded as the pad token first (the pad id also picks their
        per-layer embedding row), then overwritten in sequence order by the soft tokens. A
        placeholder without media keeps the pad embedding, as in the reference. Video frames go
        through the vision tower as images do; ``num_frames_per_video`` is only checked.
        """
        if pixel_values_videos is not None and num_frames_per_video is not None:
            frames = int(sum(int(n) for n in num_frames_per_video))
            if frames != pixel_values_videos.shape[0]:
                raise ValueError(
                    f"num_frames_per_video sums to {frames} but pixel_values_videos has "
                    f"{pixel_values_videos.shape[0]} frames"
                )
        if self.config.gemma3n_audio is not None:
            if pixel_values_videos is not None:
                raise ValueError("Gemma 3n takes images and audio, not videos")
            embeds = self.language_model.embed(input_ids)
            if pixel_values is not None:
                soft = self.image_features(pixel_values, None)
                mask = input_ids == self.config.gemma3n_vision.image_token_id
                embeds = scatter_soft_tokens(embeds, mask, soft, "image")
            if input_features is not None:
                soft = self.audio_features(input_features, input_features_mask)
                mask = input_ids == self.config.gemma3n_audio.audio_token_id
                embeds = scatter_soft_tokens(embeds, mask, soft, "audio")
            return embeds, input_ids
        if self.config.siglip_vision is not None:
            return self.gemma3_embed(input_ids, pixel_values, pixel_values_videos, input_features)
        masks = placeholder_masks(input_ids, self.config.token_ids)
        text_ids = self.text_ids(input_ids)
        embeds = self.language_model.embed(text_ids)
        if pixel_values is not None:
            soft = self.image_features(pixel_values, image_position_ids)
            embeds = scatter_soft_tokens(embeds, masks["image"], soft, "image")
        if pixel_values_videos is not None:
            soft = self.image_features(pixel_values_videos, video_position_ids)
            embeds = scatter_soft_tokens(embeds, masks["video"], soft, "video")
        if input_features is not None:
            soft = self.audio_features(input_features, input_features_mask)
            embeds = scatter_soft_tokens(embeds, masks["audio"], soft, "audio")
        return embeds, text_ids

    def gemma3_embed(self, input_ids, pixel_values, videos, audio) -> tuple[torch.Tensor, torch.Tensor]:
        """Gemma 3: the text embeddings with each image's ``mm_tokens_per_image`` soft tokens written
        over its image tokens, in order."""
        if videos is not None or audio is not None:
            raise ValueError("Gemma 3 takes images only (its processor has no video or audio)")
        text_ids = self.text_ids(input_ids)
        embeds = self.language_model.embed(text_ids)
        if pixel_values is not None:
            mask = input_ids == self.config.token_ids["image_token_id"]
            embeds = scatter_soft_tokens(embeds, mask, self.image_features(pixel_values, None), "image")
        return embeds, text_ids

    # ── forward ──────────────────────────────────────────────────────────────────────────────

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        pixel_values: torch.Tensor | None = None,
        image_position_ids: torch.Tensor | None = None,
        input_features: torch.Tensor | None = None,
        input_features_mask: torch.Tensor | None = None,
        mm_token_type_ids: torch.Tensor | None = None,
        *,
        pixel_values_videos: torch.Tensor | None = None,
        video_position_ids: torch.Tensor | None = None,
        num_frames_per_video: torch.Tensor | list[int] | None = None,
        cache: KVCache | None = None,
        slots: list[int] | None = None,
        logits_to_keep: int = 0,
    ) -> torch.Tensor:
        """Logits ``(B, T, vocab)`` for ``input_ids`` ``(B, T)``.

        ``attention_mask`` ``(B, T)`` marks real tokens (1) and left padding (0) of this call's tokens.
        With a ``cache``, row ``b`` appends its real tokens to the sequence in slot ``slots[b]``
        (default: slot ``b``); padding is not stored. ``logits_to_keep=n > 0`` computes only the last
        ``n`` positions (and skips the rest through the KV-shared layers, which write no cache).

        Multimodal inputs, as transformers' Gemma 4 processor returns them: ``pixel_values``
        ``(n_images, N, 3p²)`` with ``image_position_ids`` ``(n_images, N, 2)``; ``input_features``
        ``(n_clips, frames, mel)`` with ``input_features_mask`` ``(n_clips, frames)``;
        ``pixel_values_videos`` / ``video_position_ids`` (all frames of all videos concatenated;
        ``num_frames_per_video`` is only checked). Soft tokens fill the ``<|image|>`` /
        ``<|video|>`` / ``<|audio|>`` placeholders in order. ``mm_token_type_ids`` ``(B, T)`` turns
        on bidirectional attention inside each image and each video frame on sliding layers, for
        checkpoints with ``use_bidirectional_attention == "vision"`` (26B/31B; Gemma 3 on every
        layer); pass it with the prompt only. Gemma 3: ``pixel_values`` (n_images, 3, S, S) as
        ``Gemma3ImageProcessor`` returns them (``mm_token_type_ids``: its ``token_type_ids``).
        Gemma 3n: ``pixel_values`` (n_images, 3, 768, 768) as its image processor returns them, each
        image filling ``vision_soft_tokens_per_image`` (256) image placeholders; ``input_features`` /
        ``input_features_mask`` as ``Gemma3nAudioFeatureExtractor`` returns them, each clip filling
        ``audio_soft_tokens_per_image`` (188) audio placeholders; in order.
        """
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be (batch, length), got shape {tuple(input_ids.shape)}")
        media = {
            "pixel_values": pixel_values,
            "input_features": input_features,
            "pixel_values_videos": pixel_values_videos,
        }
        if self.config.gemma3n_audio is not None and (input_features is not None or pixel_values is not None):
            embeds, _ = self.embed_multimodal(
                input_ids,
                pixel_values,
                input_features=input_features,
                input_features_mask=input_features_mask,
                pixel_values_videos=pixel_values_videos,
            )
            return self.language_model(
                input_ids, attention_mask, cache, keep_last=logits_to_keep, slots=slots, inputs_embeds=embeds
            )
        if not self.takes_media:
            given = [name for name, value in media.items() if value is not None]
            if given:
                raise ValueError(
                    f"{', '.join(given)} given, but this checkpoint has no towers ({self.towers_note})"
                )
            return self.language_model(
                input_ids, attention_mask, cache, keep_last=logits_to_keep, slots=slots
            )

        if (input_features is None) != (input_features_mask is None):
            raise ValueError(
                "input_features and input_features_mask go together (the processor returns both)"
            )
        embeds, text_ids = self.embed_multimodal(
            input_ids,
            pixel_values,
            image_position_ids,
            input_features,
            input_features_mask,
            pixel_values_videos,
            video_position_ids,
            num_frames_per_video,
        )
        blocks = None
        if mm_token_type_ids is not None and self.config.text.use_bidirectional_attention == "vision":
            if mm_token_type_ids.shape != input_ids.shape:
                raise ValueError(
                    f"mm_token_type_ids has shape {tuple(mm_token_type_ids.shape)}, "
                    f"input_ids {tuple(input_ids.shape)}"
                )
            blocks = vision_block_ids(mm_token_type_ids.to(input_ids.device))
        return self.language_model(
            text_ids,
            attention_mask,
            cache,
            keep_last=logits_to_keep,
            slots=slots,
            inputs_embeds=embeds,
            vision_blocks=blocks,
        )
