# Sourced by setup.sh, test.sh and the demo: which interpreter and which venv.
#   PYTHON   the interpreter to build the venv with (default python3; a pyenv version that is installed but not
#            active, such as python3.12, is found under `pyenv root`)
#   VENV     the venv directory (default .venv for the default interpreter, .venv-<basename of PYTHON> otherwise)
PY=${PYTHON:-python3}
if ! "$PY" -c pass 2>/dev/null && command -v pyenv >/dev/null; then
  for cand in "$(pyenv root)"/versions/*/bin/"$PY"; do
    if [ -x "$cand" ] && "$cand" -c pass 2>/dev/null; then PY=$cand; fi
  done
fi
"$PY" -c pass 2>/dev/null || { echo "scripts/env.sh: no working interpreter '$PY' (set PYTHON)" >&2; exit 1; }
if [ -n "${PYTHON:-}" ]; then VENV=${VENV:-.venv-$(basename "$PYTHON")}; else VENV=${VENV:-.venv}; fi
