"""Convert a GGUF file (llama, qwen2 or gemma3 architecture) into a checkpoint folder of ours.

    python scripts/convert_gguf.py --gguf FILE.gguf --out_dir checkpoints/NAME [--dtype float32] [--int4]

model.pth holds the weights dequantized (Q8_0, Q5_0, Q4_0, Q4_1, Q4_K, Q6_K, ... anything the `gguf` package
reads). --int4 also writes model_int4-gguf.g32.pth, our int4 format with groups of 32: Q4_0, Q4_1 and Q4_K tensors
(blocks or sub-blocks of 32 values, a scale and an offset each) go into it as they are, with no rounding;
the other types, which the 4-bit grid cannot hold, are rounded to it from their dequantized values; the
output projection is int8 as in every int4 checkpoint. The tokenizer (and chat template) is rebuilt from
the file's metadata by transformers' GGUF support.
"""

import argparse
import sys
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from checkpoint import DTYPES, HelpFormatter, save_atomic, user_errors  # noqa: E402
from config import ModelArgs  # noqa: E402
from convert_hf_checkpoint import hf_config_to_args, permute_rotary, write_checkpoint  # noqa: E402
from model import Transformer  # noqa: E402
from quantize import int4_group_params, quantization_format, quantize_int4_values, quantized_state_dict  # noqa: E402

# GGUF architecture -> the Hugging Face model_type whose config rules apply (transformers' GGUF loader does the same).
ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2", "gemma3": "gemma3_text"}
# Metadata keys (after "ARCH.") -> Hugging Face config fields; the first four are required.
CONFIG_KEYS = {
    "embedding_length": "hidden_size",
    "block_count": "num_hidden_layers",
    "attention.head_count": "num_attention_heads",
    "feed_forward_length": "intermediate_size",
    "attention.head_count_kv": "num_key_value_heads",
    "attention.key_length": "head_dim",
    "context_length": "max_position_embeddings",
    "rope.freq_base": "rope_theta",
    "attention.layer_norm_rms_epsilon": "rms_norm_eps",
    "attention.sliding_window": "sliding_window",
}
GGUF_LAYER_NAMES = {
    "attn_norm.weight": "attention_norm.weight",
    "attn_q_norm.weight": "attention.q_norm.weight",
    "attn_k_norm.weight": "attention.k_norm.weight",
    "attn_output.weight": "attention.wo.weight",
    "attn_output.bias": "attention.wo.bias",
    "post_attention_norm.weight": "post_attention_norm.weight",
    "ffn_norm.weight": "ffn_norm.weight",
    "ffn_gate.weight": "feed_forward.w1.weight",
    "ffn_up.weight": "feed_forward.w3.weight",
    "ffn_down.weight": "feed_forward.w2.weight",
    "post_ffw_norm.weight": "post_ffn_norm.weight",
}
# Types whose (sub-)blocks of 32 are affine groups of 4-bit codes, our int4 g32 grid: bytes per block.
INT4_BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q4_K": 144}
INT4_GROUPSIZE = 32
INT4_FILE = f"model_int4-gguf.g{INT4_GROUPSIZE}.pth"  # beside quantize.py's model_int4.g32.pth (rounded from float)


def open_gguf(path: Path):
    import gguf

    if not Path(path).is_file():
        raise FileNotFoundError(f"GGUF file not found: {path}")
    try:
        return gguf.GGUFReader(str(path))
    except Exception as e:
        raise ValueError(f"{path}: not a readable GGUF file ({type(e).__name__}: {e})") from None


def metadata(reader, key: str, default=None, required=False):
    field = reader.fields.get(key)
    if field is None and required:
        raise ValueError(f"no {key} in the file's metadata")
    return default if field is None else field.contents()


def float32_value(x) -> float:
    # GGUF stores these as float32: take the shortest decimal that rounds to it (1e-05, not 9.99999974e-06).
    return float(str(np.float32(x)))


