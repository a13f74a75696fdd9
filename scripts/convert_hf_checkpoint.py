"""Convert a Hugging Face model folder (Llama, Mistral, Mixtral, Qwen2/3, Phi-3, GPT-2, Gemma 1/2/3) into a
checkpoint folder of ours.

    python scripts/convert_hf_checkpoint.py --checkpoint_dir HF_FOLDER --out_dir checkpoints/NAME

The output folder holds model.pth (our parameter names), config.json (ModelArgs) and the tokenizer
files. It is written to a temporary folder first and renamed at the end, so a failed run leaves nothing.
"""

import argparse
import math
import os
import shutil
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from checkpoint import (
    DTYPES,
    HelpFormatter,
    check_tensors,
    load_tensor_file,
    save_tensors,
    set_ordinary_mode,
    user_errors,
)  # noqa: E402
from config import ModelArgs  # noqa: E402
from model import Transformer  # noqa: E402
from tokenizer import load_tokenizer, read_json  # noqa: E402

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer.model",
    "tokenizer_config.json",
    "chat_template.jinja",
    "special_tokens_map.json",
    "generation_config.json",
)
GEMMAS = ("gemma", "gemma2", "gemma3_text")
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "mixtral", "qwen2", "qwen3", "phi3", "gpt2", *GEMMAS, "gemma3")
ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_new": "gelu_tanh"}
DEFAULT_HEAD_DIMS = {"qwen3": 128, "gemma": 256, "gemma2": 256, "gemma3_text": 256}  # when the config omits it


def hf_config_to_args(hf: dict) -> ModelArgs:
    """Our ModelArgs for a Hugging Face config.json. Every setting that changes the numerics is either
    expressed or refused: a model is never converted into a different one."""
    model_type = hf.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"unsupported model_type {model_type!r}; supported: {', '.join(SUPPORTED_MODEL_TYPES)}")
    if model_type == "gemma3":  # the multimodal model: its language model, without the vision tower
        tied = hf.get("tie_word_embeddings", hf["text_config"].get("tie_word_embeddings", True))  # the outer one rules
        hf = {**hf["text_config"], "model_type": "gemma3_text", "tie_word_embeddings": tied}
        model_type = "gemma3_text"
    if model_type == "gpt2":
        return gpt2_config_to_args(hf)
    gemma = model_type in GEMMAS
    # Gemma 1 names its activation hidden_act, Gemma 2/3 hidden_activation; both mean the tanh GELU.
    act = (
        (hf.get("hidden_activation") or hf.get("hidden_act") or "gelu_pytorch_tanh")
        if gemma
        else hf.get("hidden_act", "silu")
    )
    act = "gelu_pytorch_tanh" if gemma and act == "gelu" else act  # Gemma 1's legacy name for it, as HF reads it
    if act not in ACTIVATIONS:
        raise ValueError(f"unsupported activation {act!r} (supported: {', '.join(ACTIVATIONS)})")
    if hf.get("use_bidirectional_attention"):
        raise ValueError("bidirectional attention (an embedding model) is not supported")
    n_head = hf["num_attention_heads"]
    head_dim = hf.get("head_dim") or DEFAULT_HEAD_DIMS.get(model_type) or hf["hidden_size"] // n_head
    rope_base, rope_scaling, rope_local_base = hf_rope(hf, model_type, head_dim)
    window, layer_types = hf_attention_layers(hf, model_type)
    block_size = hf.get("max_position_embeddings", 2048)
    # Qwen's model cards add YaRN and leave max_position_embeddings at the original context: hold factor times it.
    if rope_scaling is not None and rope_scaling["rope_type"] == "yarn":
        block_size = max(block_size, int(rope_scaling["factor"] * rope_scaling["original_max_position_embeddings"]))
    bias = hf.get("attention_bias", model_type == "qwen2")
    return ModelArgs(
        dim=hf["hidden_size"],
        n_layer=hf["num_hidden_layers"],
        n_head=n_head,
        n_kv_heads=hf.get("num_key_value_heads"),  # None: as many as n_head
        head_dim=head_dim,
        intermediate_size=hf["intermediate_size"],
        vocab_size=hf["vocab_size"],
        block_size=block_size,
        rope_base=rope_base,
        rope_scaling=rope_scaling,
        norm_eps=hf.get("rms_norm_eps", 1e-6),
        tie_word_embeddings=hf.get("tie_word_embeddings", gemma),  # Gemma's default: tied
        attention_bias=bias,
        attention_out_bias=model_type != "qwen2" and bias,  # Qwen2 has q/k/v biases only
        norm_type="gemma_rmsnorm" if gemma else "rmsnorm",
        hidden_act=ACTIVATIONS[act],
        mlp_bias=hf.get("mlp_bias", False),
        scale_embeddings=gemma,
        qk_norm=model_type in ("qwen3", "gemma3_text"),
        post_norms=model_type in ("gemma2", "gemma3_text"),
        query_pre_attn_scalar=hf.get("query_pre_attn_scalar") if model_type != "gemma" else None,
        attn_logit_softcap=hf.get("attn_logit_softcapping"),
        final_logit_softcap=hf.get("final_logit_softcapping"),
        sliding_window=window,
        layer_types=layer_types,
        rope_local_base=rope_local_base,
        n_experts=hf.get("num_local_experts", 0) if model_type == "mixtral" else 0,
        n_experts_per_token=hf.get("num_experts_per_tok", 2) if model_type == "mixtral" else 2,
    )


