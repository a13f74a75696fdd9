"""SmolLM2-135M-Instruct, prepared by scripts/prepare.sh, against transformers loading the same GGUF file."""

import pytest
import torch

from conftest import SMOLLM2_DIR, SMOLLM2_GGUF, SMOLLM2_PROMPTS, assert_same_greedy
from decode import Steps, compile_steps
from eval import perplexity
from generate import generate, load_model
from kernels import Kernels, native_kernels, runs_avx2
from quantize import default_text, quantize_model
from tokenizer import load_tokenizer

pytestmark = pytest.mark.numerics

# Our logits and transformers' (30 layers, float32, logits up to ~35) differ by rounding alone: up to 9.4e-5 on
# an AVX2 CPU; a fault in any layer moves them by more than 1e-1.
TOLERANCE = 1e-3
EVERY_ROUND = {0: 1.0, 2: 1.0}  # round costs alike: each round verifies the 2 tokens prompt lookup proposes, if any


@pytest.fixture(scope="module")
def reference():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    assert SMOLLM2_GGUF.is_file() and (SMOLLM2_DIR / "model.pth").is_file(), "run: bash scripts/prepare.sh"
    kwargs = dict(gguf_file=SMOLLM2_GGUF.name)
    model = AutoModelForCausalLM.from_pretrained(str(SMOLLM2_GGUF.parent), dtype=torch.float32, **kwargs).eval()
    return model, AutoTokenizer.from_pretrained(str(SMOLLM2_GGUF.parent), **kwargs)


def test_greedy_matches_transformers(reference):
    hf, hf_tokenizer = reference
    model, tokenizer = load_model(SMOLLM2_DIR), load_tokenizer(SMOLLM2_DIR)
    prompt = "The capital of France is"
    ids = tokenizer.encode(prompt)
    assert ids == hf_tokenizer(prompt).input_ids
    with torch.no_grad():
        expected = hf.generate(torch.tensor([ids]), max_new_tokens=32, do_sample=False)[0, len(ids) :].tolist()
    ours = generate(model, ids, 32, eos_ids=tokenizer.eos_ids).tokens[0]
    # transformers keeps the EOS token it stopped at; we stop before it.
    if len(expected) < 32:
        assert expected[-1] in tokenizer.eos_ids
        expected = expected[:-1]
    assert_same_greedy(model, ids, ours, expected, TOLERANCE)
    assert "Paris" in tokenizer.decode(ours)

    x = torch.tensor([ids])
    model.setup_caches(1, len(ids))
    with torch.no_grad():
        assert (model(x, torch.arange(len(ids))) - hf(x).logits).abs().max() < TOLERANCE


# ATen's int8/int4 kernels ("library") take bfloat16 activations and round their outputs, logits included, to
# bfloat16; the fused one-row products compute in float32. Over SmolLM2's 30 layers that moves one-row logits
# (up to ~33) by up to 0.54 (int8 0.46) on an AVX2 CPU, so the two paths may pick different tokens only where two
# logits are within twice that (greedy paths measured: gaps of 0 and 0.11 where they parted). One path eager and
# compiled can differ by whole bfloat16 steps of the logits (0.125 at 16-32): none or ties measured. A wrong layout,
# scale or group moves the logits by several units and changes most tokens.
CROSS_PATH_DIFF, CROSS_PATH_MARGIN, SAME_PATH_MARGIN = 1.0, 1.2, 0.5
CPU = torch.device("cpu")


@pytest.fixture(scope="module", params=[("int8", None), ("int4", 32)], ids=["int8", "int4"])
def quantized_smollm2(request):
    """The default model quantized in memory (round to nearest), once per kernel choice."""
    kind, groupsize = request.param
    float_model, tokenizer = load_model(SMOLLM2_DIR), load_tokenizer(SMOLLM2_DIR)
    choices = {
        "library": Kernels.choose(CPU, False, "library"),
        "fused": Kernels.choose(CPU, False, "fused"),
        "compiled": Kernels.choose(CPU, True, quantized=True),
    }  # the last: what generate.py --compile picks on this CPU
    if native_kernels():
        choices["native"] = Kernels.choose(CPU, False, "native")  # kernels_cpu.cpp: int8 activations per block
    models = {name: quantize_model(float_model, kind, groupsize or 32, k) for name, k in choices.items()}
    return kind, models, [tokenizer.encode(t) for t in SMOLLM2_PROMPTS]