def gguf_config_to_hf(reader) -> dict:
    """The Hugging Face config.json that the file's metadata describes; what GGUF leaves out takes the defaults
    of the family's transformers config, as llama.cpp and transformers' GGUF loader assume them (Gemma 3:
    every sixth layer global, local RoPE base 10000)."""
    arch = metadata(reader, "general.architecture")
    if arch not in ARCHITECTURES:
        raise ValueError(f"unsupported GGUF architecture {arch!r} (supported: {', '.join(ARCHITECTURES)})")
    names = {t.name for t in reader.tensors}
    if "token_embd.weight" not in names:
        raise ValueError("no token_embd.weight tensor (a vocabulary-only GGUF file?)")
    embedding = next(t for t in reader.tensors if t.name == "token_embd.weight")
    hf = {
        "model_type": ARCHITECTURES[arch],
        "vocab_size": int(embedding.shape[-1]),  # ggml lists dims innermost first
        "tie_word_embeddings": "output.weight" not in names,
        "attention_bias": "blk.0.attn_q.bias" in names,
    }
    for i, (key, field) in enumerate(CONFIG_KEYS.items()):
        value = metadata(reader, f"{arch}.{key}", required=i < 4)
        if value is not None:
            hf[field] = float32_value(value) if isinstance(value, float) else value
    rope_type = metadata(reader, f"{arch}.rope.scaling.type", "none")
    if arch == "gemma3" and rope_type == "linear":  # Gemma 3 4B and larger: their global layers' positions scaled
        factor = metadata(reader, f"{arch}.rope.scaling.factor", required=True)
        hf["rope_scaling"] = {"rope_type": "linear", "factor": float32_value(factor)}
    elif rope_type == "yarn" and "rope_freqs.weight" not in names:
        hf["rope_scaling"] = gguf_yarn(reader, arch)
    elif "rope_freqs.weight" in names or rope_type != "none":
        raise ValueError(
            "GGUF rope scaling (rope_freqs / rope.scaling) is not supported; convert the HF folder instead"
        )
    if arch == "gemma3" and hf["num_hidden_layers"] == 62:
        # GGUF has no query_pre_attn_scalar; llama.cpp knows Gemma 3 27B (62 layers) by its size:
        # dim / heads, not head_dim.
        hf["query_pre_attn_scalar"] = hf["hidden_size"] // hf["num_attention_heads"]
    head_dim = hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"]
    if metadata(reader, f"{arch}.rope.dimension_count", head_dim) != head_dim:
        raise ValueError("partial rotary embeddings (rope.dimension_count != head_dim) are not supported")
    return hf


def gguf_yarn(reader, arch: str) -> dict:
    """YaRN as llama.cpp's converter writes it for Qwen2/3 (factor, original context, optionally the betas). The keys
    that scale attention on top of YaRN's own factor (DeepSeek's and others') are refused, not guessed."""
    scaling = f"{arch}.rope.scaling"
    neutral = {
        "attn_factor": (1.0,),
        "yarn_attn_factor": (1.0,),
        "yarn_ext_factor": (-1.0, 1.0),
        "yarn_log_multiplier": (0.0,),
    }
    for key, values in neutral.items():
        if metadata(reader, f"{scaling}.{key}", values[0]) not in values:
            raise ValueError(f"GGUF YaRN with {scaling}.{key} is not supported; convert the HF folder instead")
    yarn = {
        "rope_type": "yarn",
        "factor": float32_value(metadata(reader, f"{scaling}.factor", required=True)),
        "original_max_position_embeddings": metadata(reader, f"{scaling}.original_context_length", required=True),
    }
    for key in ("beta_fast", "beta_slow"):
        value = metadata(reader, f"{scaling}.yarn_{key}")
        if value is not None:
            yarn[key] = float32_value(value)
    return yarn


def gguf_config_to_args(reader) -> ModelArgs:
    return hf_config_to_args(gguf_config_to_hf(reader))


def gguf_tensor(tensor) -> Tensor:
    """Dequantizes one GGUF tensor to a float32 torch tensor in PyTorch's [out, in] order."""
    from gguf.quants import dequantize

    try:
        values = dequantize(tensor.data, tensor.tensor_type)  # numpy, shape reversed from ggml's
    except NotImplementedError:
        raise ValueError(f"tensor {tensor.name}: type {tensor.tensor_type.name} is not supported") from None
    shape = tuple(int(n) for n in reversed(tensor.shape))
    return torch.from_numpy(
        np.array(values, dtype=np.float32).reshape(shape)
    )  # a copy: the reader maps the file read-only


