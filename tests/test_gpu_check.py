"""scripts/gpu_check.sh and TEST_DEVICE, as far as a machine without a GPU can check them: arguments, the report of a
missing package, the refusal without CUDA, and pytest's refusal of a device it cannot use."""

import os
import subprocess
import sys

import pytest
import torch

from conftest import ROOT

SCRIPT = ROOT / "scripts" / "gpu_check.sh"


def gpu_check(*args, **env) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", str(SCRIPT), *args],
        env=os.environ | {"PYTHON": sys.executable} | env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_arguments():
    assert "--tests_only" in gpu_check("--help").stdout
    for args in (["--fast"], ["--tests_only", "--benchmark_only"]):
        result = gpu_check(*args)
        assert result.returncode == 2 and result.stderr.count("\n") == 1 and result.stderr.startswith("error:")


def test_names_a_missing_package(tmp_path):
    absent = tmp_path / "tiktoken"
    absent.mkdir()
    (absent / "__init__.py").write_text('raise ImportError("made absent by the test")\n')
    result = gpu_check(PYTHONPATH=str(tmp_path))
    assert result.returncode == 1 and result.stdout == ""
    assert result.stderr == 'error: missing Python package(s): tiktoken (carry them as wheels: README, "A GPU check")\n'


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA device")
def test_refuses_without_cuda():
    result = gpu_check()
    assert result.returncode == 1 and result.stderr == f"error: torch {torch.__version__} sees no CUDA device\n"


@pytest.mark.parametrize("name", ["tpu", *([] if torch.cuda.is_available() else ["cuda"])])
def test_pytest_refuses_a_test_device_it_cannot_use(name):
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", str(ROOT / "tests" / "test_sampling.py")],
        env=os.environ | {"TEST_DEVICE": name},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 4 and f"TEST_DEVICE={name}" in result.stderr, result.stderr
