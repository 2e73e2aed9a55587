"""``LLM``: a checkpoint's model, tokenizer and generation defaults behind text in, text out.

    llm = LLM("path/to/gemma-4-E2B-it", dtype="bf16")
    llm.generate("The capital of France is", max_new_tokens=20)
    reply = llm.chat([{"role": "user", "content": "Hi!"}], enable_thinking=True)
    reply.thinking, reply.text
    llm.chat([{"role": "user", "content": [
        {"type": "image", "image": "cat.jpg"}, {"type": "text", "text": "What is this?"}]}])
    llm.generate("<|image|>A photo of", images=["cat.jpg"])
    llm.generate("<|video|>In this clip,", videos=["clip.mp4"])

Images (a path, PIL image or array), audio (a path, or a 16 kHz mono array) and videos (a path, a list
of frames, or a ``Video``) are preprocessed as transformers' Gemma 4 processor does, and each
``<|image|>`` / ``<|audio|>`` / ``<|video|>`` placeholder of the prompt is expanded into that item's
soft tokens (a video's frames each after its timestamp); raw prompts need one placeholder per item.

Sampling arguments (``temperature``, ``top_k``, ``top_p``, ``min_p``, ``repetition_penalty``,
``seed``, ``stop_token_ids``) are those of ``torchgemma.generation.generate``; what is left unset
takes the checkpoint's ``generation_config.json`` defaults (Gemma 4: sampling at temperature 1 with
top-k 64 and top-p 0.95). Pass ``temperature=0`` for greedy decoding.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch

from .embedding import MODULES_FILE, SentenceHead, embed_texts
from .generation import MEDIA_INPUTS, GenerationConfig, GenerationStats, stream
from .processing import MediaTokens, collect_media, collect_videos, gemma3n_audio, prepare_media_prompts
from .processing.image import PATCH_SIZE, POOLING_KERNEL
from .processing.unified import prepare_unified_prompts
from .processing.video import DEFAULT_NUM_FRAMES, DEFAULT_VIDEO_SOFT_TOKENS
from .tokenizer import Tokenizer, UnknownTokenError, load_tokenizer
from .tokenizer.chat_template import select_chat_template
from .weights.loading import load
from .weights.source import auto_quantization, resolve_source

# When neither the caller nor generation_config.json says how long a reply may be.
DEFAULT_MAX_NEW_TOKENS = 512
# Soft tokens per image when the checkpoint has no processor config (transformers' default).
DEFAULT_IMAGE_SOFT_TOKENS = 280


@dataclass(frozen=True)
class ChatResult:
    """A model reply: the answer and, kept apart, its thinking (None when the reply has none)."""

    text: str
    thinking: str | None
    token_ids: tuple[int, ...]
    # "stop": the model ended its turn; "length": max_new_tokens (or the context) ran out.
    finish_reason: Literal["stop", "length"]

    @property
    def message(self) -> dict[str, str]:
        """The reply as a chat message, to append to the conversation."""
        return {"role": "assistant", "content": self.text}


@dataclass(frozen=True)
class ChatChunk:
    """A piece of a streamed reply: answer text, or thinking text when ``thinking`` is True."""

    text: str
    thinking: bool = False


class ReplyStream:
    """Incremental (thinking, answer) split of a reply, one token at a time.

    The reply is decoded incrementally and re-parsed with the tokenizer's ``parse_reply`` after each
    token; what each part gained is emitted. So the pieces join to exactly what ``parse_reply`` gives
    for the whole reply, the same rule ``LLM.chat`` applies.
    """

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.decoder = tokenizer.stream_decoder()
        self.raw = ""
        self.thinking = ""
        self.answer = ""

    def push(self, token_id: int) -> list[ChatChunk]:
        self.raw += self.decoder.push(token_id)
        return self._emit()

    def flush(self) -> list[ChatChunk]:
        self.raw += self.decoder.flush()
        return self._emit()

    def _emit(self) -> list[ChatChunk]:
        thinking, answer = self.tokenizer.parse_reply(self.raw)
        chunks = []
        for is_thought, now in ((True, thinking or ""), (False, answer)):
            sent = self.thinking if is_thought else self.answer
            # A part only grows, except for whitespace the strip holds back until text follows it.
            if len(now) > len(sent) and now.startswith(sent):
                chunks.append(ChatChunk(now[len(sent) :], thinking=is_thought))
                if is_thought:
                    self.thinking = now
                else:
                    self.answer = now
        return chunks


class LLM:
    """A loaded checkpoint (local folder or hub id) ready to generate text.

    ``max_soft_tokens``: soft tokens per image (70, 140, 280, 560 or 1120); by default the
    checkpoint's processor config (``processor_config.json`` / ``preprocessor_config.json``), else 280.
    Videos keep ``video_num_frames`` frames of ``video_soft_tokens`` soft tokens each: the processor
    config's ``video_processor`` values, else 32 and 70 (attributes, which may be changed).
    ``quantize``: as in ``torchgemma.load`` (``"auto"``: the named model gemma3-270m keeps its GGUF
    blocks; ``"int8"``, ``"int4"``, ``"gguf"`` or None). ``activations``: as in ``torchgemma.load``
    (a quantized model's prefill on the CPU: ``"auto"``, ``"int16"``, ``"int8"`` or None).
    """

    def __init__(
        self,
        source: str | Path,
        dtype: torch.dtype | str | None = None,
        device: torch.device | str | None = None,
        *,
        attention: str = "sdpa",
        max_soft_tokens: int | None = None,
        progress: bool = True,
        quantize: str | None = "auto",
        activations: str | None = "auto",
    ) -> None:
        if quantize == "auto":
            quantize = auto_quantization(source)
        folder = resolve_source(source)
        self.folder = folder
        # Gemma 3n: chat templates with the audio placeholder expanded, by template (chat_template_for).
        self._expanded_templates: dict[str, str] = {}
        self.model = load(
            folder,
            dtype=dtype,
            device=device,
            attention=attention,
            progress=progress,
            quantize=quantize,
            activations=activations,
        )
        self.tokenizer = load_tokenizer(folder)
        self.max_soft_tokens = max_soft_tokens or _image_soft_tokens(folder)
        self.video_soft_tokens, self.video_num_frames = _video_settings(folder)
        text = self.model.config.text
        self.generation_config = GenerationConfig.from_folder(folder, text)
        if self.tokenizer.vocab_size > text.vocab_size:
            raise ValueError(
                f"{folder}: the tokenizer has {self.tokenizer.vocab_size} ids but the model only "
                f"{text.vocab_size} embedding rows"
            )

    @property
    def context_length(self) -> int:
        """Most tokens (prompt plus reply) one sequence can hold."""
        return self.model.config.text.max_position_embeddings

    # ---- prompts --------------------------------------------------------------------------------

    def encode(self, prompt: str) -> list[int]:
        """Token ids of a raw prompt, starting with ``<bos>`` as Gemma was trained.

        Gemma 4 tokenizers add no ``<bos>`` themselves (the chat template writes it), so it is added
        here unless the prompt's text already begins with it.
        """
        ids = self.tokenizer.encode(prompt)
        try:
            bos = self.tokenizer.bos_id
        except UnknownTokenError:
            return ids
        return ids if ids[:1] == [bos] else [bos, *ids]

    def chat_ids(
        self,
        messages: Sequence[Mapping[str, Any]],
        enable_thinking: bool = False,
        *,
        sanitize_control_tokens: bool = True,
    ) -> list[int]:
        """The conversation rendered with the checkpoint's chat template, ready for the model's turn.

        Media items appear as one ``<|image|>`` / ``<|audio|>`` placeholder each (not expanded).
        ``sanitize_control_tokens``: control tokens typed in the messages (``<turn|>``, ``<|image|>``)
        are encoded as plain text, so only the template writes control tokens; False lets trusted
        input write them (see ``Tokenizer.apply_chat_template``).
        """
        return self.tokenizer.apply_chat_template(
            messages,
            add_generation_prompt=True,
            enable_thinking=enable_thinking,
            sanitize_control_tokens=sanitize_control_tokens,
        )

    def inputs(
        self,
        prompts: Sequence[Sequence[int]],
        images: Sequence[Any] | None = None,
        audio: Sequence[Any] | None = None,
        videos: Sequence[Any] | None = None,
    ) -> dict[str, torch.Tensor]:
        """Model inputs for token prompts, as transformers' Gemma 4 processor returns them.

        ``input_ids`` and ``attention_mask`` (B, L) left-padded; with media, placeholders expanded
        (the i-th ``<|image|>`` over all rows takes ``images[i]``, likewise audio and videos), plus
        ``mm_token_type_ids`` and the preprocessed ``pixel_values`` / ``image_position_ids`` /
        ``input_features`` / ``input_features_mask`` / ``pixel_values_videos`` /
        ``video_position_ids`` / ``num_frames_per_video``. ``generate(llm.model, **inputs, ...)``
        runs them.
        """
        if not prompts or any(len(p) == 0 for p in prompts):
            raise ValueError("every prompt needs at least one token")
        images, audio, videos = list(images or ()), list(audio or ()), list(videos or ())
        if not images and not audio and not videos:
            input_ids, mask = self._left_pad(prompts, self.generation_config.pad_token_id or 0)
            return {"input_ids": input_ids, "attention_mask": mask}
        if self.model.config.gemma3n_audio is not None:
            return self._gemma3n_inputs(prompts, images, audio, videos)
        tokens = self._media_tokens(images, audio, videos)
        config = self.model.config
        if config.model_type == "gemma4_unified":
            # Patches and frames sized as the embedders take them (_media_tokens checked they exist).
            vision, frames = config.unified_vision, config.unified_audio
            prepared = prepare_unified_prompts(
                prompts,
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
        else:
            prepared = prepare_media_prompts(
                prompts,
                tokens,
                images,
                audio,
                self.max_soft_tokens,
                videos=videos,
                tokenizer=self.tokenizer,
                video_soft_tokens=self.video_soft_tokens,
                num_frames=self.video_num_frames,
            )
        input_ids, mask = self._left_pad(prepared.pop("input_ids"), self.generation_config.pad_token_id or 0)
        types, _ = self._left_pad(prepared.pop("mm_token_type_ids"), 0)
        return {"input_ids": input_ids, "attention_mask": mask, "mm_token_type_ids": types, **prepared}

    def chat_inputs(
        self,
        messages: Sequence[Mapping[str, Any]],
        enable_thinking: bool = False,
        *,
        sanitize_control_tokens: bool = True,
    ) -> dict[str, torch.Tensor]:
        """``inputs`` of a conversation: the chat template's ids with the media of its content items.

        With sanitizing, a ``<|image|>`` typed in text is text, not a placeholder for an image."""
        images, audio = collect_media(messages)
        ids = self.tokenizer.apply_chat_template(
            messages,
            add_generation_prompt=True,
            enable_thinking=enable_thinking,
            sanitize_control_tokens=sanitize_control_tokens,
            chat_template=self.chat_template_for(audio),
        )
        return self.inputs([ids], images, audio, collect_videos(messages))

    @property
    def takes_audio(self) -> bool:
        """Whether the checkpoint runs audio: an audio tower (Gemma 4, Gemma 3n) or embedder (unified)."""
        config = self.model.config
        return (
            config.audio_config is not None
            or config.gemma3n_audio is not None
            or (config.model_type == "gemma4_unified" and config.unified_audio is not None)
        )

    def chat_template_for(self, audio: Sequence[Any], tools: Sequence[Any] | None = None) -> str | None:
        """The chat template a conversation with these audio clips (and ``tools``) renders with: None
        (the tokenizer's own) except for Gemma 3n with audio, whose placeholder renders expanded in
        the text, as Gemma3nProcessor's does (the server renders conversations itself and uses this).
        Expanded once per template, on first use."""
        if not audio or self.model.config.gemma3n_audio is None:
            return None
        template = select_chat_template(
            self.tokenizer.chat_template, tools=tools, source=self.tokenizer.name_or_path
        )
        if template not in self._expanded_templates:
            self._expanded_templates[template] = gemma3n_audio.expand_audio_in_template(
                template, self.tokenizer, self.model.config.gemma3n_audio.soft_tokens_per_clip
            )
        return self._expanded_templates[template]

    # ---- generation -----------------------------------------------------------------------------

    def generate_ids(
        self,
        prompts: Sequence[Sequence[int]],
        *,
        images: Sequence[Any] | None = None,
        audio: Sequence[Any] | None = None,
        videos: Sequence[Any] | None = None,
        max_new_tokens: int | None = None,
        stats: GenerationStats | None = None,
        **sampling: Any,
    ) -> list[list[int]]:
        """New token ids for each prompt (left-padded into one batch), each cut after its stop token.

        ``images`` / ``audio`` / ``videos`` fill the prompts' placeholders in order (see ``inputs``).
        """
        inputs = self.inputs(prompts, images, audio, videos)
        return self._collect(inputs, max_new_tokens, stats, sampling)

    def _collect(
        self, inputs: dict, max_new_tokens: int | None, stats: GenerationStats | None, sampling: dict
    ) -> list[list[int]]:
        stops = self._stop_ids(sampling)
        rows = [[] for _ in range(len(inputs["input_ids"]))]
        ended = [False] * len(rows)
        for tokens in self._stream(inputs, max_new_tokens, stats, sampling):
            for row, token in enumerate(tokens.tolist()):
                if not ended[row]:
                    rows[row].append(token)
                    ended[row] = token in stops
        return rows

    def generate(
        self,
        prompt: str | Sequence[str],
        *,
        images: Sequence[Any] | None = None,
        audio: Sequence[Any] | None = None,
        videos: Sequence[Any] | None = None,
        max_new_tokens: int | None = None,
        stats: GenerationStats | None = None,
        **sampling: Any,
    ) -> str | list[str]:
        """Continue a raw prompt (or a list of prompts, run as one batch); returns the new text.

        The text is decoded with special tokens kept, without the stop token that ended it.
        ``images`` / ``audio`` / ``videos`` need one ``<|image|>`` / ``<|audio|>`` / ``<|video|>``
        placeholder each in the prompt text (over all prompts, in order).
        """
        prompts = [prompt] if isinstance(prompt, str) else list(prompt)
        ids = self.generate_ids(
            [self._encode_prompt(p, audio) for p in prompts],
            images=images,
            audio=audio,
            videos=videos,
            max_new_tokens=max_new_tokens,
            stats=stats,
            **sampling,
        )
        stops = self._stop_ids(sampling)
        texts = [self.tokenizer.decode(_without_stop(row, stops)) for row in ids]
        return texts[0] if isinstance(prompt, str) else texts

    def stream(
        self,
        prompt: str,
        *,
        images: Sequence[Any] | None = None,
        audio: Sequence[Any] | None = None,
        videos: Sequence[Any] | None = None,
        max_new_tokens: int | None = None,
        stats: GenerationStats | None = None,
        **sampling: Any,
    ) -> Iterator[str]:
        """Like ``generate`` for one prompt, yielding text pieces as they complete."""
        inputs = self.inputs([self._encode_prompt(prompt, audio)], images, audio, videos)
        yield from self._stream_text(inputs, max_new_tokens, stats, sampling)

    def chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        enable_thinking: bool = False,
        sanitize_control_tokens: bool = True,
        max_new_tokens: int | None = None,
        stats: GenerationStats | None = None,
        **sampling: Any,
    ) -> ChatResult:
        """The model's next turn in a conversation of ``{"role", "content"}`` messages.

        ``content`` is a string or a list of items: ``{"type": "text", "text": ...}``,
        ``{"type": "image", "image": path | PIL image | array}``, ``{"type": "audio", "audio":
        path | 16 kHz array}`` and ``{"type": "video", "video": path | list of frames | Video}``
        (``"url"`` / ``"path"`` keys hold local paths or ``file://`` URLs).
        Control tokens typed in the messages stay text unless ``sanitize_control_tokens=False``
        (see ``chat_ids``).
        """
        sampling = self._chat_sampling(sampling)
        inputs = self.chat_inputs(messages, enable_thinking, sanitize_control_tokens=sanitize_control_tokens)
        ids = self._collect(inputs, max_new_tokens, stats, sampling)[0]
        stops = self._stop_ids(sampling)
        stopped = bool(ids) and ids[-1] in stops
        thinking, answer = self.tokenizer.parse_reply(self.tokenizer.decode(_without_stop(ids, stops)))
        return ChatResult(
            text=answer,
            thinking=thinking,
            token_ids=tuple(ids),
            finish_reason="stop" if stopped else "length",
        )

    def stream_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        enable_thinking: bool = False,
        sanitize_control_tokens: bool = True,
        max_new_tokens: int | None = None,
        stats: GenerationStats | None = None,
        **sampling: Any,
    ) -> Iterator[ChatChunk]:
        """Like ``chat``, yielding the reply as it comes: thinking and answer pieces, tagged apart.

        The answer pieces join to ``chat(...).text`` and the thinking pieces to ``.thinking``.
        """
        sampling = self._chat_sampling(sampling)
        inputs = self.chat_inputs(messages, enable_thinking, sanitize_control_tokens=sanitize_control_tokens)
        stops = self._stop_ids(sampling)
        reply = ReplyStream(self.tokenizer)
        for tokens in self._stream(inputs, max_new_tokens, stats, sampling):
            token = int(tokens[0])
            if token in stops:
                break
            yield from reply.push(token)
        yield from reply.flush()

    # ---- sentence embeddings --------------------------------------------------------------------

    @property
    def has_sentence_head(self) -> bool:
        """Whether the checkpoint is a sentence-transformers folder (``modules.json``): ``embed`` works."""
        return (Path(self.folder) / MODULES_FILE).is_file()

    @functools.cached_property
    def sentence_head(self) -> SentenceHead:
        """The checkpoint's sentence-transformers modules after the decoder (pooling, dense layers,
        normalisation) and its task prompts, read on first use (see ``torchgemma.embedding``)."""
        head = SentenceHead.from_folder(self.folder, self.model.config.text)
        return head.to(device=self.model.device, dtype=self.model.dtype)

    def embed(
        self,
        texts: str | Sequence[str],
        *,
        prompt_name: str | None = None,
        prompt: str | None = None,
        batch_size: int = 32,
        truncate_dim: int | None = None,
    ) -> torch.Tensor:
        """Sentence vectors (N, D) of ``texts`` (one text: (D,)), as sentence-transformers'
        ``SentenceTransformer(folder).encode(texts, ...)`` computes them, for a sentence-transformers
        checkpoint such as EmbeddingGemma.

        ``prompt_name`` picks a task prompt of the checkpoint's ``config_sentence_transformers.json``
        (EmbeddingGemma: ``"query"``, ``"document"``, ...), written before each text; ``prompt`` is a
        literal one; with neither, the checkpoint's default prompt (if any). ``truncate_dim`` keeps
        the first dimensions (Matryoshka), not re-normalized.
        """
        return embed_texts(
            self.model,
            self.tokenizer,
            self.sentence_head,
            texts,
            prompt_name=prompt_name,
            prompt=prompt,
            batch_size=batch_size,
            truncate_dim=truncate_dim,
        )

    # ---- helpers --------------------------------------------------------------------------------

    def _stream_text(
        self, inputs: dict, max_new_tokens: int | None, stats: GenerationStats | None, sampling: dict
    ) -> Iterator[str]:
        stops = self._stop_ids(sampling)
        decoder = self.tokenizer.stream_decoder()
        for tokens in self._stream(inputs, max_new_tokens, stats, sampling):
            token = int(tokens[0])
            if token in stops:
                break
            piece = decoder.push(token)
            if piece:
                yield piece
        rest = decoder.flush()
        if rest:
            yield rest

    def _stream(
        self,
        inputs: dict[str, torch.Tensor],
        max_new_tokens: int | None,
        stats: GenerationStats | None,
        sampling: dict,
    ) -> Iterator[torch.Tensor]:
        if max_new_tokens is None:
            max_new_tokens = self.generation_config.max_new_tokens or DEFAULT_MAX_NEW_TOKENS
        media = {name: inputs[name] for name in MEDIA_INPUTS if name in inputs}
        return stream(
            self.model,
            inputs["input_ids"],
            attention_mask=inputs["attention_mask"],
            **media,
            max_new_tokens=max_new_tokens,
            generation_config=self.generation_config,
            stats=stats,
            **sampling,
        )

    def _stop_ids(self, sampling: Mapping[str, Any]) -> frozenset[int]:
        stops = sampling.get("stop_token_ids")
        return frozenset(self.generation_config.eos_token_ids if stops is None else stops)

    def _chat_sampling(self, sampling: dict) -> dict:
        # A chat reply ends with the end-of-turn token, whether or not the checkpoint's eos list has it.
        if sampling.get("stop_token_ids") is not None:
            return sampling
        try:
            turn_end = self.tokenizer.turn_end_id
        except UnknownTokenError:
            return sampling
        stops = tuple(self.generation_config.eos_token_ids)
        return {**sampling, "stop_token_ids": stops if turn_end in stops else (*stops, turn_end)}

    def _encode_prompt(self, prompt: str, audio: Sequence[Any] | None) -> list[int]:
        """``encode``; Gemma 3n with audio: the placeholders expanded in the text first, as its processor."""
        if audio and self.model.config.gemma3n_audio is not None:
            soft = self.model.config.gemma3n_audio.soft_tokens_per_clip
            prompt = gemma3n_audio.expand_audio_text(prompt, self.tokenizer, soft)
        return self.encode(prompt)

    def _gemma3n_inputs(
        self, prompts: Sequence[Sequence[int]], images: list, audio: list, videos: list
    ) -> dict:
        """Gemma 3n: prompts whose audio placeholders are already expanded (``chat_inputs`` and
        ``generate`` expand them in the text, as Gemma3nProcessor), and the clips' features."""
        tokens = self._media_tokens(images, audio, videos)
        soft = self.model.config.gemma3n_audio.soft_tokens_per_clip
        found = sum(list(p).count(tokens.audio) for p in prompts)
        if found != soft * len(audio):
            raise ValueError(
                f"the prompts hold {found} audio placeholder tokens but {len(audio)} clips need "
                f"{soft} each: Gemma 3n prompts take each clip's placeholder expanded in the text "
                "(LLM.chat and LLM.generate do this; see processing.gemma3n_audio.expand_audio_text)"
            )
        input_ids, mask = self._left_pad(prompts, self.generation_config.pad_token_id or 0)
        settings = gemma3n_audio.feature_settings(self.folder) if self.folder.is_dir() else {}
        features = gemma3n_audio.process_audio_gemma3n(audio, **settings)
        return {"input_ids": input_ids, "attention_mask": mask, **features}

    def _media_tokens(self, images: list, audio: list, videos: list = ()) -> MediaTokens:
        """The placeholder ids, after checking the checkpoint has the towers for these media."""
        config = self.model.config
        vision = config.vision_config
        visual = "images" if images else "videos" if videos else None
        if config.model_type == "gemma4_unified":
            # Encoder-free embedders rather than towers (model/unified.py).
            for given, embedder, kind in (
                (images or videos, config.unified_vision, "vision"),
                (audio, config.unified_audio, "audio"),
            ):
                if given and embedder is None:
                    raise ValueError(
                        f"this gemma4_unified checkpoint has no {kind}_config: it cannot take {kind} input"
                    )
        elif visual and vision is None:
            raise ValueError(
                f"this checkpoint has no vision tower torchgemma builds ({self.model.towers_note}): "
                f"it cannot take {visual}"
            )
        elif visual and (vision.patch_size, vision.pooling_kernel_size) != (PATCH_SIZE, POOLING_KERNEL):
            raise ValueError(
                f"image preprocessing makes {PATCH_SIZE} px patches pooled {POOLING_KERNEL}x{POOLING_KERNEL}, "
                f"but this vision tower takes {vision.patch_size} px patches pooled "
                f"{vision.pooling_kernel_size}x{vision.pooling_kernel_size}"
            )
        if audio and not self.takes_audio:
            raise ValueError(
                f"this checkpoint has no audio tower torchgemma builds ({self.model.towers_note}): "
                "it cannot take audio"
            )
        try:
            tokens = MediaTokens.from_tokenizer(self.tokenizer)
        except UnknownTokenError as error:
            raise ValueError(f"the tokenizer lacks a multimodal token: {error}") from error
        # The model fills the positions of its config's ids; the tokenizer must write the same ones.
        named = [("image", tokens.image), ("audio", tokens.audio)]
        expected = config.token_ids
        if config.gemma3n_audio is not None:  # Gemma 3n: audio only; its id is in the audio config
            named = [("audio", tokens.audio)]
            expected = {"audio_token_id": config.gemma3n_audio.audio_token_id}
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

    @staticmethod
    def _left_pad(prompts: Sequence[Sequence[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
        width = max(len(p) for p in prompts)
        input_ids = torch.full((len(prompts), width), pad, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for row, ids in enumerate(prompts):
            input_ids[row, width - len(ids) :] = torch.tensor(list(ids), dtype=torch.long)
            mask[row, width - len(ids) :] = 1
        return input_ids, mask


def _image_soft_tokens(folder: Path) -> int:
    """Soft tokens per image from the checkpoint's processor config, as transformers saves it."""
    for name in ("processor_config.json", "preprocessor_config.json"):
        path = folder / name
        if folder.is_dir() and path.is_file():
            data = json.loads(path.read_text(encoding="utf-8"))
            found = data.get("image_processor", data).get("max_soft_tokens")
            if found:
                return int(found)
    return DEFAULT_IMAGE_SOFT_TOKENS


def _video_settings(folder: Path) -> tuple[int, int | None]:
    """Soft tokens per frame and frames kept per video (None: all) from the checkpoint's video
    processor config, as transformers saves it (nested in processor_config.json, or on its own)."""
    found: dict[str, Any] = {}
    if folder.is_dir():
        nested, alone = folder / "processor_config.json", folder / "video_preprocessor_config.json"
        if nested.is_file():
            found = json.loads(nested.read_text(encoding="utf-8")).get("video_processor") or {}
        if not found and alone.is_file():
            found = json.loads(alone.read_text(encoding="utf-8"))
    num_frames = found.get("num_frames", DEFAULT_NUM_FRAMES)
    if found.get("do_sample_frames") is False:
        num_frames = None
    return int(found.get("max_soft_tokens") or DEFAULT_VIDEO_SOFT_TOKENS), num_frames


def _without_stop(ids: Sequence[int], stops: frozenset[int]) -> list[int]:
    return list(ids[:-1]) if ids and ids[-1] in stops else list(ids)
