"""The layer order, checked from the source: packages import only downward, no module import
cycle, no module over 500 lines (DESIGN.md section 3).

Every module under src/treadle is parsed with `ast` (nothing is imported). Imports inside
functions count; imports under `if TYPE_CHECKING:` do not (they never run).
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parent.parent / "src" / "treadle"

#: The packages (and top-level modules) of Treadle, lowest first: each may import only from its
#: own package and the ones before it.
LAYERS = [
    "_frozen",  # a dataclass helper: imports nothing of Treadle's
    "errors",
    "session",
    "runtime",
    "_http",  # private HTTP/1.1 pool: knows nothing of LLMs
    "telemetry",  # extra: below llm, after runtime
    "llm",
    "tools",
    "sandbox",
    "mcp",  # extra: beside sandbox (after it, before persist)
    "persist",
    "stores",  # conversation stores: beside persist
    "loop",
    "agents",
    "distributed",
    "evals",  # extra: after distributed
    "testing",
    "cli",
]
RANK = {name: rank for rank, name in enumerate(LAYERS)}
#: The top-level `treadle` face (lazy names from every layer) may be imported from these only.
FACE_USERS = {name for name in LAYERS if RANK[name] > RANK["distributed"]}
MAX_LINES = 500

#: Known upward imports: (importer module, imported module). Keep it empty: a new entry needs a
#: reason next to it (the session layer reaches sandbox and persist through `session.ports`).
ALLOWED_UPWARD: set[tuple[str, str]] = set()


def _modules() -> dict[str, Path]:
    """Dotted module name -> file, for every module of the package."""
    found = {}
    for path in sorted(SRC.rglob("*.py")):
        parts = list(path.relative_to(SRC.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


MODULES = _modules()


def _is_type_checking(node: ast.If) -> bool:
    return ast.unparse(node.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING")


def _imports(module: str, path: Path) -> list[tuple[str, bool]]:
    """`(imported treadle module, at module level?)` for every import that can run."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: list[tuple[str, bool]] = []

    def targets(node: ast.Import | ast.ImportFrom) -> list[str]:
        if isinstance(node, ast.Import):
            return [alias.name for alias in node.names]
        base = node.module or ""
        if node.level:
            anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
            base = ".".join([*anchor, base] if base else anchor)
        # `from pkg import sub` imports the submodule when there is one, else a name of `pkg`.
        return [
            f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base
            for alias in node.names
        ]

    def visit(node: ast.AST, top: bool) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node):
            for child in node.orelse:
                visit(child, top)
            return
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found.extend((t, top) for t in targets(node) if t.split(".")[0] == "treadle")
            return
        inner = top and not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
        for child in ast.iter_child_nodes(node):
            visit(child, inner)

    visit(tree, True)
    return found


IMPORTS = {module: _imports(module, path) for module, path in MODULES.items()}


def _layer(module: str) -> str | None:
    """The layer of `treadle.x...` (None for the top-level face `treadle`)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else None


def test_every_package_has_a_place_in_the_order() -> None:
    layers = {_layer(module) for module in MODULES} - {None}
    assert layers <= set(RANK), f"add {sorted(layers - set(RANK))} to LAYERS with its place"


def test_packages_import_only_downward() -> None:
    violations = []
    for module, imports in IMPORTS.items():
        source = _layer(module)
        if source is None:
            continue  # the face itself imports only under TYPE_CHECKING and lazily by name
        for target, _ in imports:
            layer = _layer(target)
            allowed = source in FACE_USERS if layer is None else RANK[layer] <= RANK[source]
            if not allowed and (module, target) not in ALLOWED_UPWARD:
                violations.append(f"{module} imports {target}")
    assert not violations, "imports against the layer order:\n" + "\n".join(sorted(violations))


def test_the_allow_list_holds_only_live_violations() -> None:
    live = {(module, target) for module, imports in IMPORTS.items() for target, _ in imports}
    assert live >= ALLOWED_UPWARD, f"no longer needed: {sorted(ALLOWED_UPWARD - live)}"


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module, or a module importing itself."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def connect(node: str) -> None:  # Tarjan's algorithm
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph[node]):
            if nxt not in index:
                connect(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1 or node in graph[node]:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            connect(node)
    return found


def test_cycle_finder_finds_cycles() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": {"e"}}
    assert sorted(_cycles(graph)) == [["a", "b", "c"], ["e"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_no_module_level_import_cycle() -> None:
    graph = {
        module: {target for target, top in imports if top and target != module}
        for module, imports in IMPORTS.items()
    }
    for targets in graph.values():
        targets.intersection_update(MODULES)
    assert _cycles(graph) == []


def test_no_module_over_500_lines() -> None:
    long = {
        module: n
        for module, path in MODULES.items()
        if (n := len(path.read_text().splitlines())) > MAX_LINES
    }
    assert long == {}, f"split these modules (over {MAX_LINES} lines): {long}"
