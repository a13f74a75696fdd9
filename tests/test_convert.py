"""Converters: HF weight layouts, GGUF tensor types, atomic output, and refusal of unsafe pickles."""
import os
import pickle

import numpy as np
import pytest
import torch
from conftest import make_hf_llama
from convert_gguf import convert_gguf_state_dict, gguf_config_to_args, open_gguf
from convert_hf_checkpoint import convert_hf_checkpoint

from generate import load_model
from model import Transformer


def logits_of(model, x):
    model.setup_caches(x.shape[0], x.shape[1])
    with torch.no_grad():
        return model(x, torch.arange(x.shape[1]))


@pytest.mark.parametrize(
    "save_kwargs",
    [{"max_shard_size": "60KB"}, {"safe_serialization": False}, {"safe_serialization": False, "max_shard_size": "60KB"}],
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


def test_booby_trapped_pickle_is_refused(tmp_path, tiny_checkpoint):
    import shutil

    folder = tmp_path / "evil"
    shutil.copytree(tiny_checkpoint, folder)
    with open(folder / "model.pth", "wb") as f:
        pickle.dump({"tok_embeddings.weight": Exploit()}, f)
    with pytest.raises(ValueError, match="refusing to load .*not a plain tensor file"):
        load_model(folder / "model.pth")
    assert not (tmp_path / "pwned").exists() and not os.path.exists("pwned")


# ---------------------------------------------------------------- GGUF


def write_gguf(path, state_dict, config, tensor_type):
    """Writes our (already interleaved-rotary) weights as a llama GGUF, 2-D weights in tensor_type."""
    import gguf
    from gguf.quants import quantize

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(config.n_layer)
    w.add_context_length(config.block_size)
    w.add_embedding_length(config.dim)
    w.add_feed_forward_length(config.intermediate_size)
    w.add_head_count(config.n_head)
    w.add_head_count_kv(config.n_kv_heads)
    w.add_rope_freq_base(config.rope_base)
    w.add_layer_norm_rms_eps(config.norm_eps)
    names = {"tok_embeddings.weight": "token_embd.weight", "norm.weight": "output_norm.weight", "output.weight": "output.weight"}
    layer_names = {"attention_norm.weight": "attn_norm.weight", "attention.wo.weight": "attn_output.weight",
                   "feed_forward.w1.weight": "ffn_gate.weight", "feed_forward.w3.weight": "ffn_up.weight",
                   "feed_forward.w2.weight": "ffn_down.weight", "ffn_norm.weight": "ffn_norm.weight"}  # fmt: skip
    q, kv = config.n_head * config.head_dim, config.n_kv_heads * config.head_dim
    for name, t in state_dict.items():
        parts = name.split(".")
        if name in names:
            items = [(names[name], t)]
        elif parts[3] == "wqkv":
            qw, kw, vw = t.split([q, kv, kv])
            items = [(f"blk.{parts[1]}.attn_{p}.weight", x) for p, x in zip("qkv", (qw, kw, vw))]
        else:
            items = [(f"blk.{parts[1]}.{layer_names['.'.join(parts[2:])]}", t)]
        for gname, x in items:
            x = x.float().numpy()
            if x.ndim == 2 and tensor_type != gguf.GGMLQuantizationType.F32:
                w.add_tensor(gname, quantize(x, tensor_type), raw_dtype=tensor_type)
            else:
                w.add_tensor(gname, x)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


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
    converted = convert_gguf_state_dict(reader, config, torch.float32)
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
    from convert_gguf import gguf_tensor
    from gguf.quants import dequantize

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
