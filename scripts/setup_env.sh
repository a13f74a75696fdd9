# Sourced by quickstart.sh and test.sh: creates .venv if needed, activates it and installs requirements.
# PyTorch is installed here (not from requirements.txt) so that a torch already in .venv (the CPU or CUDA build a user chose) is kept;
# GPU users install the CUDA build of torch first (see README), and this step then leaves it alone.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
if [ ! -x .venv/bin/python ]; then
  echo "== creating virtual environment .venv"
  python3 -m venv .venv
fi
source .venv/bin/activate
stamp=".venv/.installed-$(cat requirements.txt requirements-dev.txt | sha1sum | cut -c1-12)"
if [ ! -f "$stamp" ]; then
  echo "== installing requirements into .venv"
  python -m pip install -q --upgrade pip
  python -c "import torch" 2>/dev/null || python -m pip install -q "torch==${TORCH_VERSION:-2.13.0}"
  python -m pip install -q -r requirements-dev.txt
  touch "$stamp"
fi
