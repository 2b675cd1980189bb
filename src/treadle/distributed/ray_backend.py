"""`RayPool`: the `backend="ray"` workers, one Ray async actor per worker process.

Each actor holds a `PassWorker` (its own HTTP pool, limiter and sandbox root) and runs many passes
concurrently on the actor's event loop. Actors are created without Ray's own restarts: when one
dies, the scheduler (`treadle.distributed.driver`) gets `WorkerLost` for its in-flight passes,
replaces the actor, and retries the passes on any worker. One named actor, `SharedLimits`,
holds what the workers share: the learned rate limits (a `LimitBroker` every worker leases
permits from in small batches, without configuration) and, with `rate_limit="shared"`, the
configured requests-per-minute cap as one `TokenBucket` (tokens taken in small batches too). Ray
is imported only when this backend is used; this module must never make it a dependency of the
rest of Treadle, and never call an actor without a bound on how long it waits.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import time
import uuid
from typing import Any

from treadle.distributed.driver import WorkerLost
from treadle.distributed.outcome import PassItem, PassOutcome
from treadle.distributed.worker import PassWorker, worker_name
from treadle.errors import ConfigurationError
from treadle.llm.limit_broker import LimitBroker
from treadle.llm.shared_limits import install_shared_limits

__all__ = ["LEASE_TIMEOUT", "WORKER_START_TIMEOUT", "PassActor", "RayPool", "SharedLimits",
           "TokenBucket", "ensure_ray", "load_ray"]  # fmt: skip

#: Seconds an actor may take to start and build its agent.
WORKER_START_TIMEOUT = 120.0
# Seconds to wait for an actor to clean up its sandbox root at close.
_CLOSE_TIMEOUT = 10.0
# Extra concurrent calls an actor accepts beyond the passes in flight (ready, close).
_CONTROL_CALLS = 4
#: Seconds a worker waits for a lease before pacing on its own share of the learned limits.
LEASE_TIMEOUT = 10.0


def load_ray() -> Any:
    """The `ray` module, or a `ConfigurationError` saying how to install it."""
    try:
        return importlib.import_module("ray")
    except ImportError:
        raise ConfigurationError(
            "backend='ray' needs Ray: pip install 'treadle[ray]' (or use backend='process')."
        ) from None


def ensure_ray(address: str | None = None) -> Any:
    """Connect to Ray if this process is not connected yet (`address`: a cluster, `"auto"`, or
    None for a local instance); return the `ray` module."""
    ray = load_ray()
    if not ray.is_initialized():
        ray.init(address=address, include_dashboard=False)
    return ray


class TokenBucket:
    """A requests-per-second bucket shared by every worker (runs as a named Ray actor)."""

    def __init__(self, rate_per_second: float, burst: float) -> None:
        self.rate = rate_per_second
        self.capacity = burst
        self.tokens = burst
        self.last = time.monotonic()

    def reserve(self, n: int) -> float:
        """Take `n` tokens now; return the seconds the caller must wait before using them."""
        now = time.monotonic()
        self.tokens = min(self.capacity, self.tokens + (now - self.last) * self.rate)
        self.last = now
        self.tokens -= n
        return max(0.0, -self.tokens / self.rate)


class SharedLimits:
    """What a map's workers share (runs as a named Ray actor): the learned limits they lease, and
    the configured requests-per-second bucket of `rate_limit="shared"` (None: not configured)."""

    def __init__(self, rate_per_second: float | None, burst: float, workers: int) -> None:
        self.bucket = TokenBucket(rate_per_second, burst) if rate_per_second else None
        self.broker = LimitBroker(workers)

    def reserve(self, n: int) -> float:
        """`TokenBucket.reserve` of the configured bucket."""
        if self.bucket is None:
            raise ConfigurationError("this map has no shared requests-per-minute bucket")
        return self.bucket.reserve(n)

    def lease(self, request: dict[str, Any]) -> dict[str, Any]:
        """`LimitBroker.lease`: a worker's reports in, permits out."""
        return self.broker.lease(request)

    def forget(self, worker: str) -> None:
        """A worker died: what it had leased is no longer in flight."""
        self.broker.forget(worker)

    def stats(self) -> dict[str, int]:
        """Lease round trips and 429s reported so far."""
        return {"leases": self.broker.leases, "refusals": self.broker.refusals}


class _SharedRateGate:
    """A worker's side of the shared bucket: takes `batch` tokens at a time, hands them out."""

    def __init__(self, bucket: Any, batch: int) -> None:
        self.bucket = bucket
        self.batch = batch
        self.local = 0
        self._lock: asyncio.Lock | None = None

    async def __call__(self) -> None:
        if self._lock is None:
            self._lock = asyncio.Lock()
        async with self._lock:  # passes of this worker wait in line behind the one refilling
            if self.local == 0:
                wait = await asyncio.wait_for(
                    self.bucket.reserve.remote(self.batch), WORKER_START_TIMEOUT
                )
                await asyncio.sleep(wait)
                self.local = self.batch
            self.local -= 1


