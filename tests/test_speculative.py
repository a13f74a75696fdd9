"""Speculative decoding, with a draft model or by prompt lookup: greedy output equals the target's, sampled output
follows the target's distribution, and the depth controller speculates only where it pays."""

import functools
import random
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
from speculate import (
    NGRAM_MAX,
    NGRAM_MIN,
    PROBE_GAP,
    RETRY_GAP,
    Acceptance,
    NgramIndex,
    Probes,
    choose_depth,
    depth_choices,
    draft_depth,
    expected_tokens,
    plain_rounds,
    probe_depth,
)


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


def deepest(k: int) -> dict[int, float]:
    """Round costs that make a controller draft as many tokens as it can: all depths cost alike."""
    return dict.fromkeys(depth_choices(k), 1.0)


# The target's verify pass (k + 1 positions) and plain decoding (one) differ by rounding: ~1e-6 in float32 logits.
MARGIN = 1e-4


@pytest.mark.numerics
@pytest.mark.parametrize("draft_name", ["unrelated", "int8 copy"])
def test_greedy_equals_plain_decoding(device_pairs, draft_name):
    target, drafts = device_pairs
    plain = gen.generate(target, PROMPT, 40).tokens[0]
    accepted = {}
    for k in (1, 2, 4, 8):
        result = gen.generate(target, PROMPT, 40, draft_model=drafts[draft_name], speculate_k=k, round_costs=deepest(k))
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
            costs = deepest(k)
            result = gen.generate(target, PROMPT, 40, draft_model=draft, speculate_k=k, steps=steps, round_costs=costs)
            assert_same_greedy(target, PROMPT, result.tokens[0], plain, MARGIN)
    # Every shape has been seen: another run, rounds included, must not compile anything.
    with torch._dynamo.config.patch(error_on_recompile=True):
        again = gen.generate(target, PROMPT, 40, draft_model=drafts["int8 copy"], steps=steps).tokens[0]
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
    costs = {0: 1.0, 1: 1.0, 2: 1.0}  # equal: every round drafts 2
    return np.array(
        [gen.speculative_generate(target, draft, prompt, 3, p, 2, round_costs=costs).tokens[0][1:3] for p in params]
    )


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


def test_padded_drafts_are_never_kept():
    """Rows with fewer drafts than the round's depth (lengths) get what the rule gives them with only their own
    drafts: the padding is never kept, even where the target would take it."""
    generator = torch.Generator().manual_seed(1)
    rows, k, vocab = 5, 4, 16
    p = torch.softmax(torch.randn(rows, k, vocab, generator=generator), dim=-1)
    q = torch.softmax(torch.randn(rows, k + 1, vocab, generator=generator), dim=-1)
    q[:, :k] = p  # every draft would be kept
    drafted = torch.multinomial(p.view(-1, vocab), 1, generator=generator).view(rows, k)
    uniforms, noise = (
        torch.rand(rows, k, generator=generator),
        torch.empty(rows, vocab).exponential_(generator=generator),
    )
    lengths = torch.tensor([0, 1, 2, 3, 4])
    kept, next_token = accept_drafts(drafted, p, q, uniforms, noise, lengths)
    assert kept.tolist() == lengths.tolist()
    assert int(next_token[0]) == int(torch.argmax(q[0, 0] / noise[0]))  # no drafts: a token drawn from q
    for i, n in enumerate(lengths.tolist()[1:], start=1):
        row = slice(i, i + 1)
        alone = accept_drafts(drafted[row, :n], p[row, :n], q[row, : n + 1], uniforms[row, :n], noise[row])
        assert int(alone[0]) == n and int(alone[1]) == int(next_token[i])


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
    with pytest.raises(ValueError, match="not both"):
        gen.generate(target, PROMPT, 10, draft_model=draft, ngram=True)
    with pytest.raises(ValueError, match="depth 0"):
        gen.generate(target, PROMPT, 10, ngram=True, round_costs={2: 1.0})


# ---------------------------------------------------------------- prompt lookup and the depth controller

REPEATING = PROMPT * 3  # a prompt whose continuation prompt lookup can guess: the tiny model repeats


