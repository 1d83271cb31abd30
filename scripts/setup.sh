#!/usr/bin/env bash
# Installs everything tierzero needs to build and test on a fresh Debian 12
# machine: compilers and CMake, then the libraries (all Debian packages).
# CUDA is not a Debian package: the build uses /usr/local/cuda when nvcc is
# there and builds CPU-only otherwise.
set -euo pipefail

packages=(
  build-essential cmake ninja-build pkg-config ccache git
  liburing-dev          # io_uring
  libtbb-dev            # oneTBB: CPU optimizer threads
  libxsimd-dev          # xsimd: SIMD dispatch
  libhwloc-dev          # NUMA topology, memory binding
  nlohmann-json3-dev    # configuration JSON
  libspdlog-dev libfmt-dev   # logging, formatting
  libcli11-dev          # command-line parsing for the tools
  libxxhash-dev         # checksums for NVMe extents
  libgloo-dev           # Gloo: CPU collectives between ranks
  libopenmpi-dev openmpi-bin  # MPI: how mpirun's ranks meet across machines
  zlib1g-dev            # tierzero-train's loss-curve PNG
  libgtest-dev libgmock-dev  # tests
  fio                   # the peer our NVMe benchmark compares against
  python3 python3-pip
)

missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done

if ((${#missing[@]})); then
  sudo=""
  if [ "$(id -u)" -ne 0 ]; then sudo="sudo"; fi
  echo "setup: installing ${missing[*]}"
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
else
  echo "setup: all packages present"
fi

# Python packages: safetensors and numpy read what tierzero writes; the
# Python package (bindings/, issue #7) builds with scikit-build-core and
# nanobind and is tested with pytest against torch (CPU wheels are fine) and
# transformers (a GPT-2-shaped model built from a config, no download) with
# accelerate, which its Trainer needs (tests/python/test_hf.py).
# Where the interpreter is Debian's own (PEP 668), pip needs
# --break-system-packages; elsewhere (pyenv, a venv) plain pip is fine.
python_packages=(safetensors numpy scikit-build-core nanobind pytest torch transformers accelerate)
if ! python3 -c "import safetensors, numpy, scikit_build_core, nanobind, pytest, torch, transformers, accelerate" \
    2>/dev/null; then
  echo "setup: pip installing ${python_packages[*]}"
  python3 -m pip install --quiet "${python_packages[@]}" 2>/dev/null ||
    python3 -m pip install --quiet --break-system-packages "${python_packages[@]}"
fi
