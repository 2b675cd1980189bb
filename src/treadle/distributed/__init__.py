"""Fan-out beyond one event loop: `treadle.map(..., backend="process" | "ray")`.

Agents cross process and machine boundaries as data (`AgentSpec`: model, endpoint, instructions,
tools by import path, limits; never an API key), sessions as OpenAI message lists, and results
come back as `PassOutcome`s (status, attempts, worker, messages, usage, stop reason). Workers are
processes of this machine (`backend="process"`) or Ray actors (`backend="ray"`, extra
`treadle[ray]`), each running many passes concurrently with its own HTTP pool, limiter and
sandbox root. Delivery is at-least-once. See docs/distributed.md.
"""

from treadle.distributed.backends import BACKENDS, amap, map, map_iter
from treadle.distributed.janitor import ROOT_PREFIX, clean_orphans, default_sandbox_base
from treadle.distributed.mapping import (
    DEFAULT_CALL_GRACE,
    DEFAULT_MAX_ATTEMPTS,
    REMOTE_BACKENDS,
    map_outcomes,
)
from treadle.distributed.outcome import (
    OUTCOME_METADATA_KEY,
    PassFailed,
    PassItem,
    PassLost,
    PassOutcome,
    PassStatus,
)
from treadle.distributed.results import ResultsWriter, read_results
from treadle.distributed.spec import DEFAULT_API_KEY_ENV, AgentSpec, resolve_tool, tool_path
from treadle.distributed.worker import PassWorker

__all__ = [
    "BACKENDS",
    "DEFAULT_API_KEY_ENV",
    "DEFAULT_CALL_GRACE",
    "DEFAULT_MAX_ATTEMPTS",
    "OUTCOME_METADATA_KEY",
    "REMOTE_BACKENDS",
    "ROOT_PREFIX",
    "AgentSpec",
    "PassFailed",
    "PassItem",
    "PassLost",
    "PassOutcome",
    "PassStatus",
    "PassWorker",
    "ResultsWriter",
    "amap",
    "clean_orphans",
    "default_sandbox_base",
    "map",
    "map_iter",
    "map_outcomes",
    "read_results",
    "resolve_tool",
    "tool_path",
]
