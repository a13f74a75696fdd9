"""Convert a Hugging Face Llama-family model folder into a checkpoint folder of ours.

    python scripts/convert_hf_checkpoint.py --checkpoint_dir HF_FOLDER --out_dir checkpoints/NAME

The output folder holds model.pth (our parameter names), config.json (ModelArgs) and the tokenizer
files. It is written to a temporary folder first and renamed at the end, so a failed run leaves nothing.
"""
import argparse
import os
import shutil
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from checkpoint import DTYPES, HelpFormatter, check_tensors, load_tensor_file, save_tensors, user_errors  # noqa: E402
from model import ModelArgs, Transformer  # noqa: E402
from tokenizer import load_tokenizer, read_json  # noqa: E402

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer.model",
    "tokenizer_config.json",
    "chat_template.jinja",
    "special_tokens_map.json",
    "generation_config.json",
)
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")


def hf_config_to_args(hf: dict) -> ModelArgs:
    model_type = hf.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"unsupported model_type {model_type!r}; supported: {', '.join(SUPPORTED_MODEL_TYPES)}")
    if hf.get("hidden_act", "silu") != "silu" or hf.get("mlp_bias", False):
        raise ValueError("only SiLU-gated MLPs without bias are supported")
    if hf.get("use_sliding_window") or (model_type == "mistral" and hf.get("sliding_window")):
        raise ValueError("sliding-window attention is not supported")
    # transformers 5 keeps rope settings in "rope_parameters"; earlier versions in rope_theta / rope_scaling.
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    if not isinstance(rope, dict):
        raise ValueError(f"rope_parameters / rope_scaling must be an object, got {rope!r}")
    rope = dict(rope)
    rope_base = rope.pop("rope_theta", hf.get("rope_theta", 10000.0))
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type == "default":
        rope_scaling = None
    elif rope_type == "llama3":
        keys = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
        rope_scaling = {"rope_type": "llama3", **{k: rope[k] for k in keys}}
    else:
        raise ValueError(f"unsupported rope scaling type {rope_type!r} (supported: default, llama3)")
    return ModelArgs(
        dim=hf["hidden_size"],
        n_layer=hf["num_hidden_layers"],
        n_head=hf["num_attention_heads"],
        n_kv_heads=hf.get("num_key_value_heads"),  # None: as many as n_head
        head_dim=hf.get("head_dim"),  # None: dim // n_head
        intermediate_size=hf["intermediate_size"],
        vocab_size=hf["vocab_size"],
        block_size=hf.get("max_position_embeddings", 2048),
        rope_base=rope_base,
        rope_scaling=rope_scaling,
        norm_eps=hf.get("rms_norm_eps", 1e-6),
        tie_word_embeddings=hf.get("tie_word_embeddings", False),
        attention_bias=hf.get("attention_bias", model_type == "qwen2"),
        # Qwen2 has q/k/v biases only; Llama's attention_bias covers o_proj too.
        attention_out_bias=model_type != "qwen2" and hf.get("attention_bias", False),
    )


