"""Every model family against transformers: a tiny random model of each, with the family's distinctive features
switched on, converted from its save_pretrained folder (logits, the KV cache, greedy generation, padded batches,
quantization)."""

import functools

import pytest
import torch
import transformers as tf

from chat import Chat
from conftest import TINY_VOCAB, assert_same_greedy, make_hf_llama
from convert_hf_checkpoint import convert_hf_checkpoint
from decode import compile_steps
from generate import generate, load_model
from kernels import Kernels, Linear
from quantize import quantize_model
from tokenizer import load_tokenizer

pytestmark = pytest.mark.numerics

# Float32 logits of ours and of transformers differ by rounding alone (the largest seen: below 2e-5, on AVX2
# and AVX-512 machines); every fault this must catch (a missing norm offset, a soft-cap, a window one slot off, a
# rotary base or factor, an expert's weight, a transposed Conv1D) moves some logit by more than 1e-2.
TOLERANCE = 1e-4
LENGTHS = (40, 80)  # both past every sliding window below; 80 also past Phi-3's and YaRN's original contexts
HEAD_DIM_16 = 8  # rotary pairs of a 16-wide head


def longrope(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    short, long = 1 + torch.rand(HEAD_DIM_16, generator=g), 2 + 6 * torch.rand(HEAD_DIM_16, generator=g)
    return {
        "rope_type": "longrope",
        "short_factor": short.tolist(),
        "long_factor": long.tolist(),
        "rope_theta": 10000.0,
    }


# (model class, config class, overrides of make_hf_llama's tiny Llama settings)
FAMILIES = {
    "gpt2": (
        tf.GPT2LMHeadModel,
        tf.GPT2Config,
        dict(n_embd=64, n_layer=2, n_head=4, n_positions=256, n_inner=None, tie_word_embeddings=True),
    ),
    "gemma": (tf.GemmaForCausalLM, tf.GemmaConfig, dict(num_key_value_heads=1, head_dim=32, tie_word_embeddings=False)),
    "gemma2": (
        tf.Gemma2ForCausalLM,
        tf.Gemma2Config,
        dict(
            num_hidden_layers=3,
            num_key_value_heads=2,
            head_dim=32,
            sliding_window=8,
            query_pre_attn_scalar=24,
            attn_logit_softcapping=8.0,
            final_logit_softcapping=4.0,
            tie_word_embeddings=False,
        ),
    ),
    "gemma3": (
        tf.Gemma3ForCausalLM,
        tf.Gemma3TextConfig,
        dict(
            hidden_size=32,
            seed=2,
            num_hidden_layers=3,
            sliding_window_pattern=3,
            sliding_window=8,
            num_key_value_heads=2,
            head_dim=32,
            query_pre_attn_scalar=32,
            tie_word_embeddings=True,
            rope_parameters={
                "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            },
        ),
    ),
    "qwen3": (tf.Qwen3ForCausalLM, tf.Qwen3Config, dict(num_key_value_heads=2, head_dim=32, tie_word_embeddings=True)),
    "qwen2_sliding": (
        tf.Qwen2ForCausalLM,
        tf.Qwen2Config,
        dict(num_key_value_heads=2, use_sliding_window=True, sliding_window=8, max_window_layers=1),
    ),
    "qwen2_yarn": (  # YaRN past its original 64 positions; base 100 and beta_fast 4 put pairs 2-4 on the ramp
        tf.Qwen2ForCausalLM,
        tf.Qwen2Config,
        dict(
            num_key_value_heads=2,
            max_position_embeddings=64,
            rope_parameters={
                "rope_type": "yarn",
                "factor": 2.0,
                "original_max_position_embeddings": 64,
                "beta_fast": 4.0,
                "rope_theta": 100.0,
            },
        ),
    ),
    "mistral": (tf.MistralForCausalLM, tf.MistralConfig, dict(num_key_value_heads=2, sliding_window=8)),
    "phi3": (
        tf.Phi3ForCausalLM,
        tf.Phi3Config,
        dict(
            num_key_value_heads=2,
            sliding_window=16,
            original_max_position_embeddings=64,
            rope_parameters=longrope(0),
            pad_token_id=0,
        ),
    ),
    "mixtral": (
        tf.MixtralForCausalLM,
        tf.MixtralConfig,
        dict(num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2),
    ),
}


def converted(name: str, folder, tokenizer_json, device="cpu"):
    """(name, transformers model, our model converted from its folder and loaded on device) of a family."""
    model_cls, config_cls, overrides = FAMILIES[name]
    hf = make_hf_llama(folder / "hf", tokenizer_json, model_cls, config_cls, norm_noise=0.1, **overrides)
    convert_hf_checkpoint(folder / "hf", folder / "ours")
    return name, hf, load_model(folder / "ours", device)


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, tmp_path_factory, tiny_tokenizer_json):
    return converted(request.param, tmp_path_factory.mktemp(request.param), tiny_tokenizer_json)


@pytest.fixture(scope="module", params=["gemma3", "mistral"])
def windowed(request, tmp_path_factory, tiny_tokenizer_json, device):
    """A family with sliding windows of 8, ours on the test device: Gemma 3 (two sliding layers and a full one),
    Mistral (all sliding)."""
    folder = tmp_path_factory.mktemp(request.param + "_rolling")
    return (*converted(request.param, folder, tiny_tokenizer_json, device), folder / "ours")


def test_logits_and_kv_cache_match_transformers(family):
    name, hf, model = family
    for length in LENGTHS:
        x = torch.randint(0, TINY_VOCAB, (2, length), generator=torch.Generator().manual_seed(length))
        with torch.no_grad():
            reference = hf(x).logits
            model.setup_caches(2, length)
            full = model(x, torch.arange(length))
            assert (full - reference).abs().max() < TOLERANCE, (name, length)
            # Token by token through the KV cache gives the logits of the full-sequence forward.
            model.setup_caches(2, length)
            stepwise = torch.cat([model(x[:, i : i + 1], torch.tensor([i])) for i in range(length)], dim=1)
            assert (stepwise - full).abs().max() < TOLERANCE, (name, length)


def test_greedy_generation_matches_transformers(family):
    name, hf, model = family
    prompt = torch.randint(0, TINY_VOCAB, (8,), generator=torch.Generator().manual_seed(1))
    model.setup_caches(1, 40)  # within Phi-3's original context, where transformers uses the short factors
    ours = generate(model, prompt, 32).tokens[0]
    theirs = hf.generate(prompt[None], max_new_tokens=32, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert_same_greedy(model, prompt.tolist(), ours, theirs[0, 8:].tolist(), TOLERANCE)
    assert len(set(ours)) >= 4, "degenerate output makes the comparison weak"


def test_padded_batch_rows_equal_each_prompt_alone(family):
    name, hf, model = family
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, TINY_VOCAB, (n,), generator=g).tolist() for n in (13, 3, 7)]
    batch = generate(model, prompts, 24).tokens
    for prompt, row in zip(prompts, batch):
        assert_same_greedy(model, prompt, row, generate(model, prompt, 24).tokens[0], TOLERANCE)


