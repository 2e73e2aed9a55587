"""One checkpoint's processor: a request in (a prompt or chat messages, media, tools, thinking), one
unpadded sequence of ids and its media tensors out, as transformers' processor for that checkpoint
prepares them.

    processor = Processor(tokenizer, config, folder)
    prompt = processor.chat(messages, enable_thinking=True, tools=[...])
    prompt.input_ids, prompt.media          # list of ids; MediaInputs (pixel_values, ...)
    prompt = processor(processor.encode("<|image|>A photo of"), images=["cat.jpg"])

The family's way with media is chosen once, when the processor is made: Gemma 4's towers
(``prompt.prepare_media_prompts``), Gemma 4 Unified's encoder-free embedders
(``unified.prepare_unified_prompts``), Gemma 3n's audio (placeholders expanded in the text, features
from ``gemma3n_audio``), Gemma 3's images (likewise, pixels from ``gemma3_image``), or none (a text model refuses media by name). Nothing here pads: a batch of
prompts is padded where it is batched (``LLM`` for ``generate``; the engine takes rows as they are).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..config import ModelConfig
from ..model.inputs import MediaInputs
from ..tokenizer import Tokenizer, UnknownTokenError
from ..tokenizer.chat_template import select_chat_template
from . import gemma3n_audio, gemma3n_image
from .gemma3_image import (
    Gemma3ImageSettings,
    expand_image_text,
    expand_images_in_template,
    process_images_gemma3,
)
from .image import PATCH_SIZE, POOLING_KERNEL, processor_config_section
from .prompt import MediaTokens, collect_media, collect_videos, prepare_media_prompts
from .unified import prepare_unified_prompts
from .video import DEFAULT_NUM_FRAMES, DEFAULT_VIDEO_SOFT_TOKENS

# Soft tokens per image when the checkpoint has no processor config (transformers' default).
DEFAULT_IMAGE_SOFT_TOKENS = 280


@dataclass(frozen=True)
class ProcessedPrompt:
    """One request ready for the model: its ids (placeholders expanded, no padding) and its media
    (``mm_token_type_ids`` (1, L) when the family marks soft tokens)."""

    input_ids: list[int]
    media: MediaInputs = field(default_factory=MediaInputs)


@dataclass(frozen=True)
class ExpandedRows:
    """Prompts with their placeholders expanded, unpadded: the ids of each row, the soft-token types
    of each row (None where the family has none) and the media tensors of all rows together."""

    input_ids: list[list[int]]
    mm_token_type_ids: list[list[int]] | None
    media: dict[str, torch.Tensor]


def takes_audio(config: ModelConfig) -> bool:
    """Whether a checkpoint runs audio: an audio tower (Gemma 4, Gemma 3n) or embedder (unified)."""
    if config.encoder_free:
        return config.unified_audio is not None
    return config.audio_config is not None or config.gemma3n_audio is not None


def check_media_towers(
    config: ModelConfig,
    images: Sequence[Any],
    audio: Sequence[Any],
    videos: Sequence[Any],
    *,
    towers_note: str,
) -> None:
    """Refuse, by name, media the checkpoint has no tower (or embedder) torchgemma builds for: from
    its config alone, so that the CLI checks it before the weights load (cli/precheck.py)."""
    vision = config.vision_config
    visual = "images" if images else "videos" if videos else None
    if config.encoder_free:
        # Encoder-free embedders rather than towers (model/unified.py).
        for given, embedder, kind in (
            (images or videos, config.unified_vision, "vision"),
            (audio, config.unified_audio, "audio"),
        ):
            if given and embedder is None:
                raise ValueError(
                    f"this gemma4_unified checkpoint has no {kind}_config: it cannot take {kind} input"
                )
    elif config.siglip_vision is not None or config.gemma3n_vision is not None:
        if videos:  # Gemma 3's and 3n's processors take images, not videos
            name = "Gemma 3" if config.siglip_vision is not None else "Gemma 3n"
            raise ValueError(f"{name} takes images, not videos")
    elif visual and vision is None:
        raise ValueError(
            f"this checkpoint has no vision tower torchgemma builds ({towers_note}): it cannot take {visual}"
        )
    elif visual and (vision.patch_size, vision.pooling_kernel_size) != (PATCH_SIZE, POOLING_KERNEL):
        raise ValueError(
            f"image preprocessing makes {PATCH_SIZE} px patches pooled "
            f"{POOLING_KERNEL}x{POOLING_KERNEL}, "
            f"but this vision tower takes {vision.patch_size} px patches pooled "
            f"{vision.pooling_kernel_size}x{vision.pooling_kernel_size}"
        )
    if audio and not takes_audio(config):
        raise ValueError(
            f"this checkpoint has no audio tower torchgemma builds ({towers_note}): it cannot take audio"
        )


class Processor:
    """Prompts and media of one checkpoint (``tokenizer``, its model ``config``, and the processor
    settings of its ``folder``: ``processor_config.json`` and friends).

    ``max_soft_tokens``: soft tokens per image (70, 140, 280, 560 or 1120); by default the folder's
    processor config, else 280. Videos keep ``video_num_frames`` frames of ``video_soft_tokens`` soft
    tokens each (the processor config's ``video_processor`` values, else 32 and 70). These three are
    attributes and may be changed. ``towers_note`` says why a tower is missing, in the errors for
    media the checkpoint cannot take (``Gemma.towers_note``).
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        config: ModelConfig,
        folder: str | Path | None = None,
        *,
        max_soft_tokens: int | None = None,
        towers_note: str = "config.json describes none",
    ) -> None:
        self.tokenizer = tokenizer
        self.config = config
        self.folder = None if folder is None else Path(folder)
        self.towers_note = towers_note
        settings = self.folder if self.folder is not None and self.folder.is_dir() else None
        self.max_soft_tokens = max_soft_tokens or _image_soft_tokens(settings)
        self.video_soft_tokens, self.video_num_frames = _video_settings(settings)
        self._settings_folder = settings
        # The family's media preparation, chosen once.
        self._expand_media: Callable[[list[list[int]], list, list, list], ExpandedRows]
        self._unified = config.encoder_free  # embedders project media into the decoder, no towers
        self._gemma3n_soft_tokens: int | None = None  # Gemma 3n: per clip, expanded in the text
        self._gemma3n_image_tokens: int | None = None  # Gemma 3n: per image, expanded in the text
        self._gemma3_images: Gemma3ImageSettings | None = None  # Gemma 3: expanded in the text
        if config.siglip_vision is not None:
            vision = config.siglip_vision
            self._expand_media = self._gemma3_media
            self._gemma3_images = Gemma3ImageSettings.from_folder(
                settings, vision.image_size, vision.mm_tokens_per_image
            )
        elif config.gemma3n_audio is not None:
            self._expand_media = self._gemma3n_media
            self._gemma3n_soft_tokens = config.gemma3n_audio.soft_tokens_per_clip
            if config.gemma3n_vision is not None:
                self._gemma3n_image_tokens = config.gemma3n_vision.soft_tokens_per_image
        elif self._unified:
            self._expand_media = self._unified_media
        else:
            self._expand_media = self._gemma4_media
        # Gemma 3n: chat templates with the media placeholders expanded, by template and media kinds
        # (template_for).
        self._expanded_templates: dict[tuple[str, bool, bool], str] = {}

    @property
    def takes_audio(self) -> bool:
        """Whether the checkpoint runs audio: an audio tower (Gemma 4, Gemma 3n) or embedder (unified)."""
        return takes_audio(self.config)

    # ---- requests -------------------------------------------------------------------------------

    def __call__(
        self,
        prompt: str | Sequence[int],
        *,
        images: Sequence[Any] | None = None,
        audio: Sequence[Any] | None = None,
        videos: Sequence[Any] | None = None,
    ) -> ProcessedPrompt:
        """A raw prompt (text, encoded with ``encode``, or token ids) and the media filling its
        ``<|image|>`` / ``<|audio|>`` / ``<|video|>`` placeholders, in order."""
        ids = self.encode(prompt, audio, images) if isinstance(prompt, str) else list(prompt)
        return self.process(ids, images, audio, videos)

    def chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        enable_thinking: bool = False,
        tools: Sequence[Mapping[str, Any]] | None = None,
        sanitize_control_tokens: bool = True,
        reply_prefix: str = "",
    ) -> ProcessedPrompt:
        """A conversation, rendered for the model's turn, with the media of its content items
        (``{"type": "image" | "audio" | "video", ...}``, see ``prompt.collect_media``).
        ``tools``, ``reply_prefix``: see ``render_chat``."""
        images, audio = collect_media(messages)
        ids = self.render_chat(
            messages,
            enable_thinking=enable_thinking,
            tools=tools,
            sanitize_control_tokens=sanitize_control_tokens,
            reply_prefix=reply_prefix,
            audio=audio,
            images=images,
        )
        return self.process(ids, images, audio, collect_videos(messages))

    def process(
        self,
        input_ids: Sequence[int],
        images: Sequence[Any] | None = None,
        audio: Sequence[Any] | None = None,
        videos: Sequence[Any] | None = None,
    ) -> ProcessedPrompt:
        """Token ids with placeholders (as ``render_chat`` or ``encode`` give them) and their media."""
        expanded = self.expand([input_ids], images, audio, videos)
        media = dict(expanded.media)
        if expanded.mm_token_type_ids is not None:
            media["mm_token_type_ids"] = torch.tensor(expanded.mm_token_type_ids, dtype=torch.long)
        return ProcessedPrompt(expanded.input_ids[0], MediaInputs.from_dict(media))

    def expand(
        self,
        prompts: Sequence[Sequence[int]],
        images: Sequence[Any] | None = None,
        audio: Sequence[Any] | None = None,
        videos: Sequence[Any] | None = None,
    ) -> ExpandedRows:
        """Several prompts' placeholders expanded together, as transformers' processor does a batch:
        the i-th ``<|image|>`` over all rows takes ``images[i]`` (likewise audio and videos), and the
        media of all rows are preprocessed as one batch (audio padded to the longest clip)."""
        if not prompts or any(len(p) == 0 for p in prompts):
            raise ValueError("every prompt needs at least one token")
        rows = [list(p) for p in prompts]
        images, audio, videos = list(images or ()), list(audio or ()), list(videos or ())
        if not images and not audio and not videos:
            return ExpandedRows(rows, None, {})
        return self._expand_media(rows, images, audio, videos)

    # ---- text -----------------------------------------------------------------------------------

    def encode(
        self, prompt: str, audio: Sequence[Any] | None = None, images: Sequence[Any] | None = None
    ) -> list[int]:
        """Token ids of a raw prompt, starting with ``<bos>`` as Gemma was trained.

        Gemma 4 tokenizers add no ``<bos>`` themselves (the chat template writes it), so it is added
        here unless the prompt's text already begins with it. Gemma 3n with ``audio`` / ``images``
        and Gemma 3 with ``images`` (those of this prompt): each placeholder is expanded in the text
        first, as their processors do.
        """
        if audio and self._gemma3n_soft_tokens is not None:
            prompt = gemma3n_audio.expand_audio_text(prompt, self.tokenizer, self._gemma3n_soft_tokens)
        if images and self._gemma3n_image_tokens is not None:
            prompt = gemma3n_image.expand_image_text(prompt, self.tokenizer, self._gemma3n_image_tokens)
        if images and self._gemma3_images is not None:
            prompt = expand_image_text(prompt, self._gemma3_tokens(), self._gemma3_image_texts(images))
        ids = self.tokenizer.encode(prompt)
        try:
            bos = self.tokenizer.bos_id
        except UnknownTokenError:
            return ids
        return ids if ids[:1] == [bos] else [bos, *ids]

    def chat_ids(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        enable_thinking: bool = False,
        tools: Sequence[Mapping[str, Any]] | None = None,
        sanitize_control_tokens: bool = True,
    ) -> list[int]:
        """The conversation rendered with the checkpoint's own chat template, ready for the model's
        turn; media items appear as one placeholder each (not expanded)."""
        return self.render_chat(
            messages,
            enable_thinking=enable_thinking,
            tools=tools,
            sanitize_control_tokens=sanitize_control_tokens,
        )

    def render_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        enable_thinking: bool = False,
        tools: Sequence[Mapping[str, Any]] | None = None,
        sanitize_control_tokens: bool = True,
        reply_prefix: str = "",
        audio: Sequence[Any] = (),
        images: Sequence[Any] = (),
    ) -> list[int]:
        """``chat_ids`` ready for ``process``: Gemma 3n's template writes each of the ``audio`` clips'
        and ``images``' placeholders expanded, as Gemma3nProcessor's does (Gemma 3: each of the
        ``images``', as Gemma3Processor's); ``reply_prefix`` is text the reply is made
        to start with (``replies.forced_call_prefix``), written after the generation prompt.

        ``sanitize_control_tokens``: control tokens typed in the messages (``<turn|>``, ``<|image|>``)
        are encoded as plain text, so only the template writes control tokens; False lets trusted
        input write them (see ``Tokenizer.apply_chat_template``)."""
        ids = self.tokenizer.apply_chat_template(
            messages,
            add_generation_prompt=True,
            enable_thinking=enable_thinking,
            tools=tools,
            sanitize_control_tokens=sanitize_control_tokens,
            chat_template=self.template_for(audio, tools, images),
        )
        if reply_prefix:
            ids = ids + self.tokenizer.encode(reply_prefix, add_special_tokens=False)
        return ids

    def template_for(
        self, audio: Sequence[Any], tools: Sequence[Any] | None = None, images: Sequence[Any] = ()
    ) -> str | None:
        """The chat template a conversation with these audio clips and images (and ``tools``) renders
        with: None (the tokenizer's own) except for Gemma 3n with audio or images, whose placeholders
        render expanded in the text (expanded once per template, on first use), and Gemma 3 with
        images, each of whose placeholders renders as that image's text."""
        gemma3 = bool(images) and self._gemma3_images is not None
        with_audio = bool(audio) and self._gemma3n_soft_tokens is not None
        with_images = bool(images) and self._gemma3n_image_tokens is not None
        if not gemma3 and not with_audio and not with_images:
            return None
        template = select_chat_template(
            self.tokenizer.chat_template, tools=tools, source=self.tokenizer.name_or_path
        )
        if gemma3:
            boi = self._gemma3_tokens()[0]
            return expand_images_in_template(template, boi, self._gemma3_image_texts(images))
        key = (template, with_audio, with_images)
        if key not in self._expanded_templates:
            expanded = template
            if with_audio:
                expanded = gemma3n_audio.expand_audio_in_template(
                    expanded, self.tokenizer, self._gemma3n_soft_tokens
                )
            if with_images:
                expanded = gemma3n_image.expand_image_in_template(
                    expanded, self.tokenizer, self._gemma3n_image_tokens
                )
            self._expanded_templates[key] = expanded
        return self._expanded_templates[key]

    # ---- media, by family -----------------------------------------------------------------------

    def _gemma4_media(self, rows: list[list[int]], images: list, audio: list, videos: list) -> ExpandedRows:
        prepared = prepare_media_prompts(
            rows,
            self._media_tokens(images, audio, videos),
            images,
            audio,
            self.max_soft_tokens,
            videos=videos,
            tokenizer=self.tokenizer,
            video_soft_tokens=self.video_soft_tokens,
            num_frames=self.video_num_frames,
        )
        return ExpandedRows(prepared.pop("input_ids"), prepared.pop("mm_token_type_ids"), prepared)

    def _unified_media(self, rows: list[list[int]], images: list, audio: list, videos: list) -> ExpandedRows:
        tokens = self._media_tokens(images, audio, videos)
        # Patches and frames sized as the embedders take them (_media_tokens checked they exist).
        vision, frames = self.config.unified_vision, self.config.unified_audio
        prepared = prepare_unified_prompts(
            rows,
            tokens,
            images,
            audio,
            self.max_soft_tokens,
            patch_size=vision.patch_size if vision else 16,
            pooling_kernel_size=vision.pooling_kernel_size if vision else 3,
            samples_per_token=frames.audio_embed_dim if frames else 640,
            videos=videos,
            tokenizer=self.tokenizer,
            video_soft_tokens=self.video_soft_tokens,
            num_frames=self.video_num_frames,
        )
        return ExpandedRows(prepared.pop("input_ids"), prepared.pop("mm_token_type_ids"), prepared)

    def _gemma3n_media(self, rows: list[list[int]], images: list, audio: list, videos: list) -> ExpandedRows:
        """Prompts whose audio and image placeholders are already expanded (``encode`` and
        ``render_chat`` expand them in the text, as Gemma3nProcessor), the clips' features and the
        images' pixels."""
        tokens = self._media_tokens(images, audio, videos)
        media: dict[str, Any] = {}
        for kind, placeholder, given, soft, helper in (
            ("audio", tokens.audio, audio, self._gemma3n_soft_tokens, "gemma3n_audio.expand_audio_text"),
            ("image", tokens.image, images, self._gemma3n_image_tokens, "gemma3n_image.expand_image_text"),
        ):
            found = sum(row.count(placeholder) for row in rows)
            if given and found != soft * len(given):
                raise ValueError(
                    f"the prompts hold {found} {kind} placeholder tokens but {len(given)} {kind} inputs need "
                    f"{soft} each: Gemma 3n prompts take each placeholder expanded in the text "
                    f"(LLM.chat and LLM.generate do this; see processing.{helper})"
                )
        # The processors' settings, read at the first clip or image (a setting torchgemma does not
        # compute is refused then, not when a text-only use loads the checkpoint).
        folder = self._settings_folder
        if audio:
            settings = gemma3n_audio.feature_settings(folder) if folder is not None else {}
            media.update(gemma3n_audio.process_audio_gemma3n(audio, **settings))
        if images:
            media.update(gemma3n_image.process_images_gemma3n(images, gemma3n_image.image_settings(folder)))
        return ExpandedRows(rows, None, media)

    def _gemma3_tokens(self) -> tuple[str, str, str]:
        ids = self.config.token_ids
        return tuple(self.tokenizer.id_to_token(ids[f"{name}_token_id"]) for name in ("boi", "image", "eoi"))

    def _gemma3_image_texts(self, images: Sequence[Any]) -> list[str]:
        settings, tokens = self._gemma3_images, self._gemma3_tokens()
        return [settings.image_text(tokens, crops) for crops in settings.crop_counts(images)]

    def encode_all(
        self, prompts: Sequence[str], audio: Sequence[Any] | None = None, images: Sequence[Any] | None = None
    ) -> list[list[int]]:
        """``encode`` of several raw prompts whose placeholders the media fill in order: Gemma 3's
        i-th ``<start_of_image>`` over all prompts takes ``images[i]``."""
        if not images or self._gemma3_images is None:
            return [self.encode(prompt, audio, images) for prompt in prompts]
        boi, left = self._gemma3_tokens()[0], list(images)
        rows = []
        for prompt in prompts:
            count = prompt.count(boi)
            rows.append(self.encode(prompt, audio, left[:count]) if count else self.encode(prompt, audio))
            left = left[count:]
        if left:
            raise ValueError(f"{len(images)} images were given but the prompts hold fewer {boi} placeholders")
        return rows

    def _gemma3_media(self, rows: list[list[int]], images: list, audio: list, videos: list) -> ExpandedRows:
        """Prompts whose image placeholders are already expanded (``encode`` and ``render_chat``
        expand them in the text, as Gemma3Processor), and the images' pixels."""
        if audio or videos:
            raise ValueError("Gemma 3 takes images only: it cannot take audio or videos")
        image_id = self.config.token_ids["image_token_id"]
        processed = process_images_gemma3(images, self._gemma3_images)
        per_image = self._gemma3_images.image_seq_length
        expected = per_image * processed["pixel_values"].shape[0]
        found = sum(row.count(image_id) for row in rows)
        if found != expected:
            raise ValueError(
                f"the prompts hold {found} image tokens but {len(images)} images (with "
                f"{sum(processed['num_crops'])} pan-and-scan crops) need {expected}: Gemma 3 prompts take "
                "each image's placeholder expanded in the text (LLM.chat and LLM.generate do this; see "
                "processing.gemma3_image.expand_image_text)"
            )
        types = [[int(token == image_id) for token in row] for row in rows]
        return ExpandedRows(rows, types, {"pixel_values": processed["pixel_values"]})

    def placeholder(self, kind: str) -> str:
        """The text that stands for one ``"image"``, ``"audio"`` clip or ``"video"`` in this
        checkpoint's prompts: Gemma 4's ``<|image|>`` / ``<|audio|>`` / ``<|video|>``, Gemma 3's
        ``<start_of_image>``, Gemma 3n's own soft-token spellings."""
        if kind not in ("image", "audio", "video"):
            raise ValueError(f"placeholder: kind must be 'image', 'audio' or 'video', got {kind!r}")
        config, tokenizer = self.config, self.tokenizer
        if config.siglip_vision is not None and kind == "image":  # Gemma 3: the image's start
            return tokenizer.id_to_token(config.token_ids["boi_token_id"])
        if config.gemma3n_audio is not None and kind != "video":
            return tokenizer.id_to_token(tokenizer.audio_id if kind == "audio" else tokenizer.image_id)
        return f"<|{kind}|>"

    def _media_tokens(self, images: list, audio: list, videos: list) -> MediaTokens:
        """The placeholder ids, after checking the checkpoint has the towers for these media."""
        config = self.config
        check_media_towers(config, images, audio, videos, towers_note=self.towers_note)
        try:
            tokens = MediaTokens.from_tokenizer(self.tokenizer)
        except UnknownTokenError as error:
            raise ValueError(f"the tokenizer lacks a multimodal token: {error}") from error
        # The model fills the positions of its config's ids; the tokenizer must write the same ones.
        named = [("image", tokens.image), ("audio", tokens.audio)]
        expected = config.token_ids
        if config.gemma3n_audio is not None:  # Gemma 3n: the ids are in its tower configs
            expected = {"audio_token_id": config.gemma3n_audio.audio_token_id}
            named = [("audio", tokens.audio)] if audio else []
            if config.gemma3n_vision is not None:
                expected["image_token_id"] = config.gemma3n_vision.image_token_id
                named += [("image", tokens.image)] if images else []
        if videos:
            if tokens.video is None:
                raise ValueError("the tokenizer has no <|video|> token: it cannot take videos")
            named.append(("video", tokens.video))
        for name, ours in named:
            theirs = expected.get(f"{name}_token_id")
            if theirs != ours:
                raise ValueError(
                    f"the tokenizer's {name} token id {ours} differs from config.json's {theirs}"
                )
        return tokens


def _image_soft_tokens(folder: Path | None) -> int:
    """Soft tokens per image from the checkpoint's processor config, as transformers saves it."""
    for name in ("processor_config.json", "preprocessor_config.json"):
        path = None if folder is None else folder / name
        if path is not None and path.is_file():
            data = json.loads(path.read_text(encoding="utf-8"))
            found = data.get("image_processor", data).get("max_soft_tokens")
            if found:
                return int(found)
    return DEFAULT_IMAGE_SOFT_TOKENS


def _video_settings(folder: Path | None) -> tuple[int, int | None]:
    """Soft tokens per frame and frames kept per video (None: all) from the checkpoint's video
    processor config, as transformers saves it (nested in processor_config.json, or on its own)."""
    found = processor_config_section(folder, "video_processor", "video_preprocessor_config.json")
    num_frames = found.get("num_frames", DEFAULT_NUM_FRAMES)
    if found.get("do_sample_frames") is False:
        num_frames = None
    return int(found.get("max_soft_tokens") or DEFAULT_VIDEO_SOFT_TOKENS), num_frames
