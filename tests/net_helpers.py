"""Network fixtures shared by the transport tests."""

from __future__ import annotations

import contextlib
import socket
import time
from collections.abc import Iterator


@contextlib.contextmanager
def unanswered_port() -> Iterator[int]:
    """A loopback port whose listener has a full accept backlog: the kernel drops further SYNs,
    so a connect to it hangs (until the client's connect timeout)."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(0)
    port = listener.getsockname()[1]
    fillers = []
    try:
        for _ in range(4):
            filler = socket.socket()
            filler.setblocking(False)
            with contextlib.suppress(BlockingIOError):
                filler.connect(("127.0.0.1", port))
            fillers.append(filler)
        time.sleep(0.05)  # the fillers' handshakes settle into the backlog
        yield port
    finally:
        for filler in fillers:
            filler.close()
        listener.close()
