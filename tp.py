"""Tensor parallelism: every rank holds a slice of each layer, and the ranks add up their partial results.

    torchrun --nproc_per_node=2 generate.py --checkpoint_path checkpoints/NAME/model.pth --compile

Each block is split the Megatron way, so that it communicates once after attention and once after the
feed-forward: the q/k/v projections by heads (k and v by KV heads) and w1/w3 by hidden units, so that
each rank computes its own heads and units from the full input; wo and w2 by their input features, so
that their outputs are partial sums, all-reduced. The output projection is split by vocabulary and its
slices gathered. Quantized layers split the same way, with their scales (and int4 zeros) following the
weights. The KV cache of a rank holds only its heads. NCCL connects GPUs, gloo connects CPU processes.
"""

import contextlib
import os
import sys
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import Tensor, nn

from config import ModelArgs
from kernels import Int4Linear, Int8Linear, Linear
from model import MoEFeedForward, Transformer

# A rank waits this long for the others in a collective before giving up: a dead or hung peer ends the job
# with an error instead of a hang. It must outlast the slowest rank's torch.compile between two collectives.
DEFAULT_TIMEOUT_S = 300


@dataclass(frozen=True)
class Shard:
    rank: int
    world_size: int


def maybe_init_dist(device: torch.device, timeout_s: float = DEFAULT_TIMEOUT_S) -> tuple[Shard | None, torch.device]:
    """Joins the torchrun job this process was started in, if any. Returns its shard (None when it runs
    alone) and the device it computes on: its own GPU (by LOCAL_RANK) on CUDA."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size == 1:
        return None, device
    rank, local_rank = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
    if device.type == "cuda":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s))
    return Shard(rank, world_size), device


def quiet_rank() -> bool:
    """Under torchrun every rank runs the whole script: all but rank 0 keep quiet (they fail alike)."""
    return int(os.environ.get("RANK", "0")) != 0


@contextlib.contextmanager
def rank0_prints():
    if not quiet_rank():
        yield
        return
    with open(os.devnull, "w") as devnull, contextlib.redirect_stdout(devnull), contextlib.redirect_stderr(devnull):
        yield


@contextlib.contextmanager
def rank_failures(shard: Shard | None):
    """Under torchrun a RuntimeError is mostly a collective failing (a rank died or hung): one line, exit 1.
    A rank leaves the job however it ends."""
    try:
        yield
    except RuntimeError as e:
        if shard is None:
            raise
        sys.exit(f"error: rank {shard.rank} stopped: {e}")
    finally:
        leave_dist()


def shared_seed(seed: int | None, shard: Shard | None) -> int | None:
    """Every rank must sample the same tokens: one seed for all, rank 0's (drawn there if not given)."""
    if shard is None:
        return seed
    return from_rank0(seed if seed is not None else int(torch.randint(2**62, ())))


def line_reader(shard: Shard | None):
    """A function giving stdin's next line as bytes (b"" at the end): under torchrun rank 0 reads it and
    passes it to the others."""
    if shard is None:
        return sys.stdin.buffer.readline
    return lambda: from_rank0(sys.stdin.buffer.readline() if shard.rank == 0 else None)


def leave_dist():
    if dist.is_initialized():
        dist.destroy_process_group()


def end_rank():
    """Ends a rank that finished its work: leaves the job, flushes its output and exits at once.

    gloo's threads outlive destroy_process_group, so the interpreter's and the C++ runtime's teardown runs
    around live threads. A rank has been seen to abort there, rarely ("terminate called without an active
    exception"); os._exit skips that teardown, and a rank's exit code decides whether torchrun reports the job
    failed."""
    leave_dist()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def from_rank0(value):
    """Rank 0's value (any picklable object), on every rank."""
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def agreed(value):
    """Rank 0's value on every rank under torchrun, else value: for a choice the ranks must make alike though each
    could make it alone (one measured on each, such as speculation's round costs)."""
    return from_rank0(value) if dist.is_initialized() else value


def gather_objects(value) -> list:
    """Every rank's value, in rank order, on every rank."""
    values = [None] * dist.get_world_size()
    dist.all_gather_object(values, value)
    return values