def test_quantized_kernel_paths_agree(quantized_smollm2):
    kind, models, prompts = quantized_smollm2
    library, fused, compiled = models["library"], models["fused"], models["compiled"]
    expected = [generate(library, p, 16).tokens[0] for p in prompts]  # eager, ATen's kernels
    # Eager fused products materialise [out, in] float32 tensors (slow; compiled they fuse): 8 tokens each.
    for prompt, row in zip(prompts, expected):
        assert_same_greedy(library, prompt, generate(fused, prompt, 8).tokens[0], row[:8], CROSS_PATH_MARGIN)
        if "native" in models:
            native = generate(models["native"], prompt, 16).tokens[0]
            assert_same_greedy(library, prompt, native, row, CROSS_PATH_MARGIN)
    x = torch.tensor([prompts[-1]])
    one_row = []
    with torch.no_grad():
        for model in (library, fused):  # the same prefill (many rows: one path), then one row each way
            model.setup_caches(1, x.shape[1])
            model(x[:, :-1], torch.arange(x.shape[1] - 1))
            one_row.append(model(x[:, -1:], torch.tensor([x.shape[1] - 1])))
    assert (one_row[0] - one_row[1]).abs().max() < CROSS_PATH_DIFF

    steps = compile_steps(CPU)
    compiled.setup_caches(1, max(map(len, prompts)) + 16)  # one cache for every prompt: one compiled graph
    native = compiled.kernels.int8_native if kind == "int8" else compiled.kernels.int4_native
    same_path = compiled.kernels.quant_matvec == "library" and native is None
    margin = SAME_PATH_MARGIN if same_path else CROSS_PATH_MARGIN
    for prompt, row in zip(prompts, expected):
        assert_same_greedy(library, prompt, generate(compiled, prompt, 16, steps=steps).tokens[0], row, margin)


def test_float32_eager_and_compiled_agree():
    """What generate.py runs without and with --compile: BLAS products eager, fused float32 products compiled."""
    eager, tokenizer = load_model(SMOLLM2_DIR, kernels=Kernels.choose(CPU, False)), load_tokenizer(SMOLLM2_DIR)
    compiled = load_model(SMOLLM2_DIR, kernels=Kernels.choose(CPU, True))
    prompts = [tokenizer.encode(t) for t in SMOLLM2_PROMPTS]
    steps = compile_steps(CPU)
    compiled.setup_caches(1, max(map(len, prompts)) + 16)  # one cache for every prompt: one compiled graph
    for prompt in prompts:
        expected = generate(eager, prompt, 16).tokens[0]
        assert_same_greedy(eager, prompt, generate(compiled, prompt, 16, steps=steps).tokens[0], expected, TOLERANCE)


@pytest.mark.skipif(not native_kernels() or not runs_avx2(), reason="half_linear is AVX2 code")
def test_bfloat16_native_and_fused_decode_agree():
    """bfloat16 weights' one-row products by kernels_cpu.cpp (half_linear, eager; what Kernels.choose picks) and by the
    compiled fused product: the same greedy tokens on the test prompts, except at near-ties (the float32 sums, added
    in another order, part where a layer's output rounds to bfloat16)."""
    tokenizer = load_tokenizer(SMOLLM2_DIR)
    prompts = [tokenizer.encode(t) for t in SMOLLM2_PROMPTS]
    native = load_model(SMOLLM2_DIR, dtype=torch.bfloat16, kernels=Kernels(half_native=True))
    fused = load_model(SMOLLM2_DIR, dtype=torch.bfloat16, kernels=Kernels("fused"))
    steps = compile_steps(CPU)
    fused.setup_caches(1, max(map(len, prompts)) + 16)  # one cache for every prompt: one compiled graph
    for prompt in prompts:
        expected = generate(native, prompt, 16).tokens[0]
        got = generate(fused, prompt, 16, steps=steps).tokens[0]
        assert_same_greedy(native, prompt, got, expected, CROSS_PATH_MARGIN)


# For each smaller KV cache: how far it may move a logit gap of the default model's from the float32 cache's on the
# test prompts (assert_same_greedy's margin), and its perplexity (relative); the measured worst (docs/usage.md) with
# room for other CPUs' rounding.
KV_DTYPE_BOUNDS = [(torch.int8, 2.0, 0.01), (torch.bfloat16, 1.0, 0.001)]


@pytest.mark.parametrize("kv_dtype, margin, perplexity_change", KV_DTYPE_BOUNDS)
def test_a_smaller_kv_cache_keeps_the_greedy_tokens_and_the_perplexity(kv_dtype, margin, perplexity_change):
    """--kv_cache_dtype int8 or bfloat16 on the default model (float32): the float32 cache's greedy tokens on the
    test prompts, eager, compiled and speculating by prompt lookup, except at near-ties; the perplexity of the last
    1024 tokens of eval.py's default text within 1% (int8) or 0.1% (bfloat16) of the float32 cache's (512-token
    windows). A wrong scale or a misplaced position parts them by far more."""
    eager, tokenizer = load_model(SMOLLM2_DIR, kernels=Kernels.choose(CPU, False)), load_tokenizer(SMOLLM2_DIR)
    compiled = load_model(SMOLLM2_DIR, kernels=Kernels.choose(CPU, True))
    prompts = [tokenizer.encode(t) for t in SMOLLM2_PROMPTS]
    expected = [generate(eager, p, 16).tokens[0] for p in prompts]
    tokens = tokenizer.encode(default_text())[-1024:]
    float_perplexity = perplexity(eager, tokens, 512, 256)[0]
    eager.kv_cache_dtype = compiled.kv_cache_dtype = kv_dtype
    assert perplexity(eager, tokens, 512, 256)[0] == pytest.approx(float_perplexity, rel=perplexity_change)
    steps = compile_steps(CPU)
    compiled.setup_caches(1, max(map(len, prompts)) + 16)  # one cache for every prompt: one compiled graph
    assert compiled.layers[0].attention.kv_cache.k_cache.dtype == kv_dtype
    for prompt, row in zip(prompts, expected):
        for got in (
            generate(eager, prompt, 16).tokens[0],
            generate(compiled, prompt, 16, steps=steps).tokens[0],
            generate(eager, prompt, 16, ngram=True, speculate_k=2, round_costs=EVERY_ROUND).tokens[0],
        ):
            assert_same_greedy(eager, prompt, got, row, margin)


