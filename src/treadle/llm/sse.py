"""Incremental server-sent-events decoder for streamed chat completions.

Feed it bytes as they arrive, in any chunking; it returns the `data` payload of each complete
event. It keeps only the unfinished tail between calls and must never wait for the whole body.
Comment lines (`: keep-alive`), `event:`, `id:` and `retry:` fields are skipped.
"""

from __future__ import annotations

__all__ = ["DONE", "SSEDecoder"]

DONE = b"[DONE]"
"""The payload OpenAI-compatible servers send as the last event of a stream."""


class SSEDecoder:
    """Turns a byte stream into event payloads: `decoder.feed(chunk) -> [data, ...]`."""

    __slots__ = ("_data", "_tail")

    def __init__(self) -> None:
        self._tail = b""
        self._data: list[bytes] = []

    def feed(self, chunk: bytes) -> list[bytes]:
        """Decode `chunk`; return the payloads of the events it completes (possibly none)."""
        if b"\n" not in chunk:
            self._tail += chunk
            return []
        lines = (self._tail + chunk).split(b"\n")
        self._tail = lines.pop()
        out: list[bytes] = []
        data = self._data
        for line in lines:
            if line.endswith(b"\r"):
                line = line[:-1]
            if not line:
                if data:
                    out.append(data[0] if len(data) == 1 else b"\n".join(data))
                    data = self._data = []
                continue
            if line.startswith(b"data:"):
                value = line[5:]
                data.append(value[1:] if value.startswith(b" ") else value)
            # Comments (":...") and other fields (event, id, retry) carry nothing we use.
        return out

    def flush(self) -> list[bytes]:
        """At end of stream: the payload of a last event not followed by a blank line."""
        out = self.feed(b"\n\n") if (self._tail or self._data) else []
        self._tail = b""
        return out
