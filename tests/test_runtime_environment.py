"""The runtime's integer settings from environment variables (`int_setting`)."""

from __future__ import annotations

import logging

import pytest

from treadle.runtime.busy_gc import DEFAULT_BUSY_THRESHOLD, _from_environment
from treadle.runtime.environment import int_setting
from treadle.runtime.start_gate import DEFAULT_MAX_STARTED, max_started_default


@pytest.mark.parametrize(
    ("value", "expected"), [(None, 7), ("", 7), ("  ", 7), ("12", 12), ("0", 0)]
)
def test_a_set_integer_is_read_and_an_unset_or_blank_one_is_the_default(
    monkeypatch: pytest.MonkeyPatch, value: str | None, expected: int
) -> None:
    if value is None:
        monkeypatch.delenv("TREADLE_TEST_SETTING", raising=False)
    else:
        monkeypatch.setenv("TREADLE_TEST_SETTING", value)
    assert int_setting("TREADLE_TEST_SETTING", 7) == expected


def test_a_value_that_is_no_integer_is_the_default_and_logged(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("TREADLE_MAX_STARTED_PASSES", "lots")
    monkeypatch.setenv("TREADLE_BUSY_GC_THRESHOLD", "1e4")
    with caplog.at_level(logging.WARNING, logger="treadle.runtime"):
        assert max_started_default() == DEFAULT_MAX_STARTED
        assert _from_environment() == DEFAULT_BUSY_THRESHOLD
    assert "TREADLE_MAX_STARTED_PASSES='lots' is not an integer" in caplog.text
    assert "TREADLE_BUSY_GC_THRESHOLD='1e4' is not an integer" in caplog.text
