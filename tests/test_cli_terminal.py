"""Model and tool text never drives the user's terminal: `treadle run`'s live output and
`treadle show` (plain and styled) print control characters visibly, as `less` does, keeping
newlines and tabs; `--raw` gives the bytes. Driven as real subprocesses against the fake server,
with a reply and a tool output full of escape sequences.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from treadle.cli.terminal_text import visible
from treadle.testing import FakeOpenAIServer, Reply

ROOT = Path(__file__).resolve().parent.parent

CLIPBOARD = "\x1b]52;c;cHduZWQ=\x07"  # OSC 52: write "pwned" to the clipboard
LINK = "\x1b]8;;http://evil.example/\x1b\\click\x1b]8;;\x1b\\"  # OSC 8 hyperlink
TITLE = "\x1b]0;pwned title\x07"  # window title
CLEAR = "\x1b[2J\x1b[H"  # clear the screen, cursor home
HIDDEN = "\x1b[8mhidden text\x1b[0m"  # SGR 8: invisible
C1 = "\x9b2J"  # CSI as one C1 character
BIDI = "\u202eevil"  # right-to-left override
HOSTILE = f"A{CLIPBOARD}B {LINK} {TITLE} {CLEAR} {HIDDEN} {C1} {BIDI}\rover\nline2\n\tindented"
SEQUENCES = (CLIPBOARD, "\x1b]8;", TITLE, CLEAR, "\x1b[8m", "\x9b", "\u202e", "\x07", "\r")


def _env() -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if not (k.startswith(("OPENAI_", "TREADLE_")) or k == "NO_COLOR")
    }
    env["PYTHONPATH"] = str(ROOT / "src")
    return env


def treadle(*args: str, cwd: Path) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(
        [sys.executable, "-m", "treadle.cli", *args],
        cwd=cwd,
        env=_env(),
        capture_output=True,
        timeout=120,
    )


def _assert_neutralised(out: str) -> None:
    for sequence in SEQUENCES:
        assert sequence not in out, f"{sequence!r} reached the terminal"


@pytest.fixture(scope="module")
def hostile_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """A real `treadle run --persist` whose tool prints, and whose model says, escape sequences."""
    cwd = tmp_path_factory.mktemp("hostile")
    command = "printf 'tool \\033]0;tool title\\007 \\033[2J done'"
    replies = [Reply.tool_call("run_shell_command", {"cmd": command}), Reply.text(HOSTILE)]
    with FakeOpenAIServer(replies=replies) as server:
        proc = treadle(
            "run", "go", "--model", "fake-model", "--base-url", server.base_url,
            "--sandbox", "local", "--persist", cwd=cwd,
        )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    (path,) = (cwd / ".treadle" / "sessions").glob("*.jsonl")
    return path, proc.stdout.decode()


def test_run_live_output_shows_controls_instead_of_obeying_them(
    hostile_run: tuple[Path, str],
) -> None:
    _, out = hostile_run
    _assert_neutralised(out)
    assert "\x1b" not in out  # plain output (not a terminal): no escape at all
    assert "A^[]52;c;cHduZWQ=^GB" in out  # shown the way `less` shows it
    assert "^[[8mhidden text^[[0m" in out and "<U+009B>2J" in out and "<U+202E>evil^Mover" in out
    assert "line2\n\tindented" in out  # newlines and tabs keep their meaning


@pytest.mark.parametrize("color", ["never", "always"])
def test_show_renders_a_hostile_transcript_visibly(
    hostile_run: tuple[Path, str], color: str
) -> None:
    path, _ = hostile_run
    proc = treadle("--color", color, "show", str(path), cwd=path.parent)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout.decode()
    _assert_neutralised(out)
    assert "^[]52;c;cHduZWQ=^G" in out and "^[]0;tool title^G" in out
    if color == "never":
        assert "\x1b" not in out


def test_raw_prints_the_bytes(hostile_run: tuple[Path, str]) -> None:
    path, _ = hostile_run
    proc = treadle("--raw", "--color", "never", "show", str(path), cwd=path.parent)
    assert proc.returncode == 0, proc.stderr
    assert CLIPBOARD.encode() in proc.stdout and b"\x1b[8mhidden" in proc.stdout


def test_show_of_a_malformed_file_names_the_line_not_a_bug(tmp_path: Path) -> None:
    header = {"type": "header", "schema": 1, "session_id": "s", "placement": None}
    trailer = {"type": "trailer", "usage": {"prompt_tokens": "lots"}, "stop_reason": "x"}
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(header) + "\n" + json.dumps(trailer) + "\n")
    proc = treadle("show", str(path), cwd=tmp_path)
    err = proc.stderr.decode()
    assert proc.returncode != 0 and "bug in Treadle" not in err
    assert "line 2" in err and "usage" in err


def test_visible_keeps_printable_text_and_shows_every_control() -> None:
    assert visible("héllo\tworld\n✓") == "héllo\tworld\n✓"
    shown = visible("".join(chr(c) for c in [*range(0x20), 0x7F, *range(0x80, 0xA0)]))
    assert all(ch == "\t" or ch == "\n" or 0x20 <= ord(ch) < 0x7F for ch in shown)
    assert visible("\x1b\x00\x7f\x9d") == "^[^@^?<U+009D>"


AGENT = """
from treadle import Agent, Provider
agent = Agent("echo", "Repeat.", provider=Provider(model="fake-model", base_url={url!r},
              api_key="k", max_retries=0))
