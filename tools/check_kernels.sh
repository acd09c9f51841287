#!/usr/bin/env bash
# Compile every CUDA kernel for sm_90a with nvcc, on a machine with no GPU and
# no CUDA toolkit: nvcc comes from NVIDIA's PyPI wheels (pinned to the H200's
# CUDA 13.0) in a venv. A kernel that does not compile fails here, not on the GPU.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
venv="${LILY_NVCC_VENV:-$HOME/.cache/lily-nvcc-venv}"
nvcc="$venv/lib/python3.11/site-packages/nvidia/cu13/bin/nvcc"
if [ ! -x "$nvcc" ]; then
  nvcc=$(find "$venv" -path '*nvidia/cu13/bin/nvcc' -type f 2>/dev/null | head -1 || true)
fi
if [ -z "${nvcc:-}" ] || [ ! -x "$nvcc" ]; then
  python3 -m venv "$venv"
  "$venv/bin/pip" install -q nvidia-cuda-nvcc==13.0.88 nvidia-nvvm==13.0.88 nvidia-cuda-crt==13.0.88 \
    nvidia-cuda-runtime==13.0.96 nvidia-cuda-cccl==13.0.85
  nvcc=$(find "$venv" -path '*nvidia/cu13/bin/nvcc' -type f | head -1)
fi
out=$(mktemp -d)
n=0
for f in "$root"/crates/lily-cuda/src/kernels/*.cu; do
  "$nvcc" -cubin -gencode=arch=compute_90a,code=sm_90a -O3 -Xptxas -v -I "$root/crates/lily-cuda/src/kernels" \
    -o "$out/$(basename "$f" .cu).cubin" "$f" 2> "$out/$(basename "$f").log" || { cat "$out/$(basename "$f").log"; echo "FAILED: $f"; exit 1; }
  grep -E "spill|Used" "$out/$(basename "$f").log" | sed "s|^|  $(basename "$f"): |" | grep -v " 0 bytes spill" || true
  n=$((n+1))
done
echo "compiled $n kernel files for sm_90a"
