"""The import contract of docs/architecture.md ("Layers", "Public API"), read from the code (AST, nothing imported).

The modules checked are this repository's Python files, on three floors, bottom to top: the engine (datastates/,
its model-format adapters included), the trainer (megatron/training/), and the entry points (pretrain_gpt.py,
tools/, benchmarks/, scripts/, examples/). Every import counts, wherever it is (inside functions too), except one
under `if TYPE_CHECKING:`, which never runs. Four rules:

1. No import cycle. A package's `__init__` imported on the way to one of its submodules is not an edge (every
   submodule would then be in a cycle with its package).
2. Imports point down: a module imports its own floor or those below it, never a floor above.
3. The engine's users (the trainer and the entry points) use its public surface only: names in
   `datastates.__all__`, the public modules (`datastates.paths`, `datastates.megatron`, `datastates.names`,
   `datastates.logs`, `datastates.dtensors`, `datastates.weights`; names in their `__all__` where they have one) and the Hugging Face library `datastates.hf`
   (its modules' names that do not start with `_`). A benchmark that deliberately measures an internal is named in `MEASURES_INTERNALS`
   with the reason.
4. No user reaches into an engine object's private attributes (`x._name` for a `_name` the engine defines).

Each rule is shown to fail on a breach of its kind, in a small tree written for the purpose.
"""
from __future__ import annotations

import ast
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# the floors, bottom to top: (name, top-level directories or files)
FLOORS = (("engine", ("datastates",)),
          ("trainer", (os.path.join("megatron", "training"),)),
          ("entry points", ("pretrain_gpt.py", "tools", "benchmarks", "scripts", "examples")))
ENGINE = "datastates"
PUBLIC_MODULES = {"datastates", "datastates.paths", "datastates.megatron", "datastates.names", "datastates.logs",
                  "datastates.dtensors", "datastates.weights"}
PUBLIC_PACKAGE = "datastates.hf"  # the trainer's --save-hf and the tools' --to hf / --from hf share it
NATIVE = {"datastates._native"}  # built from csrc/, not a .py file: imports nothing of the repository
# (benchmark, engine module) -> why: the benchmarks that deliberately measure an internal (rule 3's exceptions)
MEASURES_INTERNALS = {
    ("benchmarks.scale", "datastates._native"): "its simulated ranks checksum their rows with the engine's crc32c",
    ("benchmarks.scale", "datastates.coordination"): "its simulated ranks report through the engine's Coordinator",
    ("benchmarks.scale", "datastates.format"): "its simulated ranks sign manifests with the engine's format code",
    ("benchmarks.scale", "datastates.schema"): "its simulated ranks build their manifests from the engine's records",
    ("benchmarks.scale", "datastates.storage.posix"): "its simulated ranks write their files as the engine's do",
    ("benchmarks.compression", "datastates.codecs"): "it measures the codecs themselves: levels, byte grouping",
    ("benchmarks.snapshot_profile", "datastates.copies"): "it times the engine's copy backend apart from the engine",
    ("benchmarks.snapshot_profile", "datastates.slots"): "it times the staging slots' pinning and filling apart",
    ("benchmarks.memory_tier", "datastates.storage"): "it measures SharedMemoryStorage's mapped pages, not staging",
    ("benchmarks.memory_tier", "datastates._native"): "it times the crc32c a memory save computes over its pages",
    ("benchmarks.compression", "datastates.storage"): "it saves to the memory tier's storage as LocalTier makes it",
    ("benchmarks.read_once", "datastates.format"): "its unique bytes leave out the skeleton item (its id)",
    ("benchmarks.fence", "datastates._native"): "it times the copy pool's copies apart from its checksums",
}