def latest_continuation(tokens: list[int], k: int) -> list[int]:
    """Prompt lookup by search: for the longest suffix of NGRAM_MIN..NGRAM_MAX tokens that occurs earlier with a
    token after it, the k tokens after its latest such occurrence, in the sequence extended by them as they come."""
    for n in range(min(NGRAM_MAX, len(tokens)), NGRAM_MIN - 1, -1):
        for start in range(len(tokens) - n - 1, -1, -1):
            if tokens[start : start + n] == tokens[len(tokens) - n :]:
                extended = list(tokens)
                for i in range(k):
                    extended.append(extended[start + n + i])
                return extended[len(tokens) :]
    return []


def test_prompt_lookup_continues_the_latest_occurrence_of_the_longest_suffix():
    assert NgramIndex([1, 2, 3, 9, 1, 2, 3, 7, 5, 2, 3, 1, 2, 3]).propose(2) == [7, 5]  # not after 2 3 (1 2 3)
    assert NgramIndex([4, 1, 2, 3]).propose(3) == []
    assert NgramIndex([5, 7, 7, 7]).propose(4) == [7, 7, 7, 7] and NgramIndex([1, 2, 1, 2]).propose(3) == [1, 2, 1]
    rng = random.Random(0)
    for _ in range(500):
        tokens = [rng.randrange(5) for _ in range(rng.randrange(1, 40))]
        split = rng.randrange(len(tokens) + 1)
        index = NgramIndex(tokens[:split])  # a prompt, then what is generated
        index.extend(tokens[split:])
        for k in (1, 3, 6):
            assert index.propose(k) == latest_continuation(tokens, k), (tokens, k)


@pytest.mark.numerics
def test_greedy_with_prompt_lookup_equals_plain_decoding(device):
    """A model of 16 tokens that falls into repeating its output, as small models do: many proposals hold."""
    model = tiny_vocab_model(0, 2).to(device)
    prompt = [3, 1, 4, 1, 5, 3, 1, 4, 1, 5]
    plain = gen.generate(model, prompt, 40).tokens[0]
    steps = compile_steps(device)
    for model_steps in (gen.Steps(), steps):
        # first, with the round costs measured (each depth's round compiles) and the caches sized for all runs
        measured = gen.generate(model, prompt, 40, ngram=True, speculate_k=6, steps=model_steps).tokens[0]
        assert_same_greedy(model, prompt, measured, plain, MARGIN)
        for k in (6, 4, 1):
            costs = deepest(k)
            result = gen.generate(model, prompt, 40, ngram=True, speculate_k=k, round_costs=costs, steps=model_steps)
            assert_same_greedy(model, prompt, result.tokens[0], plain, MARGIN)
            figures = result.speculation
            # kept far more often than a token drawn from the 16 at random would be
            assert figures["draft"] == "prompt lookup" and figures["acceptance_rate"] > 0.25, figures
    with torch._dynamo.config.patch(error_on_recompile=True):  # a graph per depth, all compiled by now
        again = gen.generate(model, prompt, 40, ngram=True, speculate_k=4, steps=steps).tokens[0]
    assert_same_greedy(model, prompt, again, plain, MARGIN)


def lookup_samples(target, prompt, runs) -> np.ndarray:
    params = [SamplingParams(temperature=1.0, seed=seed) for seed in range(runs)]
    costs = {0: 1.0, 1: 1.0, 2: 1.0}  # equal: every round drafts what prompt lookup has, up to 2
    return np.array(
        [gen.speculative_generate(target, None, prompt, 3, p, 2, round_costs=costs).tokens[0][1:3] for p in params]
    )


