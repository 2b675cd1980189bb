"""Queue-per-conversation mode: five requests on one conversation at once, one after another.

A chat service whose users send a second message before the first is answered opens its store
with `on_conflict="queue"`: each pass waits for the conversation's running pass to commit, then
starts from its rows (across processes too: a file lock on SQLite, an advisory lock on
PostgreSQL). Run: `python examples/conversation_queue.py` (it uses the fake model server).
"""

from __future__ import annotations

import asyncio

from treadle import Provider, Session, arun_session_loop
from treadle.stores import Store
from treadle.testing import FakeOpenAIServer

AGENT = Session.from_agent_prompt("Answer briefly.")


async def main() -> None:
    with FakeOpenAIServer(script="echo") as server:
        provider = Provider(model="fake-model", base_url=server.base_url, api_key="sk-test")
        async with Store.sqlite("queue.db", on_conflict="queue") as store:
            outs = await asyncio.gather(
                *(
                    arun_session_loop(
                        Session.from_user_message(f"message {i}"),
                        AGENT,
                        provider=provider,
                        store=store,
                        conversation="user-7",
                    )
                    for i in range(5)
                )
            )
            # Every pass committed (no ConflictError), each on the version the one before made.
            print(sorted(out.metadata["version"] for out in outs))  # [2, 4, 6, 8, 10]
            convo = await store.conversation("user-7").wait_ready()
            for row in convo.table.rows:  # question, its answer, question, its answer, ...
                print(row.kind, row.content)


if __name__ == "__main__":
    asyncio.run(main())
