"""Weight-only quantization: int8 per channel, int4 per group (round-to-nearest or GPTQ).

    python quantize.py --checkpoint_path checkpoints/NAME/model.pth --mode int8
    python quantize.py --checkpoint_path checkpoints/NAME/model.pth --mode int4 --groupsize 32
    python quantize.py --checkpoint_path checkpoints/NAME/model.pth --mode int4-gptq --groupsize 32

Writes model_int8.pth / model_int4.g32.pth / model_int4-gptq.g32.pth beside the input (names for
humans only): the file records its own format, and generate.py / eval.py load it with no extra flag.
Every linear layer of the blocks is quantized; the output projection is int8 in both modes (int4 costs
it too much quality) and the embedding stays in floating point (a decode step reads one row of it).

The int4 file stores a device-neutral packing (two 4-bit values a byte); the layout of the int4
kernels (_weight_int4pack_mm on CUDA, _weight_int4pack_mm_for_cpu on CPU) is made at load time, by
kernels.Int4Linear.prepare.
"""

import argparse
from pathlib import Path

import torch
import torch.nn as nn
from torch import Tensor

from checkpoint import HelpFormatter, load_checkpoint, resolve_checkpoint, save_atomic, user_errors
from config import ModelArgs
from kernels import Int4Linear, Int8Linear, Kernels, in_huge_pages, join_native, set_kernels
from model import FeedForward, Transformer
from tokenizer import load_tokenizer, read_text

FORMAT_VERSION = 1
MODES = ("int8", "int4", "int4-gptq")
GROUPSIZES = (32, 64, 128, 256)  # what the int4 kernels accept


# ---------------------------------------------------------------- formats and kernels


def quantize_int8(w: Tensor) -> tuple[Tensor, Tensor]:
    """[N, K] -> int8 values [N, K] and one symmetric scale per output channel [N]."""
    scales = w.abs().amax(dim=1).float().clamp(min=1e-8) / 127
    q = torch.round(w.float() / scales[:, None]).clamp(-128, 127).to(torch.int8)
    return q, scales


def int4_group_params(w: Tensor, groupsize: int) -> tuple[Tensor, Tensor]:
    """[N, K] -> scales and zeros [N, K / groupsize]: value = (q - 8) * scale + zero for q in 0..15."""
    groups = w.float().reshape(w.shape[0], -1, groupsize)
    lo, hi = groups.amin(dim=-1), groups.amax(dim=-1)
    scales = ((hi - lo) / 15).clamp(min=1e-8)
    return scales, lo + 8 * scales


def quantize_int4_values(w: Tensor, scales: Tensor, zeros: Tensor, groupsize: int) -> Tensor:
    """Rounds [N, K] to the nearest 4-bit codes (0..15) of the given group parameters."""
    s, z = scales.repeat_interleave(groupsize, dim=1), zeros.repeat_interleave(groupsize, dim=1)
    return torch.round((w.float() - z) / s + 8).clamp(0, 15).to(torch.uint8)


def dequantize_int4(q: Tensor, scales: Tensor, zeros: Tensor, groupsize: int) -> Tensor:
    s, z = scales.repeat_interleave(groupsize, dim=1), zeros.repeat_interleave(groupsize, dim=1)
    return (q.float() - 8) * s + z


def pack_int4(q: Tensor) -> Tensor:
    # [N, K] codes -> [N, K / 2] bytes: column 2i in the high nibble, 2i+1 in the low one
    return (q[:, ::2] << 4 | q[:, 1::2]).to(torch.uint8)


def quantized_linears(model) -> list[tuple[str, nn.Linear]]:
    """The linear layers a quantized checkpoint replaces: every one in the blocks, and the output."""
    return [(name, m) for name, m in model.named_modules() if isinstance(m, nn.Linear)]


def check_format(fmt: dict):
    if fmt.get("version") != FORMAT_VERSION or fmt.get("mode") not in ("int8", "int4"):
        raise ValueError(f"unknown quantized format {fmt!r} (this loader reads version {FORMAT_VERSION}, int8 or int4)")
    if fmt["mode"] == "int4" and fmt.get("groupsize") not in GROUPSIZES:
        raise ValueError(f"unknown int4 group size in quantized format {fmt!r}")


