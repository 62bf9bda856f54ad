#!/usr/bin/env bash
# The test command: set-up (idempotent) then the suite on CPU.
#
#   bash scripts/test.sh                      Python 3.11 + megatron-core 0.16.1 (.venv): FIRST below, and
#                                             every file in neither list
#   PYTHON=python3.12 bash scripts/test.sh    Python 3.12 + megatron-core 0.19.2 (.venv-python3.12): SECOND
#                                             below, every file in neither list, and the cross-version tests,
#                                             which also drive .venv (set up here)
#
# Arguments go to pytest and replace the default selection (a file, -k, -x ...).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. scripts/env.sh
# Each test file runs in one environment, so that CI holds both within its budget, unless it is in neither list
# (then in both: a new file runs in both until it is placed). In both: the checks of megatron-core's own
# sharded state (test_megatron_state: bit-exact resume, resharding, a round trip through stock megatron-core),
# which the optimizer workarounds of both releases hang on, and the quick tests of flags and schedules.
# FIRST: what no megatron-core release changes (the engine alone: its unit, crash, fault, bad-input, native-I/O,
# format compatibility, reader and S3-store tests, the import contract; this project's own argument
# validation, exit and memory-tier logic over the trainer, a node lost inside an elastic job), then half of the trainer's features.
# SECOND: the other half (the newest megatron-core: upstream's scripts, MoE, DeepSeek, pipeline stages, restarts
# inside a torchrun job, whole-job kills, the data position's resume), which balances the two suites' times in CI.
# The main job (examples/run_local_demo.sh) and the Slurm examples run the trainer on the first environment too.
FIRST=(test_audit.py test_bad_input.py test_built_on_copy.py test_coordination.py test_crash.py
       test_crash_states.py test_engine.py test_engine_alone.py test_faults.py test_load_plan.py
       test_multirank.py test_native.py test_read_once.py test_load_reads.py test_snapshot.py test_storage.py
       test_compatibility.py test_reader_api.py test_import_contract.py test_s3_store.py test_s3_storage.py test_s3_convert.py
       test_s3_trainer.py test_s3_retries.py test_megatron_args.py test_exits.py
       test_memory_tier.py test_compare_losses.py test_compression.py
       test_hf.py test_hf_moe.py test_reshard.py test_virtual_pipeline.py test_trainer_flags.py test_tools.py
       test_entry_points.py test_finetune.py test_storage_conformance.py
       test_benchmark_scripts.py test_kept.py test_failures.py test_elastic.py test_fsdp2_plain.py
       test_weights_publish.py test_weights_versions.py test_weights_remote.py test_torch_dcp.py)
SECOND=(test_upstream_runs.py test_moe.py test_hf_deepseek.py test_hf_qwen.py test_megatron_resume.py
        test_megatron_pp.py test_read_once_trainer.py test_msc_torch_dist.py test_deepseek.py test_cross_version.py
        test_gpu_check.py test_hf_publish.py test_rank_launcher.py test_restarts.py test_fsdp2.py
        test_trainer_kills.py test_data_resume.py test_fsdp_dtensor.py)
# where the time goes, in every CI log; a test still running after 15 minutes is stuck (the slowest takes about a
# minute, four on a loaded machine): it fails with its stack and the suite goes on, long before CI's own guard
PYTEST=("$VENV/bin/python" -m pytest -q --durations=25 --timeout=900)
if [ "$#" -gt 0 ]; then
  exec "${PYTEST[@]}" "$@"
elif [ "$VENV" = .venv ]; then
  exec "${PYTEST[@]}" tests "${SECOND[@]/#/--ignore=tests/}"
else
  env -u PYTHON -u VENV bash scripts/setup.sh  # the cross-version tests run the first environment too
  exec "${PYTEST[@]}" tests "${FIRST[@]/#/--ignore=tests/}"
fi
