"""kernels_cpu.cpp's int8 products against an integer reference, for every ISA path this CPU runs; rows bitwise the
same alone and in batches; the PyTorch fallback when the file cannot be built."""

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import kernels
import quantize as qz
from conftest import ROOT

pytestmark = pytest.mark.numerics


def runnable_isas() -> list[int]:
    """NATIVE_ISAS indices this process may run: up to the best one native_isa() allows, VNNI where it does."""
    best = kernels.NATIVE_ISAS.index(kernels.native_isa())
    vnni = best in (2, 4)
    return [i for i in range(best + 1) if i in (0, 1, 3) or (vnni and i in (2, 4))]


@pytest.fixture(scope="module")
def ops():
    if not kernels.native_kernels():
        # CI must not go green without the kernels: there a failed build fails these tests.
        assert os.environ.get("CI") != "true", "kernels_cpu.cpp did not build"
        pytest.skip("kernels_cpu.cpp did not build here (no C++ compiler?)")
    return torch.ops.gpt_fast


def reference(x: np.ndarray, w: np.ndarray, scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The kernel's arithmetic in NumPy: activations to int8 codes per block of 32 in float32 as the kernel rounds
    them, integer block dot products in int64; returns y in float64 and, for the rounding bound, the sum of the
    magnitudes of the partial sums a kernel may add in float (4 products each, a vector lane's)."""
    m, k = x.shape
    blocks = x.reshape(m, k // 32, 32).astype(np.float32)
    amax = np.abs(blocks).max(axis=-1, keepdims=True)
    inverse = np.where(amax > 0, np.float32(127) / np.where(amax > 0, amax, 1), np.float32(0)).astype(np.float32)
    codes = np.rint(blocks * inverse).astype(np.int64)
    d = (amax / np.float32(127)).astype(np.float32)[..., 0].astype(np.float64)  # [M, K / 32]
    weights = w.reshape(w.shape[0], k // 32, 8, 4).astype(np.int64)
    lanes = np.einsum("mblj,nblj->mnbl", codes.reshape(m, k // 32, 8, 4), weights)  # exact, 4 products each
    terms = lanes * d[:, None, :, None]
    scale = scales.astype(np.float64)
    return terms.sum((-1, -2)) * scale, np.abs(terms).sum((-1, -2)) * np.abs(scale)


@pytest.mark.parametrize("k", [32, 96, 576, 1056])  # one block; odd block counts; K not a multiple of 256
def test_integer_dot_products_are_exact(ops, k):
    """Integer activations with a 127 in every block make codes equal to the activations and block scales 1: with
    scales of 1, every output is an integer sum that float32 holds exactly, so it must equal the int64 dot product."""
    g = torch.Generator().manual_seed(k)
    x = torch.randint(-127, 128, (8, k), generator=g).float()
    x[:, ::32] = 127.0
    w = torch.randint(-127, 128, (37, k), dtype=torch.int8, generator=g)
    expected = x.long() @ w.long().T
    for isa in runnable_isas():
        for m in range(1, 9):
            y = ops.int8_linear(x[:m], w, torch.ones(37), isa)
            assert torch.equal(y.long(), expected[:m]) and torch.equal(y, y.round()), kernels.NATIVE_ISAS[isa]


@pytest.mark.parametrize("k", [64, 576, 1056])
def test_float_outputs_within_rounding_of_the_reference(ops, k):
    """Random activations and scales: each output within float32 rounding of the float64 sum of the exact block
    terms (a bound of 2^-22 per block term added, on the sum of their magnitudes); a wrong block scale, code or
    sign moves outputs by far more."""
    g = torch.Generator().manual_seed(k)
    x, w = torch.randn(8, k, generator=g), torch.randint(-127, 128, (45, k), dtype=torch.int8, generator=g)
    scales = torch.rand(45, generator=g) / 100
    y_ref, magnitude = reference(x.numpy(), w.numpy(), scales.numpy())
    bound = (k // 32 + 16) * 2.0**-22 * magnitude
    for isa in runnable_isas():
        y = ops.int8_linear(x, w, scales, isa).double().numpy()
        assert (np.abs(y - y_ref) <= bound).all(), (kernels.NATIVE_ISAS[isa], np.abs(y - y_ref).max())


def test_a_row_is_bitwise_the_same_alone_and_in_any_batch(ops):
    g = torch.Generator().manual_seed(3)
    x, w = torch.randn(8, 576, generator=g), torch.randint(-127, 128, (64, 576), dtype=torch.int8, generator=g)
    scales = torch.rand(64, generator=g)
    compiled = torch.compile(lambda x, isa: ops.int8_linear(x, w, scales, isa), fullgraph=True, dynamic=False)
    for isa in runnable_isas():
        torch._dynamo.reset()  # a graph per isa and shape: within Dynamo's recompile limit for each isa
        alone = torch.cat([ops.int8_linear(x[i : i + 1], w, scales, isa) for i in range(8)])
        for m in range(2, 9):
            assert torch.equal(ops.int8_linear(x[:m], w, scales, isa), alone[:m]), (kernels.NATIVE_ISAS[isa], m)
        assert torch.equal(compiled(x, isa), alone) and torch.equal(compiled(x[:1], isa), alone[:1])


def test_int8_layer_takes_the_kernel_for_up_to_8_rows(ops):
    """Int8Linear with int8_native: rows up to NATIVE_ROWS by the kernel (int8 activations: ~4e-3 from float64 here),
    more by ATen's paths; a weight of -128, which the byte products cannot take, keeps the layer off the kernel."""
    torch.manual_seed(4)
    w = torch.randn(96, 160)
    layer = kernels.Int8Linear(160, 96)
    layer.weight, layer.scales = qz.quantize_int8(w)
    layer.kernels = kernels.Kernels(int8_native=kernels.native_isa())
    layer.prepare()
    x = torch.randn(5, 160)
    expected = ops.int8_linear(x, layer.weight, layer.scales, kernels.NATIVE_ISAS.index(kernels.native_isa()))
    assert torch.equal(layer(x), expected)
    reference_y = x.double() @ (layer.weight.double() * layer.scales.double()[:, None]).T
    assert ((layer(x) - reference_y).norm() / reference_y.norm()).item() < 1e-2
    assert not torch.equal(layer(torch.cat([x] * 2))[:5], expected)  # 10 rows: ATen's bfloat16 kernel
    layer.weight[0, 0] = -128
    layer.prepare()
    assert layer.native_scales is None


def test_without_a_compiler_the_pytorch_paths_run(tiny_checkpoint, tmp_path):
    """CXX pointing at no compiler: generate.py runs its int8 checkpoint on ATen's kernels (auto never builds), and
    --kernels native is refused after one line that says why the build failed."""
    int8 = qz.quantize_checkpoint(Path(tiny_checkpoint) / "model.pth", "int8")
    env = os.environ | {"CXX": str(tmp_path / "no-compiler"), "TORCH_EXTENSIONS_DIR": str(tmp_path / "ext")}
    command = [sys.executable, str(ROOT / "generate.py"), "--checkpoint_path", str(int8), "--prompt", "Hi"]
    command += ["--max_new_tokens", "4", "--temperature", "0", "--json"]
    run = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL)
    assert run.returncode == 0 and "kernels_cpu.cpp" not in run.stderr, run.stderr[-2000:]
    assert '"int8_native": null' in run.stdout.splitlines()[-1]
    refused = subprocess.run(command + ["--kernels", "native"], env=env, capture_output=True, text=True, timeout=300)
    said = [line for line in refused.stderr.splitlines() if "kernels_cpu.cpp" in line]
    assert refused.returncode == 1 and len(said) == 2, refused.stderr[-2000:]
    assert "did not build" in said[0] and "no-compiler" in said[0] and said[1].startswith("error: --kernels native")
    assert not (tmp_path / "ext").exists() or not any((tmp_path / "ext").rglob("*.so"))
