"""A user's code type-checks: `mypy --strict` over examples/ and every docs ```python block.

The package says "Typing :: Typed", so the code we tell people to copy must pass a user's strict
type check against the installed package, not only our own `src/` run. Each docs block is its own
module (as tests/test_docs_examples.py runs each block alone) and each example is one, all checked
in a temporary directory outside the repository, so mypy sees `treadle` as a user does: through
the installed package and its `py.typed`, with no project config.
"""

from __future__ import annotations

import re
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FENCE = re.compile(r"^```python\n(.*?)^```", re.DOTALL | re.MULTILINE)
# conftest.py's `user_mypy` fixture: mypy as a user runs it, with a shared cache.
UserMypy = Callable[..., subprocess.CompletedProcess[str]]
PAGES = sorted([ROOT / "README.md", *(ROOT / "docs").rglob("*.md")])
EXAMPLES = sorted((ROOT / "examples").glob("*.py"))

# The user's strict configuration (tests/user_mypy.py) makes no exception for `treadle`, so these
# tests also guard that every top-level name the docs use is an explicit re-export.


def _modules(target: Path) -> list[str]:
    names = []
    for page in PAGES:
        for number, block in enumerate(FENCE.findall(page.read_text()), 1):
            name = f"doc_{page.stem.replace('-', '_').lower()}_{number}.py"
            (target / name).write_text(block)
            names.append(name)
    for example in EXAMPLES:
        name = f"example_{example.name}"
        (target / name).write_text(example.read_text())
        names.append(name)
    return names


def test_docs_blocks_and_examples_pass_mypy_strict_as_user_code(
    tmp_path: Path, user_mypy: UserMypy
) -> None:
    pytest.importorskip("mypy")
    names = _modules(tmp_path)
    assert len(names) > 40, names  # the docs and examples are really there
    proc = user_mypy(tmp_path, *names)
    assert proc.returncode == 0, (
        "user code does not type-check (file names: doc_<page>_<block number>.py, "
        f"example_<file>.py):\n{proc.stdout}\n{proc.stderr}"
    )


def test_map_keeps_the_session_type(tmp_path: Path, user_mypy: UserMypy) -> None:
    # `treadle.map` used to return `list[Any]`: a typo on a result went unnoticed by mypy.
    (tmp_path / "user_map.py").write_text(
        "import treadle\n"
        "from treadle import Agent, Provider\n\n"
        'agent = Agent("a", "Answer.", provider=Provider(model="m"))\n'
        'outs = treadle.map(agent, ["x"])\n'
        "reveal_type(outs)\n"
        'mixed = treadle.map(agent, ["x"], return_exceptions=True)\n'
        "reveal_type(mixed)\n"
    )
    proc = user_mypy(tmp_path, "user_map.py")
    # An agent without an output_type: sessions whose `output` is None or untyped.
    assert 'Revealed type is "list[treadle.session.session.Session[Any | None]]"' in proc.stdout, (
        proc.stdout
    )
    assert "list[treadle.session.session.Session[Any | None] | BaseException]" in proc.stdout


