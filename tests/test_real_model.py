"""SmolLM2-135M-Instruct, prepared by scripts/prepare.sh, against transformers loading the same GGUF file."""
import pytest
import torch
from conftest import SMOLLM2_DIR, SMOLLM2_GGUF, assert_same_greedy

from generate import generate, load_model
from tokenizer import load_tokenizer


pytestmark = pytest.mark.numerics

# Our logits and transformers' (30 layers, float32, logits up to ~35) differ by rounding alone: up to 9.4e-5 on
# an AVX2 CPU; a fault in any layer moves them by more than 1e-1.
TOLERANCE = 1e-3


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