def gpt2_config_to_args(hf: dict) -> ModelArgs:
    act = hf.get("activation_function", "gelu_new")
    if act not in ACTIVATIONS or ACTIVATIONS[act] != "gelu_tanh":
        raise ValueError(f"unsupported GPT-2 activation_function {act!r} (supported: gelu_new, gelu_pytorch_tanh)")
    if hf.get("scale_attn_by_inverse_layer_idx") or not hf.get("scale_attn_weights", True):
        raise ValueError("GPT-2 attention scaling other than 1/sqrt(head_dim) is not supported")
    dim = hf["n_embd"]
    return ModelArgs(
        dim=dim,
        n_layer=hf["n_layer"],
        n_head=hf["n_head"],
        intermediate_size=hf.get("n_inner") or 4 * dim,
        vocab_size=hf["vocab_size"],
        block_size=hf["n_positions"],
        norm_eps=hf.get("layer_norm_epsilon", 1e-5),
        tie_word_embeddings=hf.get("tie_word_embeddings", True),
        attention_bias=True,
        attention_out_bias=True,
        norm_type="layernorm",
        hidden_act="gelu_tanh",
        gated_mlp=False,
        mlp_bias=True,
        position_embedding="learned",
    )


def hf_rope(hf: dict, model_type: str, head_dim: int) -> tuple[float, dict | None, float | None]:
    """(rope_base, rope_scaling, rope_local_base) of a config. transformers 5 keeps the settings in
    "rope_parameters" (Gemma 3: one set per kind of layer); earlier versions in rope_theta / rope_scaling."""
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    if not isinstance(rope, dict):
        raise ValueError(f"rope_parameters / rope_scaling must be an object, got {rope!r}")
    local_base = None
    if model_type == "gemma3_text":
        local = rope.get("sliding_attention") or {"rope_theta": hf.get("rope_local_base_freq", 10000.0)}
        if local.get("rope_type", "default") != "default":
            raise ValueError(f"unsupported rope scaling of sliding layers {local!r} (supported: default)")
        local_base = local["rope_theta"]
        rope = rope.get("full_attention", rope)
    rope = dict(rope)
    if rope.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0)) != 1.0:
        raise ValueError("partial rotary embeddings (partial_rotary_factor < 1) are not supported")
    default_base = 1_000_000.0 if model_type == "gemma3_text" else 10000.0
    rope_base = rope.pop("rope_theta", hf.get("rope_theta", default_base))
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    rope_type = "longrope" if model_type == "phi3" and rope_type in ("su", "yarn") else rope_type  # as HF reads Phi-3
    if rope_type == "default":
        return rope_base, None, local_base
    if rope_type == "llama3":
        keys = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
        return rope_base, {"rope_type": "llama3", **{k: rope[k] for k in keys}}, local_base
    if rope_type == "linear":
        return rope_base, {"rope_type": "linear", "factor": rope["factor"]}, local_base
    if rope_type == "longrope":
        original = rope.get("original_max_position_embeddings") or hf["original_max_position_embeddings"]
        factor = rope.get("factor") or hf["max_position_embeddings"] / original
        # The paper's attention scaling unless the config gives one (Phi-3 derives factor from the two lengths).
        attention_factor = rope.get("attention_factor") or (
            math.sqrt(1 + math.log(factor) / math.log(original)) if factor > 1 else 1.0
        )
        return (
            rope_base,
            {
                "rope_type": "longrope",
                "short_factor": rope["short_factor"],
                "long_factor": rope["long_factor"],
                "original_max_position_embeddings": original,
                "attention_factor": attention_factor,
            },
            local_base,
        )
    if rope_type == "yarn":
        return rope_base, hf_yarn(hf, rope), local_base
    raise ValueError(
        f"unsupported rope scaling type {rope_type!r} (supported: default, llama3, linear, longrope, yarn)"
    )


