"""Child processes for the store conformance tests (run as `python store_worker.py CMD ...`).

`append URL KEY I BASE_URL`: one turn ("msg I") on conversation KEY through the fake server,
   run again on the latest version after each `ConflictError` until it commits.
`fanout URL KEY BASE_URL N [queue]`: fork N processes (after the imports, before any thread
   starts), each doing `append` with its own I; exits 0 when every one did. With `queue` the
   store is opened with `on_conflict="queue"`: each turn runs once (a `ConflictError` fails the
   child) and prints `I VERSION`, the version its commit made.
`spin URL KEY`: append 20-row batches forever, printing each committed version (to be killed).
`hang URL KEY BASE_URL`: a pass whose tool prints "tool started" then waits forever.
`resume URL KEY BASE_URL`: resume the conversation's pending pass, approving every call.
"""

from __future__ import annotations

import os
import sys
import threading

from treadle import Provider, Session, run_session_loop, tool
from treadle.errors import ConflictError
from treadle.session import ChunkRow
from treadle.stores import Store

AGENT = Session.from_agent_prompt("Answer briefly.")


@tool(needs_approval=True)
def deploy(target: str) -> str:
    """Deploy to `target` (a human approves each call)."""
    return f"deployed to {target}"


@tool
def quick() -> str:
    """Answer at once."""
    return "quick result"


@tool
def wait_forever() -> str:
    """Block until the process dies."""
    print("tool started", flush=True)
    threading.Event().wait()
    return "never"


def append(url: str, key: str, index: str, base_url: str, queue: bool = False) -> None:
    """One turn, run again on the latest version until it commits (queued: run once)."""
    provider = Provider(model="fake-model", base_url=base_url, api_key="k")
    if queue:
        with Store.open(url, on_conflict="queue") as store:
            out = run_session_loop(
                Session.from_user_message(f"msg {index}"),
                AGENT,
                provider=provider,
                store=store,
                conversation=key,
            )
            print(index, out.metadata["version"], flush=True)
        return
    store = Store.open(url)
    while True:
        try:
            run_session_loop(
                Session.from_user_message(f"msg {index}"),
                AGENT,
                provider=provider,
                store=store,
                conversation=key,
            ).synchronize()
            break
        except ConflictError:
            continue  # another process committed first: the turn runs on the new version
    store.close()


def fanout(url: str, key: str, base_url: str, n: int, queue: bool = False) -> int:
    """Fork `n` appenders (this process has imported everything and started no thread yet)."""
    if url.startswith("postgres"):
        import psycopg_pool  # noqa: F401  (imported once here, not in each child)
    children = []
    for i in range(n):
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                append(url, key, str(i), base_url, queue)
                code = 0
            finally:
                os._exit(code)
        children.append(pid)
    failed = 0
    for pid in children:
        _, status = os.waitpid(pid, 0)
        failed += status != 0
    return failed


def main(argv: list[str]) -> None:
    command, url, key = argv[:3]
    if command == "append":
        append(url, key, argv[3], argv[4])
        return
    if command == "fanout":
        queue = argv[5:] == ["queue"]
        sys.exit(1 if fanout(url, key, argv[3], int(argv[4]), queue) else 0)
    store = Store.open(url)
    if command == "spin":
        rows = [ChunkRow.user(f"row {i} " + "x" * 2000) for i in range(20)]
        while True:
            print(store.append(key, rows), flush=True)
    elif command == "hang":
        provider = Provider(model="fake-model", base_url=argv[3], api_key="k")
        run_session_loop(
            Session.from_user_message("wait"),
            AGENT,
            provider=provider,
            tools=[quick, wait_forever],
            store=store,
            conversation=key,
        ).synchronize()
    elif command == "resume":
        provider = Provider(model="fake-model", base_url=argv[3], api_key="k")
        (pending,) = store.pending(key)
        out = run_session_loop(
            Session(),
            AGENT,
            provider=provider,
            tools=[deploy],
            store=store,
            conversation=pending,
            approvals={call["id"]: True for call in pending.pending_approvals},
        )
        print(out.stop_reason, out.metadata["version"], flush=True)
    store.close()


if __name__ == "__main__":
    main(sys.argv[1:])
