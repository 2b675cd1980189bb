"""HTTP failures classified by what the user should do, retried only when a retry can succeed.

Real servers on 127.0.0.1: the fake OpenAI server for OpenAI-shaped faults, and a plain
`http.server` (not OpenAI-compatible at all) for wrong URLs and wrong protocols.
"""

from __future__ import annotations

import asyncio
import http.server
import threading
from collections.abc import Iterator

import httpx
import pytest
from pydantic_core import to_json

from treadle.cli.failures import explain
from treadle.errors import (
    AuthenticationError,
    InvalidRequestError,
    ModelNotFoundError,
    NotOpenAIEndpointError,
    ProtocolMismatchError,
    ProviderError,
    ProviderTimeout,
)
from treadle.llm import Provider, build_request_body, get_client
from treadle.llm.http_errors import error_from_status, excerpt
from treadle.testing import FakeOpenAIServer, Reply

USER = [to_json({"role": "user", "content": "hello"})]


async def send(provider: Provider, *, stream: bool) -> None:
    body = build_request_body(provider, USER, stream=stream)
    client = get_client(provider)
    if stream:
        async for _ in client.stream(provider, body):
            pass
    else:
        await client.complete(provider, body)


class _PlainHandler(http.server.BaseHTTPRequestHandler):
    """A web server that is not an OpenAI endpoint: GET pages only (POST answers 501)."""

    hits: list[str]

    def do_GET(self) -> None:
        self.hits.append(self.path)
        body = b"<html><body>Not found</body></html>"
        self.send_response(404)
        self.send_header("content-type", "text/html")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:  # quiet test output
        return


class _HtmlPostHandler(_PlainHandler):
    """Answers every POST with a 404 HTML page (a site's own not-found page)."""

    def do_POST(self) -> None:
        length = int(self.headers.get("content-length") or 0)
        self.rfile.read(length)
        self.do_GET()


class _PagePostHandler(_PlainHandler):
    """Answers every POST with 200 and a web page (a single-page app's catch-all route)."""

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("content-length") or 0))
        body = b"<!doctype html><html><body><div id=app></div></body></html>"
        self.send_response(200)
        self.send_header("content-type", "text/html; charset=utf-8")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


@pytest.fixture(
    params=[_PlainHandler, _HtmlPostHandler, _PagePostHandler], ids=["501", "404-html", "200-html"]
)
def plain_server(request: pytest.FixtureRequest) -> Iterator[tuple[str, list[str]]]:
    hits: list[str] = []
    handler = type("Handler", (request.param,), {"hits": hits})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/v1", hits
    finally:
        server.shutdown()
        server.server_close()
        thread.join(10)


@pytest.mark.parametrize("stream", [False, True])
async def test_a_server_that_is_not_openai_compatible_is_a_wrong_url(
    plain_server: tuple[str, list[str]], stream: bool
) -> None:
    base_url, _ = plain_server
    provider = Provider(model="m", base_url=base_url, api_key="k", retry_base_delay=0.001)
    with pytest.raises(NotOpenAIEndpointError) as info:
        await send(provider, stream=stream)
    err = info.value
    assert "retry later" not in str(err)
    assert "base_url" in err.message or "base URL" in err.message
    failure = explain(err)
    assert "--base-url" in failure.fix
    assert "retry" not in failure.fix


async def test_a_not_openai_endpoint_is_not_retried() -> None:
    hits: list[str] = []
    handler = type("Handler", (_PlainHandler,), {"hits": hits})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    posts = 0

    def count_post(self: http.server.BaseHTTPRequestHandler) -> None:
        nonlocal posts
        posts += 1
        self.send_error(501, "Unsupported method ('POST')")

    handler.do_POST = count_post  # type: ignore[attr-defined]
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        base_url = f"http://127.0.0.1:{server.server_address[1]}/v1"
        provider = Provider(model="m", base_url=base_url, api_key="k", retry_base_delay=0.001)
        with pytest.raises(NotOpenAIEndpointError):
            await send(provider, stream=False)
        assert posts == 1
    finally:
        server.shutdown()
        server.server_close()
        thread.join(10)


