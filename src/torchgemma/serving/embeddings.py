"""POST /v1/embeddings: sentence embeddings (checkpoints with sentence-transformers modules).

``input`` is text (a string or a list of them) or token ids (a list of ints, or a list of such
lists): ids are this model's own, taken as the whole input (no task prompt, no special token
added), as vLLM and llama.cpp take them. EmbeddingGemma 2 also takes items with images and audio,
in the shape of Jina's embeddings API (and sentence-transformers 6's dict inputs): ``{"image":
"data:image/png;base64,..."}``, ``{"audio": "data:audio/wav;base64,..."}``, ``{"text": ...}``, or
several keys in one item (one vector: media first, then the text); plain strings may sit beside.
Media are checked against the server's limits from their headers before any is decoded.
"""

from __future__ import annotations

import asyncio
import base64
from typing import Any, NamedTuple

from ..embedding import embed_token_ids, token_counts
from ..embedding_media import embed_inputs
from .errors import APIError, bad_request
from .limits import MediaBudget
from .media import check_wav, data_url_bytes, decode_wav_upload, load_image, open_image
from .openmp import released
from .protocol import EmbeddingItem, EmbeddingRequest
from .state import ServerState

WAV_EXAMPLE = "data:audio/wav;base64,..."


def no_sentence_head() -> APIError:
    return APIError(
        404,
        "this checkpoint has no sentence-transformers modules (modules.json): it cannot embed",
        param="model",
    )


async def create_embedding(state: ServerState, body: EmbeddingRequest) -> dict:
    """One vector per input, as floats or base64 little-endian float32."""
    state.check_model(body.model)
    llm = state.llm
    if not llm.has_sentence_head:
        raise no_sentence_head()
    texts = [body.input] if isinstance(body.input, str) else body.input
    if not texts:
        raise bad_request("input is empty", "input")
    # (A mix of text and ids is refused by the request's schema.)
    if isinstance(texts[0], int):  # one row of token ids
        texts = [texts]
    if any(isinstance(row, list) and not row for row in texts):
        raise bad_request("input has an empty list of token ids", "input")
    head = llm.sentence_head
    if body.dimensions is not None and not 0 < body.dimensions <= head.dimension:
        raise bad_request(f"dimensions must be in 1..{head.dimension}", "dimensions")
    if any(isinstance(item, EmbeddingItem) for item in texts):
        check_media_items(state, texts)
    try:
        # Tokenizing, decoding and embedding off the event loop, one batch at a time; generation
        # keeps its own engine thread.
        async with state.embedding_lock:
            counts, vectors = await asyncio.to_thread(released(_embed), state, head, texts, body)
    except ValueError as error:  # an unknown prompt_name, a text with no tokens, an id outside the vocabulary
        raise bad_request(str(error), "input") from error
    vectors = vectors.float().cpu()
    data = []
    for index, vector in enumerate(vectors):
        if body.encoding_format == "base64":
            embedding: Any = base64.b64encode(vector.numpy().astype("<f4").tobytes()).decode()
        else:
            embedding = vector.tolist()
        data.append({"object": "embedding", "index": index, "embedding": embedding})
    usage = {"prompt_tokens": sum(counts), "total_tokens": sum(counts)}
    return {"object": "list", "data": data, "model": state.model_name, "usage": usage}


def check_media_items(state: ServerState, items: list) -> None:
    """Before any work: the model's towers and the request's media count."""
    budget = MediaBudget(state.limits)
    for index, item in enumerate(items):
        if not isinstance(item, EmbeddingItem):
            continue
        for kind, present, able in (
            ("images", item.image, state.takes_images),
            ("audio", item.audio, state.takes_audio),
        ):
            if present and not able:
                raise bad_request(
                    f"this model cannot embed {kind} ({state.llm.model.config.towers_note})", f"input.{index}"
                )
        for _ in [*_listed(item.image), *_listed(item.audio)]:
            budget.count(f"input.{index}")


class _CheckedItem(NamedTuple):
    """An input item whose media headers passed the limits, not yet decoded."""

    text: str | None
    images: list  # opened images
    clips: list[bytes]  # WAV files
    at: str  # where the item is in the request ("input.3")


def decoded_items(state: ServerState, items: list) -> list:
    """The inputs as ``LLM.embed`` takes them: every image's and clip's header checked against the
    server's limits, then all decoded."""
    budget = MediaBudget(state.limits)
    checked = []
    for index, item in enumerate(items):
        if not isinstance(item, EmbeddingItem):
            checked.append(item)
            continue
        at = f"input.{index}"
        images = [open_image(url, f"{at}.image", budget) for url in _listed(item.image)]
        clips = [data_url_bytes(url, "audio", WAV_EXAMPLE, f"{at}.audio") for url in _listed(item.audio)]
        for data in clips:
            check_wav(data, f"{at}.audio", budget)
        checked.append(_CheckedItem(item.text, images, clips, at))
    return [
        {
            "text": item.text or "",
            "image": [load_image(image, f"{item.at}.image") for image in item.images],
            "audio": [decode_wav_upload(data, f"{item.at}.audio") for data in item.clips],
        }
        if isinstance(item, _CheckedItem)
        else item
        for item in checked
    ]


def _listed(value: str | list[str] | None) -> list[str]:
    return [] if value is None else [value] if isinstance(value, str) else list(value)


def _embed(state: ServerState, head, texts: list, body: EmbeddingRequest):
    llm = state.llm
    if isinstance(texts[0], list):
        if body.prompt_name is not None:
            raise ValueError("prompt_name applies to text input: token ids are embedded as given")
        vectors = embed_token_ids(llm.model, llm.tokenizer, head, texts, truncate_dim=body.dimensions)
        return [min(len(row), head.max_length) for row in texts], vectors
    if any(isinstance(item, EmbeddingItem) for item in texts):
        counts: list[int] = []
        vectors = embed_inputs(
            llm.model,
            llm.processor,
            head,
            decoded_items(state, texts),
            prompt_name=body.prompt_name,
            truncate_dim=body.dimensions,
            counts=counts,
        )
        return counts, vectors
    counts = token_counts(llm.tokenizer, head, texts, prompt_name=body.prompt_name)
    return counts, llm.embed(texts, prompt_name=body.prompt_name, truncate_dim=body.dimensions)
