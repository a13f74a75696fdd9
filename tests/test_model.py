"""The model against transformers: logits, the KV cache, greedy generation; and config validation."""

import functools
import json

import pytest
import torch

from config import ModelArgs
from conftest import assert_same_greedy, make_hf_llama
from convert_hf_checkpoint import convert_hf_checkpoint
from generate import generate, load_model
from model import KVCache, Transformer, grouped_attention

pytestmark = pytest.mark.numerics

# Our float32 logits and transformers' (and ours decoded step by step, or prefilled in chunks) differ by
# rounding alone: at most 1.2e-5 over these configs on an AVX2 CPU, and 1.0e-5 with ATen's portable kernels
# (ATEN_CPU_CAPABILITY=default). Every fault this must catch (a q/k permutation, a norm, a mask, a rope scaling,
# a cache slot) moves them by more than 1e-2, so TOLERANCE sits well between the two.
TOLERANCE = 1e-4
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,
}
CONFIGS = {
    "mha": {},
    "gqa": {"num_key_value_heads": 2},
    "mqa": {"num_key_value_heads": 1},
    "head_dim_not_dim_over_heads": {"num_key_value_heads": 2, "head_dim": 24},
    "attention_bias": {"attention_bias": True},
    "tied_embeddings": {"tie_word_embeddings": True},
    "llama3_rope_scaling": {"rope_scaling": LLAMA3_ROPE, "rope_theta": 500000.0},
    "everything": {
        "num_key_value_heads": 2,
        "head_dim": 40,
        "attention_bias": True,
        "tie_word_embeddings": True,
        "rope_scaling": LLAMA3_ROPE,
        "rope_theta": 500000.0,
    },
}


def convert(tmp_path, tokenizer_json, device="cpu", **overrides):
    hf_dir, out = tmp_path / "hf", tmp_path / "ours"
    hf = make_hf_llama(hf_dir, tokenizer_json, **overrides)
    convert_hf_checkpoint(hf_dir, out)
    return hf, load_model(out / "model.pth", device)


