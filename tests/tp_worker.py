"""Run by test_tp.py under torchrun (and called by it in one process): the logits of a padded batch and the
greedy tokens of a batch of two prompts. Rank 0 saves both.

    tp_worker.py CHECKPOINT OUT [compile] [native]
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import torch  # noqa: E402

import tp  # noqa: E402
from decode import compile_steps  # noqa: E402
from generate import generate, load_model  # noqa: E402
from kernels import Kernels, native_isa  # noqa: E402

ROWS = [[5, 17, 3, 99, 250, 41, 7, 8], [0, 0, 0, 60, 61, 62, 300, 2]]  # row 1: three slots of left padding
LEFT_PAD = [0, 3]
PROMPTS = [[5, 17, 3, 99, 250], [60, 61]]
# The CPU int8/int4 kernels normally take bfloat16 activations and round their outputs to bfloat16, so a sum of
# two half-length products differs from one full-length product by bfloat16 rounding (~1e-2 here, enough to flip
# near-tied greedy picks of a random model). With float32 everywhere, what is left to compare is the split itself.
EXACT = Kernels(gemm_dtype=torch.float32, kernel_activations=torch.float32)


def native() -> Kernels:
    """EXACT with kernels_cpu.cpp's int8/int4 products (built on first use): a rank's share of a row-parallel
    layer's inputs is whole blocks of 32, so only the order of the float sums over blocks differs (and, through it,
    now and then an activation's int8 code: see test_tp)."""
    return Kernels(gemm_dtype=torch.float32, kernel_activations=torch.float32, int8_native=native_isa(),
                   int4_native=native_isa())  # fmt: skip


def logits_and_tokens(checkpoint, shard=None, compiled=False, kernels: Kernels = EXACT) -> dict:
    model = load_model(checkpoint, shard=shard, kernels=kernels)
    with torch.no_grad():
        model.setup_caches(2, 16)
        left_pad = torch.tensor(LEFT_PAD)
        prefill = model(torch.tensor(ROWS), torch.arange(8), left_pad)
        step = model(torch.tensor([[11], [12]]), torch.tensor([8]), left_pad)  # one decode step on the cache
    steps = compile_steps(torch.device("cpu"), decode=compiled)
    tokens = generate(model, PROMPTS, 24, steps=steps).tokens
    return {"logits": torch.cat([prefill, step], dim=1), "tokens": tokens}


if __name__ == "__main__":
    checkpoint, out = sys.argv[1:3]
    shard, _ = tp.maybe_init_dist(torch.device("cpu"))
    result = logits_and_tokens(
        checkpoint, shard, "compile" in sys.argv[3:], native() if "native" in sys.argv[3:] else EXACT
    )
    if shard.rank == 0:
        torch.save(result, out)
    tp.end_rank()
