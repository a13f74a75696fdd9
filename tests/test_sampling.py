"""Sampling against a float64 reference, and its determinism."""

import numpy as np
import pytest
import torch

from generate import generate, load_model
from sampling import (
    SamplingParams,
    apply_penalties,
    draw_exponential_,
    logits_to_probs,
    record_token,
    refill_noise,
    sample,
    sampler_state,
)

pytestmark = pytest.mark.numerics


def reference_probs(logits: np.ndarray, temperature, top_k, top_p, min_p) -> np.ndarray:
    """Temperature, top-k, top-p, min-p, in float64, one row at a time, by sorting."""
    out = np.zeros_like(logits, dtype=np.float64)
    for r, row in enumerate(logits.astype(np.float64) / temperature):
        order = np.argsort(-row, kind="stable")
        kept = order[:top_k] if top_k else order
        p = np.exp(row[kept] - row[kept].max())
        p /= p.sum()
        if top_p < 1:
            n, mass = 0, 0.0
            while mass < top_p:  # the smallest prefix holding at least top_p
                mass += p[n]
                n += 1
            kept, p = kept[:n], p[:n]
        keep = p >= min_p * p.max()
        kept, p = kept[keep], p[keep]
        out[r, kept] = p / p.sum()
    return out


def knobs(**values):
    return {k: torch.tensor(float(v)) for k, v in values.items()}


@pytest.mark.parametrize(
    "temperature,top_k,top_p,min_p",
    [
        (1.0, 0, 1.0, 0.0),
        (0.7, 5, 1.0, 0.0),
        (1.3, 50, 1.0, 0.0),
        (1.0, 0, 0.9, 0.0),
        (0.8, 0, 0.5, 0.0),
        (1.0, 20, 0.8, 0.0),
        (2.0, 3, 0.3, 0.0),
        (1.0, 0, 1.0, 0.05),
        (0.5, 0, 1.0, 0.3),
        (1.5, 100, 0.95, 0.02),
    ],
)
def test_probabilities_match_float64_reference(temperature, top_k, top_p, min_p):
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(16, 1000, generator=generator) * 3
    ours = logits_to_probs(logits, **knobs(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p))
    ours = ours.double().numpy()
    reference = reference_probs(logits.numpy(), temperature, top_k, top_p, min_p)
    assert np.array_equal(ours > 0, reference > 0), "kept sets differ"
    assert np.abs(ours - reference).max() < 1e-5
    if top_k and top_p == 1 and min_p == 0:
        assert ((ours > 0).sum(-1) == top_k).all()


def reference_penalties(logits, prompt, output, repetition, presence, frequency):
    out = logits.astype(np.float64).copy()
    for r in range(out.shape[0]):
        for t in set(prompt[r]) | set(output[r]):
            out[r, t] = out[r, t] / repetition if out[r, t] > 0 else out[r, t] * repetition
        for t in set(output[r]):
            out[r, t] -= presence + frequency * output[r].count(t)
    return out


@pytest.mark.parametrize(
    "repetition,presence,frequency",
    [(1.3, 0.0, 0.0), (0.7, 0.0, 0.0), (1.0, 0.5, 0.0), (1.0, 0.0, 0.4), (1.2, 0.3, 0.2)],
)
def test_penalties_match_float64_reference(repetition, presence, frequency):
    rng = np.random.default_rng(0)
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(1)) * 2
    prompts = [list(rng.integers(0, 50, 6)) for _ in range(3)]
    outputs = [list(rng.integers(0, 50, 9)) for _ in range(3)]
    params = SamplingParams(repetition_penalty=repetition, presence_penalty=presence, frequency_penalty=frequency)
    state = sampler_state(params, [[int(t) for t in p] for p in prompts], 50, "cpu")
    for step in range(9):
        record_token(state, torch.tensor([[int(outputs[r][step])] for r in range(3)]))
    ours = apply_penalties(logits, state).double().numpy()
    reference = reference_penalties(logits.numpy(), prompts, outputs, repetition, presence, frequency)
    assert np.abs(ours - reference).max() < 1e-5
    assert (ours != logits.numpy()).any()