async def test_an_unknown_path_on_an_openai_server_is_a_wrong_url() -> None:
    with FakeOpenAIServer("echo") as server:
        base = server.base_url.removesuffix("/v1")  # forgot the /v1
        provider = Provider(model="m", base_url=base + "/api", api_key="k")
        with pytest.raises(NotOpenAIEndpointError) as info:
            await send(provider, stream=False)
        assert "/v1" in explain(info.value).fix


async def test_an_unknown_model_says_so() -> None:
    with FakeOpenAIServer("echo") as server:
        server.enqueue(
            Reply.error(404, "The model `gpt-9` does not exist.", code="model_not_found")
        )
        provider = Provider(model="gpt-9", base_url=server.base_url, api_key="k")
        with pytest.raises(ModelNotFoundError) as info:
            await send(provider, stream=False)
        assert server.request_count == 1
        assert "--model" in explain(info.value).fix


@pytest.mark.parametrize("stream", [False, True])
async def test_a_deterministic_500_is_not_retried(stream: bool) -> None:
    # llama.cpp answers 500 when the model's tool call cannot be parsed: the same request fails
    # the same way every time, so retrying it only multiplies the wait.
    message = (
        "Failed to parse tool call arguments as JSON: [json.exception.parse_error.101] "
        "parse error at line 1, column 1: syntax error while parsing value"
    )
    with FakeOpenAIServer("echo") as server:
        server.enqueue(*[Reply.error(500, message, type="server_error")] * 4)
        provider = Provider(
            model="m", base_url=server.base_url, api_key="k", retry_base_delay=0.001
        )
        with pytest.raises(InvalidRequestError) as info:
            await send(provider, stream=stream)
        assert server.request_count == 1
        assert info.value.status_code == 500
        assert "json.exception.parse_error" in str(info.value)
        assert "retry later" not in str(info.value)


async def test_an_ordinary_500_is_still_retried() -> None:
    with FakeOpenAIServer("echo") as server:
        server.enqueue(Reply.server_error(500), Reply.server_error(503))
        provider = Provider(
            model="m", base_url=server.base_url, api_key="k", retry_base_delay=0.001
        )
        await send(provider, stream=False)
        assert server.request_count == 3


def test_a_short_key_is_not_redacted_inside_words() -> None:
    text = "[json.exception.parse_error] syntax error near x"
    assert excerpt(text, "x") == text


def test_a_real_key_is_redacted_as_a_whole_token() -> None:
    key = "sk-live-0123456789abcdef"
    assert excerpt(f"Incorrect API key provided: {key}.", key) == (
        "Incorrect API key provided: ***."
    )
    # The same characters inside a longer token are not the key.
    assert excerpt(f"{key}XYZ", key) == f"{key}XYZ"


async def test_a_one_letter_key_leaves_the_servers_message_readable() -> None:
    with FakeOpenAIServer("echo") as server:
        server.enqueue(Reply.bad_request("[json.exception.type_error.302] syntax error"))
        provider = Provider(model="m", base_url=server.base_url, api_key="x")
        with pytest.raises(ProviderError) as info:
            await send(provider, stream=False)
        assert "json.exception.type_error" in str(info.value)
        assert "syntax error" in str(info.value)
        assert "***" not in str(info.value) and "***" not in (info.value.body or "")


def test_error_from_status_takes_plain_values() -> None:
    body = to_json({"error": {"message": "Incorrect API key provided.", "code": "invalid_api_key"}})
    err = error_from_status(401, {"x-request-id": "req_1"}, body, api_key=None)
    assert isinstance(err, AuthenticationError)
    assert err.request_id == "req_1"
    assert err.status_code == 401
    assert "Incorrect API key provided. Check OPENAI_API_KEY" in str(err)  # not "provided.; check"


