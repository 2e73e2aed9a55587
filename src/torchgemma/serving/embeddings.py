"""POST /v1/embeddings: sentence embeddings (checkpoints with sentence-transformers modules)."""

from __future__ import annotations

import asyncio
import base64
from typing import Any

from ..embedding import token_counts
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
    if not all(isinstance(text, str) for text in texts):
        raise bad_request("input must be text (a string or a list of strings), not token ids", "input")
    head = llm.sentence_head
    if body.dimensions is not None and not 0 < body.dimensions <= head.dimension:
        raise bad_request(f"dimensions must be in 1..{head.dimension}", "dimensions")
    try:
        # Tokenizing and embedding off the event loop, one batch at a time; generation keeps its
        # own engine thread.
        async with state.embedding_lock:
            counts, vectors = await asyncio.to_thread(_embed, llm, head, texts, body)
    except ValueError as error:  # an unknown prompt_name, a text with no tokens
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


def _embed(llm, head, texts: list[str], body: EmbeddingRequest):
    counts = token_counts(llm.tokenizer, head, texts, prompt_name=body.prompt_name)
    return counts, llm.embed(texts, prompt_name=body.prompt_name, truncate_dim=body.dimensions)
