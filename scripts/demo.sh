#!/usr/bin/env bash
# Sets up, builds, and runs tierzero's main job. Until the GPT trainer lands
# (issue #6) that is:
#  1. the tier demo: plan a model's placement across GPU, CPU and NVMe, then
#     move its blocks through the device and pinned-memory tiers and report
#     throughput and pool use (extra arguments go to tierzero-tiers);
#  2. the engine training an MLP (8 layers of 2048 x 2048) with its 16-bit
#     parameters, master weights and Adam moments on NVMe, prefetching behind
#     a simulated compute time, with a Chrome trace of the last step.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo
cmake --build build -j "$(nproc)" --target tierzero-tiers tierzero-overlap-bench
mkdir -p /var/tmp/tierzero-nvme
build/bench/tierzero-tiers --config examples/zero_infinity.json "$@"
echo
build/bench/tierzero-overlap-bench --layers 8 --hidden 2048 --batch 2 --compute-ms 10 --placement nvme \
  --nvme-path /var/tmp/tierzero-nvme --steps 5 --trace /var/tmp/tierzero-nvme/step-trace.json