def swap_in_quantized_modules(model, fmt: dict):
    """Replaces the model's linear layers (on the meta device) by the quantized modules fmt describes."""
    check_format(fmt)
    with torch.device("meta"):
        for name, linear in quantized_linears(model):
            bias = linear.bias is not None
            if fmt["mode"] == "int8" or name == "output":
                new = Int8Linear(linear.in_features, linear.out_features, bias)
            else:
                new = Int4Linear(linear.in_features, linear.out_features, fmt["groupsize"], bias)
            model.set_submodule(name, new)
        if model.output is None:  # tied embeddings: the quantized output projection gets its own weights
            model.output = Int8Linear(model.config.dim, model.config.vocab_size)


def quantization_format(kind: str, groupsize: int | None, method: str = "rtn") -> dict:
    return {
        "version": FORMAT_VERSION,
        "mode": kind,
        "groupsize": None if kind == "int8" else groupsize,
        "method": method,
        "output": "int8",
        "embedding": "float",
    }


def quantize_model(model, kind: str, groupsize: int = 32, kernels: Kernels = Kernels()):
    """A round-to-nearest quantized copy ("int8" or "int4") of a floating-point model, built in memory
    the way load_model builds it from a quantized checkpoint (for benchmarks)."""
    fmt = quantization_format(kind, groupsize)
    state = quantized_state_dict(model, kind, groupsize)
    with torch.device("meta"):
        quantized = Transformer(model.config)
    swap_in_quantized_modules(quantized, fmt)
    quantized.load_state_dict(state, assign=True)
    set_kernels(quantized, kernels)
    prepare_quantized(quantized)
    if kernels.huge_pages:
        in_huge_pages(quantized)
    return quantized.eval()


def load_checkpoint_model(path: Path) -> tuple[Transformer, dict | None]:
    """The model a checkpoint file holds, float or quantized (and its quantization format, or None): built on
    the meta device, with the memory-mapped tensors assigned (no second copy), before any device or kernels."""
    config = ModelArgs.from_json(path.parent / "config.json")
    with torch.device("meta"):
        model = Transformer(config)
    state_dict, quantization = load_checkpoint(path)
    if quantization is not None:
        try:
            swap_in_quantized_modules(model, quantization)
        except ValueError as e:
            raise ValueError(f"{path}: {e}") from None
    try:
        model.load_state_dict(state_dict, assign=True)
    except RuntimeError as e:
        raise ValueError(f"{path} does not match {path.parent / 'config.json'}: {e}") from None
    return model, quantization


def prepare_quantized(model):
    """Makes the layouts that each layer's kernels need (so after set_kernels), on its device, and joins a gated
    MLP's gate and up projections for kernels_cpu.cpp (kernels.join_native)."""
    for module in model.modules():
        if isinstance(module, (Int8Linear, Int4Linear)):
            module.prepare()
    for module in model.modules():
        if isinstance(module, FeedForward) and module.w3 is not None:
            join_native(module.w1, module.w3)


# ---------------------------------------------------------------- GPTQ


def gptq_int4(w: Tensor, hessian: Tensor, groupsize: int, damp: float = 0.01, act_order: bool = False):
    """GPTQ (Frantar et al. 2022) for one [N, K] weight: returns 4-bit codes [N, K], scales and zeros [N, K / g].

    Columns are rounded one at a time, and each rounding error is spread over the columns not yet
    rounded, weighted by the inverse Hessian of the layer's inputs. With act_order, columns go in order
    of decreasing Hessian diagonal and the group parameters are fixed up front from the original
    weights, so the groups stay contiguous in the file's format."""
    w = w.double().clone()
    h = hessian.double().clone()
    n, k = w.shape
    dead = torch.diag(h) == 0  # inputs that were always zero
    h[dead, dead] = 1
    w[:, dead] = 0
    if act_order:
        scales, zeros = (t.double() for t in int4_group_params(w, groupsize))
    else:  # filled as each group is reached
        scales, zeros = torch.empty(n, k // groupsize, dtype=w.dtype), torch.empty(n, k // groupsize, dtype=w.dtype)
    order = torch.argsort(torch.diag(h), descending=True) if act_order else torch.arange(k)
    w, h = w[:, order], h[order][:, order]
    h += damp * torch.diag(h).mean() * torch.eye(k, dtype=h.dtype)
    hinv = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True)
    codes = torch.zeros(n, k, dtype=torch.uint8)
    block = max(128, groupsize)  # a multiple of groupsize, so a group never straddles two blocks
    for start in range(0, k, block):
        end = min(start + block, k)
        wb, errors, hb = w[:, start:end].clone(), torch.zeros(n, end - start, dtype=w.dtype), hinv[start:end, start:end]
        for i in range(end - start):
            col = order[start + i].item()
            g = col // groupsize
            if not act_order and col % groupsize == 0:  # a new group: its parameters from the weights as updated so far
                scales[:, g : g + 1], zeros[:, g : g + 1] = int4_group_params(wb[:, i : i + groupsize], groupsize)
            q = quantize_int4_values(wb[:, i : i + 1], scales[:, g : g + 1], zeros[:, g : g + 1], 1)
            codes[:, col] = q[:, 0]
            error = (wb[:, i] - dequantize_int4(q, scales[:, g : g + 1], zeros[:, g : g + 1], 1)[:, 0]) / hb[i, i]
            wb[:, i:] -= error[:, None] * hb[i, i:][None, :]
            errors[:, i] = error
        w[:, end:] -= errors @ hinv[start:end, end:]
    return codes, scales.float(), zeros.float()


