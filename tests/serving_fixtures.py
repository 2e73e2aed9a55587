"""A real server on a free loopback port, and an engine double that replays scripted model outputs."""

from __future__ import annotations

import io
import socket
import threading
import time
import wave
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np

from torchgemma.generation import StepOutput


@contextmanager
def running_server(app) -> Iterator[str]:
    """Serve ``app`` with uvicorn on 127.0.0.1 (a port the OS picks) in a thread; yield its base URL."""
    import uvicorn

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("the test server did not start")
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        sock.close()


class ScriptedEngine:
    """Replays a scripted reply per request, one token per step, ending with a stop token.

    It has the methods the server's runner calls on ``Engine``; ``prompts`` keeps the ids each
    request was given (to check what the chat template rendered). ``step_delay`` slows steps down.
    """

    def __init__(
        self, tokenizer, replies: list[str], *, stop_id: int, max_batch_size: int = 4, max_len: int = 512
    ):
        self.tokenizer = tokenizer
        self.replies = deque(replies)
        self.stop_id = stop_id
        self.max_batch_size = max_batch_size
        self.max_len = max_len
        self.prompts: list[list[int]] = []
        self.arguments: list[dict] = []
        self.requests: dict = {}
        self.step_delay = 0.0
        self.fail_at_step: int | None = None  # raise inside step number N (counting from 1)
        self._steps = 0
        self._queue: deque = deque()
        self._running: dict = {}

    def add_request(self, request_id, input_ids, **kwargs) -> None:
        reply = self.replies.popleft() if self.replies else ""
        ids = self.tokenizer.encode(reply, add_special_tokens=False) + [self.stop_id]
        self.prompts.append(list(input_ids))
        self.arguments.append(kwargs)
        self.requests[request_id] = deque(ids)
        self._queue.append(request_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def abort_request(self, request_id) -> None:
        self.requests.pop(request_id, None)
        self._running.pop(request_id, None)
        if request_id in self._queue:
            self._queue.remove(request_id)

    def step(self) -> list:
        if self.step_delay:
            time.sleep(self.step_delay)
        self._steps += 1
        if self._steps == self.fail_at_step:
            raise RuntimeError("the scripted step failed")
        while self._queue and len(self._running) < self.max_batch_size:
            request_id = self._queue.popleft()
            self._running[request_id] = True
        outputs = []
        for request_id in list(self._running):
            tokens = self.requests[request_id]
            token = tokens.popleft()
            done = not tokens
            if done:
                del self.requests[request_id], self._running[request_id]
            outputs.append(StepOutput(request_id, token, done, "stop" if done else None))
        return outputs


def content_of(llm, token_ids) -> str:
    """What the server answers for these generated tokens: the reply's content, specials left out."""
    from torchgemma.replies import parse_reply
    from torchgemma.serving.sequences import hidden_token_ids

    stops = set(llm.generation_config.eos_token_ids) | {llm.tokenizer.turn_end_id}
    ids = [t for t in token_ids if t not in stops and t not in hidden_token_ids(llm.tokenizer)]
    return parse_reply(llm.tokenizer.decode(ids)).content


def wav_bytes(samples: np.ndarray, rate: int = 16_000) -> bytes:
    """Mono 16-bit PCM WAV bytes of float samples in [-1, 1]."""
    buffer = io.BytesIO()
    with wave.open(buffer, "wb") as out:
        out.setnchannels(1)
        out.setsampwidth(2)
        out.setframerate(rate)
        out.writeframes((np.clip(samples, -1, 1) * 32767).astype("<i2").tobytes())
    return buffer.getvalue()
