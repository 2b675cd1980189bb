"""The read buffer connections receive into: one per thread, shared by its connections.

asyncio hands a `BufferedProtocol` its buffer, reads into it and calls `buffer_updated` at once,
in the same callback (plain and TLS transports alike), and llhttp copies what it hands on, so no
read's bytes outlive that call: every connection of one event loop can read into the same buffer.
One buffer per connection was 64 KiB of resident memory per pass holding a connection (issue 33:
1,000 connections, 64 MiB), where the floor's aiohttp loop keeps far less.
"""

from __future__ import annotations

import threading

__all__ = ["READ_BUFFER_BYTES", "thread_read_buffer"]

READ_BUFFER_BYTES = 64 * 1024
"""The buffer's size: one read takes up to this much, with no allocation per read (a 256 KiB
`bytes` per read, asyncio's default, costs an mmap and munmap each time)."""

_local = threading.local()


def thread_read_buffer() -> memoryview:
    """This thread's read buffer (event loops run one per thread: no two reads overlap on it)."""
    buffer: memoryview | None = getattr(_local, "buffer", None)
    if buffer is None:
        buffer = _local.buffer = memoryview(bytearray(READ_BUFFER_BYTES))
    return buffer
