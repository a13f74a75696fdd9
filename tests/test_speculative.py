"""Speculative decoding: greedy output equals the target's, sampled output follows the target's distribution."""

import functools
import shutil

import numpy as np
import pytest
import torch
import torch._dynamo

import generate as gen
import quantize as qz
from config import ModelArgs
from conftest import assert_same_greedy, make_hf_llama
from convert_hf_checkpoint import convert_hf_checkpoint
from decode import compile_steps, verify_step
from kernels import Kernels
from model import Transformer
from sampling import SamplingParams, accept_drafts, row_sampler_state, sampler_state, set_row


@pytest.fixture(scope="module")
def pair_files(tiny_checkpoint, tiny_tokenizer_json, tmp_path_factory):
    folder = tmp_path_factory.mktemp("spec")
    shutil.copytree(tiny_checkpoint, folder / "target")
    make_hf_llama(
        folder / "hf_draft", tiny_tokenizer_json, seed=7, num_hidden_layers=1, num_key_value_heads=1, hidden_size=32
    )
    convert_hf_checkpoint(folder / "hf_draft", folder / "draft")
    int8 = qz.quantize_checkpoint(folder / "target" / "model.pth", "int8")
    return folder / "target", {"unrelated": folder / "draft", "int8 copy": int8}


def load_pairs(pair_files, kernels=Kernels(), device="cpu"):
    target, drafts = pair_files
    load = functools.partial(gen.load_model, device=device, kernels=kernels)
    return load(target), {name: load(p) for name, p in drafts.items()}


@pytest.fixture(scope="module")
def pairs(pair_files):
    return load_pairs(pair_files)


@pytest.fixture(scope="module")
def device_pairs(pair_files, device):
    return load_pairs(pair_files, device=device)


PROMPT = [5, 17, 42, 7, 99]
# The target's verify pass (k + 1 positions) and plain decoding (one) differ by rounding: ~1e-6 in float32 logits.
MARGIN = 1e-4


@pytest.mark.numerics
@pytest.mark.parametrize("draft_name", ["unrelated", "int8 copy"])
def test_greedy_equals_plain_decoding(device_pairs, draft_name):
    target, drafts = device_pairs
    plain = gen.generate(target, PROMPT, 40).tokens[0]
    accepted = {}
    for k in (1, 2, 4, 8):
        result = gen.generate(target, PROMPT, 40, draft_model=drafts[draft_name], speculate_k=k)
        assert_same_greedy(target, PROMPT, result.tokens[0], plain, MARGIN)
        accepted[k] = result.speculation["acceptance_rate"]
    if draft_name == "int8 copy":
        assert min(accepted.values()) > 0.5  # a quantized copy agrees with the target most of the time


@pytest.mark.numerics
def test_compiled_greedy_equals_plain_without_recompiling(pair_files, device):
    # The kernels generate.py --compile picks on this CPU: fused products, also for the verify's k + 1 rows.
    target, drafts = load_pairs(pair_files, Kernels.choose(device, compiled=True), device)
    plain = gen.generate(load_pairs(pair_files, device=device)[0], PROMPT, 40).tokens[0]
    steps = compile_steps(device)
    for draft in drafts.values():
        for k in (8, 4, 2, 1):  # the first sizes the caches for all: one graph per k, and per draft
            result = gen.generate(target, PROMPT, 40, draft_model=draft, speculate_k=k, steps=steps)
            assert_same_greedy(target, PROMPT, result.tokens[0], plain, MARGIN)
    # Every shape has been seen: another run, rounds included, must not compile anything.
    with torch._dynamo.config.patch(error_on_recompile=True):
        again = gen.generate(target, PROMPT, 40, draft_model=drafts["int8 copy"], speculate_k=4, steps=steps).tokens[0]
    assert_same_greedy(target, PROMPT, again, plain, MARGIN)


