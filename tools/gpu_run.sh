#!/usr/bin/env bash
# The H200 session script. Build on the development machine first:
#   tools/gpu_run.sh build           -> .carry/ (lily binary + CUDA test binaries)
# then on the GPU machine (device tool, carry .carry):
#   tools/gpu_run.sh check           -> kernel tests, full4 vs CPU and vs transformers, quick bench
#   tools/gpu_run.sh full            -> lily bench (issue sizes) and full 40-layer logits vs transformers
#   tools/gpu_run.sh peer            -> transformers' own prefill/decode speed on the same weights
#   tools/gpu_run.sh ncu             -> each decode kernel of one layer cycle alone under Nsight Compute
#   tools/gpu_run.sh trace           -> one decode step's timeline (LILY_TRACE build of the kernels)
#   tools/gpu_run.sh phases          -> that timeline once per phase mark (TRACE_MARK): phases inside kernels
#   tools/gpu_run.sh final           -> issue 6 in one call (tests, roofline, side by side, 4k/32k/131k)
#   tools/gpu_run.sh h200            -> final on an H200; else LILY_ELSE's mode, or exit 3
# Logs and JSON go to $OUT (or ./gpu-out); a short table is printed last.
set -uo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
out="${OUT:-$root/gpu-out}"
mkdir -p "$out"
# LILY_CARRY: another unpacked build (e.g. .carry/safe, a second bundle carried alongside)
carry="${LILY_CARRY:-$root/.carry}"
lily="$carry/lily"
mode="${1:-check}"

summary=()
note() { summary+=("$1"); }

tokens_json() { # N -> file with N seeded token ids
  python3 -c "import json,random; random.seed(7); print(json.dumps([random.randrange(248077) for _ in range($1)]))" > "$2"
}

gpu_tests() { # every carried GPU test binary (LILY_TEST_BINS: a subset, e.g. "ops model"); logs in /tmp and $out/tests.log
  local bins=()
  if [ -n "${LILY_TEST_BINS:-}" ]; then
    for b in $LILY_TEST_BINS; do bins+=("$carry/test-${b}_gpu"); done
  else
    bins=("$carry"/test-*)
  fi
  for t in "${bins[@]}"; do
    timeout 200 "$t" --test-threads 1 > "/tmp/$(basename "$t").log" 2>&1 \
      && note "$(basename "$t"): $(grep -E '^test result' "/tmp/$(basename "$t").log" | tail -1)" \
      || note "$(basename "$t"): FAILED: $(grep -E -A3 'panicked' "/tmp/$(basename "$t").log" | head -5 | tr '\n' ' ')"
    { echo "==== $t"; cat "/tmp/$(basename "$t").log"; } >> "$out/tests.log"
  done
}

decode_rows() { # FILE: a lily bench output's decode rows (every context) on one line
  awk 'f && NF {print} / context +gen /{f=1}' "$1" | tr '\n' ' ' | sed 's/  */ /g'
}

unpack() { # DIR: its bundle.tar.xz unpacked once
  [ -f "$1/bundle.tar.xz" ] && [ ! -x "$1/lily" ] && (cd "$1" && tar -xJf bundle.tar.xz)
  return 0
}

