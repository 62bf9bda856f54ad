"""The engine installs and works with torch alone: a real venv that holds torch (and what torch needs) but no
megatron-core saves, publishes across two ranks, and loads back."""
import importlib.metadata as md
import os
import re
import subprocess
import sys
import sysconfig

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SCRIPT = r"""
import sys, torch
try:
    import megatron.core
    raise SystemExit("megatron-core is visible")
except ImportError:
    pass
from datastates import CheckpointEngine, PosixOptions, paths, tracker
root = sys.argv[1]
store = torch.distributed.HashStore()
state = lambda r: {"w": torch.arange(1000, dtype=torch.float32) + r, "step": 7}
engines = [CheckpointEngine(host_buffer_bytes=1 << 20, storage=PosixOptions(writer_threads=1), rank=r, world_size=2,
                            store=store)
           for r in range(2)]
for r, eng in enumerate(engines):
    eng.save(state(r), paths.checkpoint_dir(root, 3))
for eng in engines:
    eng.wait()
for r, eng in enumerate(engines):
    got = eng.load(root)
    assert torch.equal(got["w"], state(r)["w"]) and got["step"] == 7
    eng.close()
assert tracker.read_latest(root) == 3
print("ENGINE-ALONE OK")
"""


def _closure(name: str, seen: set) -> None:
    """`name` and every distribution it requires (extras and environment markers that do not apply skipped)."""
    key = re.sub(r"[-_.]+", "-", name).lower()
    if key in seen:
        return
    try:
        dist = md.distribution(name)
    except md.PackageNotFoundError:
        return
    seen.add(key)
    for req in dist.requires or []:
        if "extra ==" in req:
            continue
        _closure(re.split(r"[ ;<>=!~\[(]", req, 1)[0], seen)


def _link_distribution(name: str, site: str) -> None:
    dist = md.distribution(name)
    tops = {str(f).split("/")[0] for f in dist.files or [] if not str(f).startswith("..")}
    base = str(dist.locate_file(""))
    for top in tops:
        src, dst = os.path.join(base, top), os.path.join(site, top)
        if os.path.exists(src) and not os.path.exists(dst) and not top.endswith(".pth"):
            os.symlink(src, dst)


def test_engine_works_in_a_venv_with_torch_and_no_megatron(tmp_path):
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    py = venv / "bin" / "python"
    site = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    deps: set = set()
    _closure("torch", deps)
    _closure("numpy", deps)
    assert "megatron-core" not in deps
    for name in deps:
        _link_distribution(name, site)
    # this checkout, with its compiled native module, as an installed package would be
    os.symlink(os.path.join(ROOT, "datastates"), os.path.join(site, "datastates"))
    assert sysconfig.get_paths()["purelib"] != site
    r = subprocess.run([str(py), "-c", SCRIPT, str(tmp_path / "ck")], capture_output=True, text=True, timeout=300,
                       env={k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")},
                       cwd=str(tmp_path))
    assert r.returncode == 0 and "ENGINE-ALONE OK" in r.stdout, r.stdout[-2000:] + r.stderr[-3000:]