class Tree:
    """The Python modules under `root` on the floors `floors`: their names, files, floors and imports."""

    def __init__(self, root: str, floors=FLOORS):
        self.files: dict[str, str] = {}  # dotted module name -> file
        self.floor: dict[str, int] = {}
        for level, (_, tops) in enumerate(floors):
            for top in tops:
                for path in self._python_files(os.path.join(root, top)):
                    rel = os.path.relpath(path, root)[:-3].split(os.sep)
                    name = ".".join(rel[:-1] if rel[-1] == "__init__" else rel)
                    self.files[name], self.floor[name] = path, level
        self._trees: dict[str, ast.Module] = {}

    @staticmethod
    def _python_files(top: str):
        if top.endswith(".py"):
            yield from [top] if os.path.exists(top) else []
            return
        for directory, _, files in os.walk(top):
            yield from (os.path.join(directory, f) for f in sorted(files) if f.endswith(".py"))

    def tree(self, module: str) -> ast.Module:
        if module not in self._trees:
            with open(self.files[module]) as f:
                self._trees[module] = ast.parse(f.read(), self.files[module])
        return self._trees[module]

    def imports(self, module: str) -> list[ast.stmt]:
        """Every Import/ImportFrom statement of `module` that can run (not under `if TYPE_CHECKING:`)."""
        never = {id(n) for node in ast.walk(self.tree(module)) if isinstance(node, ast.If) and _is_type_checking(node.test)
                 for child in node.body for n in ast.walk(child)}
        return [node for node in ast.walk(self.tree(module))
                if isinstance(node, (ast.Import, ast.ImportFrom)) and id(node) not in never]

    def targets(self, module: str, node: ast.stmt) -> list[tuple[str, str | None]]:
        """(module imported, name imported from it or None) of one import statement in `module`."""
        if isinstance(node, ast.Import):
            return [(alias.name, None) for alias in node.names]
        base = node.module or ""
        if node.level:
            package = module if os.path.basename(self.files[module]) == "__init__.py" else module.rpartition(".")[0]
            parts = package.split(".")
            parts = parts[:len(parts) - node.level + 1]
            base = ".".join(parts + ([node.module] if node.module else []))
        return [(f"{base}.{alias.name}", None) if f"{base}.{alias.name}" in self.files.keys() | NATIVE
                else (base, alias.name) for alias in node.names]

    def graph(self) -> dict[str, set[str]]:
        """Module -> the repository's modules it imports."""
        return {m: {target for node in self.imports(m) for target, _ in self.targets(m, node)
                    if target in self.files and target != m} for m in self.files}

    def crossings(self, modules, allowed) -> list[str]:
        """`module (line n): import` for each import of `modules` that `allowed(module, target, name)` refuses."""
        return [f"{m} (line {node.lineno}): {target}{'' if name is None else ' import ' + name}"
                for m in modules for node in self.imports(m)
                for target, name in self.targets(m, node) if not allowed(m, target, name)]

    def floor_of(self, target: str) -> int | None:
        """The floor of an imported module (a package's, for a name it holds); None outside the repository."""
        while target and target not in self.floor:
            target = target.rpartition(".")[0]
        return self.floor.get(target)

    def users(self) -> list[str]:
        return sorted(m for m in self.files if not _is_engine(m))

    def all_of(self, module: str) -> set[str] | None:
        for node in self.tree(module).body:
            if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets):
                return set(ast.literal_eval(node.value))
        return None


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _is_engine(target: str) -> bool:
    return target == ENGINE or target.startswith(ENGINE + ".")


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


def cycle_breaches(tree: Tree) -> list[str]:
    graph = tree.graph()
    return [f"{_shortest_cycle(graph, c)}   (modules in this cycle: {', '.join(c)})" for c in _cycles(graph)]


def upward_breaches(tree: Tree) -> list[str]:
    def allowed(module, target, name):
        floor = tree.floor_of(target)
        return floor is None or floor <= tree.floor[module]
    return tree.crossings(sorted(tree.files), allowed)


def surface_breaches(tree: Tree) -> list[str]:
    public_names = {m: tree.all_of(m) for m in PUBLIC_MODULES if m in tree.files}

    def allowed(module, target, name):
        if not _is_engine(target) or (module, target) in MEASURES_INTERNALS:
            return True
        if target == PUBLIC_PACKAGE or target.startswith(PUBLIC_PACKAGE + "."):
            return name is None or not name.startswith("_")
        return target in public_names and (name is None or public_names[target] is None
                                           or name in public_names[target])
    return tree.crossings(tree.users(), allowed)