@pytest.mark.parametrize("name", CONFIGS)
def test_matches_transformers(tmp_path, tiny_tokenizer_json, name, device):
    """Ours on the test device, transformers' on the CPU: the logits of a forward, of decoding step by step through
    the KV cache (all of it, or the slots it needs), of a chunked prefill, and greedy continuations."""
    hf, model = convert(tmp_path, tiny_tokenizer_json, device, **CONFIGS[name])
    torch.manual_seed(1)
    x_cpu = torch.randint(0, hf.config.vocab_size, (2, 48))
    x, arange = x_cpu.to(device), functools.partial(torch.arange, device=device)
    model.setup_caches(2, 64)
    with torch.no_grad():
        reference = hf(x_cpu).logits.to(device)
        full = model(x, arange(48))
        assert (full - reference).abs().max() < TOLERANCE
        # Token by token through the KV cache gives the logits of the full-sequence forward.
        model.setup_caches(2, 64)
        stepwise = torch.cat([model(x[:, i : i + 1], arange(i, i + 1)) for i in range(48)], dim=1)
        assert (stepwise - full).abs().max() < TOLERANCE
        # So does each step attending to the fewest cache slots that hold what it sees (kv_length), as a server does.
        model.setup_caches(2, 64)
        windowed = torch.cat([model(x[:, i : i + 1], arange(i, i + 1), kv_length=i + 1) for i in range(48)], dim=1)
        assert (windowed - full).abs().max() < TOLERANCE
        # A chunked prefill (16 + 32 positions) too.
        model.setup_caches(2, 64)
        chunks = torch.cat([model(x[:, :16], arange(16)), model(x[:, 16:], arange(16, 48))], dim=1)
        assert (chunks - full).abs().max() < TOLERANCE
        # A prefill that asks for the last position's logits only (what generation samples from).
        model.setup_caches(2, 64)
        last = model(x, arange(48), last_only=True)
        assert last.shape == (2, 1, hf.config.vocab_size) and (last - reference[:, -1:]).abs().max() < TOLERANCE

    prompt = torch.randint(0, hf.config.vocab_size, (7,))
    ours = generate(model, prompt, 32).tokens[0]
    theirs = hf.generate(prompt[None], max_new_tokens=32, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert_same_greedy(model, prompt.tolist(), ours, theirs[0, 7:].tolist(), TOLERANCE)
    assert len(set(ours)) >= 4, "degenerate output makes the comparison weak"


def test_groups_of_rows_attend_to_windows_of_their_own(tiny_checkpoint, device):
    """A step whose rows attend in two groups, each to a window of its own (a server's short rows beside rows
    holding long prompts), gives every row the logits it gets attending to the whole cache; a group that took the
    other's shorter window would miss most of its rows' positions."""
    model = load_model(tiny_checkpoint / "model.pth", device)
    model.setup_caches(4, 64)
    torch.manual_seed(2)
    lengths = [5, 9, 40, 50]  # rows 0 and 1 in one group, rows 2 and 3 in the other
    with torch.no_grad():
        for row, length in enumerate(lengths):
            tokens = torch.randint(3, model.config.vocab_size, (1, length), device=device)
            model(tokens, torch.arange(length, device=device), cache_rows=torch.tensor([row], device=device))
        x = torch.randint(3, model.config.vocab_size, (4, 1), device=device)
        positions = torch.tensor(lengths, device=device)[:, None]
        whole = model(x, positions)
        grouped = model(x, positions, kv_length=(10, 51))
        assert (grouped - whole).abs().max() < TOLERANCE
        assert (model(x, positions, kv_length=(51, 10)) - whole)[2:].abs().max() > 100 * TOLERANCE
        with pytest.raises(ValueError, match="equal groups"):
            model(x, positions, kv_length=(10, 20, 51))


def test_qwen2_biases(tmp_path, tiny_tokenizer_json):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    hf, model = convert(
        tmp_path, tiny_tokenizer_json, model_cls=Qwen2ForCausalLM, config_cls=Qwen2Config, num_key_value_heads=2
    )
    assert model.config.attention_bias and not model.config.attention_out_bias
    x = torch.randint(0, hf.config.vocab_size, (1, 20))
    model.setup_caches(1, 32)
    with torch.no_grad():
        assert (model(x, torch.arange(20)) - hf(x).logits).abs().max() < TOLERANCE


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("logit_softcap", [None, 5.0])
def test_grouped_attention_against_float64(fused, logit_softcap):
    # 6 query heads on 2 KV heads, 3 queries (a verify step) over 10 cache slots, some of them masked; the
    # float64 reference repeats each KV head for its queries. Float32 rounding stays near 1e-6; a wrong head
    # grouping, mask or scale moves the output by more than 1e-2.
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 6, 3, 16), torch.randn(2, 2, 10, 16), torch.randn(2, 2, 10, 16)
    mask = torch.rand(2, 1, 3, 10) > 0.3
    mask[..., 0] = True
    y = grouped_attention(q, k, v, mask, 0.3, logit_softcap, fused)
    scores = q.double() @ k.double().repeat_interleave(3, dim=1).transpose(-1, -2) * 0.3
    if logit_softcap is not None:
        scores = logit_softcap * torch.tanh(scores / logit_softcap)
    probs = scores.masked_fill(~mask, float("-inf")).softmax(-1)
    torch.testing.assert_close(y.double(), probs @ v.double().repeat_interleave(3, dim=1), atol=1e-5, rtol=0)


def test_generate_stops_at_eos(tiny_checkpoint):
    model = load_model(tiny_checkpoint)
    prompt = torch.tensor([5, 6, 7])
    free = generate(model, prompt, 20).tokens[0]
    eos = free[5]
    stopped = generate(model, prompt, 20, eos_ids=[eos]).tokens[0]
    assert stopped == free[: free.index(eos)]


def test_config_validation(tmp_path):
    base = dict(dim=64, n_layer=2, n_head=4, intermediate_size=96, vocab_size=100)
    path = tmp_path / "config.json"
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}
    cases = {
        "not divisible by n_kv_heads": {**base, "n_kv_heads": 3},
        "missing fields ['vocab_size']": {k: v for k, v in base.items() if k != "vocab_size"},
        "unknown fields ['hidden_size']": {**base, "hidden_size": 64},
        "n_layer must be a positive integer": {**base, "n_layer": 0},
        "unsupported rope_scaling": {**base, "rope_scaling": {"rope_type": "dynamic", "factor": 2.0}},
        "rope_scaling original_max_position_embeddings must be a positive number": {
            **base,
            "rope_scaling": {"rope_type": "yarn", "factor": 4.0},
        },
        "rope_scaling beta_fast must be a positive number": {**base, "rope_scaling": {**yarn, "beta_fast": "32"}},
        "rope_scaling truncate must be true or false": {**base, "rope_scaling": {**yarn, "truncate": 1}},
        "rope_scaling has unknown keys ['mscale']": {**base, "rope_scaling": {**yarn, "mscale": 1.0}},
        "norm_type must be one of rmsnorm, gemma_rmsnorm, layernorm": {**base, "norm_type": "batchnorm"},
        "hidden_act must be one of silu, gelu_tanh": {**base, "hidden_act": "relu"},
        "layer_types must list 2": {**base, "layer_types": ["full_attention"]},
        "sliding_window is not set": {**base, "layer_types": ["full_attention", "sliding_attention"]},
        "n_experts_per_token must be in 1..2": {**base, "n_experts": 2, "n_experts_per_token": 3},
        "short_factor must be a list of 8": {
            **base,
            "rope_scaling": {
                "rope_type": "longrope",
                "original_max_position_embeddings": 64,
                "attention_factor": 1.1,
                "short_factor": [1.0] * 7,
                "long_factor": [2.0] * 8,
            },
        },
        "attn_logit_softcap must be a positive finite number": {**base, "attn_logit_softcap": 0},
    }
    for message, config in cases.items():
        path.write_text(json.dumps(config))
        with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
            ModelArgs.from_json(path)
    with pytest.raises(FileNotFoundError):
        ModelArgs.from_json(tmp_path / "absent.json")
    path.write_text(json.dumps({**base, "head_dim": 24}))
    assert ModelArgs.from_json(path).head_dim == 24