e2e() { # NAME TOKENS DECODE_FROM [extra hf_compare args]
  local name=$1 n=$2 df=$3 extra=${4:-}
  local exp="/tmp/exp-$name" toks="/tmp/toks-$name.json"
  "$lily" synthetic-export --synthetic "$name" --out "$exp" >> "$out/e2e-$name.log" 2>&1
  tokens_json "$n" "$toks"
  local ids; ids=$(python3 -c "import json;print(','.join(map(str,json.load(open('$toks')))))")
  local t0=$(date +%s)
  if ! "$lily" logits --device cuda --synthetic "$name" --max-seq $((n + 16)) --tokens "$ids" --decode-from "$df" \
      --out "/tmp/lily-$name.safetensors" >> "$out/e2e-$name.log" 2>&1; then
    note "e2e $name: lily logits FAILED (see e2e-$name.log)"; return
  fi
  local t1=$(date +%s)
  if PYTHONUNBUFFERED=1 python3 tools/hf_compare.py --export "$exp" --lily "/tmp/lily-$name.safetensors" \
      --tokens-file "$toks" --decode-from "$df" $extra --json-out "$out/e2e-$name.json" >> "$out/e2e-$name.log" 2>&1; then
    note "$(python3 -c "
import json; r=json.load(open('$out/e2e-$name.json'))
d=r['decode'] or {}
f=r.get('hf_bf16_vs_hf_f32'); g=r.get('lily_vs_hf_f32')
extra=f\" | floor hf-bf16 vs hf-f32: rel_l2 {f['rel_l2']:.3e} top1 {f['top1']:.3f}; lily vs hf-f32: rel_l2 {g['rel_l2']:.3e} top1 {g['top1']:.3f}\" if f else ''
f=r.get('hf_eager_vs_hf_sdpa'); g=r.get('lily_vs_hf_sdpa')
extra+=f\" | hf-eager vs hf-sdpa: rel_l2 {f['rel_l2']:.3e} top1 {f['top1']:.3f}; lily vs hf-sdpa: rel_l2 {g['rel_l2']:.3e} top1 {g['top1']:.3f}\" if f else ''
print(f\"e2e $name T=$n: all rel_l2 {r['all']['rel_l2']:.3e} top1 {r['all']['top1']:.3f} tie-aware {r['all']['top1_tie_aware']:.3f} (lily bf16 {r['all']['top1_lily_bf16']:.3f}, hf ties {r['all']['ref_tied_rows']}) | prefill rel_l2 {r['prefill']['rel_l2']:.3e} top1 {r['prefill']['top1']:.3f} | decode rel_l2 {d.get('rel_l2',0):.3e} top1 {d.get('top1',0):.3f} | lily $((t1 - t0))s{extra}\")")"
  else
    note "e2e $name: hf_compare FAILED (see e2e-$name.log)"
  fi
  rm -f "/tmp/lily-$name.safetensors"
}

unpack "$carry"

case "$mode" in
h200)
  # issue 6's draw: `final` when this machine is an H200, else the mode named
  # by LILY_ELSE (e.g. envs, with its own variables), else nothing (exit 3:
  # give the machine back at once). Calls that ask for an H200 mostly get an
  # H100 (sessions 13-23).
  gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
  echo "GPU: $gpu"
  if echo "$gpu" | grep -q H200; then exec "$0" final; fi
  [ -n "${LILY_ELSE:-}" ] && exec "$0" "$LILY_ELSE"
  exit 3
  ;;
build)
  cargo build --release -p lily-cli
  mkdir -p .carry
  cp target/release/lily .carry/lily
  rm -f .carry/test-*
  for t in $(cargo test --release -p lily-cuda -p lily-cli --no-run --message-format=json 2>/dev/null |
             python3 -c "import sys,json
for l in sys.stdin:
  m=json.loads(l)
  if m.get('reason')=='compiler-artifact' and m.get('executable') and m['target']['kind']!=['bin']: print(m['executable'])"); do
    n="$(basename "$t" | sed 's/-[0-9a-f]*$//')"
    case "$n" in *_gpu|kernels_compile) cp "$t" ".carry/test-$n" ;; esac
  done
  # the device's carry is capped at 64 MiB with the tree: ship one xz archive
  strip .carry/lily .carry/test-*
  (cd .carry && tar -cJf bundle.tar.xz lily test-* && rm -f lily test-*)
  ls -la .carry
  exit 0
  ;;
