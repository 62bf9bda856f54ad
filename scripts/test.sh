#!/usr/bin/env bash
# The test command: set-up (idempotent) then the suite on CPU.
#
#   bash scripts/test.sh                      Python 3.11 + megatron-core 0.16.1 (.venv): the whole suite
#   PYTHON=python3.12 bash scripts/test.sh    Python 3.12 + megatron-core 0.19.2 (.venv-python3.12): the tests
#                                             that megatron-core's version can change (ONE_ENV below: the rest),
#                                             plus the cross-version tests, which also drive .venv (set up here)
#
# Arguments go to pytest and replace the default selection (a file, -k, -x ...).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. scripts/env.sh
# Tests of what no megatron-core release changes run in the first environment only (the same torch is in
# both): the engine alone (torch + datastates._native: its unit, crash, fault, bad-input, native-I/O, format
# compatibility, reader and S3-store tests, and the import contract),
# and this project's own argument validation, exit, kill and memory-tier logic over the trainer. The second
# environment runs everything that builds or checkpoints megatron-core's objects, plus the cross-version tests.
ONE_ENV=(test_audit.py test_bad_input.py test_built_on_copy.py test_coordination.py test_crash.py
         test_crash_states.py test_engine.py test_engine_alone.py test_faults.py test_load_plan.py
         test_multirank.py test_native.py test_read_once.py test_restore.py test_snapshot.py test_storage.py
         test_compatibility.py test_reader_api.py test_import_contract.py test_s3_store.py test_s3_storage.py
         test_s3_trainer.py test_s3_retries.py test_megatron_args.py test_exits.py test_trainer_kills.py
         test_memory_tier.py test_compare_losses.py test_compression.py
         test_restarts.py)
# where the time goes, in every CI log
PYTEST=("$VENV/bin/python" -m pytest -q --durations=25)
if [ "$#" -gt 0 ]; then
  exec "${PYTEST[@]}" "$@"
elif [ "$VENV" = .venv ]; then
  exec "${PYTEST[@]}" tests
else
  env -u PYTHON -u VENV bash scripts/setup.sh  # the cross-version tests run the first environment too
  exec "${PYTEST[@]}" tests "${ONE_ENV[@]/#/--ignore=tests/}"
fi