def test_sampling_with_prompt_lookup_follows_the_target_distribution(monkeypatch):
    """A proposal is a one-hot draft distribution: the acceptance rule keeps the target's distribution. The prompt
    holds every token, so every round has a proposal; a rule that keeps every proposal fails the same test."""
    target = tiny_vocab_model(0, 2)
    prompt = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2, 3, 8, 4, 6, 2, 6, 4, 3, 3, 8, 3, 2, 7, 9, 5, 0] + [
        10,
        11,
        12,
        13,
        14,
        15,
        1,
    ]
    second, third = exact_marginals(target, prompt)
    samples = lookup_samples(target, prompt, 2500)
    assert not chi_square_rejects(samples[:, 0], second) and not chi_square_rejects(samples[:, 1], third)

    def keep_all(drafted, p, q, uniforms, noise, lengths):
        return lengths, torch.argmax(q[torch.arange(drafted.shape[0]), lengths] / noise, dim=-1)

    monkeypatch.setattr(gen, "accept_drafts", keep_all)
    wrong = lookup_samples(target, prompt, 2500)
    assert chi_square_rejects(wrong[:, 0], second) or chi_square_rejects(wrong[:, 1], third)


def test_depth_follows_the_acceptance_seen():
    assert expected_tokens(0.6, 4) == pytest.approx((1 - 0.6**5) / (1 - 0.6))
    costs = {0: 1.0, 2: 1.2, 4: 1.3}
    acceptance = Acceptance()
    assert choose_depth(costs, [(acceptance, 4)]) == 4  # 1/2 before any evidence: 1.94 / 1.3 > 1.75 / 1.2 > 1
    for _ in range(30):
        acceptance.record(kept=0, tried=1)  # proposals the target never takes
    assert choose_depth(costs, [(acceptance, 4)]) == 0
    for _ in range(30):
        acceptance.record(kept=1, tried=1)
    assert choose_depth(costs, [(acceptance, 4)]) == 4
    assert choose_depth(costs, [(acceptance, 1)]) == 2  # one draft, padded: 1.88 / 1.2 > 1
    assert choose_depth(costs, [(acceptance, 0)]) == 0
    # A batch: rows without drafts yield their one token at any depth, which weighs against a dearer round.
    assert choose_depth(costs, [(acceptance, 4)] + [(Acceptance(), 0)] * 3) == 4
    assert choose_depth(costs, [(acceptance, 4)] + [(Acceptance(), 0)] * 15) == 0
    for _ in range(30):
        acceptance.record(kept=0, tried=1)
    # With no evidence, what it saw fades towards 1/2: it tries speculating again.
    faded = Acceptance(acceptance.kept, acceptance.tried)
    quiet_rounds = next(i for i in range(1, 1000) if faded.record(0, 0) or choose_depth(costs, [(faded, 4)]))
    assert 5 < quiet_rounds < 60
    # A draft model's plain rounds run in one go: as many as the controller would pick one by one.
    assert plain_rounds(costs, acceptance, 4, 1000) == quiet_rounds
    assert plain_rounds(costs, acceptance, 4, 3) == 3


