"""The OpenAI-compatible HTTP API over one model: the route table, authentication and error handling.

    POST /v1/chat/completions       chat.py         messages (text, images, audio), tools, thinking
    POST /v1/completions            completions.py  a raw prompt
    POST /v1/audio/transcriptions   audio.py        an uploaded clip (checkpoints with an audio tower)
    POST /v1/embeddings             embeddings.py   sentence embeddings (text or token ids)
    POST /v1/responses              responses.py    OpenAI's Responses API, over the chat path
    GET  /v1/responses/{id}  DELETE /v1/responses/{id}   stored responses
    GET  /v1/models  /v1/models/{id}  /health  /metrics  /   (the last: a chat page)

Each route reads its request and calls its endpoint's handler with the server's state
(``state.ServerState``); errors have OpenAI's shape. Before any route, ``Guard`` gives the request
its id (the client's ``x-request-id`` or a new one, sent back on every response), answers CORS
(``allowed_origins``), and checks what needs no body: the Host header, the API key, an endpoint the
model cannot serve, and the body's size as it is read; then it writes the request's log line.
"""

from __future__ import annotations

import hmac
import re
import uuid
from collections.abc import Sequence
from importlib import resources
from typing import Annotated

from fastapi import FastAPI, File, Form, Request, UploadFile
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware.cors import CORSMiddleware

from ..generation.engine import Engine
from ..llm import LLM
from ..version import __version__
from .audio import create_transcription, no_audio_tower
from .chat import create_chat_completion
from .completions import create_completion
from .embeddings import create_embedding, no_sentence_head
from .errors import RETRY_AFTER_SECONDS, APIError, bad_request
from .limits import Limits
from .metrics import RequestLog, logger
from .protocol import ChatCompletionRequest, CompletionRequest, EmbeddingRequest, ResponsesRequest
from .responses import create_response, delete_response, retrieve_response
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
    prefill_chunk: int | None = None,
    engine: Engine | None = None,
    limits: Limits | None = None,
    allowed_hosts: Sequence[str] | None = None,
    log_prompts: bool = False,
    prefix_cache_gb: float = 1.0,
    allowed_origins: Sequence[str] | None = None,
    responses_store: int = 64,
) -> FastAPI:
    """The server's application: ``uvicorn.run(create_app(llm, model_name=...))``.

    ``engine`` replaces the one built from ``llm.model`` (anything with ``Engine``'s methods: tests
    script model outputs this way); its ``max_len`` then sets the limit. ``limits``: what one request
    may ask (``limits.Limits``' defaults when None). ``allowed_hosts``: the names the Host header may
    give (any port; ``"*"`` any name, ``"*.example.com"`` its subdomains), None to serve any
    (``torchgemma serve`` allows only loopback names when bound to loopback). Each request is logged
    at INFO on the ``torchgemma.serving`` logger; its prompt too with ``log_prompts``.
    ``prefix_cache_gb``: GiB of the prefix cache the requests share (0: none; see ``ServerState.build``).
    ``allowed_origins``: the web origins a browser page may call the API from (CORS; ``"*"`` any),
    None or empty for no CORS headers at all. ``responses_store``: how many /v1/responses replies
    are kept for ``previous_response_id`` and GET (the oldest dropped first; 0 keeps none).
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
        limits=limits,
        prefix_cache_gb=prefix_cache_gb,
        responses_store=responses_store,
    )
    app = FastAPI(title="torchgemma", version=__version__, docs_url=None, redoc_url=None)
    app.state.server = state
    app.state.runner = state.runner
    app.state.metrics = state.metrics
    app.on_event("shutdown")(state.close)
    _add_error_handling(app, state)
    _add_routes(app, state)
    app.add_middleware(
        Guard,
        state=state,
        allowed_hosts=allowed_hosts,
        log_prompts=log_prompts,
        allowed_origins=allowed_origins,
    )
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
        timestamp_granularities: Annotated[list[str] | None, Form(alias="timestamp_granularities[]")] = None,
    ):
        return await create_transcription(
            state,
            await file.read(),
            model=model,
            prompt=prompt,
            language=language,
            response_format=response_format,
            temperature=temperature,
            timestamp_granularities=timestamp_granularities,
            request=request,
        )

    @app.post("/v1/embeddings")
    async def embeddings(body: EmbeddingRequest):
        return await create_embedding(state, body)

    @app.post("/v1/responses")
    async def responses(body: ResponsesRequest, request: Request):
        return await create_response(state, body, request)

    @app.get("/v1/responses/{response_id}")
    async def stored_response(response_id: str):
        return retrieve_response(state, response_id)

    @app.delete("/v1/responses/{response_id}")
    async def forget_response(response_id: str):
        return delete_response(state, response_id)

    @app.get("/v1/models")
    async def models():
        return list_models(state)

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        return model_entry(state, model_id)

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
    return {"object": "list", "data": [model_entry(state, state.model_name)]}


def model_entry(state: ServerState, model_id: str) -> dict:
    """GET /v1/models/{id}: the served model's entry; any other id is a 404 in OpenAI's shape.
    (``:path`` in the route: a served name may hold '/', as a checkpoint's folder does.)"""
    if model_id != state.model_name:
        raise APIError(
            404,
            f"the model {model_id!r} does not exist here; this server serves {state.model_name!r}",
            param="model",
            code="model_not_found",
        )
    return {"id": state.model_name, "object": "model", "created": state.created, "owned_by": "torchgemma"}


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


# Host names a server bound to loopback answers to by default (any port): a browser page on another
# site can make requests to 127.0.0.1 through a name it controls (DNS rebinding), but that name is
# then in the Host header.
LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "::1")