def check_divisible(config: ModelArgs, world_size: int, quantization: dict | None):
    """Raises ValueError unless every split apply_tp makes is even (and, for int4, whole groups)."""
    c, w = config, world_size
    counts = {"n_head": c.n_head, "n_kv_heads": c.n_kv_heads, "intermediate_size": c.intermediate_size}
    problems = [f"{name} = {n} is not a multiple of {w}" for name, n in counts.items() if n % w]
    if not problems and quantization is not None and quantization["mode"] == "int4":
        group = quantization["groupsize"]
        inputs = {"wo": c.n_head * c.head_dim, "w2": c.intermediate_size}
        problems += [
            f"{name} would get {k // w} inputs a rank, not whole int4 groups of {group}"
            for name, k in inputs.items()
            if k // w % group
        ]
        outputs = {"wqkv": (c.n_head + 2 * c.n_kv_heads) * c.head_dim, "w1/w3": c.intermediate_size}
        problems += [
            f"{name} would get {n // w} outputs a rank, not a multiple of 16 (int4 kernel tiles)"
            for name, n in outputs.items()
            if n // w % 16
        ]
    if problems:
        raise ValueError(f"cannot split this model over {w} ranks: " + "; ".join(problems))


def set_tensor(module: nn.Module, name: str, value: Tensor):
    if isinstance(getattr(module, name), nn.Parameter):
        value = nn.Parameter(value, requires_grad=False)
    setattr(module, name, value)


def keep_outputs(linear: nn.Module, parts: list[range]):
    """Keeps these output features of a linear layer, plain or quantized (a copy: only the slice stays)."""
    index = torch.cat([torch.arange(p.start, p.stop) for p in parts])
    set_tensor(linear, "weight", linear.weight[index])
    if isinstance(linear, Int8Linear):
        linear.scales = linear.scales[index]
    if isinstance(linear, Int4Linear):
        linear.scales_and_zeros = linear.scales_and_zeros[:, index]
    if linear.bias is not None:
        set_tensor(linear, "bias", linear.bias[index])
    linear.out_features = len(index)


def keep_inputs(linear: nn.Module, inputs: range, keep_bias: bool):
    """Keeps these input features; the bias, added once to the sum of the ranks' parts, on one rank only."""
    start, end = inputs.start, inputs.stop
    if isinstance(linear, Int4Linear):  # two inputs a byte, one scale and zero per group of inputs
        linear.weight = linear.weight[:, start // 2 : end // 2].contiguous()
        group = linear.groupsize
        linear.scales_and_zeros = linear.scales_and_zeros[start // group : end // group].contiguous()
    else:
        set_tensor(linear, "weight", linear.weight[:, start:end].contiguous())
    if not keep_bias:
        linear.bias = None
    linear.in_features = end - start


def part(n: int, shard: Shard, offset: int = 0) -> range:
    """This rank's slice of n consecutive features starting at offset."""
    size = n // shard.world_size
    return range(offset + shard.rank * size, offset + (shard.rank + 1) * size)


def all_reduce_output(module, inputs, output: Tensor) -> Tensor:
    return funcol.all_reduce(output, "sum", dist.group.WORLD)


def all_gather_output(module, inputs, output: Tensor) -> Tensor:
    return funcol.all_gather_single(output.contiguous(), output.dim() - 1, dist.group.WORLD)


def apply_tp(model: Transformer, shard: Shard):
    """Cuts the model down to this rank's slice, in place. Call it on the weights as loaded (memory-mapped
    on the CPU), before moving the model to its device, so that no rank ever copies the whole model."""
    c, first = model.config, shard.rank == 0
    q_size, kv_size = c.n_head * c.head_dim, c.n_kv_heads * c.head_dim
    heads = [part(q_size, shard), part(kv_size, shard, q_size), part(kv_size, shard, q_size + kv_size)]
    units = part(c.intermediate_size, shard)
    for layer in model.layers:
        attn, ff = layer.attention, layer.feed_forward
        keep_outputs(attn.wqkv, heads)  # this rank's q heads, then its k heads, then its v heads
        keep_inputs(attn.wo, heads[0], keep_bias=first)
        attn.n_head, attn.n_kv_heads = c.n_head // shard.world_size, c.n_kv_heads // shard.world_size
        attn.register_forward_hook(all_reduce_output)
        # Mixture of experts: each expert is split like a dense MLP (not whole experts to ranks), so every rank
        # does an equal share of every token's work whatever the routing; the router is replicated.
        for mlp in ff.experts if isinstance(ff, MoEFeedForward) else [ff]:
            for linear in (mlp.w1, mlp.w3) if mlp.w3 is not None else (mlp.w1,):
                keep_outputs(linear, [units])
            keep_inputs(mlp.w2, units, keep_bias=first)
        ff.register_forward_hook(all_reduce_output)
    if c.vocab_size % shard.world_size == 0:  # otherwise every rank computes all the logits
        if model.output is None:  # tied: the output projection becomes a slice of the embedding table
            model.output = Linear(c.dim, c.vocab_size, bias=False, device="meta")
            model.output.weight = nn.Parameter(model.tok_embeddings.weight, requires_grad=False)
        keep_outputs(model.output, [part(c.vocab_size, shard)])
        model.output.register_forward_hook(all_gather_output)
