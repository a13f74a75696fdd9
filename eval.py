"""Perplexity of a checkpoint (floating-point or quantized) on a text, with a sliding window.

    python eval.py --checkpoint_path checkpoints/SmolLM2-135M-Instruct/model_int4.g32.pth
    python eval.py --checkpoint_path ... --text_file book.txt --max_tokens 8192 --json
    python eval.py --dtype bfloat16                  # the float weights in bfloat16 (as generate.py --dtype)

The default text is the documentation every Python installation carries (pydoc topics). The score
covers the text's last --max_tokens tokens (GPTQ calibrates on its first ones). Each window of
--window tokens scores only the tokens the previous window did not, so every scored token sees at
least window - stride tokens of context. --step_rows N feeds each window N tokens a step, through the KV
cache as decoding does: the products of few rows (decode, speculative verification) are scored instead of the
prefill's.
"""

import argparse
import json
import math
from pathlib import Path

import torch

from checkpoint import (
    DEFAULT_CHECKPOINT,
    DTYPES,
    KV_CACHE_DTYPES,
    KV_CACHE_HELP,
    HelpFormatter,
    device_flag,
    user_errors,
)
from generate import load_models
from kernels import MATVECS
from quantize import default_text
from tokenizer import read_text


@torch.no_grad()
def text_logprobs(model, tokens: list[int], window: int, stride: int, step_rows: int | None = None) -> list[float]:
    """The log-probability of each of tokens[1:] given those before it in its window (float64 log-softmax);
    step_rows: the tokens of a forward pass (default: a whole window)."""
    if not 0 < stride < window:  # a window must overlap the previous one: its first token has no context in it
        raise ValueError(f"need 0 < stride < window, got stride {stride} and window {window}")
    model.setup_caches(1, window)
    scores, scored_until = [], 1  # the first token has no prediction
    for start in range(0, len(tokens) - 1, stride):
        chunk = torch.tensor(tokens[start : start + window])
        step = step_rows or len(chunk)
        pieces = range(0, len(chunk), step)
        logits = torch.cat(
            [model(chunk[None, i : i + step], torch.arange(i, min(i + step, len(chunk))))[0] for i in pieces]
        )
        logprobs = torch.log_softmax(logits[:-1].double(), dim=-1)
        targets = chunk[1:]
        new = slice(scored_until - start - 1, None)  # positions whose target was not scored yet
        scores += logprobs[new].gather(-1, targets[new, None])[:, 0].tolist()
        scored_until = start + len(chunk)
        if scored_until >= len(tokens):
            break
    return scores


def perplexity(model, tokens: list[int], window: int, stride: int, step_rows: int | None = None) -> tuple[float, int]:
    """exp(mean negative log-likelihood) of tokens[1:], and how many were scored."""
    scores = text_logprobs(model, tokens, window, stride, step_rows)
    return math.exp(-sum(scores) / len(scores)), len(scores)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument("--checkpoint_path", type=Path, default=DEFAULT_CHECKPOINT, help="any model*.pth")
    parser.add_argument("--text_file", type=Path, help="text to score (default: Python's pydoc topics)")
    parser.add_argument("--max_tokens", type=int, default=4096, help="score the text's last N tokens")
    parser.add_argument("--window", type=int, default=1024, help="tokens per forward pass (capped by block_size)")
    parser.add_argument("--stride", type=int, default=None, help="tokens between window starts (default: window / 2)")
    parser.add_argument("--step_rows", type=int, default=None, help="tokens a forward pass (default: a window)")
    parser.add_argument("--device", type=device_flag, default="cpu", help="cpu, cuda or cuda:N")
    parser.add_argument("--dtype", choices=DTYPES, default="float32", help="the weights' and activations' dtype")
    parser.add_argument("--kv_cache_dtype", choices=KV_CACHE_DTYPES, default=None, help=KV_CACHE_HELP)
    parser.add_argument("--kernels", choices=MATVECS, default="auto", help="as generate.py's flag (eager)")
    parser.add_argument("--json", action="store_true", help='last line: {"perplexity": x, "tokens": n}')
    args = parser.parse_args(argv)
    if args.stride is None:
        args.stride = args.window // 2
    if args.max_tokens < 2 or args.window < 2 or not 0 < args.stride < args.window:
        parser.error("need --max_tokens >= 2, --window >= 2 and 0 < --stride < --window")
    if args.step_rows is not None and args.step_rows < 1:
        parser.error("need --step_rows >= 1")
    return args


def main(argv=None):
    args = parse_args(argv)
    with user_errors():
        text = read_text(args.text_file) if args.text_file else default_text()
        model, tokenizer, _ = load_models(
            args.checkpoint_path, args.device, args.dtype, matvec=args.kernels, kv_cache_dtype=args.kv_cache_dtype
        )
        tokens = tokenizer.encode(text)[-args.max_tokens :]
        if len(tokens) < 2:
            raise ValueError(f"{args.text_file or 'the text'}: fewer than 2 tokens")
        window = min(args.window, model.config.block_size)
        ppl, counted = perplexity(model, tokens, window, min(args.stride, window - 1), args.step_rows)
        print(f"perplexity {ppl:.4f} over {counted} tokens ({args.checkpoint_path})")
        if args.json:
            print(json.dumps({"perplexity": ppl, "tokens": counted}))


if __name__ == "__main__":
    main()