check|decode)
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/gpu.txt"
  for t in "$carry"/test-*; do
    if timeout 300 "$t" --test-threads 1 --nocapture > "$out/$(basename "$t").log" 2>&1; then
      note "$(basename "$t"): $(grep -E '^test result' "$out/$(basename "$t").log" | tail -1)"
    else
      note "$(basename "$t"): FAILED: $(grep -E 'panicked|FAILED' "$out/$(basename "$t").log" | head -3 | tr '\n' ' ')"
    fi
  done
  grep -h "full4:" "$out"/test-*.log | head -2 | while read -r l; do note "$l"; done
  if [ "$mode" = decode ]; then
    # decode speed of the released geometry, with the per-kernel-group profile
    timeout 420 "$lily" bench --device cuda --synthetic full --prompt-len 512 --context 512,4096,32768 --gen 128 --runs 3 --profile \
      > "$out/bench-decode.txt" 2> "$out/bench-decode.log" && note "$(cat "$out/bench-decode.txt")" || note "bench decode FAILED: $(tail -3 "$out/bench-decode.log")"
    e2e full4 1100 1050 "--hf-f32 --hf-sdpa"
    LILY_CUDA_GRAPH=0 timeout 120 "$lily" bench --device cuda --synthetic full --prompt-len 512 --context 4096 --gen 64 --runs 2 \
      > "$out/bench-nograph.txt" 2>&1 && note "without the CUDA graph: $(tail -1 "$out/bench-nograph.txt")" || note "bench nograph FAILED"
    echo; echo "==== summary ($mode) ===="; printf '%s\n' "${summary[@]}"; exit 0
  fi
  e2e full4 1100 1050 --hf-f32
  "$lily" bench --device cuda --synthetic full4 --prompt-len 512,4096 --context 512 --gen 32 --runs 2 > "$out/bench-full4.txt" 2>&1 \
    && note "bench full4: $(tr '\n' ' ' < "$out/bench-full4.txt" | sed 's/  */ /g' | cut -c1-400)" || note "bench full4 FAILED"
  ;;
full)
  "$lily" bench --device cuda --synthetic full --runs 3 --json > "$out/bench-full.json" 2> "$out/bench-full.log" \
    && note "bench full: $(cat "$out/bench-full.json")" || note "bench full FAILED: $(tail -3 "$out/bench-full.log")"
  e2e full 1100 1050
  ;;
floor)
  e2e full4 1100 1050 "--hf-f32 --hf-sdpa"
  e2e full 1100 1050 "--hf-sdpa"
  ;;
final)
  # issue 6 in one call: the engine's GPU test, the decode profile at 4k (the
  # roofline table), Lily and transformers side by side, decode at 4k / 32k /
  # 131k, each with the screened greedy lm_head (default) and the full one
  # (the device returns at most 8 files: results go to $out, logs to /tmp/final)
  mkdir -p /tmp/final
  note "$(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader)"
  for t in "$carry"/test-generate_gpu; do
    timeout 200 "$t" --test-threads 1 > "/tmp/final/$(basename "$t").log" 2>&1 \
      && note "$(basename "$t"): $(grep -E '^test result' "/tmp/final/$(basename "$t").log" | tail -1)" \
      || note "$(basename "$t"): FAILED: $(grep -E -A2 'panicked' "/tmp/final/$(basename "$t").log" | head -4 | tr '\n' ' ')"
  done
  timeout 120 "$lily" bench --device cuda --synthetic full --prompt-len 64 --context 4096 --gen 64 --runs 2 --profile \
    > "$out/bench-profile.txt" 2> "/tmp/final/bench-profile.log" && note "$(cat "$out/bench-profile.txt")" || note "profile FAILED: $(tail -3 "/tmp/final/bench-profile.log")"
  timeout 200 "$lily" bench --device cuda --synthetic full --prompt-len 512,4096 --context 512,4096,32768 --gen 128 --runs 3 --json \
    > "$out/side-lily.json" 2> "/tmp/final/side-lily.log" || note "lily bench FAILED: $(tail -3 "/tmp/final/side-lily.log")"
  (cd tools && PYTHONUNBUFFERED=1 timeout 240 python3 hf_bench.py --synthetic full --lily "$lily" --prompt-len 512,4096 \
    --context 512,4096 --gen 16 --runs 1 --out "$out/side-hf.json" > "/tmp/final/side-hf.log" 2>&1) || note "hf bench FAILED: $(tail -3 "/tmp/final/side-hf.log")"
  note "$(python3 tools/side_by_side.py "$out/side-lily.json" "$out/side-hf.json" 2>&1)"
  # the same decode with the full bf16 lm_head in greedy steps (the default
  # screens it through its int8 copy: same ids), so both figures are on record
  LILY_HEAD_SCREEN=0 timeout 150 "$lily" bench --device cuda --synthetic full --prompt-len 512 --context 512,4096,32768 --gen 128 --runs 3 \
    > "$out/side-lily-full-head.txt" 2> "/tmp/final/side-lily-full-head.log" \
    && note "LILY_HEAD_SCREEN=0: $(decode_rows "$out/side-lily-full-head.txt")" || note "lily bench (full head) FAILED: $(tail -3 "/tmp/final/side-lily-full-head.log")"
  # 131,072 (--fill zeros: past 512 tokens the KV cache is zeroed, not
  # prefilled), with 4k and 32k reached the same way for the ratios
  # (bench-long-1.txt: screened head, bench-long-0.txt: full head)
  for e in LILY_HEAD_SCREEN=1 LILY_HEAD_SCREEN=0; do
    env $e timeout 150 "$lily" bench --device cuda --synthetic full --prompt-len 64 --context 4096,32768,131072 --fill zeros --gen 128 --runs 3 \
      > "$out/bench-long-${e#*=}.txt" 2>&1 && note "$e --fill zeros: $(decode_rows "$out/bench-long-${e#*=}.txt")" || note "bench long $e FAILED: $(tail -2 "$out/bench-long-${e#*=}.txt")"
  done
  ;;
recheck)
  for t in .carry/test-model_gpu .carry/test-ops_gpu; do
    timeout 120 "$t" --test-threads 1 > "$out/$(basename "$t").log" 2>&1 \
      && note "$(basename "$t"): $(grep -E '^test result' "$out/$(basename "$t").log" | tail -1)" \
      || note "$(basename "$t"): FAILED: $(grep -E -A2 'panicked' "$out/$(basename "$t").log" | head -4 | tr '\n' ' ')"
  done
  timeout 200 "$lily" bench --device cuda --synthetic full --prompt-len 4096 --context 512,4096,32768 --gen 128 --runs 3 \
    > "$out/bench-decode.txt" 2> "$out/bench-decode.log" && note "$(cat "$out/bench-decode.txt")" || note "bench FAILED: $(tail -3 "$out/bench-decode.log")"
  timeout 60 "$lily" bench --device cuda --synthetic full --prompt-len 64 --context 4096 --gen 32 --runs 1 --profile \
    > "$out/bench-profile.txt" 2> "$out/bench-profile.log" && note "$(tail -14 "$out/bench-profile.txt")" || note "profile FAILED"
  ;;
