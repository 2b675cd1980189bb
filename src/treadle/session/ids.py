"""Session ids: 32 hex characters, 128 random bits, drawn without a system call per id."""

from __future__ import annotations

import os
import random

__all__ = ["new_session_id"]

# Seeded from os.urandom; a private instance, so `random.seed()` cannot make ids repeat.
_ids = random.Random()
# A forked child must not repeat its parent's ids (the global `random` reseeds the same way).
os.register_at_fork(after_in_child=_ids.seed)


def new_session_id() -> str:
    """A fresh session id (32 hex characters, 128 random bits).

    Drawn from a private generator seeded from `os.urandom`, not `uuid.uuid4()`: that reads
    `os.urandom` on every call, a system call that lets go of the GIL, and a thread submitting
    passes while the runtime's loop is busy then waits a whole switch interval (5 ms) to get it
    back (10,000 lazy submissions: 1.4 s, mostly that wait; see docs/performance.md).
    """
    # `to_bytes(...).hex()`: the same 32 digits as `f"{n:032x}"`, in a third of its time.
    return _ids.getrandbits(128).to_bytes(16, "big").hex()