@pytest.mark.parametrize("stream", [False, True])
async def test_a_silent_tls_handshake_is_a_connect_timeout_never_use_http(stream: bool) -> None:
    # The fake server speaks plain HTTP and, like llama.cpp's, waits silently for a request
    # line that a TLS ClientHello never completes. Silence is all the client knows: a loaded or
    # far TLS endpoint looks the same, so this is a connect timeout (retried as one), never
    # "use http://", which would send the API key in cleartext.
    with FakeOpenAIServer("echo") as server:
        base_url = server.base_url.replace("http://", "https://")
        provider = Provider(
            model="m", base_url=base_url, api_key="k", timeout=(0.5, 30.0), max_retries=1,
            retry_base_delay=0.001,
        )  # fmt: skip
        with pytest.raises(ProviderTimeout) as info:
            await asyncio.wait_for(send(provider, stream=stream), 60)
        assert not isinstance(info.value, ProtocolMismatchError)
        assert "connecting to" in info.value.message and "http://" not in info.value.message
        # The whole budget, then one retry, and each reaches the server: the budget starts once
        # the TLS context is loaded (charged with certifi's load, over a second under load,
        # both attempts once ran out before dialing), and an attempt's connect() to 127.0.0.1
        # runs before its first await. The server's thread counts a connection when it accepts
        # it, which on a loaded machine can come after the client gave up on it.
        for _ in range(600):
            if server.connections_opened >= 2:
                break
            await asyncio.sleep(0.05)
        assert server.connections_opened == 2


@pytest.mark.parametrize("own_client", [False, True], ids=["treadle-client", "user-httpx"])
async def test_https_to_a_server_that_answers_plain_http_fails_at_once(own_client: bool) -> None:
    # A plain-HTTP server that answers the ClientHello with an HTTP error (most do): the TLS
    # layer sees "wrong version number" at once; it must not be retried as a connection error.
    connections = 0

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal connections
        connections += 1
        await reader.read(10)
        writer.write(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    http_client = httpx.AsyncClient() if own_client else None
    try:
        provider = Provider(
            model="m", base_url=f"https://127.0.0.1:{port}/v1", api_key="k",
            retry_base_delay=0.001, http_client=http_client,
        )  # fmt: skip
        with pytest.raises(ProtocolMismatchError) as info:
            await send(provider, stream=False)
        assert f"base_url=http://127.0.0.1:{port}/v1" in info.value.message
        # Never retried. Treadle's pool makes one plain-HTTP probe of the port before it says
        # "use http://" (the handshake's failure alone does not prove the peer speaks HTTP).
        assert connections == (1 if own_client else 2)
    finally:
        if http_client is not None:
            await http_client.aclose()
        server.close()
        await server.wait_closed()


class _TlsPortHandler(_PlainHandler):
    """What nginx answers to plain HTTP at its TLS port."""

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("content-length") or 0))
        body = (
            b"<html><head><title>400 The plain HTTP request was sent to HTTPS port</title></head>"
            b"<body><center><h1>400 Bad Request</h1></center></body></html>"
        )
        self.send_response(400)
        self.send_header("content-type", "text/html")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


async def test_http_to_an_https_port_says_use_https() -> None:
    handler = type("Handler", (_TlsPortHandler,), {"hits": []})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        base_url = f"http://127.0.0.1:{server.server_address[1]}/v1"
        provider = Provider(model="m", base_url=base_url, api_key="k")
        with pytest.raises(ProtocolMismatchError) as info:
            await send(provider, stream=False)
        assert f"https://127.0.0.1:{server.server_address[1]}/v1" in info.value.message
        assert "https://" in explain(info.value).fix
    finally:
        server.shutdown()
        server.server_close()
        thread.join(10)


def test_a_base_url_that_is_not_a_url_gets_a_fix_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from treadle.cli import main

    monkeypatch.setenv("OPENAI_API_KEY", "sk-test-0123456789")
    code = main(["run", "--base-url", "notaurl", "--model", "m", "hello"])
    err = capsys.readouterr().err
    assert code != 0
    assert "treadle: fix:" in err
    assert "http" in err.split("treadle: fix:", 1)[1]
