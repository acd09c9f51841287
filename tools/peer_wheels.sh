#!/usr/bin/env bash
# Re-creates .whl/ (git-ignored) from scratch: the pure-Python wheels that give
# transformers its fast GDN kernels on the GPU machine, which has no internet
# (tools/hf_bench.py's peer; issue 33 item 7).
#
#   fla-core 0.6.0 + flash-linear-attention 0.6.0 (Triton kernels; both
#   py3-none-any; they need einops, torch>=2.7, triton>=3.3 and
#   5.6.2<=transformers<6, all already on the GPU image: torch 2.11.0+cu130,
#   triton 3.6.0, transformers 5.17.0, Python 3.12). Nothing else is carried,
#   so nothing shadows the machine's torch / triton / transformers.
#   causal-conv1d is not carried: PyPI has only its sdist (it needs nvcc and a
#   CUDA build); transformers then uses F.conv1d for the short convolution.
#
# Usage (on a dev machine with pip and PyPI):  tools/peer_wheels.sh
# Then carry `.whl` in the device call and start its command with the line
# this script prints.
set -euo pipefail
cd "$(dirname "$0")/.."

rm -rf .whl
mkdir .whl
req=$(mktemp)
trap 'rm -f "$req"' EXIT
cat > "$req" <<'EOF'
fla-core==0.6.0 --hash=sha256:b0708b70e0b119cd58a0a5146ea56cb175cef6ed969d8ac60267e3e077ce3ebd
flash-linear-attention==0.6.0 --hash=sha256:6dec9735f8454523c13553622e98aff30152dde6586b4ac7d88010fbb7a06b5f
EOF
# the GPU machine's Python (3.12, CPython, x86-64 manylinux); pure-Python
# wheels match any of these tags, the platform list only keeps pip from
# picking a binary for this machine instead
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 \
  -d .whl -r "$req"

ls -l .whl
echo "total: $(du -sh .whl | cut -f1)"
echo
echo "On the GPU machine (carry: .whl), start the command with:"
echo 'python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site || exit;'
