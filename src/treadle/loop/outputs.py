"""Where a pass's rows go besides its output session: the persisted transcript and the stored
conversation, opened when the pass starts, finished when it ends, abandoned when it fails.

Kept apart from the engine so its pass walk stays readable; each function takes the running
pass (`engine._Pass`) and never blocks the event loop (the writer and the journal are async).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING

from treadle.loop.plan import PassPlan, plain_metadata
from treadle.session import ChunkRow, ChunkTable, SessionData
from treadle.session.stops import StopReason
from treadle.tools.unanswered import answer_gaps

if TYPE_CHECKING:
    from treadle.loop.engine import _Pass

__all__ = ["abandon_outputs", "finish_outputs", "open_conversation_of", "open_transcript"]


async def open_conversation_of(
    run: _Pass, plan: PassPlan, out_id: str, user: SessionData
) -> SessionData:
    """With `store=` and `conversation=`: the stored conversation first, then the input (see
    `treadle.stores.journal`); the input as it is otherwise."""
    if plan.store is None or plan.conversation is None:
        # Calls a new message goes on past are answered first; misplaced or repeated results
        # the caller supplied are refused here, before anything is requested.
        rows = user.table.rows
        answered = answer_gaps(rows)
        if answered is rows:
            return user
        run.table = ChunkTable._trusted(list(answered))
        return dataclasses.replace(user, table=run.table)
    # Imported here: `import treadle` and passes without a store never load the stores. From
    # the module, not the package: a package's `from ... import` is a Python call every pass.
    from treadle.stores.opening import open_conversation

    start = await open_conversation(
        plan.store.backend,
        plan.conversation,
        out_id,
        user.table.rows,
        run.agent_rows,
        queue=plan.store.on_conflict == "queue",
    )
    run.journal = start.journal
    # The committed rows were validated when read (or made by this process), the input's by
    # its table: no per-row check again.
    run.table, run.usage = ChunkTable._trusted(start.rows), start.usage
    run.user_metadata = start.metadata
    return SessionData(run.table, run.usage, None, start.metadata)


async def open_transcript(
    run: _Pass, plan: PassPlan, out_id: str, rows: Sequence[ChunkRow]
) -> None:
    """With `persist`: the transcript file's header and the input rows."""
    if plan.persist_path is None:
        return
    from treadle.persist.producer import producer_record  # loads with the first transcript
    from treadle.persist.writer import SessionWriter

    run.writer = SessionWriter(plan.persist_path)
    await run.writer.open(
        session_id=out_id,
        parent_ids=(plan.user.id, plan.agent.id),
        operator="run_session_loop",
        placement=plan.user.placement,
        placement_options=plan.user.placement_spec,
        agent_rows=run.agent_rows,
        rows=rows,
        producer=producer_record(plan.provider),
    )
    run.metadata["path"] = str(plan.persist_path)


async def finish_outputs(run: _Pass, stop_reason: StopReason) -> None:
    """The pass ended: the transcript's trailer, then the conversation's one transaction (the
    whole pass, or `ConflictError`)."""
    if run.writer is not None:
        await run.writer.finish(
            usage=run.usage, stop_reason=stop_reason, metadata=plain_metadata(run.metadata)
        )
    if run.journal is not None:
        from treadle.stores.records import KEPT_METADATA  # loaded with the journal

        # The commit keeps only what the next pass needs (`KEPT_METADATA`): the rest of the
        # metadata (a request_usage entry per request...) is not made plain for nothing.
        kept = {k: run.metadata[k] for k in KEPT_METADATA if k in run.metadata}
        run.metadata["version"] = await run.journal.finish(
            run.table.rows,
            usage=run.usage,
            stop_reason=stop_reason,
            metadata=plain_metadata(kept) if kept else kept,
        )
        run.metadata["conversation"] = run.journal.key


async def abandon_outputs(run: _Pass, err: BaseException) -> None:
    """The pass failed or was cancelled (called shielded): the transcript closes without a
    trailer, so readers see the pass did not end cleanly, and nothing is committed to the
    conversation, which stays as it was."""
    if run.writer is not None:
        await run.writer.aclose()
    if run.journal is not None:
        await run.journal.aclose(err)
