"""``LLM``: a checkpoint's model, processor and generation defaults behind text in, text out.

    llm = LLM("path/to/gemma-4-E2B-it", dtype="bf16")
    llm.generate("The capital of France is", max_new_tokens=20)
    reply = llm.chat([{"role": "user", "content": "Hi!"}], enable_thinking=True)
    reply.thinking, reply.text
    llm.chat([{"role": "user", "content": [
        {"type": "image", "image": "cat.jpg"}, {"type": "text", "text": "What is this?"}]}])
    llm.chat(messages, tools=[{"type": "function", "function": {"name": "get_weather", ...}}]).tool_calls
    llm.generate("<|image|>A photo of", images=["cat.jpg"])
    llm.generate("<|video|>In this clip,", videos=["clip.mp4"])

Requests go in through the checkpoint's ``Processor`` (``llm.processor``: prompts, chat templates,
images, audio and videos as transformers' processor prepares them; see processing/processor.py) and
replies come out through Gemma's reply grammar (``torchgemma.replies``: thinking, answer, tool calls).

Sampling: ``sampling=SamplingParams(...)``, or its settings by name (``temperature``, ``top_k``,
``top_p``, ``min_p``, ``repetition_penalty``, ``presence_penalty``, ``frequency_penalty``, ``seed``), with
what is left unset taking the checkpoint's ``generation_config.json`` defaults (Gemma 4: sampling at
temperature 1 with top-k 64 and top-p 0.95). Pass ``temperature=0`` for greedy decoding. ``stop_token_ids`` replaces the
checkpoint's stop tokens (``[]``: never stop).

Constrained output (``generation/constraints.py``): ``response_format=`` (OpenAI's dict, a pydantic
model class or a ``Grammar``) everywhere; ``tool_choice=``, ``parallel_tool_calls=`` in chats.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch

from .embedding import MODULES_FILE, SentenceHead, check_embedding_rows
from .embedding_media import EmbeddingInput, embed_inputs
from .generation import MEDIA_INPUTS, GenerationConfig, GenerationStats, Grammar, SamplingParams, stream
from .generation.constraints import chat_grammar, grammar_for_response_format
from .generation.generate import left_pad
from .generation.prefix_cache import prefix_cache_of
from .generation.speculative import speculative_config
from .model.inputs import MediaInputs
from .processing.processor import ProcessedPrompt, Processor
from .replies import Delta, ReplyStream, ToolCall, parse_reply
from .tokenizer import UnknownTokenError, load_tokenizer
from .weights.loading import load
from .weights.source import resolve_source

# The prefix cache's bound (GiB): the 270M in float32 keeps ~36 KiB per token (~29k tokens), E2B in
# bf16 ~18 KiB (15 of its 35 layers own keys); it fills only as prompts are seen.
DEFAULT_PREFIX_CACHE_GB = 1.0
# The sampling settings the public methods take by name (folded into one SamplingParams).
SAMPLING_SETTINGS = (
    "temperature", "top_k", "top_p", "min_p", "repetition_penalty", "seed", "logit_bias",
    "presence_penalty", "frequency_penalty",
)  # fmt: skip


@dataclass(frozen=True)
class ChatResult:
    """A model reply: the answer, its thinking kept apart (None when the reply has none), and the
    tool calls it made (when ``tools`` were offered)."""

    text: str
    thinking: str | None
    token_ids: tuple[int, ...]
    # "stop": the model ended its turn; "length": max_new_tokens (or the context) ran out.
    finish_reason: Literal["stop", "length"]
    tool_calls: tuple[ToolCall, ...] = ()

    @property
    def message(self) -> dict[str, Any]:
        """The reply as a chat message, to append to the conversation (with its tool calls, as the
        chat template reads them back)."""
        message: dict[str, Any] = {"role": "assistant", "content": self.text}
        if self.tool_calls:
            message["tool_calls"] = [call.template_entry() for call in self.tool_calls]
        return message


@dataclass(frozen=True)
class ChatChunk:
    """A piece of a streamed reply: answer text, thinking text when ``thinking`` is True, or a
    complete tool call (``tool_call``, with empty text)."""

    text: str
    thinking: bool = False
    tool_call: ToolCall | None = None


def _processor_setting(name: str) -> property:
    """An attribute of the LLM that reads and writes the processor's own."""
    return property(
        lambda self: getattr(self.processor, name), lambda self, value: setattr(self.processor, name, value)
    )