"""


def test_eval_and_compare_show_hostile_item_ids_visibly(tmp_path: Path) -> None:
    with FakeOpenAIServer("echo") as server:
        (tmp_path / "hostile_agent.py").write_text(AGENT.format(url=server.base_url))
        with (tmp_path / "qa.jsonl").open("w") as file:
            for i in range(4):
                item = {
                    "id": f"q{i}{TITLE}{CLIPBOARD}",
                    "input": f"w{i} {HOSTILE}",
                    "expected": f"w{i}",
                }
                file.write(json.dumps(item) + "\n")
        runs = [
            treadle("eval", "qa.jsonl", "--agent", "hostile_agent:agent", "--log", "a.jsonl",
                    cwd=tmp_path),
            treadle("eval", "qa.jsonl", "--agent", "hostile_agent:agent", "--log", "b.jsonl",
                    "--scorer", "contains", cwd=tmp_path),
        ]  # fmt: skip
    for proc in runs:
        assert proc.returncode == 0, proc.stderr
    compared = treadle("eval", "compare", "a.jsonl", "b.jsonl", cwd=tmp_path)
    assert compared.returncode == 0, compared.stderr
    out = b"".join(p.stdout for p in [*runs, compared]).decode()
    _assert_neutralised(out)
    assert "\x1b" not in out and "^[]0;pwned title^G" in compared.stdout.decode()


MARKUP_ID = "[link=https://evil.example/steal]ok-session[/link]"
MARKUP_STOP = "[conceal]HIDDEN[/conceal][blink]final_answer[/blink]"
#: What rich would print for that markup: an OSC 8 link, SGR 8 (hidden) and SGR 5 (blink).
MARKUP_EFFECTS = ("\x1b]8;", "\x1b[8m", "\x1b[5m")


@pytest.mark.parametrize("raw", [False, True], ids=["visible", "raw"])
def test_styled_tables_print_markup_in_saved_files_as_plain_text(tmp_path: Path, raw: bool) -> None:
    pytest.importorskip("rich")
    header = {"type": "header", "schema": 1, "session_id": MARKUP_ID, "parent_ids": [],
              "operator": "run_session_loop", "created_at": 0.0, "agent_rows": []}  # fmt: skip
    trailer = {"type": "trailer", "usage": {}, "stop_reason": MARKUP_STOP, "metadata": {}}
    (tmp_path / "a.jsonl").write_text(json.dumps(header) + "\n" + json.dumps(trailer) + "\n")
    args = ["--color", "always", *(["--raw"] if raw else []), "sessions", str(tmp_path)]
    proc = subprocess.run(
        [sys.executable, "-m", "treadle.cli", *args],
        env={**_env(), "COLUMNS": "250", "TERM": "xterm-256color"},
        capture_output=True,
        timeout=120,
    )
    out = proc.stdout.decode()
    assert proc.returncode == 0, proc.stderr
    for effect in MARKUP_EFFECTS:
        assert effect not in out, f"{effect!r} reached the terminal"
    assert MARKUP_ID in out and "[conceal]HIDDEN[/conceal]" in out  # shown as written


def test_console_cells_and_progress_labels_are_never_markup(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    pytest.importorskip("rich")
    monkeypatch.setenv("COLUMNS", "250")  # no folding: the cells are read back whole
    import io

    from treadle.cli.console import make_console

    out = io.StringIO()
    console = make_console("always", out)
    label = "[link=https://evil.example]x[/link]\\"
    console.table([f"id{MARKUP_ID}", "stop"], [[MARKUP_ID, MARKUP_STOP]])
    with console.progress(1, label) as progress:
        progress.describe(label + "[blink]now[/blink]")
        progress.advance()
    text = out.getvalue()
    for effect in MARKUP_EFFECTS:
        assert effect not in text, f"{effect!r} reached the terminal"
    assert MARKUP_STOP in text and "[blink]now[/blink]" in text


def test_visible_shows_invisible_and_reordering_characters() -> None:
    hidden = [0x200B, 0x200C, 0x200D, 0x200E, 0x200F, 0x061C, 0x2028, 0x2029, 0x2060, 0xFEFF,
              0xE0000, 0xE0041, 0xE007F]  # fmt: skip
    for code in hidden:
        assert visible(f"a{chr(code)}b") == f"a<U+{code:04X}>b"
    assert visible("plain ✓ é 日本") == "plain ✓ é 日本"


def test_a_server_error_message_reaches_the_terminal_visibly(tmp_path: Path) -> None:
    """`treadle run`'s failure line quotes the server's error body: shown, never obeyed."""
    with FakeOpenAIServer(replies=[Reply.bad_request(f"bad {TITLE}{CLEAR}")]) as server:
        proc = treadle(
            "run", "go", "--model", "fake-model", "--base-url", server.base_url,
            "--sandbox", "local", cwd=tmp_path,
        )  # fmt: skip
    assert proc.returncode != 0
    err = proc.stderr.decode()
    assert "\x1b" not in err and "\x07" not in err
    assert "^[]0;pwned title^G^[[2J^[[H" in err


def test_eval_failure_cells_show_controls_instead_of_dropping_them() -> None:
    from treadle.cli.eval import _cell

    shown = _cell(f"ans{TITLE}\r\x1c{BIDI}", styled=False)
    assert shown == "ans^[]0;pwned title^G^M^\\<U+202E>evil"
    assert _cell("two\n\tlines  here", styled=False) == "two lines here"
