#!/usr/bin/env bash
# The GPU machine's script. Build on the development machine first:
#   tools/gpu_run.sh build [DIR]    -> DIR (default .carry)/bundle.tar.xz: the lily binary and every
#                                      GPU test binary, built from this checkout
#   tools/build_variant.sh REV NAME -> .carry/variants/NAME: another revision's bundle, to compare
# then on the GPU machine (device tool; carry .carry, and .whl for the transformers peer):
#   tools/gpu_run.sh tests          -> every GPU test (--include-ignored)
#   tools/gpu_run.sh accept         -> a change that must keep behaviour and speed: this bundle and
#                                      .carry/old in one run (tests of both, decode at 4k/32k
#                                      interleaved, the logits of both compared); then `e2e`
#   tools/gpu_run.sh prefill        -> prefill at 512..32k with each prompt's last chunk profiled
#                                      (the prefill roofline, tools/roofline.py)
#   tools/gpu_run.sh prefill-accept -> issue 34's Lily figures in one call: every GPU test, prefill at
#                                      512..32k profiled, a 131,072-token prompt, the time to first
#                                      token of a ~24k-token prompt through lily serve, chunks of 8k and
#                                      16k, decode at 4k/32k
#                                      (with .carry/old: its decode in the same run)
#   tools/gpu_run.sh agent          -> an agent's conversation through lily serve (the prompt cache's
#                                      time to first token per turn, a cold reference) and the decode
#                                      speed of each sampling setting (tools/serve_agent.py); then the
#                                      same for each .carry/variants/* and .carry/old carried
#   tools/gpu_run.sh side           -> Lily beside transformers + fla on the same weights, the decode
#                                      roofline at 4k, 131k decode, the full-head rows
#   tools/gpu_run.sh variants       -> decode at 4k/32k of this bundle and every .carry/variants/*, interleaved
#   tools/gpu_run.sh e2e            -> logits against transformers, 4 and 40 layers
#   tools/gpu_run.sh trace          -> one decode step's timeline (lily bench --trace)
#   tools/gpu_run.sh phases         -> that timeline once per phase mark (--trace-mark)
#   tools/gpu_run.sh ncu            -> each decode kernel of one layer cycle alone under Nsight Compute
#   tools/gpu_run.sh fp8            -> the block-FP8 GPU tests, decode and prefill with --quantize fp8
#                                      beside bf16 in the same run, the FP8 decode roofline at 4k
#   tools/gpu_run.sh ncu-prefill    -> each prefill kernel of a 4,096-token chunk (full4) under Nsight
#                                      Compute, one row per kernel (tools/ncu_table.py)
#   tools/gpu_run.sh llamacpp       -> llama.cpp Q4_0 on a random full-size GGUF (carry .peers, see below)
# JSON and logs go to $OUT (or ./gpu-out; the device returns at most 8 files there, so bulky logs stay
# in /tmp/gpu-run); a short summary is printed last.
set -uo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
out="${OUT:-$root/gpu-out}"
logs=/tmp/gpu-run
mkdir -p "$out" "$logs"
mode="${1:-tests}"

summary=()
note() { summary+=("$1"); }

unpack() { # DIR: its bundle.tar.xz unpacked once
  [ -f "$1/bundle.tar.xz" ] && [ ! -x "$1/lily" ] && (cd "$1" && tar -xJf bundle.tar.xz)
  return 0
}

