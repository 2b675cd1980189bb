"""TLS contexts as httpx builds them, and handshake failures turned into `TLSError`.

Trust, by `verify=`: `True` (the default) is certifi's bundle, or `SSL_CERT_FILE` /
`SSL_CERT_DIR` when `trust_env`; `"system"` is the operating system's store through
`truststore` (the `treadle[truststore]` extra); any other string is a CA file or directory;
`False` turns verification off; an `ssl.SSLContext` is used as given. Every context offers ALPN
`http/1.1`. Building a context reads certificate files, so `ssl_context_async` builds it on a
worker thread; both are cached, so a context is built once per options and environment.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import socket
import ssl
import threading
from typing import TYPE_CHECKING

from treadle._http.errors import OpenFilesExhausted, TLSError
from treadle.errors import ConfigurationError

if TYPE_CHECKING:
    from treadle._http.connect import NetworkOptions

__all__ = ["SYSTEM_STORE", "handshake_error", "ssl_context", "ssl_context_async"]

SYSTEM_STORE = "system"
"""`verify="system"`: trust the operating system's store via `truststore`, as httpx documents."""

ALPN = ["http/1.1"]
"""Offered in every handshake: the pool speaks HTTP/1.1 only."""

# OpenSSL's reasons when the bytes that came back are not a TLS record at all: the peer spoke
# something else (in practice plain HTTP answering a ClientHello with "HTTP/1.1 400").
_NOT_TLS_REASONS = frozenset(
    {"WRONG_VERSION_NUMBER", "HTTP_REQUEST", "PACKET_LENGTH_TOO_LONG", "RECORD_LAYER_FAILURE"}
)


def ssl_context(options: NetworkOptions) -> ssl.SSLContext:
    """The client context for `options` (cached per options and `SSL_CERT_*` values).

    Reads certificate files: on an event loop, await `ssl_context_async` instead.
    """
    return _cached((options, *_env_paths(options)))


async def ssl_context_async(options: NetworkOptions) -> ssl.SSLContext:
    """`ssl_context`, with a first build (file reads) on a worker thread.

    Single-flight: a thousand passes connecting at once share one build (certifi's bundle costs
    tens of milliseconds of CPU to load), not a thousand.
    """
    key: _Key = (options, *_env_paths(options))
    context = _built.get(key)
    if context is not None:
        return context
    loop = asyncio.get_running_loop()
    building = _building.get((loop, key))
    if building is None:
        building = loop.create_task(asyncio.to_thread(_cached, key))
        _building[(loop, key)] = building
        building.add_done_callback(lambda _: _building.pop((loop, key), None))
    # Shielded: one waiter's cancellation must not cancel the build the others wait for.
    return await asyncio.shield(building)


_Key = tuple["NetworkOptions", str, str]
_built: dict[_Key, ssl.SSLContext] = {}
_building: dict[tuple[asyncio.AbstractEventLoop, _Key], asyncio.Task[ssl.SSLContext]] = {}
_lock = threading.Lock()


def _cached(key: _Key) -> ssl.SSLContext:
    with _lock:  # worker threads and the loop thread may both build
        context = _built.get(key)
        if context is None:
            context = _build_context(*key)
            # A few entries at most (one per Provider configuration): drop the oldest past 64.
            if len(_built) >= 64:
                _built.pop(next(iter(_built)))
            _built[key] = context
        return context


def _env_paths(options: NetworkOptions) -> tuple[str, str]:
    if not options.trust_env or options.verify is not True:
        return "", ""
    return os.environ.get("SSL_CERT_FILE", ""), os.environ.get("SSL_CERT_DIR", "")