class PassActor:
    """The body of a worker actor (made remote by `RayPool`)."""

    def __init__(
        self, spec: dict[str, Any], options: dict[str, Any], limits: tuple[str, int] | None
    ) -> None:
        gate = None
        if limits is not None:  # (the SharedLimits actor's name, the configured bucket's batch)
            shared = load_ray().get_actor(limits[0])

            async def lease(request: dict[str, Any]) -> dict[str, Any]:
                reply: dict[str, Any] = await asyncio.wait_for(
                    shared.lease.remote(request), LEASE_TIMEOUT
                )
                return reply

            install_shared_limits(lease, worker_name())  # before the agent's limiters exist
            if limits[1]:
                gate = _SharedRateGate(shared, limits[1])
        self.worker = PassWorker(spec, rate_gate=gate, **options)

    async def ready(self) -> str:
        """This worker's name, once it is up."""
        return self.worker.name

    async def run(self, item: dict[str, Any]) -> dict[str, Any]:
        """Run one pass; return its outcome as JSON."""
        return (await self.worker.run(item)).to_json()

    async def close(self) -> None:
        """Remove this worker's sandbox root."""
        await asyncio.to_thread(self.worker.close)


class RayPool:
    """`size` Ray actors running passes of `spec`."""

    def __init__(
        self,
        spec: dict[str, Any],
        *,
        size: int | None = None,
        concurrency: int,
        sandbox_base: str | None = None,
        pass_timeout: float | None = None,
        rate_limit: str = "split",
        requests_per_minute: int | None = None,
        address: str | None = None,
        num_cpus: float = 1,
        worker_init: str | None = None,
    ) -> None:
        self._ray = ensure_ray(address)
        resources = self._ray.cluster_resources()
        self.size = size or max(1, int(resources.get("CPU", 1) // max(num_cpus, 0.001)))
        self._spec = spec
        shared = rate_limit == "shared" and requests_per_minute is not None
        self._options = {
            "share": 1.0 / self.size,
            "sandbox_base": sandbox_base,
            "pass_timeout": pass_timeout,
            "worker_init": worker_init,
        }
        self._actor_class = self._ray.remote(PassActor).options(
            max_concurrency=concurrency + _CONTROL_CALLS, num_cpus=num_cpus, max_restarts=0
        )
        rate, batch = None, 0
        if shared:
            assert requests_per_minute is not None
            rate = requests_per_minute / 60.0
            # Small batches keep the bucket actor's cost low without letting one worker hoard.
            batch = max(1, min(10, int(rate // 20)))
        name = f"treadle-limits-{uuid.uuid4().hex[:12]}"
        self._limits: Any = (
            self._ray.remote(SharedLimits)
            .options(name=name, num_cpus=0)
            .remote(rate, batch, self.size)
        )
        self._limits_ref: tuple[str, int] | None = (name, batch)
        self._actors: list[Any] = [None] * self.size
        self._names = ["none"] * self.size

    def worker_name(self, slot: int) -> str:
        """The current worker of `slot`, `host:pid`."""
        return self._names[slot]

    async def _spawn(self, slot: int) -> None:
        actor = self._actor_class.remote(self._spec, self._options, self._limits_ref)
        self._actors[slot] = actor
        try:
            self._names[slot] = await asyncio.wait_for(actor.ready.remote(), WORKER_START_TIMEOUT)
        except Exception as err:
            raise ConfigurationError(f"a Ray worker could not start: {err}") from None

    async def start(self) -> None:
        """Start every actor (in parallel)."""
        try:
            await asyncio.gather(*(self._spawn(slot) for slot in range(self.size)))
        except BaseException:
            await self.close()
            raise

    async def run(self, slot: int, item: PassItem) -> PassOutcome:
        """Run one pass on the actor of `slot`."""
        actor = self._actors[slot]
        if actor is None:
            raise WorkerLost(f"worker slot {slot} has no live actor")
        exceptions = self._ray.exceptions
        try:
            data = await actor.run.remote(item.to_json())
        except (exceptions.RayActorError, exceptions.ActorUnavailableError) as err:
            raise WorkerLost(f"worker {self._names[slot]} died: {type(err).__name__}") from None
        return PassOutcome.from_json(data)

    async def restart(self, slot: int) -> None:
        """Replace the actor of `slot` (its janitor removes the dead one's sandboxes)."""
        old = self._actors[slot]
        self._actors[slot] = None
        if old is not None:
            with contextlib.suppress(Exception):
                self._ray.kill(old, no_restart=True)
        if self._limits is not None:  # what the dead worker leased is not in flight any more
            with contextlib.suppress(Exception):
                self._limits.forget.remote(self._names[slot])
        await self._spawn(slot)

    async def shared_stats(self) -> dict[str, int]:
        """The shared limits actor's counts (lease round trips, 429s reported)."""
        stats: dict[str, int] = await asyncio.wait_for(self._limits.stats.remote(), _CLOSE_TIMEOUT)
        return stats

    async def close(self) -> None:
        """Let each live actor remove its sandbox root, then end the actors and the bucket."""
        actors = [a for a in self._actors if a is not None]
        self._actors = [None] * self.size

        async def stop(actor: Any) -> None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(actor.close.remote(), _CLOSE_TIMEOUT)
            with contextlib.suppress(Exception):
                self._ray.kill(actor, no_restart=True)

        await asyncio.gather(*(stop(a) for a in actors))
        if self._limits is not None:
            with contextlib.suppress(Exception):
                self._ray.kill(self._limits, no_restart=True)
            self._limits = None