def dequantized_copy(model, kind: str, groupsize: int):
    """A float model whose linear layers hold the weights quantization rounds them to (the output projection
    in int8, as quantize.py does), computed with float32 arithmetic: what a quantized model must compute."""
    import copy

    from quantize import dequantize_int4, int4_group_params, quantize_int4_values, quantize_int8, quantized_linears

    reference = copy.deepcopy(model)
    if reference.output is None:  # the quantized output projection has weights of its own
        reference.output = Linear(model.config.dim, model.config.vocab_size, bias=False)
        reference.output.weight = torch.nn.Parameter(model.tok_embeddings.weight.clone())
    with torch.no_grad():
        for name, linear in quantized_linears(reference):
            w = linear.weight
            if kind == "int8" or name == "output":
                q, scales = quantize_int8(w)
                w.copy_(q.float() * scales[:, None])
            else:
                scales, zeros = int4_group_params(w, groupsize)
                w.copy_(dequantize_int4(quantize_int4_values(w, scales, zeros, groupsize), scales, zeros, groupsize))
    return reference


# float32 activations for ATen's int8/int4 kernels (they take bfloat16 by default), so that what is compared is
# the quantized weights and their layout, not bfloat16 rounding.
EXACT = Kernels(gemm_dtype=torch.float32, kernel_activations=torch.float32)
# Relative error of the logits, ||quantized - float|| / ||float||, over 80 positions, as measured on these tiny
# random models (whose logits are far more sensitive than a trained model's): int8 0.017-0.029 (Mixtral 0.086: a
# perturbed router picks other experts for some tokens), int4 with groups of 32: 0.19-0.37 (Mixtral 0.44). A
# layer left in float or rounded to the wrong weights is caught by the dequantized reference instead, exactly.
QUANTIZED_BOUNDS = {"int8": 0.15, "int4": 0.6}


