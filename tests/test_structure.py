"""The package's shape: no import circles between graphstep's modules, no module past ~500 lines, no class
past ~250."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import graphstep

PACKAGE = Path(graphstep.__file__).parent


def imports_of(path: Path) -> set[str]:
    """graphstep modules that `path` imports, at any depth of its code (lazy imports count too, and
    so do imports for type checkers only: a circle of them is a circle of the design)."""
    module = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    package = module.rsplit(".", 1)[0] if path.name != "__init__.py" else module
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                target = f"{base}.{node.module}" if node.module else base
            else:
                target = node.module or ""
            names = [f"{target}.{a.name}" for a in node.names] + [target]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            continue
        found.update(n for n in names if n.startswith("graphstep") and module_path(n) is not None)
    found.discard(module)
    return found


def module_path(name: str) -> Path | None:
    parts = name.split(".")[1:]
    candidate = PACKAGE.joinpath(*parts)
    if candidate.with_suffix(".py").exists():
        return candidate.with_suffix(".py")
    if (candidate / "__init__.py").exists():
        return candidate / "__init__.py"
    return None


def graph() -> dict[str, set[str]]:
    modules = {}
    for path in PACKAGE.rglob("*.py"):
        name = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts).removesuffix(".__init__")
        modules[name] = {m.removesuffix(".__init__") for m in imports_of(path)}
    return modules


def test_no_import_circles_between_modules():
    edges = graph()
    # The package's __init__ re-exports the public surface: every module may be reached from it,
    # and a module importing `graphstep` itself (the demo) is at the top as well.
    edges = {m: {t for t in ts if t != "graphstep"} for m, ts in edges.items() if m != "graphstep"}
    state: dict[str, str] = {}

    def visit(node: str, trail: list[str]) -> None:
        state[node] = "open"
        for target in sorted(edges.get(node, ())):
            assert state.get(target) != "open", "import circle: " + " -> ".join([*trail, node, target])
            if target not in state:
                visit(target, [*trail, node])
        state[node] = "done"

    for node in sorted(edges):
        if node not in state:
            visit(node, [])


# The layers, top to bottom: a module (or any module of a subpackage) imports only layers below it.
# On top, what runs graphstep rather than what it is made of: the command line, the benchmark harness
# (which times the demo's step) and the demo with its built-in GPT; no layer below imports them.
LAYERS = [
    "cli",
    "bench",
    "demo",
    "explain",
    "capture",
    "teardown",
    "lifecycle",
    "capturing",
    "verify",
    "step_context",
    "effects",
    "distributed",
    "backends",
    "guards",
    "optim",
    "profiling",
    "diagnostics",
    "state",
    "signature",
    "config",
    "errors",
]


def layer_of(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in LAYERS else None


def test_the_layers_import_one_way():
    upward = []
    for module, targets in graph().items():
        here = layer_of(module)
        if here is None:
            continue
        for target in targets:
            there = layer_of(target)
            if there is not None and LAYERS.index(there) < LAYERS.index(here):
                upward.append(f"{module} imports {target}")
    assert not upward, "imports that climb back up: " + "; ".join(sorted(upward))


def test_at_most_16_modules_at_the_top_and_each_subpackage_says_what_it_offers():
    top = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(top) <= 16, f"{len(top)} modules at the top: {top}"
    for init in PACKAGE.glob("*/__init__.py"):
        if init.parent.name in LAYERS:
            assert ast.get_docstring(ast.parse(init.read_text())), f"{init} has no docstring"


def test_no_module_is_past_500_lines():
    long = {p.name: n for p in PACKAGE.rglob("*.py") if (n := len(p.read_text().splitlines())) > 500}
    assert not long, f"modules past 500 lines: {long}"


def test_no_class_is_past_250_lines():
    long = {
        f"{p.name}:{node.name}": size
        for p in PACKAGE.rglob("*.py")
        for node in ast.walk(ast.parse(p.read_text()))
        if isinstance(node, ast.ClassDef) and (size := node.end_lineno - node.lineno + 1) > 250
    }
    assert not long, f"classes past 250 lines: {long}"


def test_benchmark_results_hold_results_not_logs():
    results = PACKAGE.parent.parent / "benchmarks" / "results"
    if not results.is_dir():
        pytest.skip("graphstep is installed without its repository")
    kept = {".json", ".jsonl", ".md", ".png"}
    others = sorted(p.name for p in results.iterdir() if p.suffix not in kept)
    assert not others, f"benchmarks/results holds files that are not results: {others}"