class LLM:
    """A loaded checkpoint (local folder or hub id) ready to generate text.

    ``max_soft_tokens``: soft tokens per image (70, 140, 280, 560 or 1120); by default the
    checkpoint's processor config (``processor_config.json`` / ``preprocessor_config.json``), else 280.
    Videos keep ``video_num_frames`` frames of ``video_soft_tokens`` soft tokens each: the processor
    config's ``video_processor`` values, else 32 and 70 (attributes, which may be changed).
    ``quantize``, ``activations``, ``mmproj`` (llama.cpp's towers file beside a .gguf model) and other
    keywords (``tensor_parallel_size``, ``expert_parallel``: many devices): as in ``torchgemma.load``
    (``quantize="auto"``: a .gguf file or gemma3-270m keeps its GGUF blocks).
    ``prefix_cache_gb``: the memory (GiB) of the prefix cache the LLM keeps across calls
    (``llm.prefix_cache``, a ``generation.prefix_cache.PrefixCache``): a prompt that begins as an
    earlier one did (the conversation so far, a shared system prompt) prefills only the rest, with
    the same results; ``llm.prefix_cache.stats()`` counts what it saved. 0 turns it off.
    ``speculative``: speculative decoding for every call (``generation/speculative.py``): ``"ngram"``,
    ``{"method": "ngram" | "mtp", "num_tokens": k, "model": ...}``; the same tokens when greedy.
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
        prefix_cache_gb: float = DEFAULT_PREFIX_CACHE_GB,
        mmproj: str | Path | None = None,
        speculative: Any = None,
        **load_options: Any,
    ) -> None:
        prefix_cache = prefix_cache_of(prefix_cache_gb)  # checked before the load
        folder = resolve_source(source)
        self.folder = folder
        # The source, not the folder: load resolves it again and reads quantize="auto" from its name.
        self.model = load(
            source,
            dtype=dtype,
            device=device,
            attention=attention,
            progress=progress,
            quantize=quantize,
            mmproj=mmproj,
            **load_options,
        )
        self.tokenizer = load_tokenizer(folder)
        text = self.model.config.text
        self.generation_config = GenerationConfig.from_folder(folder, text)
        # Added tokens may reach past the embedding table (EmbeddingGemma and Gemma 3 270M/1B map
        # <image_soft_token> to 262144, one past theirs): legal, until a prompt uses one (checked before
        # the model runs). Vocabulary pieces past it would come out of plain text: another model's.
        pieces = self.tokenizer.backend.get_vocab_size(with_added_tokens=False)
        if pieces > text.vocab_size:
            raise ValueError(
                f"{folder}: the tokenizer has {pieces} ids but the model only {text.vocab_size} "
                "embedding rows, before any added token: is the tokenizer another model's?"
            )
        self.processor = Processor(
            self.tokenizer,
            self.model.config,
            folder,
            max_soft_tokens=max_soft_tokens,
            towers_note=self.model.towers_note,
        )
        self.prefix_cache = prefix_cache
        self.speculative = speculative_config(speculative, self.model)

    @property
    def context_length(self) -> int:
        """Most tokens (prompt plus reply) one sequence can hold."""
        return self.model.config.text.max_position_embeddings

    # The processor's settings, as attributes of the LLM too (see the class docstring).
    max_soft_tokens = _processor_setting("max_soft_tokens")
    video_soft_tokens = _processor_setting("video_soft_tokens")
    video_num_frames = _processor_setting("video_num_frames")

    @property
    def takes_audio(self) -> bool:
        """Whether the checkpoint runs audio: an audio tower (Gemma 4, Gemma 3n) or embedder (unified)."""
        return self.processor.takes_audio

    # ---- prompts (the processor's) --------------------------------------------------------------

    def encode(self, prompt: str, audio: Sequence | None = None, images: Sequence | None = None) -> list[int]:
        """Token ids of a raw prompt, starting with ``<bos>`` (Gemma 3 and 3n: placeholders of ``audio``
        / ``images`` expanded in the text first); see ``Processor.encode``."""
        return self.processor.encode(prompt, audio, images)

    def chat_ids(
        self,
        messages: Sequence[Mapping[str, Any]],
        enable_thinking: bool = False,
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        sanitize_control_tokens: bool = True,
    ) -> list[int]:
        """The conversation rendered with the checkpoint's chat template, ready for the model's turn.

        Media items appear as one ``<|image|>`` / ``<|audio|>`` placeholder each (not expanded).
        ``sanitize_control_tokens``: control tokens typed in the messages (``<turn|>``, ``<|image|>``)
        are encoded as plain text, so only the template writes control tokens; False lets trusted
        input write them (see ``Tokenizer.apply_chat_template``).
        """
        return self.processor.chat_ids(
            messages,
            enable_thinking=enable_thinking,
            tools=tools,
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
        ``video_position_ids`` / ``num_frames_per_video``.
        """
        expanded = self.processor.expand(prompts, images, audio, videos)
        input_ids, mask = left_pad(expanded.input_ids, self.generation_config.pad_token_id or 0)
        inputs = {"input_ids": input_ids, "attention_mask": mask}
        if expanded.mm_token_type_ids is not None:
            inputs["mm_token_type_ids"] = left_pad(expanded.mm_token_type_ids, 0)[0]
        return {**inputs, **expanded.media}

    def chat_inputs(
        self,
        messages: Sequence[Mapping[str, Any]],
        enable_thinking: bool = False,
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        sanitize_control_tokens: bool = True,
    ) -> dict[str, torch.Tensor]:
        """``inputs`` of a conversation: the chat template's ids with the media of its content items.

        With sanitizing, a ``<|image|>`` typed in text is text, not a placeholder for an image."""
        prompt = self.processor.chat(
            messages,
            enable_thinking=enable_thinking,
            tools=tools,
            sanitize_control_tokens=sanitize_control_tokens,
        )
        ids = torch.tensor([prompt.input_ids], dtype=torch.long)
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids), **prompt.media.as_dict()}

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
        sampling: SamplingParams | None = None,
        **settings: Any,
    ) -> list[list[int]]:
        """New token ids for each prompt (left-padded into one batch), each cut after its stop token.

        ``images`` / ``audio`` / ``videos`` fill the prompts' placeholders in order (see ``inputs``).
        """
        run = self._settings(sampling, settings, max_new_tokens, stats)
        return self._collect(self.inputs(prompts, images, audio, videos), run)

    def generate(
        self,
        prompt: str | Sequence[str],
        *,
        images: Sequence[Any] | None = None,
        audio: Sequence[Any] | None = None,
        videos: Sequence[Any] | None = None,
        max_new_tokens: int | None = None,
        stats: GenerationStats | None = None,
        sampling: SamplingParams | None = None,
        **settings: Any,
    ) -> str | list[str]:
        """Continue a raw prompt (or a list of prompts, run as one batch); returns the new text.

        The text is decoded with special tokens kept, without the stop token that ended it.
        ``images`` / ``audio`` / ``videos`` need one ``<|image|>`` / ``<|audio|>`` / ``<|video|>``
        placeholder each in the prompt text (over all prompts, in order).
        """
        prompts = [prompt] if isinstance(prompt, str) else list(prompt)
        run = self._settings(sampling, settings, max_new_tokens, stats)
        inputs = self.inputs(self.processor.encode_all(prompts, audio, images), images, audio, videos)
        texts = [self.tokenizer.decode(_without_stop(row, run.stops)) for row in self._collect(inputs, run)]
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
        sampling: SamplingParams | None = None,
        **settings: Any,
    ) -> Iterator[str]:
        """Like ``generate`` for one prompt, yielding text pieces as they complete."""
        run = self._settings(sampling, settings, max_new_tokens, stats)
        request = self.processor(prompt, images=images, audio=audio, videos=videos)
        decoder = self.tokenizer.stream_decoder()
        for token in self._tokens(request, run):
            piece = decoder.push(token)
            if piece:
                yield piece
        rest = decoder.flush()
        if rest:
            yield rest

    def chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        enable_thinking: bool = False,
        tools: Sequence[Mapping[str, Any]] | None = None,
        sanitize_control_tokens: bool = True,
        max_new_tokens: int | None = None,
        stats: GenerationStats | None = None,
        sampling: SamplingParams | None = None,
        **settings: Any,
    ) -> ChatResult:
        """The model's next turn in a conversation of ``{"role", "content"}`` messages.

        ``content`` is a string or a list of items: ``{"type": "text", "text": ...}``,
        ``{"type": "image", "image": path | PIL image | array}``, ``{"type": "audio", "audio":
        path | 16 kHz array}`` and ``{"type": "video", "video": path | list of frames | Video}``
        (``"url"`` / ``"path"`` keys hold local paths or ``file://`` URLs).
        ``tools``: JSON-schema function definitions (``{"type": "function", "function": {"name",
        "description", "parameters"}}``) the chat template offers the model; the calls it makes
        come back parsed in ``tool_calls`` (answer them with ``{"role": "tool", "name", "content"}``
        messages after ``result.message``).
        Control tokens typed in the messages stay text unless ``sanitize_control_tokens=False``
        (see ``chat_ids``).
        """
        # A response format starts at the first token: no thought before it.
        enable_thinking = enable_thinking and settings.get("response_format") is None
        context = {"tools": tools, "thinking": enable_thinking}
        run = self._settings(sampling, settings, max_new_tokens, stats, chat=context)
        request = self.processor.chat(
            messages,
            enable_thinking=enable_thinking,
            tools=tools,
            sanitize_control_tokens=sanitize_control_tokens,
        )
        ids = list(self._tokens(request, run, keep_stop=True))
        stopped = bool(ids) and ids[-1] in run.stops
        reply = parse_reply(self.tokenizer.decode(_without_stop(ids, run.stops)), tools=bool(tools))
        return ChatResult(
            text=reply.content,
            thinking=reply.reasoning,
            token_ids=tuple(ids),
            finish_reason="stop" if stopped else "length",
            tool_calls=tuple(reply.tool_calls),
        )

    def stream_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        enable_thinking: bool = False,
        tools: Sequence[Mapping[str, Any]] | None = None,
        sanitize_control_tokens: bool = True,
        max_new_tokens: int | None = None,
        stats: GenerationStats | None = None,
        sampling: SamplingParams | None = None,
        **settings: Any,
    ) -> Iterator[ChatChunk]:
        """Like ``chat``, yielding the reply as it comes: thinking and answer pieces, tagged apart,
        and each tool call once complete.

        The answer pieces join to ``chat(...).text``, the thinking pieces to ``.thinking`` and the
        tool calls are ``.tool_calls``.
        """
        # A response format starts at the first token: no thought before it.
        enable_thinking = enable_thinking and settings.get("response_format") is None
        context = {"tools": tools, "thinking": enable_thinking}
        run = self._settings(sampling, settings, max_new_tokens, stats, chat=context)
        request = self.processor.chat(
            messages,
            enable_thinking=enable_thinking,
            tools=tools,
            sanitize_control_tokens=sanitize_control_tokens,
        )
        decoder = self.tokenizer.stream_decoder()
        reply = ReplyStream(tools=bool(tools))
        for token in self._tokens(request, run):
            yield from map(_chunk, reply.push(decoder.push(token)))
        yield from map(_chunk, reply.push(decoder.flush()) + reply.finish())

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
        texts: EmbeddingInput | Sequence[EmbeddingInput],
        *,
        prompt_name: str | None = None,
        prompt: str | None = None,
        batch_size: int = 32,
        truncate_dim: int | None = None,
    ) -> torch.Tensor:
        """Sentence vectors (N, D) of ``texts`` (one: (D,)), as sentence-transformers computes them,
        for a sentence-transformers checkpoint (EmbeddingGemma, EmbeddingGemma 2). EmbeddingGemma 2
        also takes ``{"image": ..., "audio": ..., "text": ...}`` items (see torchgemma.embedding_media).
        ``prompt_name`` picks a task prompt of the checkpoint's ``config_sentence_transformers.json``
        (``"query"``, ``"document"``, ...), written before each text; ``prompt`` is a literal one;
        with neither, the checkpoint's default prompt (if any). ``truncate_dim`` keeps the first
        dimensions (Matryoshka), not re-normalized.
        """
        return embed_inputs(
            self.model,
            self.processor,
            self.sentence_head,
            texts,
            prompt_name=prompt_name,
            prompt=prompt,
            batch_size=batch_size,
            truncate_dim=truncate_dim,
        )

    # ---- helpers --------------------------------------------------------------------------------

    def _settings(
        self,
        sampling: SamplingParams | None,
        settings: Mapping[str, Any],
        max_new_tokens: int | None,
        stats: GenerationStats | None,
        *,
        chat: Mapping[str, Any] | bool = False,
    ) -> _Run:
        """One call's generation settings: the sampling settings given by name folded into one
        ``SamplingParams`` (the checkpoint's defaults for the rest), unless ``sampling`` is given."""
        settings = dict(settings)
        stops = settings.pop("stop_token_ids", None)
        grammar = self._grammar(settings, chat)
        unknown = sorted(set(settings) - set(SAMPLING_SETTINGS))
        if unknown:
            raise TypeError(f"unknown generation settings: {', '.join(unknown)}")
        if sampling is not None and settings:
            raise TypeError(f"sampling= or {', '.join(settings)}, not both")
        if sampling is None:
            sampling = self.generation_config.sampling(**settings)
        if stops is None:
            stops = self.generation_config.eos_token_ids
            # A chat reply ends with the end-of-turn token, whether or not the checkpoint's eos list has it.
            turn_end = self._turn_end_id() if chat else None
            if turn_end is not None and turn_end not in stops:
                stops = (*stops, turn_end)
        if max_new_tokens is None:
            max_new_tokens = self.generation_config.reply_limit(bool(self.tokenizer.chat_template))
        return _Run(sampling, tuple(stops), max_new_tokens, stats, grammar)

    def _grammar(self, settings: dict[str, Any], chat: Mapping[str, Any] | bool) -> Grammar | None:
        """The call's constraint (``chat_grammar``; ``chat`` holds a chat's tools), popped from ``settings``."""
        response_format = settings.pop("response_format", None)
        if not chat:
            return grammar_for_response_format(self.tokenizer, response_format)
        choice = settings.pop("tool_choice", None)
        parallel = settings.pop("parallel_tool_calls", None)
        context = chat if isinstance(chat, Mapping) else {}
        return chat_grammar(
            self.tokenizer,
            response_format=response_format,
            tools=context.get("tools"),
            tool_choice=choice,
            parallel_tool_calls=parallel,
            thinking=bool(context.get("thinking")),
        )

    def _turn_end_id(self) -> int | None:
        try:
            return self.tokenizer.turn_end_id
        except UnknownTokenError:
            return None

    def _stream(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None,
        media: MediaInputs | None,
        run: _Run,
    ) -> Iterator[torch.Tensor]:
        """The next token of every row (B,), step by step: ``generation.stream`` with the call's settings."""
        check_embedding_rows(input_ids, self.tokenizer, self.model.config.text.vocab_size)
        return stream(
            self.model,
            input_ids,
            attention_mask=attention_mask,
            media=media,
            max_new_tokens=run.max_new_tokens,
            sampling=run.sampling,
            stop_token_ids=run.stops,
            generation_config=self.generation_config,
            stats=run.stats,
            prefix_cache=self.prefix_cache,
            constraint=run.grammar,
            speculative=self.speculative,
        )

    def _tokens(self, request: ProcessedPrompt, run: _Run, *, keep_stop: bool = False) -> Iterator[int]:
        """One request's new tokens, unpadded, up to its stop token (included with ``keep_stop``)."""
        ids = torch.tensor([request.input_ids], dtype=torch.long)
        for tokens in self._stream(ids, None, request.media or None, run):
            token = int(tokens[0])
            if token in run.stops and not keep_stop:
                return
            yield token
            if token in run.stops:
                return

    def _collect(self, inputs: dict[str, torch.Tensor], run: _Run) -> list[list[int]]:
        """Each row's new tokens of a padded batch (``inputs``), cut after its stop token."""
        media = MediaInputs.from_dict({name: inputs[name] for name in MEDIA_INPUTS if name in inputs})
        rows: list[list[int]] = [[] for _ in range(len(inputs["input_ids"]))]
        ended = [False] * len(rows)
        for tokens in self._stream(inputs["input_ids"], inputs["attention_mask"], media or None, run):
            for row, token in enumerate(tokens.tolist()):
                if not ended[row]:
                    rows[row].append(token)
                    ended[row] = token in run.stops
        return rows


