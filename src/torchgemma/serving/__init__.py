"""``torchgemma serve``: an OpenAI-compatible HTTP server with continuous batching.

    app.py          create_app: the state, the route table, authentication, errors in OpenAI's shape
    state.py        ServerState: the model, engine runner, metrics and limits every handler reads
    chat.py         POST /v1/chat/completions (messages -> the chat template's; tools; thinking)
    completions.py  POST /v1/completions (a raw prompt)
    audio.py        POST /v1/audio/transcriptions
    embeddings.py   POST /v1/embeddings (text or token ids)
    responses.py    POST /v1/responses (over the chat path; events; the bounded store's routes)
    responses_input.py  the Responses API's input items and tools as the chat path's
    streaming.py    prepared request -> deltas (decoder, torchgemma.replies, stop strings) -> SSE or whole
    sampling.py     sampling fields -> the engine's arguments, checked against the limits
    media.py        images and audio sent by clients, decoded
    errors.py       APIError: errors in OpenAI's shape
    runner.py       the engine on its own thread, fed by the handlers
    protocol.py     OpenAI's request shapes (pydantic)
    metrics.py      Prometheus metrics
    static/         the chat page served at /

Requests go in through the checkpoint's processor (``llm.processor``) and replies come out through
the reply grammar (``torchgemma.replies``), as for ``LLM``.
Each endpoint's handler is a plain async function of the state and the request body
(``await chat.create_chat_completion(state, body)``), callable without a socket.

Needs the ``serve`` extra (``pip install -e ".[serve]"``): FastAPI, uvicorn, prometheus_client,
python-multipart.
"""
