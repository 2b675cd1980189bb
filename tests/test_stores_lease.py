"""The owner lease of a pass running on another host: renewed while its process lives (a long
tool call is never taken for a dead owner), expired once it died (another process resumes it).

Two real processes on two "hosts": the owner runs in its own UTS namespace (`unshare --uts`,
root only) with another host name, so this process can only judge it by its lease, as a
process on another machine would. The lease is short here (`TREADLE_OWNER_LEASE_SECONDS`).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pg_cluster import Cluster
from treadle import Provider, Session, run_session_loop
from treadle import tool as make_tool
from treadle.errors import ConflictError
from treadle.stores import Store
from treadle.testing import FakeOpenAIServer
from treadle.testing.fake_replies import Reply

WORKER = str(Path(__file__).with_name("store_worker.py"))
AGENT = Session.from_agent_prompt("Answer briefly.")
LEASE = 4.0
#: Generous guards against a hang, never timing assertions.
CHILD_TIMEOUT = 240


def _can_be_another_host() -> bool:
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        return False
    probe = subprocess.run(
        ["unshare", "--uts", "--", "hostname", "treadle-probe"], capture_output=True
    )
    return probe.returncode == 0


pytestmark = [
    pytest.mark.slow,  # waits out several leases
    pytest.mark.skipif(
        not _can_be_another_host(), reason="needs root and unshare --uts (another host name)"
    ),
]


def test_a_live_owner_keeps_its_lease_and_a_dead_one_loses_it(url: str) -> None:
    with FakeOpenAIServer(script="echo") as server:
        server.enqueue(Reply.tool_call("wait_forever", {}))
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join(sys.path),
            "TREADLE_OWNER_LEASE_SECONDS": str(LEASE),
        }
        owner = subprocess.Popen(
            ["unshare", "--uts", "--", "sh", "-c",
             'hostname treadle-other-host && exec "$@"', "sh",
             sys.executable, WORKER, "hang", url, "long", server.base_url],
            stdout=subprocess.PIPE, text=True, env=env,
        )  # fmt: skip
        try:
            assert owner.stdout is not None
            assert owner.stdout.readline().strip() == "tool started"

            @make_tool
            def wait_forever() -> str:
                """Resumed here once the owner died: the call's outcome is unknown, so it is
                reported to the model instead of run again."""
                raise AssertionError("a call of unknown outcome ran again")

            provider = Provider(model="fake-model", base_url=server.base_url, api_key="k")
            with Store.open(url) as store:
                (first,) = store.pending("long")
                # Three leases pass while the tool runs: only the heartbeat keeps it owned.
                end = time.monotonic() + 3 * LEASE
                while time.monotonic() < end:
                    (now,) = store.pending("long")
                    assert (now.status, now.resumable) == ("running", False), now
                    time.sleep(LEASE / 8)
                assert now.updated_at > first.updated_at  # renewed, not written by the tool
                with pytest.raises(ConflictError, match="still running in a live process"):
                    run_session_loop(
                        Session(), AGENT, provider=provider, tools=[wait_forever],
                        store=store, conversation=now,
                    ).synchronize()  # fmt: skip
                owner.send_signal(signal.SIGKILL)
                owner.communicate(timeout=CHILD_TIMEOUT)
                deadline = time.monotonic() + CHILD_TIMEOUT
                while not store.pending("long")[0].resumable:  # the lease runs out
                    assert time.monotonic() < deadline
                    time.sleep(LEASE / 8)
                (dead,) = store.pending("long")
                out = run_session_loop(
                    Session(), AGENT, provider=provider, tools=[wait_forever],
                    store=store, conversation=dead,
                ).synchronize()  # fmt: skip
                assert out.metadata["version"] > 0
                assert store.pending("long") == []
        finally:
            if owner.poll() is None:
                owner.kill()
                owner.communicate(timeout=CHILD_TIMEOUT)


def test_a_lease_on_postgresql_is_timed_by_the_server_not_the_owner_clock(
    pg: Cluster, tmp_path: Path
) -> None:
    """The owner's wall clock runs 30 s behind (far more than its 4 s lease): the lease it
    renews is still current here, because PostgreSQL's clock times it. The skew is simulated
    (a sitecustomize shifting the owner's `time.time`): this machine's clock cannot be set."""
    url = pg.new_database()
    (tmp_path / "sitecustomize.py").write_text(
        "import time\n_real = time.time\ntime.time = lambda: _real() - 30.0\n"
    )
    with FakeOpenAIServer(script="echo") as server:
        server.enqueue(Reply.tool_call("wait_forever", {}))
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join([str(tmp_path), *sys.path]),
            "TREADLE_OWNER_LEASE_SECONDS": str(LEASE),
        }
        owner = subprocess.Popen(
            ["unshare", "--uts", "--", "sh", "-c",
             'hostname treadle-other-host && exec "$@"', "sh",
             sys.executable, WORKER, "hang", url, "long", server.base_url],
            stdout=subprocess.PIPE, text=True, env=env,
        )  # fmt: skip
        try:
            assert owner.stdout is not None
            assert owner.stdout.readline().strip() == "tool started"
            with Store.open(url) as store:
                (live,) = store.pending("long")
                assert (live.status, live.resumable) == ("running", False), live
        finally:
            owner.kill()
            owner.communicate(timeout=CHILD_TIMEOUT)
