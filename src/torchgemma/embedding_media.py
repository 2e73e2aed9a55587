"""Sentence embeddings of images and audio (EmbeddingGemma 2), beside text.

    llm = torchgemma.LLM("google/embeddinggemma-2")           # or a local folder
    vectors = llm.embed([
        "A red bicycle leaning on a wall",                      # text
        {"image": "bike.jpg"},                                  # an image (path, PIL image, array)
        {"audio": "bell.wav"},                                  # a clip (path, 16 kHz array)
        {"image": "bike.jpg", "text": "a photo of a bicycle"},  # media and text in one input
    ])                                                          # (4, D), unit vectors

An input is a string or a mapping with ``"text"``, ``"image"`` and ``"audio"`` keys (an image or
clip, or a list of them), as sentence-transformers 6 takes multimodal inputs. A mapping's media go
first, one placeholder each (``<|image|>``, ``<|audio|>``) joined by spaces, then its text after a
space: the text EmbeddingGemma2Processor builds when it is given no text, extended by the text.
The tokenizer adds its special tokens, and each placeholder is expanded into the soft tokens the
towers make (``<|image>`` + n x ``<|image|>`` + ``<image|>``, as the processor). Task prompts apply
to text-only inputs, as sentence-transformers applies them (not to media inputs).

Text-only inputs are embedded as ``embedding.embed_texts`` embeds them (batched, longest first);
an input with media is embedded alone (its soft tokens, the towers' padding, depend on no other).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch

from .embedding import SentenceHead, _token_ids, check_embedding_rows, embed_texts, token_counts

if TYPE_CHECKING:
    from .model import Gemma
    from .processing import Processor

INPUT_KEYS = ("text", "image", "audio")
EmbeddingInput = str | Mapping[str, Any]


def embed_inputs(
    model: Gemma,
    processor: Processor,
    head: SentenceHead,
    inputs: EmbeddingInput | Sequence[EmbeddingInput],
    *,
    prompt_name: str | None = None,
    prompt: str | None = None,
    batch_size: int = 32,
    truncate_dim: int | None = None,
    counts: list[int] | None = None,
) -> torch.Tensor:
    """Sentence vectors (N, D) of ``inputs`` (one input: (D,)): texts, and mappings of text, images
    and audio (see the module's docstring). ``counts``, if given, is filled with the tokens each
    input ran through the model (soft tokens included): the server's usage figures."""
    single = isinstance(inputs, str | Mapping)
    parsed = [_parse(item, i) for i, item in enumerate([inputs] if single else list(inputs))]
    with_media = [i for i, (_, images, audio) in enumerate(parsed) if images or audio]
    if with_media and not model.takes_media:
        raise ValueError(
            f"this checkpoint embeds text only ({model.config.model_type}): it cannot take images or audio"
        )
    if truncate_dim is not None and not 0 < truncate_dim <= head.dimension:
        raise ValueError(f"truncate_dim must be in 1..{head.dimension}, got {truncate_dim}")
    head.prompt(prompt_name, prompt)  # an unknown prompt name is an error whatever the inputs
    texts = [i for i in range(len(parsed)) if i not in set(with_media)]
    settings = dict(prompt_name=prompt_name, prompt=prompt)
    found = embed_texts(
        model,
        processor.tokenizer,
        head,
        [parsed[i][0] for i in texts],
        batch_size=batch_size,
        truncate_dim=truncate_dim,
        **settings,
    )
    vectors, lengths = found, {}
    if with_media:
        rows: list[torch.Tensor | None] = [None] * len(parsed)
        for i, vector in zip(texts, found):
            rows[i] = vector
        with torch.inference_mode():
            for i in with_media:
                text, images, audio = parsed[i]
                vector, lengths[i] = _embed_media(model, processor, head, text, images, audio, f"texts[{i}]")
                rows[i] = vector[:truncate_dim]
        vectors = torch.stack(rows)
    if counts is not None:
        lengths.update(
            zip(texts, token_counts(processor.tokenizer, head, [parsed[i][0] for i in texts], **settings))
        )
        counts[:] = [lengths[i] for i in range(len(parsed))]
    return vectors[0] if single else vectors


def media_text(text: str, images: Sequence[Any], audio: Sequence[Any], tokenizer: Any) -> str:
    """The text an input with media is tokenized from: a placeholder per image, then per clip,
    joined by spaces, then the input's text after a space."""
    image, clip = tokenizer.special_token("image"), tokenizer.special_token("audio")
    placeholders = [image] * len(images) + [clip] * len(audio)
    return " ".join(placeholders + ([text] if text else []))


def _embed_media(
    model: Gemma, processor: Processor, head: SentenceHead, text: str, images, audio, where: str
) -> tuple[torch.Tensor, int]:
    """One input with media -> its sentence vector (D,) and its length in tokens."""
    tokenizer = processor.tokenizer
    ids = _token_ids(tokenizer, media_text(text, images, audio, tokenizer), head.max_length)
    check_embedding_rows([ids], tokenizer, model.config.text.vocab_size, where)
    expected = len(images) + len(audio)
    placeholders = sum(ids.count(t) for t in (tokenizer.image_id, tokenizer.audio_id))
    if placeholders != expected:  # the text was cut at max_length, or wrote placeholders itself
        raise ValueError(
            f"{where}: its tokens hold {placeholders} media placeholders for {expected} images and clips "
            f"(its text may not write <|image|> or <|audio|>, and must fit in {head.max_length} tokens)"
        )
    request = processor.process(ids, images, audio)
    if len(request.input_ids) > head.max_length:
        raise ValueError(
            f"{where} is {len(request.input_ids)} tokens with its media's soft tokens, more than "
            f"this model's {head.max_length}"
        )
    media = {k: v for k, v in request.media.as_dict().items() if k != "mm_token_type_ids"}
    input_ids = torch.tensor([request.input_ids], device=model.device)
    embeds, text_ids = model.embed_multimodal(input_ids, **media)
    states = model.language_model(text_ids, inputs_embeds=embeds, head=False)  # (1, T, D)
    mask = torch.ones_like(input_ids)
    return head(states, mask)[0], len(request.input_ids)


def _parse(item: Any, index: int) -> tuple[str, list[Any], list[Any]]:
    """(text, images, clips) of one input."""
    if isinstance(item, str):
        return item, [], []
    if not isinstance(item, Mapping):
        raise TypeError(
            f"texts[{index}] is a {type(item).__name__}, not a str or a mapping of "
            f"{', '.join(repr(k) for k in INPUT_KEYS)}"
        )
    unknown = sorted(set(item) - set(INPUT_KEYS))
    if unknown:
        raise ValueError(f"texts[{index}] has unknown key(s) {unknown}; known: {', '.join(INPUT_KEYS)}")
    text = item.get("text") or ""
    if not isinstance(text, str):
        raise TypeError(f"texts[{index}]['text'] is a {type(text).__name__}, not a str")
    images, audio = _media_list(item.get("image")), _media_list(item.get("audio"))
    if not text and not images and not audio:
        raise ValueError(f"texts[{index}] is empty: give text, an image or audio")
    return text, images, audio


def _media_list(value: Any) -> list[Any]:
    """An image or clip, or a list of them (a list of numbers is one clip's samples)."""
    if value is None:
        return []
    if isinstance(value, list | tuple) and not (value and isinstance(value[0], int | float)):
        return list(value)
    return [value]
