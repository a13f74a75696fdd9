"""Real models of other families from their Q4_K_M GGUF files (scripts/prepare.sh --model NAME), against
transformers loading the same file in float32. scripts/test.sh prepares gemma3-270m; the Qwen2.5-Coder tests
run when their checkpoints are there and are skipped otherwise."""

import pytest
import torch

from conftest import assert_same_greedy
from convert_gguf import INT4_BLOCK_BYTES, INT4_FILE, INT4_GROUPSIZE, open_gguf
from decode import compile_steps
from generate import generate, load_model
from kernels import Kernels, unpack_int4
from prepare_gguf import CHECKPOINTS, DOWNLOADS, MODELS
from quantize import dequantize_int4
from tokenizer import load_tokenizer

pytestmark = pytest.mark.numerics

FAMILY_MODELS = ["gemma3-270m", "qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b"]
REQUIRED = "gemma3-270m"  # scripts/test.sh prepares it
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a land far away, there",
    "List three colours:",
    "1, 2, 3, 4,",
    "import numpy as np\n\n# the mean of each row of a matrix\n",
    "Water boils at",
    "The quick brown fox jumps over the lazy dog. " * 4,
]
NEW_TOKENS = 32
# Ours and transformers' float32 logits differ by rounding alone: measured up to 6.4e-5 (Gemma 3 270M, logits up to
# ~35), 1.0e-4 (Qwen2.5-Coder 0.5B) and 1.4e-4 (1.5B) on an AVX2 CPU; a fault in any layer, a norm's missing
# offset or a mis-ordered rotary pair moves them by more than 1e-1.
TOLERANCE = 1e-3
CPU = torch.device("cpu")


def prepared(name: str):
    folder, gguf = CHECKPOINTS / MODELS[name].folder, DOWNLOADS / MODELS[name].gguf
    if not ((folder / "model.pth").is_file() and gguf.is_file()):
        if name == REQUIRED:
            pytest.fail(f"run: bash scripts/prepare.sh --model {name}")
        pytest.skip(f"not prepared (bash scripts/prepare.sh --model {name})")
    return folder, gguf


@pytest.fixture(scope="module", params=FAMILY_MODELS)
def real_model(request):
    """(checkpoint folder, our tokenizer, prompts as ids, transformers' greedy continuations)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, gguf = prepared(request.param)
    tokenizer = load_tokenizer(folder)
    prompts = [tokenizer.encode(p) for p in PROMPTS]
    hf_tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    assert prompts == [hf_tokenizer(p).input_ids for p in PROMPTS]
    hf = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32).eval()
    expected = []
    with torch.no_grad():
        for ids in prompts:
            row = hf.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False)[0, len(ids) :].tolist()
            expected.append(row[:-1] if len(row) < NEW_TOKENS else row)  # transformers keeps the EOS it stopped at
        x = torch.tensor([prompts[-1]])
        logits = hf(x).logits
    return folder, tokenizer, prompts, expected, logits


def test_logits_and_greedy_match_transformers(real_model):
    folder, tokenizer, prompts, expected, hf_logits = real_model
    model = load_model(folder, kernels=Kernels.choose(CPU, False))
    x = torch.tensor([prompts[-1]])
    model.setup_caches(1, x.shape[1])
    with torch.no_grad():
        assert (model(x, torch.arange(x.shape[1])) - hf_logits).abs().max() < TOLERANCE
    got = generate(model, prompts, NEW_TOKENS, eos_ids=tokenizer.eos_ids).tokens  # one left-padded batch
    for prompt, row, want in zip(prompts, got, expected):
        assert_same_greedy(model, prompt, row, want, TOLERANCE)


def test_compiled_greedy_matches_transformers(real_model):
    folder, tokenizer, prompts, expected, _ = real_model
    model = load_model(folder, kernels=Kernels.choose(CPU, True))  # what generate.py --compile runs
    got = generate(model, prompts, NEW_TOKENS, eos_ids=tokenizer.eos_ids, steps=compile_steps(CPU)).tokens
    for prompt, row, want in zip(prompts, got, expected):
        assert_same_greedy(model, prompt, row, want, TOLERANCE)


def test_int4_checkpoint_holds_the_files_4_bit_blocks():
    """model_int4-gguf.g32.pth keeps every Q4_K / Q4_0 / Q4_1 weight of the file as it is (the float32 products of its
    float16 scales, ~1e-7 relative), where rounding to the same grid again would move most weights."""
    folder, gguf = prepared(REQUIRED)
    exact = {t.name for t in open_gguf(gguf).tensors if t.tensor_type.name in INT4_BLOCK_BYTES}
    assert "blk.0.attn_output.weight" in exact  # Gemma 3 270M's Q4_K_M: attention outputs are Q4_K
    float_state = torch.load(folder / "model.pth", mmap=True, weights_only=True)
    int4 = torch.load(folder / INT4_FILE, mmap=True, weights_only=True)
    assert int4["quantization"]["method"] == "gguf"
    for name in ("layers.0.attention.wo", "layers.17.attention.wo"):
        sz = int4["state_dict"][f"{name}.scales_and_zeros"]
        w = dequantize_int4(
            unpack_int4(int4["state_dict"][f"{name}.weight"]), sz[..., 0].T, sz[..., 1].T, INT4_GROUPSIZE
        )
        reference = float_state[f"{name}.weight"]
        assert (w - reference).abs().max() <= 1e-6 * reference.abs().max()
