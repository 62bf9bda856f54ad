#!/usr/bin/env bash
# The test command: set-up (idempotent) then the suite on CPU. PYTHON=python3.12 runs it in the second
# environment (Python 3.12, megatron-core 0.19); arguments go to pytest (a subset, -k, -x ...).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. scripts/env.sh
exec "$VENV/bin/python" -m pytest -q tests "$@"
