"""Where the recorded replies of real providers are: `TREADLE_PROVIDER_REPLIES`, else
`shared/provider-replies` beside the checkout (or beside its parent, for a worktree one level
down). They live outside the project, so the tests that read them skip when they are absent."""

from __future__ import annotations

import os
from pathlib import Path


def replies_dir() -> Path | None:
    """The folder of recorded provider replies, or None when there is none."""
    named = os.environ.get("TREADLE_PROVIDER_REPLIES")
    root = Path(__file__).resolve().parents[1]
    candidates = [Path(named)] if named else []
    candidates += [root.parent / "shared" / "provider-replies"]
    candidates += [root.parent.parent / "shared" / "provider-replies"]
    return next((c for c in candidates if c.is_dir()), None)