# The transformers peer's fast kernels (tools/peer_wheels.sh makes .whl): fla 0.6 on PYTHONPATH
# before any Python starts, so transformers picks its GDN kernels at import.
if ls "$root"/.whl/*.whl > /dev/null 2>&1 && [ "$mode" != build ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$root"/.whl/*.whl \
    && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi

carry="$root/.carry"
lily="$carry/lily"
[ "$mode" != build ] && unpack "$carry"

gpu_tests() { # BUNDLE TAG: every GPU test binary of the bundle, GPU tests included
  local dir=$1 tag=$2
  for t in "$dir"/test-*; do
    [ -x "$t" ] || continue
    local n; n=$(basename "$t")
    # LILY_TESTS: only these test binaries (names without test-), e.g. "gdn_gpu ops_gpu"
    [ -n "${LILY_TESTS:-}" ] && [[ " $LILY_TESTS " != *" ${n#test-} "* ]] && continue
    if timeout 300 "$t" --include-ignored --test-threads 1 > "$logs/$tag-$n.log" 2>&1; then
      note "$tag $n: $(grep -E '^test result' "$logs/$tag-$n.log" | tail -1)"
    else
      note "$tag $n: FAILED: $(grep -E -A3 'panicked' "$logs/$tag-$n.log" | head -5 | tr '\n' ' ')"
    fi
    { echo "==== $tag $t"; cat "$logs/$tag-$n.log"; } >> "$out/tests.log"
  done
}

decode_rows() { # FILE: a lily bench table's decode rows on one line
  awk 'f && NF {print} / context +gen /{f=1}' "$1" | tr '\n' ' ' | sed 's/  */ /g'
}

tokens_json() { # N FILE: N seeded token ids
  python3 -c "import json,random; random.seed(7); print(json.dumps([random.randrange(248077) for _ in range($1)]))" > "$2"
}

e2e() { # NAME TOKENS DECODE_FROM [ROWS_FROM [BIN]]: Lily's logits against transformers' on the same
  # weights (positions ROWS_FROM.. compared: a long prompt's last rows and the decoded ones)
  local name=$1 n=$2 df=$3 rf=${4:-0} bin=${5:-$lily}
  local exp="/tmp/exp-$name" toks="/tmp/toks-$name-$n.json"
  [ -d "$exp" ] || "$bin" synthetic-export --synthetic "$name" --out "$exp" >> "$logs/e2e-$name.log" 2>&1
  tokens_json "$n" "$toks"
  local ids; ids=$(python3 -c "import json;print(','.join(map(str,json.load(open('$toks')))))")
  if ! "$bin" logits --device cuda --synthetic "$name" --max-seq $((n + 16)) --tokens "$ids" --decode-from "$df" \
      --rows-from "$rf" --out "/tmp/lily-$name-$n.safetensors" >> "$logs/e2e-$name.log" 2>&1; then
    note "e2e $name: lily logits FAILED (see $logs/e2e-$name.log)"; return
  fi
  if PYTHONUNBUFFERED=1 python3 tools/hf_compare.py --export "$exp" --lily "/tmp/lily-$name-$n.safetensors" \
      --tokens-file "$toks" --decode-from "$df" --rows-from "$rf" --json-out "$out/e2e-$name-$n.json" \
      >> "$logs/e2e-$name.log" 2>&1; then
    note "$(python3 -c "
import json; r=json.load(open('$out/e2e-$name-$n.json')); d=r['decode'] or {}
print(f\"e2e $name T=$n rows from $rf: all rel_l2 {r['all']['rel_l2']:.3e} top1 {r['all']['top1']:.3f} tie-aware {r['all']['top1_tie_aware']:.3f} | prefill rel_l2 {r['prefill']['rel_l2']:.3e} | decode rel_l2 {d.get('rel_l2',0):.3e} top1 {d.get('top1',0):.3f}\")")"
  else
    note "e2e $name: hf_compare FAILED (see $logs/e2e-$name.log)"
  fi
}