iter)
  # one optimisation round: every GPU test, decode at 4k/32k with the
  # in-graph profile, and the step without programmatic dependent launch
  gpu_tests
  grep -h "full4:" /tmp/test-*.log | head -2 | while read -r l; do note "$l"; done
  if grep -q "FAILED" /tmp/test-model_gpu.log 2>/dev/null; then
    LILY_PDL=0 timeout 200 .carry/test-model_gpu --test-threads 1 full4 > /tmp/nopdl.log 2>&1
    note "model_gpu full4 without PDL: $(grep -E '^test result|full4:' /tmp/nopdl.log | tr '\n' ' ')"
  fi
  timeout 200 "$lily" bench --device cuda --synthetic full --prompt-len 4096 --context 4096,32768 --gen 128 --runs 3 \
    > "$out/bench-decode.txt" 2> "$out/bench-decode.log" && note "$(cat "$out/bench-decode.txt")" || note "bench FAILED: $(tail -3 "$out/bench-decode.log")"
  LILY_PDL=0 timeout 100 "$lily" bench --device cuda --synthetic full --prompt-len 64 --context 4096 --gen 64 --runs 2 \
    > "$out/bench-nopdl.txt" 2>&1 && note "without PDL: $(tail -1 "$out/bench-nopdl.txt")" || note "bench nopdl FAILED"
  timeout 120 "$lily" bench --device cuda --synthetic full --prompt-len 64 --context 4096 --gen 32 --runs 1 --profile \
    > "$out/bench-profile.txt" 2> "$out/bench-profile.log" && note "$(tail -16 "$out/bench-profile.txt")" || note "profile FAILED: $(tail -3 "$out/bench-profile.log")"
  ;;
