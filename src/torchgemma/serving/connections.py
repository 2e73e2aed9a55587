"""uvicorn's HTTP/1.1 protocol with a deadline for a request's headers and a cap on connections.

uvicorn closes a kept-alive connection that stays idle (``timeout_keep_alive``), but a new
connection that sends nothing, or its headers a byte at a time, stays open for good; each holds a
file descriptor and counts toward ``limit_concurrency``, so a few hundred of them make the server
answer 503 to everyone, and a thousand exhaust the descriptors (then nothing is even accepted).
Here a connection has ``seconds`` to complete its headers, from when it opens and again after each
response; then it is closed. And a connection beyond ``limit_concurrency`` is answered 503 and
closed as soon as it opens (uvicorn would keep it open until it sent a request), so that excess
connections give their descriptors back at once.
"""

from __future__ import annotations

import asyncio
import json

from uvicorn.protocols.http.h11_impl import H11Protocol

from .errors import RETRY_AFTER_SECONDS

_BUSY_BODY = json.dumps(
    {
        "error": {
            "message": "the server has too many open connections (--max-connections); retry shortly",
            "type": "server_busy",
            "param": None,
            "code": None,
        }
    }
).encode()
BUSY_RESPONSE = (
    b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n"
    + f"retry-after: {RETRY_AFTER_SECONDS}\r\nconnection: close\r\ncontent-length: {len(_BUSY_BODY)}\r\n\r\n".encode()
    + _BUSY_BODY
)


def header_timeout_protocol(seconds: float) -> type[H11Protocol]:
    """An ``H11Protocol`` (uvicorn's ``http=``) that closes connections slower than ``seconds`` to
    send a request's headers."""

    class HeaderTimeoutProtocol(H11Protocol):
        _deadline: asyncio.TimerHandle | None = None

        def connection_made(self, transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            if self.limit_concurrency is not None and len(self.connections) > self.limit_concurrency:
                transport.write(BUSY_RESPONSE)
                transport.close()
                return
            self._arm()

        def on_response_complete(self) -> None:
            # Armed first: a pipelined request that begins inside the call disarms it again.
            self._arm()
            super().on_response_complete()

        def handle_events(self) -> None:
            super().handle_events()
            if self.cycle is not None and not self.cycle.response_complete:  # headers are in
                self._disarm()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _arm(self) -> None:
            self._disarm()
            self._deadline = self.loop.call_later(seconds, self._expire)

        def _disarm(self) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
                self._deadline = None

        def _expire(self) -> None:
            self._deadline = None
            waiting = self.cycle is None or self.cycle.response_complete
            if waiting and not self.transport.is_closing():
                self.transport.close()

    return HeaderTimeoutProtocol