def embed(
    texts: EmbeddingInput | Sequence[EmbeddingInput],
    *,
    model: LLM | str | Path,
    prompt_name: str | None = None,
    prompt: str | None = None,
    batch_size: int = 32,
    truncate_dim: int | None = None,
    dtype: torch.dtype | str | None = None,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """Sentence vectors of ``texts`` (and media: EmbeddingGemma 2) from a sentence-transformers checkpoint.

    ``model``: an ``LLM``, or what ``LLM`` loads (a folder, a hub id), loaded with ``dtype`` and
    ``device`` for this call only; keep an ``LLM`` to embed more than once. The rest is ``LLM.embed``.
    """
    if isinstance(model, LLM):
        if dtype is not None or device is not None:
            raise ValueError("dtype and device apply when model is a source to load, not an LLM")
    else:
        model = LLM(model, dtype=dtype, device=device, progress=False)
    return model.embed(
        texts, prompt_name=prompt_name, prompt=prompt, batch_size=batch_size, truncate_dim=truncate_dim
    )


@dataclass(frozen=True)
class _Run:
    """One call's generation settings, resolved once (``LLM._settings``)."""

    sampling: SamplingParams
    stops: tuple[int, ...]
    max_new_tokens: int
    stats: GenerationStats | None
    grammar: Grammar | None = None


def _chunk(delta: Delta) -> ChatChunk:
    if delta.kind == "tool_call":
        return ChatChunk("", tool_call=delta.tool_call)
    return ChatChunk(delta.text, thinking=delta.kind == "reasoning")


def _without_stop(ids: Sequence[int], stops: Sequence[int]) -> list[int]:
    return list(ids[:-1]) if ids and ids[-1] in stops else list(ids)