# A request id the client gives (x-request-id) is echoed when it is this plain: it goes into a
# response header and the log line as it is.
REQUEST_ID = re.compile(r"[\x21-\x7e]{1,200}")


class Guard:
    """ASGI middleware in front of every route: the request's id and log line, CORS, then the Host
    header, the API key, endpoints the model cannot serve, and the body-size cap, each answered
    before the body is read.

    Every response carries ``x-request-id``: the client's (1-200 visible ASCII characters; anything
    else is a 400) or a new one; the log line ends with it. With ``allowed_origins``, Starlette's
    ``CORSMiddleware`` answers preflights (no API key needed: browsers send none there) and adds
    the CORS headers to every answer, refusals included, so that a page can read a 401's message.

    The body is read here, counted as it arrives (a chunked body has no Content-Length), at most
    ``limits.max_request_bytes``; beyond that, or when Content-Length says so first, the answer is
    413 and the connection is closed without reading the rest. The routes then read the body from
    memory, as they would have read it anyway.
    """

    def __init__(
        self,
        app,
        *,
        state: ServerState,
        allowed_hosts: Sequence[str] | None,
        log_prompts: bool,
        allowed_origins: Sequence[str] | None = None,
    ):
        self.app, self.state, self.log_prompts = app, state, log_prompts
        self.allowed_hosts = None if allowed_hosts is None else [h.lower().strip("[]") for h in allowed_hosts]
        if self.allowed_hosts is not None and "*" in self.allowed_hosts:
            self.allowed_hosts = None
        self.checked = self._checked
        if allowed_origins:
            self.checked = CORSMiddleware(
                self._checked,
                allow_origins=list(allowed_origins),
                allow_methods=["GET", "POST", "DELETE", "OPTIONS"],
                # The OpenAI SDKs send their own x-stainless-* headers from a browser too.
                allow_headers=["*"],
                expose_headers=["x-request-id", "Retry-After"],
            )

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        client = scope.get("client")
        log = RequestLog(scope["method"], scope["path"], f"{client[0]}:{client[1]}" if client else "-")
        scope["torchgemma.log"] = log
        given = dict(scope["headers"]).get(b"x-request-id")
        given = given.decode("latin-1") if given is not None else None
        request_id = given if given is not None and REQUEST_ID.fullmatch(given) else f"req_{uuid.uuid4().hex}"
        scope["torchgemma.request_id"] = request_id

        async def logged_send(message):
            if message["type"] == "http.response.start":
                log.status = message["status"]
                headers = [(k, v) for k, v in message.get("headers", []) if k.lower() != b"x-request-id"]
                message = {**message, "headers": [*headers, (b"x-request-id", request_id.encode())]}
            await send(message)

        try:
            if given is not None and request_id != given:
                refusal = bad_request(
                    "the x-request-id header must be 1-200 visible ASCII characters (no spaces)",
                    "x-request-id",
                )
                return await refusal.response()(scope, receive, logged_send)
            await self.checked(scope, receive, logged_send)
        finally:
            logger.info(
                f"{log.line(self.state.tokenizer if self.log_prompts else None)} request_id={request_id}"
            )

    async def _checked(self, scope, receive, send):
        refusal = self._refusal(scope)
        if refusal is not None:
            return await refusal.response()(scope, receive, send)
        body = await self._read_body(scope, receive, send)
        if body is not None:
            await self.app(scope, _replay(body, receive), send)

    def _refusal(self, scope) -> APIError | None:
        headers = dict(scope["headers"])
        if self.allowed_hosts is not None:
            host = headers.get(b"host", b"").decode("latin-1")
            if not _host_allowed(host, self.allowed_hosts):
                return bad_request(
                    f"Host header {host!r} is not one this server answers to (allowed: "
                    f"{', '.join(self.allowed_hosts)}; see --allowed-hosts)",
                    code="host_not_allowed",
                )
        path, state = scope["path"], self.state
        if state.api_key is not None and path not in OPEN_PATHS:
            given = headers.get(b"authorization", b"")
            if not hmac.compare_digest(given, f"Bearer {state.api_key}".encode()):
                return APIError(401, "missing or wrong API key (send Authorization: Bearer KEY)")
        # Endpoints this model cannot serve: refused before their upload is read.
        if path == "/v1/audio/transcriptions" and not state.takes_audio:
            return no_audio_tower()
        if path == "/v1/embeddings" and not state.llm.has_sentence_head:
            return no_sentence_head()
        return None

    async def _read_body(self, scope, receive, send) -> bytes | None:
        """The whole body, or None once a 413 has been sent."""
        cap = self.state.limits.max_request_bytes
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > cap:
            await _too_large(cap, int(length))(scope, receive, send)
            return None
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client left
                return b"".join(chunks)
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > cap:
                await _too_large(cap, None)(scope, receive, send)
                return None
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)


def _too_large(cap: int, length: int | None):
    stated = f" ({length:,} bytes)" if length is not None else ""
    error = APIError(
        413,
        f"the request body{stated} is larger than this server's limit of {cap:,} bytes (--max-request-bytes)",
        code="request_too_large",
    )
    # Close the connection rather than read the rest of the body.
    return error.response({"Connection": "close"})


def _replay(body: bytes, receive):
    """A receive that gives the body read already, then the client's own messages (a disconnect)."""
    sent = False

    async def replayed():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replayed


def _host_allowed(host: str, allowed: list[str]) -> bool:
    """Whether a Host header's name (any port) is among ``allowed`` (``*.example.com`` matches its
    subdomains)."""
    host = host.strip().lower()
    if host.startswith("["):  # [::1]:8000
        name = host[1 : host.find("]")] if "]" in host else ""
    else:
        name = host.rsplit(":", 1)[0] if host.count(":") == 1 else host
    if not name:
        return False
    return any(
        name == pattern or (pattern.startswith("*.") and name.endswith(pattern[1:])) for pattern in allowed
    )
