"""Sampling against a float64 reference, and its determinism."""
import numpy as np
import pytest
import torch

from generate import generate, load_model, logits_to_probs, sample


def reference_probs(logits: np.ndarray, temperature: float, top_k: int | None, top_p: float | None) -> np.ndarray:
    """Temperature, then top-k, then top-p, in float64, one row at a time, by sorting."""
    out = np.zeros_like(logits)
    for r, row in enumerate(logits.astype(np.float64) / temperature):
        order = np.argsort(-row, kind="stable")
        kept = order[:top_k] if top_k else order
        p = np.exp(row[kept] - row[kept].max())
        p /= p.sum()
        if top_p is not None and top_p < 1:
            n, mass = 0, 0.0
            while mass < top_p:  # the smallest prefix holding at least top_p
                mass += p[n]
                n += 1
            kept, p = kept[:n], p[:n] / p[:n].sum()
        out[r, kept] = p
    return out


@pytest.mark.parametrize(
    "temperature,top_k,top_p",
    [(1.0, None, None), (0.7, 5, None), (1.3, 50, None), (1.0, None, 0.9), (0.8, None, 0.5), (1.0, 20, 0.8), (2.0, 3, 0.3)],
)
def test_probabilities_match_float64_reference(temperature, top_k, top_p):
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(16, 1000, generator=generator) * 3
    ours = logits_to_probs(logits, temperature, top_k, top_p).double().numpy()
    reference = reference_probs(logits.numpy(), temperature, top_k, top_p)
    assert np.array_equal(ours > 0, reference > 0), "kept sets differ"
    assert np.abs(ours - reference).max() < 1e-5
    if top_k:
        assert ((ours > 0).sum(-1) == top_k).all() or top_p is not None


def test_top_p_always_keeps_the_best_token():
    logits = torch.tensor([[10.0, 0.0, 0.0, 0.0]])
    probs = logits_to_probs(logits, 1.0, None, 0.01)
    assert probs.tolist() == [[1.0, 0.0, 0.0, 0.0]]


def test_sampling_follows_the_distribution():
    torch.manual_seed(0)
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log().expand(20000, 1, 4)
    counts = torch.bincount(sample(logits, temperature=1.0).flatten(), minlength=4).double() / 20000
    assert (counts - probs.double()).abs().max() < 0.015


def test_top_k_1_is_greedy_and_seed_repeats(tiny_checkpoint):
    model = load_model(tiny_checkpoint)
    prompt = [3, 4, 5, 6]
    greedy = generate(model, prompt, 24, temperature=0).tokens[0]
    assert generate(model, prompt, 24, temperature=1.0, top_k=1).tokens[0] == greedy

    def sampled(seed):
        torch.manual_seed(seed)
        return generate(model, prompt, 24, temperature=1.0, top_p=0.95).tokens[0]

    assert sampled(7) == sampled(7)
    assert sampled(7) != sampled(8)
    assert sampled(7) != greedy


def test_bad_sampling_values(tiny_checkpoint):
    model = load_model(tiny_checkpoint)
    for kwargs, message in [
        ({"temperature": -0.1}, "temperature must be >= 0"),
        ({"top_p": 0.0}, r"top_p must be in \(0, 1\]"),
        ({"top_p": 1.5}, r"top_p must be in \(0, 1\]"),
        ({"top_k": -1}, "top_k must be >= 0"),
    ]:
        with pytest.raises(ValueError, match=message):
            generate(model, [1, 2], 4, **kwargs)
    with pytest.raises(ValueError, match="exceeds the model's block_size"):
        generate(model, [1] * 200, 100)
