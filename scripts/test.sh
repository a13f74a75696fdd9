#!/usr/bin/env bash
# Runs the test suite in .venv (created on first use), after preparing the default model and Gemma 3 270M.
#   bash scripts/test.sh            # everything
#   bash scripts/test.sh -k sampling # extra arguments go to pytest
source "$(dirname "$0")/setup_env.sh"
echo "== ruff: format and lint (fix with: ruff format . && ruff check --fix .)"
ruff format --check --quiet .
ruff check --quiet .
bash scripts/prepare.sh
bash scripts/prepare.sh --model gemma3-270m
# The chat page test drives Debian's headless chromium; as root with apt (CI), install it when it is missing.
if ! command -v chromedriver >/dev/null && [ "$(id -u)" -eq 0 ] && command -v apt-get >/dev/null; then
  echo "== installing chromium and chromium-driver (for the chat page test)"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends chromium chromium-driver >/dev/null
fi
# A persistent inductor cache makes the compiled tests fast after their first run. Each CPU capability compiles
# into its own subfolder (decode.inductor_cache_dir): the AVX2 pass below never runs the AVX-512 pass's code.
export TORCHINDUCTOR_CACHE_DIR="${TORCHINDUCTOR_CACHE_DIR:-$PWD/.cache/inductor}"
status=0
# stdin from /dev/null: a script a test runs without input of its own must not wait on the terminal or CI pipe.
# --durations: the slowest tests, so that CI's time is watched where it is spent.
python -m pytest -q --durations=25 tests "$@" </dev/null || status=$?
if [ "$status" -eq 5 ]; then
  echo "error: pytest collected no tests" >&2
  exit 5
fi

# CI runs on Intel (AVX-512, AMX) or AMD (AVX2 only) machines, whose kernels round differently. On an AVX-512
# CPU, the tests that compare numerically different paths run a second time on the AVX2 code paths, so that a
# tolerance that only holds for one kind of CPU fails here, not on the other kind of machine.
# What the switches cover: ATen's vectorised kernels (ATEN_CPU_CAPABILITY: its DispatchStub kernels, the
# int8/int4 weight kernels, SLEEF's exp/log), the C++ that inductor generates (it takes its vector ISA from
# ATEN_CPU_CAPABILITY), MKL's BLAS (MKL_ENABLE_INSTRUCTIONS) and oneDNN's matmuls, including AMX
# (ONEDNN_MAX_CPU_ISA). What they do not: MKL's and oneDNN's choices by cache size and CPU vendor (blocking, and
# so summation order, can still differ on an AMD machine), and the thread count of the machine.
if [ "$status" -eq 0 ] && grep -qw avx512f /proc/cpuinfo 2>/dev/null; then
  echo "== the numerics tests again, on the AVX2 code paths (ATEN_CPU_CAPABILITY=avx2)"
  ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2 ONEDNN_MAX_CPU_ISA=AVX2 \
    python -m pytest -q --durations=25 tests -m numerics "$@" </dev/null || status=$?
  if [ "$status" -eq 5 ]; then  # the extra arguments selected no numerics test: nothing to repeat
    status=0
  fi
fi
echo "== inductor caches, one per CPU capability:" $(cd "$TORCHINDUCTOR_CACHE_DIR" 2>/dev/null && du -sh -- */ | tr '\t' ' ')
exit "$status"
