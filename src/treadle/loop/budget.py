"""The ends of a pass's limits: the token caps (`Limits.max_total_tokens`, and
`Provider.budget_total_tokens` whose `on_budget_exceeded` fires once, when the total first
crosses), and the last tool-less answer `Limits.final_answer_on_limit` asks for. Never blocks the
event loop."""

from __future__ import annotations

from typing import TYPE_CHECKING

from treadle.errors import BudgetExceededError
from treadle.loop.control import call_user
from treadle.loop.events import AssistantRowEvent
from treadle.session import ChunkRow

if TYPE_CHECKING:
    from treadle.loop.engine import _Pass

__all__ = ["check_budget", "final_answer"]

_NO_TOOLS = {"tool_choice": "none"}


async def check_budget(run: _Pass) -> None:
    """Stop the pass (or ask `on_budget_exceeded`) once its tokens reach a cap or budget."""
    total = run.pass_usage.total_tokens
    cap = run.plan.limits.max_total_tokens
    if cap is not None and total >= cap:
        run.budget_stop = True
    provider = run.plan.provider
    budget = provider.budget_total_tokens if provider is not None else None
    if budget is None or run.budget_fired or total < budget:
        return
    run.budget_fired = True  # fires once per pass, when the total first crosses the cap
    callback = provider.on_budget_exceeded if provider is not None else None
    if callback is None:  # no one to ask: the budget is a limit, the pass stops
        run.budget_stop = True
        run.metadata["budget_message"] = (
            f"the pass used {total} tokens, over its budget of {budget}"
        )
        return
    try:
        with run.snapshot() as session:
            await call_user(callback, session, run.pass_usage)
    except BudgetExceededError as err:
        run.budget_stop = True
        run.metadata["budget_message"] = str(err)


async def final_answer(run: _Pass) -> None:
    """One last completion with tools switched off, after a limit stopped the pass."""
    turn = await run.complete(run.request(_NO_TOOLS))
    payload = dict(turn.payload)
    payload.pop("tool_calls", None)  # a model that calls tools anyway: keep its text only
    run.count(turn.usage)
    row = ChunkRow._trusted("assistant", payload)
    if run.pump is not None:
        await run.pump.drain()
    await run.append([row], boundary=True)
    if run.events is not None:
        run.events.emit(AssistantRowEvent, row=row)
