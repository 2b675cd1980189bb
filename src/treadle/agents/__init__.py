"""Agents and workflows: `Agent`, fan-out (`map`), pipelines, handoffs, triage, structured
output and validators, hooks, streaming and compaction, all built on the public session loop."""

from treadle.agents.agent import MAX_COMPACTIONS_PER_RUN, Agent, AgentInput
from treadle.agents.agent_run import RunSettings
from treadle.agents.compaction import (
    DEFAULT_COMPACTION_INSTRUCTION,
    DEFAULT_KEEP_LAST,
    SUMMARY_PREFIX,
    TokenEstimator,
    arun_session_compress,
    compaction_cut,
    run_session_compress,
)
from treadle.agents.fanout import DEFAULT_CONCURRENCY, amap, map, map_iter
from treadle.agents.handoffs import MAX_HANDOFFS_PER_RUN, Handoff, handoff, remove_tool_rows
from treadle.agents.outcomes import AgentErrorContext
from treadle.agents.patterns import Pipeline, Triage, brainstorm, pipeline, triage
from treadle.agents.streaming import AgentEvent, AgentPassEvent, AgentRunStopped, HandoffEvent
from treadle.agents.structured import (
    DEFAULT_OUTPUT_RETRIES,
    FINAL_RESULT_TOOL,
    StructuredMode,
    StructuredOutputError,
)

__all__ = [
    "DEFAULT_COMPACTION_INSTRUCTION",
    "DEFAULT_CONCURRENCY",
    "DEFAULT_KEEP_LAST",
    "DEFAULT_OUTPUT_RETRIES",
    "FINAL_RESULT_TOOL",
    "MAX_COMPACTIONS_PER_RUN",
    "MAX_HANDOFFS_PER_RUN",
    "SUMMARY_PREFIX",
    "Agent",
    "AgentErrorContext",
    "AgentEvent",
    "AgentInput",
    "AgentPassEvent",
    "AgentRunStopped",
    "Handoff",
    "HandoffEvent",
    "Pipeline",
    "RunSettings",
    "StructuredMode",
    "StructuredOutputError",
    "TokenEstimator",
    "Triage",
    "amap",
    "arun_session_compress",
    "brainstorm",
    "compaction_cut",
    "handoff",
    "map",
    "map_iter",
    "pipeline",
    "remove_tool_rows",
    "run_session_compress",
    "triage",
]