def calibration_tokens(tokenizer, text: str, samples: int, seq_length: int) -> Tensor:
    """The text's first samples x seq_length tokens as [samples, seq_length] (eval.py scores its end)."""
    ids = tokenizer.encode(text, bos=False)
    if len(ids) < samples * seq_length:
        raise ValueError(
            f"calibration text has {len(ids)} tokens, fewer than --calibration_samples x --calibration_seq_length "
            f"= {samples * seq_length}"
        )
    return torch.tensor(ids[: samples * seq_length]).view(samples, seq_length)


@torch.no_grad()
def gptq_quantize_blocks(model, tokens: Tensor, groupsize: int, act_order: bool, batch: int = 8) -> dict:
    """Quantizes each block's linear layers in turn with GPTQ; later blocks see the quantized earlier ones.

    Returns {linear name: (codes, scales, zeros)}."""
    from tqdm import tqdm

    samples, seq_length = tokens.shape
    model.setup_caches(batch, seq_length)
    input_pos = torch.arange(seq_length)
    positions, inputs = model.attention_inputs(input_pos, None, batch)
    xs = [model.embed(rows, positions[: len(rows)]) for rows in tokens.split(batch)]

    def run(layer, x):  # the layer on a batch of len(x) rows
        freqs_cis, slots, (mask,) = inputs[layer.attention.kind]
        return layer(x, slots, None if freqs_cis is None else freqs_cis[: len(x)], None, 1, mask[: len(x)])

    results = {}
    for index, layer in enumerate(tqdm(model.layers, desc="GPTQ", unit="layer")):
        linears = {name: m for name, m in layer.named_modules() if isinstance(m, nn.Linear)}
        hessians = {name: torch.zeros(m.in_features, m.in_features, dtype=torch.float64) for name, m in linears.items()}

        def accumulate(hessian):
            def hook(module, args, output):
                x = args[0].reshape(-1, args[0].shape[-1]).float()
                hessian.add_((2 * x.T @ x / (samples * seq_length)).double())  # float32 products, float64 sum

            return hook

        handles = [m.register_forward_hook(accumulate(hessians[name])) for name, m in linears.items()]
        for x in xs:
            run(layer, x)
        for handle in handles:
            handle.remove()
        for name, module in linears.items():
            codes, scales, zeros = gptq_int4(module.weight, hessians[name], groupsize, act_order=act_order)
            module.weight.copy_(dequantize_int4(codes, scales, zeros, groupsize))
            results[f"layers.{index}.{name}"] = (codes, scales, zeros)
        xs = [run(layer, x) for x in xs]
    return results


# ---------------------------------------------------------------- writing a quantized checkpoint


def quantized_state_dict(model, mode: str, groupsize: int | None, int4_groups: dict | None = None) -> dict:
    """The checkpoint's tensors; int4 layers take their (codes, scales, zeros) from int4_groups when given (GPTQ's, or
    a GGUF file's 4-bit blocks), else round to nearest."""
    state = dict(model.state_dict())
    linears = dict(quantized_linears(model))
    if model.output is None:
        linears["output"] = nn.Linear(model.config.dim, model.config.vocab_size, bias=False)
        linears["output"].weight = model.tok_embeddings.weight
    for name, module in linears.items():
        state.pop(f"{name}.weight", None)
        w = module.weight.detach()
        if mode == "int8" or name == "output":
            q, scales = quantize_int8(w)
            state[f"{name}.weight"], state[f"{name}.scales"] = q, scales
            continue
        if int4_groups is not None:
            codes, scales, zeros = int4_groups[name]
        else:
            scales, zeros = int4_group_params(w, groupsize)
            codes = quantize_int4_values(w, scales, zeros, groupsize)
        state[f"{name}.weight"] = pack_int4(codes)
        state[f"{name}.scales_and_zeros"] = torch.stack([scales.T, zeros.T], dim=-1).contiguous()  # [K / g, N, 2]
    return state