@pytest.mark.parametrize("kind", QUANTIZED_BOUNDS)
def test_quantized_computes_its_rounded_weights_and_stays_close_to_float(family, kind):
    name, _, model = family
    quantized = quantize_model(model, kind, 32, EXACT)
    linears = [m for m in quantized.modules() if isinstance(m, torch.nn.Linear)]
    assert not linears, f"{name}: linear layers left in float: {linears}"
    reference = dequantized_copy(model, kind, 32)
    x = torch.randint(0, TINY_VOCAB, (1, 80), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        logits = {}
        for label, m in (("float", model), ("quantized", quantized), ("reference", reference)):
            m.setup_caches(1, 80)
            logits[label] = m(x, torch.arange(80))
    assert (logits["quantized"] - logits["reference"]).abs().max() < TOLERANCE, name
    error = ((logits["quantized"] - logits["float"]).norm() / logits["float"].norm()).item()
    assert 0 < error < QUANTIZED_BOUNDS[kind], (name, error)


@pytest.mark.parametrize("name", ["gpt2", "gemma3", "mixtral"])
def test_compiled_decode_has_no_graph_break(tmp_path, tiny_tokenizer_json, name):
    """Learned positions, sliding layers (rolling caches) and global ones with their own rotary bases, and experts:
    one graph."""
    import torch._dynamo

    model_cls, config_cls, overrides = FAMILIES[name]
    make_hf_llama(tmp_path / "hf", tiny_tokenizer_json, model_cls, config_cls, norm_noise=0.1, **overrides)
    convert_hf_checkpoint(tmp_path / "hf", tmp_path / "ours")
    model = load_model(tmp_path / "ours")
    prompts = [[5, 6, 7, 8, 9, 10], [11, 12]]  # left padding, and a sequence past the sliding window of 8
    if model.config.sliding_window:  # through rolling caches, which the generations keep
        model.setup_caches(2, 30, chunk=CHUNK)
    eager = generate(model, prompts, 24).tokens
    torch._dynamo.reset()
    counters = torch._dynamo.utils.counters
    counters.clear()
    with torch._dynamo.config.patch(error_on_recompile=True):
        compiled = generate(model, prompts, 24, steps=compile_steps(torch.device("cpu"))).tokens
    assert counters["stats"]["unique_graphs"] == 1 and not counters["graph_break"]
    for prompt, got, expected in zip(prompts, compiled, eager):
        assert_same_greedy(model, prompt, got, expected, TOLERANCE)


def test_speculative_decoding_with_a_quantized_draft(family):
    """Greedy speculation gives the target's own greedy tokens, whatever the draft (here: its int8 copy)."""
    name, _, model = family
    prompt = torch.randint(0, TINY_VOCAB, (6,), generator=torch.Generator().manual_seed(4)).tolist()
    plain = generate(model, prompt, 24).tokens[0]
    draft = quantize_model(model, "int8", kernels=EXACT)
    deepest = {0: 1.0, 2: 1.0, 4: 1.0}  # round costs alike: every round drafts 4 (not what this machine's timing picks)
    speculative = generate(model, prompt, 24, draft_model=draft, speculate_k=4, round_costs=deepest)
    assert_same_greedy(model, prompt, speculative.tokens[0], plain, TOLERANCE)
    assert speculative.speculation["acceptance_rate"] > 0  # the draft's proposals were checked and taken, not bypassed


def test_gemma3_multimodal_folder_converts_to_its_language_model(tmp_path, tiny_tokenizer_json):
    """A gemma3 folder (language model and vision tower): the converter keeps the language model, whose
    logits on text are the multimodal model's."""
    text = dict(
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=64,
        vocab_size=TINY_VOCAB,
        sliding_window=8,
        max_position_embeddings=128,
    )
    vision = dict(
        hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32, image_size=28, patch_size=14
    )
    hf = make_hf_llama(
        tmp_path / "hf",
        tiny_tokenizer_json,
        tf.Gemma3ForConditionalGeneration,
        tf.Gemma3Config,
        norm_noise=0.1,
        text_config=text,
        vision_config=vision,
        mm_tokens_per_image=4,
    )
    config = convert_hf_checkpoint(tmp_path / "hf", tmp_path / "ours")
    assert config.qk_norm and config.post_norms and config.sliding_window == 8
    model = load_model(tmp_path / "ours")
    x = torch.randint(0, TINY_VOCAB, (1, 24), generator=torch.Generator().manual_seed(5))
    model.setup_caches(1, 24)
    with torch.no_grad():
        assert (model(x, torch.arange(24)) - hf(input_ids=x).logits).abs().max() < TOLERANCE


# Rolling caches: a call takes at most 3 positions, so a sliding layer's ring holds 8 + 3 - 1 = 10 slots, and every
# sequence below runs past it more than twice (3x the window: 24 positions and more).
CHUNK = 3


def rolling_caches(model, rows: int, length: int, chunk: int = CHUNK):
    """Sets up rolling caches, and checks that the sliding layers' buffers are ring-sized, the full layers'
    full-length."""
    model.setup_caches(rows, length, chunk=chunk)
    for layer in model.layers:
        cache = layer.attention.kv_cache
        slots = model.config.sliding_window + chunk - 1 if layer.attention.kind == "sliding_attention" else length
        assert (
            cache.k_cache.shape
            == cache.v_cache.shape
            == (rows, layer.attention.n_kv_heads, slots, model.config.head_dim)
        )


def test_rolling_caches_give_transformers_logits(windowed, device):
    """A forward over 24 positions (in pieces of 3), token by token, and after rows swapped or copied, through
    rings of 10 slots: transformers' logits (theirs on the CPU, ours on the test device)."""
    name, hf, model, _ = windowed
    x_cpu = torch.randint(0, TINY_VOCAB, (2, 24), generator=torch.Generator().manual_seed(5))
    x, arange = x_cpu.to(device), functools.partial(torch.arange, device=device)
    with torch.no_grad():
        reference = hf(x_cpu).logits.to(device)
        rolling_caches(model, 2, 24)
        assert (model(x, arange(24)) - reference).abs().max() < TOLERANCE, name
        rolling_caches(model, 2, 24)
        stepwise = torch.cat([model(x[:, i : i + 1], arange(i, i + 1)) for i in range(24)], dim=1)
        assert (stepwise - reference).abs().max() < TOLERANCE, name
        # A ring keeps its last 10 positions: a query at 24 still finds its window, one at 10 no longer.
        assert model.holds(0, 0, 24) and not model.holds(0, 0, 10)
        # Rows move with their rings (a server's slots): row 0 holding 17 positions and row 1 holding 12, swapped,
        # or row 0's copied into row 1, go on as the rows they took.
        for move in ("swap", "copy"):
            rolling_caches(model, 2, 24)
            model(x[:1, :17], arange(17), cache_rows=arange(0, 1))
            model(x[1:, :12], arange(12), cache_rows=arange(1, 2))
            if move == "swap":
                model.swap_rows(0, 1, 17)
                rows, starts = (1, 0), (12, 17)  # what each cache row now holds, and its length
            else:
                model.copy_positions(0, 1, 0, 17)
                rows, starts = (0, 0), (17, 17)
            for cache_row, (row, start) in enumerate(zip(rows, starts)):
                logits = model(x[row : row + 1, start:], arange(start, 24), cache_rows=arange(cache_row, cache_row + 1))
                assert (logits - reference[row : row + 1, start:]).abs().max() < TOLERANCE, (name, move)


def hf_greedy(hf, prompt: list[int], n: int) -> list[int]:
    out = hf.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt) :].tolist()


