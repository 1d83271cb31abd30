#!/usr/bin/env bash
# Packs what a GPU machine needs to run tierzero's CUDA tests and GPU
# benchmarks without building there: stripped test binaries and tools from a
# CUDA build, the shared libraries they load that a bare CUDA image lacks
# (liburing, oneTBB, hwloc, Gloo, spdlog, fmt and theirs; not libc, libstdc++,
# CUDA's or NCCL's, which the GPU machine has), and the Python wheels under
# OUT/wheel if present. scripts/gpu_checks.sh runs them there.
#
#   scripts/gpu_bundle.sh [BUILD_DIR=build] [OUT=.gpu]
set -euo pipefail
build=${1:-build}
out=${2:-.gpu}
mkdir -p "$out/bin" "$out/lib"
rm -f "$out"/bin/* "$out"/lib/*
bins=(tests/tierzero_kernels_tests tests/tierzero_offload_tests tests/tierzero_comm_tests tests/tierzero_engine_tests tests/tierzero_train_tests
      tests/tierzero_common_tests train/tierzero-train bench/tierzero-overlap-bench bench/tierzero-tiers
      bench/tierzero-nvme-bench common/tierzero-info train/tierzero-estimate)
for b in "${bins[@]}"; do
  [[ -x "$build/$b" ]] || { echo "gpu_bundle: $build/$b is missing (build it first)" >&2; exit 1; }
  strip -o "$out/bin/$(basename "$b")" "$build/$b"
done
skip='/(libc|libm|libstdc\+\+|libgcc_s|ld-linux-x86-64|libpthread|libdl|librt|libcuda|libnccl|libcublas|libcublasLt|libcudart)\.so'
for b in "$out"/bin/*; do
  ldd "$b" | awk '/=> \// {print $3}'
done | sort -u | grep -v -E "$skip" | while read -r lib; do cp -L "$lib" "$out/lib/"; done
du -sh "$out"
