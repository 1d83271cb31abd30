#!/usr/bin/env bash
# On a GPU machine: runs every CUDA test and GPU benchmark tierzero has, from
# the bundle scripts/gpu_bundle.sh made (.gpu/: binaries, libraries, wheel),
# so nothing is built there. Logs and JSON go to OUT_DIR; a summary table is
# printed last. Exits non-zero when a test fails.
#
#   scripts/gpu_checks.sh OUT_DIR [PART...]     PART: info tests python bench train accept
#                                               (default: all but accept)
#   TZ_GPU_TRAIN_ARGS="ARGS|ARGS..." adds tierzero-train runs to the train part (see train/README.md)
#   TZ_GPU_OVERLAP="nvme cpu gpu" the overlap bench placements; TZ_GPU_PY_BENCH=0 skips the GPT-2 Python bench
#   TZ_GPU_PY_ALL=0 runs only the Python tests on CUDA tensors (not the whole suite first)
#   TZ_GPU_DEADLINE_S=N: no run starts after N seconds, and none runs past them (the
#     device tool's call limit), so the summary is always printed
#   TZ_GPU_LARGEST="--layers L --hidden H ..." the accept part's largest compact model
#     (default: the size tierzero-estimate --largest picks for these budgets)
#   TZ_GPU_ACCEPT="3b gpt2 ..." the accept part's runs, in this order (default: 3b 8b_compact gpt2
#     largest 3b_one_micro_batch 8b_fp32; also 3b_auto); TZ_GPU_3B="after_backward ..." its 3.2B CPU-optimizer configs
# The accept part is issues #21 and #22's GPU acceptance: the 3.2B runs with the
# optimizer after and under backward against every state on the GPU, the 8.1B
# run with fp32 and with compact states, the GPT-2 Python bench with the CPU
# optimizer's variants, and the largest model the compact states train.
set -uo pipefail
out=${1:?usage: gpu_checks.sh OUT_DIR [PART...]}
shift
parts=" ${*:-info tests python bench train} "
deadline=${TZ_GPU_DEADLINE_S:-100000}
mkdir -p "$out"
root=$(pwd)
bin=$root/.gpu/bin
# Binaries built elsewhere name the source tree by its absolute path (test
# fixtures, data/): make that path resolve to this checkout.
src=$(cat "$root/.gpu/source_dir" 2>/dev/null || echo /work/main)
if [[ ! -e $src ]]; then mkdir -p "$(dirname "$src")" && ln -s "$root" "$src"; fi
nccl=$(find /usr /opt -name 'libnccl.so.2' 2>/dev/null | head -1)
cublas=$(find /usr/local/cuda*/ /usr /opt -name 'libcublas.so.1[0-9]' 2>/dev/null | head -1)
export LD_LIBRARY_PATH="$root/.gpu/lib${nccl:+:$(dirname "$nccl")}${cublas:+:$(dirname "$cublas")}:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}"
export TMPDIR=${TMPDIR:-/var/tmp}
summary=()
failed=0
py_ok=
py_site=

# run NAME TIMEOUT_S COMMAND...: logs to OUT_DIR/NAME.log, one summary line.
run() {
  local name=$1 limit=$2
  shift 2
  local left=$((deadline - SECONDS))
  if ((left < 15)); then
    summary+=("$(printf '%-34s not run: past TZ_GPU_DEADLINE_S=%s' "$name" "$deadline")")
    return 0
  fi
  ((limit > left)) && limit=$left
  local start=$SECONDS
  timeout -k 10 "$limit" "$@" >"$out/$name.log" 2>&1
  local rc=$?
  local took=$((SECONDS - start))
  local tally
  tally=$(grep -E '^\[  (PASSED|FAILED|SKIPPED) +\] [0-9]+ test' "$out/$name.log" | sed 's/\[ *//; s/ *\]//' | tr '\n' ' ')
  [[ -z $tally ]] && tally=$(grep -E '[0-9]+ (passed|failed|skipped)' "$out/$name.log" | tail -1)
  summary+=("$(printf '%-34s rc=%-3s %4ss  %s' "$name" "$rc" "$took" "$tally")")
  if [[ $rc -ne 0 ]]; then
    failed=1
    echo "=== $name failed (rc $rc); its log ends:"
    tail -40 "$out/$name.log"
  fi
  return 0
}

if [[ $parts == *" info "* ]]; then
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv >"$out/gpu.txt" 2>&1
  cat "$out/gpu.txt"
  run info 60 "$bin/tierzero-info" --path "$TMPDIR" --json "$out/info.json"
fi

if [[ $parts == *" tests "* ]]; then
  run kernels_tests 300 "$bin/tierzero_kernels_tests"
  run offload_tests 300 "$bin/tierzero_offload_tests"
  run common_tests 300 "$bin/tierzero_common_tests"
  run comm_nccl_tests 300 "$bin/tierzero_comm_tests" --gtest_filter='*Nccl*'
  run engine_cuda_tests 500 "$bin/tierzero_engine_tests" --gtest_filter='ZeroEngineCuda*:*Nccl*'
  # TrainLibraries (CPU tests CI runs) start build/train/tierzero-train, which the bundle does not hold.
  run train_cuda_tests 500 "$bin/tierzero_train_tests" --gtest_filter='*Cuda*:-TrainLibraries.*'