def private_reach_breaches(tree: Tree) -> list[str]:
    """`module (line n): expression` for each attribute a user reads or writes that the engine defines as private
    (a `_name` method, class attribute or `self._name`), on anything but its own `self`/`cls`."""
    private = set()
    for m in tree.files:
        if not _is_engine(m):
            continue
        for node in ast.walk(tree.tree(m)):
            if isinstance(node, ast.ClassDef):
                for item in node.body:
                    names = [item.name] if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)) else \
                        [t.id for t in getattr(item, "targets", [getattr(item, "target", None)])
                         if isinstance(t, ast.Name)]
                    private.update(n for n in names if _private(n))
            elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self" \
                    and _private(node.attr):
                private.add(node.attr)
    return [f"{m} (line {node.lineno}): {ast.unparse(node)}" for m in tree.users() for node in ast.walk(tree.tree(m))
            if isinstance(node, ast.Attribute) and node.attr in private
            and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"))]


def _private(name: str) -> bool:
    return name.startswith("_") and not name.endswith("__")


REPO = Tree(ROOT)


def test_no_import_cycle():
    bad = cycle_breaches(REPO)
    assert not bad, "import cycles, one per set of modules in a cycle:\n" + "\n".join(bad)


def test_imports_point_down():
    bad = upward_breaches(REPO)
    assert not bad, "imports of a floor above (engine < trainer < entry points):\n" + "\n".join(bad)


def test_the_engine_s_users_import_only_its_public_surface():
    bad = surface_breaches(REPO)
    assert not bad, "the trainer or the entry points importing what the engine does not make public:\n" + \
        "\n".join(bad)


def test_no_user_reaches_into_the_engine_s_private_attributes():
    bad = private_reach_breaches(REPO)
    assert not bad, "the engine's private attributes used from above it:\n" + "\n".join(bad)


def test_every_internal_a_benchmark_measures_is_still_imported():
    """An entry of MEASURES_INTERNALS that no import needs any more would let a new one in unseen."""
    used = {(m, target) for m in REPO.users() for node in REPO.imports(m) for target, _ in REPO.targets(m, node)}
    stale = sorted(set(MEASURES_INTERNALS) - used)
    assert not stale, f"MEASURES_INTERNALS entries that no import uses (remove them): {stale}"


def _write(root, files: dict[str, str]) -> Tree:
    for rel, text in files.items():
        os.makedirs(os.path.join(root, os.path.dirname(rel)), exist_ok=True)
        with open(os.path.join(root, rel), "w") as f:
            f.write(text)
    return Tree(str(root))


ENGINE_FILES = {
    "datastates/__init__.py": "from .pool import Pool\n__all__ = ['Pool']\n",
    "datastates/pool.py": "class Pool:\n    def __init__(self):\n        self._slots = []\n",
    "megatron/training/loop.py": "from datastates import Pool\n",
    "tools/cli.py": "import megatron.training.loop\n",
}


def test_each_rule_fails_on_its_breach(tmp_path):
    """The rules above pass on a tree that keeps them and name each breach: a cycle made by an import inside a
    function, the trainer importing a tool inside a function, an internal module imported, a private attribute
    read; an import under TYPE_CHECKING is no breach."""
    clean = _write(tmp_path / "clean", ENGINE_FILES | {
        "megatron/training/hints.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import tools.cli\n"})
    assert (cycle_breaches(clean), upward_breaches(clean), surface_breaches(clean),
            private_reach_breaches(clean)) == ([], [], [], [])
    bad = _write(tmp_path / "bad", ENGINE_FILES | {
        "datastates/pool.py": ENGINE_FILES["datastates/pool.py"] + "def later():\n    from . import grow\n",
        "datastates/grow.py": "from .pool import Pool\n",
        "megatron/training/loop.py": "from datastates import Pool\nfrom datastates.pool import Pool as P\n"
                                     "def export():\n    from tools.cli import main\n    return Pool()._slots\n",
    })
    assert cycle_breaches(bad) == ["datastates.grow -> datastates.pool -> datastates.grow   (modules in this "
                                   "cycle: datastates.grow, datastates.pool)",
                                   "megatron.training.loop -> tools.cli -> megatron.training.loop   (modules in "
                                   "this cycle: megatron.training.loop, tools.cli)"]
    assert upward_breaches(bad) == ["megatron.training.loop (line 4): tools.cli import main"]
    assert surface_breaches(bad) == ["megatron.training.loop (line 2): datastates.pool import Pool"]
    assert private_reach_breaches(bad) == ["megatron.training.loop (line 5): Pool()._slots"]