def hf_yarn(hf: dict, rope: dict) -> dict:
    """YaRN's settings as transformers reads them: the original context defaults to max_position_embeddings, and the
    attention factor, when not given, to the paper's (model.rope_attention_factor). DeepSeek's mscale is refused."""
    original = rope.get("original_max_position_embeddings") or hf["max_position_embeddings"]
    factor = rope.get("factor") or hf["max_position_embeddings"] / original
    yarn = {"rope_type": "yarn", "factor": factor, "original_max_position_embeddings": original}
    yarn |= {
        key: rope[key]
        for key in ("attention_factor", "beta_fast", "beta_slow", "truncate")
        if rope.get(key) is not None
    }
    if rope.get("mscale") or rope.get("mscale_all_dim"):
        raise ValueError("rope scaling yarn with mscale / mscale_all_dim (DeepSeek's) is not supported")
    return yarn


def hf_attention_layers(hf: dict, model_type: str) -> tuple[int | None, list | None]:
    """(sliding_window, layer_types): which layers attend to a sliding window, as transformers decides it."""
    window = hf.get("sliding_window")
    if model_type in ("qwen2", "qwen3") and not hf.get("use_sliding_window"):
        window = None  # their configs carry a window they do not use
    if window is None:
        return None, None
    if hf.get("layer_types") is not None:
        return window, list(hf["layer_types"])
    n = hf["num_hidden_layers"]
    if model_type in ("qwen2", "qwen3"):  # the first max_window_layers layers attend to everything
        first_full = hf.get("max_window_layers", n)
        return window, ["full_attention" if i < first_full else "sliding_attention" for i in range(n)]
    if model_type in ("gemma2", "gemma3_text"):  # every other layer global (Gemma 2); every sixth (Gemma 3)
        period = 2 if model_type == "gemma2" else hf.get("sliding_window_pattern", 6)
        return window, ["full_attention" if (i + 1) % period == 0 else "sliding_attention" for i in range(n)]
    return window, None  # all layers slide: Mistral, Mixtral, Phi-3


