"""kernels_cpu.cpp's int8 and int4 products against an integer reference, for every ISA path this CPU runs; rows
bitwise the same alone and in batches; the layers' use of them; int4 weights widened for many rows; the PyTorch
fallback when the file cannot be built; oneDNN's float32 product, eager and compiled, and its copy of the weights in
oneDNN's layout."""

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import kernels
import model as model_module
import quantize as qz
from conftest import ROOT, SMOLLM2_DIR
from generate import load_model

pytestmark = pytest.mark.numerics
CPU = torch.device("cpu")
AHEAD = kernels.PREFETCH_BYTES  # the operators' prefetch argument, which changes no result


def runnable_isas() -> list[int]:
    """NATIVE_ISAS indices this process may run (the CPU's instructions, as torch's CPU capability allows)."""
    return [kernels.NATIVE_ISAS.index(isa) for isa in kernels.native_isas()]


@pytest.fixture(scope="module")
def ops(native_ops):
    return native_ops


def quantized_activations(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """x [M, K] as the kernel quantizes it, in float32: codes [M, K / 32, 8, 4] (a vector lane's 4 bytes last) in
    int64, block scales d [M, K / 32] in float64, and the blocks of x [M, K / 32, 32] in float32."""
    m, k = x.shape
    blocks = x.reshape(m, k // 32, 32).astype(np.float32)
    amax = np.abs(blocks).max(axis=-1, keepdims=True)
    inverse = np.where(amax > 0, np.float32(127) / np.where(amax > 0, amax, 1), np.float32(0)).astype(np.float32)
    codes = np.rint(blocks * inverse).astype(np.int64).reshape(m, k // 32, 8, 4)
    return codes, (amax / np.float32(127)).astype(np.float32)[..., 0].astype(np.float64), blocks


def float32_bound(blocks: int, magnitude: np.ndarray) -> np.ndarray:
    """How far float32 sums of a kernel's block terms may stray: 2^-22 per term added (a lane's, the reductions'),
    on the sum of the terms' magnitudes."""
    return (blocks + 16) * 2.0**-22 * magnitude


def reference(x: np.ndarray, w: np.ndarray, scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The int8 kernel's arithmetic in NumPy: integer block dot products in int64 (a vector lane's 4 products each),
    times the block scales in float64; returns y and the float32 rounding bound."""
    codes, d, _ = quantized_activations(x)
    lanes = np.einsum("mblj,nblj->mnbl", codes, w.reshape(w.shape[0], *codes.shape[1:]).astype(np.int64))
    terms = lanes * d[:, None, :, None]
    scale = scales.astype(np.float64)
    return terms.sum((-1, -2)) * scale, float32_bound(d.shape[1], np.abs(terms).sum((-1, -2)) * np.abs(scale))


@pytest.mark.parametrize("k", [64, 576, 1088])  # one pair of blocks; K not a multiple of 256; an odd pair count
def test_integer_dot_products_are_exact(ops, k):
    """Integer activations with a 127 in every block make codes equal to the activations and block scales 1: with
    scales of 1, every output is an integer sum that float32 holds exactly, so it must equal the int64 dot product."""
    g = torch.Generator().manual_seed(k)
    x = torch.randint(-127, 128, (8, k), generator=g).float()
    x[:, ::32] = 127.0
    w = torch.randint(-127, 128, (36, k), dtype=torch.int8, generator=g)
    expected, packed = x.long() @ w.long().T, kernels.int8_native_layout(w)
    for isa in runnable_isas():
        for m in range(1, 9):
            y = ops.int8_linear(x[:m], packed, torch.ones(36), isa, AHEAD)
            assert torch.equal(y.long(), expected[:m]) and torch.equal(y, y.round()), kernels.NATIVE_ISAS[isa]


@pytest.mark.parametrize("k", [64, 576, 1088])
def test_float_outputs_within_rounding_of_the_reference(ops, k):
    """Random activations and scales: each output within float32 rounding of the float64 sum of the exact block
    terms (a bound of 2^-22 per block term added, on the sum of their magnitudes); a wrong block scale, code or
    sign moves outputs by far more."""
    g = torch.Generator().manual_seed(k)
    x, w = torch.randn(8, k, generator=g), torch.randint(-127, 128, (44, k), dtype=torch.int8, generator=g)
    scales = torch.rand(44, generator=g) / 100
    y_ref, bound = reference(x.numpy(), w.numpy(), scales.numpy())
    for isa in runnable_isas():
        y = ops.int8_linear(x, kernels.int8_native_layout(w), scales, isa, AHEAD).double().numpy()
        assert (np.abs(y - y_ref) <= bound).all(), (kernels.NATIVE_ISAS[isa], np.abs(y - y_ref).max())


def test_activation_codes_round_half_to_even_like_the_reference(ops):
    """The activations' quantization, read back through unit weights: in a block whose largest magnitude is 127 the
    codes are the values rounded, halves to even as NumPy's rint (and nearbyint) round them, in every row and block
    of a batch large enough to be quantized by both threads."""
    g = torch.Generator().manual_seed(5)
    x = (torch.randint(-252, 253, (40, 128), generator=g) / 2).float()  # multiples of 0.5: many exact halves
    x[:, ::32] = 127.0
    codes = torch.from_numpy(np.rint(x.numpy()))
    unit = kernels.int8_native_layout(torch.eye(128, dtype=torch.int8))
    for isa in runnable_isas():
        assert torch.equal(ops.int8_linear(x, unit, torch.ones(128), isa, AHEAD), codes), kernels.NATIVE_ISAS[isa]


def int4_weights(n: int, k: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Random codes [N, K] in 0..15 and float16 scales and offsets [N, K / 32, 2]."""
    codes = torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=g)
    scales = torch.stack([torch.rand(n, k // 32, generator=g) / 50, torch.randn(n, k // 32, generator=g) / 10], -1)
    return codes, scales.half()


def int4_reference(x: np.ndarray, codes: np.ndarray, scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The int4 kernel's arithmetic in NumPy: per block, d * (scale * (int64 dot product of the codes) + offset * (sum
    of the activation codes)); returns y in float64 and the float32 rounding bound."""
    activation_codes, d, _ = quantized_activations(x)
    lanes = np.einsum(
        "mblj,nblj->mnbl", activation_codes, codes.reshape(-1, *activation_codes.shape[1:]).astype(np.int64)
    )
    scale, offset = scales[..., 0].astype(np.float64), scales[..., 1].astype(np.float64)  # [N, K / 32]
    scaled = lanes * (d[:, None, :] * scale[None])[..., None]
    offsets = offset[None] * (d * activation_codes.sum((-1, -2)))[:, None, :]
    magnitude = np.abs(scaled).sum((-1, -2)) + np.abs(offsets).sum(-1)
    return scaled.sum((-1, -2)) + offsets.sum(-1), float32_bound(d.shape[1], magnitude)


@pytest.mark.parametrize("k", [64, 576, 1088])  # one pair of blocks; K not a multiple of 256; an odd pair count
def test_int4_integer_dot_products_are_exact(ops, k):
    """As for int8, with codes 0..15, scales 1 and offsets 0: every output is the int64 dot product exactly; then
    offsets alone (codes' scale 0) give offset * the sum of the (integer) activations exactly."""
    g = torch.Generator().manual_seed(k)
    x = torch.randint(-127, 128, (8, k), generator=g).float()
    x[:, ::32] = 127.0
    codes, _ = int4_weights(36, k, g)
    ones = kernels.int4_native_layout(codes, torch.stack([torch.ones(36, k // 32), torch.zeros(36, k // 32)], -1))
    offsets = kernels.int4_native_layout(
        codes, torch.stack([torch.zeros(36, k // 32), torch.full((36, k // 32), 2.0)], -1)
    )
    expected, sums = x.long() @ codes.long().T, 2 * x.long().sum(-1, keepdim=True)
    for isa in runnable_isas():
        for m in range(1, 9):
            y = ops.int4_linear(x[:m], ones, isa, AHEAD)
            assert torch.equal(y.long(), expected[:m]) and torch.equal(y, y.round()), kernels.NATIVE_ISAS[isa]
        assert torch.equal(ops.int4_linear(x, offsets, isa, AHEAD), sums.expand(8, 36).float())


@pytest.mark.parametrize("k", [64, 576, 1088])
def test_int4_float_outputs_within_rounding_of_the_reference(ops, k):
    g = torch.Generator().manual_seed(k)
    x = torch.randn(8, k, generator=g)
    codes, scales = int4_weights(44, k, g)
    y_ref, bound = int4_reference(x.numpy(), codes.numpy(), scales.float().numpy())
    for isa in runnable_isas():
        y = ops.int4_linear(x, kernels.int4_native_layout(codes, scales), isa, AHEAD).double().numpy()
        assert (np.abs(y - y_ref) <= bound).all(), (kernels.NATIVE_ISAS[isa], np.abs(y - y_ref).max())


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_a_row_is_bitwise_the_same_alone_and_in_any_batch(ops, kind):
    """Batches of 2 to 8 rows, and of 70 (past the kernel's blocks of 8 and of 64 rows)."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(70, 576, generator=g)
    if kind == "int8":
        w = torch.randint(-127, 128, (64, 576), dtype=torch.int8, generator=g)
        weights = kernels.int8_native_layout(w), torch.rand(64, generator=g)
    else:
        weights = (kernels.int4_native_layout(*int4_weights(64, 576, g)),)
    op = ops.int8_linear if kind == "int8" else ops.int4_linear
    compiled = torch.compile(lambda x, isa: op(x, *weights, isa, AHEAD), fullgraph=True, dynamic=False)
    for isa in runnable_isas():
        torch._dynamo.reset()  # a graph per isa and shape: within Dynamo's recompile limit for each isa
        alone = torch.cat([op(x[i : i + 1], *weights, isa, AHEAD) for i in range(70)])
        for m in [*range(2, 9), 70]:
            assert torch.equal(op(x[:m], *weights, isa, AHEAD), alone[:m]), (kernels.NATIVE_ISAS[isa], m)
        assert torch.equal(compiled(x[:8], isa), alone[:8]) and torch.equal(compiled(x[:1], isa), alone[:1])


def test_the_distance_asked_ahead_changes_no_result(ops):
    """The operators' prefetch argument (Kernels.prefetch_bytes) only asks for cache lines early: the outputs are
    bitwise the same at any distance, none included, on every ISA path; a negative distance is refused."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(3, 1088, generator=g)
    int8 = kernels.int8_native_layout(torch.randint(-127, 128, (64, 1088), dtype=torch.int8, generator=g))
    int4 = kernels.int4_native_layout(*int4_weights(64, 1088, g))
    scales = torch.rand(64, generator=g)
    for isa in runnable_isas():
        for prefetch in (0, 64, 8192):
            assert torch.equal(
                ops.int8_linear(x, int8, scales, isa, prefetch), ops.int8_linear(x, int8, scales, isa, AHEAD)
            )
            assert torch.equal(ops.int4_linear(x, int4, isa, prefetch), ops.int4_linear(x, int4, isa, AHEAD))
    if kernels.runs_avx2():
        weight = torch.randn(64, 1088, generator=g).to(torch.bfloat16)
        assert torch.equal(ops.half_linear(x, weight, 0), ops.half_linear(x, weight, AHEAD))
    with pytest.raises(RuntimeError, match="prefetch"):
        ops.int8_linear(x, int8, scales, 0, -64)


def int8_layer(n: int, k: int, seed: int, native: bool = True) -> kernels.Int8Linear:
    """An Int8Linear of a random [n, k] weight, prepared for kernels_cpu.cpp (or not: native=False)."""
    torch.manual_seed(seed)
    layer = kernels.Int8Linear(k, n)
    layer.weight, layer.scales = qz.quantize_int8(torch.randn(n, k))
    layer.kernels = kernels.Kernels(int8_native=kernels.native_isa() if native else None)
    layer.prepare()
    return layer


def int4_layer(n: int, k: int, seed: int, groupsize: int = 32) -> kernels.Int4Linear:
    """An Int4Linear of a random [n, k] weight, prepared for kernels_cpu.cpp."""
    torch.manual_seed(seed)
    w, layer = torch.randn(n, k), kernels.Int4Linear(k, n, groupsize)
    scales, zeros = qz.int4_group_params(w, groupsize)
    layer.weight = qz.pack_int4(qz.quantize_int4_values(w, scales, zeros, groupsize))
    layer.scales_and_zeros = torch.stack([scales, zeros], -1).transpose(0, 1).contiguous()  # [K / groupsize, N, 2]
    layer.kernels = kernels.Kernels(int4_native=kernels.native_isa())
    layer.prepare()
    return layer


def test_int8_layer_takes_the_kernel(ops):
    """Int8Linear with Kernels.int8_native: any number of rows by the kernel (int8 activations: ~4e-3 from float64
    here), except Kernels.widen_rows or more where the CPU has bfloat16 matrix products: a widened bfloat16
    product; a weight of -128, which the byte products cannot take, and shapes that do not make whole groups of 4
    channels and 64 inputs keep the layer off the kernel."""
    layer = int8_layer(96, 192, 4)
    x = torch.randn(5, 192)
    packed = kernels.int8_native_layout(layer.weight)
    expected = ops.int8_linear(x, packed, layer.scales, kernels.NATIVE_ISAS.index(kernels.native_isa()), AHEAD)
    assert torch.equal(layer(x), expected)
    reference_y = x.double() @ (layer.weight.double() * layer.scales.double()[:, None]).T
    assert ((layer(x) - reference_y).norm() / reference_y.norm()).item() < 1e-2
    assert torch.equal(layer(torch.cat([x] * 4))[:5], expected)  # 20 rows: the kernel too
    layer.kernels = kernels.Kernels(int8_native=kernels.native_isa(), gemm_dtype=torch.bfloat16, widen_rows=20)
    assert torch.equal(layer(torch.cat([x] * 4)[:19])[:5], expected)  # fewer rows: the kernel
    widened = layer(torch.cat([x] * 4))[:5]  # the bfloat16 product
    assert not torch.equal(widened, expected) and ((widened - reference_y).norm() / reference_y.norm()).item() < 1e-2
    for n, k in [(94, 192), (96, 160)]:
        odd = kernels.Int8Linear(k, n)
        odd.weight, odd.scales, odd.kernels = layer.weight[:n, :k].contiguous(), layer.scales[:n], layer.kernels
        odd.prepare()
        assert odd.native_packed is None and odd(x[:, :k]).shape == (5, n)
    layer.weight[0, 0] = -128
    layer.prepare()
    assert layer.native_packed is None


@pytest.mark.parametrize("groupsize", [32, 128])
def test_int4_layer_takes_the_kernel(ops, groupsize):
    """Int4Linear with Kernels.int4_native: its stored groups become kernels_cpu.cpp's per-block float16 scales and
    offsets; any number of rows runs the kernel (where the CPU has no bfloat16 matrix products: see
    test_int4_layer_widens_its_weights_for_many_rows), within int8 activations' error of the float64 product of the
    stored weights. A K that is not a multiple of 64 keeps the layer off the kernel (ATen's kernel then)."""
    layer = int4_layer(96, 256, 5, groupsize)
    codes, (scales, zeros) = kernels.unpack_int4(layer.weight), layer.scales_and_zeros.transpose(0, 1).unbind(-1)
    x = torch.randn(8, 256)
    isa = kernels.NATIVE_ISAS.index(kernels.native_isa())
    assert torch.equal(layer(x), ops.int4_linear(x, layer.native_packed, isa, AHEAD))
    reference_y = x.double() @ qz.dequantize_int4(codes, scales, zeros, groupsize).double().T
    assert ((layer(x) - reference_y).norm() / reference_y.norm()).item() < 1e-2
    assert torch.equal(layer(torch.cat([x] * 3))[:8], layer(x))  # 24 rows: the kernel too, each row as alone
    odd = kernels.Int4Linear(96, 16, 32)
    odd.weight, odd.scales_and_zeros = layer.weight[:16, :48], layer.scales_and_zeros[:3, :16]
    odd.kernels = layer.kernels
    odd.prepare()
    assert odd.native_packed is None and odd.packed is not None


def test_int4_weights_widen_to_the_stored_weights_in_bfloat16(ops):
    """int4_weights: every weight code * scale + offset (float16 scale and offset of its block: the products are exact
    in float32, the sum rounds once), rounded to bfloat16 to nearest even; exactly, whatever path the CPU runs."""
    g = torch.Generator().manual_seed(6)
    codes, scales = int4_weights(40, 192, g)
    w = ops.int4_weights(kernels.int4_native_layout(codes, scales))
    blocks = codes.view(40, 6, 32).double() * scales[..., :1].double() + scales[..., 1:].double()
    assert w.dtype == torch.bfloat16 and torch.equal(w, blocks.view(40, 192).float().bfloat16())


def test_int4_layer_widens_its_weights_for_many_rows(ops):
    """With bfloat16 matrix products (Kernels.gemm_dtype, chosen where the CPU has them), widen_rows rows or more run
    one product with the widened weights: bfloat16 activations and weights, float32 sums, so within bfloat16
    rounding of the float64 product of the stored weights; fewer rows run the kernel."""
    layer = int4_layer(96, 256, 7)
    layer.kernels = kernels.Kernels(int4_native=kernels.native_isa(), gemm_dtype=torch.bfloat16, widen_rows=16)
    x = torch.randn(16, 256)
    codes, (scales, zeros) = kernels.unpack_int4(layer.weight), layer.scales_and_zeros.transpose(0, 1).unbind(-1)
    stored = qz.dequantize_int4(codes, scales, zeros, 32).double()
    widened = ops.int4_weights(layer.native_packed)
    assert torch.equal(layer(x), torch.nn.functional.linear(x.bfloat16(), widened).float())
    reference_y = x.double() @ stored.T
    assert ((layer(x) - reference_y).norm() / reference_y.norm()).item() < 1e-2
    fewer = x[:15]
    isa = kernels.NATIVE_ISAS.index(kernels.native_isa())
    assert torch.equal(layer(fewer), ops.int4_linear(fewer, layer.native_packed, isa, AHEAD))


@pytest.mark.parametrize(
    "units, unit_bytes", [(17920, 3072), (8960, 3072), (2240, 12288), (7, 5 << 20), (5, 22 << 20), (3, 40 << 20)]
)
def test_widened_blocks_are_the_fewest_within_the_kept_size(units, unit_bytes):
    """widened_blocks: every unit once, in blocks of whole units each within KEPT_BLOCK_BYTES (a unit alone larger
    goes alone), so few that one block fewer could not hold them all, of equal size but for a smaller last one."""
    blocks = kernels.widened_blocks(units, unit_bytes)
    most = kernels.KEPT_BLOCK_BYTES // unit_bytes
    assert sum(blocks) == units
    assert all(b * unit_bytes <= kernels.KEPT_BLOCK_BYTES for b in blocks) if most else blocks == [1] * units
    assert (len(blocks) - 1) * most < units
    assert len(set(blocks[:-1])) <= 1 and blocks[-1] <= blocks[0]


def test_products_widen_their_weights_a_block_of_channels_at_a_time(ops, monkeypatch):
    """A weight whose widened copy exceeds KEPT_BLOCK_BYTES (here made small) is widened and multiplied a block of
    channels at a time: int8 weights widened to float32 give the float64 product within float32 rounding, to bfloat16
    within bfloat16 rounding; int4 weights the one product of all of them widened, within float32 rounding."""
    monkeypatch.setattr(kernels, "KEPT_BLOCK_BYTES", 20 << 10)
    layer = int8_layer(100, 192, 8, native=False)
    x = torch.randn(16, 192)
    reference_y = x.double() @ (layer.weight.double() * layer.scales.double()[:, None]).T
    assert len(kernels.widened_blocks(100, 192 * 4)) == 4
    for dtype, bound in ((torch.float32, 1e-6), (torch.bfloat16, 1e-2)):
        y = kernels.cpu_product(x.to(dtype), layer.weight, layer.scales, kernels.Kernels(gemm_dtype=dtype))
        assert y.shape == (16, 100) and ((y.double() - reference_y).norm() / reference_y.norm()).item() < bound
    layer = int4_layer(96, 256, 9)
    layer.kernels = kernels.Kernels(int4_native=kernels.native_isa(), gemm_dtype=torch.bfloat16, widen_rows=16)
    assert len(kernels.widened_blocks(24, 4 * 256 * 2)) == 3
    x = torch.randn(16, 256)
    whole = torch.nn.functional.linear(x.bfloat16(), ops.int4_weights(layer.native_packed))
    y = layer(x)
    assert torch.allclose(y, whole.float(), rtol=1e-5, atol=1e-5 * whole.float().abs().max().item())


@pytest.mark.parametrize("make", [int8_layer, int4_layer], ids=["int8", "int4"])
def test_joined_pair_equals_each_layer(ops, make, monkeypatch):
    """join_native: a gate and up projection in one kernels_cpu.cpp call give each layer's own outputs bitwise (a
    channel's sum never sees the others), for any number of rows; the layers' layouts become views of the joined one
    (no second copy); many rows where the CPU widens to bfloat16 instead go to each layer's widened product (int8), or
    to one product of the joined layout widened (int4: within float32 rounding of each layer's, as the matrix product
    may sum in another order for another number of outputs), and a layer prepared again goes back to one call per
    layer."""
    gate, up = make(96, 192, 6), make(64, 192, 7)
    alone = [layer.native_packed.clone() for layer in (gate, up)]
    kernels.join_native(gate, up)
    assert gate.native_packed.data_ptr() == gate.joined_packed.data_ptr()
    assert all(torch.equal(layer.native_packed, packed) for layer, packed in zip((gate, up), alone))
    calls = []
    native_linear = kernels.native_linear
    monkeypatch.setattr(kernels, "native_linear", lambda *a: calls.append(a[2].shape[0]) or native_linear(*a))
    x = torch.randn(20, 192)
    for rows in (1, 3, 8, 20):
        g, u = kernels.pair_linear(gate, up, x[:rows])
        assert torch.equal(g, gate(x[:rows])) and torch.equal(u, up(x[:rows]))
    # per row count: the pair's one call of 40 groups of channels, then each layer's own (24, 16)
    assert calls == [40, 24, 16] * 4
    widening = dataclasses.replace(gate.kernels, gemm_dtype=torch.bfloat16, widen_rows=20)
    gate.kernels = up.kernels = widening
    g, u = kernels.pair_linear(gate, up, x)
    for got, layer in ((g, gate), (u, up)):
        if make is int8_layer:
            assert torch.equal(got, layer(x))
        else:
            assert torch.allclose(got, layer(x), rtol=1e-5, atol=1e-5 * layer(x).abs().max().item())
    assert len(calls) == 12
    gate.prepare()
    assert gate.joined_packed is None


def test_joined_pair_needs_two_native_layers_alike(ops):
    """A pair joins only where both layers run the kernel, of one kind, without bias."""
    native, plain = int8_layer(96, 192, 8), int8_layer(96, 192, 9, native=False)
    for first, second in [(native, plain), (native, int4_layer(96, 192, 10))]:
        kernels.join_native(first, second)
        assert first.joined_packed is None
        x = torch.randn(2, 192)
        g, u = kernels.pair_linear(first, second, x)
        assert torch.equal(g, first(x)) and torch.equal(u, second(x))


def test_without_a_compiler_the_pytorch_paths_run(tiny_checkpoint, tmp_path):
    """CXX pointing at no compiler: a float checkpoint never tries the build; an int8 one says in one line that
    kernels_cpu.cpp did not build and runs on ATen's kernels; --kernels native is refused after that line."""
    int8 = qz.quantize_checkpoint(Path(tiny_checkpoint) / "model.pth", "int8")
    env = os.environ | {"CXX": str(tmp_path / "no-compiler"), "TORCH_EXTENSIONS_DIR": str(tmp_path / "ext")}

    def generate(checkpoint: Path, *flags: str) -> tuple[subprocess.CompletedProcess, list[str]]:
        command = [sys.executable, str(ROOT / "generate.py"), "--checkpoint_path", str(checkpoint), "--prompt", "Hi"]
        command += ["--max_new_tokens", "4", "--temperature", "0", "--json", *flags]
        run = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL)
        return run, [line for line in run.stderr.splitlines() if "kernels_cpu.cpp" in line]

    run, said = generate(Path(tiny_checkpoint) / "model.pth")
    assert run.returncode == 0 and said == [], run.stderr[-2000:]
    run, said = generate(int8)
    assert run.returncode == 0 and len(said) == 1 and "did not build" in said[0], run.stderr[-2000:]
    stats = run.stdout.splitlines()[-1]
    assert "no-compiler" in said[0] and '"int8_native": null' in stats and '"int4_native": null' in stats
    refused, said = generate(int8, "--kernels", "native")
    assert refused.returncode == 1 and len(said) == 2, refused.stderr[-2000:]
    assert "did not build" in said[0] and said[1].startswith("error: --kernels native")
    assert not (tmp_path / "ext").exists() or not any((tmp_path / "ext").rglob("*.so"))


@pytest.mark.skipif(not kernels.runs_avx2(), reason="half_linear is kernels_cpu.cpp's AVX2 code")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_product_within_float32_rounding(ops, dtype):
    """half_linear: bfloat16 / float16 weights (widened exactly) times float32 rows, within float32 rounding of the
    float64 product (K units in the last place of the magnitudes' sum; a lost or doubled lane of 8 inputs misses
    by far more); each row the same alone or beside others. A Linear with Kernels.half_native takes it for one row,
    eager and compiled, and the fused product for two; its output rounds to the weights' dtype as the fused one's."""
    torch.manual_seed(0)
    weight, x = torch.randn(94, 328).to(dtype), torch.randn(3, 328).to(dtype).float()  # x as the layer is given it
    y = ops.half_linear(x, weight, AHEAD)
    reference_y = x.double() @ weight.double().T
    assert (y.double() - reference_y).abs().le(328 * 2.0**-24 * (x.double().abs() @ weight.double().abs().T)).all()
    assert torch.equal(ops.half_linear(x[1:2], weight, AHEAD), y[1:2])
    layer = kernels.Linear(328, 94, bias=False)
    layer.weight.data = weight
    layer.kernels = kernels.Kernels("fused", half_native=True)
    with torch.no_grad():
        assert torch.equal(layer(x[:1].to(dtype), 8), y[:1].to(dtype))
        assert torch.equal(torch.compile(layer, fullgraph=True, dynamic=False)(x[:1].to(dtype), 8), y[:1].to(dtype))
        two = layer(x[:2].to(dtype), 8)  # eagerly the fused product's arithmetic, unrolled
        fused_two = torch.stack([(row * weight.float()).sum(-1) for row in x[:2].to(dtype).float()]).to(dtype)
    assert torch.equal(two, fused_two)


@pytest.mark.parametrize("rows", [1, 16, 100])
def test_onednn_float32_product_eager_and_compiled(rows):
    """Kernels.float_gemm "onednn": float32 products by oneDNN, within float32 rounding of the float64 product (a
    bound of K units in the last place of the magnitudes' sum), eager and inside a compiled step (its own operator:
    inductor cannot lower oneDNN's linear of a weight that is an input)."""
    torch.manual_seed(rows)
    layer = kernels.Linear(320, 96, bias=True)
    layer.kernels = kernels.Kernels(float_gemm="onednn")
    x = torch.randn(rows, 320)
    with torch.no_grad():
        eager = layer(x, 0)
        compiled = torch.compile(layer, fullgraph=True, dynamic=False)(x, 0)
        reference_y = x.double() @ layer.weight.double().T + layer.bias.double()
        bound = 320 * 2.0**-24 * (x.double().abs() @ layer.weight.double().abs().T + layer.bias.double().abs())
    assert (eager.double() - reference_y).abs().le(bound).all()
    assert torch.equal(compiled, eager)


ONEDNN_PACKED = kernels.Kernels("fused", "fused", float_gemm="onednn", packed_float=True)


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="oneDNN is not in this build of torch")
@pytest.mark.parametrize("rows", [1, 7, 8, 100])
def test_products_of_many_rows_read_the_weights_copy_in_onednn_layout(rows):
    """Kernels.packed_float: set_kernels keeps a float32 layer's weight a second time in oneDNN's layout (not in the
    state dict), which products of PACKED_ROWS rows or more read, within float32 rounding of the float64 product,
    eager and compiled alike; fewer rows read the weight itself. Which copy a product read shows once the weight
    itself is zeroed."""
    # Linear.forward compiles once per test and shape in this module: within Dynamo's recompile limit alone too
    torch._dynamo.reset()
    torch.manual_seed(rows)
    layer = kernels.Linear(320, 96, bias=True)
    kernels.set_kernels(layer, ONEDNN_PACKED)
    assert layer.packed_weight is not None and set(layer.state_dict()) == {"weight", "bias"}
    x = torch.randn(rows, 320)
    with torch.no_grad():
        reference_y = x.double() @ layer.weight.double().T + layer.bias.double()
        bound = 320 * 2.0**-24 * (x.double().abs() @ layer.weight.double().abs().T + layer.bias.double().abs())
        layer.weight.zero_()
        eager = layer(x, 8)
        compiled = torch.compile(layer, fullgraph=True, dynamic=False)(x, 8)
    if rows >= kernels.PACKED_ROWS:
        assert (eager.double() - reference_y).abs().le(bound).all()
    else:
        assert torch.equal(eager, layer.bias.expand(rows, -1))
    assert torch.allclose(compiled, eager, rtol=1e-6, atol=1e-6)


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="oneDNN is not in this build of torch")
def test_a_model_for_batched_steps_keeps_onednn_copies_of_its_float32_weights():
    """Kernels.choose keeps the copies where the run's steps reach PACKED_ROWS rows and the float32 products run
    oneDNN; with them, the tied output's among them, a batch's logits are those of the model without them (on an Intel
    CPU that one runs MKL: float32 sums in another order, ~1e-6 of the logits' norm after 30 layers, where one layer
    reading another's copy moves them by ~0.1)."""
    chosen = [kernels.Kernels.choose(CPU, True, rows=rows).packed_float for rows in (1, 7, 8, 64)]
    onednn = kernels.Kernels.choose(CPU, True).float_gemm == "onednn"
    assert chosen == ([False, False, True, True] if onednn else [False] * 4)
    plain = load_model(SMOLLM2_DIR, kernels=kernels.Kernels.choose(CPU, True))
    packed = load_model(SMOLLM2_DIR, kernels=ONEDNN_PACKED)
    linears = [m for m in packed.modules() if isinstance(m, kernels.Linear)]
    assert packed.output is None and packed.packed_output is not None and plain.packed_output is None
    assert linears and all(m.packed_weight is not None for m in linears)
    x = torch.randint(100, 1000, (16, 12))
    with torch.no_grad():
        for m in (plain, packed):
            m.setup_caches(16, 64)
        steps = [m(x, torch.arange(12), fused_rows=8) for m in (plain, packed)]
    assert ((steps[0] - steps[1]).norm() / steps[1].norm()).item() < 1e-4


def test_kernels_record_the_float32_product():
    """The choice is recorded in the run's figures: oneDNN where the CPU is not Intel's (MKL is Intel's library)."""
    chosen = kernels.Kernels.choose(CPU, False).describe()
    intel = "GenuineIntel" in kernels.cpuinfo_words()
    assert chosen["float_gemm"] == ("blas" if intel or not torch.backends.mkldnn.is_available() else "onednn")


def test_half_precision_products_and_prefetches_chosen_per_cpu():
    """A bfloat16/float16 model's one-row products take half_linear wherever kernels_cpu.cpp builds and its AVX2 code
    may run: eager everywhere, compiled except on AMD CPUs with AVX-512, where the fused product reads faster (its
    prefetched reads beat the fused product's on Intel's AVX-512 and on AVX2-only CPUs: docs/performance.md). float32
    and --kernels fused stay off it, and so does a process held below AVX2 (half_linear has no scalar path). The
    native kernels ask for cache lines ahead except on AMD CPUs with AVX-512."""
    wherever = kernels.native_kernels() and kernels.runs_avx2()
    amd_avx512 = {"AuthenticAMD", "avx512f"} <= kernels.cpuinfo_words()
    for compiled in (False, True):
        expected = wherever and not (compiled and amd_avx512)
        assert kernels.Kernels.choose(CPU, compiled, half=True).describe()["half_native"] == expected
        assert kernels.Kernels.choose(CPU, compiled).describe()["prefetch_bytes"] == (0 if amd_avx512 else AHEAD)
        assert not kernels.Kernels.choose(CPU, compiled).half_native
        assert not kernels.Kernels.choose(CPU, compiled, "fused", half=True).half_native
    choice = "import torch, kernels; print(kernels.Kernels.choose(torch.device('cpu'), False, half=True).half_native)"
    env = {**os.environ, "ATEN_CPU_CAPABILITY": "default"}
    run = subprocess.run([sys.executable, "-c", choice], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert run.stdout.split()[-1:] == ["False"], run.stderr


def attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float):
    """softmax(q k^T * scale) v in float64, query head i reading KV head i // (H / H_kv)."""
    group = q.shape[1] // k.shape[1]
    k, v = (t.double().repeat_interleave(group, 1) for t in (k, v))
    scores = (q.double() @ k.transpose(-1, -2) * scale).masked_fill(~mask, float("-inf"))
    return scores.softmax(-1) @ v


def decode_inputs(rows: int, heads: int, kv_heads: int, head_dim: int, length: int, g: torch.Generator):
    """A decode step's q [rows, H, 1, D] as the model makes it (a transpose: not contiguous), keys and values as
    views of a longer cache of more rows (its strides), and a mask [rows, 1, 1, length] with holes where each query
    sees its own position; the masked positions' values are 1e4, which any weight on them would show."""
    q = torch.randn(rows, 1, heads, head_dim, generator=g).transpose(1, 2) * 3  # sharp softmaxes, not only flat ones
    mask = torch.rand(rows, 1, 1, length, generator=g) < 0.7
    mask[..., -1] = True
    cache_k, cache_v = (torch.randn(rows + 2, kv_heads, length + 20, head_dim, generator=g) for _ in range(2))
    cache_v[:rows, :, :length].masked_fill_(~mask.transpose(2, 3), 1e4)
    return q, cache_k[:rows, :, :length], cache_v[:rows, :, :length], mask


@pytest.mark.skipif(not kernels.runs_avx2(), reason="decode_attention is kernels_cpu.cpp's AVX2 code")
@pytest.mark.parametrize("heads, kv_heads, head_dim", [(9, 3, 64), (7, 1, 128), (10, 2, 64), (8, 8, 16), (21, 3, 64)])
def test_decode_attention_within_float32_rounding_of_float64(ops, heads, kv_heads, head_dim):
    """Query heads per KV head 3, 7, 5 (4 + 1 a pass over the values), 1 and 7 (4 + 3), over 1, 13 (not whole passes
    of 8 positions) and 300 positions. The outputs are weighted means of values of about 1 in size: float32 rounding
    of a few hundred terms stays far below 2e-5, and a weight misplaced by a position, a head or the mask far above."""
    g = torch.Generator().manual_seed(7)
    for length in (1, 13, 300):
        q, k, v, mask = decode_inputs(5, heads, kv_heads, head_dim, length, g)
        y = ops.decode_attention(q, k, v, mask, head_dim**-0.5)
        assert y.shape == q.shape and y.is_contiguous()
        error = (y.double() - attention_reference(q, k, v, mask, head_dim**-0.5)).abs().max().item()
        assert error < 2e-5, (length, error)


@pytest.mark.skipif(not kernels.runs_avx2(), reason="decode_attention is kernels_cpu.cpp's AVX2 code")
def test_decode_attention_of_a_row_is_bitwise_the_same_in_any_batch_and_compiled(ops):
    """A row's work is the same whatever the other rows are, and a compiled step (the operator's fake, keys and
    values sliced from the cache inside the graph, at two lengths) calls the same kernel; shapes it cannot take are
    refused with a message."""
    g = torch.Generator().manual_seed(8)
    q, k, v, mask = decode_inputs(8, 9, 3, 64, 40, g)
    alone = torch.cat(
        [ops.decode_attention(q[i : i + 1], k[i : i + 1], v[i : i + 1], mask[i : i + 1], 0.125) for i in range(8)]
    )
    for rows in range(2, 9):
        assert torch.equal(ops.decode_attention(q[:rows], k[:rows], v[:rows], mask[:rows], 0.125), alone[:rows])
    cache_k, cache_v = k.as_strided(k.shape, k.stride()), v.as_strided(v.shape, v.stride())
    step = torch.compile(
        lambda q, mask: kernels.native_attention(
            q, cache_k[:, :, : mask.shape[-1]], cache_v[:, :, : mask.shape[-1]], mask, 0.125
        ),
        fullgraph=True,
    )
    for length in (40, 33):
        expected = ops.decode_attention(q, k[:, :, :length], v[:, :, :length], mask[..., :length], 0.125)
        assert torch.equal(step(q, mask[..., :length]), expected), length
    with pytest.raises(RuntimeError, match="multiple of 16"):
        ops.decode_attention(q[..., :40], k[..., :40], v[..., :40], mask, 0.125)
    with pytest.raises(RuntimeError, match="multiple of H_kv"):
        ops.decode_attention(q[:, :8], k[:, :3], v[:, :3], mask, 0.125)


def test_decode_attention_chosen_for_steps_of_several_rows(tiny_checkpoint, monkeypatch):
    """Runs whose decode steps compute NATIVE_ATTENTION_ROWS rows or more (a batch, a server's slots) take the kernel
    for those steps wherever kernels_cpu.cpp builds and its AVX2 code may run: not single-row runs, --kernels fused
    or library, nor a process held below AVX2. A model's step of 4 rows calls it, its prefill and a step of 3 rows do
    not (nor soft-capped, half-precision or odd-sized heads); the logits stay within float32 rounding of float64's."""
    wherever = kernels.native_kernels() and kernels.runs_avx2()
    rows = kernels.NATIVE_ATTENTION_ROWS
    assert kernels.Kernels.choose(CPU, True, rows=16).attention_rows == (rows if wherever else None)
    assert kernels.Kernels.choose(CPU, False, rows=rows).describe()["attention_rows"] == (rows if wherever else None)
    assert kernels.Kernels.choose(CPU, True).attention_rows is None
    assert all(kernels.Kernels.choose(CPU, True, m, rows=16).attention_rows is None for m in ("fused", "library"))
    choice = "import torch, kernels; print(kernels.Kernels.choose(torch.device('cpu'), True, rows=16).attention_rows)"
    env = {**os.environ, "ATEN_CPU_CAPABILITY": "default"}
    run = subprocess.run([sys.executable, "-c", choice], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert run.stdout.split()[-1:] == ["None"], run.stderr
    chosen = kernels.Kernels(attention_rows=rows)
    q, k = torch.randn(rows, 9, 1, 64), torch.randn(rows, 3, 10, 64)
    assert kernels.runs_native_attention(q, k, k, None, chosen)
    assert not kernels.runs_native_attention(q, k, k, None, kernels.Kernels())
    assert not kernels.runs_native_attention(q[: rows - 1], k[: rows - 1], k[: rows - 1], None, chosen)
    assert not kernels.runs_native_attention(torch.randn(rows, 9, 2, 64), k, k, None, chosen)
    assert not kernels.runs_native_attention(q, k, k, 50.0, chosen)
    assert not kernels.runs_native_attention(q.bfloat16(), k.bfloat16(), k.bfloat16(), None, chosen)
    assert not kernels.runs_native_attention(q[..., :40], k[..., :40], k[..., :40], None, chosen)
    if not wherever:
        return
    calls = []
    monkeypatch.setattr(
        model_module, "native_attention", lambda *a: calls.append(a[0].shape[0]) or kernels.native_attention(*a)
    )
    prompts = torch.randint(0, 100, (rows, 12), generator=torch.Generator().manual_seed(9))
    logits = {}
    for name, dtype, chosen_kernels in [
        ("native", torch.float32, chosen),
        ("float64", torch.float64, kernels.Kernels()),
    ]:
        model = load_model(tiny_checkpoint, dtype=dtype, kernels=chosen_kernels)
        model.setup_caches(rows, 16)
        with torch.no_grad():
            model(prompts, torch.arange(12))
            logits[name] = model(prompts[:, -1:], torch.tensor([12]))
            model(prompts[: rows - 1, -1:], torch.tensor([13]))
    layers = len(model.layers)
    assert calls == [rows] * layers  # the float32 model's step of 4 rows only
    error = ((logits["native"].double() - logits["float64"]).norm() / logits["float64"].norm()).item()
    assert error < 1e-5, error


PREFILL_FAULTS = """
import resource, sys, torch
from generate import load_model
torch.set_num_threads(2)
model = load_model(sys.argv[1], "cpu", torch.bfloat16)
model.setup_caches(1, 256)
x, faults = torch.randint(100, 1000, (1, 128)), []
for _ in range(4):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    with torch.no_grad():
        model(x, torch.arange(128), last_only=True, fused_rows=0, kv_length=128)
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(*faults)
"""


PRODUCT_FAULTS = """
import resource, torch, kernels
kernels.keep_freed_memory()
torch.set_num_threads(2)
# int8 weights whose float32 copy is 2 MiB over KEPT_BLOCK_BYTES, times 64 rows
n = (kernels.KEPT_BLOCK_BYTES + (2 << 20)) // (4 * 2048)
weight, scales = torch.randint(-127, 128, (n, 2048), dtype=torch.int8), torch.rand(n)
x, faults = torch.randn(64, 2048), []
for _ in range(12):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    kernels.cpu_product(x, weight, scales, kernels.Kernels())
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(*faults)
"""


@pytest.mark.skipif(not hasattr(__import__("ctypes").CDLL(None), "mallopt"), reason="the C library has no mallopt")
def test_a_product_whose_widened_weights_exceed_the_kept_size_reuses_memory():
    """A weight whose widened copy is larger than malloc keeps (KEPT_BLOCK_BYTES: a large model's gate and up
    projections, widened for a prefill) is widened in blocks within it, which reuse the memory the blocks before
    freed: after the first products, next to no page faults, where one copy of it would be mapped afresh at every
    product (some 8,700 page faults each here). The first products settle the heap, how many of them varies from run
    to run (glibc keeps a heap per thread), so the last 4 of 12 are checked."""
    run = subprocess.run([sys.executable, "-c", PRODUCT_FAULTS], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    faults = [int(n) for n in run.stdout.split()]
    assert max(faults[8:]) < 1000, faults


@pytest.mark.skipif(not hasattr(__import__("ctypes").CDLL(None), "mallopt"), reason="the C library has no mallopt")
def test_a_prefill_reuses_the_memory_its_widened_weights_freed():
    """The default model in bfloat16, prefilled again and again in a fresh process: its products widen each weight to
    float32 (cpu_product, on CPUs without bfloat16 matrix products). With keep_freed_memory (load_model's set_kernels
    calls it), the copies reuse the memory the previous ones freed: after the first prefills, few page faults (most
    often none; now and then a prefill maps a megabyte or few afresh, up to some 1,700 faults). glibc's default
    behaviour depends on the order of earlier allocations; in some runs it maps every copy afresh, 12,000 to 23,000
    page faults each prefill, so the bound sits between the two."""
    assert (SMOLLM2_DIR / "model.pth").is_file(), "run: bash scripts/prepare.sh"
    command = [sys.executable, "-c", PREFILL_FAULTS, str(SMOLLM2_DIR / "model.pth")]
    run = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL)
    assert run.returncode == 0, run.stderr[-2000:]
    faults = [int(n) for n in run.stdout.split()]
    assert max(faults[2:]) < 6000, faults


def huge_page_eligible(address: int) -> bool:
    """Whether the kernel may back the mapping holding address with transparent huge pages (/proc/self/smaps)."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        first = line.split()[0]
        if not first.endswith(":"):  # a mapping's header: "start-end perms ..."
            start, end = (int(a, 16) for a in first.split("-"))
            inside = start <= address < end
        elif inside and first == "THPeligible:":
            return line.split()[1] == "1"
    raise AssertionError(f"{address:#x} is in no mapping")


@pytest.mark.skipif(not kernels.transparent_huge_pages(), reason="no transparent huge pages here")
def test_weights_moved_into_huge_pages_keep_their_values_and_sharing(tiny_checkpoint):
    plain = load_model(tiny_checkpoint)
    huge = load_model(tiny_checkpoint, kernels=kernels.Kernels(huge_pages=True))
    assert kernels.Kernels.choose(CPU, True).huge_pages
    assert plain.state_dict().keys() == huge.state_dict().keys()
    advised_only = "[madvise]" in kernels.THP_MODES.read_text()  # "always" gives any large mapping huge pages
    for name, t in huge.state_dict().items():
        assert torch.equal(t, plain.state_dict()[name]), name
        if name != "tok_embeddings.weight":  # a lookup table (the output projection has its own weight) stays
            assert huge_page_eligible(t.data_ptr()), name
        assert not (advised_only and huge_page_eligible(plain.state_dict()[name].data_ptr())), name
    assert not (advised_only and huge_page_eligible(huge.tok_embeddings.weight.data_ptr()))
    x = torch.randint(0, 100, (1, 12))
    plain.setup_caches(1, 12), huge.setup_caches(1, 12)
    with torch.no_grad():
        assert torch.equal(huge(x, torch.arange(12)), plain(x, torch.arange(12)))
    # A tied output projection and a view of a weight share memory before the move, and after it
    model = load_model(tiny_checkpoint)
    model.output.weight = model.tok_embeddings.weight
    model.layers[0].register_buffer("first_rows", model.tok_embeddings.weight[:4])
    storages = {t.untyped_storage().data_ptr() for t in model.parameters()}
    kernels.in_huge_pages(model)
    assert huge_page_eligible(model.tok_embeddings.weight.data_ptr())  # read whole by the output projection: moved
    assert model.output.weight.data_ptr() == model.tok_embeddings.weight.data_ptr()
    assert model.layers[0].first_rows.data_ptr() == model.tok_embeddings.weight.data_ptr()
    assert torch.equal(model.layers[0].first_rows, model.tok_embeddings.weight[:4])
    # each storage moved has one of its own (torch.compile's nested regions refuse weights that share one)
    assert len({t.untyped_storage().data_ptr() for t in model.parameters()}) == len(storages)


RELEASED_AFTER_MOVE = """
import torch, kernels
kernels.keep_freed_memory()
def resident():
    return int(open("/proc/self/statm").read().split()[1]) * 4096
# 48 weights of 1 MiB from malloc's heap: below its mmap threshold each, and below its trim threshold in all
model = torch.nn.Sequential(*[torch.nn.Linear(1024, 512, bias=False).bfloat16() for _ in range(48)])
before = resident()
kernels.in_huge_pages(model)
print((resident() - before) / (48 << 20))
"""


@pytest.mark.skipif(not kernels.transparent_huge_pages(), reason="no transparent huge pages here")
def test_weights_moved_into_huge_pages_give_their_old_memory_back():
    """The weights' copies in the mapping take memory, and the heap blocks they leave are given back: the process
    grows by far less than the weights (it would grow by all of them with the freed blocks kept)."""
    done = subprocess.run([sys.executable, "-c", RELEASED_AFTER_MOVE], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert float(done.stdout) < 0.5


def test_quantized_weights_and_their_layouts_moved_into_huge_pages_give_the_same_logits(tiny_checkpoint):
    choice = kernels.Kernels.choose(CPU, False, quantized=True)
    x = torch.randint(0, 100, (1, 12))
    logits = []
    for huge in (False, True):
        model = qz.quantize_model(
            load_model(tiny_checkpoint), "int8", kernels=dataclasses.replace(choice, huge_pages=huge)
        )
        model.setup_caches(1, 12)
        with torch.no_grad():
            logits.append(model(x, torch.arange(12)))
    assert torch.equal(*logits)