def _build_context(options: NetworkOptions, cert_file: str, cert_dir: str) -> ssl.SSLContext:
    verify = options.verify
    try:
        if isinstance(verify, ssl.SSLContext):
            context = verify
        elif verify is False:
            context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
            context.check_hostname = False
            context.verify_mode = ssl.CERT_NONE
        elif verify == SYSTEM_STORE:
            context = _system_store()
        elif isinstance(verify, str):
            if os.path.isdir(verify):
                context = ssl.create_default_context(capath=verify)
            else:
                context = ssl.create_default_context(cafile=verify)
        elif cert_file:
            context = ssl.create_default_context(cafile=cert_file)
        elif cert_dir:
            context = ssl.create_default_context(capath=cert_dir)
        else:
            import certifi

            context = ssl.create_default_context(cafile=certifi.where())
        if isinstance(options.cert, str):
            context.load_cert_chain(options.cert)
        elif options.cert is not None:
            context.load_cert_chain(*options.cert)
    except (OSError, ssl.SSLError) as exc:
        if exc.errno in (errno.EMFILE, errno.ENFILE):
            raise OpenFilesExhausted(
                "The process ran out of file descriptors reading the CA certificates "
                f"({errno.errorcode[exc.errno]}); raise the limit (ulimit -n) or lower the "
                "number of concurrent passes."
            ) from None
        raise ConfigurationError(
            f"Cannot load the certificates for verify={_shown(verify)} / cert= ({exc}); "
            "check the paths and that the files are PEM."
        ) from None
    context.set_alpn_protocols(ALPN)
    return context


def _system_store() -> ssl.SSLContext:
    try:
        import truststore
    except ImportError:
        raise ConfigurationError(
            'verify="system" needs the truststore package: pip install "treadle[truststore]".'
        ) from None
    return truststore.SSLContext(ssl.PROTOCOL_TLS_CLIENT)


def _shown(verify: object) -> str:
    return repr(verify) if isinstance(verify, (bool, str)) else "<SSLContext>"


def not_tls(exc: BaseException) -> bool:
    """True when OpenSSL says the bytes the peer sent back were not a TLS record at all."""
    return isinstance(exc, ssl.SSLError) and getattr(exc, "reason", None) in _NOT_TLS_REASONS


async def first_bytes_after_hello(
    sock: socket.socket, context: ssl.SSLContext, server_hostname: str
) -> bytes:
    """Send a ClientHello on connected `sock` and return the first (up to 5) bytes answered.

    A probe for a peer that did not answer in TLS: it sends what the failed handshake sent, a
    ClientHello, and nothing else, and reads only the start of the answer.
    """
    loop = asyncio.get_running_loop()
    outgoing = ssl.MemoryBIO()
    hello = context.wrap_bio(ssl.MemoryBIO(), outgoing, server_hostname=server_hostname)
    with contextlib.suppress(ssl.SSLWantReadError):
        hello.do_handshake()
    await loop.sock_sendall(sock, outgoing.read())
    answer = b""
    while len(answer) < 5:
        more = await loop.sock_recv(sock, 5 - len(answer))
        if not more:
            break
        answer += more
    return answer


def handshake_error(exc: BaseException, origin: str, *, plain_http: bool = False) -> TLSError:
    """A failed handshake with `origin` as a `TLSError` saying what happened and what to do.

    `plain_http` is the caller's finding that the peer answers a ClientHello with `HTTP/`: only
    then is `plaintext_peer` set (never from timing: a slow handshake is a `ConnectTimeout`).
    """
    if isinstance(exc, ssl.SSLCertVerificationError):
        return TLSError(
            f"The certificate of {origin} did not verify ({exc.verify_message}); pass verify= "
            "a CA bundle that signs it (or set SSL_CERT_FILE), or fix the server's certificate.",
            url=origin,
        )
    reason = getattr(exc, "reason", None)
    if not_tls(exc) and plain_http:
        return TLSError(
            f"{origin} answered the TLS handshake in plain HTTP: this port serves http://, not "
            "https://; check the scheme and port of base_url.",
            url=origin,
            plaintext_peer=True,
        )
    if not_tls(exc):
        return TLSError(
            f"{origin} answered the TLS handshake with bytes that are not TLS; check that this "
            "port serves HTTPS (the scheme and port of base_url).",
            url=origin,
        )
    if isinstance(exc, ssl.SSLError):
        return TLSError(
            f"The TLS handshake with {origin} failed ({reason or exc}); check the server's TLS "
            "setup, verify= and cert=.",
            url=origin,
        )
    return TLSError(
        f"{origin} closed the connection during the TLS handshake ({type(exc).__name__}); it "
        "may require a client certificate (cert=) or not speak TLS on this port.",
        url=origin,
    )
