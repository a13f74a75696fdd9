"""Convert a GGUF file (llama architecture) into a checkpoint folder of ours.

    python scripts/convert_gguf.py --gguf FILE.gguf --out_dir checkpoints/NAME [--dtype float32]

Quantized tensors (Q8_0, Q4_0, Q4_1, Q4_K, Q6_K, ... anything the `gguf` package reads) are
dequantized; the tokenizer is rebuilt from the file's metadata by transformers' GGUF support.
"""
import argparse
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from checkpoint import DTYPES, HelpFormatter, user_errors  # noqa: E402
from convert_hf_checkpoint import write_checkpoint  # noqa: E402
from model import ModelArgs  # noqa: E402

GGUF_LAYER_NAMES = {
    "attn_norm.weight": "attention_norm.weight",
    "attn_output.weight": "attention.wo.weight",
    "ffn_gate.weight": "feed_forward.w1.weight",
    "ffn_up.weight": "feed_forward.w3.weight",
    "ffn_down.weight": "feed_forward.w2.weight",
    "ffn_norm.weight": "ffn_norm.weight",
}


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


def gguf_config_to_args(reader) -> ModelArgs:
    arch = metadata(reader, "general.architecture")
    if arch != "llama":
        raise ValueError(f"unsupported GGUF architecture {arch!r} (supported: llama)")
    names = {t.name for t in reader.tensors}
    if "rope_freqs.weight" in names or metadata(reader, "llama.rope.scaling.type", "none") != "none":
        raise ValueError("GGUF rope scaling (rope_freqs / rope.scaling) is not supported; convert the HF folder instead")
    if "token_embd.weight" not in names:
        raise ValueError("no token_embd.weight tensor (a vocabulary-only GGUF file?)")
    embedding = next(t for t in reader.tensors if t.name == "token_embd.weight")
    args = ModelArgs(
        dim=metadata(reader, "llama.embedding_length", required=True),
        n_layer=metadata(reader, "llama.block_count", required=True),
        n_head=metadata(reader, "llama.attention.head_count", required=True),
        n_kv_heads=metadata(reader, "llama.attention.head_count_kv"),  # None: as many as n_head
        head_dim=metadata(reader, "llama.attention.key_length"),  # None: dim // n_head
        intermediate_size=metadata(reader, "llama.feed_forward_length", required=True),
        vocab_size=int(embedding.shape[-1]),  # ggml lists dimensions innermost first
        block_size=metadata(reader, "llama.context_length", 2048),
        rope_base=float32_value(metadata(reader, "llama.rope.freq_base", 10000.0)),
        norm_eps=float32_value(metadata(reader, "llama.attention.layer_norm_rms_epsilon", 1e-5)),
        tie_word_embeddings="output.weight" not in names,
    )
    if metadata(reader, "llama.rope.dimension_count", args.head_dim) != args.head_dim:
        raise ValueError("partial rotary embeddings (rope.dimension_count != head_dim) are not supported")
    return args


def gguf_tensor(tensor) -> torch.Tensor:
    """Dequantizes one GGUF tensor to a float32 torch tensor in PyTorch's [out, in] order."""
    from gguf.quants import dequantize

    try:
        values = dequantize(tensor.data, tensor.tensor_type)  # numpy, shape reversed from ggml's
    except NotImplementedError:
        raise ValueError(f"tensor {tensor.name}: type {tensor.tensor_type.name} is not supported") from None
    shape = tuple(int(n) for n in reversed(tensor.shape))
    return torch.from_numpy(np.array(values, dtype=np.float32).reshape(shape))  # a copy: the reader maps the file read-only


def convert_gguf_state_dict(reader, args: ModelArgs, dtype: torch.dtype) -> dict:
    # llama.cpp stores q/k rows already in the interleaved rotary order we use: no permutation.
    out, qkv = {}, {}
    for tensor in reader.tensors:
        name, t = tensor.name, gguf_tensor(tensor).to(dtype)
        if name == "token_embd.weight":
            out["tok_embeddings.weight"] = t
        elif name == "output_norm.weight":
            out["norm.weight"] = t
        elif name == "output.weight":
            out["output.weight"] = t
        elif name.startswith("blk."):
            _, i, rest = name.split(".", 2)
            if rest in GGUF_LAYER_NAMES:
                out[f"layers.{i}.{GGUF_LAYER_NAMES[rest]}"] = t
            elif rest.split(".")[0] in ("attn_q", "attn_k", "attn_v"):
                proj, kind = rest.split(".")
                qkv.setdefault((i, kind), {})[proj] = t
            else:
                raise ValueError(f"unexpected GGUF tensor {name!r}")
        else:
            raise ValueError(f"unexpected GGUF tensor {name!r}")
    for (i, kind), group in qkv.items():
        if len(group) != 3:
            raise ValueError(f"layer {i}: incomplete q/k/v {kind} tensors in GGUF file")
        out[f"layers.{i}.attention.wqkv.{kind}"] = torch.cat([group["attn_q"], group["attn_k"], group["attn_v"]])
    return out


def save_gguf_tokenizer(gguf_path: Path, folder: Path):
    from transformers import AutoTokenizer

    gguf_path = Path(gguf_path).resolve()
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    except Exception as e:  # transformers' GGUF reader raises many kinds of errors for odd metadata
        raise ValueError(f"{gguf_path}: could not rebuild its tokenizer ({type(e).__name__}: {e})") from None
    tokenizer.save_pretrained(str(folder))


def convert_gguf(gguf_path: Path, out_dir: Path, dtype: torch.dtype = torch.float32) -> ModelArgs:
    reader = open_gguf(gguf_path)
    try:
        args = gguf_config_to_args(reader)
        state_dict = convert_gguf_state_dict(reader, args, dtype)
    except ValueError as e:
        raise ValueError(f"{gguf_path}: {e}") from None
    write_checkpoint(Path(out_dir), state_dict, args, lambda folder: save_gguf_tokenizer(gguf_path, folder))
    return args


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument("--gguf", type=Path, required=True, help="the .gguf file")
    parser.add_argument("--out_dir", type=Path, required=True, help="folder to write (replaced if it exists)")
    parser.add_argument("--dtype", choices=DTYPES, default="float32", help="dtype of the dequantized weights")
    opts = parser.parse_args(argv)
    with user_errors():
        args = convert_gguf(opts.gguf, opts.out_dir, DTYPES[opts.dtype])
    print(f"wrote {opts.out_dir} ({args.n_layer} layers, dim {args.dim}, vocab {args.vocab_size})")


if __name__ == "__main__":
    main()
