"""Quantization: kernels against float64, exact round trips, GPTQ against round-to-nearest, checkpoints end to end."""

import json
import shutil
import subprocess
import sys

import pytest
import torch

import kernels
import quantize as qz
from checkpoint import save_atomic
from conftest import ROOT, assert_same_greedy
from decode import compile_steps
from generate import generate, load_model
from kernels import Kernels
from tokenizer import load_tokenizer

pytestmark = pytest.mark.numerics


def relative_error(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("batch", [1, 5, 8])  # 3 and 15 rows take the int8 kernel, 24 the widened weight
def test_int8_linear_matches_float64_reference(bias, batch, device):
    torch.manual_seed(0)
    w, x = torch.randn(96, 160), torch.randn(batch, 3, 160)
    q, scales = qz.quantize_int8(w)
    assert q.dtype == torch.int8 and (q.float() * scales[:, None] - w).abs().max() <= scales.max() / 2 + 1e-6
    layer = kernels.Int8Linear(160, 96, bias)
    layer.weight, layer.scales = q, scales
    if bias:
        layer.bias = torch.nn.Parameter(torch.randn(96))
    reference = x.double() @ (q.double() * scales.double()[:, None]).T + (layer.bias.double() if bias else 0)
    layer.to(device).prepare()
    # bfloat16 activations in the CPU kernel round each input to 8 significant bits: 2.7e-3 to 3.2e-3 here (AVX2);
    # a wrong scale, sign or layout gives errors of order 1.
    assert relative_error(layer(x.to(device)).cpu(), reference) < 1e-2


@pytest.mark.parametrize("rows, fused_rows", [(1, 1), (5, 8), (8, 8), (5, 1), (9, 8), (3, 0)])
def test_a_step_fuses_products_of_up_to_its_fused_rows_rows(rows, fused_rows):
    """The caller's row limit decides the path, whatever runs the step: a fused product computes in float32,
    ATen's int8 kernel (more rows than the limit) with bfloat16 activations."""
    torch.manual_seed(2)
    w, x = torch.randn(96, 160), torch.randn(rows, 160)
    layer = kernels.Int8Linear(160, 96)
    layer.weight, layer.scales = qz.quantize_int8(w)
    layer.kernels = Kernels(quant_matvec="fused")
    layer.prepare()
    error = relative_error(
        layer(x, fused_rows), x.double() @ (layer.weight.double() * layer.scales.double()[:, None]).T
    )
    # float32 sums: ~1e-7 here; bfloat16 inputs: ~3e-3
    assert (error < 1e-5) == (rows <= fused_rows), error


@pytest.mark.parametrize("groupsize", [32, 64])
def test_int4_linear_matches_float64_reference(groupsize, device):
    torch.manual_seed(1)
    w, x = torch.randn(96, 256), torch.randn(4, 256)
    scales, zeros = qz.int4_group_params(w, groupsize)
    codes = qz.quantize_int4_values(w, scales, zeros, groupsize)
    dequantized = qz.dequantize_int4(codes, scales, zeros, groupsize)
    assert codes.max() <= 15 and (dequantized - w).abs().max() <= scales.max() / 2 + 1e-5
    layer = kernels.Int4Linear(256, 96, groupsize)
    layer.weight = qz.pack_int4(codes)
    layer.scales_and_zeros = torch.stack([scales.T, zeros.T], dim=-1)
    layer.to(device).prepare()  # on CUDA: _weight_int4pack_mm's layout, bfloat16 activations as on the CPU
    assert relative_error(layer(x.to(device)).cpu(), x.double() @ dequantized.double().T) < 1e-2  # 3.2e-3 here


def test_pack_and_save_round_trips_exactly(tmp_path):
    codes = torch.randint(0, 16, (7, 64), dtype=torch.uint8)
    packed = qz.pack_int4(codes)
    assert packed.shape == (7, 32) and torch.equal(kernels.unpack_int4(packed), codes)
    state = {"w": packed, "s": torch.randn(2, 7, 2), "q": torch.randint(-128, 127, (3, 4), dtype=torch.int8)}
    save_atomic({"quantization": {"version": 1}, "state_dict": state}, tmp_path / "f.pth")
    loaded = torch.load(tmp_path / "f.pth", weights_only=True)["state_dict"]
    assert all(torch.equal(loaded[k], v) and loaded[k].dtype == v.dtype for k, v in state.items())


def test_gptq_beats_round_to_nearest_on_correlated_inputs():
    torch.manual_seed(2)
    w = torch.randn(64, 256)
    mixing = torch.randn(256, 256) / 16 + torch.eye(256)
    x = torch.randn(2048, 32) @ torch.randn(32, 256) + 0.1 * torch.randn(2048, 256) @ mixing  # low-rank + noise
    hessian = 2 * x.double().T @ x.double() / len(x)
    scales, zeros = qz.int4_group_params(w, 32)
    rtn = qz.dequantize_int4(qz.quantize_int4_values(w, scales, zeros, 32), scales, zeros, 32)
    errors = {"rtn": relative_error(x @ rtn.T, x @ w.T)}
    for act_order in (False, True):
        codes, s, z = qz.gptq_int4(w, hessian, 32, act_order=act_order)
        errors[f"gptq act_order={act_order}"] = relative_error(x @ qz.dequantize_int4(codes, s, z, 32).T, x @ w.T)
    assert errors["gptq act_order=False"] < 0.8 * errors["rtn"], errors
    assert errors["gptq act_order=True"] < 0.8 * errors["rtn"], errors


@pytest.fixture(scope="module")
def quantized_checkpoints(tiny_checkpoint, tmp_path_factory):
    folder = tmp_path_factory.mktemp("q") / "tiny"
    shutil.copytree(tiny_checkpoint, folder)
    paths = {
        mode: qz.quantize_checkpoint(folder / "model.pth", mode, 32, calibration_samples=4, calibration_seq_length=64)
        for mode in qz.MODES
    }
    return folder, paths


def test_quantized_checkpoints_load_and_stay_close(quantized_checkpoints):
    folder, paths = quantized_checkpoints
    assert sorted(p.name for p in paths.values()) == ["model_int4-gptq.g32.pth", "model_int4.g32.pth", "model_int8.pth"]
    reference = load_model(folder / "model.pth")
    x = torch.randint(0, 300, (2, 24))
    reference.setup_caches(2, 24)
    with torch.no_grad():
        expected = reference(x, torch.arange(24))
        for mode, path in paths.items():
            model = load_model(path)
            assert isinstance(
                model.layers[0].attention.wqkv, kernels.Int8Linear if mode == "int8" else kernels.Int4Linear
            )
            assert isinstance(model.output, kernels.Int8Linear)
            model.setup_caches(2, 24)
            # The quantization error itself, large on random weights: int8 0.03, int4 0.33, GPTQ 0.43 here (GPTQ
            # calibrates on text this random model does not predict). Broken kernels or layouts decorrelate the
            # logits (relative error ~1.4, as for unrelated logits of the same spread).
            assert relative_error(model(x, torch.arange(24)), expected) < (0.1 if mode == "int8" else 0.7), mode


def run_generate(*args):
    result = subprocess.run(
        [sys.executable, str(ROOT / "generate.py"), *args], capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1])