bench() { # NAME BIN ARGS...: lily bench --json into $out/NAME.json
  local name=$1 bin=$2; shift 2
  if timeout 300 "$bin" bench --device cuda --synthetic full --json "$@" > "$out/$name.json" 2> "$logs/$name.log"; then
    note "$name: $(python3 -c "
import json; r=json.load(open('$out/$name.json'))
p=' '.join(f\"pp{x['prompt_len']} {x['prefill_tok_s']:.0f}\" for x in r['prefill'])
d=' '.join(f\"tg@{x['context']} {x['decode_tok_s']:.2f}\" for x in r['decode'])
print(p, '|', d)")"
  else
    note "$name FAILED: $(tail -3 "$logs/$name.log" | tr '\n' ' ')"
  fi
}

case "$mode" in
build)
  # the bundle: lily and every test binary that holds GPU tests, stripped, in one xz archive (the
  # device's carry is capped at 64 MiB with the tree)
  dst="${2:-$root/.carry}"
  cargo build --release --locked -p lily-cli || exit 1
  mkdir -p "$dst"
  rm -f "$dst"/lily "$dst"/test-* "$dst"/bundle.tar.xz
  cp target/release/lily "$dst/lily"
  for t in $(cargo test --release --locked --workspace --no-run --message-format=json 2>/dev/null |
             python3 -c "import sys,json
for l in sys.stdin:
  m=json.loads(l)
  if m.get('reason')=='compiler-artifact' and m.get('executable') and m['target']['kind']==['test']: print(m['executable'])"); do
    n="$(basename "$t" | sed 's/-[0-9a-f]*$//')"
    case "$n" in *_gpu|kernels_compile) cp "$t" "$dst/test-$n" ;; esac
  done
  strip "$dst"/lily "$dst"/test-*
  (cd "$dst" && tar -cJf bundle.tar.xz lily test-* && rm -f lily test-*)
  ls -la "$dst"
  exit 0
  ;;
tests)
  note "$(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader)"
  gpu_tests "$carry" new
  ;;
accept)
  # Behaviour and speed kept: the old bundle (.carry/old) and this one in one run.
  old="$carry/old"
  unpack "$old"
  note "$(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader)"
  gpu_tests "$carry" new
  gpu_tests "$old" old
  # decode at 4k and 32k, interleaved old/new twice
  for round in 1 2; do
    for v in old new; do
      bin="$lily"; [ "$v" = old ] && bin="$old/lily"
      bench "decode-$v-$round" "$bin" --prompt-len 64 --context 4096,32768 --gen 128 --runs 3
    done
  done
  # the same logits from both builds (4 layers, 1,100 tokens: prefill and decode)
  tokens_json 1100 /tmp/toks-ab.json
  ids=$(python3 -c "import json;print(','.join(map(str,json.load(open('/tmp/toks-ab.json')))))")
  for v in old new; do
    bin="$lily"; [ "$v" = old ] && bin="$old/lily"
    "$bin" logits --device cuda --synthetic full4 --max-seq 1200 --tokens "$ids" --decode-from 1050 \
      --out "/tmp/logits-$v.safetensors" > "$logs/logits-$v.log" 2>&1 || note "logits $v FAILED"
  done
  note "$(python3 - <<'PY'
import json, numpy as np
from safetensors.numpy import load_file
a = load_file('/tmp/logits-old.safetensors')['logits'].astype(np.float64)
b = load_file('/tmp/logits-new.safetensors')['logits'].astype(np.float64)
rel = float(np.linalg.norm(a - b) / np.linalg.norm(a))
same = float((a.argmax(1) == b.argmax(1)).mean())
print(f"logits old vs new (full4, 1,100 tokens, decode from 1,050): bit-identical {bool((a == b).all())}, rel L2 {rel:.3e}, same top-1 {same:.4f}")
PY
)"
  ;;