def permute_rotary(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    # HF rotates the first half of each head against the second; we rotate interleaved pairs.
    # Row order per head: [0 .. D/2-1 | D/2 .. D-1] -> [0, D/2, 1, D/2+1, ...]. Works on weights and biases.
    head_dim = w.shape[0] // n_heads
    return w.reshape(n_heads, 2, head_dim // 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def hf_weight_files(checkpoint_dir: Path) -> list[Path]:
    # The index names the shards; some folders also hold other weight files (e.g. consolidated.safetensors).
    for single, index in (("model.safetensors", "model.safetensors.index.json"), ("pytorch_model.bin", "pytorch_model.bin.index.json")):
        if (checkpoint_dir / index).is_file():
            weight_map = read_json(checkpoint_dir / index).get("weight_map")
            if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
                raise ValueError(f"{checkpoint_dir / index}: no weight_map of tensor names to file names")
            return [checkpoint_dir / name for name in sorted(set(weight_map.values()))]
        if (checkpoint_dir / single).is_file():
            return [checkpoint_dir / single]
    raise FileNotFoundError(f"no model.safetensors or pytorch_model.bin (or their index) in {checkpoint_dir}")


def iter_hf_tensors(checkpoint_dir: Path):
    """Yields (name, tensor), one weight file at a time."""
    for path in hf_weight_files(checkpoint_dir):
        yield from read_weight_file(path).items()


def read_weight_file(path: Path) -> dict:
    """One weight file's tensors by name: safetensors, or a .bin loaded without running code from it (mmap)."""
    if path.suffix != ".safetensors":
        return check_tensors(load_tensor_file(path), path)
    from safetensors.torch import load_file

    try:
        return load_file(str(path))
    except Exception as e:  # SafetensorError: a damaged, truncated or missing file
        raise ValueError(f"{path}: not a readable safetensors file ({e})") from None


def convert_hf_state_dict(tensors, args: ModelArgs, dtype: torch.dtype | None) -> dict:
    renames = {
        "model.embed_tokens.weight": "tok_embeddings.weight",
        "model.norm.weight": "norm.weight",
        "lm_head.weight": "output.weight",
    }
    layer_renames = {
        "self_attn.o_proj.weight": "attention.wo.weight",
        "self_attn.o_proj.bias": "attention.wo.bias",
        "mlp.gate_proj.weight": "feed_forward.w1.weight",
        "mlp.up_proj.weight": "feed_forward.w3.weight",
        "mlp.down_proj.weight": "feed_forward.w2.weight",
        "input_layernorm.weight": "attention_norm.weight",
        "post_attention_layernorm.weight": "ffn_norm.weight",
    }
    out, pending_qkv = {}, {}
    for name, t in tensors:
        t = t.to(dtype) if dtype is not None else t
        if name in renames:
            if name == "lm_head.weight" and args.tie_word_embeddings:
                continue  # stored once, as tok_embeddings.weight
            out[renames[name]] = t
            continue
        parts = name.split(".")  # model.layers.{i}.{rest}
        if parts[:2] != ["model", "layers"] or "rotary_emb" in name:
            if "rotary_emb" in name:
                continue  # precomputed frequencies some old checkpoints carry; we compute our own
            raise ValueError(f"unexpected tensor {name!r} in checkpoint")
        i, rest = parts[2], ".".join(parts[3:])
        if rest in layer_renames:
            out[f"layers.{i}.{layer_renames[rest]}"] = t
        elif rest.split(".")[0] == "self_attn" and rest.split(".")[1] in ("q_proj", "k_proj", "v_proj"):
            proj, kind = rest.split(".")[1], rest.split(".")[2]  # kind: weight or bias
            if proj == "q_proj":
                t = permute_rotary(t, args.n_head)
            elif proj == "k_proj":
                t = permute_rotary(t, args.n_kv_heads)
            group = pending_qkv.setdefault((i, kind), {})
            group[proj] = t
            if len(group) == 3:
                fused = torch.cat([group["q_proj"], group["k_proj"], group["v_proj"]])
                out[f"layers.{i}.attention.wqkv.{kind}"] = fused
                del pending_qkv[(i, kind)]
        else:
            raise ValueError(f"unexpected tensor {name!r} in checkpoint")
    if pending_qkv:
        raise ValueError(f"incomplete q/k/v projections in checkpoint: {sorted(pending_qkv)}")
    return out


def check_state_dict(state_dict: dict, args: ModelArgs):
    """Raises ValueError unless state_dict has exactly the parameters (names and shapes) of the model."""
    with torch.device("meta"):
        expected = {k: v.shape for k, v in Transformer(args).state_dict().items()}
    missing = sorted(set(expected) - set(state_dict))
    extra = sorted(set(state_dict) - set(expected))
    if missing or extra:
        raise ValueError(f"checkpoint does not match config: missing {missing[:5]}, unexpected {extra[:5]}")
    for k, shape in expected.items():
        if state_dict[k].shape != shape:
            raise ValueError(f"checkpoint tensor {k} has shape {tuple(state_dict[k].shape)}, config implies {tuple(shape)}")


def write_checkpoint(out_dir: Path, state_dict: dict, args: ModelArgs, fill_tokenizer):
    """Writes model.pth, config.json and (through fill_tokenizer(folder)) the tokenizer files, atomically."""
    check_state_dict(state_dict, args)
    out_dir = out_dir.resolve()
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    try:
        save_tensors(state_dict, tmp / "model.pth", shown_as=out_dir / "model.pth")
        (tmp / "config.json").write_text(args.to_json() + "\n")
        fill_tokenizer(tmp)
        if out_dir.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.old-", dir=out_dir.parent))
            os.replace(out_dir, old / "previous")
            os.replace(tmp, out_dir)
            shutil.rmtree(old)
        else:
            os.replace(tmp, out_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def convert_hf_checkpoint(checkpoint_dir: Path, out_dir: Path, dtype: torch.dtype | None = None) -> ModelArgs:
    checkpoint_dir = Path(checkpoint_dir)
    if not (checkpoint_dir / "config.json").is_file():
        raise FileNotFoundError(f"no config.json in {checkpoint_dir}: is it a Hugging Face model folder?")
    if Path(out_dir).resolve() == checkpoint_dir.resolve():
        raise ValueError("--out_dir must differ from --checkpoint_dir")
    config_path = checkpoint_dir / "config.json"
    hf = read_json(config_path)
    try:
        args = hf_config_to_args(hf)
    except KeyError as e:
        raise ValueError(f"{config_path}: missing field {e}") from None
    except ValueError as e:
        raise ValueError(f"{config_path}: {e}") from None
    load_tokenizer(checkpoint_dir)  # refused now, if missing or damaged, rather than when the checkpoint is used
    state_dict = convert_hf_state_dict(iter_hf_tensors(checkpoint_dir), args, dtype)

    def copy_tokenizer(folder: Path):
        for name in TOKENIZER_FILES:
            if (checkpoint_dir / name).is_file():
                shutil.copy(checkpoint_dir / name, folder / name)

    write_checkpoint(Path(out_dir), state_dict, args, copy_tokenizer)
    return args


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument("--checkpoint_dir", type=Path, required=True, help="Hugging Face model folder")
    parser.add_argument("--out_dir", type=Path, required=True, help="folder to write (replaced if it exists)")
    parser.add_argument("--dtype", choices=DTYPES, help="convert weights to this dtype (default: keep as stored)")
    opts = parser.parse_args(argv)
    with user_errors():
        args = convert_hf_checkpoint(opts.checkpoint_dir, opts.out_dir, DTYPES.get(opts.dtype))
    print(f"wrote {opts.out_dir} ({args.n_layer} layers, dim {args.dim}, vocab {args.vocab_size})")


if __name__ == "__main__":
    main()
