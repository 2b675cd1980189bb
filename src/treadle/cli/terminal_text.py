"""Render model and tool text for a terminal: control characters shown, never obeyed.

A model's reply, a tool's output and a saved transcript are text from outside: printed raw, an
escape sequence in them would reach the user's terminal (OSC 52 writing the clipboard, OSC 8
links, title changes, screen clears, text hidden with SGR 8 or moved with cursor controls). The
CLI prints every such text through `visible`, which shows each C0 and C1 control character the
way `less` does (ESC as `^[`, CR as `^M`, DEL as `^?`; C1, bidirectional, zero-width and tag
characters and line separators as `<U+009B>`), keeping newlines and tabs. With no ESC, CSI or
OSC introducer left, no sequence can start. `treadle --raw ...` skips this for those who want the
bytes. Pure functions; no I/O.
"""

from __future__ import annotations

__all__ = ["visible"]


def _table() -> dict[int, str]:
    table: dict[int, str] = {}
    for code in range(0x20):
        if code not in (0x09, 0x0A):  # tab and newline keep their meaning
            table[code] = "^" + chr(code + 0x40)
    table[0x7F] = "^?"
    # C1 controls (CSI is 0x9B, OSC 0x9D on terminals that take 8-bit controls); the
    # bidirectional overrides, isolates and marks that reorder what a line appears to say; the
    # line and paragraph separators; zero-width characters that hide text between letters; and
    # the tag characters, invisible letters that can carry a whole hidden message.
    shown = [
        *range(0x80, 0xA0),
        *range(0x202A, 0x202F),
        *range(0x2066, 0x206A),
        0x200E,  # left-to-right mark
        0x200F,  # right-to-left mark
        0x061C,  # Arabic letter mark
        0x2028,  # line separator
        0x2029,  # paragraph separator
        *range(0x200B, 0x200E),  # zero-width space, non-joiner, joiner
        0x2060,  # word joiner
        0xFEFF,  # zero-width no-break space (byte order mark)
        *range(0xE0000, 0xE0080),  # tags
    ]
    for code in shown:
        table[code] = f"<U+{code:04X}>"
    return table


_VISIBLE = _table()


def visible(text: str) -> str:
    """`text` with every control character shown as printable text (newlines and tabs kept)."""
    return text.translate(_VISIBLE)