quick)
  # decode speed only (a second build carried alongside: LILY_CARRY=.carry/alt)
  timeout 200 "$lily" bench --device cuda --synthetic full --prompt-len 64 --context 4096,32768 --gen 128 --runs 3 \
    > "$out/bench-quick-$(basename "$carry").txt" 2> "$out/bench-quick.log" \
    && note "$carry: $(tail -3 "$out/bench-quick-$(basename "$carry").txt")" || note "bench quick FAILED: $(tail -3 "$out/bench-quick.log")"
  ;;
splits)
  # decode at 4k with other attention split counts (LILY_ATTN_SPLITS) than
  # the rule's (132 at this max-seq)
  for n in 66 264; do
    LILY_ATTN_SPLITS=$n timeout 100 "$lily" bench --device cuda --synthetic full --prompt-len 64 --context 4096 --gen 128 --runs 3 \
      > "$out/bench-splits-$n.txt" 2>&1 && note "splits $n: $(tail -1 "$out/bench-splits-$n.txt")" || note "splits $n FAILED"
  done
  ;;
ab)
  # a change against the build before it, in one run: the GPU tests of this
  # build, decode at 4k and 32k alternating between .carry/alt (the build
  # before) and this one, this one's decode profile, then its logits against
  # transformers (the floor mode's full-size check)
  alt="$root/.carry/alt"
  unpack "$alt"
  gpu_tests
  for v in alt new alt new; do
    bin="$lily"; [ "$v" = alt ] && bin="$alt/lily"
    [ -x "$bin" ] || continue
    timeout 150 "$bin" bench --device cuda --synthetic full --prompt-len 64 --context 4096,32768 --gen 128 --runs 3 \
      > "$out/bench-ab-$v.txt" 2>&1 && note "$v: $(decode_rows "$out/bench-ab-$v.txt")" || note "$v FAILED"
  done
  timeout 120 "$lily" bench --device cuda --synthetic full --prompt-len 64 --context 4096 --gen 32 --runs 1 --profile \
    > "$out/bench-profile.txt" 2> "$out/bench-profile.log" && note "$(tail -14 "$out/bench-profile.txt")" || note "profile FAILED"
  e2e full 1100 1050 "--hf-sdpa"
  ;;
variants)
  # every build under .carry/variants/* (tools/build_variant.sh), decode at
  # 4k and 32k, in turn, twice: builds compared in one run
  names=()
  for d in "$root"/.carry/variants/*/; do
    [ -f "$d/bundle.tar.xz" ] || continue
    unpack "$d"
    names+=("$(basename "$d")")
  done
  for round in 1 2; do
    for n in "${names[@]}"; do
      timeout 150 "$root/.carry/variants/$n/lily" bench --device cuda --synthetic full --prompt-len 64 --context 4096,32768 --gen 128 --runs 3 \
        > "$out/bench-$n-$round.txt" 2>&1 && note "$n: $(decode_rows "$out/bench-$n-$round.txt")" || note "$n FAILED"
    done
  done
  ;;
envs)
  # one build under several settings (LILY_ENVS: settings separated by ';',
  # each a space-separated list of VAR=value), decode at LILY_CONTEXTS
  # (4096,32768), in turn, LILY_ROUNDS times (2); after every GPU test when
  # LILY_TESTS=1. A setting's LILY_BIN=PATH runs another carried build
  # (e.g. .carry/variants/NAME/lily, unpacked here). LILY_FILL=zeros: the
  # cache past 512 tokens zeroed, not prefilled (for 131072 in LILY_CONTEXTS).
  [ "${LILY_TESTS:-0}" = 1 ] && gpu_tests
  for d in "$root"/.carry/variants/*/; do unpack "$d"; done
  IFS=';' read -r -a sets <<< "${LILY_ENVS:-LILY_PDL=1}"
  for round in $(seq 1 "${LILY_ROUNDS:-2}"); do
    for e in "${sets[@]}"; do
      tag=$(echo "$e" | tr ' =/' '_.-')
      bin=$(printf '%s\n' $e | sed -n 's/^LILY_BIN=//p')
      env $e timeout 150 "${bin:-$lily}" bench --device cuda --synthetic full --prompt-len 64 --context "${LILY_CONTEXTS:-4096,32768}" --fill "${LILY_FILL:-prefill}" --gen 128 --runs 3 \
        > "$out/bench-$tag-$round.txt" 2>&1 && note "$e: $(decode_rows "$out/bench-$tag-$round.txt")" || note "$e FAILED: $(tail -2 "$out/bench-$tag-$round.txt")"
    done
  done
  ;;
