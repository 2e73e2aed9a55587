"""POST /v1/embeddings: sentence embeddings (checkpoints with sentence-transformers modules).

``input`` is text (a string or a list of them) or token ids (a list of ints, or a list of such
lists): ids are this model's own, taken as the whole input (no task prompt, no special token
added), as vLLM and llama.cpp take them.
"""

from __future__ import annotations

import asyncio
import base64
from typing import Any

from ..embedding import embed_token_ids, token_counts
from .errors import APIError, bad_request
from .protocol import EmbeddingRequest
from .state import ServerState


def no_sentence_head() -> APIError:
    return APIError(
        404,
        "this checkpoint has no sentence-transformers modules (modules.json): it cannot embed",
        param="model",
    )


async def create_embedding(state: ServerState, body: EmbeddingRequest) -> dict:
    """One vector per input text, as floats or base64 little-endian float32."""
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
    try:
        # Tokenizing and embedding off the event loop, one batch at a time; generation keeps its
        # own engine thread.
        async with state.embedding_lock:
            counts, vectors = await asyncio.to_thread(_embed, llm, head, texts, body)
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


def _embed(llm, head, texts: list[str] | list[list[int]], body: EmbeddingRequest):
    if isinstance(texts[0], list):
        if body.prompt_name is not None:
            raise ValueError("prompt_name applies to text input: token ids are embedded as given")
        vectors = embed_token_ids(llm.model, llm.tokenizer, head, texts, truncate_dim=body.dimensions)
        return [min(len(row), head.max_length) for row in texts], vectors
    counts = token_counts(llm.tokenizer, head, texts, prompt_name=body.prompt_name)
    return counts, llm.embed(texts, prompt_name=body.prompt_name, truncate_dim=body.dimensions)
