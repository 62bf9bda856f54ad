"""Optional libraries the benchmarks need, checked before any measuring starts (not after minutes of it)."""
import importlib.util

INSTALL = "EXTRAS=megatron,tools,test,bench bash scripts/setup.sh   (or, in the venv: pip install -e '.[bench]')"


def require(*modules: str) -> None:
    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    if missing:
        raise SystemExit(f"the benchmarks need {', '.join(missing)}, not installed here; install with:\n    {INSTALL}")