def test_top_p_always_keeps_the_best_token():
    logits = torch.tensor([[10.0, 0.0, 0.0, 0.0]])
    probs = logits_to_probs(logits, **knobs(temperature=1, top_k=0, top_p=0.01, min_p=0))
    assert probs.tolist() == [[1.0, 0.0, 0.0, 0.0]]


def test_sampling_follows_the_distribution():
    torch.manual_seed(0)
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log().expand(20000, 4)
    params = SamplingParams(temperature=1.0)
    state = sampler_state(params, [[0]] * 20000, 4, "cpu")
    state.seen.zero_()
    refill_noise(state, params, None)
    token, _ = sample(logits, state, greedy=False, n_logprobs=None)
    counts = torch.bincount(token.flatten(), minlength=4).double() / 20000
    assert (counts - probs.double()).abs().max() < 0.015


def test_top_k_1_is_greedy_and_seed_repeats(tiny_checkpoint):
    model = load_model(tiny_checkpoint)
    prompt = [3, 4, 5, 6]
    greedy = generate(model, prompt, 24).tokens[0]
    assert generate(model, prompt, 24, sampling=SamplingParams(temperature=1.0, top_k=1)).tokens[0] == greedy

    def sampled(seed):
        torch.manual_seed(seed)
        return generate(model, prompt, 24, sampling=SamplingParams(temperature=1.0, top_p=0.95)).tokens[0]

    assert sampled(7) == sampled(7)
    assert sampled(7) != sampled(8)
    assert sampled(7) != greedy
    # A per-request seed (its own torch.Generator) does not depend on the global generator.
    seeded = SamplingParams(temperature=1.0, seed=3)
    per_request = [generate(model, prompt, 24, sampling=seeded).tokens[0] for _ in range(2)]
    torch.manual_seed(99)
    assert per_request[0] == per_request[1] == generate(model, prompt, 24, sampling=seeded).tokens[0]


def test_bad_sampling_values(tiny_checkpoint):
    model = load_model(tiny_checkpoint)
    for kwargs, message in [
        ({"temperature": -0.1}, "temperature must be >= 0"),
        ({"top_p": 0.0}, r"top_p must be in \(0, 1\]"),
        ({"top_p": 1.5}, r"top_p must be in \(0, 1\]"),
        ({"top_k": -1}, "top_k must be >= 0"),
        ({"min_p": -0.1}, r"min_p must be in \[0, 1\]"),
        ({"min_p": 1.5}, r"min_p must be in \[0, 1\]"),
        ({"repetition_penalty": 0.0}, "repetition_penalty must be > 0"),
    ]:
        with pytest.raises(ValueError, match=message):
            generate(model, [1, 2], 4, sampling=SamplingParams(**kwargs))
    with pytest.raises(ValueError, match="exceeds the model's block_size"):
        generate(model, [1] * 200, 100)


def test_noise_is_exponential():
    """The draws that sampling divides by follow Exp(1): the empirical CDF against 1 - exp(-x), within 5 standard
    errors, never 0 (a token would win with any probability), and the same for the same seed."""
    n = 400_000
    draws = draw_exponential_(torch.empty(n), torch.Generator().manual_seed(0)).double()
    for x in (0.01, 0.1, 0.5, 1.0, 2.0, 4.0, 8.0):
        expected = 1 - np.exp(-x)
        assert abs((draws <= x).double().mean().item() - expected) < 5 * np.sqrt(expected * (1 - expected) / n)
    assert abs(draws.mean().item() - 1) < 5 / np.sqrt(n) and (draws > 0).all()
    again = draw_exponential_(torch.empty(n), torch.Generator().manual_seed(0)).double()
    assert torch.equal(draws, again)
