"""Closing a process pool whose worker no longer reads its pipe (frozen, or a tool holding the
GIL): the driver's sender is blocked on the full pipe, and `close` must still end the worker
after its grace and fail its passes with `WorkerLost`, never wait for the sender first."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import signal

import pytest

from treadle.distributed import AgentSpec, PassItem
from treadle.distributed import process as process_module
from treadle.distributed.process import ProcessPool
from treadle.errors import WorkerLost
from treadle.testing import FakeOpenAIServer
from treadle.testing.sample_tools import shout_script, shouter


async def test_closing_a_pool_whose_worker_stopped_reading_kills_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(process_module, "_STOP_GRACE", 1.0)
    with FakeOpenAIServer(script=shout_script) as server:
        spec = AgentSpec.from_agent(shouter(server.base_url))
        pool = ProcessPool(spec.to_json(), size=1)
        await pool.start()
        pid = pool.pids()[0]
        assert pid is not None
        os.kill(pid, signal.SIGSTOP)  # it reads nothing more
        item = PassItem(0, "s" * 32, [{"role": "user", "content": "x" * 1_000_000}])
        runs = [
            asyncio.create_task(pool.run(0, dataclasses.replace(item, index=i))) for i in range(16)
        ]
        await asyncio.sleep(0.5)  # 16 MB queued: the sender is blocked on the full pipe
        await asyncio.wait_for(pool.close(), 60)
        results = await asyncio.gather(*runs, return_exceptions=True)
        assert all(isinstance(r, WorkerLost) for r in results), results
        with pytest.raises(ProcessLookupError):  # killed and reaped
            os.kill(pid, 0)