def tiny_vocab_model(seed: int, layers: int) -> Transformer:
    torch.manual_seed(seed)
    model = Transformer(ModelArgs(dim=32, n_layer=layers, n_head=2, intermediate_size=64, vocab_size=16, block_size=64))
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.ones_like(p) if "norm" in name else torch.randn_like(p) * 0.4)
    return model.eval()


def exact_marginals(model, prompt) -> tuple[np.ndarray, np.ndarray]:
    """P(2nd new token) and P(3rd new token) in float64, by enumerating the first two."""

    def next_probs(prefixes):
        model.setup_caches(len(prefixes), len(prefixes[0]))
        with torch.no_grad():
            logits = model(torch.tensor(prefixes), torch.arange(len(prefixes[0])))[:, -1].double()
        return torch.softmax(logits, -1).numpy()

    p1 = next_probs([prompt])[0]
    p2 = next_probs([prompt + [a] for a in range(16)])  # [a, b]
    p3 = next_probs([prompt + [a, b] for a in range(16) for b in range(16)]).reshape(16, 16, 16)
    second = p1 @ p2
    third = np.einsum("a,ab,abc->c", p1, p2, p3)
    return second, third


def chi_square_rejects(samples: np.ndarray, expected: np.ndarray) -> bool:
    """Pearson's test at significance 0.001, cells with fewer than 5 expected merged."""
    counts = np.bincount(samples, minlength=len(expected)).astype(float)
    expected = expected * len(samples)
    small = expected < 5
    observed = np.append(counts[~small], counts[small].sum())
    expected = np.append(expected[~small], expected[small].sum())
    observed, expected = observed[expected > 0], expected[expected > 0]
    statistic = ((observed - expected) ** 2 / expected).sum()
    critical = {
        d: c
        for d, c in enumerate(
            [0, 10.83, 13.82, 16.27, 18.47, 20.52, 22.46, 24.32, 26.12, 27.88, 29.59, 31.26, 32.91, 34.53, 36.12, 37.70]
        )
    }[len(observed) - 1]
    return statistic > critical


def speculative_samples(target, draft, prompt, runs) -> np.ndarray:
    params = [SamplingParams(temperature=1.0, seed=seed) for seed in range(runs)]
    return np.array([gen.speculative_generate(target, draft, prompt, 3, p, 2).tokens[0][1:3] for p in params])


def test_sampled_tokens_follow_the_target_distribution():
    target, draft = tiny_vocab_model(0, 2), tiny_vocab_model(1, 1)
    prompt = [3, 1, 4, 1, 5]
    second, third = exact_marginals(target, prompt)
    samples = speculative_samples(target, draft, prompt, 2500)
    assert not chi_square_rejects(samples[:, 0], second) and not chi_square_rejects(samples[:, 1], third)
    # The test has the power to tell the target's distribution from the draft's.
    draft_second, draft_third = exact_marginals(draft, prompt)
    assert chi_square_rejects(samples[:, 0], draft_second) or chi_square_rejects(samples[:, 1], draft_third)


def test_acceptance_rule_yields_the_target_distribution():
    """One round, k = 1: the token at the round's first position follows q. The same statistic rejects what a
    plausible wrong rule gives (at a rejection, q's most likely token instead of a draw from the residual)."""
    generator = torch.Generator().manual_seed(0)
    p, q = torch.softmax(torch.randn(2, 16, generator=generator) * 1.5, dim=-1)
    first = []
    for _ in range(4000):
        drafted = torch.multinomial(p, 1, generator=generator)[None]
        uniforms, noise = torch.rand(1, 1, generator=generator), torch.empty(1, 16).exponential_(generator=generator)
        kept, next_token = accept_drafts(drafted, p[None, None], torch.stack([q, q])[None], uniforms, noise)
        first.append(int(drafted) if int(kept) else int(next_token))
    wrong = torch.minimum(p, q)
    wrong[q.argmax()] += 1 - wrong.sum()
    first = np.array(first)
    assert not chi_square_rejects(first, q.double().numpy()) and chi_square_rejects(first, wrong.double().numpy())


