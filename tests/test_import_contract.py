"""The import contract of docs/architecture.md ("Layers", "Public API"), read from the code (AST, nothing imported).

The modules checked are this repository's: datastates/, megatron/training/, tools/ and benchmarks/. Three rules:

1. No import cycle. Only module-level imports count, those that run when the module is imported: at its top level,
   also under `if`/`try`/`with` and in class bodies. An import inside a function runs later, and one under
   `if TYPE_CHECKING:` never runs, so neither makes a cycle. A package's `__init__` imported on the way to one of
   its submodules is not an edge either (every submodule would then be in a cycle with its package).
2. The engine's users (the trainer, the tools, the benchmarks) use its public surface only: names in
   `datastates.__all__`, the public modules `datastates.megatron`, `datastates.names` and `datastates.logs`
   (names in their `__all__` where they have one), and the Hugging Face library `datastates.hf` (its modules'
   names that do not start with `_`). Every import in the file counts, wherever it is (the whole
   AST). A benchmark that deliberately measures an internal is named in `MEASURES_INTERNALS` with the reason.
3. The engine (datastates/) imports none of its users (the trainer, the tools, the benchmarks); every import counts.
"""
from __future__ import annotations

import ast
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CHECKED = ("datastates", os.path.join("megatron", "training"), "tools", "benchmarks")
USERS = ("megatron.training", "tools", "benchmarks")  # the engine's users: rule 2
ENGINE = "datastates"
PUBLIC_MODULES = {"datastates", "datastates.megatron", "datastates.names", "datastates.logs"}
PUBLIC_PACKAGE = "datastates.hf"  # the trainer's --save-hf and the tools' --to hf / --from hf share it
NATIVE = {"datastates._native"}  # built from csrc/, not a .py file: imports nothing of the repository
# (benchmark, engine module) -> why: the benchmarks that deliberately measure an internal (rule 2's exceptions)
MEASURES_INTERNALS = {
    ("benchmarks.scale", "datastates._native"): "its simulated ranks checksum their rows with the engine's crc32c",
    ("benchmarks.scale", "datastates.coordination"): "its simulated ranks report through the engine's Coordinator",
    ("benchmarks.scale", "datastates.format"): "its simulated ranks sign manifests with the engine's format code",
    ("benchmarks.scale", "datastates.schema"): "its simulated ranks build their manifests from the engine's records",
    ("benchmarks.compression", "datastates.codecs"): "it measures the codecs themselves: levels, byte grouping",
    ("benchmarks.snapshot_profile", "datastates.copies"): "it times the engine's copy backend apart from the engine",
    ("benchmarks.snapshot_profile", "datastates.slots"): "it times the staging slots' pinning and filling apart",
    ("benchmarks.memory_tier", "datastates.storage"): "it measures SharedMemoryStorage's mapped pages, not staging",
    ("benchmarks.memory_tier", "datastates._native"): "it times the crc32c a memory save computes over its pages",
    ("benchmarks.compression", "datastates.storage"): "it saves to the memory tier's storage as LocalTier makes it",
    ("benchmarks.read_once", "datastates.format"): "its unique bytes leave out the skeleton item (its id)",
}



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


def _imports(body: list[ast.stmt]):
    """The Import/ImportFrom statements a module's import runs, in `body` (rule 1)."""
    for node in body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        elif isinstance(node, ast.If) and _is_type_checking(node.test):
            yield from _imports(node.orelse)
        else:
            for field in ("body", "orelse", "finalbody", "handlers", "cases"):
                children = getattr(node, field, None)
                if isinstance(children, list) and children and isinstance(children[0], ast.AST):
                    yield from _imports(children)


def _every_import(module: str):
    """Every Import/ImportFrom statement of `module`, wherever it is (rules 2 and 3)."""
    return [node for node in ast.walk(_tree(module)) if isinstance(node, (ast.Import, ast.ImportFrom))]


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
    return {m: {target for node in _imports(_tree(m).body) for target, _ in _targets(m, node)
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
    """`module: import` for each import of `modules` that `allowed(module, target, name)` refuses."""
    return [f"{m} (line {node.lineno}): {target}{'' if name is None else ' import ' + name}"
            for m in modules for node in _every_import(m)
            for target, name in _targets(m, node) if not allowed(m, target, name)]


def _is_engine(target: str) -> bool:
    return target == ENGINE or target.startswith(ENGINE + ".")


def _users() -> list[str]:
    return sorted(m for m in MODULES if any(m == u or m.startswith(u + ".") for u in USERS))


def test_the_engine_s_users_import_only_its_public_surface():
    public_names = {m: _all_of(m) for m in PUBLIC_MODULES}

    def allowed(module, target, name):
        if not _is_engine(target) or (module.startswith("benchmarks.") and (module, target) in MEASURES_INTERNALS):
            return True
        if target == PUBLIC_PACKAGE or target.startswith(PUBLIC_PACKAGE + "."):
            return name is None or not name.startswith("_")
        return target in PUBLIC_MODULES and (name is None or public_names[target] is None
                                             or name in public_names[target])
    bad = _crossings(_users(), allowed)
    assert not bad, "the trainer, tools or benchmarks importing what the engine does not make public:\n" + \
        "\n".join(bad)


def test_every_internal_a_benchmark_measures_is_still_imported():
    """An entry of MEASURES_INTERNALS that no import needs any more would let a new one in unseen."""
    used = {(m, target) for m in _users() for node in _every_import(m) for target, _ in _targets(m, node)}
    stale = sorted(set(MEASURES_INTERNALS) - used)
    assert not stale, f"MEASURES_INTERNALS entries that no import uses (remove them): {stale}"


def test_the_engine_imports_none_of_its_users():
    def allowed(module, target, name):
        return not any(target == up or target.startswith(up + ".") for up in USERS)
    engine = sorted(m for m in MODULES if _is_engine(m))
    bad = _crossings(engine, allowed)
    assert not bad, "the engine importing the layers above it:\n" + "\n".join(bad)
