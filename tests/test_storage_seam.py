"""The storage seam (docs/architecture.md, "The storage contract"): nothing of the engine calls a file system
outside `datastates/storage/`. Every Python file of the engine is parsed (nothing imported) and every call of a
file-system function (`os`'s and `os.path`'s that touch a file, `shutil`, `tempfile`, the builtin `open`,
`pathlib.Path`) outside `storage/` is a breach, unless named below with the reason."""
from __future__ import annotations

import ast
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OS_CALLS = {"rename", "replace", "link", "symlink", "unlink", "remove", "mkdir", "makedirs", "rmdir", "removedirs",
            "listdir", "scandir", "walk", "stat", "lstat", "statvfs", "open", "truncate", "ftruncate", "fsync",
            "pwrite", "pread", "chmod", "utime", "posix_fallocate"}
PATH_CALLS = {"exists", "lexists", "isdir", "isfile", "islink", "getsize", "getmtime", "realpath", "samefile"}
MODULES = {"shutil", "tempfile", "pathlib"}
# (file under datastates/, called name) -> why it is no breach
OUTSIDE_THE_SEAM = {
    "hf/": "datastates.hf reads a user's transformers files (a model, a tokenizer) where they are, on a local file "
           "system, as transformers does; what it writes goes through a storage",
    "memory_tier/topology.py:os.path.realpath": "a name, resolved: which machine's memory a directory is",
}


def breaches(root: str) -> list[str]:
    """`file (line n): call` for every file-system call of the engine under `root` outside storage/."""
    found = []
    engine = os.path.join(root, "datastates")
    for directory, _, files in os.walk(engine):
        for name in sorted(f for f in files if f.endswith(".py")):
            rel = os.path.relpath(os.path.join(directory, name), engine).replace(os.sep, "/")
            if rel.startswith("storage/") or any(rel.startswith(k) for k in OUTSIDE_THE_SEAM if k.endswith("/")):
                continue
            with open(os.path.join(directory, name)) as f:
                tree = ast.parse(f.read())
            for node in sorted((n for n in ast.walk(tree) if isinstance(n, ast.Call)), key=lambda n: n.lineno):
                if _touches_files(call := ast.unparse(node.func)) and f"{rel}:{call}" not in OUTSIDE_THE_SEAM:
                    found.append(f"datastates/{rel} (line {node.lineno}): {call}")
    return found


def _touches_files(call: str) -> bool:
    head, _, last = call.rpartition(".")
    return (call == "open" or (head == "os" and last in OS_CALLS) or (head == "os.path" and last in PATH_CALLS)
            or call.split(".")[0] in MODULES or call in ("Path", "Path.open"))


def test_nothing_of_the_engine_calls_a_file_system_outside_storage():
    bad = breaches(ROOT)
    assert not bad, "file-system calls outside datastates/storage/ (make them a storage's operations):\n" + \
        "\n".join(bad)


def test_every_exception_is_still_needed_and_the_rule_fails_on_a_breach(tmp_path):
    for key in (k for k in OUTSIDE_THE_SEAM if not k.endswith("/")):
        rel, _, call = key.partition(":")
        with open(os.path.join(ROOT, "datastates", rel)) as f:
            assert call in f.read(), f"{key} is no longer called: remove it from OUTSIDE_THE_SEAM"
    files = {"datastates/storage/disk.py": "import os\ndef put(p):\n    os.rename(p, p + '.x')\n",
             "datastates/tier.py": "import os, shutil\ndef move(a, b):\n    os.rename(a, b)\n"
                                   "    if os.path.exists(b):\n        shutil.rmtree(b)\n    return open(b)\n"}
    for rel, text in files.items():
        os.makedirs(tmp_path / os.path.dirname(rel), exist_ok=True)
        (tmp_path / rel).write_text(text)
    assert breaches(str(tmp_path)) == ["datastates/tier.py (line 3): os.rename",
                                       "datastates/tier.py (line 4): os.path.exists",
                                       "datastates/tier.py (line 5): shutil.rmtree",
                                       "datastates/tier.py (line 6): open"]
