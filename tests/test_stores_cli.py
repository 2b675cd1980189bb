"""`treadle sessions --store URL` and `treadle show store:KEY`, run as real commands; and the
JSONL <-> store round trip they use."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from treadle import Session, load_session, run_session_loop
from treadle.errors import ConflictError
from treadle.session import ChunkRow
from treadle.stores import Store
from treadle.testing import ScriptedExecutor

ROOT = Path(__file__).resolve().parent.parent
AGENT = Session.from_agent_prompt("Answer briefly.")


def treadle(*args: str, cwd: Path, **env: str) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("OPENAI_", "TREADLE_"))}
    return subprocess.run(
        [sys.executable, "-m", "treadle.cli", *args],
        cwd=cwd,
        env={**clean, "PYTHONPATH": str(ROOT / "src"), "NO_COLOR": "1", **env},
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_jsonl_round_trips_through_a_store(tmp_path: Path) -> None:
    out = run_session_loop(
        Session.from_user_message("hello"),
        AGENT,
        executor=ScriptedExecutor(["hi there"]),
        persist_path=tmp_path / "one.jsonl",
    )
    out.synchronize()
    with Store.sqlite(tmp_path / "s.db") as store:
        key, version = store.import_jsonl(tmp_path / "one.jsonl", key="imported")
        assert (key, version) == ("imported", 2)
        assert store.conversation("imported").rows == out.rows
        path = store.export_jsonl("imported", tmp_path / "back.jsonl")
        loaded = load_session(path)
        assert loaded.closed and loaded.session.rows == out.rows
        try:
            store.import_jsonl(tmp_path / "one.jsonl", key="imported")
        except ConflictError as err:
            assert "already exists" in str(err)
        else:
            raise AssertionError("importing onto an existing key must fail")


def test_sessions_and_show_on_a_store(tmp_path: Path) -> None:
    with Store.sqlite(tmp_path / "s.db") as store:
        for key, text in (("alice", "one"), ("bob", "two")):
            run_session_loop(
                Session.from_user_message(text),
                AGENT,
                executor=ScriptedExecutor([f"answer {text}"]),
                store=store,
                conversation=key,
            ).synchronize()
    listed = treadle("sessions", "--store", "sqlite:///s.db", "--json", cwd=tmp_path)
    assert listed.returncode == 0, listed.stderr
    data = json.loads(listed.stdout)
    assert sorted(c["key"] for c in data["conversations"]) == ["alice", "bob"]
    shown = treadle("show", "store:alice", cwd=tmp_path, TREADLE_STORE=str(tmp_path / "s.db"))
    assert shown.returncode == 0, shown.stderr
    assert "answer one" in shown.stdout and "2 rows" in shown.stdout
    missing = treadle("show", "store:carol", "--store", "s.db", cwd=tmp_path)
    assert missing.returncode != 0 and "No conversation 'carol'" in missing.stderr
    exported = treadle("sessions", "--store", "s.db", "--export", "out", cwd=tmp_path)
    assert exported.returncode == 0, exported.stderr
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["alice.jsonl", "bob.jsonl"]
    imported = treadle("sessions", "--store", "other.db", "--import", "out", cwd=tmp_path)
    assert imported.returncode == 0, imported.stderr
    assert "imported" in imported.stdout
    with Store.sqlite(tmp_path / "other.db") as other:
        assert [r.content for r in other.conversation("bob").rows] == ["two", "answer two"]


def test_an_import_stopped_at_an_existing_key_can_be_run_again(tmp_path: Path) -> None:
    """A directory import stops at the first key the store already has (nothing of that file is
    written), says how to go on, and `--skip-existing` then imports the rest, leaving the
    existing conversations as they are."""
    exported = tmp_path / "exported"
    with Store.sqlite(tmp_path / "src.db") as source:
        for key in ("a", "b", "c", "d"):
            source.append(key, [ChunkRow.user(f"text of {key}")])
        for key in ("a", "b", "c", "d"):
            source.export_jsonl(key, exported / f"{key}.jsonl")
    dst = tmp_path / "dst.db"
    with Store.sqlite(dst) as target:
        target.append("c", [ChunkRow.user("another c")])
    url = f"sqlite:///{dst}"
    first = treadle("sessions", "--store", url, "--import", str(exported), cwd=tmp_path)
    assert first.returncode != 0
    assert "'c' already exists" in first.stderr and "--skip-existing" in first.stderr
    assert "2 file(s) were imported before it" in first.stderr
    again = treadle(
        "sessions", "--store", url, "--import", str(exported), "--skip-existing", cwd=tmp_path
    )
    assert again.returncode == 0, again.stderr
    assert "skipped" in again.stdout and "c.jsonl" in again.stdout
    with Store.sqlite(dst) as target:
        assert sorted(i.key for i in target.conversations()) == ["a", "b", "c", "d"]
        assert [r.content for r in target.conversation("c").rows] == ["another c"]
        assert [r.content for r in target.conversation("d").rows] == ["text of d"]


def _session_file(path: Path, session_id: str, text: str) -> None:
    """A one-row session file whose header names `session_id`."""
    lines = [
        {"type": "header", "schema": 1, "session_id": session_id, "parent_ids": [],
         "operator": "run_session_loop", "created_at": 1.0, "placement": None, "agent_rows": []},
        {"type": "row", "kind": "user", "payload": {"content": text}},
        {"type": "trailer", "rows": 1, "usage": {}, "stop_reason": "final_answer",
         "metadata": {}},
    ]  # fmt: skip
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))


def test_skip_existing_reports_a_file_with_an_unusable_key_and_goes_on(tmp_path: Path) -> None:
    """A file whose session id is no usable store key (here it holds a NUL) is reported with
    its reason; the files after it are imported all the same, and the exit code says one was
    refused."""
    files = tmp_path / "files"
    files.mkdir()
    _session_file(files / "a.jsonl", "a", "text of a")
    _session_file(files / "b.jsonl", "bad\x00key", "text of b")
    _session_file(files / "c.jsonl", "c", "text of c")
    url = f"sqlite:///{tmp_path / 'dst.db'}"
    ran = treadle(
        "sessions", "--store", url, "--import", str(files), "--skip-existing", cwd=tmp_path
    )
    assert ran.returncode != 0
    assert "b.jsonl" in ran.stderr + ran.stdout and "NUL" in ran.stderr + ran.stdout
    assert "1 file(s) were not imported" in ran.stderr
    with Store.open(url) as target:
        assert sorted(i.key for i in target.conversations()) == ["a", "c"]


def test_skip_existing_skips_an_existing_empty_conversation(tmp_path: Path) -> None:
    """A key the store has counts as existing whatever its row count (as `fork` counts it): an
    empty conversation there is skipped, not imported into."""
    files = tmp_path / "files"
    files.mkdir()
    _session_file(files / "e.jsonl", "e", "text of e")
    dst = tmp_path / "dst.db"
    with Store.sqlite(dst) as target:
        assert target.append("e", []) == 0
    url = f"sqlite:///{dst}"
    plain = treadle("sessions", "--store", url, "--import", str(files), cwd=tmp_path)
    assert plain.returncode != 0 and "'e' already exists" in plain.stderr
    ran = treadle(
        "sessions", "--store", url, "--import", str(files), "--skip-existing", cwd=tmp_path
    )
    assert ran.returncode == 0, ran.stderr
    assert "skipped" in ran.stdout and "e.jsonl" in ran.stdout
    with Store.sqlite(dst) as target:
        assert target.conversation("e").rows == ()
