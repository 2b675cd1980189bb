"""The ends of a pass's token limits: the soft budget (`Provider.budget_total_tokens` and
`on_budget_exceeded`), and the last tool-less answer `Limits.final_answer_on_limit` asks for.

Two different things bound a pass's tokens. `Limits(max_total_tokens=...)` is the hard stop: the
pass ends with `stop_reason == "budget"`. `Provider(budget_total_tokens=...)` is a soft budget:
when a pass first crosses it, `on_budget_exceeded(session, usage)` is called once (raise
`BudgetExceededError` there to stop the pass), and without a callback one warning is logged on
the `treadle` logger and the pass runs on.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any

from treadle.errors import BudgetExceededError
from treadle.loop.control import call_user
from treadle.loop.events import AssistantRowEvent
from treadle.session import ChunkRow, Session, Usage
from treadle.session.rows import valid_text
from treadle.tools.context import ToolContext, context_parameter

if TYPE_CHECKING:
    from treadle.loop.engine import _Pass

__all__ = ["check_budget", "final_answer", "soft_budget_crossed"]

_NO_TOOLS = {"tool_choice": "none"}

logger = logging.getLogger("treadle")


async def soft_budget_crossed(
    callback: Callable[..., Any] | None,
    *,
    pass_id: str,
    usage: Usage,
    budget: int,
    snapshot: Callable[[], AbstractContextManager[Session]],
    context: Callable[[Session], ToolContext],
) -> str | None:
    """Handle the first crossing of the soft budget; the stop message when the pass must stop."""
    if callback is None:
        logger.warning(
            "pass %s used %d tokens, over Provider.budget_total_tokens=%d; it runs on "
            "(set Limits(max_total_tokens=...) to stop it, or on_budget_exceeded to decide)",
            pass_id,
            usage.total_tokens,
            budget,
        )
        return None
    param = context_parameter(callback)  # asked once per pass: the budget fires once
    try:
        with snapshot() as session:
            if param is None:
                await call_user(callback, session, usage)
            else:
                await call_user(callback, session, usage, **{param: context(session)})
    except BudgetExceededError as err:
        return str(err)
    return None


async def final_answer(run: _Pass) -> None:
    """One last completion with tools switched off, after a limit stopped the pass."""
    turn = await run.complete(run.request(_NO_TOOLS))
    payload = dict(turn.payload)
    payload.pop("tool_calls", None)  # a model that calls tools anyway: keep its text only
    run.count(turn.usage)
    row = ChunkRow._trusted("assistant", valid_text(payload))
    if run.pump is not None:
        await run.pump.drain()
    await run.append([row], boundary=True)
    if run.events is not None:
        run.events.emit(AssistantRowEvent, row=row)


async def check_budget(run: _Pass) -> None:
    """After each reply: the hard cap (`Limits.max_total_tokens`) and the soft budget, which
    fires once per pass, when the total first crosses it."""
    total = run.pass_usage.total_tokens
    cap = run.plan.limits.max_total_tokens
    if cap is not None and total >= cap:
        run.budget_stop = True
    provider = run.plan.provider
    budget = provider.budget_total_tokens if provider is not None else None
    if budget is None or run.budget_fired or total < budget:
        return
    run.budget_fired = True
    message = await soft_budget_crossed(
        provider.on_budget_exceeded if provider is not None else None,
        pass_id=run.out_id,
        usage=run.pass_usage,
        budget=budget,
        snapshot=run.snapshot,
        context=run.context,
    )
    if message is not None:
        run.budget_stop = True
        run.metadata["budget_message"] = message
