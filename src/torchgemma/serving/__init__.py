"""``torchgemma serve``: an OpenAI-compatible HTTP server with continuous batching.

    app.py        the endpoints (FastAPI): chat and text completions, transcription, models, metrics
    runner.py     the engine on its own thread, fed by the handlers
    parsing.py    Gemma 4's reply format (thinking, tool calls) -> OpenAI's fields, whole or streamed
    protocol.py   OpenAI's request shapes (pydantic)
    metrics.py    Prometheus metrics
    static/       the chat page served at /

Needs the ``serve`` extra (``pip install -e ".[serve]"``): FastAPI, uvicorn, prometheus_client,
python-multipart.
"""
