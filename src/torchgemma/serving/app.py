"""The OpenAI-compatible HTTP API over one model: the route table, authentication and error handling.

    POST /v1/chat/completions       chat.py         messages (text, images, audio), tools, thinking
    POST /v1/completions            completions.py  a raw prompt
    POST /v1/audio/transcriptions   audio.py        an uploaded clip (checkpoints with an audio tower)
    POST /v1/embeddings             embeddings.py   sentence embeddings
    GET  /v1/models  /health  /metrics  /   (the last: a chat page)

Each route reads its request and calls its endpoint's handler with the server's state
(``state.ServerState``); errors have OpenAI's shape.
"""

from __future__ import annotations

import hmac
from importlib import resources
from typing import Annotated

from fastapi import FastAPI, File, Form, Request, UploadFile
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..generation.engine import Engine
from ..llm import LLM
from ..version import __version__
from .audio import create_transcription
from .chat import create_chat_completion
from .completions import create_completion
from .embeddings import create_embedding
from .errors import RETRY_AFTER_SECONDS, APIError, bad_request
from .protocol import ChatCompletionRequest, CompletionRequest, EmbeddingRequest
from .state import ServerState

# Open without the API key: the health check and the (static) chat page, which sends the key itself.
OPEN_PATHS = ("/health", "/", "/favicon.ico")


def create_app(
    llm: LLM,
    *,
    model_name: str,
    max_batch_size: int = 8,
    max_len: int = 4096,
    max_waiting: int = 64,
    api_key: str | None = None,
    prefill_chunk: int = 512,
    engine: Engine | None = None,
) -> FastAPI:
    """The server's application: ``uvicorn.run(create_app(llm, model_name=...))``.

    ``engine`` replaces the one built from ``llm.model`` (anything with ``Engine``'s methods: tests
    script model outputs this way); its ``max_len`` then sets the limit.
    """
    state = ServerState.build(
        llm,
        model_name=model_name,
        max_batch_size=max_batch_size,
        max_len=max_len,
        max_waiting=max_waiting,
        api_key=api_key,
        prefill_chunk=prefill_chunk,
        engine=engine,
    )
    app = FastAPI(title="torchgemma", version=__version__, docs_url=None, redoc_url=None)
    app.state.server = state
    app.state.runner = state.runner
    app.state.metrics = state.metrics
    app.on_event("shutdown")(state.close)
    _add_error_handling(app, state)
    _add_routes(app, state)
    return app


def _add_routes(app: FastAPI, state: ServerState) -> None:
    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        return await create_chat_completion(state, body, request)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        return await create_completion(state, body, request)

    @app.post("/v1/audio/transcriptions")
    async def transcriptions(
        request: Request,
        file: Annotated[UploadFile, File()],
        model: Annotated[str | None, Form()] = None,
        prompt: Annotated[str | None, Form()] = None,
        language: Annotated[str | None, Form()] = None,
        response_format: Annotated[str, Form()] = "json",
        temperature: Annotated[float, Form()] = 0.0,
    ):
        return await create_transcription(
            state,
            await file.read(),
            model=model,
            prompt=prompt,
            language=language,
            response_format=response_format,
            temperature=temperature,
            request=request,
        )

    @app.post("/v1/embeddings")
    async def embeddings(body: EmbeddingRequest):
        return await create_embedding(state, body)

    @app.get("/v1/models")
    async def models():
        return list_models(state)

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/metrics")
    async def prometheus():
        return Response(state.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/favicon.ico")
    async def favicon():
        return Response(status_code=204)

    @app.get("/", response_class=HTMLResponse)
    async def chat_page():
        return resources.files("torchgemma.serving").joinpath("static/chat.html").read_text(encoding="utf-8")


def list_models(state: ServerState) -> dict:
    entry = {"id": state.model_name, "object": "model", "created": state.created, "owned_by": "torchgemma"}
    return {"object": "list", "data": [entry]}


def _add_error_handling(app: FastAPI, state: ServerState) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, error: APIError):
        headers = {"Retry-After": str(RETRY_AFTER_SECONDS)} if error.status == 503 else None
        return error.response(headers)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, error: RequestValidationError):
        first = error.errors()[0] if error.errors() else {}
        if first.get("type") == "json_invalid":
            return bad_request(f"the request body is not valid JSON: {first.get('msg', '')}").response()
        location = [str(part) for part in first.get("loc", ()) if part != "body"]
        param = ".".join(location) or None
        return bad_request(f"{param or 'request'}: {first.get('msg', 'invalid value')}", param).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, error: StarletteHTTPException):
        return APIError(error.status_code, str(error.detail)).response()

    @app.middleware("http")
    async def _authenticate(request: Request, call_next):
        given = request.headers.get("authorization", "")
        if (
            state.api_key is not None
            and request.url.path not in OPEN_PATHS
            and not hmac.compare_digest(given.encode(), f"Bearer {state.api_key}".encode())
        ):
            return APIError(401, "missing or wrong API key (send Authorization: Bearer KEY)").response()
        return await call_next(request)
