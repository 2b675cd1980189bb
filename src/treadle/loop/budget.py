"""The soft token budget of a pass: `Provider.budget_total_tokens` and `on_budget_exceeded`.

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
from typing import Any

from treadle.errors import BudgetExceededError
from treadle.loop.control import call_user
from treadle.session import Session, Usage
from treadle.tools.context import ToolContext, context_parameter

__all__ = ["soft_budget_crossed"]

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
