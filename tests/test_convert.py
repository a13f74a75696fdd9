"""Converters: HF weight layouts, GGUF tensor types, atomic output, and refusal of unsafe pickles."""

import os
import pickle

import numpy as np
import pytest
import torch
import transformers

from conftest import make_hf_llama, write_gguf
from convert_gguf import convert_gguf_state_dict, gguf_config_to_args, gguf_int4_groups, open_gguf
from convert_hf_checkpoint import convert_hf_checkpoint
from generate import load_model
from model import Transformer
from quantize import dequantize_int4


def logits_of(model, x):
    model.setup_caches(x.shape[0], x.shape[1])
    with torch.no_grad():
        return model(x, torch.arange(x.shape[1]))


@pytest.mark.parametrize(
    "save_kwargs",
    [
        {"max_shard_size": "60KB"},
        {"safe_serialization": False},
        {"safe_serialization": False, "max_shard_size": "60KB"},
    ],
    ids=["sharded-safetensors", "pytorch_model.bin", "sharded-bin"],
)
def test_hf_weight_formats(tmp_path, tiny_tokenizer_json, save_kwargs):
    hf = make_hf_llama(tmp_path / "hf", tiny_tokenizer_json, num_key_value_heads=2, save_kwargs=save_kwargs)
    weight_files = [f for f in os.listdir(tmp_path / "hf") if f.endswith((".bin", ".safetensors"))]
    assert len(weight_files) >= 1 and ("max_shard_size" not in save_kwargs or len(weight_files) > 1)
    convert_hf_checkpoint(tmp_path / "hf", tmp_path / "out")
    x = torch.randint(0, 300, (1, 24))
    with torch.no_grad():
        assert (logits_of(load_model(tmp_path / "out"), x) - hf(x).logits).abs().max() < 1e-4


def test_bfloat16_conversion_keeps_dtype(tmp_path, tiny_tokenizer_json):
    make_hf_llama(tmp_path / "hf", tiny_tokenizer_json)
    convert_hf_checkpoint(tmp_path / "hf", tmp_path / "out", dtype=torch.bfloat16)
    state = torch.load(tmp_path / "out" / "model.pth", weights_only=True)
    assert all(t.dtype == torch.bfloat16 for t in state.values())


def test_failed_conversion_leaves_nothing(tmp_path, tiny_tokenizer_json, tiny_checkpoint):
    make_hf_llama(tmp_path / "hf", tiny_tokenizer_json)
    (tmp_path / "hf" / "tokenizer.json").unlink()
    with pytest.raises(FileNotFoundError, match="no tokenizer.json or tokenizer.model"):
        convert_hf_checkpoint(tmp_path / "hf", tmp_path / "out")
    assert sorted(os.listdir(tmp_path)) == ["hf"]
    # A failure while writing (here: in the tokenizer step) removes the temporary folder too.
    from convert_hf_checkpoint import write_checkpoint

    model = load_model(tiny_checkpoint)

    def failing_tokenizer(folder):
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        write_checkpoint(tmp_path / "out", model.state_dict(), model.config, failing_tokenizer)
    assert sorted(os.listdir(tmp_path)) == ["hf"]


class Exploit:
    def __reduce__(self):
        return (os.system, ("touch pwned",))


@pytest.mark.parametrize("writer", ["pickle", "torch.save"])
def test_booby_trapped_pickle_is_refused(tmp_path, tiny_checkpoint, monkeypatch, writer):
    import shutil

    monkeypatch.chdir(tmp_path)  # where the trap would touch ./pwned
    folder = tmp_path / "evil"
    shutil.copytree(tiny_checkpoint, folder)
    trap = {"tok_embeddings.weight": Exploit()}
    if writer == "pickle":
        (folder / "model.pth").write_bytes(pickle.dumps(trap))
    else:  # the zip format torch.save writes, which mmap can read: only weights_only stands in the way
        torch.save(trap, folder / "model.pth")
    with pytest.raises(ValueError, match="refusing to load .*not a plain tensor file"):
        load_model(folder / "model.pth")
    assert not (tmp_path / "pwned").exists()
    # The trap is live: a load that allows code would have run it.
    torch.load(folder / "model.pth", weights_only=False) if writer == "torch.save" else pickle.loads(
        (folder / "model.pth").read_bytes()
    )
    assert (tmp_path / "pwned").exists()


# ---------------------------------------------------------------- GGUF


# Relative error bound of each format's round trip on Gaussian weights.
GGUF_TOLERANCES = {"F32": 0.0, "F16": 1e-3, "BF16": 1e-2, "Q8_0": 1e-2, "Q4_0": 0.2, "Q4_1": 0.15}


