#!/usr/bin/env bash
# The CUDA half in one command, for a GPU machine with a CUDA build of torch and no internet (docs/testing.md):
#   bash scripts/gpu_check.sh                   # the numerics tests on cuda, then the benchmark of a 7B shape
#   bash scripts/gpu_check.sh --tests_only      # or --benchmark_only
# Unlike scripts/test.sh it installs and downloads nothing: it names any missing package (carry it as a wheel, see
# README). The benchmark runs random weights of Llama-2-7B's shape: eager and compiled bfloat16, compiled int8 and
# int4, and compiled bfloat16 with its own int4 copy as the draft. PYTHON picks the interpreter (default python3).
set -uo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
tests=1
benchmark=1
for arg in "$@"; do
  case "$arg" in
    --tests_only) benchmark=0 ;;
    --benchmark_only) tests=0 ;;
    -h | --help) sed -n '2,7p' "$0" | cut -c3- && exit 0 ;;
    *) echo "error: unknown argument $arg (use --tests_only, --benchmark_only or --help)" >&2 && exit 2 ;;
  esac
done
if [ "$tests" -eq 0 ] && [ "$benchmark" -eq 0 ]; then
  echo "error: --tests_only and --benchmark_only exclude each other" >&2
  exit 2
fi

# Imported, not just found: a package present but broken counts as missing.
missing=$("$PYTHON" - <<'EOF'
import importlib

need = ["torch", "transformers", "pytest", "tokenizers", "sentencepiece", "safetensors", "jinja2", "tiktoken"]
missing = []
for name in need:
    try:
        importlib.import_module(name)
    except Exception:
        missing.append(name)
print(" ".join(missing))
EOF
) || { echo "error: $PYTHON does not run" >&2; exit 1; }
if [ -n "$missing" ]; then
  echo "error: missing Python package(s): $missing (carry them as wheels: README, \"A GPU check\")" >&2
  exit 1
fi
"$PYTHON" -c 'import sys, torch; torch.cuda.is_available() or sys.exit(f"error: torch {torch.__version__} sees no CUDA device")' ||
  exit 1

out=$(mktemp -d)
status=0
if [ "$tests" -eq 1 ]; then
  echo "== the numerics tests on cuda"
  # Compiling dominates the tests' time and runs on the CPU: with pytest-xdist, 8 workers share the GPU. Each test is
  # named as it ends (-v), so a run stopped by a time limit shows which ones it had not finished.
  parallel=()
  "$PYTHON" -c 'import xdist' 2>/dev/null && parallel=(-n 8)
  TEST_DEVICE=cuda "$PYTHON" -m pytest -v -m numerics tests -p no:cacheprovider --durations=10 "${parallel[@]}" </dev/null |
    tee "$out/tests.txt"
  status=${PIPESTATUS[0]}
fi
if [ "$benchmark" -eq 1 ]; then
  bench=("$PYTHON" scripts/benchmark.py --shape llama-2-7b --device cuda --rounds 3)
  echo "== Llama-2-7B's shape, random weights: bfloat16, int8, int4"
  "${bench[@]}" --configs eager:bfloat16,compiled:bfloat16,compiled:int8,compiled:int4 | tee "$out/bench.txt" ||
    status=1
  echo "== the same, speculative: compiled bfloat16 with its own int4 copy as the draft"
  "${bench[@]}" --configs compiled:bfloat16 --draft int4 | tee "$out/speculative.txt" || status=1
fi

echo
echo "== summary ($("$PYTHON" -c 'import torch; print(torch.cuda.get_device_name(), "torch", torch.__version__)'))"
[ -f "$out/tests.txt" ] && echo "tests: $(tail -n 1 "$out/tests.txt")"
for f in "$out/bench.txt" "$out/speculative.txt"; do
  [ -f "$f" ] && grep -E "^(\||copy bandwidth|CPU:|llama-2-7b)" "$f"
done
rm -rf "$out"
exit "$status"