def test_a_draft_the_prior_keeps_off_is_probed():
    """Round costs where drafting pays only if most drafts are kept: at the acceptance assumed without evidence
    (1/2) the controller picks plain rounds, which observe nothing. A probe at the first round finds the target's
    own copy always right, and the rounds speculate from then on; a draft that is mostly wrong costs that one
    probe in 30 tokens. Either way the tokens are plain decoding's. Probes come at the first round, then after
    PROBE_GAP plain rounds, then after twice as many each time (after RETRY_GAP where the controller had followed
    the draft); none where no depth could pay."""
    model, itself, unrelated = tiny_vocab_model(0, 2), tiny_vocab_model(0, 2), tiny_vocab_model(1, 1)
    prompt = [3, 1, 4, 1, 5, 3, 1, 4, 1, 5]
    plain = gen.generate(model, prompt, 30).tokens[0]
    costs = {0: 1.0, 2: 2.0, 4: 2.9}
    assert choose_depth(costs, [(Acceptance(), 4)]) == 0 and probe_depth(costs, 4) == 4
    assert probe_depth(costs, 1) == 0 and probe_depth({0: 1.0, 2: 3.5, 4: 5.5}, 4) == 0
    for draft in (itself, unrelated):
        result = gen.generate(model, prompt, 30, round_costs=costs, draft_model=draft)
        assert_same_greedy(model, prompt, result.tokens[0], plain, MARGIN)
        depths = result.speculation["depth_histogram"]
        if draft is itself:
            assert depths[4] > depths[0] and result.speculation["acceptance_rate"] > 0.9
        else:
            assert depths[4] == 1 and result.speculation["acceptance_rate"] < 0.5
    probes, probed = Probes(), []
    for round_ in range(8 * PROBE_GAP):
        if draft_depth(costs, [(Acceptance(), probes)], 4):
            probed.append(round_)
        else:
            probes.plain(1)
    assert probed == [0, 1 + PROBE_GAP, 2 + 3 * PROBE_GAP, 3 + 7 * PROBE_GAP]
    # Of several rows, those whose probe is due are probed, all of them in one round; the others wait on.
    due, waiting = Probes(), Probes(wait=5)
    assert draft_depth(costs, [(Acceptance(), due), (Acceptance(), waiting)], 4) == 4
    assert (due.wait, due.gap, waiting.wait) == (PROBE_GAP, 2 * PROBE_GAP, 5)
    assert draft_depth(costs, [(Acceptance(), due), (Acceptance(), waiting)], 4) == 0
    kept = Acceptance(kept=9.0, tried=9.0)
    assert draft_depth(costs, [(kept, due), (kept, waiting)], 4) == 4
    assert due.wait == waiting.wait == RETRY_GAP, "speculating rows are followed"
    # One the controller followed is probed again soon after it turns the draft off, then as from the start.
    probes.followed()
    probes.plain(RETRY_GAP - 1)
    assert not probes.due()
    probes.plain(1)
    assert probes.due()
    probes.probed()
    probes.plain(PROBE_GAP)
    assert probes.due()


def test_dear_verification_decodes_plainly_step_for_step():
    """Round costs where verifying any drafts costs more than the most tokens it could yield: every round is a
    plain decode step, and the tokens are exactly plain decoding's (the same step, not the verify pass). Where
    verifying is cheap and proposals hold, rounds speculate, and keep most drafts."""
    model, draft = tiny_vocab_model(0, 2), tiny_vocab_model(1, 1)
    prompt = [3, 1, 4, 1, 5, 3, 1, 4, 1, 5]
    plain = gen.generate(model, prompt, 30).tokens[0]
    dear = {0: 1.0, 2: 3.5, 4: 5.5}
    for sampling in (SamplingParams(), SamplingParams(temperature=1.0, seed=3)):  # sampled: the same noise drawn
        expected = gen.generate(model, prompt, 30, sampling=sampling).tokens[0]
        for drafts in (dict(ngram=True), dict(draft_model=draft)):
            result = gen.generate(model, prompt, 30, sampling=sampling, round_costs=dear, **drafts)
            assert result.tokens[0] == expected and result.speculation["depth_histogram"] == [29, 0, 0, 0, 0]
    # A run of plain rounds ends at an EOS, as plain decoding does: the token that first appears last.
    eos = max(set(plain), key=plain.index)
    ended = gen.generate(model, prompt, 30, eos_ids=[eos]).tokens[0]
    assert ended == plain[: plain.index(eos)] and len(ended) > 2
    result = gen.generate(model, prompt, 30, eos_ids=[eos], round_costs=dear, draft_model=draft)
    assert result.tokens[0] == ended and result.speculation["depth_histogram"][0] == len(ended)  # no step past it
    cheap = {0: 1.0, 2: 1.05, 4: 1.1}
    # A speculative round ends it too where the drafts it keeps hold the EOS: no round after it.
    for drafts in (dict(ngram=True), dict(draft_model=tiny_vocab_model(0, 2))):
        result = gen.generate(model, prompt, 30, eos_ids=[eos], round_costs=cheap, **drafts)
        kept = sum(n * length for length, n in enumerate(result.speculation["accepted_length_histogram"]))
        assert result.tokens[0] == ended and kept + sum(result.speculation["depth_histogram"]) <= len(ended) + 4
    result = gen.generate(model, prompt, 30, ngram=True, round_costs=cheap)
    assert_same_greedy(model, prompt, result.tokens[0], plain, MARGIN)
    assert result.speculation["depth_histogram"][4] > 0 and result.speculation["acceptance_rate"] > 0.5