fi

# The wheel, as a user installs it (the tools land in the environment's bin/,
# where tests/python/test_tools.py looks; --force-reinstall: a warm machine may
# hold an earlier build of the same version), or into a directory of its own
# where the environment will not take it. Once, for any part that needs it.
install_wheel() {
  [[ -n $py_ok ]] && return 0
  ls "$root"/.gpu/wheel/*.whl >/dev/null 2>&1 || return 1
  if timeout 120 python3 -m pip install -q --no-index --no-deps --no-compile --force-reinstall "$root"/.gpu/wheel/*.whl \
    >"$out/pip.log" 2>&1; then
    py_site=
  else
    timeout 120 python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/tz-site "$root"/.gpu/wheel/*.whl \
      >>"$out/pip.log" 2>&1 || return 1
    py_site=/tmp/tz-site
  fi
  py_ok=1
}
if [[ $parts == *" python "* || $parts == *" bench "* || $parts == *" accept "* ]]; then
  install_wheel || summary+=("python: no wheel in .gpu/wheel, or it did not install (see pip.log): no Python tests or benches")
fi

if [[ $parts == *" python "* && -n $py_ok ]]; then
  if [[ ${TZ_GPU_PY_ALL:-1} != 0 ]]; then
    PYTHONPATH=$py_site TIERZERO_NVME_BENCH=$bin/tierzero-nvme-bench run python_tests 400 python3 -m pytest -q -rs \
      -p no:cacheprovider "$root/tests/python"
  fi
  # The GPU tests again, with their printed figures.
  PYTHONPATH=$py_site run python_cuda_tests 200 python3 -m pytest -q -s -p no:cacheprovider -k "cuda or gpu or cupy" \
    "$root/tests/python"
fi

if [[ $parts == *" bench "* ]]; then
  run tier_demo 120 "$bin/tierzero-tiers" --params 2e9 --json "$out/tiers.json"
  for placement in ${TZ_GPU_OVERLAP-nvme cpu gpu}; do
    for ms in 4 10 30; do
      run "overlap_${placement}_${ms}ms" 200 "$bin/tierzero-overlap-bench" --backend cuda --synthetic --placement "$placement" \
        --layers 8 --hidden 4096 --batch 4 --compute-ms "$ms" --steps 5 --nvme-path "$TMPDIR/tz-overlap" \
        --json "$out/overlap_${placement}_${ms}ms.json"
    done
  done
  if [[ -n $py_ok && ${TZ_GPU_PY_BENCH:-1} != 0 ]]; then
    PYTHONPATH=$py_site run gpt2_python_bench 400 python3 "$root/bench/python/gpt2_gpu_bench.py" \
      --nvme-path "$TMPDIR" --json "$out/gpt2_python.json"
  fi
fi

if [[ $parts == *" train "* && -n ${TZ_GPU_TRAIN_ARGS:-} ]]; then
  i=0
  IFS='|' read -r -a runs <<<"$TZ_GPU_TRAIN_ARGS"
  for args in "${runs[@]}"; do
    i=$((i + 1))
    # shellcheck disable=SC2086
    run "train_$i" 560 "$bin/tierzero-train" $args
  done
fi

# The accept part's runs, by name; TZ_GPU_ACCEPT picks and orders them.
accept_gpt2() {
  [[ -n $py_ok ]] || return 0
  PYTHONPATH=$py_site run gpt2_python_bench_cpu 300 python3 "$root/bench/python/gpt2_gpu_bench.py" \
    --ways torch,gpu,cpu,cpu+ahead,cpu+compact --nvme-path "$TMPDIR" --json "$out/gpt2_python_cpu.json"
}
# Issue #22: 3.2B (16 x 4096) with the optimizer in CPU memory, after and
# under backward, against every state on the GPU, in one run of this script.
t3=(--backend cuda --layers 16 --hidden 4096 --heads 32 --seq 512 --steps 8 --warmup-steps 4 --eval-every 0 --log-every 1)
accept_3b() {
  run train_3b_all_gpu 120 "$bin/tierzero-train" --config examples/gpu_on_device.json --gpu-bytes 62GiB "${t3[@]}" \
    --out "$out/train/3b_all_gpu"
  for c in ${TZ_GPU_3B:-after_backward under_backward under_backward_noclip}; do
    run "train_3b_cpu_$c" 150 "$bin/tierzero-train" --config "bench/gpu/3b_$c.json" --gpu-bytes 20GiB "${t3[@]}" \
      --out "$out/train/3b_cpu_$c"
  done
}
# The same tokens a step (16 sequences) in one micro-batch, clipping off:
# the whole backward can run beside the optimizer (docs/engine.md's bound).
accept_3b_one_micro_batch() {
  run train_3b1_all_gpu 150 "$bin/tierzero-train" --config bench/gpu/3b_one_micro_batch_all_gpu.json --gpu-bytes 62GiB \
    "${t3[@]}" --out "$out/train/3b1_all_gpu"
  for c in after_backward under_backward_noclip; do
    run "train_3b1_cpu_$c" 150 "$bin/tierzero-train" --config "bench/gpu/3b_one_micro_batch_$c.json" --gpu-bytes 20GiB \
      "${t3[@]}" --out "$out/train/3b1_cpu_$c"
  done
}
# "auto" (the default) with clipping off: its measured pace (Note [When to
# speculate]) should stop speculating after its first two kept windows where
# they were slower; ahead_off in the log names both times.
accept_3b_auto() {
  run train_3b1_cpu_auto_noclip 150 "$bin/tierzero-train" --config bench/gpu/3b_one_micro_batch_auto_noclip.json \
    --gpu-bytes 20GiB --backend cuda --layers 16 --hidden 4096 --heads 32 --seq 512 --steps 12 --warmup-steps 4 \
    --eval-every 0 --log-every 1 --out "$out/train/3b1_cpu_auto_noclip"
}
# Issue #21: 8.1B (40 x 4096) with compact states (they fit in CPU memory).
t8=(--backend cuda --layers 40 --hidden 4096 --heads 32 --seq 512 --eval-every 0 --log-every 1 --nvme-path "$TMPDIR/tz-big")
accept_8b_compact() {
  run train_8b_compact 200 "$bin/tierzero-train" --config bench/gpu/8b_under_backward.json --master remainder --moments int8 \
    --steps 4 "${t8[@]}" --out "$out/train/8b_compact"
  rm -rf "$TMPDIR/tz-big"
}
# The 8.1B run as the H100 ran it, fp32 states (the master on NVMe).
accept_8b_fp32() {
  run train_8b_fp32 240 "$bin/tierzero-train" --config bench/gpu/8b.json --steps 3 "${t8[@]}" --out "$out/train/8b_fp32"
  rm -rf "$TMPDIR/tz-big"
}
# The largest model the most compact states train on this machine.
accept_largest() {
  local largest=${TZ_GPU_LARGEST:-}
  if [[ -z $largest ]]; then
    # The most layers of width 4096 the planner fits in this machine's budgets
    # (the config's GPU and CPU bytes, the free space of the run's NVMe
    # directory), for the run below: 2 sequences a micro-batch (the
    # activations of 4, fp32 without recomputation, would not fit beside the
    # parameters on the GPU at this depth), no evaluation.
    mkdir -p "$TMPDIR/tz-largest"
    local found= layers
    for layers in $(seq 200 -1 8); do
      ((SECONDS < deadline)) || break
      if "$bin/tierzero-estimate" --config bench/gpu/8b_under_backward.json --master remainder --moments int8 \
        --grad-accum-dtype bf16 --hidden 4096 --heads 32 --seq 512 --batch 2 --eval-batches 0 --layers "$layers" \
        --nvme-path "$TMPDIR/tz-largest" >"$out/largest_plan.txt" 2>&1; then
        found=$layers
        break
      fi
    done
    [[ -n $found ]] && largest="--layers $found --batch 2"
  fi
  if [[ -z $largest ]] && ((SECONDS >= deadline)); then
    summary+=("$(printf '%-34s not run: past TZ_GPU_DEADLINE_S=%s' train_largest_compact "$deadline")")
  elif [[ -z $largest ]]; then
    summary+=("$(printf '%-34s not run: no layer count fits (largest_plan.txt: the last estimate)' train_largest_compact)")
    failed=1
  fi
  # shellcheck disable=SC2086
  [[ -n $largest ]] && run train_largest_compact 400 "$bin/tierzero-train" --config bench/gpu/8b_under_backward.json --master remainder \
    --moments int8 --grad-accum-dtype bf16 --backend cuda --hidden 4096 --heads 32 --seq 512 $largest --steps 2 \
    --eval-every 0 --log-every 1 --nvme-path "$TMPDIR/tz-largest" --out "$out/train/largest_compact"
  rm -rf "$TMPDIR/tz-largest"
}
if [[ $parts == *" accept "* ]]; then
  for item in ${TZ_GPU_ACCEPT:-3b 8b_compact gpt2 largest 3b_one_micro_batch 8b_fp32}; do
    if ! declare -F "accept_$item" >/dev/null; then
      summary+=("TZ_GPU_ACCEPT: no accept run '$item' (3b 3b_one_micro_batch 3b_auto 8b_compact 8b_fp32 gpt2 largest)")
      failed=1
      continue
    fi
    "accept_$item"
  done
fi

echo
echo "tierzero GPU checks on $(head -2 "$out/gpu.txt" 2>/dev/null | tail -1)"
printf '%s\n' "${summary[@]}" | tee "$out/summary.txt"
exit $failed
