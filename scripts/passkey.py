"""Passkey retrieval: a five-digit number hidden in filler text and asked for at the end, at several context lengths
and depths, answered greedily. Each case prints its prompt's tokens, where the key sits, whether the answer holds
it, the prefill's tokens/s, the process's peak memory so far (cases run shortest first, so each length's peak is
its own) and the KV cache's size as set up for the case.

    python scripts/passkey.py --checkpoint_path checkpoints/Qwen2.5-Coder-0.5B-Instruct/model.pth \\
        --lengths 4096,8192,16384 --depths 0.1,0.5,0.9

The text is the common passkey test's (Mohtashami and Jaggi, 2023): repeated filler sentences around "The pass key
is N. Remember it. N is the pass key.", then "What is the pass key? The pass key is", as plain text (no chat
template). A prompt takes whole filler sentences, so its length is within a sentence of the one asked for.
"""

import argparse
import random
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from checkpoint import (  # noqa: E402
    DEFAULT_CHECKPOINT,
    DEFAULT_DEVICE,
    DTYPES,
    KV_CACHE_DTYPES,
    KV_CACHE_HELP,
    HelpFormatter,
    device_flag,
    user_errors,
)
from generate import generate, load_models  # noqa: E402
from results import peak_memory_gb  # noqa: E402

INTRO = "There is important information hidden in a lot of irrelevant text. Find it and remember it.\n"
FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
NEEDLE = "The pass key is {key}. Remember it. {key} is the pass key. "
QUESTION = "\nWhat is the pass key? The pass key is"


def passkey_text(fillers: int, depth: float, key: int) -> str:
    """INTRO, fillers filler sentences with the needle after round(depth * fillers) of them, then the question."""
    before = round(depth * fillers)
    return INTRO + FILLER * before + NEEDLE.format(key=key) + FILLER * (fillers - before) + QUESTION


def passkey_prompt(tokenizer, length: int, depth: float, key: int) -> list[int]:
    """The token ids of the longest passkey text of at most length tokens (at least one filler sentence)."""
    per_filler = len(tokenizer.encode(FILLER * 64)) / 64
    fillers = max(1, int((length - len(tokenizer.encode(passkey_text(0, depth, key)))) / per_filler))
    while fillers > 1 and len(tokenizer.encode(passkey_text(fillers, depth, key))) > length:
        fillers -= 1
    return tokenizer.encode(passkey_text(fillers, depth, key))


def run_case(model, tokenizer, length: int, depth: float, key: int, device: torch.device) -> dict:
    prompt = passkey_prompt(tokenizer, length, depth, key)
    result = generate(model, prompt, 8, eos_ids=tokenizer.eos_ids)
    answer = tokenizer.decode(result.tokens[0])
    return {
        "length": length,
        "prompt_tokens": len(prompt),
        "depth": depth,
        "key": key,
        "answer": answer.strip().splitlines()[0] if answer.strip() else "",
        "found": str(key) in answer,
        "prefill_tokens_per_s": len(prompt) / result.time_to_first_token_s,
        "peak_memory_gb": peak_memory_gb(device),
        "kv_cache_mb": model.kv_cache_figures()["kv_cache_bytes"] / 1e6,
    }


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    arg = parser.add_argument
    arg("--checkpoint_path", type=Path, default=DEFAULT_CHECKPOINT, help="the checkpoint (any model*.pth)")
    arg("--lengths", default="1024,4096", help="comma-separated prompt lengths in tokens")
    arg("--depths", default="0.5", help="comma-separated positions of the key in the filler, 0 (start) to 1 (end)")
    arg("--seed", type=int, default=0, help="seeds the keys")
    arg("--dtype", choices=DTYPES, default=None, help="floating-point dtype (default: float32 on CPU)")
    arg("--kv_cache_dtype", choices=KV_CACHE_DTYPES, default=None, help=KV_CACHE_HELP)
    arg("--device", type=device_flag, default=DEFAULT_DEVICE)
    args = parser.parse_args(argv)
    try:
        args.lengths = sorted(int(n) for n in args.lengths.split(","))
        args.depths = [float(d) for d in args.depths.split(",")]
    except ValueError:
        parser.error("--lengths takes integers and --depths numbers, comma-separated")
    if min(args.lengths) < 64:
        parser.error("--lengths must be at least 64 tokens")
    if not all(0 <= d <= 1 for d in args.depths):
        parser.error("--depths must be within 0..1")
    return args


def main(argv=None):
    args = parse_args(argv)
    with user_errors():
        model, tokenizer, _ = load_models(
            args.checkpoint_path, args.device, args.dtype, kv_cache_dtype=args.kv_cache_dtype
        )
        if args.lengths[-1] + 8 > model.config.block_size:
            raise ValueError(
                f"--lengths {args.lengths[-1]} and the answer exceed the model's {model.config.block_size}"
            )
        keys = random.Random(args.seed)
        print("| tokens | depth | key | answer | found | prefill tok/s | peak memory GB | KV cache MB |")
        print("|---|---|---|---|---|---|---|---|")
        for length in args.lengths:
            for depth in args.depths:
                r = run_case(model, tokenizer, length, depth, keys.randrange(10000, 100000), args.device)
                print(
                    f"| {r['prompt_tokens']} | {depth:g} | {r['key']} | {r['answer'][:40]} | {r['found']} "
                    f"| {r['prefill_tokens_per_s']:.1f} | {r['peak_memory_gb']:.2f} | {r['kv_cache_mb']:.0f} |",
                    flush=True,
                )


if __name__ == "__main__":
    main()