@pytest.mark.parametrize("type_name", GGUF_TOLERANCES)
def test_gguf_tensor_types(tmp_path, tiny_checkpoint, type_name):
    import gguf

    model = load_model(tiny_checkpoint)
    state = model.state_dict()
    write_gguf(tmp_path / "m.gguf", state, model.config, gguf.GGMLQuantizationType[type_name])
    reader = open_gguf(tmp_path / "m.gguf")
    config = gguf_config_to_args(reader)
    assert config == model.config
    converted, _ = convert_gguf_state_dict(reader, config, torch.float32)
    assert converted.keys() == state.keys()
    for name, t in state.items():
        error = (converted[name] - t).norm() / t.norm()
        assert error <= GGUF_TOLERANCES[type_name] + 1e-7, (name, float(error))
    if type_name == "F32":  # lossless: the converted model is the same model
        with torch.device("meta"):
            again = Transformer(config)
        again.load_state_dict(converted, assign=True)
        x = torch.randint(0, config.vocab_size, (1, 16))
        assert torch.equal(logits_of(again, x), logits_of(model, x))


@pytest.mark.parametrize("type_name,block_bytes,scale_offsets", [("Q4_K", 144, (0, 2)), ("Q6_K", 210, (208,))])
def test_gguf_k_quant_layout(tmp_path, type_name, block_bytes, scale_offsets):
    """gguf-py cannot quantize K-formats, so random blocks (with sane f16 scales) check shape and order."""
    import gguf
    from gguf.quants import dequantize

    from convert_gguf import gguf_tensor

    kind = gguf.GGMLQuantizationType[type_name]
    rows, cols = 3, 512  # two 256-value super-blocks per row
    raw = np.random.default_rng(0).integers(0, 256, (rows, cols // 256 * block_bytes), dtype=np.uint8)
    blocks = raw.reshape(rows, -1, block_bytes)
    for offset in scale_offsets:
        blocks[:, :, offset : offset + 2] = np.frombuffer(np.float16(0.01).tobytes(), dtype=np.uint8)
    w = gguf.GGUFWriter(str(tmp_path / "k.gguf"), "llama")
    w.add_tensor("t", raw, raw_dtype=kind)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    (tensor,) = open_gguf(tmp_path / "k.gguf").tensors
    t = gguf_tensor(tensor)
    assert t.shape == (rows, cols) and t.dtype == torch.float32
    expected = dequantize(raw, kind).reshape(rows, cols)
    assert np.array_equal(t.numpy(), expected) and np.isfinite(expected).all() and expected.std() > 0
    if type_name == "Q4_K":  # the same values in our int4 g32 format, up to float32 rounding of scale and zero
        codes, scales, zeros = gguf_int4_groups(tensor)
        assert (dequantize_int4(codes, scales, zeros, 32) - t).abs().max() <= 1e-6 * t.abs().max()
    else:
        assert gguf_int4_groups(tensor) is None  # 6-bit codes: no 4-bit grid holds them


# How llama.cpp's converter names a block's tensors (Hugging Face name -> GGUF name).
GGUF_BLOCK_NAMES = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "pre_feedforward_layernorm": "ffn_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def write_hf_as_gguf(path, hf, arch: str, tensor_type, extra_metadata=None):
    """A transformers model as llama.cpp writes qwen2 and gemma3 files: q/k rows in Hugging Face's rotate-half
    order (no permutation), Gemma's norm weights with 1 added, its RoPE scaling (linear, YaRN), block weights in
    tensor_type. extra_metadata: more float32 keys, as {key: value}."""
    import gguf
    from gguf.quants import quantize

    c, gemma = hf.config, arch == "gemma3"
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    w = gguf.GGUFWriter(str(path), arch)
    for key, value in {
        "block_count": c.num_hidden_layers,
        "context_length": c.max_position_embeddings,
        "embedding_length": c.hidden_size,
        "feed_forward_length": c.intermediate_size,
        "attention.head_count": c.num_attention_heads,
        "attention.head_count_kv": c.num_key_value_heads,
        "attention.key_length": head_dim,
        "attention.value_length": head_dim,
    }.items():
        w.add_uint32(f"{arch}.{key}", value)
    w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", c.rms_norm_eps)
    rope = c.rope_parameters.get("full_attention", c.rope_parameters)
    w.add_float32(f"{arch}.rope.freq_base", rope["rope_theta"])
    if gemma:
        w.add_uint32(f"{arch}.attention.sliding_window", c.sliding_window)
    if rope["rope_type"] != "default":
        w.add_string(f"{arch}.rope.scaling.type", rope["rope_type"])
        w.add_float32(f"{arch}.rope.scaling.factor", rope["factor"])
    if rope["rope_type"] == "yarn":
        w.add_uint32(f"{arch}.rope.scaling.original_context_length", rope["original_max_position_embeddings"])
        w.add_float32(f"{arch}.rope.scaling.yarn_beta_fast", rope["beta_fast"])
    for key, value in (extra_metadata or {}).items():
        w.add_float32(key, value)
    top = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
    for name, t in hf.state_dict().items():
        module, kind = name.rsplit(".", 1)
        if module.startswith("model.layers."):
            _, _, i, rest = module.split(".", 3)
            ggml = (
                "post_attention_norm"
                if rest == "post_attention_layernorm" and gemma
                else GGUF_BLOCK_NAMES.get(rest, "ffn_norm")
            )
            module = f"blk.{i}.{ggml}"
        elif name == "lm_head.weight" and c.tie_word_embeddings:
            continue
        else:
            module = top[module]
        x = (t + 1 if gemma and name.endswith("norm.weight") else t).float().numpy()
        if x.ndim == 2 and module.startswith("blk."):
            w.add_tensor(f"{module}.{kind}", quantize(x, tensor_type), raw_dtype=tensor_type)
        else:
            w.add_tensor(f"{module}.{kind}", x)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


YARN = {
    "rope_type": "yarn",
    "factor": 2.0,
    "original_max_position_embeddings": 32,
    "beta_fast": 4.0,
    "rope_theta": 100.0,
}
GGUF_FAMILIES = {  # six layers: the Gemma 3 pattern GGUF files imply (five sliding, one global)
    "qwen2": (transformers.Qwen2ForCausalLM, transformers.Qwen2Config, dict(num_key_value_heads=2)),
    "qwen2_yarn": (  # a qwen2 file with YaRN, as llama.cpp's converter writes Qwen's
        transformers.Qwen2ForCausalLM,
        transformers.Qwen2Config,
        dict(num_key_value_heads=2, max_position_embeddings=32, rope_parameters=YARN),
    ),
    "gemma3": (
        transformers.Gemma3ForCausalLM,
        transformers.Gemma3TextConfig,
        dict(
            num_hidden_layers=6,
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
}


@pytest.mark.numerics
@pytest.mark.parametrize("name", GGUF_FAMILIES)
def test_gguf_families_match_transformers(tmp_path, tiny_tokenizer_json, name):
    """A tiny Qwen2 (q/k/v biases; YaRN past 32 positions) or Gemma 3 (norm offsets, q/k norms, windows, two RoPE
    bases) written as llama.cpp writes them: float32 logits as transformers' (rounding alone, below 2e-5; a fault
    moves them by 1e-2 or more). Written in Q4_0, the int4 conversion holds the file's blocks exactly, rows permuted
    with their groups."""
    import gguf

    model_cls, config_cls, overrides = GGUF_FAMILIES[name]
    arch = name.split("_")[0]
    hf = make_hf_llama(tmp_path / "hf", tiny_tokenizer_json, model_cls, config_cls, norm_noise=0.1, **overrides)
    write_hf_as_gguf(tmp_path / "m.gguf", hf, arch, gguf.GGMLQuantizationType.F32)
    reader = open_gguf(tmp_path / "m.gguf")
    config = gguf_config_to_args(reader)
    state, _ = convert_gguf_state_dict(reader, config, torch.float32)
    with torch.device("meta"):
        ours = Transformer(config)
    ours.load_state_dict(state, assign=True)
    x = torch.randint(0, 300, (2, 40), generator=torch.Generator().manual_seed(0))  # past the 8-token window
    with torch.no_grad():
        assert (logits_of(ours, x) - hf(x).logits).abs().max() < 1e-4

    write_hf_as_gguf(tmp_path / "q.gguf", hf, arch, gguf.GGMLQuantizationType.Q4_0)
    state, groups = convert_gguf_state_dict(open_gguf(tmp_path / "q.gguf"), config, torch.float32, int4=True)
    assert len(groups) == 5 * config.n_layer  # wqkv, wo, w1, w2, w3 of every block
    for name, (codes, scales, zeros) in groups.items():
        w = state[f"{name}.weight"]
        assert (dequantize_int4(codes, scales, zeros, 32) - w).abs().max() <= 1e-6 * w.abs().max(), name


# ---------------------------------------------------------------- families' configs as the Hub has them

# Older config.json files, without the layer_types and rope_parameters that transformers 5 writes: the converter
# must read them as transformers does (its config classes are the reference here).
BASE = dict(
    hidden_size=64,
    num_hidden_layers=6,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=96,
    vocab_size=320,
    max_position_embeddings=256,
)
HUB_CONFIGS = {
    "gemma2": dict(BASE, model_type="gemma2", head_dim=32, sliding_window=8, rope_theta=10000.0),
    "gemma3": dict(
        BASE,
        model_type="gemma3_text",
        head_dim=32,
        sliding_window=8,
        sliding_window_pattern=3,
        rope_theta=1e6,
        rope_local_base_freq=10000.0,
        rope_scaling={"rope_type": "linear", "factor": 8.0},
    ),
    "qwen2_unused_window": dict(BASE, model_type="qwen2", use_sliding_window=False, sliding_window=4096),
    "qwen2_window": dict(BASE, model_type="qwen2", use_sliding_window=True, sliding_window=8, max_window_layers=2),
    "mistral": dict(BASE, model_type="mistral", sliding_window=4096),
    "qwen2_yarn_card": dict(  # the edit Qwen's model cards describe for long texts
        BASE,
        model_type="qwen2",
        max_position_embeddings=64,
        rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
    ),
    "phi3_su": dict(
        BASE,
        model_type="phi3",
        original_max_position_embeddings=64,
        rope_scaling={"type": "su", "short_factor": [1.0] * 8, "long_factor": [2.0] * 8},
    ),
}


@pytest.mark.parametrize("name", HUB_CONFIGS)
def test_hub_configs_read_as_transformers_reads_them(name):
    import math

    from transformers import AutoConfig

    from convert_hf_checkpoint import hf_config_to_args

    raw = HUB_CONFIGS[name]
    if name == "phi3_su":  # transformers 5.23 reads the length only inside rope_scaling; Phi-3's files have it outside
        reference = AutoConfig.for_model(
            **dict(raw, rope_scaling=dict(raw["rope_scaling"], original_max_position_embeddings=64))
        )
    else:
        reference = AutoConfig.for_model(**raw)
    args = hf_config_to_args(raw)
    assert args.sliding_window == reference.sliding_window
    if reference.sliding_window is not None:  # Mistral's config has no layer_types: all its layers slide
        assert args.layer_types == list(getattr(reference, "layer_types", None) or ["sliding_attention"] * 6)
    else:
        assert set(args.layer_types) == {"full_attention"}
    rope = reference.rope_parameters
    if name == "gemma3":
        assert args.rope_local_base == rope["sliding_attention"]["rope_theta"]
        rope = rope["full_attention"]
    assert args.rope_base == rope["rope_theta"]
    assert (args.rope_scaling or {}).get("rope_type", "default") == rope["rope_type"]
    if name == "phi3_su":  # the paper's attention factor for a 4x longer context
        assert math.isclose(args.rope_scaling["attention_factor"], math.sqrt(1 + math.log(256 / 64) / math.log(64)))
    if name == "qwen2_yarn_card":  # the card leaves max_position_embeddings at the original context; we hold 4x
        assert args.rope_scaling["factor"] == rope["factor"] and args.block_size == 4 * 64


def test_gguf_yarn_refuses_attention_scaling_it_cannot_read(tmp_path, tiny_tokenizer_json):
    """Keys that scale attention on top of YaRN's own factor are refused by name, not guessed; without them the file
    holds factor times its original context."""
    import gguf

    model_cls, config_cls, overrides = GGUF_FAMILIES["qwen2_yarn"]
    hf = make_hf_llama(tmp_path / "hf", tiny_tokenizer_json, model_cls, config_cls, **overrides)
    write_hf_as_gguf(tmp_path / "m.gguf", hf, "qwen2", gguf.GGMLQuantizationType.F32)
    assert gguf_config_to_args(open_gguf(tmp_path / "m.gguf")).block_size == 2 * 32
    extra = {"qwen2.rope.scaling.attn_factor": 0.5}
    write_hf_as_gguf(tmp_path / "a.gguf", hf, "qwen2", gguf.GGMLQuantizationType.F32, extra)
    with pytest.raises(ValueError, match="qwen2.rope.scaling.attn_factor"):
        gguf_config_to_args(open_gguf(tmp_path / "a.gguf"))


def test_unknown_family_is_refused_in_one_line(tmp_path):
    from convert_hf_checkpoint import SUPPORTED_MODEL_TYPES, hf_config_to_args

    with pytest.raises(ValueError, match="unsupported model_type 'bert'; supported: llama, ") as error:
        hf_config_to_args(dict(BASE, model_type="bert"))
    assert "\n" not in str(error.value) and all(t in str(error.value) for t in SUPPORTED_MODEL_TYPES)
