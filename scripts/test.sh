#!/usr/bin/env bash
# Runs the test suite in .venv (created on first use), after preparing the default model.
#   bash scripts/test.sh            # everything
#   bash scripts/test.sh -k sampling # extra arguments go to pytest
source "$(dirname "$0")/setup_env.sh"
bash scripts/prepare.sh
# A persistent inductor cache makes the compiled tests fast after their first run.
export TORCHINDUCTOR_CACHE_DIR="${TORCHINDUCTOR_CACHE_DIR:-$PWD/.cache/inductor}"
status=0
python -m pytest -q tests "$@" || status=$?
if [ "$status" -eq 5 ]; then
  echo "error: pytest collected no tests" >&2
fi
exit "$status"