def test_acceptance_rule_treats_each_row_alone():
    """A batch of rows (a server's requests) gives each row what the rule gives it alone: rows of different
    distributions, drafts that agree with their target and drafts that do not."""
    generator = torch.Generator().manual_seed(0)
    rows, k, vocab = 6, 3, 16
    p = torch.softmax(torch.randn(rows, k, vocab, generator=generator) * 2, dim=-1)
    q = torch.softmax(torch.randn(rows, k + 1, vocab, generator=generator) * 2, dim=-1)
    q[:2, :k] = p[:2]  # rows whose drafts the target agrees with: all kept, and a bonus token
    drafted = torch.multinomial(p.view(-1, vocab), 1, generator=generator).view(rows, k)
    uniforms, noise = (
        torch.rand(rows, k, generator=generator),
        torch.empty(rows, vocab).exponential_(generator=generator),
    )
    kept, next_token = accept_drafts(drafted, p, q, uniforms, noise)
    alone = [
        accept_drafts(drafted[i : i + 1], p[i : i + 1], q[i : i + 1], uniforms[i : i + 1], noise[i : i + 1])
        for i in range(rows)
    ]
    assert kept.tolist() == [int(a[0]) for a in alone] and next_token.tolist() == [int(a[1]) for a in alone]
    assert kept[:2].tolist() == [k, k] and kept[2:].min() < k


def test_verify_step_applies_each_rows_settings(pairs):
    """A server verifies rows of different requests in one pass: each row's distributions are the ones its own
    settings give it alone (temperature 0 among sampled rows: one-hot at the argmax)."""
    target, _ = pairs
    settings = [
        SamplingParams(temperature=0.7, top_k=5),
        SamplingParams(),
        SamplingParams(temperature=1.3, top_p=0.8),
        SamplingParams(temperature=1.0, min_p=0.2),
    ]
    x = torch.tensor([[5, 17, 42], [7, 99, 3], [11, 12, 13], [8, 8, 8]])
    vocab = target.config.vocab_size
    state = row_sampler_state(len(settings), vocab, "cpu")
    for row, params in enumerate(settings):
        set_row(state, row, params, [])
    target.setup_caches(len(settings), 16)
    together = verify_step(target, x, torch.arange(3), state, greedy=False)
    for row, params in enumerate(settings):
        target.setup_caches(1, 16)
        alone = verify_step(
            target, x[row : row + 1], torch.arange(3), sampler_state(params, [[]], vocab, "cpu"), greedy=params.greedy
        )[0]
        torch.testing.assert_close(together[row], alone, atol=1e-5, rtol=0)
    assert ((together[1] == 0) | (together[1] == 1)).all() and not ((together[0] == 0) | (together[0] == 1)).all()


def test_bad_speculation_requests(pairs):
    target, drafts = pairs
    draft = drafts["int8 copy"]
    cases = [
        (dict(speculate_k=0), "speculate_k must be >= 1"),
        (dict(sampling=SamplingParams(repetition_penalty=1.2)), "not penalties or logprobs"),
        (dict(sampling=SamplingParams(logprobs=2)), "not penalties or logprobs"),
    ]
    for kwargs, message in cases:
        with pytest.raises(ValueError, match=message):
            gen.generate(target, PROMPT, 10, draft_model=draft, **kwargs)
    with pytest.raises(ValueError, match="one prompt at a time"):
        gen.generate(target, [PROMPT, PROMPT], 10, draft_model=draft)
    with pytest.raises(ValueError, match="vocabulary"):
        gen.generate(target, PROMPT, 10, draft_model=tiny_vocab_model(0, 1))
    with pytest.raises(ValueError, match="block_size"):
        gen.generate(target, PROMPT, 250, draft_model=draft, speculate_k=8)
