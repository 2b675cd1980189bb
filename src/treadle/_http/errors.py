"""The HTTP layer's own small error types; `treadle.llm` maps each to a `TreadleError` once.

```
HTTPError                              any failure of one HTTP exchange
├── InvalidURL (also ValueError)       not an http(s) URL, a host that is not valid IDNA 2008
├── InvalidHeader (also ValueError)    a header name that is not a token, a value with a line break
├── OpenFilesExhausted                 EMFILE/ENFILE: the process is at `ulimit -n`; never retried
├── PoolTimeout                        no connection of the pool became free within pool_timeout
├── ConnectError                       no connection: refused, unreachable, DNS failure, reset
│   ├── ConnectTimeout                 the connect budget (DNS, TCP, proxy, TLS) ran out
│   ├── ProxyError                     the proxy refused the CONNECT or could not be reached
│   └── TLSError                       the handshake failed (certificate, protocol)
├── ReadTimeout                        no byte of the reply within the read timeout
├── WriteError                         the request could not be written
├── RemoteProtocolError                a malformed reply, or the connection closed mid-reply
│   ├── StaleConnection                a reused connection closed, no reply byte, just after the
│   │                                  write: the server never saw the request (free re-send)
│   └── MalformedReply                 a reply that is not valid HTTP/1.1 or breaks a bound (a
│       │                              parse error, a framing conflict, an endless head): the
│       │                              server answers the same again, so it is never retried
│       └── UnsupportedReply           a reply this client does not read (101 upgrade, a status
│                                      outside 100-599, a transfer coding other than chunked)
├── PoolClosed                         the client closed its pool under the request
├── DecodeError                        a compressed body that does not decompress, or over the cap
└── BodyClosed                         a read from a reply body after it was closed
```

Messages say what happened in one sentence and never carry header values (API keys).
"""

from __future__ import annotations

__all__ = [
    "BodyClosed",
    "ConnectError",
    "ConnectTimeout",
    "DecodeError",
    "HTTPError",
    "InvalidHeader",
    "InvalidURL",
    "MalformedReply",
    "OpenFilesExhausted",
    "PoolClosed",
    "PoolTimeout",
    "ProxyError",
    "ReadTimeout",
    "RemoteProtocolError",
    "StaleConnection",
    "TLSError",
    "UnsupportedReply",
    "WriteError",
]


class HTTPError(Exception):
    """One HTTP exchange failed; `url` is the request's URL without credentials."""

    def __init__(self, message: str, *, url: str = "") -> None:
        super().__init__(message)
        self.url = url


class InvalidURL(HTTPError, ValueError):
    """The URL is not an http:// or https:// URL, or its host is not a valid name."""


class InvalidHeader(HTTPError, ValueError):
    """A header name is not an HTTP token, or a value holds a line break."""


class OpenFilesExhausted(HTTPError):
    """The process has no file descriptor left (EMFILE/ENFILE): raise `ulimit -n`."""


class PoolTimeout(HTTPError):
    """No connection of the pool became free within the pool timeout."""


class ConnectError(HTTPError):
    """No connection could be opened (refused, unreachable, name not resolved, reset)."""

    def __init__(
        self, message: str, *, url: str = "", dns: bool = False, no_such_host: bool = False
    ) -> None:
        super().__init__(message, url=url)
        self.dns = dns
        """True when resolving the host name failed (perhaps for a moment: a DNS server down)."""
        self.no_such_host = no_such_host
        """True when the DNS answered that the name does not exist: a retry will not help."""


class ConnectTimeout(ConnectError):
    """The connect budget (DNS, TCP, proxy CONNECT and TLS together) ran out."""


class ProxyError(ConnectError):
    """The proxy could not be reached or refused the CONNECT tunnel."""


class TLSError(ConnectError):
    """The TLS handshake failed; `plaintext_peer` when the peer answered in plain HTTP."""

    def __init__(self, message: str, *, url: str = "", plaintext_peer: bool = False) -> None:
        super().__init__(message, url=url)
        self.plaintext_peer = plaintext_peer


class ReadTimeout(HTTPError):
    """No byte of the reply arrived within the read timeout."""


class WriteError(HTTPError):
    """The request could not be written to the connection."""


class RemoteProtocolError(HTTPError):
    """The reply is malformed, or the connection closed before the reply was complete."""


class StaleConnection(RemoteProtocolError):
    """A reused keep-alive connection closed with no reply byte just after the write.

    The server closed it while it sat idle, so it never saw the request: one re-send on a new
    connection is free (it is not a retry), but never with `max_retries=0` (that means one send).
    """


class MalformedReply(RemoteProtocolError):
    """The bytes the server sent are not a reply this client reads: llhttp refused them (a bad
    status line or chunk size, `Content-Length` beside `Transfer-Encoding`, differing or listed
    lengths, a folded header line), or they broke a bound (head, 1xx run, trailers). Nothing
    went wrong on the way: the server answers the same way again, so it is not retried."""


class UnsupportedReply(MalformedReply):
    """A reply this client does not read: a `101` upgrade, a status outside 100-599, or a
    transfer coding other than `chunked` alone. The server answers the same way every time, so
    it is not retried."""


class PoolClosed(HTTPError, RuntimeError):
    """The client's pool was closed (`aclose_clients()`, `Pool.close()`) under this request: it
    waited for a connection, or its reply was still arriving. Still a `RuntimeError`, as before."""


class DecodeError(HTTPError):
    """A compressed body does not decompress, or decompresses past the size cap."""


class BodyClosed(HTTPError):
    """A read from a reply body after `aclose()`."""
