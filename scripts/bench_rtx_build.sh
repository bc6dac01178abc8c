#!/usr/bin/env bash
# TensorRT-RTX sm89 plan builds of SmolLM2-135M-Instruct on this CPU, per format: build wall time, peak RSS, plan
# size. Prints one markdown row per format (the table in BENCHMARKS.md, rtx-build section).
# Usage: scripts/bench_rtx_build.sh [WORKDIR] [FORMAT...]   (formats: fp16 bf16 fp8 int8_sq int4_wo int4_awq w4a8_awq)
# Quantized checkpoints use the smallest calibration that works (2 samples of 32 tokens): a build check, not an
# accuracy one. Fetches SmolLM2 into the camshaft cache first if it is not there (`camshaft models fetch`).
set -euo pipefail
cd "$(dirname "$0")/.."
WORK=${1:-/tmp/bench_rtx_build}
shift || true
FORMATS=${*:-fp16 fp8 int8_sq int4_wo int4_awq w4a8_awq}
CAMSHAFT=.venv/bin/camshaft
MODEL="$($CAMSHAFT models fetch smollm2-135m-instruct)"
LIMITS=(--max-batch-size 8 --max-seq-len 1024)
mkdir -p "$WORK"
echo "| format | quantize (s) | build wall (s) | build_engine (s) | peak RSS (GB) | model.plan (MB) | graph data (MB) |"
echo "|---|---|---|---|---|---|---|"
for fmt in $FORMATS; do
  src=$MODEL qsec="—" dtype=()
  if [ "$fmt" = bf16 ]; then
    dtype=(--dtype bfloat16)
  elif [ "$fmt" != fp16 ]; then
    src=$WORK/$fmt.ckpt
    rm -rf "$src"
    start=$(date +%s.%N)
    $CAMSHAFT quantize --model "$MODEL" --quant "$fmt" --output "$src" --calib-size 2 --calib-seq-len 32 \
      >/dev/null 2>"$WORK/$fmt.quantize.log"
    qsec=$(echo "$(date +%s.%N) - $start" | bc | xargs printf "%.1f")
  fi
  out=$WORK/$fmt-sm89
  rm -rf "$out"
  /usr/bin/time -v -o "$WORK/$fmt.time" $CAMSHAFT build --model "$src" --output "$out" --target tensorrt-rtx \
    --gpu-arch sm89 "${LIMITS[@]}" ${dtype[@]+"${dtype[@]}"} >/dev/null 2>"$WORK/$fmt.build.log"
  wall=$(awk -F': ' '/Elapsed \(wall clock\)/ {n=split($2,t,":"); s=0; for(i=1;i<=n;i++) s=s*60+t[i]; printf "%.1f", s}' \
    "$WORK/$fmt.time")
  rss=$(awk -F': ' '/Maximum resident set size/ {printf "%.2f", $2/1e6}' "$WORK/$fmt.time")
  builder=$(.venv/bin/python -c "import json,sys; print(json.load(open(sys.argv[1]))['target_options']['build_seconds'])" \
    "$out/manifest.json" 2>/dev/null || echo "?")
  plan=$(stat -c %s "$out/model.plan" | awk '{printf "%.0f", $1/1e6}')
  data=$(stat -c %s "$out/graph.onnx.data" | awk '{printf "%.0f", $1/1e6}')
  echo "| $fmt | $qsec | $wall | $builder | $rss | $plan | $data |"
done
