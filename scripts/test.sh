#!/usr/bin/env bash
# Sets up, builds and runs every test.
#   scripts/test.sh               the normal build (CUDA sources compiled where nvcc exists)
#   scripts/test.sh --sanitize    the same tests under AddressSanitizer + UBSan (CPU build)
# Exits non-zero when any test fails.
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
cmake -S . -B "$build_dir" "${cmake_args[@]}"
cmake --build "$build_dir" -j "$(nproc)"
ctest --test-dir "$build_dir" --output-on-failure --no-tests=error -j "$(nproc)"