prefill)
  note "$(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader)"
  bench prefill "$lily" --prompt-len "${LILY_PROMPTS:-512,4096,16384,32768}" --context 64 --gen 16 --runs 2 --profile
  # every variant (tools/build_variant.sh) and an old bundle, if carried, in the same run
  for d in "$carry"/variants/*/; do
    [ -f "$d/bundle.tar.xz" ] || continue
    unpack "$d"
    bench "prefill-$(basename "$d")" "$d/lily" --prompt-len "${LILY_PROMPTS:-512,4096,16384,32768}" --context 64 --gen 16 --runs 2
  done
  if [ -f "$carry/old/bundle.tar.xz" ]; then
    unpack "$carry/old"
    bench prefill-old "$carry/old/lily" --prompt-len "${LILY_PROMPTS:-512,4096,16384,32768}" --context 64 --gen 16 --runs 2
  fi
  [ -s "$out/prefill.json" ] && python3 tools/roofline.py "$out/prefill.json" > "$out/prefill-roofline.md" \
    && note "$(cat "$out/prefill-roofline.md")"
  ;;
prefill-accept)
  note "$(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader)"
  gpu_tests "$carry" new
  bench prefill "$lily" --prompt-len 512,4096,16384,32768 --context 64 --gen 16 --runs 2 --profile
  # (the table from prefill.json again here: tools/roofline.py; $OUT keeps its 8 files for JSON)
  [ -s "$out/prefill.json" ] && note "$(python3 tools/roofline.py "$out/prefill.json")"
  bench prefill-131k "$lily" --max-seq 131200 --prompt-len 131072 --context 64 --gen 4 --runs 1
  # the chunk size: larger chunks read the expert weights fewer times per prompt
  for c in 8192 16384; do
    bench "prefill-chunk$c" "$lily" --prefill-chunk $c --prompt-len 16384,32768 --context 64 --gen 4 --runs 2
  done
  if timeout 400 python3 tools/serve_ttft.py --lily "$lily" --tokens 24000 --out "$out/serve-ttft.json" \
      -- --device cuda --synthetic full --max-seq 32768 > "$logs/serve-ttft.log" 2>&1; then
    note "serve: $(python3 -c "import json; r=json.load(open('$out/serve-ttft.json')); print('prompt tokens', r['prompt_tokens'], 'ttft s', [round(x['ttft_s'], 3) for x in r['runs']])")"
  else
    note "serve ttft FAILED: $(tail -3 "$logs/serve-ttft.log" | tr '\n' ' ')"
  fi
  bench decode "$lily" --prompt-len 64 --context 4096,32768 --gen 128 --runs 3
  if [ -f "$carry/old/bundle.tar.xz" ]; then
    unpack "$carry/old"
    bench decode-old "$carry/old/lily" --prompt-len 64 --context 4096,32768 --gen 128 --runs 3
  fi
  ;;
agent)
  # this bundle, then every .carry/variants/* and .carry/old carried (each agent-NAME.json)
  note "$(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader)"
  runs=("agent:$lily")
  for d in "$carry"/variants/*/ "$carry"/old/; do
    [ -f "$d/bundle.tar.xz" ] && unpack "$d" && runs+=("agent-$(basename "$d"):$d/lily")
  done
  for r in "${runs[@]}"; do
    name=${r%%:*} bin=${r#*:}
    if timeout 300 python3 tools/serve_agent.py --lily "$bin" --out "$out/$name.json" \
        -- --device cuda --synthetic full --max-seq 16384 > "$logs/$name.log" 2>&1; then
      note "$name: $(tail -13 "$logs/$name.log")"
    else
      note "$name FAILED: $(tail -3 "$logs/$name.log" | tr '\n' ' ')"
    fi
  done
  ;;
side)
  # Lily and transformers + fla on the same random weights, in this run
  note "$(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader)"
  bench side-lily "$lily" --prompt-len 512,4096,16384 --context 512,4096,32768 --gen 128 --runs 3
  (cd tools && PYTHONUNBUFFERED=1 timeout 420 python3 hf_bench.py --synthetic full --lily "$lily" --require-fla \
    --prompt-len 512,4096,16384 --context 512,4096 --gen 16 --runs 2 --out "$out/side-hf.json" > "$logs/side-hf.log" 2>&1) \
    || note "hf bench FAILED: $(tail -3 "$logs/side-hf.log" | tr '\n' ' ')"
  note "$(python3 tools/side_by_side.py "$out/side-lily.json" "$out/side-hf.json" 2>&1)"
  # the decode roofline at 4k (the in-graph profile), then decode at 131k and the full bf16 head
  bench profile-4k "$lily" --prompt-len 64 --context 4096 --gen 64 --runs 2 --profile
  bench long "$lily" --prompt-len 64 --context 4096,32768,131072 --fill zeros --gen 128 --runs 3
  bench full-head "$lily" --greedy-head full --prompt-len 64 --context 4096,32768 --gen 128 --runs 3
  ;;
