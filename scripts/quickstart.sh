#!/usr/bin/env bash
# Sets up .venv, prepares SmolLM2-135M-Instruct and generates text with it.
#   bash scripts/quickstart.sh [generate.py flags...]
source "$(dirname "$0")/setup_env.sh"
bash scripts/prepare.sh
if [ "$#" -eq 0 ]; then
  set -- --prompt "The capital of France is" --max_new_tokens 64 --temperature 0
fi
python generate.py "$@"
