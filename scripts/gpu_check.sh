#!/usr/bin/env bash
# The CUDA check, for a machine with an NVIDIA GPU (CI's machines have none: run it there by hand).
#
#   bash scripts/gpu_check.sh      (a few minutes; the first set-up also downloads torch's CUDA build, ~3 GB)
#
# Without CUDA (no nvidia-smi, no GPU in `nvidia-smi -L`, or CUDA_VISIBLE_DEVICES set empty) it says so and exits
# 0 at once, installing nothing. Otherwise it sets up a venv of its own, .venv-cuda, through scripts/setup.sh
# (PYTHON, default python3.12: on Linux x86_64 pip's torch==2.13.0 for it is the CUDA build; TORCH_PIN as in
# setup.sh; extras megatron,tools,test,bench), checks that its torch sees the GPU (a GPU that nvidia-smi lists
# but torch cannot use is a failure), and runs three parts on one CUDA device (the first of CUDA_VISIBLE_DEVICES,
# default 0):
#   (a) pytest tests/test_cuda.py: the engine's CUDA path (pinned staging, side-stream copies, the fence);
#   (b) pretrain_gpt.py on 1 GPU with --bf16 --use-distributed-optimizer --async-ckpt (datastates, a checkpoint
#       every 5 iterations): stopped at iteration 10 (--exit-interval), resumed with --load to 20, and every
#       iteration's loss compared with an uninterrupted run of the same flags, for exact equality.
#       Why exact: both runs execute the same kernels on the same shapes in the same order on one device (no TP,
#       no reduction across ranks; megatron-core's local layer spec, no Transformer Engine; cuBLAS made
#       deterministic with CUBLAS_WORKSPACE_CONFIG=:4096:8), and the resume restores model, fp32 main params,
#       Adam moments and the CPU and CUDA RNG states bit for bit (dropout stays on). A difference is therefore a
#       resume bug or a GPU that is not deterministic run to run; on a mismatch the uninterrupted run is
#       repeated once, and the summary line says which of the two it is (either way the part fails);
#   (c) the side-by-side checkpoint benchmark's systems (benchmarks/systems.py: torch.save, megatron-core
#       torch_dist sync/async, DCP save/async_save, this engine sync/lazy) on its 1 GB fp32 state
#       (benchmarks/common.make_state) held on the GPU, one rank, 1 warm-up + 3 checkpoints each: save() call,
#       stall (call + immediate fence) and time to durable, medians. benchmarks/run_all.py has no option that
#       puts its state on the device, so this part drives the same systems with the state moved to cuda.
#       It passes when both engine modes save and the lazy engine's last checkpoint loads back into the GPU
#       state bit for bit; a peer that fails is named in the line, as the benchmark reports failed systems.
# One summary line per part (PASS/FAIL/SKIP and the key figure) at the end; exit 1 if any part fails. Every
# part's full output is under OUT (default bench_out/gpu_check).
#
# GPU_CHECK_DEVICE=cpu: the same parts, the same commands, on the CPU in the project's default venv (.venv, bench
# extra added), for checking this script on a machine without a GPU; (a)'s tests then skip (SKIP).
set -uo pipefail  # no -e: every part runs and reports
cd "$(dirname "$0")/.."
DEVICE=${GPU_CHECK_DEVICE:-cuda}
say() { echo "gpu_check: $*"; }

case "$DEVICE" in
  cuda)
    why=
    if ! command -v nvidia-smi >/dev/null 2>&1; then
      why="nvidia-smi not found"
    elif ! nvidia-smi -L 2>/dev/null | grep -q '^GPU '; then
      why="nvidia-smi lists no GPU"
    elif [ -n "${CUDA_VISIBLE_DEVICES+set}" ] && { [ -z "$CUDA_VISIBLE_DEVICES" ] || [ "$CUDA_VISIBLE_DEVICES" = -1 ]; }; then
      why="CUDA_VISIBLE_DEVICES='$CUDA_VISIBLE_DEVICES' hides every GPU"
    fi
    if [ -n "$why" ]; then
      say "no CUDA on this machine ($why): nothing to check, nothing installed"
      exit 0
    fi
    CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0}
    export CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES%%,*}  # one device
    export PYTHON=${PYTHON:-python3.12} VENV=${VENV:-.venv-cuda}
    ;;
  cpu) export CUDA_VISIBLE_DEVICES= ;;
  *) echo "GPU_CHECK_DEVICE must be cuda or cpu, not '$DEVICE'" >&2; exit 2 ;;
