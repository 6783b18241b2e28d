"""The package's shape, checked: layers (import-linter), no import cycle, module and function sizes.

docs/design.md ("Package layout") explains the layers; pyproject.toml's [tool.importlinter] states
them. These checks read the code only (nothing runs), so they are quick.
"""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
from pathlib import Path

import grimp
import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "checkpointing"
MAX_MODULE_LINES = 400
MAX_FUNCTION_LINES = 60
ONE_PIECE = "# one piece:"  # a longer function says, in a comment inside it, why it is one piece


def test_import_contracts_hold():
    exe = shutil.which("lint-imports", path=str(Path(sys.executable).parent)) or shutil.which("lint-imports")
    assert exe, "import-linter is not installed: pip install -e '.[dev]'"
    done = subprocess.run([exe, "--no-cache"], cwd=PACKAGE.parent, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert "broken" in done.stdout and " 0 broken" in done.stdout


def _cycles(graph: grimp.ImportGraph) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    adj = {m: sorted(graph.find_modules_directly_imported_by(m)) for m in graph.modules}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0
    for root in sorted(adj):
        if root in index:
            continue
        work = [(root, iter(adj[root]))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in adj:
                    continue
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(adj[child])))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_no_import_cycle_anywhere():
    """Type-only imports included (grimp reads `if TYPE_CHECKING:` imports too)."""
    graph = grimp.build_graph("checkpointing", cache_dir=None)
    assert _cycles(graph) == []


def test_cycle_finder_finds_a_cycle():
    graph = grimp.ImportGraph()
    for name in ("p", "p.a", "p.b", "p.c"):
        graph.add_module(name)
    graph.add_import(importer="p.a", imported="p.b")
    graph.add_import(importer="p.b", imported="p.c")
    graph.add_import(importer="p.c", imported="p.a")
    assert _cycles(graph) == [["p.a", "p.b", "p.c"]]


def _modules() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


@pytest.mark.parametrize("path", _modules(), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_module_size_and_docstring(path: Path):
    source = path.read_text()
    lines = source.count("\n")
    assert lines <= MAX_MODULE_LINES, f"{path.relative_to(PACKAGE)} has {lines} lines (at most {MAX_MODULE_LINES}): split it by job"
    if path.name != "__main__.py":
        assert ast.get_docstring(ast.parse(source)), f"{path.relative_to(PACKAGE)} does not open with a docstring saying its job"


def test_long_functions_say_why_they_are_one_piece():
    long = []
    for path in _modules():
        source = path.read_text()
        lines = source.split("\n")
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                size = node.end_lineno - node.lineno + 1
                body = "\n".join(lines[node.lineno - 1:node.end_lineno])
                if size > MAX_FUNCTION_LINES and ONE_PIECE not in body:
                    long.append(f"{path.relative_to(PACKAGE)}:{node.lineno} {node.name} ({size} lines)")
    assert long == [], f"functions over {MAX_FUNCTION_LINES} lines without a {ONE_PIECE!r} comment: {long}"
