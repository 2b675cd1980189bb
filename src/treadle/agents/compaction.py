"""Compaction: replace the older rows of a session with a model-written summary.

`run_session_compress` keeps every system row, summarises the other rows before a cut point into
one user row ("Summary of the earlier conversation: ..."), and keeps the most recent rows
verbatim. The cut point never separates an assistant row's tool calls from their `tool_result`
rows. `TokenEstimator` turns request bytes into a token estimate, calibrated from the usage
providers report, so agents can compact before a request would overflow the context window.

This module must never drop a system row, never leave a tool call without its result (or a result
without its call) that was paired in the input, and never mutate its input session.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

from treadle.errors import ConfigurationError
from treadle.llm.provider import Provider
from treadle.loop import Guardrail, GuardrailInput, Limits, Tripwire, arun_session_loop
from treadle.runtime import run_lazy
from treadle.session import ChunkRow, Session, SessionData, Usage

if TYPE_CHECKING:
    from treadle.agents.agent import Agent

__all__ = [
    "DEFAULT_COMPACTION_INSTRUCTION",
    "DEFAULT_KEEP_LAST",
    "MAX_SUMMARY_INPUT_ROW_CHARS",
    "SUMMARY_PREFIX",
    "TokenEstimator",
    "arun_session_compress",
    "compaction_cut",
    "request_bytes",
    "run_session_compress",
]

#: Non-system rows kept verbatim at the end of a compacted session (by default).
DEFAULT_KEEP_LAST = 6
#: Each row's text is cut to this many characters when shown to the summariser, so one huge tool
#: result cannot make the summary request itself overflow.
MAX_SUMMARY_INPUT_ROW_CHARS = 4_000
#: The start of the summary row's text.
SUMMARY_PREFIX = "Summary of the earlier conversation:\n"
DEFAULT_COMPACTION_INSTRUCTION = (
    "Summarise the conversation below so that it can continue without it. Keep every fact, "
    "decision, file name, number, open question and unfinished task; drop pleasantries. "
    "Answer with the summary only."
)
# Bytes of JSON per token before any usage was observed (typical of English and JSON text).
_DEFAULT_TOKENS_PER_BYTE = 0.25


def compaction_cut(rows: Sequence[ChunkRow], keep_last: int) -> int:
    """Index where the verbatim tail starts: about `keep_last` non-system rows from the end,
    moved earlier until no tool call before it has its result at or after it."""
    if keep_last < 0:
        raise ConfigurationError(f"keep_last must be >= 0, got {keep_last}.")
    cut = len(rows)
    kept = 0
    while cut > 0 and kept < keep_last:
        cut -= 1
        if rows[cut].kind != "system":
            kept += 1
    issued: dict[str, int] = {}
    answered_at: dict[str, int] = {}
    for i, row in enumerate(rows):
        if row.kind == "assistant":
            for call in row.tool_calls:
                issued.setdefault(str(call.get("id")), i)
        elif row.kind == "tool_result":
            answered_at[str(row.payload.get("tool_call_id"))] = i
    # A cut at i is invalid while a call issued before i is answered at or after i.
    spans = [(issued[c], answered_at[c]) for c in issued if c in answered_at]
    while cut > 0 and any(start < cut <= end for start, end in spans):
        cut -= 1
    return cut


def _compactable(rows: Sequence[ChunkRow], keep_last: int) -> bool:
    cut = compaction_cut(rows, keep_last)
    summarised = [r for r in rows[:cut] if r.kind != "system"]
    # One earlier summary alone is not worth summarising again.
    return len(summarised) > 1 or (len(summarised) == 1 and not _is_summary(summarised[0]))


def _is_summary(row: ChunkRow) -> bool:
    return (
        row.kind == "user"
        and isinstance(row.content, str)
        and row.content.startswith(SUMMARY_PREFIX)
    )


def _text_of(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return " ".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
    return ""


def _clip(text: str) -> str:
    if len(text) <= MAX_SUMMARY_INPUT_ROW_CHARS:
        return text
    dropped = len(text) - MAX_SUMMARY_INPUT_ROW_CHARS
    return text[:MAX_SUMMARY_INPUT_ROW_CHARS] + f"…[truncated {dropped} chars]"


def render_transcript(rows: Iterable[ChunkRow]) -> str:
    """The rows as plain text for the summariser (tool calls and results described in words)."""
    lines = []
    for row in rows:
        if row.kind == "user":
            lines.append(f"User: {_clip(_text_of(row.content))}")
        elif row.kind == "assistant":
            text = _text_of(row.content)
            if text:
                lines.append(f"Assistant: {_clip(text)}")
            for call in row.tool_calls:
                fn = call.get("function", {})
                lines.append(
                    f"Assistant called tool {fn.get('name')} with {_clip(str(fn.get('arguments')))}"
                )
        elif row.kind == "tool_result":
            lines.append(f"Tool {row.payload.get('name')} returned: {_clip(_text_of(row.content))}")
    return "\n".join(lines)


async def arun_session_compress(
    session: Session,
    agent_session: Session,
    *,
    agent_provider: Provider | None = None,
    executor: object | None = None,
    instruction: str | None = None,
    keep_last: int = DEFAULT_KEEP_LAST,
) -> Session:
    """Compact `session` on the calling loop (see `run_session_compress`)."""
    if not isinstance(session, Session) or not isinstance(agent_session, Session):
        raise ConfigurationError("run_session_compress takes a session and an agent session.")
    if isinstance(keep_last, bool) or not isinstance(keep_last, int) or keep_last < 0:
        raise ConfigurationError(f"keep_last must be an int >= 0, got {keep_last!r}.")
    data = await session.wait_ready()
    rows = data.table.rows
    cut = compaction_cut(rows, keep_last)
    head = rows[:cut]
    summarised = [r for r in head if r.kind != "system"]
    if not summarised:
        return _derived(session, data, list(rows), Usage(), 0)
    prompt = (
        f"{instruction or DEFAULT_COMPACTION_INSTRUCTION}\n\n<conversation>\n"
        f"{render_transcript(summarised)}\n</conversation>"
    )
    out = await arun_session_loop(
        Session.from_user_message(prompt),
        agent_session,
        agent_provider=agent_provider,
        executor=executor,
        limits=Limits(max_steps=1, final_answer_on_limit=True),
    )
    summary = (out.final_text or "").strip() or "(the summariser returned nothing)"
    new_rows = [
        *(r for r in head if r.kind == "system"),
        ChunkRow.user(SUMMARY_PREFIX + summary),
        *rows[cut:],
    ]
    return _derived(session, data, new_rows, out.usage, len(summarised))


def _derived(
    session: Session, data: SessionData, rows: list[ChunkRow], cost: Usage, summarised: int
) -> Session:
    from treadle.session import ChunkTable

    metadata = {"compaction": {"summarised_rows": summarised, "kept_rows": len(rows)}}
    return Session._derive(
        SessionData(ChunkTable(rows), data.usage + cost, data.stop_reason, metadata),
        operator="compress",
        kind=session.lineage.kind,
        parents=[session],
        sandbox=session.sandbox_handle,
    )


def run_session_compress(
    session: Session,
    agent_session: Session,
    *,
    agent_provider: Provider | None = None,
    executor: object | None = None,
    instruction: str | None = None,
    keep_last: int = DEFAULT_KEEP_LAST,
) -> Session:
    """Return at once a lazy, shorter `session`: older rows summarised by the model into one row.

    System rows are kept (those before the cut come first, in order), then one user row starting
    with `SUMMARY_PREFIX`, then the last `keep_last` non-system rows verbatim (a few more when
    needed so that no tool call is separated from its result). The summary is written by one
    completion with `agent_session`'s rows as system prompt and `instruction` (default
    `DEFAULT_COMPACTION_INSTRUCTION`); its tokens are added to the usage. Nothing to summarise
    gives a copy with the same rows. `out.metadata["compaction"]` counts the rows.
    """
    if not isinstance(session, Session) or not isinstance(agent_session, Session):
        raise ConfigurationError("run_session_compress takes a session and an agent session.")
    if agent_provider is None and executor is None:
        raise ConfigurationError(
            "run_session_compress needs agent_provider=Provider(model=...) (or an executor)."
        )
    return run_lazy(
        arun_session_compress(
            session,
            agent_session,
            agent_provider=agent_provider,
            executor=executor,
            instruction=instruction,
            keep_last=keep_last,
        ),
        parents=[session],
        operator="compress",
        kind=session.lineage.kind,
    )


def request_bytes(
    agent_rows: Iterable[ChunkRow], rows: Iterable[ChunkRow], tools: bytes | None
) -> int:
    """Bytes of the messages and tool schemas a request would send."""
    total = sum(len(r.message_json()) for r in agent_rows)
    total += sum(len(r.message_json()) for r in rows)
    return total + (len(tools) if tools else 0)


class TokenEstimator:
    """Estimates prompt tokens from request bytes, calibrated by the usage providers report.

    Starts at one token per four bytes; every observation moves the ratio halfway towards the
    measured one. Safe to share between concurrent passes (a float is replaced atomically).
    """

    def __init__(self, tokens_per_byte: float = _DEFAULT_TOKENS_PER_BYTE) -> None:
        self.tokens_per_byte = tokens_per_byte

    def estimate(self, nbytes: int) -> int:
        """Estimated tokens of a request of `nbytes` bytes."""
        return int(nbytes * self.tokens_per_byte)

    def observe(self, prompt_tokens: int, nbytes: int) -> None:
        """Calibrate from a provider's reported `prompt_tokens` for `nbytes` bytes sent."""
        if prompt_tokens > 0 and nbytes > 0:
            self.tokens_per_byte = (self.tokens_per_byte + prompt_tokens / nbytes) / 2

    def observe_pass(
        self,
        agent_rows: Sequence[ChunkRow],
        before: Session,
        after: Session,
        tools: bytes | None,
    ) -> None:
        """Calibrate from a finished pass: its prompt tokens against the bytes of its requests."""
        rows = after.data.table.rows
        start = len(before.data.table)
        prompt = after.data.usage.prompt_tokens - before.data.usage.prompt_tokens
        if prompt <= 0 or start > len(rows):
            return
        base = sum(len(r.message_json()) for r in agent_rows) + (len(tools) if tools else 0)
        sent = 0
        prefix = sum(len(r.message_json()) for r in rows[:start])
        for i in range(start, len(rows)):
            if rows[i].kind == "assistant":  # each assistant row answers one request
                sent += base + prefix
            prefix += len(rows[i].message_json())
        self.observe(prompt, sent)


def compaction_guardrail(agent: Agent, compactions: Callable[[], int]) -> Guardrail:
    """The guardrail that asks for a compaction when `agent`'s next request would reach
    `compact_at_tokens` (at most `MAX_COMPACTIONS_PER_RUN` a run: `compactions()` counts them).
    """
    from treadle.agents.agent import _COMPACTION_GUARD, MAX_COMPACTIONS_PER_RUN

    limit = agent.compact_at_tokens
    assert limit is not None
    keep = agent.compact_keep_last

    async def check(data: GuardrailInput) -> Tripwire | None:
        if compactions() >= MAX_COMPACTIONS_PER_RUN:
            return None
        request = data.request
        rows = request.rows
        nbytes = request_bytes(request.agent_rows, rows, request.tools.schemas_json())
        estimate = agent.estimator.estimate(nbytes)
        if estimate < limit or not _compactable(rows, keep):
            return None
        return Tripwire(
            reason=f"estimated context of {estimate} tokens reached compact_at_tokens={limit}",
            guardrail=_COMPACTION_GUARD,
            when="before",
            info=estimate,
        )

    return Guardrail(check, "before", _COMPACTION_GUARD)