variants)
  # decode of this bundle and of every .carry/variants/* (tools/build_variant.sh), interleaved, twice
  names=(main)
  for d in "$carry"/variants/*/; do [ -f "$d/bundle.tar.xz" ] && unpack "$d" && names+=("$(basename "$d")"); done
  for round in 1 2; do
    for n in "${names[@]}"; do
      bin="$lily"; [ "$n" = main ] || bin="$carry/variants/$n/lily"
      bench "decode-$n-$round" "$bin" --prompt-len 64 --context "${LILY_CONTEXTS:-4096,32768}" --gen 128 --runs 3
    done
  done
  ;;
e2e)
  e2e full4 1100 1050
  e2e full 1100 1050
  # prefill-heavy: 8,000 tokens prefilled (two chunks), 50 decoded; the last 64 prompt rows compared
  e2e full 8050 8000 7936
  # with an old bundle carried, its 40-layer logits on the same tokens against this one's
  if [ -f "$carry/old/bundle.tar.xz" ]; then
    unpack "$carry/old"
    ids=$(python3 -c "import json;print(','.join(map(str,json.load(open('/tmp/toks-full-1100.json')))))")
    "$carry/old/lily" logits --device cuda --synthetic full --max-seq 1116 --tokens "$ids" --decode-from 1050 \
      --out /tmp/lily-full-old.safetensors > "$logs/logits-full-old.log" 2>&1 || note "old full logits FAILED"
    note "$(python3 - <<'PY'
import numpy as np
from safetensors.numpy import load_file
a = load_file('/tmp/lily-full-old.safetensors')['logits'].astype(np.float64)
b = load_file('/tmp/lily-full-1100.safetensors')['logits'].astype(np.float64)
print(f"logits old vs new (full, 40 layers): bit-identical {bool((a == b).all())}, rel L2 {float(np.linalg.norm(a - b) / np.linalg.norm(a)):.3e}, same top-1 {float((a.argmax(1) == b.argmax(1)).mean()):.4f}")
PY
)"
  fi
  ;;
trace)
  # one decode step's timeline (the trace build of the kernels; its tok/s are not speed figures)
  timeout 300 "$lily" bench --device cuda --synthetic full --prompt-len 64 --context "${LILY_CONTEXTS:-4096,32768}" \
      --gen 64 --runs 2 --trace "$out/trace" > "$logs/trace.txt" 2>&1 \
    && note "$(python3 tools/trace_step.py "$out"/trace/trace-*.csv 2>&1)" \
    || note "trace FAILED: $(tail -3 "$logs/trace.txt")"
  ;;
phases)
  # the trace once per phase mark (gdn.cu 1-6, moe.cu router 11, gate/up 21-22), at 4,096
  for m in ${LILY_MARKS:-1 2 3 4 5 6 11 21 22}; do
    rm -rf /tmp/phase-trace
    timeout 120 "$lily" bench --device cuda --synthetic full --prompt-len 64 --context 4096 --gen 64 --runs 2 \
        --trace /tmp/phase-trace --trace-mark "$m" > "$logs/phase-$m.txt" 2>&1 \
      && note "mark $m: $(python3 tools/trace_step.py /tmp/phase-trace/trace-4096.csv | awk '/^phase mark/{f=1; next} f && !/^kernel/' | tr '\n' ' ')" \
      || note "mark $m FAILED: $(tail -2 "$logs/phase-$m.txt")"
  done
  ;;
ncu)
  # Each decode kernel of one layer cycle (3 GDN layers and an attention layer) alone under Nsight
  # Compute, launched eagerly (ncu serialises kernels: no PDL overlap), on full4 (the released
  # sizes, 4 layers: ncu saves and restores device memory between replay passes, too slow at 40).
  # LILY_NCU_SKIP: matching launches skipped (50 = two steps); LILY_NCU_COUNT: profiled (25 = one step).
  ncu_bin=$(command -v ncu || ls /usr/local/cuda/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
  kernels='gemv3_kernel|gdn_decode_kernel|gemv_add_kernel|router_decode_kernel|moe_gate_up_kernel|moe_down_norm_kernel|attention_decode_partial_kernel|attention_decode_merge_kernel'
  if [ -z "$ncu_bin" ]; then
    note "ncu: not found"
  elif timeout 300 "$ncu_bin" --kernel-name "regex:^($kernels)\$" --launch-skip "${LILY_NCU_SKIP:-50}" \
      --launch-count "${LILY_NCU_COUNT:-25}" --cache-control none --clock-control none \
      --section SpeedOfLight --section LaunchStats --section Occupancy --section WarpStateStats \
      --metrics gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum --csv --page details \
      "$lily" bench --device cuda --synthetic full4 --eager --prompt-len 64 --context 4096 --gen 8 --runs 1 \
      > "$out/ncu.csv" 2> "$logs/ncu.log"; then
    note "ncu: $out/ncu.csv"
  else
    note "ncu FAILED: $(tail -5 "$logs/ncu.log" | tr '\n' ' ')"
  fi
  ;;
fp8)
  # block FP8 (issue 36): the FP8 GPU tests, then decode and prefill of the synthetic model quantized
  # at load (--quantize fp8, the releases' layout) beside the same model in bf16, in one run
  note "$(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader)"
  LILY_TESTS="${LILY_TESTS:-ops_gpu model_gpu}" gpu_tests "$carry" new
  bench fp8 "$lily" --quantize fp8 --prompt-len 512,4096 --context 4096,32768 --gen 128 --runs 3
  bench bf16 "$lily" --prompt-len 512,4096 --context 4096,32768 --gen 128 --runs 3
  bench fp8-profile "$lily" --quantize fp8 --prompt-len 64 --context 4096 --gen 64 --runs 2 --profile
  [ -s "$out/fp8-profile.json" ] && note "$(python3 tools/roofline.py "$out/fp8-profile.json" 2>&1 | tail -20)"
  ;;
ncu-prefill)
  # Each prefill kernel of one 4,096-token chunk on full4 (3 GDN layers and an attention layer, the
  # released sizes) under Nsight Compute: time, throughput and occupancy per launch (the roofline's
  # groups split into their kernels; cuBLAS GEMMs are left out, their groups run near peak).
  ncu_bin=$(command -v ncu || ls /usr/local/cuda/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
  kernels='conv_silu_kernel|gdn_chunk_prep_kernel|gdn_chunk_scan_kernel|gated_rmsnorm_kernel|add_rmsnorm_kernel|attention_prefill_kernel|qk_prep_kernel|router_topk_kernel|moe_count_kernel|moe_assign_kernel|moe_tiles_kernel|moe_gate_up_grouped_kernel|moe_down_grouped_kernel|moe_combine_kernel'
  # (the bench's 64-token warm-up prefill makes the first 59 matching launches)
  if [ -z "$ncu_bin" ]; then
    note "ncu: not found"
  elif timeout 400 "$ncu_bin" --kernel-name "regex:^($kernels)\$" --launch-skip 59 --launch-count "${LILY_NCU_COUNT:-70}" \
      --cache-control all --clock-control base \
      --section SpeedOfLight --section LaunchStats --section Occupancy \
      --metrics gpu__time_duration.sum,dram__bytes_read.sum,sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active \
      --csv --page details \
      "$lily" bench --device cuda --synthetic full4 --prompt-len 4096 --context 4096 --gen 2 --runs 1 \
      > "$out/ncu-prefill.csv" 2> "$logs/ncu-prefill.log"; then
    note "ncu-prefill: $(python3 tools/ncu_table.py "$out/ncu-prefill.csv" 2>&1)"
  else
    note "ncu-prefill FAILED: $(tail -5 "$logs/ncu-prefill.log" | tr '\n' ' ')"
  fi
  ;;
llamacpp)
  # ../shared/peers/llamacpp copied to .peers/llamacpp with its .anchors (get_sources.sh); carry .peers
  if [ -x "$root/.peers/llamacpp/run_on_gpu.sh" ]; then
    ANCHORS="$root/.peers/.anchors" BENCH_EXTRA="${BENCH_EXTRA:--ub 2048}" bash "$root/.peers/llamacpp/run_on_gpu.sh" \
      > "$logs/llamacpp.log" 2>&1 && note "llama.cpp: $(tail -8 "$logs/llamacpp.log" | tr '\n' ' ')" \
      || note "llama.cpp FAILED: $(tail -5 "$logs/llamacpp.log" | tr '\n' ' ')"
  else
    note "llama.cpp: .peers/llamacpp not carried"
  fi
  ;;
*)
  echo "unknown mode $mode" >&2
  exit 2
  ;;
esac
echo
echo "==== summary ($mode) ===="
printf '%s\n' "${summary[@]}"
