"""The compiled decode step: the tokens of eager, for batches too, with no recompilation across steps or sampling
values."""

import contextlib

import pytest
import torch
import torch._dynamo

from conftest import assert_same_greedy
from decode import compile_steps, plain_steps, token_steps
from generate import generate, load_model
from kernels import Kernels, native_isa, native_kernels
from quantize import quantize_checkpoint
from sampling import SamplingParams, sampler_state

pytestmark = pytest.mark.numerics

# Compiled and eager logits differ by rounding (fused kernels sum in another order): ~1e-6 on this float32
# model. Greedy outputs may part only at a tie closer than MARGIN; a miscompiled step differs by far more.
MARGIN = 1e-4
PROMPTS = [[7, 8, 9, 10, 11], [3], [20, 21, 22, 23, 24, 25, 26, 27, 28]]  # different lengths: left padding


def test_compiled_equals_eager_without_recompiling(tiny_checkpoint, device):
    """On CUDA, the compiled steps replay CUDA graphs. On a CPU the weights are in huge pages, as generate.py loads
    them there (kernels.in_huge_pages: a storage each, which torch.compile's nested regions need)."""
    model = load_model(tiny_checkpoint, device, kernels=Kernels(huge_pages=device.type == "cpu"))
    eager = generate(model, PROMPTS, 50).tokens
    counters = torch._dynamo.utils.counters
    torch._dynamo.reset()
    counters.clear()
    steps = compile_steps(device)
    generate(model, PROMPTS, 2, steps=steps)  # compiles
    # The cache is set up for these shapes already: 50 more steps must reuse the one graph.
    with torch._dynamo.config.patch(error_on_recompile=True):
        compiled = generate(model, PROMPTS, 50, steps=steps).tokens
    assert counters["stats"]["unique_graphs"] == 1 and not counters["graph_break"]
    for prompt, got, expected in zip(PROMPTS, compiled, eager):
        assert_same_greedy(model, prompt, got, expected, MARGIN)

    # Sampling compiles one more graph; new values of every setting reuse it.
    generate(model, PROMPTS, 3, steps=steps, sampling=SamplingParams(temperature=0.7, seed=0))
    graphs = counters["stats"]["unique_graphs"]
    settings = SamplingParams(
        temperature=1.3,
        top_k=5,
        top_p=0.8,
        min_p=0.05,
        repetition_penalty=1.2,
        presence_penalty=0.5,
        frequency_penalty=0.3,
        seed=1,
    )
    with torch._dynamo.config.patch(error_on_recompile=True):
        compiled = generate(model, PROMPTS, 30, steps=steps, sampling=settings).tokens
    assert counters["stats"]["unique_graphs"] == graphs == 2 and not counters["graph_break"]
    # Same seed, same draws: the compiled sampler picks what the eager one picks. (A draw is the argmax of p / E
    # over the vocabulary; a relative rounding difference d in p changes it only when the two largest ratios are
    # within d, which happens to about d / 2 of draws (simulated): with d ~ 1e-6, ~5e-5 over these 90 draws.)
    assert compiled == generate(model, PROMPTS, 30, sampling=settings).tokens


def test_compiled_decode_steps_never_wait_for_the_gpu(tiny_checkpoint, device):
    """Between the host's looks at the tokens, compiled decode steps (CUDA graphs) only queue work: CUDA's sync debug
    mode makes any call that waits for the GPU an error. So do speculative decoding's plain rounds in a row."""
    if device.type != "cuda":
        pytest.skip("waiting for the device is a CUDA matter: a CPU step computes as it is called")
    model = load_model(tiny_checkpoint, device)
    steps = compile_steps(device)
    for sampling in (SamplingParams(), SamplingParams(temperature=0.7, top_p=0.9, repetition_penalty=1.1, seed=0)):
        produced = token_steps(model, PROMPTS[:2], 24, sampling, steps)
        for _ in range(4):  # the prefill, then decode steps that compile and record their graphs
            next(produced)
        with no_waiting(device):
            for _ in range(16):
                next(produced)
    sampling = SamplingParams(temperature=0.7, seed=0)
    state = sampler_state(sampling, [PROMPTS[0]], model.config.vocab_size, device)
    run = (state, sampling, sampling.generator(device), model.max_seq_length)
    token = torch.tensor([[PROMPTS[0][-1]]], device=device)
    plain_steps(model, steps, token, 8, 4, *run)  # compiles and records its graphs
    with no_waiting(device):
        plain_steps(model, steps, token, 8, 16, *run)


def test_compiled_int8_kv_cache_equals_eager(tiny_checkpoint, device):
    """--kv_cache_dtype int8 compiled (on CUDA, CUDA graphs that write and read the codes and their scales) gives
    eager's tokens, one graph for every step. On a CPU test_real_model checks this on the default model."""
    if device.type == "cpu":
        pytest.skip("a CPU's compiled int8 cache is checked on the real model (test_real_model.py)")
    model = load_model(tiny_checkpoint, device)
    model.kv_cache_dtype = torch.int8
    eager = generate(model, PROMPTS, 40).tokens
    torch._dynamo.reset()
    steps = compile_steps(device)
    generate(model, PROMPTS, 2, steps=steps)  # compiles
    with torch._dynamo.config.patch(error_on_recompile=True):
        compiled = generate(model, PROMPTS, 40, steps=steps).tokens
    for prompt, got, expected in zip(PROMPTS, compiled, eager):
        assert_same_greedy(model, prompt, got, expected, MARGIN)


@contextlib.contextmanager
def no_waiting(device):
    """Inside, any call that waits for the GPU is an error (CUDA's sync debug mode)."""
    torch.cuda.synchronize(device)
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_compiled_prefill_equals_eager_for_any_prompt_length(tiny_checkpoint):
    """generate.py --compile_prefill: the prefill compiled, static at its first prompt length and then dynamic (one
    more graph for every later length), gives eager's first tokens."""
    model = load_model(tiny_checkpoint)
    torch._dynamo.reset()
    steps = compile_steps(torch.device("cpu"), decode=False, prefill=True)
    for prompts in (PROMPTS, [[5, 6, 7]], [list(range(3, 20))]):
        for prompt, got, expected in zip(
            prompts, generate(model, prompts, 1, steps=steps).tokens, generate(model, prompts, 1).tokens
        ):
            assert_same_greedy(model, prompt, got, expected, MARGIN)


@pytest.mark.skipif(not native_kernels(), reason="kernels_cpu.cpp is not built here")
@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_compiled_prefill_of_widened_quantized_layers_equals_eager(tiny_checkpoint, mode):
    """Where the CPU has bfloat16 matrix products (AVX512-BF16, AMX), an int8/int4 prefill widens the weights for one
    bfloat16 product, the gate and up projections' joined layout at once: compiled as eager, with eager's first tokens
    (the widened products round activations to bfloat16, so a compiled graph's other float32 rounding may move a
    logit by ~1e-3, not by what a wrong product moves it)."""
    path = quantize_checkpoint(tiny_checkpoint / "model.pth", mode, 32)
    widening = Kernels(int8_native=native_isa(), int4_native=native_isa(), gemm_dtype=torch.bfloat16, widen_rows=4)
    model = load_model(path, kernels=widening)
    assert model.layers[0].feed_forward.w1.joined_packed is not None
    torch._dynamo.reset()
    steps = compile_steps(torch.device("cpu"), decode=False, prefill=True)
    for prompt, got, expected in zip(
        PROMPTS, generate(model, PROMPTS, 1, steps=steps).tokens, generate(model, PROMPTS, 1).tokens
    ):
        assert_same_greedy(model, prompt, got, expected, 0.05)