esac

if ! EXTRAS=megatron,tools,test,bench bash scripts/setup.sh; then
  say "FAIL: set-up (scripts/setup.sh) failed"
  exit 1
fi
. scripts/env.sh
PY=$VENV/bin/python
OUT=${OUT:-bench_out/gpu_check}
rm -rf "$OUT" && mkdir -p "$OUT"
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-4} PYTHONWARNINGS=ignore CUBLAS_WORKSPACE_CONFIG=:4096:8

if [ "$DEVICE" = cuda ]; then
  if ! info=$("$PY" -c 'import torch
assert torch.cuda.is_available(), f"torch {torch.__version__} (CUDA build: {torch.version.cuda}) sees no CUDA device"
print(f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}, CUDA {torch.version.cuda}")' 2>&1); then
    say "FAIL: nvidia-smi lists a GPU but $VENV's torch cannot use it: $(echo "$info" | tail -n 1)"
    say "(a CPU build of torch: set TORCH_PIN or PYTHON; CUDA build: check the driver against CUDA's version)"
    exit 1
  fi
else
  info="CPU dry run, torch $("$PY" -c 'import torch; print(torch.__version__)')"
fi
say "device: $info; venv $VENV; logs under $OUT"

SUMMARY=()
FAILED=0
result() {  # result PART PASS|FAIL|SKIP TEXT
  SUMMARY+=("$1 $2: $3")
  [ "$2" = FAIL ] && FAILED=1
  say "$1 $2: $3"
}

# ---------------------------------------------------------------- (a) the engine's CUDA tests
say "(a) pytest tests/test_cuda.py   (log: $OUT/a_test_cuda.log)"
timeout 600 "$PY" -m pytest -q -rs -p no:cacheprovider tests/test_cuda.py >"$OUT/a_test_cuda.log" 2>&1
rc=$?
last=$(grep -E '[0-9]+ (passed|failed|skipped|error)' "$OUT/a_test_cuda.log" | tail -n 1 | tr -d '=' | xargs)
passed=$(echo "$last" | sed -n 's/.*\b\([0-9]\+\) passed.*/\1/p')
if [ "$rc" != 0 ]; then
  result "(a) tests/test_cuda.py" FAIL "exit $rc: ${last:-no pytest summary}"; tail -n 30 "$OUT/a_test_cuda.log"
elif [ "$DEVICE" = cpu ]; then
  result "(a) tests/test_cuda.py" SKIP "$last (no CUDA device in a CPU dry run)"
elif [ "${passed:-0}" -ge 2 ]; then
  result "(a) tests/test_cuda.py" PASS "$last"
else
  result "(a) tests/test_cuda.py" FAIL "fewer than the 2 single-device tests ran: $last"
fi

# ---------------------------------------------------------------- (b) bf16 trainer: stop, resume, compare
ITERS=20 HALF=10 INTERVAL=5
MODEL=(--num-layers 4 --hidden-size 256 --num-attention-heads 8 --seq-length 256 --max-position-embeddings 256
       --vocab-size 1024 --micro-batch-size 4 --global-batch-size 8 --train-iters "$ITERS" --lr 3e-3
       --lr-warmup-iters 2 --lr-decay-style cosine --mock-data --seed 1234 --log-interval 1
       --bf16 --use-distributed-optimizer --ckpt-format datastates --async-ckpt --save-interval "$INTERVAL")
train() {  # train NAME ARGS...: one 1-process torchrun job (its own free port), output to $OUT/b_NAME.log
  local name=$1
  shift
  say "(b) $name   (log: $OUT/b_$name.log)"
  timeout 600 "$PY" -m torch.distributed.run --standalone --nproc_per_node 1 pretrain_gpt.py "${MODEL[@]}" "$@" \
    >"$OUT/b_$name.log" 2>&1 || { say "(b) $name failed (exit $?); the end of its log:"; tail -n 30 "$OUT/b_$name.log"; return 1; }
}
# compare_losses A_LOGS B_LOGS: A is a stopped (first log, to HALF) and resumed (second log) run, or one log;
# prints the figure for the summary line; exit 1 with the differences when the losses are not identical
compare_losses() {
  "$PY" - "$HALF" "$ITERS" "$@" <<'PYEOF'
import re, sys
half, iters, a, b = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3].split(","), sys.argv[4]
loss = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.* lm loss: ([^ ]+) \|")
stall = re.compile(r"checkpoint summary iteration\s+\d+ .*max stall ms over ranks: ([\d.]+)")
def losses(path):
    return {int(k): v for k, v in loss.findall(open(path).read())}
problems = []
if len(a) == 2:
    p1, p2 = losses(a[0]), losses(a[1])
    if late := sorted(i for i in p1 if i > half):
        problems.append(f"the first part did not stop at {half}: it logged iterations {late}")
    if early := sorted(i for i in p2 if i <= half):
        problems.append(f"the second part did not resume at {half + 1}: it logged iterations {early}")
    got = {**{i: v for i, v in p1.items() if i <= half}, **{i: v for i, v in p2.items() if i > half}}
else:
    got = losses(a[0])
ref = losses(b)
for name, d in (("stop+resume" if len(a) == 2 else a[0], got), (b, ref)):
    if gone := [i for i in range(1, iters + 1) if i not in d]:
        problems.append(f"{name}: no loss for iterations {gone}")
differ = [i for i in range(1, iters + 1) if i in got and i in ref and got[i] != ref[i]]
problems += [f"iteration {i}: {got[i]} vs {ref[i]}" for i in differ[:5]]
if problems:
    print("; ".join(problems))
    sys.exit(1)
stalls = [float(s) for p in a for s in stall.findall(open(p).read())]
print(f"losses identical at all {iters} iterations (stopped at {half}, resumed from the lazy checkpoint; "
      f"last lm loss {ref[iters]}); lazy checkpoint stall max {max(stalls):.1f} ms over {len(stalls)} checkpoints")
PYEOF
}
B=$OUT/b_ckpt
if train "1-stop-at-$HALF" --save "$B/resumed" --load "$B/resumed" --exit-interval "$HALF" &&
   train "2-resume-to-$ITERS" --save "$B/resumed" --load "$B/resumed" &&
   train "3-uninterrupted" --save "$B/straight"; then
  if msg=$(compare_losses "$OUT/b_1-stop-at-$HALF.log,$OUT/b_2-resume-to-$ITERS.log" "$OUT/b_3-uninterrupted.log"); then
    result "(b) bf16 stop/resume" PASS "$msg"
  else
    say "(b) the losses differ: $msg; repeating the uninterrupted run to tell a resume bug from a non-deterministic GPU"
    if train "4-uninterrupted-again" --save "$B/straight2"; then
      if again=$(compare_losses "$OUT/b_4-uninterrupted-again.log" "$OUT/b_3-uninterrupted.log"); then
        result "(b) bf16 stop/resume" FAIL "the resumed run differs from two identical uninterrupted runs: $msg"
      else
        result "(b) bf16 stop/resume" FAIL "this GPU is not deterministic run to run (two uninterrupted runs differ: $again), so the exact resume check cannot decide; resume: $msg"
      fi
    else
      result "(b) bf16 stop/resume" FAIL "the losses differ ($msg), and the repeated uninterrupted run failed"
    fi
  fi
