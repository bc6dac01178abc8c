#!/usr/bin/env bash
# Perplexity and size per quantization format on SmolLM2-135M-Instruct, on a held-out text (the first 6000 bytes of
# the Python LICENSE, which is not in the calibration corpus of stdlib docstrings). Prints one line per format.
# Usage: [MODEL=CHECKPOINT_DIR] scripts/bench_quant_accuracy.sh [OUT_DIR]  (outputs under OUT_DIR are replaced)
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="${1:-out/q}"
PY=.venv/bin/python
CAMSHAFT=.venv/bin/camshaft
mkdir -p "$OUT"
$PY -c "import sys, sysconfig, pathlib; sys.stdout.write(pathlib.Path(sysconfig.get_paths()['stdlib'], 'LICENSE.txt').read_bytes()[:6000].decode())" \
    > "$OUT/heldout.txt"
MODEL="${MODEL:-$($CAMSHAFT models fetch smollm2-135m-instruct)}"  # MODEL=DIR: another checkpoint
[ -f "$OUT/fp32-engine/manifest.json" ] || $CAMSHAFT build --model "$MODEL" --output "$OUT/fp32-engine" --max-seq-len 2048 \
    > "$OUT/fp32.log" 2>&1
echo "fp32: checkpoint $(du -sm "$MODEL" | cut -f1) MiB, engine $(du -sm "$OUT/fp32-engine" | cut -f1) MiB: $($CAMSHAFT eval ppl --engine "$OUT/fp32-engine" --data "$OUT/heldout.txt")"
for q in int8_wo int4_wo int4_awq w4a8_awq; do
    start=$(date +%s)
    $CAMSHAFT quantize --model "$MODEL" --quant "$q" --output "$OUT/$q" --calib-size 32 > "$OUT/$q.log" 2>&1
    took=$(( $(date +%s) - start ))
    compute=(--weight-only-compute float)  # the table's unmarked rows: exact dequantized weights (‡ rows: int8)
    [ "$q" = w4a8_awq ] && compute=()
    $CAMSHAFT build --model "$OUT/$q" --output "$OUT/$q-engine" --max-seq-len 2048 "${compute[@]}" >> "$OUT/$q.log" 2>&1
    echo "$q: quantize ${took} s, checkpoint $(du -sm "$OUT/$q" | cut -f1) MiB, engine $(du -sm "$OUT/$q-engine" | cut -f1) MiB:" \
         "$($CAMSHAFT eval ppl --engine "$OUT/$q-engine" --data "$OUT/heldout.txt")"
done
# --lm-head int8|int4 on int4_awq: quantized again with the option, as users do (--lm-head int4 records the head's
# float input channels, chosen over the calibration passes; the layers are calibrated as above).
for head in int8 int4; do
    ckpt="$OUT/int4_awq-head-$head"
    start=$(date +%s)
    $CAMSHAFT quantize --model "$MODEL" --quant int4_awq --lm-head "$head" --output "$ckpt" --calib-size 32 \
        > "$OUT/int4_awq-head-$head.log" 2>&1
    took=$(( $(date +%s) - start ))
    $CAMSHAFT build --model "$ckpt" --output "$ckpt-engine" --max-seq-len 2048 --weight-only-compute float \
        >> "$OUT/int4_awq-head-$head.log" 2>&1
    echo "int4_awq --lm-head $head: quantize ${took} s, engine $(du -sm "$ckpt-engine" | cut -f1) MiB:" \
         "$($CAMSHAFT eval ppl --engine "$ckpt-engine" --data "$OUT/heldout.txt")"
done