@pytest.mark.parametrize("stored, bits", [(torch.bfloat16, 8), (torch.float16, 11)])
def test_a_half_precision_kv_cache_rounds_each_value_and_reads_it_in_the_model_dtype(device, stored, bits):
    """A float32 model's KVCache stored in bfloat16 or float16 reads back float32 values, each within half a unit in
    the last place of the stored dtype (2^-bits of its magnitude, float16's subnormal step below), and not all of them
    exact, for a slice of rows and for listed rows; a model with that kv_cache_dtype counts half of float32's bytes
    per position."""
    torch.manual_seed(0)
    cache = KVCache(3, 10, 2, 64, torch.float32, stored).to(device)
    k, v = torch.randn(2, 2, 6, 64).to(device), (torch.randn(2, 2, 6, 64) * 100).to(device)
    cache.update(torch.arange(6, device=device), k, v)
    assert cache.k_cache.dtype == cache.v_cache.dtype == stored and cache.k_scale is None
    for rows in (slice(0, 2), torch.tensor([0, 1], device=device)):
        for written, read in zip((k, v), cache.read(rows, 6)):
            assert read.dtype == torch.float32
            assert (read - written).abs().le(written.abs() * 2.0**-bits + 2.0**-25).all()
            assert not torch.equal(read, written)
    model = Transformer(ModelArgs(dim=64, n_layer=2, n_head=4, intermediate_size=96, vocab_size=100, n_kv_heads=2))
    float_bytes = model.kv_bytes_per_position()
    model.kv_cache_dtype = stored
    assert 2 * model.kv_bytes_per_position() == float_bytes


def test_int8_kv_cache_holds_each_position_within_half_a_step(device):
    """An int8 KVCache reads back each position and head within half a quantization step of what was written
    (max |x| / 254 of that position and head, plus float32 rounding), for listed rows too; zeros stay zeros; copying
    and swapping rows move the scales with the codes; and it holds about a quarter of float32's bytes."""
    torch.manual_seed(0)
    cache = KVCache(3, 10, 2, 64, torch.float32, torch.int8).to(device)
    k, v = (torch.randn(2, 2, 6, 64) * torch.rand(2, 2, 6, 1) * 10).to(device), torch.randn(2, 2, 6, 64).to(device)
    v[0, 1, 2] = 0
    cache.update(torch.arange(6, device=device), k, v)
    for written, read in zip((k, v), cache.read(slice(0, 2), 6)):
        step = written.abs().amax(-1, keepdim=True) / 127
        assert (read - written).abs().le(step * (0.5 + 1e-4)).all()  # the slack: float32 rounding of x * 127 / max
        assert (read - written).abs().amax() > step.amin() / 10  # it is quantized, not stored as given
    assert torch.equal(cache.read(slice(0, 2), 6)[1][0, 1, 2], torch.zeros(64, device=device))
    rows = torch.tensor([1, 0], device=device)
    assert torch.equal(cache.read(rows, 6)[0], cache.read(slice(0, 2), 6)[0][[1, 0]])
    before = cache.read(slice(0, 2), 6)
    cache.copy_slots(0, 2, slice(0, 6))
    assert torch.equal(cache.read(slice(2, 3), 6)[0], before[0][:1])
    cache.swap_rows(0, 1, slice(0, 6))
    assert torch.equal(cache.read(slice(0, 1), 6)[1], before[1][1:2])
    model = Transformer(ModelArgs(dim=64, n_layer=2, n_head=4, intermediate_size=96, vocab_size=100, n_kv_heads=2))
    float_bytes = model.kv_bytes_per_position()
    model.kv_cache_dtype = torch.int8
    assert model.kv_bytes_per_position() == 2 * 2 * 2 * (16 + 4) and float_bytes == 2 * 2 * 2 * 16 * 4