# Deliberately wrong user programs, each line that mypy must reject marked `# E: <text>` (a part
# of the message it must report). Before typed results, `mypy --strict` passed on most of these.
WRONG_PROGRAMS = {
    "wrong_output_field.py": """\
import pydantic
from treadle import Agent, Provider

class City(pydantic.BaseModel):
    name: str
    population: int

agent = Agent("geo", "Answer.", provider=Provider(model="m"), output_type=City)
out = agent("capital of France?")
if out.output is not None:
    print(out.output.populaton)  # E: "City" has no attribute "populaton"
    print(out.output.name.upper())
label: str = out.output  # E: Incompatible types in assignment
""",
    "wrong_tool_arguments.py": """\
from treadle import tool

@tool
def add(a: int, b: int) -> int:
    \"\"\"Add two numbers.\"\"\"
    return a + b

@tool(timeout=5)
async def shout(text: str) -> str:
    \"\"\"Shout.\"\"\"
    return text.upper()

total: int = add(1, 2)
add("1", 2)  # E: Argument 1 to "__call__" of "FunctionTool" has incompatible type "str"
add(a=1, c=2)  # E: Unexpected keyword argument "c"

async def main() -> None:
    size: int = await shout("hi")  # E: Incompatible types in assignment
""",
    "misspelled_stop_reason.py": """\
from treadle import Agent, Provider, StopReason

agent = Agent("a", "Answer.", provider=Provider(model="m"))
out = agent("hi")
if out.stop_reason == "finall_answer":  # E: Non-overlapping equality check
    pass
reason: StopReason = "max_step"  # E: Incompatible types in assignment
done: bool = out.stop_reason == "final_answer"
Agent("b", provider=Provider(model="m"), tool_use_behavior="stop_first")  # E: "tool_use_behavior"
""",
    "wrong_deps.py": """\
from dataclasses import dataclass
from treadle import Agent, Provider, ToolContext, tool

@dataclass
class Deps:
    token: str

@tool
def whoami(ctx: ToolContext[Deps]) -> str:
    \"\"\"Who am I.\"\"\"
    return ctx.deps.tokn  # E: "Deps" has no attribute "tokn"

agent = Agent("a", "Answer.", provider=Provider(model="m"), tools=[whoami], deps_type=Deps)
agent("hi", deps=Deps("t"))
agent("hi", deps="t")  # E: Argument "deps" to "__call__" of "Agent" has incompatible type "str"
""",
    "map_results.py": """\
import pydantic
import treadle
from treadle import Agent, Provider

class Verdict(pydantic.BaseModel):
    ok: bool

agent = Agent("judge", "Judge.", provider=Provider(model="m"), output_type=Verdict)
outs = treadle.map(agent, ["a", "b"])
passed = [o for o in outs if o.output is not None and o.output.ok]
wrong = [o.output.okay for o in outs if o.output is not None]  # E: has no attribute "okay"
""",
    # A correct program (no `# E:` line): policies typed as users write them must pass.
    "tool_policies.py": """\
from dataclasses import dataclass
from treadle import Agent, Provider, ToolContext, tool

@dataclass
class Deps:
    token: str

def explain(error: Exception) -> str:
    return f"failed: {error}"

def enabled(ctx: ToolContext[Deps]) -> bool:
    return ctx.deps.token != ""

def instructions(ctx: ToolContext[Deps]) -> str:
    return f"Use token {ctx.deps.token}."

@tool(on_error=explain)
def a(q: str) -> str:
    \"\"\"a\"\"\"
    return q

@tool(is_enabled=enabled, strict=True, timeout=5, on_timeout="raise")
def b(q: str) -> str:
    \"\"\"b\"\"\"
    return q

agent = Agent("a", instructions, provider=Provider(model="m"), tools=[a, b], deps_type=Deps)
""",
}

_MARK = re.compile(r"# E: (.+)$")


def test_mypy_strict_rejects_wrong_user_programs(tmp_path: Path, user_mypy: UserMypy) -> None:
    pytest.importorskip("mypy")
    expected: dict[tuple[str, int], str] = {}
    for name, text in WRONG_PROGRAMS.items():
        (tmp_path / name).write_text(text)
        for number, line in enumerate(text.splitlines(), 1):
            mark = _MARK.search(line)
            if mark:
                expected[(name, number)] = mark.group(1)
    proc = user_mypy(tmp_path, *WRONG_PROGRAMS)
    errors: dict[tuple[str, int], list[str]] = {}
    for line in proc.stdout.splitlines():
        found = re.match(r"^(\S+\.py):(\d+): error: (.*)$", line)
        if found:
            key = (found.group(1), int(found.group(2)))
            errors.setdefault(key, []).append(found.group(3))
    missing = {
        key: want
        for key, want in expected.items()
        if not any(want in message for message in errors.get(key, []))
    }
    unexpected = {key: messages for key, messages in errors.items() if key not in expected}
    assert not missing, f"mypy did not report these:\n{missing}\n{proc.stdout}"
    assert not unexpected, f"mypy reported errors on correct lines:\n{unexpected}"
    assert len(expected) == 11