side)
  # Lily and transformers on the same random weights, one after the other in
  # this run, then one table with the ratio (BENCHMARKS.md records it)
  timeout 300 "$lily" bench --device cuda --synthetic full --prompt-len 512,4096,16384 --context 512,4096,32768 --gen 128 --runs 3 --json \
    > "$out/side-lily.json" 2> "$out/side-lily.log" || note "lily bench FAILED: $(tail -3 "$out/side-lily.log")"
  (cd tools && PYTHONUNBUFFERED=1 timeout 280 python3 hf_bench.py --synthetic full --lily ../.carry/lily --prompt-len 512,4096,16384 \
    --context 512,4096,32768 --gen 32 --runs 2 --out "$out/side-hf.json" > "$out/side-hf.log" 2>&1) || note "hf bench FAILED: $(tail -3 "$out/side-hf.log")"
  note "$(python3 tools/side_by_side.py "$out/side-lily.json" "$out/side-hf.json" 2>&1)"
  ;;
long)
  # decode at 131,072 context (one prefill; its speed is what issue 6 asks about)
  # (--fill zeros: past 512 tokens the KV cache is zeroed, not prefilled; a
  # 131k prefill with the CUDA-core prefill attention would take minutes)
  # (LILY_HEAD_SCREEN=0 in the caller's environment: the full bf16 lm_head)
  timeout 560 "$lily" bench --device cuda --synthetic full --prompt-len 64 --context 4096,32768,131072 --fill zeros --gen 128 --runs 3 \
    > "$out/bench-long.txt" 2> "$out/bench-long.log" && note "$(cat "$out/bench-long.txt")" || note "bench long FAILED: $(tail -3 "$out/bench-long.log")"
  ;;
trace)
  # one decode step's timeline from the kernels' LILY_TRACE diagnostic (a
  # run-time define: no rebuild): every launch's blocks' start, release from
  # the PDL wait and exit (crates/lily-cuda/src/trace.rs), summarised per
  # kernel by tools/trace_step.py (the bench's own tok/s are of the traced
  # build, slower than the plain one)
  LILY_KERNEL_DEFINES="LILY_TRACE=1${LILY_KERNEL_DEFINES:+,$LILY_KERNEL_DEFINES}" timeout 300 "$lily" bench --device cuda --synthetic full \
      --prompt-len 64 --context "${LILY_CONTEXTS:-4096,32768}" --gen 64 --runs 2 --trace "$out/trace" \
      > "$out/bench-trace.txt" 2> "$out/bench-trace.log" \
    && note "$(python3 tools/trace_step.py "$out"/trace/trace-*.csv 2>&1)" \
    || note "trace FAILED: $(tail -3 "$out/bench-trace.log")"
  ;;
phases)
  # the trace once per phase mark (LILY_MARKS, default every mark in the
  # kernels: gdn.cu 1-6, moe.cu router 11, gate/up 21-22), at 4,096: where a
  # kernel's time after its wait goes (tools/trace_step.py "phase mark")
  for m in ${LILY_MARKS:-1 2 3 4 5 6 11 21 22}; do
    rm -rf /tmp/phase-trace
    LILY_KERNEL_DEFINES="LILY_TRACE=1,LILY_TRACE_MARK=$m${LILY_KERNEL_DEFINES:+,$LILY_KERNEL_DEFINES}" timeout 120 "$lily" bench --device cuda \
        --synthetic full --prompt-len 64 --context 4096 --gen 64 --runs 2 --trace /tmp/phase-trace > "/tmp/phase-$m.txt" 2>&1 \
      && note "mark $m: $(python3 tools/trace_step.py /tmp/phase-trace/trace-4096.csv | awk '/^phase mark/{f=1; next} f && !/^kernel/' | tr '\n' ' ')" \
      || note "mark $m FAILED: $(tail -2 "/tmp/phase-$m.txt")"
  done
  ;;
