#!/usr/bin/env bash
# The test command: set-up (idempotent) then the whole suite on CPU.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m pytest -q tests "$@"
