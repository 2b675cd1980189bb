"""What a hostile review found in the conversation stores: a live pass taken over by another
process, exports written through planted symlinks, imports of endless or special files, and
keys whose file names do not fit. Real files, real child processes (tests/store_worker.py)."""

from __future__ import annotations

import io
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from treadle import Provider, Session, run_session_loop
from treadle import tool as make_tool
from treadle.cli.console import Console
from treadle.cli.stores import export_file_name, store_sessions_command
from treadle.errors import ConfigurationError, ConflictError, PersistenceError
from treadle.persist.reader import load_session
from treadle.session import ChunkRow
from treadle.stores import Store, transfer
from treadle.testing import FakeOpenAIServer
from treadle.testing.fake_replies import Reply

WORKER = str(Path(__file__).with_name("store_worker.py"))
AGENT = Session.from_agent_prompt("Answer briefly.")
#: Generous: the suite must pass on a loaded 2-core machine.
CHILD_TIMEOUT = 240


@pytest.fixture(scope="module")
def server() -> Iterator[FakeOpenAIServer]:
    with FakeOpenAIServer(script="echo") as srv:
        yield srv


def test_a_pass_running_in_a_live_process_cannot_be_taken_over(
    tmp_path: Path, server: FakeOpenAIServer
) -> None:
    url = f"sqlite:///{tmp_path / 'store.db'}"
    server.enqueue(Reply.tool_call("wait_forever", {}))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    child = subprocess.Popen(
        [sys.executable, WORKER, "hang", url, "live", server.base_url],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        assert child.stdout is not None
        assert child.stdout.readline().strip() == "tool started"

        @make_tool
        def wait_forever() -> str:
            """Must not run here: the live process is still running it."""
            raise AssertionError("a call still running elsewhere ran again")

        provider = Provider(model="fake-model", base_url=server.base_url, api_key="k")
        with Store.open(url) as store:
            (pending,) = store.pending("live")
            assert (pending.status, pending.resumable) == ("running", False)
            with pytest.raises(ConflictError, match="still running in a live process"):
                run_session_loop(
                    Session(), AGENT, provider=provider, tools=[wait_forever],
                    store=store, conversation=pending,
                ).synchronize()  # fmt: skip
            assert store.conversation("live").rows == ()
            child.send_signal(signal.SIGKILL)
            child.communicate(timeout=CHILD_TIMEOUT)
            (dead,) = store.pending("live")  # its process died: now another may resume it
            assert (dead.status, dead.resumable) == ("running", True)
    finally:
        if child.poll() is None:
            child.kill()
            child.communicate(timeout=CHILD_TIMEOUT)


def test_export_never_writes_through_a_planted_symlink(tmp_path: Path) -> None:
    victim = tmp_path / "victim.txt"
    victim.write_text("PRECIOUS\n")
    out = tmp_path / "out"
    out.mkdir()
    (out / ".k.jsonl.partial").symlink_to(victim)  # the old fixed temporary name
    with Store.sqlite(tmp_path / "e.db") as store:
        store.append("k", [ChunkRow.user("transcript row")])
        store.export_jsonl("k", out / "k.jsonl")
        assert victim.read_text() == "PRECIOUS\n"
        assert (out / "k.jsonl").is_file() and not (out / "k.jsonl").is_symlink()
        assert load_session(out / "k.jsonl", sandbox=False).session.rows[0].content == (
            "transcript row"
        )
        linked = out / "linked.jsonl"
        linked.symlink_to(victim)
        with pytest.raises(ConfigurationError, match="is a symbolic link"):
            store.export_jsonl("k", linked)
        assert victim.read_text() == "PRECIOUS\n"
        assert sorted(p.name for p in out.iterdir() if p.name.endswith(".partial")) == [
            ".k.jsonl.partial"  # the planted link only: no partial file left behind
        ]


def test_import_refuses_a_fifo_a_device_a_link_and_an_oversized_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fifo = tmp_path / "a.jsonl"
    os.mkfifo(fifo)
    (tmp_path / "z.jsonl").symlink_to("/dev/zero")
    with Store.sqlite(tmp_path / "i.db") as store:
        failures: list[BaseException] = []

        def attempt() -> None:
            try:
                store.import_jsonl(fifo)
            except BaseException as err:
                failures.append(err)

        worker = threading.Thread(target=attempt, daemon=True)
        worker.start()
        worker.join(CHILD_TIMEOUT)
        if worker.is_alive():  # it hangs on the FIFO: give it a writer so the thread ends
            with open(fifo, "wb"):
                pass
            worker.join(CHILD_TIMEOUT)
            pytest.fail("importing a FIFO with no writer hung")
        assert isinstance(failures[0], PersistenceError)
        assert "not a regular file" in str(failures[0])
        with pytest.raises(PersistenceError, match="not a regular file"):
            store.import_jsonl("/dev/zero")
        with pytest.raises(PersistenceError, match="symbolic link"):
            store.import_jsonl(tmp_path / "z.jsonl")
        good = tmp_path / "good.jsonl"
        store.append("k", [ChunkRow.user("hello")])
        store.export_jsonl("k", good)
        monkeypatch.setattr(transfer, "MAX_IMPORT_BYTES", good.stat().st_size - 1)
        with pytest.raises(PersistenceError, match="over the import limit"):
            store.import_jsonl(good, key="big")
        monkeypatch.setattr(transfer, "MAX_IMPORT_BYTES", good.stat().st_size)
        assert store.import_jsonl(good, key="fits") == ("fits", 1)
        assert store.pending() == []


def test_export_names_fit_a_file_system_for_a_long_unicode_key(tmp_path: Path) -> None:
    long_key = "ключ" * 25  # 100 characters, 600 bytes once quoted
    with Store.sqlite(tmp_path / "s.db") as store:
        store.append(long_key, [ChunkRow.user("long")])
        store.append("short", [ChunkRow.user("short")])
    names = {export_file_name(long_key), export_file_name("short")}
    assert all(len(n.encode()) <= 255 for n in names)
    assert export_file_name(long_key) != export_file_name(long_key + "x")
    console = Console(io.StringIO())
    assert store_sessions_command(str(tmp_path / "s.db"), console, export=tmp_path / "out") == 0
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == sorted(names)
