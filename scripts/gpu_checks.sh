#!/usr/bin/env bash
# On a GPU machine: runs every CUDA test and GPU benchmark tierzero has, from
# the bundle scripts/gpu_bundle.sh made (.gpu/: binaries, libraries, wheel),
# so nothing is built there. Logs and JSON go to OUT_DIR; a summary table is
# printed last. Exits non-zero when a test fails.
#
#   scripts/gpu_checks.sh OUT_DIR [PART...]     PART: info tests python bench train (default: all)
#   TZ_GPU_TRAIN_ARGS="ARGS|ARGS..." adds tierzero-train runs to the train part (see train/README.md)
#   TZ_GPU_OVERLAP="nvme cpu gpu" the overlap bench placements; TZ_GPU_PY_BENCH=0 skips the GPT-2 Python bench
set -uo pipefail
out=${1:?usage: gpu_checks.sh OUT_DIR [PART...]}
shift
parts=" ${*:-info tests python bench train} "
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

# run NAME TIMEOUT_S COMMAND...: logs to OUT_DIR/NAME.log, one summary line.
run() {
  local name=$1 limit=$2
  shift 2
  local start=$SECONDS
  timeout "$limit" "$@" >"$out/$name.log" 2>&1
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
  run train_cuda_tests 500 "$bin/tierzero_train_tests" --gtest_filter='*Cuda*'
fi

if [[ $parts == *" python "* ]]; then
  if ls "$root"/.gpu/wheel/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/tz-site "$root"/.gpu/wheel/*.whl \
      >"$out/pip.log" 2>&1
    PYTHONPATH=/tmp/tz-site TIERZERO_NVME_BENCH=$bin/tierzero-nvme-bench run python_tests 400 python3 -m pytest -q -rs \
      -p no:cacheprovider "$root/tests/python"
    # The GPU tests again, with their printed figures.
    PYTHONPATH=/tmp/tz-site run python_cuda_tests 200 python3 -m pytest -q -s -p no:cacheprovider -k "cuda or gpu or cupy" \
      "$root/tests/python"
  else
    summary+=("python_tests: no wheel in .gpu/wheel")
  fi
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
  if [[ -d /tmp/tz-site && ${TZ_GPU_PY_BENCH:-1} != 0 ]]; then
    PYTHONPATH=/tmp/tz-site run gpt2_python_bench 400 python3 "$root/bench/python/gpt2_gpu_bench.py" \
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

echo
echo "tierzero GPU checks on $(head -2 "$out/gpu.txt" 2>/dev/null | tail -1)"
printf '%s\n' "${summary[@]}" | tee "$out/summary.txt"
exit $failed