def permute_rotary(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    # HF rotates the first half of each head against the second; we rotate interleaved pairs.
    # Row order per head: [0 .. D/2-1 | D/2 .. D-1] -> [0, D/2, 1, D/2+1, ...]. Works on weights and biases.
    head_dim = w.shape[0] // n_heads
    return w.reshape(n_heads, 2, head_dim // 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def hf_weight_files(checkpoint_dir: Path) -> list[Path]:
    # The index names the shards; some folders also hold other weight files (e.g. consolidated.safetensors).
    for single, index in (
        ("model.safetensors", "model.safetensors.index.json"),
        ("pytorch_model.bin", "pytorch_model.bin.index.json"),
    ):
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


# Hugging Face names inside a block -> ours, for those renamed as they are (see convert_hf_state_dict).
LAYER_RENAMES = {
    "self_attn.o_proj": "attention.wo",
    "self_attn.q_norm": "attention.q_norm",
    "self_attn.k_norm": "attention.k_norm",
    "mlp.gate_proj": "feed_forward.w1",
    "mlp.up_proj": "feed_forward.w3",
    "mlp.down_proj": "feed_forward.w2",
    "input_layernorm": "attention_norm",
    "post_attention_layernorm": "ffn_norm",  # Gemma 2/3: post_attention_norm (see convert_hf_state_dict)
    "pre_feedforward_layernorm": "ffn_norm",
    "post_feedforward_layernorm": "post_ffn_norm",
    "block_sparse_moe.gate": "feed_forward.router",
    # GPT-2 (transformer.h.{i}.*), whose Conv1D weights are stored [in, out]
    "ln_1": "attention_norm",
    "ln_2": "ffn_norm",
    "attn.c_attn": "attention.wqkv",
    "attn.c_proj": "attention.wo",
    "mlp.c_fc": "feed_forward.w1",
    "mlp.c_proj": "feed_forward.w2",
}
GPT2_CONV1D = ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")
# Projections that make up our fused wqkv, and which of q, k, v each holds (Phi-3 stores all three fused).
QKV_PROJECTIONS = {
    "self_attn.q_proj": "q",
    "self_attn.k_proj": "k",
    "self_attn.v_proj": "v",
    "self_attn.qkv_proj": "qkv",
}
TOP_RENAMES = {
    "model.embed_tokens": "tok_embeddings",
    "model.norm": "norm",
    "lm_head": "output",
    "wte": "tok_embeddings",
    "wpe": "pos_embeddings",
    "ln_f": "norm",
}


def hf_name_parts(name: str) -> tuple[str | None, str]:
    """(layer index or None, name within the layer or the model) with the model's prefixes removed;
    (None, "") for tensors that are not weights of the language model."""
    for prefix in ("model.language_model.", "language_model.model.", "language_model."):  # Gemma 3 multimodal
        if name.startswith(prefix):
            name = ("model." if prefix != "language_model." else "") + name[len(prefix) :]
    if name.startswith(
        ("model.vision_tower.", "vision_tower.", "model.multi_modal_projector.", "multi_modal_projector.")
    ):
        return None, ""
    name = name.removeprefix("transformer.")  # GPT-2
    for layers in ("model.layers.", "h."):
        if name.startswith(layers):
            index, rest = name[len(layers) :].split(".", 1)
            return index, rest
    return None, name


def convert_hf_state_dict(tensors, config: ModelArgs, dtype: torch.dtype | None) -> dict:
    out, pending_qkv = {}, {}
    q_size, kv_size = config.n_head * config.head_dim, config.n_kv_heads * config.head_dim
    rotary = config.position_embedding == "rope"
    for name, t in tensors:
        t = t.to(dtype) if dtype is not None else t
        index, rest = hf_name_parts(name)
        module, _, kind = rest.rpartition(".")  # kind: weight or bias
        if rest == "" or "rotary_emb" in rest or rest in ("attn.bias", "attn.masked_bias"):
            continue  # not the language model's; precomputed rotary angles; GPT-2's causal-mask buffers
        if index is None:
            if module not in TOP_RENAMES:
                raise ValueError(f"unexpected tensor {name!r} in checkpoint")
            if module == "lm_head" and config.tie_word_embeddings:
                continue  # stored once, as tok_embeddings.weight
            out[f"{TOP_RENAMES[module]}.{kind}"] = t
            continue
        prefix = f"layers.{index}."
        if module in GPT2_CONV1D and kind == "weight":
            t = t.T.contiguous()
        if module in QKV_PROJECTIONS:
            group = pending_qkv.setdefault((index, kind), {})
            parts = t.split([q_size, kv_size, kv_size]) if module == "self_attn.qkv_proj" else [t]
            group.update(zip(QKV_PROJECTIONS[module], parts))
            if len(group) == 3:
                q, k, v = group["q"], group["k"], group["v"]
                if rotary:
                    q, k = permute_rotary(q, config.n_head), permute_rotary(k, config.n_kv_heads)
                out[f"{prefix}attention.wqkv.{kind}"] = torch.cat([q, k, v])
                del pending_qkv[(index, kind)]
        elif module == "mlp.gate_up_proj":  # Phi-3: gate and up projections stacked
            out[f"{prefix}feed_forward.w1.{kind}"], out[f"{prefix}feed_forward.w3.{kind}"] = t.chunk(2)
        elif module.startswith("block_sparse_moe.experts."):  # Mixtral: experts.{e}.w1/w2/w3 as ours
            out[f"{prefix}feed_forward.experts.{module.split('.', 2)[2]}.{kind}"] = t
        elif module in LAYER_RENAMES:
            ours = LAYER_RENAMES[module]
            if module == "post_attention_layernorm" and config.post_norms:
                ours = "post_attention_norm"
            if module == "block_sparse_moe.gate":
                out[f"{prefix}{ours}"] = t
                continue
            if module in ("self_attn.q_norm", "self_attn.k_norm") and rotary:
                t = permute_rotary(t, 1)  # one weight per head dimension, reordered as the q/k rows were
            out[f"{prefix}{ours}.{kind}"] = t
        else:
            raise ValueError(f"unexpected tensor {name!r} in checkpoint")
    if pending_qkv:
        raise ValueError(f"incomplete q/k/v projections in checkpoint: {sorted(pending_qkv)}")
    return out


def check_state_dict(state_dict: dict, config: ModelArgs):
    """Raises ValueError unless state_dict has exactly the parameters (names and shapes) of the model."""
    with torch.device("meta"):
        expected = {k: v.shape for k, v in Transformer(config).state_dict().items()}
    missing = sorted(set(expected) - set(state_dict))
    extra = sorted(set(state_dict) - set(expected))
    if missing or extra:
        raise ValueError(f"checkpoint does not match config: missing {missing[:5]}, unexpected {extra[:5]}")
    for k, shape in expected.items():
        if state_dict[k].shape != shape:
            raise ValueError(
                f"checkpoint tensor {k} has shape {tuple(state_dict[k].shape)}, config implies {tuple(shape)}"
            )


def write_checkpoint(out_dir: Path, state_dict: dict, config: ModelArgs, fill_tokenizer):
    """Writes model.pth, config.json and (through fill_tokenizer(folder)) the tokenizer files, atomically."""
    check_state_dict(state_dict, config)
    out_dir = out_dir.resolve()
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    set_ordinary_mode(tmp, 0o777)
    try:
        save_tensors(state_dict, tmp / "model.pth", shown_as=out_dir / "model.pth")
        (tmp / "config.json").write_text(config.to_json() + "\n")
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
        config = hf_config_to_args(hf)
    except KeyError as e:
        raise ValueError(f"{config_path}: missing field {e}") from None
    except ValueError as e:
        raise ValueError(f"{config_path}: {e}") from None
    load_tokenizer(checkpoint_dir)  # refused now, if missing or damaged, rather than when the checkpoint is used
    state_dict = convert_hf_state_dict(iter_hf_tensors(checkpoint_dir), config, dtype)

    def copy_tokenizer(folder: Path):
        for name in TOKENIZER_FILES:
            if (checkpoint_dir / name).is_file():
                shutil.copy(checkpoint_dir / name, folder / name)

    write_checkpoint(Path(out_dir), state_dict, config, copy_tokenizer)
    return config


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    arg = p.add_argument
    arg("--checkpoint_dir", type=Path, required=True, help="Hugging Face model folder")
    arg("--out_dir", type=Path, required=True, help="folder to write (replaced if it exists)")
    arg("--dtype", choices=DTYPES, help="convert weights to this dtype (default: keep as stored)")
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    with user_errors():
        config = convert_hf_checkpoint(args.checkpoint_dir, args.out_dir, DTYPES.get(args.dtype))
    print(f"wrote {args.out_dir} ({config.n_layer} layers, dim {config.dim}, vocab {config.vocab_size})")


if __name__ == "__main__":
    main()
