"""One-line notices on stderr for the waits a user would otherwise sit through in silence.

    with slow_notice("torchgemma: reading the vocabulary for constrained decoding (once)..."):
        ...   # said only if this is still running NOTICE_AFTER_SECONDS in

The first run of a command does one-time work (assembling the 270M, building a GGUF tokenizer,
llguidance reading a vocabulary, the batch-invariance probe, torch.compile); each says what it is
doing when it takes long enough to notice, and fast paths (small models, later calls) print nothing.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager

# Past this a silent wait looks like a hang; below it a notice would be noise on every run.
NOTICE_AFTER_SECONDS = 1.5


def say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


@contextmanager
def slow_notice(message: str, after: float | None = None) -> Iterator[None]:
    """Print ``message`` on stderr if the block is still running ``after`` seconds in (default
    ``NOTICE_AFTER_SECONDS``)."""
    timer = threading.Timer(NOTICE_AFTER_SECONDS if after is None else after, say, args=(message,))
    timer.daemon = True  # never keeps a process alive
    timer.start()
    try:
        yield
    finally:
        timer.cancel()
