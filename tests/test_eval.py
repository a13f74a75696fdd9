"""eval.py's perplexity against a float64 reference computed with transformers on the same tokens."""

import json
import math
import subprocess
import sys

import pytest
import torch

from conftest import ROOT, make_hf_llama
from convert_hf_checkpoint import convert_hf_checkpoint
from eval import perplexity
from generate import load_model
from tokenizer import load_tokenizer

pytestmark = pytest.mark.numerics
# Our float32 model and transformers' in float64 differ by ~1e-6 in a token's log-probability; a token scored
# twice, skipped, or with the wrong context moves the perplexity of these ~200-400 tokens by 1e-2 or more.
RELATIVE = 1e-4


def reference_perplexity(hf, tokens: list[int], window: int, stride: int) -> float:
    """Token t (t >= 1) scored once, by the first window [s, s + window), s = 0, stride, 2 stride, ..., that
    holds it past its first position (a causal model's prediction at t - 1 sees tokens s..t - 1 only)."""
    nll, logprobs = 0.0, {}
    for t in range(1, len(tokens)):
        s = next(s for s in range(0, len(tokens), stride) if s < t < s + window)
        if s not in logprobs:
            with torch.no_grad():
                logprobs[s] = torch.log_softmax(hf(torch.tensor([tokens[s : s + window]])).logits[0].double(), dim=-1)
        nll -= logprobs[s][t - s - 1, tokens[t]].item()
    return math.exp(nll / (len(tokens) - 1))


def test_perplexity_matches_a_float64_reference(tmp_path, tiny_tokenizer_json):
    hf = make_hf_llama(tmp_path / "hf", tiny_tokenizer_json)
    convert_hf_checkpoint(tmp_path / "hf", tmp_path / "ours")
    hf = hf.double()
    model = load_model(tmp_path / "ours")
    tokens = torch.randint(0, 300, (200,), generator=torch.Generator().manual_seed(0)).tolist()
    for window, stride in [(256, 128), (64, 16), (50, 49)]:
        ppl, counted = perplexity(model, tokens, window, stride)
        assert counted == 199
        assert ppl == pytest.approx(reference_perplexity(hf, tokens, window, stride), rel=RELATIVE)
    # decode-shaped: 5 tokens a forward pass through the KV cache scores the same tokens the same way
    assert perplexity(model, tokens, 64, 16, step_rows=5) == (pytest.approx(perplexity(model, tokens, 64, 16)[0]), 199)
    with pytest.raises(ValueError, match="need 0 < stride < window"):
        perplexity(model, tokens, 50, 50)  # the token at each window's start would have no context

    text = tmp_path / "text.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 40)
    result = subprocess.run(
        [
            sys.executable,
            str(ROOT / "eval.py"),
            "--checkpoint_path",
            str(tmp_path / "ours"),
            "--text_file",
            str(text),
            "--window",
            "128",
            "--max_tokens",
            "300",
            "--json",
        ],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout.strip().splitlines()[-1])
    scored = load_tokenizer(tmp_path / "ours").encode(text.read_text())[-300:]
    assert report["tokens"] == len(scored) - 1
    assert report["perplexity"] == pytest.approx(reference_perplexity(hf, scored, 128, 64), rel=RELATIVE)
