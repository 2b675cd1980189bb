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
from collections.abc import Iterator
from pathlib import Path

import pytest

from pg_cluster import Cluster, cluster
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


@pytest.fixture(scope="module")
def pg() -> Iterator[Cluster]:
    yield from cluster()


@pytest.fixture(params=["sqlite", "postgres"])
def url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'store.db'}"
    running: Cluster = request.getfixturevalue("pg")
    return running.new_database()


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


def test_an_owner_in_another_pid_namespace_is_judged_by_its_lease_not_by_pid() -> None:
    """Same host name, another pid namespace (containers sharing a UTS namespace): its pid
    means nothing here, so a pid that is dead here does not free its pass, and one alive here
    does not hold it past its lease. Records as a process there writes them (`this_owner`)."""
    from treadle.stores.owner import owner_alive, this_owner

    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()  # a pid with no process behind it here
    mine = this_owner()
    there = {**mine, "pid": gone.pid, "pidns": "another-boot:4026531836", "lease": LEASE}
    now = time.time()
    assert owner_alive({"owner": there}, now, now)  # fresh lease: the owner may still run it
    assert not owner_alive({"owner": there}, now - LEASE - 1, now)  # its lease ran out
    alive_here = {**there, "pid": os.getpid()}  # a pid alive here is no proof over there
    assert not owner_alive({"owner": alive_here}, now - LEASE - 1, now)
    # In this namespace the pid is still what decides (a dead owner frees its pass at once).
    assert not owner_alive({"owner": {**mine, "pid": gone.pid}}, now, now)
    assert owner_alive({"owner": mine}, now - 10 * LEASE, now)
