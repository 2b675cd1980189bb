"""The fix line for a flag a command does not take: the flag meant, or where that setting lives.

Never suggests `--help` as the flag meant (every fix line already says `--help` lists the flags),
and for a flag that belongs to another command, it names where the setting goes instead.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["unknown_flag_fix"]

# Flags of `treadle run` that `treadle eval` takes from the agent it loads instead.
_AGENT_SETTINGS = frozenset(
    {"--model", "--base-url", "--api-key", "--mcp", "--mcp-url", "--max-steps"}
)


def unknown_flag_fix(prog: str, message: str, known: Sequence[str]) -> str:
    """The `fix:` line for the parser error `message` of the command `prog`."""
    fix = f"`{prog} --help` lists every flag."
    if not message.startswith("unrecognized arguments:"):
        return fix
    import difflib  # only on this error path: start-up stays light

    candidates = [flag for flag in known if flag not in ("-h", "--help")]
    for word in message.split(":", 1)[1].split():
        flag = word.split("=", 1)[0]
        if not flag.startswith("-"):
            continue
        if prog.endswith(" eval") and flag in _AGENT_SETTINGS:
            return (
                f"treadle eval takes no {flag}: the agent named by --agent sets it (its "
                f"Provider(...) and tools, in your module). {fix}"
            )
        close = difflib.get_close_matches(flag, candidates, n=1)
        if close:
            return f"did you mean {close[0]}? {fix}"
    return fix
