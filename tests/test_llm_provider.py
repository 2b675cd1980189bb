"""Provider configuration, secrets masking and the request-body builder."""

from __future__ import annotations

import httpx
import pytest
from pydantic_core import from_json, to_json

from treadle.errors import ConfigurationError
from treadle.llm import Provider, build_request_body

KEY = "sk-test-SECRETSECRETSECRET-9876"


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("OPENAI_API_KEY", "OPENAI_BASE_URL", "TREADLE_MODEL"):
        monkeypatch.delenv(name, raising=False)


def test_repr_and_str_mask_the_key() -> None:
    provider = Provider(model="m", api_key=KEY, temperature=0.5)
    for text in (repr(provider), str(provider), repr(provider.resolve())):
        assert KEY not in text
        assert "…9876" in text
    assert "temperature=0.5" in repr(provider)


def test_env_fallbacks_resolve(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OPENAI_API_KEY", KEY)
    monkeypatch.setenv("OPENAI_BASE_URL", "https://example.test/v1/")
    monkeypatch.setenv("TREADLE_MODEL", "env-model")
    resolved = Provider().resolve()
    assert (resolved.model, resolved.api_key) == ("env-model", KEY)
    assert resolved.chat_completions_url == "https://example.test/v1/chat/completions"
    assert Provider.from_env(model="other").model == "other"


def test_missing_model_names_the_env_var() -> None:
    with pytest.raises(ConfigurationError, match="TREADLE_MODEL"):
        Provider(api_key=KEY).resolve()


def test_missing_key_names_the_env_var_unless_loopback() -> None:
    with pytest.raises(ConfigurationError, match="OPENAI_API_KEY"):
        Provider(model="m").check()
    for url in ("http://127.0.0.1:8080/v1", "http://localhost:11434/v1", "http://[::1]:8000/v1"):
        assert Provider(model="m", base_url=url).resolve().api_key is None


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("max_retries", -1),
        ("temperature", 2.5),
        ("temperature", -0.1),
        ("top_p", 1.5),
        ("max_tokens", 0),
        ("max_concurrent_requests", 0),
        ("requests_per_minute", -5),
        ("tokens_per_minute", 0),
        ("timeout", -1.0),
        ("base_url", "ftp://x"),
    ],
)
def test_bad_values_name_the_field(field: str, value: object) -> None:
    with pytest.raises(ConfigurationError, match=field):
        Provider(model="m", **{field: value})  # type: ignore[arg-type]


def test_timeout_shapes() -> None:
    assert Provider(model="m", timeout=5).httpx_timeout == httpx.Timeout(5.0)
    pair = Provider(model="m", timeout=(1.0, 30.0)).httpx_timeout
    assert (pair.connect, pair.read) == (1.0, 30.0)


def test_body_joins_encoded_messages_and_options() -> None:
    provider = Provider(
        model="m",
        base_url="http://127.0.0.1/v1",
        temperature=0.2,
        max_tokens=50,
        tool_choice="auto",
        parallel_tool_calls=True,
        stop=["\n\n"],
        extra_body={"top_k": 20},
    )
    messages = [
        to_json({"role": "system", "content": "s"}),
        to_json({"role": "user", "content": "u"}),
    ]
    tools = to_json([{"type": "function", "function": {"name": "f", "parameters": {}}}])
    body = from_json(build_request_body(provider, messages, tools, stream=True))
    assert body["messages"] == [
        {"role": "system", "content": "s"},
        {"role": "user", "content": "u"},
    ]
    assert body["tools"][0]["function"]["name"] == "f"
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert (body["model"], body["temperature"], body["max_tokens"]) == ("m", 0.2, 50)
    assert body["tool_choice"] == "auto" and body["parallel_tool_calls"] is True
    assert body["top_k"] == 20 and body["stop"] == ["\n\n"]

    plain = from_json(build_request_body(provider, messages, stream=False))
    assert plain["stream"] is False and "stream_options" not in plain
    assert "tool_choice" not in plain and "tools" not in plain


def test_body_extra_overrides_without_duplicate_keys() -> None:
    provider = Provider(model="m", base_url="http://127.0.0.1/v1", temperature=0.2)
    raw = build_request_body(
        provider, [b'{"role":"user","content":"x"}'], stream=False, extra={"temperature": 1.0}
    )
    assert raw.count(b'"temperature"') == 1
    assert from_json(raw)["temperature"] == 1.0
    raw = build_request_body(provider, [], stream=False, extra={"user": "u1"})
    assert from_json(raw)["user"] == "u1"
