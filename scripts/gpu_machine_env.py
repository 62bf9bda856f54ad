"""Build a venv shaped like the GPU machines' own python3, for the GPU check's rehearsal on a CPU machine.

    python scripts/gpu_machine_env.py SOURCE_VENV TARGET_VENV [--torch WHEEL]

The GPU machines this project is checked on are offline and have Python 3.12 with torch and a fixed list of
packages (MACHINE below), but neither megatron-core, nor boto3, nor multi-storage-client, nor this project. The
rehearsal must fail where the machine would, so TARGET_VENV sees exactly MACHINE and what those packages need:
each distribution of that closure found in SOURCE_VENV (the Python 3.12 test venv) is linked in, file by file, so
nothing is downloaded twice; one that SOURCE_VENV lacks is installed from the registry (matplotlib, a few MB).
`--torch WHEEL` installs that torch instead of linking SOURCE_VENV's (the GPU machines run torch 2.11: this is how
the rehearsal proves the floor of the supported range); its CUDA libraries still come from SOURCE_VENV.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys

# What a GPU machine's python3 has (the device description), by distribution name.
MACHINE = ["torch", "numpy", "packaging", "pybind11", "setuptools", "wheel", "pytest", "hypothesis", "transformers",
           "safetensors", "tokenizers", "sentencepiece", "tensorboard", "psutil", "matplotlib", "tqdm"]

_CLOSURE = r"""
import importlib.metadata as md, json, re, sys
from packaging.requirements import Requirement
want, seen, missing, files = [(n, "") for n in sys.argv[1:]], set(), [], {}
while want:
    name, extra = want.pop()
    name = re.sub(r"[-_.]+", "-", name).lower()
    if (name, extra) in seen:
        continue
    seen.add((name, extra))
    try:
        dist = md.distribution(name)
    except md.PackageNotFoundError:
        missing.append(name)
        continue
    files[name] = [str(f) for f in dist.files or []]
    for r in dist.requires or []:  # what the distribution needs, and what the extra asked of it needs
        req = Requirement(r)
        if req.marker is None or req.marker.evaluate({"extra": extra}):
            want += [(req.name, "")] + [(req.name, e) for e in req.extras]
print(json.dumps({"files": files, "missing": sorted(set(missing))}))
"""
_INSTALLED = ("import importlib.metadata as md, json, re; "
              "print(json.dumps([re.sub(r'[-_.]+', '-', d.metadata['Name']).lower() for d in md.distributions() "
              "if d.metadata['Name']]))")


def site_packages(venv: str) -> str:
    lib = os.path.join(venv, "lib")
    found = [d for d in os.listdir(lib) if re.fullmatch(r"python3\.\d+", d)]
    if len(found) != 1:
        raise SystemExit(f"{venv}: expected one lib/python3.X, found {found}")
    return os.path.join(lib, found[0], "site-packages")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("source")
    ap.add_argument("target")
    ap.add_argument("--torch", help="a torch wheel to install instead of linking the source venv's torch")
    a = ap.parse_args()
    src_py = os.path.join(a.source, "bin", "python")
    out = subprocess.run([src_py, "-c", _CLOSURE, *MACHINE], check=True, capture_output=True, text=True).stdout
    closure = json.loads(out)
    if not os.path.exists(os.path.join(a.target, "bin", "python")):
        subprocess.run([os.path.realpath(src_py), "-m", "venv", "--without-pip", a.target], check=True)
        subprocess.run([os.path.join(a.target, "bin", "python"), "-m", "ensurepip", "--default-pip"], check=True,
                       capture_output=True)
    target_py = os.path.join(a.target, "bin", "python")
    pip = [target_py, "-m", "pip", "install", "--quiet", "--no-cache-dir"]
    if a.torch:
        subprocess.run([*pip, "--no-deps", a.torch], check=True)
    if closure["missing"]:  # installed first, with what they need (none of it torch), so nothing is linked twice
        subprocess.run([*pip, *closure["missing"]], check=True)
    have = set(json.loads(subprocess.run([target_py, "-c", _INSTALLED], check=True, capture_output=True,
                                         text=True).stdout))
    src_site, dst_site = os.path.abspath(site_packages(a.source)), os.path.abspath(site_packages(a.target))
    linked = 0
    for name, paths in closure["files"].items():
        if name in have:
            continue
        for rel in paths:
            src, dst = os.path.join(src_site, rel), os.path.normpath(os.path.join(dst_site, rel))
            if not dst.startswith(dst_site + os.sep) or not os.path.isfile(src) or os.path.lexists(dst):
                continue  # scripts under ../../bin, files the installer listed but did not keep
            os.makedirs(os.path.dirname(dst), exist_ok=True)
            os.symlink(src, dst)
            linked += 1
    print(f"{a.target}: {len(closure['files'])} distributions linked from {a.source} ({linked} new files), "
          f"installed {closure['missing'] + ([a.torch] if a.torch else []) or 'nothing'}")


if __name__ == "__main__":
    sys.exit(main())
