#!/usr/bin/env bash
# The main job on the embedded default: fetch SmolLM2-135M-Instruct, build a CPU engine, answer a chat prompt
# (the arguments, if any, are the prompt: ./scripts/demo.sh Name three rivers).
set -euo pipefail
if [ -n "${CAMSHAFT_CACHE:-}" ]; then export CAMSHAFT_CACHE="$(realpath -m "$CAMSHAFT_CACHE")"; fi  # before the cd
cd "$(dirname "$0")/.."
bash scripts/setup.sh reference
CAMSHAFT=.venv/bin/camshaft
MODEL="$($CAMSHAFT models fetch smollm2-135m-instruct)"
ENGINE=engines/smollm2-135m-instruct
# (re)build unless an engine from this camshaft is there: engines of format 1 lack the faster sequence graph
if [ ! -f "$ENGINE/manifest.json" ] || [ ! -f "$ENGINE/sequence.onnx" ]; then
    $CAMSHAFT build --model "$MODEL" --output "$ENGINE" --max-seq-len 2048
fi
$CAMSHAFT run --engine "$ENGINE" --chat --stream --max-tokens 96 \
    --prompt "${*:-What is the capital of France, and what is it famous for?}"