else
  result "(b) bf16 stop/resume" FAIL "a training run failed (logs $OUT/b_*.log)"
fi
rm -rf "$B"

# ---------------------------------------------------------------- (c) 1 GB side by side, state on the device
say "(c) 1 GB side-by-side benchmark, state on $DEVICE   (log: $OUT/c_bench.log)"
# a file, not stdin: megatron-core's async writer starts processes with spawn, which re-import the main module
cat >"$OUT/c_bench.py" <<'PYEOF'
import os, shutil, socket, statistics, sys, time, traceback
import torch
import torch.distributed as dist
sys.path.insert(0, os.path.abspath("benchmarks"))
import common
import systems as S


def main():
    device, root, size_gb, reps = sys.argv[1], sys.argv[2], float(sys.argv[3]), int(sys.argv[4])
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=0, world_size=1)  # as benchmarks/worker.py (object collectives only here)
    common.install_cpu_guard()  # nothing with CUDA
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)

    def to_device(x):
        if isinstance(x, dict):
            return {k: to_device(v) for k, v in x.items()}
        return x.to(device) if isinstance(x, torch.Tensor) and x.is_floating_point() else x

    state = to_device(common.make_state(size_gb * common.GB, 0, 1))
    ref = common.checksums(state)
    nbytes = common.state_bytes(state)
    print(f"state {nbytes / 1e9:.3f} GB on {device}", flush=True)
    ctx = {"rank": 0, "world": 1, "engine_buffer_bytes": 4 << 30, "engine_writer_threads": 4}
    systems, failed = [], {}
    for name in S.available(S.DEFAULT_SYSTEMS):
        s = S.REGISTRY[name]()
        try:
            s.setup(ctx)
            systems.append(s)
        except Exception as e:
            failed[name] = f"setup: {type(e).__name__}: {e}"
    samples = {s.name: [] for s in systems}
    last = {}
    for rep in range(1 + reps):  # 1 warm-up; systems interleaved A B C ... C B A as the benchmark does
        for s in (systems if rep % 2 == 0 else systems[::-1]):
            if s.name in failed:
                continue
            path = os.path.join(root, s.name, f"iter_{rep + 1:07d}")
            try:
                sync()
                t0 = time.perf_counter()
                s.save(state, path, rep + 1)
                t_call = time.perf_counter() - t0
                s.fence()
                t_fence = time.perf_counter() - t0
                s.wait()
                common.fsync_tree(path)
                t_durable = time.perf_counter() - t0
            except Exception as e:
                traceback.print_exc()
                failed[s.name] = f"{type(e).__name__}: {e}"
                continue
            if rep:
                samples[s.name].append((t_call, t_fence, t_durable))
                print(f"rep {rep} {s.name:17s} call {t_call:7.3f}s stall {t_fence:7.3f}s durable {t_durable:7.3f}s",
                      flush=True)
            if s.name in last:
                shutil.rmtree(last[s.name], ignore_errors=True)  # one checkpoint per system on the disk
            last[s.name] = path
    verified = False
    if "engine_lazy" in last and "engine_lazy" not in failed:
        lazy = next(s for s in systems if s.name == "engine_lazy")
        for k, t in common.iter_tensors(state):
            t.zero_()
        try:
            lazy.load(state, last["engine_lazy"])
            got = common.checksums(state)
            on_device = all(t.device.type == device for _, t in common.iter_tensors(state) if t.is_floating_point())
            verified = got == ref and on_device
            print(f"engine_lazy load into the {device} state: checksums {'equal' if got == ref else 'DIFFER'}, "
                  f"tensors on {device}: {on_device}", flush=True)
        except Exception as e:
            traceback.print_exc()
            failed["engine_lazy load"] = f"{type(e).__name__}: {e}"
    for s in systems:
        try:
            s.teardown()
        except Exception:
            pass
    dist.destroy_process_group()
    med = {n: tuple(statistics.median(x[i] for x in v) for i in range(3)) for n, v in samples.items() if v}
    print(f"\n{'system':18s} {'call s':>8s} {'stall s':>8s} {'durable s':>9s} {'GB/s':>6s}")
    for n, (c, f, d) in med.items():
        print(f"{n:18s} {c:8.3f} {f:8.3f} {d:9.3f} {nbytes / d / 1e9:6.2f}")
    for n, e in failed.items():
        print(f"{n:18s} FAILED: {e}")
    ok = "engine_lazy" in med and "engine_sync" in med and verified
    peers = ", ".join(f"{n} {med[n][1]:.3f} s" for n in ("torch_save", "torch_dist_async", "dcp_async") if n in med)
    line = (f"{nbytes / 1e9:.2f} GB on {device}: lazy engine stall {med['engine_lazy'][1]:.3f} s (call "
            f"{med['engine_lazy'][0]:.3f} s, durable {med['engine_lazy'][2]:.3f} s), sync engine "
            f"{med['engine_sync'][1]:.3f} s; peers' stall: {peers}" if ok else
            "the engine did not save, or its checkpoint did not load back bit for bit")
    if failed:
        line += "; failed: " + ", ".join(failed)
    print(("SUMMARY PASS " if ok else "SUMMARY FAIL ") + line)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":  # torch_dist and DCP spawn processes that import this file
    main()
PYEOF
timeout 900 "$PY" "$OUT/c_bench.py" "$DEVICE" "$OUT/c_ckpt" 1.0 3 >"$OUT/c_bench.log" 2>&1
rc=$?
line=$(sed -n 's/^SUMMARY \(PASS\|FAIL\) //p' "$OUT/c_bench.log" | tail -n 1)
if [ "$rc" = 0 ]; then
  result "(c) 1 GB side by side" PASS "$line"
else
  result "(c) 1 GB side by side" FAIL "exit $rc: ${line:-see $OUT/c_bench.log}"
  tail -n 30 "$OUT/c_bench.log"
fi
rm -rf "$OUT/c_ckpt"

echo
say "summary ($info)"
for l in "${SUMMARY[@]}"; do echo "  $l"; done
if [ "$FAILED" = 0 ]; then say "PASS"; else say "FAIL"; fi
exit "$FAILED"
