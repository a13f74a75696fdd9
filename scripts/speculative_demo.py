"""Speculative decoding with a real draft and target, side by side with the target alone, in one run.

    python scripts/speculative_demo.py --compile \\
        --target checkpoints/Qwen2.5-Coder-1.5B-Instruct/model_int4-gguf.g32.pth \\
        --draft checkpoints/Qwen2.5-Coder-0.5B-Instruct/model_int4-gguf.g32.pth

Each prompt (a chat turn when the target has a chat template) is decoded greedily by the target alone and
with the draft proposing --speculate_k tokens a round. For each it prints the text, tokens/s of both, the
draft's acceptance rate, the tokens each target forward yields and the speed-up; then the totals. The two
texts are the same at temperature 0 (the output says so, or where they part: the verify step scores k + 1
tokens at once and so rounds differently from one-token steps, which can flip a near-tie). The first prompt
runs once beforehand to compile and warm up.
"""

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from checkpoint import DEFAULT_DEVICE, DTYPES, HelpFormatter, device_flag, user_errors  # noqa: E402
from decode import compile_steps, ensure_caches  # noqa: E402
from generate import generate, load_models  # noqa: E402

PROMPTS = [
    "Write a Python function that checks whether a string is a palindrome.",
    "Write a Python function that returns the n-th Fibonacci number, iteratively.",
    "Explain what a Python list comprehension is, with an example.",
    "Write a bash one-liner that counts the lines of every .py file under the current folder.",
]


def run_pair(target, draft, prompt: list[int], max_new_tokens: int, k: int, steps, eos_ids) -> tuple:
    plain = generate(target, prompt, max_new_tokens, eos_ids=eos_ids, steps=steps)
    start = time.perf_counter()
    fast = generate(target, prompt, max_new_tokens, eos_ids=eos_ids, steps=steps, draft_model=draft, speculate_k=k)
    fast_time = time.perf_counter() - start
    return plain, fast, fast_time


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument("--target", type=Path, required=True, help="the target checkpoint (any model*.pth)")
    parser.add_argument("--draft", type=Path, required=True, help="the draft checkpoint; same tokenizer as the target")
    parser.add_argument("--prompt", action="append", help="a prompt (several allowed; default: four coding requests)")
    parser.add_argument("--max_new_tokens", type=int, default=128, help="tokens to generate at most, per prompt")
    parser.add_argument("--speculate_k", type=int, default=4, help="tokens the draft proposes a round")
    parser.add_argument("--compile", action="store_true", help="torch.compile the decode, draft and verify steps")
    parser.add_argument("--dtype", choices=DTYPES, default=None, help="floating-point dtype (default: float32 on CPU)")
    parser.add_argument("--device", type=device_flag, default=DEFAULT_DEVICE)
    parser.add_argument("--raw", action="store_true", help="send the prompts as plain text, not as chat turns")
    args = parser.parse_args(argv)
    for name in ("max_new_tokens", "speculate_k"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be >= 1")
    return args


def main(argv=None):
    args = parse_args(argv)
    with user_errors():
        device = args.device
        target, tokenizer, draft = load_models(
            args.target, device, args.dtype, args.compile, draft_checkpoint_path=args.draft
        )
        texts = args.prompt or PROMPTS
        chat = tokenizer.chat_template and not args.raw
        prompts = [
            tokenizer.encode_chat([{"role": "user", "content": t}]) if chat else tokenizer.encode(t) for t in texts
        ]
        for m in (target, draft):  # one cache size for every run: nothing recompiles
            ensure_caches(m, 1, max(map(len, prompts)), args.max_new_tokens + args.speculate_k + 1)
        steps = compile_steps(device, args.compile)
        settings = (args.max_new_tokens, args.speculate_k, steps, tokenizer.eos_ids)
        start = time.perf_counter()
        run_pair(target, draft, prompts[0], *settings)  # compiles (with --compile) and warms up
        print(
            f"target {args.target}, draft {args.draft}, k={args.speculate_k}, "
            f"{'compiled' if args.compile else 'eager'}, "
            f"{target.tok_embeddings.weight.dtype}, warm-up {time.perf_counter() - start:.1f} s\n"
        )
        rows = []  # per prompt: (tokens, seconds alone, seconds speculative, accepted-length histogram)
        for text, prompt in zip(texts, prompts):
            plain, fast, fast_time = run_pair(target, draft, prompt, *settings)
            n, plain_time = len(plain.tokens[0]), plain.time_to_first_token_s + plain.decode_time_s
            rows.append((n, plain_time, fast_time, fast.speculation["accepted_length_histogram"]))
            print(f"--- {text!r}\n{tokenizer.decode(plain.tokens[0]).strip()}\n")
            same = (
                "the same tokens"
                if fast.tokens == plain.tokens
                else next(
                    f"TOKENS DIFFER from token {i} (a near-tie that the two step shapes round differently?)"
                    for i, (a, b) in enumerate(zip(fast.tokens[0] + [None], plain.tokens[0] + [None]))
                    if a != b
                )
            )
            print(f"    {summary(*rows[-1])}; speculative and alone: {same}\n")
        totals = [sum(column) for column in zip(*[row[:3] for row in rows])]
        print(f"all prompts: {summary(*totals, [sum(h) for h in zip(*[row[3] for row in rows])])}")


def summary(tokens: int, plain_time: float, fast_time: float, histogram: list[int]) -> str:
    rounds, kept = sum(histogram), sum(i * count for i, count in enumerate(histogram))
    k = len(histogram) - 1
    return (
        f"{tokens} tokens: target alone {tokens / plain_time:.2f} tok/s, speculative {tokens / fast_time:.2f} tok/s "
        f"(x{plain_time / fast_time:.2f}); acceptance {kept / max(rounds * k, 1):.0%}, "
        f"{(kept + rounds) / max(rounds, 1):.2f} tokens per target forward"
    )


if __name__ == "__main__":
    main()
