#!/usr/bin/env bash
# Sets up, builds and runs every test.
#   scripts/test.sh               the normal build (CUDA sources compiled where nvcc exists)
#   scripts/test.sh --sanitize    the same tests under AddressSanitizer + UBSan (CPU build)
# Then (not with --sanitize) installs the Python package into python3 and
# runs its tests (tests/python, pytest). Exits non-zero when any test fails.
set -euo pipefail
cd "$(dirname "$0")/.."

build_dir=build
cmake_args=(-G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo)
if [[ "${1:-}" == "--sanitize" ]]; then
  build_dir=build-asan
  # CUDA sources are compiled and linked by the normal build; the sanitizer
  # build checks the host code the CI machine can run.
  cmake_args=(-G Ninja -DCMAKE_BUILD_TYPE=Debug -DTIERZERO_SANITIZE=ON -DTIERZERO_CUDA=OFF)
  export ASAN_OPTIONS=detect_leaks=1:abort_on_error=1:strict_string_checks=1
  export UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1
fi

scripts/setup.sh
# ccache keys without the working directory, so the wheel build below (its
# own build directory) reuses the objects of this one.
export CCACHE_NOHASHDIR=true
cmake -S . -B "$build_dir" "${cmake_args[@]}"
cmake --build "$build_dir" -j "$(nproc)"
ctest --test-dir "$build_dir" --output-on-failure --no-tests=error -j "$(nproc)"

if [[ "${1:-}" == "--sanitize" ]]; then
  # The extension would have to be loaded into an uninstrumented python3 with
  # the ASan runtime preloaded; the C++ under it is what the tests above ran.
  echo "test.sh --sanitize: skipping the Python package (tests/python run in the normal build)"
  exit 0
fi
# The Python package: `pip install .` as a user would, except without build
# isolation (setup.sh installed scikit-build-core and nanobind) so the build
# directory (build-wheel/) and ccache carry over from run to run.
echo "::: python package (pip install ., pytest tests/python)"
pip_install=(python3 -m pip install --quiet --no-build-isolation .)
if ! pip_log=$("${pip_install[@]}" 2>&1); then
  if grep -q externally-managed-environment <<<"$pip_log"; then
    "${pip_install[@]}" --break-system-packages
  else
    echo "$pip_log"
    exit 1
  fi
fi
# The benchmark binding runs the program this build made (tierzero.nvme.benchmark).
export TIERZERO_NVME_BENCH="$PWD/$build_dir/bench/tierzero-nvme-bench"
# From a directory outside the tree: the installed package is what is tested.
(cd "$build_dir" && python3 -m pytest "$OLDPWD/tests/python" -q -rs)  # -rs: print why a test skipped (GPU ones)