def output_path(checkpoint_path: Path, mode: str, groupsize: int | None) -> Path:
    suffix = f"_{mode}" + (f".g{groupsize}" if mode != "int8" else "")
    return checkpoint_path.with_name(checkpoint_path.stem + suffix + ".pth")


def quantize_checkpoint(
    checkpoint_path: Path,
    mode: str,
    groupsize: int = 32,
    calibration_text: str | None = None,
    calibration_samples: int = 32,
    calibration_seq_length: int = 512,
    act_order: bool = False,
) -> Path:
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}; choose from {', '.join(MODES)}")
    if mode != "int8" and groupsize not in GROUPSIZES:
        raise ValueError(f"groupsize {groupsize} is not supported; choose from {', '.join(map(str, GROUPSIZES))}")
    checkpoint_path = resolve_checkpoint(checkpoint_path)
    model, quantization = load_checkpoint_model(checkpoint_path)
    if quantization is not None:
        raise ValueError(f"{checkpoint_path} is already quantized; quantize the floating-point model.pth")
    model = model.float().eval()
    for name, module in quantized_linears(model):
        if mode == "int8" or name == "output":
            continue
        if module.in_features % groupsize:
            raise ValueError(
                f"groupsize {groupsize} does not divide the {module.in_features} inputs of {name}; "
                f"use a groupsize that divides {module.in_features}"
            )
        if module.out_features % 16:  # the int4 kernels' tile height
            raise ValueError(f"int4 needs a multiple of 16 outputs; {name} has {module.out_features}: use int8")
    gptq_results = None
    if mode == "int4-gptq":
        text = calibration_text if calibration_text is not None else default_text()
        tokens = calibration_tokens(
            load_tokenizer(checkpoint_path.parent), text, calibration_samples, calibration_seq_length
        )
        gptq_results = gptq_quantize_blocks(model, tokens, groupsize, act_order)
    kind = "int8" if mode == "int8" else "int4"
    fmt = quantization_format(kind, groupsize, "gptq" if mode == "int4-gptq" else "rtn")
    out = output_path(checkpoint_path, mode, None if kind == "int8" else groupsize)
    save_atomic({"quantization": fmt, "state_dict": quantized_state_dict(model, kind, groupsize, gptq_results)}, out)
    return out


def default_text() -> str:
    """Documentation text every Python installation carries (the standard library's pydoc topics)."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[key] for key in sorted(topics))


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument("--checkpoint_path", type=Path, required=True, help="the floating-point model.pth")
    parser.add_argument(
        "--mode",
        required=True,
        choices=MODES,
        help="int8: per-channel weights; int4: per-group (--groupsize) by rounding; int4-gptq: "
        "per-group by GPTQ on calibration text",
    )
    parser.add_argument("--groupsize", type=int, default=32, help="int4 group size: 32, 64, 128 or 256")
    parser.add_argument("--calibration_file", type=Path, help="GPTQ calibration text (default: Python's pydoc topics)")
    parser.add_argument("--calibration_samples", type=int, default=32, help="GPTQ: sequences of calibration text")
    parser.add_argument("--calibration_seq_length", type=int, default=512, help="GPTQ: tokens per sequence")
    parser.add_argument("--act_order", action="store_true", help="GPTQ: quantize columns by decreasing activation")
    args = parser.parse_args(argv)
    if args.calibration_samples < 1 or args.calibration_seq_length < 1:
        parser.error("--calibration_samples and --calibration_seq_length must be >= 1")
    return args


def main(argv=None):
    args = parse_args(argv)
    with user_errors():
        text = read_text(args.calibration_file) if args.calibration_file else None
        out = quantize_checkpoint(
            args.checkpoint_path,
            args.mode,
            args.groupsize,
            text,
            args.calibration_samples,
            args.calibration_seq_length,
            args.act_order,
        )
        print(f"wrote {out} ({out.stat().st_size / 1e6:.1f} MB)")


if __name__ == "__main__":
    main()