ncu)
  # Each decode kernel of one layer cycle (3 GDN layers and an attention
  # layer) alone under Nsight Compute: its isolated duration, DRAM bytes and
  # stall reasons, i.e. how much of a kernel is its own latency rather than
  # the dependency gap before it (ncu runs kernels one at a time, so no PDL
  # overlap; launched eagerly). On full4 (the released geometry, 4 layers,
  # 8.2 GiB): ncu saves and restores device memory between a kernel's replay
  # passes, and on the 40-layer model (65 GiB) the run passed 500 s without
  # a result (17th session); on full4 a kernel takes about a second. Caches
  # and clocks as in a real run (no flush, no clock lock). A full4 decode
  # step is exactly 25 matching launches (prefill has none; qk_prep_kernel,
  # which prefill also runs, is left out).
  # LILY_NCU_SKIP: matching launches skipped (50 = two steps);
  # LILY_NCU_COUNT: how many to profile (25 = one step).
  ncu_bin=$(command -v ncu || ls /usr/local/cuda/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
  kernels='gemv3_kernel|gdn_decode_kernel|gemv_add_norm_kernel|router_decode_kernel|moe_gate_up_kernel|moe_down_norm_kernel|attention_decode_partial_kernel|attention_decode_merge_kernel'
  if [ -z "$ncu_bin" ]; then
    note "ncu: not found"
  elif LILY_CUDA_GRAPH=0 timeout 300 "$ncu_bin" --kernel-name "regex:^($kernels)\$" --launch-skip "${LILY_NCU_SKIP:-50}" \
      --launch-count "${LILY_NCU_COUNT:-25}" --cache-control none --clock-control none \
      --section SpeedOfLight --section LaunchStats --section Occupancy --section WarpStateStats \
      --metrics gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum --csv --page details \
      "$lily" bench --device cuda --synthetic full4 --prompt-len 64 --context 4096 --gen 8 --runs 1 \
      > "$out/ncu.csv" 2> "$out/ncu.log"; then
    note "$(python3 - "$out/ncu.csv" <<'PY'
import csv, sys
rows = {}
order = []
lines = [l for l in open(sys.argv[1]) if l.startswith('"')]
for r in csv.DictReader(lines):
    k = (r["ID"], r["Kernel Name"])
    if k not in rows:
        rows[k] = {}
        order.append(k)
    rows[k][r["Metric Name"]] = (r["Metric Value"], r["Metric Unit"])
# ncu's units, to us and MB
SCALE = {"nsecond": 1e-3, "ns": 1e-3, "usecond": 1.0, "us": 1.0, "msecond": 1e3, "ms": 1e3,
         "byte": 1e-6, "Kbyte": 1e-3, "Mbyte": 1.0, "Gbyte": 1e3}
def val(m, *names):  # the first of the metrics present, scaled
    for n in names:
        if n in m:
            v, unit = m[n]
            try:
                return float(v.replace(",", "")) * SCALE.get(unit, 1.0)
            except ValueError:
                return float("nan")
    return float("nan")
print(f"{'id':>4} {'kernel':<34} {'us':>8} {'DRAM MB':>8} {'GB/s':>7} {'cyc/issue':>9}")
for k in order:
    m = rows[k]
    us = val(m, "gpu__time_duration.sum", "Duration")
    mb = val(m, "dram__bytes_read.sum") + val(m, "dram__bytes_write.sum")
    cpi = val(m, "Warp Cycles Per Issued Instruction")
    print(f"{k[0]:>4} {k[1][:34]:<34} {us:8.2f} {mb:8.2f} {mb / us * 1e3 if us else 0:7.0f} {cpi:9.1f}")
PY
)"
  else
    note "ncu FAILED: $(tail -5 "$out/ncu.log" | tr '\n' ' ')"
  fi
  ;;
peer)
  (cd tools && PYTHONUNBUFFERED=1 python3 hf_bench.py --synthetic full --lily ../.carry/lily --out "$out/hf-bench.json" > "$out/hf-bench.log" 2>&1) \
    && note "transformers: $(cat "$out/hf-bench.json")" || note "hf bench FAILED: $(tail -3 "$out/hf-bench.log")"
  ;;
esac
echo
echo "==== summary ($mode) ===="
printf '%s\n' "${summary[@]}"
