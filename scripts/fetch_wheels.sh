#!/usr/bin/env bash
# What bench/python/deepspeed_compare.py needs beside tierzero, for a machine that reaches
# no package registry (the GPU machine): DeepSpeed's sdist and the pure-Python packages it
# imports that torch's environment lacks, as files, and libaio (DeepSpeed's NVMe op) as
# Debian packages. DeepSpeed is never a tierzero dependency; nothing here touches torch.
#
#   scripts/fetch_wheels.sh [OUT=.gpu/deepspeed]      # here, with network: download into OUT
#   scripts/fetch_wheels.sh --install DIR [PYTHON]    # there, offline: install from DIR
#
# Then carry OUT with the working tree (run's carry: [".gpu"]) and, on the GPU machine:
#   scripts/fetch_wheels.sh --install .gpu/deepspeed /path/to/venv/bin/python
#   python bench/python/deepspeed_compare.py --mode gpu --nvme-path /var/tmp --json gpu.json
# DeepSpeed builds its ops (cpu_adam, async_io) on first use with ninja, the C++ compiler
# and CUDA's nvcc, into ~/.cache/torch_extensions (minutes).
#
# Versions: the ones measured in bench/RESULTS.md ("tierzero against the DeepSpeed package").
set -euo pipefail
DEEPSPEED=deepspeed==0.19.8
PURE=(hjson ninja py-cpuinfo msgpack einops wheel)
DEBS=(libaio1 libaio-dev)

if [[ ${1:-} == --install ]]; then
  dir=${2:?usage: fetch_wheels.sh --install DIR [PYTHON]}
  py=${3:-python3}
  if ls "$dir"/*.deb >/dev/null 2>&1; then
    dpkg -i "$dir"/*.deb
  fi
  "$py" -m pip install --no-index --find-links "$dir" --no-deps "${PURE[@]}"
  # --no-build-isolation: DeepSpeed's setup.py imports torch; build against the torch that is installed.
  DS_BUILD_OPS=0 "$py" -m pip install --no-index --find-links "$dir" --no-deps --no-build-isolation "$DEEPSPEED"
  "$py" -c "import deepspeed, torch; print('deepspeed', deepspeed.__version__, 'beside torch', torch.__version__)"
  exit 0
fi

out=${1:-.gpu/deepspeed}
mkdir -p "$out"
py=${PYTHON:-python3}
"$py" -m pip download --no-deps --no-binary deepspeed -d "$out" "$DEEPSPEED"
"$py" -m pip download --no-deps -d "$out" "${PURE[@]}"
(cd "$out" && apt-get download "${DEBS[@]}")
ls -l "$out"
du -sh "$out"
