#!/usr/bin/env bash
# A short H200 check (for a nearly spent device budget): the CUDA op and model
# tests, then a small bench and a generate on the depth-reduced model.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-gpu-out}"; mkdir -p "$out"
for t in .carry/test-ops_gpu .carry/test-gdn_gpu .carry/test-model_gpu; do
  timeout 120 "$t" --test-threads 1 --nocapture > "$out/$(basename "$t").log" 2>&1
  echo "$(basename "$t"): $(grep -E '^test result|panicked' "$out/$(basename "$t").log" | head -3 | tr '\n' ' ')"
done
grep -h "full4:" "$out"/test-model_gpu.log
timeout 60 .carry/lily bench --device cuda --synthetic full4 --prompt-len 4096 --context 512 --gen 32 --runs 1 2>&1 | tail -5
timeout 30 .carry/lily generate --device cuda --synthetic full4 --prompt hi --max-tokens 16 --seed 1 --temperature 0.7 > "$out/gen.txt" 2>&1; tail -c 300 "$out/gen.txt"
