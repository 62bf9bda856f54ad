#!/usr/bin/env bash
# The test command: set-up (idempotent) then the suite on CPU.
#
#   bash scripts/test.sh                      Python 3.11 + megatron-core 0.16.1 (.venv): the whole suite
#   PYTHON=python3.12 bash scripts/test.sh    Python 3.12 + megatron-core 0.19.2 (.venv-python3.12): the suite
#                                             without the engine-only durability campaigns (below), plus the
#                                             cross-version tests, which also drive .venv (set up here too)
#
# Arguments go to pytest and replace the default selection (a file, -k, -x ...).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. scripts/env.sh
# Crash, fault, bad-input and native-I/O campaigns: the engine alone (torch + datastates._native, no
# megatron-core), with the same torch in both environments; they run in the first one only.
ENGINE_ONLY=(test_crash.py test_crash_states.py test_faults.py test_bad_input.py test_native.py)
if [ "$#" -gt 0 ]; then
  exec "$VENV/bin/python" -m pytest -q "$@"
elif [ "$VENV" = .venv ]; then
  exec "$VENV/bin/python" -m pytest -q tests
else
  env -u PYTHON -u VENV bash scripts/setup.sh  # the cross-version tests run the first environment too
  exec "$VENV/bin/python" -m pytest -q tests "${ENGINE_ONLY[@]/#/--ignore=tests/}"
fi