def test_prompt_lookup_gives_the_greedy_tokens():
    """generate(..., ngram=True) on the test prompts, eager and compiled, as generate.py --ngram runs it: plain
    decoding's greedy tokens (the verify pass rounds differently from a one-token step: a near-tie may part them)."""
    tokenizer = load_tokenizer(SMOLLM2_DIR)
    prompts = [tokenizer.encode(t) for t in SMOLLM2_PROMPTS]
    for compiled in (False, True):
        model = load_model(SMOLLM2_DIR, kernels=Kernels.choose(CPU, compiled))
        steps = compile_steps(CPU) if compiled else Steps()
        model.setup_caches(1, max(map(len, prompts)) + 24 + 3)  # one cache for every prompt: one graph a depth
        verified = 0
        for prompt in prompts:
            expected = generate(model, prompt, 24, steps=steps).tokens[0]
            result = generate(model, prompt, 24, steps=steps, ngram=True, speculate_k=2, round_costs=EVERY_ROUND)
            assert_same_greedy(model, prompt, result.tokens[0], expected, TOLERANCE)
            verified += sum(result.speculation["depth_histogram"][1:])
        assert verified > len(prompts)  # proposals were verified


def test_native_kernels_perplexity_in_decode_shaped_steps(native_ops):
    """kernels_cpu.cpp's products, scored 8 tokens a step (a speculative verification's shape, the kernel's most
    rows) on the last 1024 tokens of eval.py's default text: int8 within 1% of float32's perplexity (its rounded
    weights cost most of that), int4 g32 within 1% of ATen's int4 kernel's in the same steps. A wrong scale, offset
    or block moves the perplexity by far more."""
    float_model, tokenizer = load_model(SMOLLM2_DIR), load_tokenizer(SMOLLM2_DIR)
    tokens = tokenizer.encode(default_text())[-1024:]
    native, library = Kernels.choose(CPU, False, "native"), Kernels.choose(CPU, False, "library")

    def score(model, step_rows: int | None = 8) -> float:
        return perplexity(model, tokens, 512, 256, step_rows)[0]

    float32 = score(float_model, None)  # whole windows: float32 products do not depend on the rows
    assert score(quantize_model(float_model, "int8", kernels=native)) == pytest.approx(float32, rel=0.01)
    int4 = score(quantize_model(float_model, "int4", 32, library))
    assert score(quantize_model(float_model, "int4", 32, native)) == pytest.approx(int4, rel=0.01)


def test_prefill_paths_perplexity(native_ops):
    """Whole windows of 512 tokens (a prefill's products of many rows) on the last 1024 tokens of eval.py's default
    text, with the kernels this CPU chooses (float32 by oneDNN on CPUs other than Intel's; int8 and int4 by the native
    kernels, or a product widened to bfloat16 where the CPU has bfloat16 matrix products): float32 within 0.1% of
    MKL's (F.linear, Kernels()), bfloat16 weights within 1% of float32, int8 and int4 g32 within 1% of the same
    quantized weights through ATen's kernels. A wrong layout, scale or widening moves it by far more."""
    float_model, tokenizer = load_model(SMOLLM2_DIR, kernels=Kernels()), load_tokenizer(SMOLLM2_DIR)
    tokens = tokenizer.encode(default_text())[-1024:]
    chosen, library = Kernels.choose(CPU, False, quantized=True), Kernels.choose(CPU, False, "library")

    def score(model) -> float:
        return perplexity(model, tokens, 512, 256)[0]

    float32 = score(float_model)
    assert score(load_model(SMOLLM2_DIR, kernels=chosen)) == pytest.approx(float32, rel=1e-3)
    assert score(load_model(SMOLLM2_DIR, dtype=torch.bfloat16, kernels=chosen)) == pytest.approx(float32, rel=0.01)
    for kind in ("int8", "int4"):
        expected = score(quantize_model(float_model, kind, 32, library))
        assert score(quantize_model(float_model, kind, 32, chosen)) == pytest.approx(expected, rel=0.01), kind
