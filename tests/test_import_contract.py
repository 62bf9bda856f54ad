"""The import contract of docs/architecture.md ("Layers", "Public API"), read from the code (AST, nothing imported).

The modules checked are this repository's: datastates/, megatron/training/ and tools/. Three rules:

1. No import cycle. Only module-level imports count, those that run when the module is imported: at its top level,
   also under `if`/`try`/`with` and in class bodies. An import inside a function runs later, and one under
   `if TYPE_CHECKING:` never runs, so neither makes a cycle. A package's `__init__` imported on the way to one of
   its submodules is not an edge either (every submodule would then be in a cycle with its package).
2. Tools use the engine's public surface only: names in `datastates.__all__`, and the public modules
   `datastates.megatron`, `datastates.names` and `datastates.logs` (names in their `__all__` where they have one).
   Every import counts here, in a function or not.
3. The engine (datastates/) imports neither the trainer (megatron.training) nor the tools; every import counts.
"""
from __future__ import annotations

import ast
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CHECKED = ("datastates", os.path.join("megatron", "training"), "tools")
ENGINE = "datastates"
PUBLIC_MODULES = {"datastates", "datastates.megatron", "datastates.names", "datastates.logs"}
NATIVE = {"datastates._native"}  # built from csrc/, not a .py file: imports nothing of the repository



def _modules() -> dict[str, str]:
    """Dotted module name -> file, for every module checked."""
    found = {}
    for top in CHECKED:
        for directory, _, files in os.walk(os.path.join(ROOT, top)):
            for f in files:
                if f.endswith(".py"):
                    rel = os.path.relpath(os.path.join(directory, f), ROOT)[:-3].split(os.sep)
                    found[".".join(rel[:-1] if rel[-1] == "__init__" else rel)] = os.path.join(directory, f)
    return found


MODULES = _modules()


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(body: list[ast.stmt], module_level: bool):
    """The Import/ImportFrom statements of `body`; with `module_level`, those a module's import runs."""
    for node in body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            if not module_level:
                yield from _imports(node.body, module_level)
        elif isinstance(node, ast.If) and _is_type_checking(node.test):
            if not module_level:
                yield from _imports(node.body, module_level)
            yield from _imports(node.orelse, module_level)
        else:
            for field in ("body", "orelse", "finalbody", "handlers", "cases"):
                children = getattr(node, field, None)
                if isinstance(children, list) and children and isinstance(children[0], ast.AST):
                    yield from _imports(children, module_level)


def _targets(module: str, node: ast.stmt) -> list[tuple[str, str | None]]:
    """(module imported, name imported from it or None) of one import statement in `module`."""
    if isinstance(node, ast.Import):
        return [(alias.name, None) for alias in node.names]
    base = node.module or ""
    if node.level:
        package = module if os.path.basename(MODULES[module]) == "__init__.py" else module.rpartition(".")[0]
        parts = package.split(".")
        parts = parts[:len(parts) - node.level + 1]
        base = ".".join(parts + ([node.module] if node.module else []))
    return [(f"{base}.{alias.name}", None) if f"{base}.{alias.name}" in MODULES.keys() | NATIVE else (base, alias.name)
            for alias in node.names]


def _tree(module: str) -> ast.Module:
    with open(MODULES[module]) as f:
        return ast.parse(f.read(), MODULES[module])


def _all_of(module: str) -> set[str] | None:
    for node in _tree(module).body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets):
            return set(ast.literal_eval(node.value))
    return None


def _graph() -> dict[str, set[str]]:
    """Module -> the repository's modules its module-level imports import."""
    return {m: {target for node in _imports(_tree(m).body, True) for target, _ in _targets(m, node)
                if target in MODULES and target != m} for m in MODULES}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The modules of each strongly connected component of more than one module, sorted (Tarjan's algorithm)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def _shortest_cycle(graph: dict[str, set[str]], component: list[str]) -> str:
    """The shortest cycle through the first module of a strongly connected component, as `a -> b -> a`."""
    start, inside = component[0], set(component)
    paths, seen = [[start]], {start}
    while paths:
        path = paths.pop(0)
        for nxt in sorted(graph[path[-1]] & inside):
            if nxt == start:
                return " -> ".join(path + [start])
            if nxt not in seen:
                seen.add(nxt)
                paths.append(path + [nxt])
    raise AssertionError(f"{component} is not a cycle")


def test_no_import_cycle():
    graph = _graph()
    cycles = _cycles(graph)
    assert not cycles, "import cycles (module-level imports), one per set of modules in a cycle:\n" + "\n".join(
        f"{_shortest_cycle(graph, c)}   (modules in this cycle: {', '.join(c)})" for c in cycles)


def _crossings(modules, allowed) -> list[str]:
    """`module: import` for each import of `modules` that `allowed(target, name)` refuses."""
    return [f"{m} (line {node.lineno}): {target}{'' if name is None else ' import ' + name}"
            for m in modules for node in _imports(_tree(m).body, False)
            for target, name in _targets(m, node) if not allowed(m, target, name)]


def test_tools_import_only_the_engine_s_public_surface():
    public_names = {m: _all_of(m) for m in PUBLIC_MODULES}

    def allowed(module, target, name):
        if target != ENGINE and not target.startswith(ENGINE + "."):
            return True
        return target in PUBLIC_MODULES and (name is None or public_names[target] is None
                                             or name in public_names[target])
    tools = sorted(m for m in MODULES if m.startswith("tools."))
    bad = _crossings(tools, allowed)
    assert not bad, "tools importing what the engine does not make public:\n" + "\n".join(bad)


def test_the_engine_imports_neither_the_trainer_nor_the_tools():
    def allowed(module, target, name):
        return not any(target == up or target.startswith(up + ".") for up in ("megatron.training", "tools"))
    engine = sorted(m for m in MODULES if m == ENGINE or m.startswith(ENGINE + "."))
    bad = _crossings(engine, allowed)
    assert not bad, "the engine importing the layers above it:\n" + "\n".join(bad)
