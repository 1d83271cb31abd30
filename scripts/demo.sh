#!/usr/bin/env bash
# Sets up, builds, and runs tierzero's main job. Until the trainer lands
# (issue #6) that is the tier demo: plan a model's placement across GPU, CPU
# and NVMe, then move its blocks through the device and pinned-memory tiers and
# report throughput and pool use. Extra arguments go to tierzero-tiers.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo
cmake --build build -j "$(nproc)" --target tierzero-tiers
mkdir -p /var/tmp/tierzero-nvme
build/bench/tierzero-tiers --config examples/zero_infinity.json "$@"
