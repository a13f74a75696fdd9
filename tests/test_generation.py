"""Batches of different prompts, padding, stop conditions, streaming, chat and log-probabilities."""

import pytest
import torch

import decode
from chat import Chat
from conftest import SMOLLM2_DIR, SMOLLM2_PROMPTS, assert_same_greedy
from decode import Steps, Stream, decode_one_token, prefill
from generate import generate, load_model
from kernels import Kernels
from results import TextPieces
from sampling import SamplingParams, sampler_state
from tokenizer import IncrementalDecoder, load_tokenizer

pytestmark = pytest.mark.numerics

# Logits of one prompt computed alone and as a row of a padded batch differ by rounding alone: a few 1e-6 for
# the tiny model, ~1e-5 for SmolLM2's 30 layers (float32, both CPU kinds); a fault (a visible padding slot, a
# wrong position) moves them by more than 1e-1. Greedy outputs may therefore part only where two logits are closer
# than these margins.
TINY_MARGIN, SMOLLM2_MARGIN = 1e-4, 1e-3


@pytest.fixture(scope="module")
def tiny(tiny_checkpoint):
    return load_model(tiny_checkpoint), load_tokenizer(tiny_checkpoint)


@pytest.fixture(scope="module")
def tiny_on_device(tiny_checkpoint, device):
    return load_model(tiny_checkpoint, device), load_tokenizer(tiny_checkpoint)


@pytest.fixture(scope="module")
def smollm2():
    assert (SMOLLM2_DIR / "model.pth").is_file(), "run: bash scripts/prepare.sh"
    return load_model(SMOLLM2_DIR), load_tokenizer(SMOLLM2_DIR)