def test_rolling_caches_generate_as_transformers(windowed):
    """Through rings of 10 slots: a padded batch of prompts of 13, 3 and 7 tokens, and speculative rounds of 4
    drafts (an int4 draft, with rolling caches of its own, whose rejected drafts were written to the ring) give
    transformers' greedy tokens."""
    name, hf, model, _ = windowed
    g = torch.Generator().manual_seed(6)
    prompts = [torch.randint(0, TINY_VOCAB, (n,), generator=g).tolist() for n in (13, 3, 7)]
    rolling_caches(model, 3, 13 + 24)
    for prompt, row in zip(prompts, generate(model, prompts, 24).tokens):
        assert_same_greedy(model, prompt, row, hf_greedy(hf, prompt, 24), TOLERANCE)
    draft = quantize_model(model, "int4", 32, EXACT)
    for m in (model, draft):  # a call writes up to 4 positions past the next call's first: chunks of 4
        rolling_caches(m, 1, 13 + 24 + 5, chunk=4)
    deepest = {0: 1.0, 2: 1.0, 4: 1.0}
    speculative = generate(model, prompts[0], 24, draft_model=draft, speculate_k=4, round_costs=deepest)
    assert model.max_seq_length == 13 + 24 + 5, "the rolling caches were kept"
    assert_same_greedy(model, prompts[0], speculative.tokens[0], hf_greedy(hf, prompts[0], 24), TOLERANCE)
    assert 0 < speculative.speculation["acceptance_rate"] < 1, "some drafts were rejected"


def test_a_chat_keeps_its_conversation_in_rolling_caches(windowed):
    """A Chat's turns through rings of 10 slots reply with transformers' greedy tokens. A turn whose prefix the
    ring still holds the window of prefills only what is new; one whose prefix ends before what the ring holds
    (the previous reply, re-rendered with a newline before it, parts from the cache where the reply began) is
    prefilled whole."""
    name, hf, model, folder = windowed
    tokenizer = load_tokenizer(folder)
    chat = Chat(model, tokenizer, max_new_tokens=1, cache_length=128)
    rolling_caches(model, 1, 128)
    first = chat.send("the first message, long enough to roll the window")  # one token: the cache ends at the prompt
    assert first.prompt_tokens[0] > 3 * model.config.sliding_window
    chat.max_new_tokens = 12
    for text, reused in (("and a second one", True), ("a third", False)):
        conversation = chat.render(chat.messages + [{"role": "user", "content": text}])
        reply = chat.send(text)
        assert (chat.last_prefill < len(conversation) // 2) if reused else chat.last_prefill == len(conversation)
        made = reply.raw_tokens[0]  # through an EOS, where one ended it
        assert_same_greedy(model, conversation, made, hf_greedy(hf, conversation, len(made)), TOLERANCE)
