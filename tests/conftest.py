"""Shared fixtures. Tests talk to real parts: the runtime thread, real files, real subprocesses."""

from __future__ import annotations

import signal
import uuid
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

# CPython 3.11 keeps one AST-construction depth counter per interpreter, not per thread
# (python/cpython#106905), so two threads building ASTs at once can raise a spurious
# "AST constructor recursion depth mismatch". Hypothesis's pytest plugin imports (and pytest
# rewrites) the hypothesis package lazily at the end of the session, while Treadle's runtime and
# worker threads may still be running; importing it here, before any thread starts, removes that
# window.
import hypothesis  # noqa: F401
import pytest

from sandbox_support import BACKENDS, open_sandbox, processes_with

if TYPE_CHECKING:
    from pathlib import Path

    import trustme

    from treadle.testing import FakeOpenAIServer
    from treadle.testing.postgres import PostgresCluster

# A shell without job control starts background commands with SIGINT ignored (POSIX), and an
# ignored signal stays ignored across exec: Python then installs no KeyboardInterrupt handler, so
# every CLI child of a suite started that way (`make test &` from a script, some CI runners)
# ignores Ctrl-C, and tests that press it hang (`treadle show --follow` did, in about half the
# fresh-clone runs). The suite stands in for a terminal user, whose Ctrl-C is live: restore the
# default handler here, which the children then inherit as the default disposition.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.fixture(scope="session")
def pg() -> Iterator[PostgresCluster]:
    """A throwaway PostgreSQL cluster for the store tests, one per test process (each test takes
    a fresh database of it); without PostgreSQL installed they skip (fail on CI)."""
    from pg_cluster import cluster

    yield from cluster()


@pytest.fixture(params=["sqlite", "postgres"])
def url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A fresh, empty conversation store of each backend in turn, as a URL (children open it
    too): a SQLite file, or a new database of the `pg` cluster."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'store.db'}"
    running: PostgresCluster = request.getfixturevalue("pg")
    return running.new_database()


@pytest.fixture(params=BACKENDS)
def any_sandbox(request: pytest.FixtureRequest) -> Iterator[Any]:
    """A fresh sandbox of each backend in turn (`local`, `isolated`)."""
    yield from open_sandbox(request.param)


@pytest.fixture
def marker() -> str:
    """A `sleep` argument no other process on the machine uses: `sleep {marker}` sleeps 30 s and
    lets the test find every such process on the host, whichever PID namespace it is in."""
    return f"30.{uuid.uuid4().int % 10**12:012d}"


@pytest.fixture
def survivors() -> Callable[[str], list[int]]:
    """`survivors(marker)`: host pids still running a command that contains `marker`."""
    return processes_with


@pytest.fixture(scope="session")
def user_mypy(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Any]:
    """`user_mypy(directory, *files)`: `mypy` with a user's strict configuration (MYPY_INI in
    tests/user_mypy.py) on `files` in `directory`, as a CompletedProcess.

    Type-checking Treadle and its dependencies from cold costs several CPU-seconds a run; the
    suite's user-code checks share one cache (across xdist workers too) and take turns, so only
    the first pays it and each later run reads the cache."""
    from user_mypy import run_user_mypy

    # The base temp of one xdist worker sits in the run's shared directory: the cache and its
    # lock go there, one for the whole run.
    shared = tmp_path_factory.getbasetemp().parent / "user-mypy"
    shared.mkdir(exist_ok=True)
    return lambda directory, *files: run_user_mypy(shared, directory, *files)


# -- the network tests' set-up (test_http_connect*.py): a test CA, no proxy or CA from the env --


@pytest.fixture
def clean_network(monkeypatch: pytest.MonkeyPatch) -> None:
    """No proxy or CA settings of the developer's or CI's own in this test (`pytestmark =
    pytest.mark.usefixtures("clean_network")` in a module that dials)."""
    from connect_helpers import clean_network_env

    clean_network_env(monkeypatch)


@pytest.fixture(scope="module")
def ca() -> trustme.CA:
    """A test certificate authority, one for each module that asks."""
    import trustme

    return trustme.CA()


@pytest.fixture(scope="module")
def ca_file(ca: trustme.CA) -> Iterator[str]:
    """`ca`'s certificate as a PEM file (for `verify=` paths and SSL_CERT_FILE)."""
    with ca.cert_pem.tempfile() as path:
        yield path


@pytest.fixture
def server() -> Iterator[FakeOpenAIServer]:
    """The fake model server answering with the `echo` script, one for each test (a module that
    wants another script or scope defines its own `server`)."""
    from treadle.testing import FakeOpenAIServer

    with FakeOpenAIServer(script="echo") as srv:
        yield srv


@pytest.fixture
def parse_hold(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[float]]:
    """The thread CPU time of every message parse of the test, in seconds (the real `_parse`,
    over stdio and HTTP)."""
    from mcp_holds import timed  # the MCP SDK is an extra: imported by the tests that use it
    from treadle.mcp import http, stdio

    held: list[float] = []
    timed_parse = timed(stdio._parse, held)
    monkeypatch.setattr(stdio, "_parse", timed_parse)
    monkeypatch.setattr(http, "_parse", timed_parse)
    yield held
    assert held, "no message was parsed"
    print(f"longest parse {max(held) * 1000:.1f} ms of thread CPU")