def random_prompts(lengths, vocab, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


def test_batch_equals_each_prompt_alone(tiny_on_device):
    model, _ = tiny_on_device
    prompts = random_prompts([1, 3, 7, 12, 20, 27, 33, 40], 300)
    batch = generate(model, prompts, 24).tokens
    for prompt, row in zip(prompts, batch):
        assert_same_greedy(model, prompt, row, generate(model, prompt, 24).tokens[0], TINY_MARGIN)
    assert len({tuple(r) for r in batch}) == 8


def test_batch_equals_each_prompt_alone_smollm2(smollm2):
    model, tokenizer = smollm2
    prompts = [tokenizer.encode(t) for t in SMOLLM2_PROMPTS]
    assert min(map(len, prompts)) == 1 and max(map(len, prompts)) >= 40
    batch = generate(model, prompts, 16).tokens
    for prompt, row in zip(prompts, batch):
        assert_same_greedy(model, prompt, row, generate(model, prompt, 16).tokens[0], SMOLLM2_MARGIN)


def test_padding_is_invisible(tiny_on_device):
    model, _ = tiny_on_device
    short, other, longer = random_prompts([5, 9, 38], 300, seed=1)
    alone = generate(model, short, 20).tokens[0]
    for pad_id in (0, 17, 299):
        assert_same_greedy(
            model, short, generate(model, [short, other], 20, pad_id=pad_id).tokens[0], alone, TINY_MARGIN
        )
        # 33 slots of padding
        assert_same_greedy(
            model, short, generate(model, [short, longer], 20, pad_id=pad_id).tokens[0], alone, TINY_MARGIN
        )


def test_eos_stops_each_row_at_its_place(tiny):
    model, _ = tiny
    prompts = random_prompts([4, 6, 9], 300, seed=2)
    free = generate(model, prompts, 30).tokens
    eos = free[0][10]  # a token row 0 produces; the other rows may produce it elsewhere or never
    stopped = generate(model, prompts, 30, eos_ids=[eos])
    for row, out, reason in zip(free, stopped.tokens, stopped.finish_reasons):
        assert out == row[: row.index(eos)] if eos in row else out == row
        assert reason == ("eos" if eos in row else "length")


def split_stop_string(tokenizer, tokens):
    """A 2-character stop string made of the last character of one token and the first of the next."""
    text = tokenizer.decode(tokens)
    for i in range(3, len(tokens) - 1):
        boundary = len(tokenizer.decode(tokens[: i + 1]))
        stop = text[boundary - 1 : boundary + 1]
        clean = tokenizer.decode(tokens[: i + 1]) == text[:boundary]  # no character split at this boundary
        completes = tokenizer.decode(tokens[: i + 2]).startswith(text[: boundary + 1])  # token i+1 brings the 2nd
        if len(stop) == 2 and stop.strip() and text.find(stop) == boundary - 1 and clean and completes:
            return stop, i, boundary
    raise AssertionError("no usable token boundary")


def test_stop_string_across_two_tokens(tiny):
    model, tokenizer = tiny
    prompts = random_prompts([4, 7], 300, seed=3)
    free = generate(model, prompts, 40, tokenizer=tokenizer)
    stop, i, boundary = split_stop_string(tokenizer, free.tokens[0])
    result = generate(model, prompts, 40, tokenizer=tokenizer, stop=[stop])
    assert result.texts[0] == free.texts[0][: boundary - 1]
    assert result.tokens[0] == free.tokens[0][: i + 2] and result.finish_reasons[0] == "stop"
    other = free.texts[1]
    expected = other[: other.find(stop)] if stop in other else other
    assert result.texts[1] == expected
    # Streaming (one row) stops where generating that row alone stops, and never shows any part of the stop string.
    alone = generate(model, prompts[0], 40, tokenizer=tokenizer, stop=[stop])
    assert_same_greedy(model, prompts[0], alone.tokens[0], result.tokens[0], TINY_MARGIN)
    pieces = []
    streamed = Stream(model, tokenizer, prompts[0], 40, stop=[stop]).run(pieces.append)
    assert "".join(pieces) == streamed.texts[0] == alone.texts[0]
    assert streamed.tokens[0] == alone.tokens[0]


def test_incremental_decoding_of_split_characters(tiny):
    _, tokenizer = tiny
    text = "日本語 🙂🚀 café ½ — Ærø"
    ids = tokenizer.encode(text, bos=False)
    assert len(ids) > len(text), "the tokenizer should split multi-byte characters"
    decoder = IncrementalDecoder(tokenizer)
    pieces = [decoder.push(t) for t in ids] + [decoder.flush()]
    assert "".join(pieces) == text
    assert not any("\ufffd" in p for p in pieces)


def test_text_pieces_end_at_eos_inside_a_character(tiny):
    """An EOS (or the last token) that cuts a character in half: the pieces shown still join to the decoded text."""
    _, tokenizer = tiny
    ids = tokenizer.encode("日本語", bos=False)[:-1]
    expected = tokenizer.decode(ids)
    assert expected.endswith("\ufffd"), "the cut should leave half a character"
    for last in [tokenizer.eos_ids[0], None]:
        pieces = TextPieces(tokenizer, stop=[])
        shown = [pieces.push(t) for t in ids] + [pieces.push(last) if last is not None else pieces.end()]
        assert "".join(shown) == expected and pieces.finished == ("eos" if last is not None else None)


def test_stream_pieces_join_to_the_generation(tiny):
    model, tokenizer = tiny
    prompt = tokenizer.encode("日本語 🙂")
    pieces = []
    result = Stream(model, tokenizer, prompt, 40, sampling=SamplingParams(temperature=1.0, seed=5)).run(pieces.append)
    assert "".join(pieces) == result.texts[0] == tokenizer.decode(result.tokens[0])
    assert (
        result.tokens[0]
        == generate(
            model, prompt, 40, sampling=SamplingParams(temperature=1.0, seed=5), eos_ids=tokenizer.eos_ids
        ).tokens[0]
    )


@pytest.mark.parametrize("which", ["tiny", "smollm2"])
def test_chat_prefills_only_the_new_turn(request, which):
    model, tokenizer = request.getfixturevalue(which)
    chat = Chat(model, tokenizer, max_new_tokens=12, cache_length=256)
    first = chat.send("Hello! What is the capital of France?")
    assert first.prompt_tokens == [len(chat.render(chat.messages[:1]))]
    conversation = chat.render(chat.messages + [{"role": "user", "content": "And of Italy?"}])
    second = chat.send("And of Italy?")
    # Only what follows the cached prefix is prefilled: the end of turn 1 and the new message.
    assert chat.last_prefill == second.prompt_tokens[0] < len(conversation) // 2
    # The reply is the one a fresh prefill of the whole conversation gives.
    fresh = generate(model, conversation, 12, eos_ids=tokenizer.eos_ids, tokenizer=tokenizer)
    margin = TINY_MARGIN if which == "tiny" else SMOLLM2_MARGIN
    assert_same_greedy(model, conversation, second.tokens[0], fresh.tokens[0], margin)
    if second.tokens == fresh.tokens:
        assert second.texts == fresh.texts


def test_chat_drops_oldest_turns_when_full(tiny):
    model, tokenizer = tiny
    chat = Chat(model, tokenizer, max_new_tokens=20, cache_length=80)
    for i in range(6):
        chat.send(f"message number {i} with some words")
    assert chat.dropped_turns > 0 and chat.messages[-2]["content"] == "message number 5 with some words"
    with pytest.raises(ValueError, match="does not fit"):
        chat.send("a very long message " * 30)


def test_logprobs_are_the_models_own(tiny):
    model, _ = tiny
    prompt = random_prompts([6], 300, seed=4)[0]
    result = generate(model, prompt, 10, sampling=SamplingParams(logprobs=3))
    tokens = result.tokens[0]
    model.setup_caches(1, 16)
    with torch.no_grad():
        reference = torch.log_softmax(model(torch.tensor([prompt + tokens]), torch.arange(16)), dim=-1)[0]
    # A decode step and one forward over the whole sequence agree to ~1e-6 here; 1e-4 still tells apart
    # log-probs of the wrong position or of processed logits (differences of 1e-1 and more).
    for i, entry in enumerate(result.logprobs[0]):
        row = reference[len(prompt) - 1 + i]
        assert entry.token == tokens[i]
        assert abs(entry.logprob - row[tokens[i]].item()) < 1e-4
        ids, values = zip(*entry.top)
        assert len(set(ids)) == 3 and all(abs(v - row[t].item()) < 1e-4 for t, v in entry.top)
        assert torch.allclose(torch.tensor(values), row.topk(3).values, atol=1e-4)  # the 3 best, best first
        assert entry.top[0][0] == tokens[i]  # greedy picks the most likely


def test_bad_requests(tiny):
    model, tokenizer = tiny
    cases = [
        (lambda: generate(model, [], 5), "the prompt list is empty"),
        (lambda: generate(model, [[1, 2], []], 5), "a prompt is empty"),
        (lambda: generate(model, [1, 2], 5, stop=[""], tokenizer=tokenizer), "a stop string is empty"),
        (lambda: generate(model, [1, 2], 5, stop=["x"]), "stop strings need the tokenizer"),
    ]
    for call, message in cases:
        with pytest.raises(ValueError, match=message):
            call()
    model.setup_caches(2, 32)
    with pytest.raises(ValueError, match="batch of 3 rows is larger than the cache, set up for 2"):
        model(torch.ones(3, 4, dtype=torch.long), torch.arange(4))


def test_padded_row_computes_what_it_computes_alone(tiny):
    """A left-padded row sees none of its padding, and its rotary positions restart at its first real token."""
    model, _ = tiny
    prompt = torch.tensor(random_prompts([10], 300, seed=6))
    pad = 200
    model.setup_caches(1, 256)
    # The positions themselves: under RoPE a uniform shift of every position leaves the logits unchanged up to
    # rounding, so no tolerance on logits could see it. The angles must be those of positions 0..9, exactly.
    positions, inputs = model.attention_inputs(torch.arange(pad + 10), torch.tensor([pad]), 1)
    angles, _, (mask,) = inputs["full_attention"]
    assert torch.equal(positions[0, pad:], torch.arange(10)) and torch.equal(angles[0, pad:], model.freqs_cis[:10])
    # Each real query sees the real slots up to its own and no padding slot.
    assert torch.equal(mask[0, 0, pad:, pad : pad + 10], torch.ones(10, 10, dtype=torch.bool).tril())
    assert not mask[0, 0, pad:, :pad].any() and not mask[0, 0, pad:, pad + 10 :].any()
    with torch.no_grad():
        alone = model(prompt, torch.arange(10))
        x = torch.cat([torch.full((1, pad), 5), prompt], dim=1)
        padded = model(x, torch.arange(pad + 10), torch.tensor([pad]))[:, pad:]
        leaky = model(x, torch.arange(pad + 10), torch.tensor([pad - 1]))[:, pad:]  # one padding slot visible
    # Rounding alone separates alone and padded (3e-6 on an AVX2 and on an AVX-512 CPU); one visible padding
    # token moves the logits by far more than the 1e-4 allowed (by 5 here), which the last line checks.
    assert (alone - padded).abs().max() < 1e-4
    assert (alone - leaky).abs().max() > 1e-2


def test_prefill_never_fuses(tiny_checkpoint):
    """A prefill's products, its last row's output projection included, take the library path whatever the kernels
    chose for decode steps (fused eagerly, one row materialises a weight-sized temporary): its first token and
    log-probs are bitwise those of library kernels."""
    outputs = []
    for matvec in ("library", "fused"):
        model = load_model(tiny_checkpoint, kernels=Kernels(float_matvec=matvec, quant_matvec=matvec))
        model.setup_caches(1, 16)
        x = torch.tensor([random_prompts([9], model.config.vocab_size)[0]])
        s = sampler_state(SamplingParams(temperature=0, logprobs=3), x.tolist(), model.config.vocab_size, x.device)
        with torch.no_grad():
            outputs.append(prefill(model, x, torch.arange(9), torch.zeros(1, dtype=torch.long), s, True, 3))
    (token, logprobs), (fused_token, fused_logprobs) = outputs
    assert torch.equal(token, fused_token) and all(map(torch.equal, logprobs, fused_logprobs))


def test_a_long_prompt_enters_the_cache_in_pieces(tiny_checkpoint, monkeypatch, device):
    """Prompts longer than decode.PREFILL_CHUNK (8 here) enter the cache in pieces, each attending to the positions
    before it: the greedy tokens of one piece (they differ by float32 rounding alone, so the margin is small), for a
    batch of prompts of different lengths (left-padded, one shorter than a piece), a continuation of cached positions
    (a chat's next turn), and speculation by prompt lookup. A piece that attended to itself alone, or sat at the
    wrong positions, would part the tokens with a wide margin."""
    model = load_model(tiny_checkpoint, device)
    prompts = random_prompts([37, 6, 20], model.config.vocab_size)
    rounds = {0: 1.0, 2: 1.0}  # round costs alike: every round verifies what prompt lookup proposes
    outputs = {}
    for chunk in (4096, 8):
        monkeypatch.setattr(decode, "PREFILL_CHUNK", chunk)
        batch = generate(model, prompts, 12).tokens
        lookup = generate(model, prompts[0] * 2, 12, ngram=True, speculate_k=2, round_costs=rounds).tokens[0]
        first = generate(model, prompts[0], 4).tokens[0]
        model.setup_caches(1, 80)  # the next turn continues from the 41 positions cached
        list(decode.token_steps(model, [prompts[0] + first], 1, SamplingParams(), Steps()))
        turn = [int(t) for t, _ in decode.token_steps(model, [prompts[2]], 8, SamplingParams(), Steps(), start_pos=41)]
        outputs[chunk] = batch, lookup, turn
    for got, expected, prompt in zip(outputs[8][0], outputs[4096][0], prompts):
        assert_same_greedy(model, prompt, got, expected, 1e-4)
    assert_same_greedy(model, prompts[0] * 2, outputs[8][1], outputs[4096][1], 1e-4)
    assert outputs[8][2] == outputs[4096][2]


def test_decode_steps_read_only_the_filled_part_of_a_long_cache(tiny_checkpoint):
    """A decode step attends to a window of the cache that covers every position written so far, rounded up to
    16 slots (a CPU's), not to the whole cache set up for a chat: the same tokens as a cache just long enough."""
    model = load_model(tiny_checkpoint)
    prompt = random_prompts([21], model.config.vocab_size)[0]
    tight = generate(model, prompt, 40).tokens[0]
    model.setup_caches(1, model.config.block_size)
    windows = []

    def decode(model, x, input_pos, left_pad, s, greedy, n_logprobs, window=None):
        windows.append((int(input_pos[0]), model.max_seq_length if window is None else window.shape[0]))
        return decode_one_token(model, x, input_pos, left_pad, s, greedy, n_logprobs, window)

    assert generate(model, prompt, 40, steps=Steps(decode=decode)).tokens[0] == tight
    assert len(windows) == 39
    assert all(position < length <= position + 16 and length % 16 == 0 for position, length in windows), windows
