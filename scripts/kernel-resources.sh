#!/usr/bin/env bash
# Registers, stack frame and spills of every kernel, without a GPU: NVRTC and ptxas from
# NVIDIA's pip wheels (CUDA 12.9), in a virtual environment cached outside the project
# (SSD_CUDA_TOOLS, default ${XDG_CACHE_HOME:-~/.cache}/ssd-cuda-tools), then
# gpu/examples/kernel_resources.rs, which compiles the kernels as the crate does.
#   bash scripts/kernel-resources.sh [TARGET] [FILTER]     e.g.  sm_90a compute_out_pair
# The counts agreed with what the H200's driver reported for the output kernels (docs/gpu.md).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
tools=${SSD_CUDA_TOOLS:-${XDG_CACHE_HOME:-$HOME/.cache}/ssd-cuda-tools}
venv="$tools/venv"
site() { "$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])'; }
if [ ! -x "$venv/bin/python" ] || [ ! -x "$(site)/nvidia/cuda_nvcc/bin/ptxas" ] ||
  [ ! -d "$(site)/nvidia/cuda_nvrtc/lib" ]; then
  echo "fetching NVRTC and ptxas (pip, about 110 MB) into $tools" >&2
  python3 -m venv "$venv"
  "$venv/bin/pip" install -q --disable-pip-version-check \
    nvidia-cuda-nvrtc-cu12==12.9.86 nvidia-cuda-nvcc-cu12==12.9.86
fi
lib="$(site)/nvidia/cuda_nvrtc/lib"
cd "$root"
LD_LIBRARY_PATH="$lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" PTXAS="$(site)/nvidia/cuda_nvcc/bin/ptxas" \
  cargo run --release -q -p ssd-gpu --example kernel_resources -- "$@"
