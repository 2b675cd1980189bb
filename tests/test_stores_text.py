"""Text no database or file can hold, made during a pass: a lone surrogate (`"\\ud800"`, or the
`"\\udcff"` a file name read with `surrogateescape` carries) in a tool's result or in the model's
text is replaced with U+FFFD where it enters the transcript, so the pass commits (SQLite,
PostgreSQL) or persists (JSONL) the same rows it returns, instead of failing at its end.

Real parts: SQLite files, a throwaway PostgreSQL cluster (tests/pg_cluster.py), JSONL files.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pydantic_core
import pytest

from treadle import Session, arun_session_loop, tool
from treadle.loop.control import Guardrail
from treadle.persist.reader import load_session
from treadle.stores import Store
from treadle.testing import ScriptedExecutor
from treadle.testing.scripted import tool_call


@tool
def list_names() -> dict[str, Any]:
    """File names as `os.listdir` gives them for bytes that are not UTF-8."""
    return {"names": ["report-\udcff.txt", "ok.txt"], "odd\ud800key": 1}


def _script() -> ScriptedExecutor:
    return ScriptedExecutor([tool_call("list_names", {}), "Found \ud800 one odd name \udfff."])


def _check(rows: Any) -> None:
    kinds = [r.kind for r in rows]
    assert kinds == ["user", "assistant", "tool_result", "assistant"], kinds
    result = pydantic_core.from_json(rows[2].payload["content"])
    assert result == {"ok": True, "names": ["report-\ufffd.txt", "ok.txt"], "odd\ufffdkey": 1}
    assert rows[3].payload["content"] == "Found \ufffd one odd name \ufffd."
    for row in rows:  # every row can be written as UTF-8 now
        pydantic_core.to_json(row.payload)


@pytest.mark.parametrize("where", ["sqlite", "postgres"])
def test_a_lone_surrogate_from_a_tool_or_the_model_is_replaced_and_committed(
    where: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    url = (
        str(tmp_path / "text.db")
        if where == "sqlite"
        else request.getfixturevalue("pg").new_database()
    )

    async def main() -> None:
        async with Store.open(url) as store:
            out = await arun_session_loop(
                Session.from_user_message("list the files"),
                Session.from_agent_prompt("List files."),
                executor=_script(),
                tools=[list_names],
                store=store,
                conversation="files",
            )
            assert out.metadata["version"] == 4
            _check(out.rows)
            stored = await store.conversation("files")
            assert stored.rows == out.rows  # what the pass returned is what the store holds
            _check(stored.rows)

    asyncio.run(main())


def test_jsonl_persistence_replaces_them_the_same_way(tmp_path: Path) -> None:
    path = tmp_path / "files.jsonl"

    async def main() -> Session:
        return await arun_session_loop(
            Session.from_user_message("list the files"),
            Session.from_agent_prompt("List files."),
            executor=_script(),
            tools=[list_names],
            persist_path=path,
        )

    out = asyncio.run(main())
    _check(out.rows)
    loaded = load_session(path)
    assert loaded.closed and loaded.session.rows == out.rows


async def _interrupt(row: Any, control: Any) -> None:
    control.interrupt("why \ud800")


def _quote(data: Any) -> str:
    """A guardrail whose reason quotes the model's reply (text with a lone surrogate)."""
    return f"blocked reply: {data.reply.choices[0].message.content}"


def _metadata_pass(how: str, **outputs: Any) -> Any:
    if how == "interrupt":
        return arun_session_loop(
            Session.from_user_message("hi"),
            Session.from_agent_prompt("x"),
            executor=ScriptedExecutor(["an answer"]),
            on_message=_interrupt,
            **outputs,
        )
    return arun_session_loop(
        Session.from_user_message("hi"),
        Session.from_agent_prompt("x"),
        executor=ScriptedExecutor(["bad \ud800 reply"]),
        guardrails=[Guardrail(_quote, when="output")],
        **outputs,
    )


@pytest.mark.parametrize("how", ["interrupt", "guardrail"])
@pytest.mark.parametrize("where", ["jsonl", "sqlite", "postgres"])
def test_interrupt_and_guardrail_reasons_are_replaced_the_same_way(
    how: str, where: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    """A lone surrogate in `control.interrupt(reason)` or a guardrail's reason goes through the
    same `valid_text` at entry: the pass returns, and JSONL and the store hold what it returned."""

    async def main() -> None:
        if where == "jsonl":
            out = await _metadata_pass(how, persist_path=tmp_path / "t.jsonl")
            loaded = load_session(tmp_path / "t.jsonl")
            assert loaded.closed and loaded.session.rows == out.rows
            kept = loaded.session.metadata
        else:
            url = (
                str(tmp_path / "m.db")
                if where == "sqlite"
                else request.getfixturevalue("pg").new_database()
            )
            async with Store.open(url) as store:
                out = await _metadata_pass(how, store=store, conversation="k")
                assert (await store.conversation("k")).rows == out.rows
                (waiting,) = await store.apending("k") if how == "interrupt" else (None,)
                kept = {"interrupt_reason": getattr(waiting, "interrupt_reason", None)}
        if how == "interrupt":
            assert out.stop_reason == "interrupted"
            assert out.interrupt_reason == kept["interrupt_reason"] == "why \ufffd"
        else:
            assert out.stop_reason == "blocked"
            reason = "blocked reply: bad \ufffd reply"
            assert out.metadata["tripwire"].reason == reason
            if where == "jsonl":  # the trailer, as written (a loaded session drops it)
                lines = (tmp_path / "t.jsonl").read_text(encoding="utf-8").splitlines()
                trailer = pydantic_core.from_json(lines[-1])
                assert trailer["metadata"]["tripwire"]["reason"] == reason

    asyncio.run(main())


def test_valid_text_keeps_clean_values_and_replaces_every_surrogate_it_finds() -> None:
    # Clean values come back as the same objects (the walk builds nothing); a surrogate
    # anywhere, keys and tuples included, is replaced and only its containers are rebuilt.
    from treadle.session.rows import valid_text

    clean = {"role": "assistant", "content": None, "tool_calls": [{"id": "c", "n": 1}], "é": ("x",)}
    assert valid_text(clean) is clean
    dirty = {"k\ud800": [1, ("a", "b\udcff")], "same": clean, "ünï": "t\ud800"}
    fixed = valid_text(dirty)
    assert fixed == {"k\ufffd": [1, ("a", "b\ufffd")], "same": clean, "ünï": "t\ufffd"}
    assert fixed["same"] is clean and isinstance(fixed["k\ufffd"][1], tuple)


def test_valid_text_looks_at_a_deep_dirty_value_once(monkeypatch: pytest.MonkeyPatch) -> None:
    # A surrogate at the bottom of a value 200 levels deep: the clean-check runs over the value
    # once, not again at every level of the rebuild (which walked it once per level: 33x the
    # old cost at depth 150, seconds of a stalled loop). Counted in calls, not timed.
    from treadle.session import rows

    calls = 0
    clean = rows._clean

    def counting(value: object) -> bool:
        nonlocal calls
        calls += 1
        return clean(value)

    monkeypatch.setattr(rows, "_clean", counting)
    deep: object = "x\ud800"
    for _ in range(200):
        deep = [{"text": "t", "parts": deep}]
    fixed = rows.valid_text(deep)
    assert calls <= 2 * 200 * 3, calls  # a call per node at most (a level: list, dict, value)
    for _ in range(200):
        assert isinstance(fixed, list)
        fixed = fixed[0]["parts"]
    assert fixed == "x\ufffd"
