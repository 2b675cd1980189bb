"""Hostile session files: a saved file never chooses a host directory, host mounts, the network
or a weaker backend for the loaded session (the caller's `placement=` wins, or the load refuses
naming what the file asked for), and every malformed field is a `PersistenceError` naming the
file and the line, never a bare `ValueError`/`TypeError`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from sandbox_support import needs_bwrap
from treadle import load_session
from treadle.errors import PersistenceError
from treadle.sandbox import Isolated

HEADER: dict[str, Any] = {
    "type": "header",
    "schema": 1,
    "session_id": "s1",
    "parent_ids": [],
    "operator": "run_session_loop",
    "created_at": 0.0,
    "placement": "isolated",
    "agent_rows": [{"role": "system", "content": "be brief"}],
}
ROWS: list[dict[str, Any]] = [
    {"type": "row", "kind": "user", "payload": {"role": "user", "content": "hi"}},
    {"type": "row", "kind": "assistant", "payload": {"role": "assistant", "content": "hello"}},
    {"type": "trailer", "rows": 2, "usage": {"prompt_tokens": 1, "completion_tokens": 1,
     "total_tokens": 2, "requests": 1}, "stop_reason": "final_answer", "metadata": {}},
]  # fmt: skip


_DEFAULT_LIMITS: dict[str, Any] = Isolated().to_spec()["limits"]
_LIMITS = list(_DEFAULT_LIMITS)


def _file(tmp_path: Path, header: dict[str, Any], rows: list[dict[str, Any]] = ROWS) -> Path:
    path = tmp_path / "s.jsonl"
    path.write_text("".join(json.dumps(obj) + "\n" for obj in [header, *rows]))
    return path


@pytest.mark.parametrize(
    ("placement", "options", "named"),
    [
        ("/root", None, "host directory '/root'"),
        ("local", None, "'local' placement"),
        ("isolated", {"writable": ["/etc"]}, "writable host mounts /etc"),
        ("isolated", {"read_only": ["/root"]}, "read-only host mounts /root"),
        ("isolated", {"network": True}, "network access"),
        (
            "isolated",
            {"limits": dict.fromkeys(_LIMITS)},
            "limits looser than Isolated()'s "
            "(cpu_seconds=None, memory_bytes=None, max_processes=None",
        ),
        (
            "isolated",
            {"limits": {**_DEFAULT_LIMITS, "memory_bytes": 10**12}},
            "(memory_bytes=1000000000000)",
        ),
    ],
)
def test_a_file_cannot_choose_where_code_runs(
    tmp_path: Path, placement: str, options: dict[str, Any] | None, named: str
) -> None:
    header = {**HEADER, "placement": placement}
    if options is not None:
        spec = {**Isolated().to_spec(), **options}
        spec.pop("env")
        header["placement_options"] = {**spec, "env_names": []}
    path = _file(tmp_path, header)
    with pytest.raises(PersistenceError, match="may not choose") as raised:
        load_session(path)
    assert named in str(raised.value) and str(path) in str(raised.value)
    # The transcript still reads, and the caller's placement wins over the file's.
    assert load_session(path, sandbox=False).session.placement is None
    loaded = load_session(path, placement="local")
    try:
        assert loaded.session.placement == "local"
        workspace = loaded.session.require_sandbox().workspace
        assert workspace != Path("/root") and workspace.name.startswith("treadle-")
    finally:
        loaded.session.close_sandbox()


@needs_bwrap
def test_a_file_saved_from_a_box_and_edited_to_local_is_refused(tmp_path: Path) -> None:
    path = _file(tmp_path, {**HEADER, "placement": "local"})  # was "isolated" when written
    with pytest.raises(PersistenceError, match="'local'"):
        load_session(path)
    loaded = load_session(path, placement="isolated")
    try:
        assert loaded.session.require_sandbox().backend.name == "isolated"
    finally:
        loaded.session.close_sandbox()
    # The default box by name, or with default options, is what a file may ask for by itself.
    plain = load_session(_file(tmp_path, HEADER))
    assert plain.session.placement == "isolated"
    plain.session.close_sandbox()


def test_a_file_may_ask_for_limits_as_tight_as_or_tighter_than_the_default(
    tmp_path: Path,
) -> None:
    spec = Isolated().to_spec()
    spec.pop("env")
    tighter = {**_DEFAULT_LIMITS, "memory_bytes": 64 * 1024**2, "cpu_seconds": 5}
    header = {**HEADER, "placement_options": {**spec, "env_names": [], "limits": tighter}}
    loaded = load_session(_file(tmp_path, header))
    try:
        assert loaded.session.placement == "isolated"
        assert loaded.session.placement_spec == {**spec, "env": {}, "limits": tighter}
    finally:
        loaded.session.close_sandbox()


def _trailer(**metadata: Any) -> list[dict[str, Any]]:
    return [ROWS[0], {**ROWS[2], "metadata": metadata}]


def _row(**change: Any) -> dict[str, Any]:
    return {**ROWS[0], **change}


@pytest.mark.parametrize(
    ("header_change", "rows", "line"),
    [
        ({"schema": "abc"}, ROWS, 1),
        ({"schema": [1]}, ROWS, 1),
        ({"agent_rows": {"role": "system"}}, ROWS, 1),
        ({"agent_rows": [{"role": 5}]}, ROWS, 1),
        ({"session_id": 7}, ROWS, 1),
        ({}, [ROWS[0], {"type": "row", "payload": {}}], 3),
        ({}, [_row(kind="nonsense")], 2),
        ({}, [_row(payload="text")], 2),
        ({}, [{"type": "row", "kind": "tool_result", "payload": {"tool_call_id": 5}}], 2),
        ({}, [{"type": "row", "kind": "tool_result", "payload": []}], 2),
        ({}, [{"type": "intent", "tool_call_id": {"x": 1}}], 2),
        ({}, [{"type": "intent"}], 2),
        ({}, [ROWS[0], {**ROWS[2], "usage": {"prompt_tokens": "many"}}], 3),
        ({}, [ROWS[0], {**ROWS[2], "usage": [1, 2]}], 3),
        ({}, [ROWS[0], {**ROWS[2], "usage": {"total_tokens": -4}}], 3),
        ({}, [ROWS[0], {**ROWS[2], "stop_reason": 12}], 3),
        ({}, [ROWS[0], {**ROWS[2], "metadata": [1]}], 3),
        ({}, _trailer(pending_approvals=5), 3),
        ({}, _trailer(pending_approvals=[7]), 3),
        ({}, _trailer(pending_approvals=[{"id": "a", "name": 5, "arguments": "{}"}]), 3),
        ({}, _trailer(cancelled="yes"), 3),
        ({}, _trailer(interrupt_reason={"x": 1}), 3),
        ({}, _trailer(budget_message=3), 3),
    ],
)
def test_every_malformed_field_is_a_persistence_error_with_file_and_line(
    tmp_path: Path, header_change: dict[str, Any], rows: list[dict[str, Any]], line: int
) -> None:
    path = _file(tmp_path, {**HEADER, **header_change}, rows)
    with pytest.raises(PersistenceError) as raised:
        load_session(path, sandbox=False)
    assert f"{path}: line {line}" in str(raised.value)


def test_a_placement_that_is_not_a_name_is_damage(tmp_path: Path) -> None:
    path = _file(tmp_path, {**HEADER, "placement": ["isolated"]})
    with pytest.raises(
        PersistenceError,
        match=r"line 1: the header's placement is malformed \(\['isolated'\] is list",
    ):
        load_session(path)


def test_well_formed_trailer_metadata_comes_back(tmp_path: Path) -> None:
    call = {"id": "c1", "name": "delete", "arguments": '{"path": "x"}'}
    rows = _trailer(pending_approvals=[call], interrupt_reason="approval required for delete",
                    cancelled=False, other="dropped")  # fmt: skip
    session = load_session(_file(tmp_path, HEADER, rows), sandbox=False).session
    assert session.pending_approvals == [call]
    assert session.interrupt_reason == "approval required for delete"
    assert session.metadata["cancelled"] is False and "other" not in session.metadata