def gguf_int4_groups(tensor) -> tuple[Tensor, Tensor, Tensor] | None:
    """A Q4_0, Q4_1 or Q4_K [N, K] weight in our int4 g32 terms, value = (code - 8) * scale + zero: codes
    [N, K] (0..15) and scales and zeros [N, K / 32], with no rounding of the codes (the scales and zeros are
    float32 products of the file's float16 numbers). None for other types."""
    kind = tensor.tensor_type.name
    if kind not in INT4_BLOCK_BYTES:
        return None
    n = int(tensor.shape[1])
    raw = torch.from_numpy(np.array(tensor.data, dtype=np.uint8)).reshape(n, -1, INT4_BLOCK_BYTES[kind])

    def f16(offset: int) -> Tensor:  # the float16 number at a byte offset of every block: [N, blocks, 1]
        return raw[..., offset : offset + 2].contiguous().view(torch.float16).float()

    if kind == "Q4_K":  # 256 values: d, dmin, 8 six-bit (scale, min) pairs in 12 bytes, 128 bytes of codes
        packed = raw[..., 4:16].int()
        low, high, extra = packed[..., 0:4], packed[..., 4:8], packed[..., 8:12]
        sub_scales = torch.cat([low & 63, (extra & 15) | (low >> 6) << 4], dim=-1)
        sub_mins = torch.cat([high & 63, (extra >> 4) | (high >> 6) << 4], dim=-1)
        qs = raw[..., 16:].reshape(n, -1, 4, 1, 32)  # 32 bytes hold sub-block 2j (low nibbles) and 2j + 1 (high)
        codes = torch.cat([qs & 15, qs >> 4], dim=3).reshape(n, -1, 32)
        scales, offsets = f16(0) * sub_scales, -f16(2) * sub_mins  # value = scale * code + offset
    else:  # 32 values: d (Q4_1: and m), 16 bytes holding values i (low nibble) and i + 16 (high)
        qs = raw[..., 4:] if kind == "Q4_1" else raw[..., 2:]
        codes = torch.cat([qs & 15, qs >> 4], dim=-1)
        scales = f16(0)
        offsets = f16(2) if kind == "Q4_1" else -8 * scales
    scales, offsets = scales.reshape(n, -1), offsets.reshape(n, -1)
    return codes.reshape(n, -1), scales, offsets + 8 * scales