# Margins for greedy outputs of one checkpoint computed two ways. Compiled and eager fused products sum float32
# in another order: logits within ~1e-5. ATen's kernels round their outputs, logits included, to bfloat16, so
# compiled and eager library paths (identical here) could only differ by whole bfloat16 steps of the logits
# (1/128 of ~4). float32 against bfloat16 activations: up to 0.10 on this model (int8; int4 0.08: its wide random
# weights amplify the rounding). A broken kernel or layout decorrelates the logits (differences of several).
SAME_PATH = {"fused": 1e-4, "library": 0.1}
BFLOAT16_VS_FLOAT32 = 0.3


@pytest.mark.parametrize("matvec", ["library", "fused"])
def test_quantized_checkpoints_generate_eager_and_compiled(quantized_checkpoints, matvec):
    folder, paths = quantized_checkpoints
    prompt = load_tokenizer(folder).encode("The quick")
    kernels = Kernels.choose(torch.device("cpu"), compiled=False, matvec=matvec)  # as the command line below
    steps = compile_steps(torch.device("cpu"))
    for mode, path in paths.items():
        cli = run_generate(
            "--checkpoint_path",
            str(path),
            "--prompt",
            "The quick",
            "--max_new_tokens",
            "20",
            "--temperature",
            "0",
            "--kernels",
            matvec,
            "--json",
        )
        assert cli["stats"]["new_tokens"] == [20] and cli["stats"]["kernels"]["quant_matvec"] == matvec, mode
        model = load_model(path, kernels=kernels)
        eager = generate(model, prompt, 20).tokens[0]
        compiled = generate(model, prompt, 20, steps=steps).tokens[0]
        assert_same_greedy(model, prompt, compiled, eager, SAME_PATH[matvec])
        assert cli["tokens"][0] == eager  # the command line runs the same eager path
        other = load_model(
            path, kernels=Kernels.choose(torch.device("cpu"), False, "fused" if matvec == "library" else "library")
        )
        assert_same_greedy(other, prompt, generate(other, prompt, 20).tokens[0], eager, BFLOAT16_VS_FLOAT32)


def test_bad_quantization_requests(quantized_checkpoints, tmp_path):
    folder, paths = quantized_checkpoints
    before = sorted(p.name for p in folder.iterdir())
    cases = [
        (dict(mode="int3"), "unknown mode 'int3'"),
        (dict(mode="int4", groupsize=48), "groupsize 48 is not supported"),
        (dict(mode="int4", groupsize=64), "groupsize 64 does not divide the 96 inputs of layers.0.feed_forward.w2"),
        (dict(mode="int4-gptq", calibration_samples=1000), "calibration text has .* tokens, fewer than"),
    ]
    for kwargs, message in cases:
        with pytest.raises(ValueError, match=message):
            qz.quantize_checkpoint(folder / "model.pth", **kwargs)
    with pytest.raises(ValueError, match="already quantized"):
        qz.quantize_checkpoint(paths["int8"], "int4")
    assert sorted(p.name for p in folder.iterdir()) == before  # nothing written
    data = torch.load(paths["int8"], weights_only=True)
    data["quantization"]["mode"] = "int2"
    torch.save(data, tmp_path / "odd.pth")
    shutil.copy(folder / "config.json", tmp_path / "config.json")
    with pytest.raises(ValueError, match="unknown quantized format"):
        load_model(tmp_path / "odd.pth")