def rounded_int4_groups(w: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    scales, zeros = int4_group_params(w, INT4_GROUPSIZE)
    return quantize_int4_values(w, scales, zeros, INT4_GROUPSIZE), scales, zeros


def convert_gguf_state_dict(reader, config: ModelArgs, dtype: torch.dtype, int4: bool = False) -> tuple[dict, dict]:
    """Our state dict, and with int4 the (codes, scales, zeros) of every linear layer of the blocks."""
    # llama.cpp stores llama's q/k rows in the interleaved rotary order we use; other architectures (NEOX rotary)
    # keep Hugging Face's rotate-half order, permuted here as convert_hf_checkpoint does.
    rotate_half = metadata(reader, "general.architecture") != "llama"
    gemma = config.norm_type == "gemma_rmsnorm"
    out, int4_groups, qkv = {}, {}, {}
    for tensor in reader.tensors:
        name, t = tensor.name, gguf_tensor(tensor)
        groups = None
        if int4 and t.ndim == 2 and name.startswith("blk."):
            groups = gguf_int4_groups(tensor) or rounded_int4_groups(t)
        if gemma and name.endswith("norm.weight"):
            t = t - 1  # llama.cpp stores Gemma's norm weights with the 1 added; ours are offsets from 1
        t = t.to(dtype)
        if name == "token_embd.weight":
            out["tok_embeddings.weight"] = t
        elif name == "output_norm.weight":
            out["norm.weight"] = t
        elif name == "output.weight":
            out["output.weight"] = t
        elif name.startswith("blk."):
            _, i, rest = name.split(".", 2)
            if rest in GGUF_LAYER_NAMES:
                if rotate_half and rest in ("attn_q_norm.weight", "attn_k_norm.weight"):
                    t = permute_rotary(t, 1)  # one weight per head dimension, reordered as the q/k rows are
                ours = f"layers.{i}.{GGUF_LAYER_NAMES[rest]}"
                out[ours] = t
                if groups is not None:
                    int4_groups[ours.removesuffix(".weight")] = groups
            elif rest.split(".")[0] in ("attn_q", "attn_k", "attn_v"):
                proj, kind = rest.split(".")
                heads = {"attn_q": config.n_head, "attn_k": config.n_kv_heads}.get(proj)
                if rotate_half and heads:
                    t = permute_rotary(t, heads)
                    groups = None if groups is None else tuple(permute_rotary(g, heads) for g in groups)
                qkv.setdefault((i, kind), {})[proj] = (t, groups)
            else:
                raise ValueError(f"unexpected GGUF tensor {name!r}")
        else:
            raise ValueError(f"unexpected GGUF tensor {name!r}")
    for (i, kind), group in qkv.items():
        if len(group) != 3:
            raise ValueError(f"layer {i}: incomplete q/k/v {kind} tensors in GGUF file")
        parts = [group[p] for p in ("attn_q", "attn_k", "attn_v")]
        out[f"layers.{i}.attention.wqkv.{kind}"] = torch.cat([t for t, _ in parts])
        if kind == "weight" and int4:
            int4_groups[f"layers.{i}.attention.wqkv"] = tuple(
                torch.cat(g) for g in zip(*(groups for _, groups in parts))
            )
    return out, int4_groups


def int4_checkpoint(state_dict: dict, config: ModelArgs, int4_groups: dict) -> dict:
    """Our int4 g32 checkpoint of the converted model, its block layers' codes taken from int4_groups."""
    for name, (codes, _, _) in int4_groups.items():
        if codes.shape[0] % 16:  # the int4 kernels' tile height
            raise ValueError(
                f"--int4 needs a multiple of 16 outputs; {name} has {codes.shape[0]}: quantize.py --mode int8"
            )
    with torch.device("meta"):
        model = Transformer(config)
    model.load_state_dict(state_dict, assign=True)
    fmt = quantization_format("int4", INT4_GROUPSIZE, "gguf")
    return {"quantization": fmt, "state_dict": quantized_state_dict(model, "int4", INT4_GROUPSIZE, int4_groups)}


def save_gguf_tokenizer(gguf_path: Path, folder: Path):
    from transformers import AutoTokenizer

    gguf_path = Path(gguf_path).resolve()
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    except Exception as e:  # transformers' GGUF reader raises many kinds of errors for odd metadata
        raise ValueError(f"{gguf_path}: could not rebuild its tokenizer ({type(e).__name__}: {e})") from None
    tokenizer.save_pretrained(str(folder))


def convert_gguf(gguf_path: Path, out_dir: Path, dtype: torch.dtype = torch.float32, int4: bool = False) -> ModelArgs:
    reader = open_gguf(gguf_path)
    try:
        config = gguf_config_to_args(reader)
        state_dict, int4_groups = convert_gguf_state_dict(reader, config, dtype, int4)
        quantized = int4_checkpoint(state_dict, config, int4_groups) if int4 else None
    except (KeyError, ValueError) as e:
        raise ValueError(f"{gguf_path}: {e}") from None

    def fill_folder(folder: Path):
        save_gguf_tokenizer(gguf_path, folder)
        if quantized is not None:
            save_atomic(quantized, folder / INT4_FILE)

    write_checkpoint(Path(out_dir), state_dict, config, fill_folder)
    return config


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument("--gguf", type=Path, required=True, help="the .gguf file")
    parser.add_argument("--out_dir", type=Path, required=True, help="folder to write (replaced if it exists)")
    parser.add_argument("--dtype", choices=DTYPES, default="float32", help="dtype of the dequantized weights")
    parser.add_argument("--int4", action="store_true", help=f"also write {INT4_FILE}, 4-bit blocks kept as they are")
    return parser.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    with user_errors():
        config = convert_gguf(args.gguf, args.out_dir, DTYPES[args.dtype], args.int4)
    print(f"wrote {args.out_dir} ({config.n_layer} layers, dim {config.dim}, vocab {config.vocab_size})")


if __name__ == "__main__":
    main()
