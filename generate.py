"""Generate text with a checkpoint of ours.

    python generate.py --prompt "The capital of France is" --max_new_tokens 64
    python generate.py --prompt "Once upon a time" --prompt "def fib(n):" --temperature 0 --json
    python generate.py --checkpoint_path checkpoints/NAME/model.pth --compile --temperature 0.8 --top_p 0.95
    python generate.py --interactive            # a conversation kept in the KV cache

generate() continues a batch of prompts, speculative_generate() one prompt with a draft model; both run the steps
of decode.py (eager, or compiled by compile_steps). The host looks at the tokens only to stream them or, every few
steps, to check whether every row is done. load_models() loads what every script runs.
"""

import argparse
import contextlib
import functools
import json
import math
import sys
import time
from dataclasses import asdict, fields
from pathlib import Path

import torch
from torch import Tensor

import tp
from chat import Chat, chat_loop
from checkpoint import (
    DEFAULT_CHECKPOINT,
    DEFAULT_DEVICE,
    DTYPES,
    KV_CACHE_DTYPES,
    KV_CACHE_HELP,
    HelpFormatter,
    device_flag,
    load_checkpoint,
    prompt_lines,
    resolve_checkpoint,
    user_errors,
    utf8_text,
)
from decode import (
    Steps,
    Stream,
    attention_window,
    check_prompts,
    check_speculation,
    compile_steps,
    draft_and_verify,
    ensure_caches,
    fill_cache,
    inductor_cache_dir,
    plain_steps,
    prompt_head,
    token_steps,
)
from kernels import MATVECS, Kernels, in_huge_pages, set_kernels
from model import Transformer
from quantize import load_checkpoint_model, prepare_quantized
from results import Generation, Speculation, check_stop, collect, find_stop, summarize, synchronize
from sampling import (
    SamplingParams,
    accept_drafts,
    check_logprobs,
    check_seed,
    draw_exponential_,
    refill_noise,
    sampler_state,
)
from speculate import (
    Acceptance,
    NgramIndex,
    Probes,
    check_round_costs,
    choose_depth,
    depth_choices,
    draft_depth,
    lookup_drafts,
    measure_round_costs,
    plain_rounds,
)
from tokenizer import Tokenizer, load_tokenizer

CHECK_INTERVAL = 8  # decode steps between host checks for finished rows (EOS, stop strings)


@torch.no_grad()
def generate(
    model: Transformer,
    prompts,
    max_new_tokens: int,
    *,
    sampling: SamplingParams = SamplingParams(),
    eos_ids=(),
    stop=(),
    tokenizer: Tokenizer | None = None,
    batch_size: int = 1,
    pad_id: int = 0,
    draft_model: Transformer | None = None,
    ngram: bool = False,
    speculate_k: int = 4,
    round_costs: dict[int, float] | None = None,
    steps: Steps = Steps(),
) -> Generation:
    """Continues each prompt (token ids; one prompt or a list, each repeated batch_size times) in one batch.

    Every row stops at its first EOS or stop string (matched on decoded text, which needs tokenizer)
    or after max_new_tokens. With a draft_model, or with ngram (prompt lookup: drafts from the context), decoding
    is speculative (batch 1), up to speculate_k drafted tokens a round (speculative_generate; round_costs: its)."""
    rows = check_prompts(prompts) * batch_size
    stop = check_stop(stop, tokenizer)
    if draft_model is not None and ngram:
        raise ValueError("speculative decoding drafts with a draft model or by prompt lookup (ngram), not both")
    if draft_model is not None or ngram:
        if len(rows) != 1:
            raise ValueError(f"speculative decoding takes one prompt at a time, got a batch of {len(rows)}")
        ends = {"eos_ids": eos_ids, "stop": stop, "tokenizer": tokenizer}
        return speculative_generate(
            model,
            draft_model,
            rows[0],
            max_new_tokens,
            sampling,
            speculate_k,
            **ends,
            steps=steps,
            round_costs=round_costs,
        )
    device = model.tok_embeddings.weight.device
    eos = torch.tensor(list(eos_ids), dtype=torch.long, device=device)
    produced = token_steps(model, rows, max_new_tokens, sampling, steps, pad_id=pad_id)

    synchronize(device)
    start = time.perf_counter()
    tokens, logprobs = [], []
    finished = torch.zeros(len(rows), dtype=torch.bool, device=device)
    for step, (token, lp) in enumerate(produced, start=1):
        if step == 1:
            synchronize(device)
            ttft = time.perf_counter() - start
        tokens.append(token)
        logprobs.append(lp)
        finished |= torch.isin(token[:, 0], eos)
        if step % CHECK_INTERVAL == 0 and all_finished(tokens, finished, stop, tokenizer):
            break
    raw = torch.cat(tokens, dim=1).tolist()
    decode_time = time.perf_counter() - start - ttft
    return collect(raw, logprobs, rows, eos_ids, stop, tokenizer, ttft, decode_time)


def all_finished(tokens: list[Tensor], finished: Tensor, stop: list[str], tokenizer: Tokenizer | None) -> bool:
    """Whether every row is done: finished [B] (at an EOS so far), or, with stop strings, its text holds one
    (then marked in finished)."""
    if stop:
        so_far = torch.cat(tokens, dim=1).tolist()
        finished |= torch.tensor(
            [find_stop(tokenizer.decode(row), stop) >= 0 for row in so_far], device=finished.device
        )
    return bool(finished.all())


@torch.no_grad()
def speculative_generate(
    model,
    draft,
    prompt: list[int],
    max_new_tokens: int,
    params: SamplingParams,
    k: int,
    *,
    eos_ids=(),
    stop=(),
    tokenizer=None,
    steps: Steps = Steps(),
    round_costs: dict[int, float] | None = None,
) -> Generation:
    """Generates from the target, each round verifying up to k drafted tokens: the draft model's, or with draft
    None prompt lookup's (speculate.NgramIndex). speculate.choose_depth picks each round's depth (0: a plain decode
    step) from round_costs, the seconds of a round at each depth of speculate.depth_choices(k) (None: measured here,
    after the prefill), and a draft model it keeps off is probed now and then (speculate.Probes); a proposal shorter
    than the depth is padded. The output distribution is exactly the target's (greedy: its greedy tokens, but where
    a near-tie rounds differently in the verify pass). One host sync per round."""
    check_speculation(model, draft, params, k)
    device, greedy, vocab_size = model.tok_embeddings.weight.device, params.greedy, model.config.vocab_size
    models = (model,) if draft is None else (model, draft)
    for m in models:  # verification writes up to k positions past the last kept token
        ensure_caches(m, 1, len(prompt), max_new_tokens + k + 1, overrun=k)
    max_seq_length = min(m.max_seq_length for m in models)
    s_target, s_draft = (sampler_state(params, [prompt], vocab_size, device) for _ in range(2))
    generator = params.generator(device)
    draft_noise = functools.partial(refill_noise, s_draft, params, generator)
    x, no_pad = torch.tensor([prompt], device=device), torch.zeros(1, dtype=torch.long, device=device)
    eos, stats = set(eos_ids), Speculation(k)

    synchronize(device)
    start = time.perf_counter()
    refill_noise(s_target, params, generator)
    head = prompt_head(len(prompt))
    fill_cache(model, x[:, :head], 0)
    positions = torch.arange(head, len(prompt), device=device)
    first, _ = steps.prefill(model, x[:, head:], positions, no_pad, s_target, greedy, None, kv_length=len(prompt))
    tokens = prompt + [int(first)]  # position i holds tokens[i]; the last is the current token, in no cache yet
    draft_cached = 0  # the positions the draft's cache holds (it catches up before it drafts)
    if draft is not None:  # the draft reads the prompt as part of the prefill: its first round may come at once
        draft_cached = catch_up(draft, tokens, draft_cached)
    ttft = time.perf_counter() - start  # the prefill of both models
    index = NgramIndex(tokens) if draft is None else None
    measuring = time.perf_counter()
    if round_costs is None:
        run_round = functools.partial(time_round, model, draft, steps, tokens, s_target, s_draft, greedy)
        round_costs = tp.agreed(measure_round_costs(run_round, depth_choices(k)))
    start += time.perf_counter() - measuring  # not decoding
    check_round_costs(round_costs)
    acceptance, probes = Acceptance(), Probes()
    while (
        len(tokens) - len(prompt) < max_new_tokens
        and tokens[-1] not in eos
        and not stopped(tokens, prompt, stop, tokenizer)
    ):
        pos, cur = len(tokens) - 1, torch.tensor([tokens[-1:]], device=device)
        proposal = index.propose(k) if index is not None else []
        if draft is None:
            depth = choose_depth(round_costs, [(acceptance, len(proposal))])
        else:
            depth = draft_depth(round_costs, [(acceptance, probes)], k)
        if depth == 0:
            # A draft model's plain rounds observe nothing, so the controller's next choices are known already: the
            # plain rounds in a row run chained on the device, with a host sync every CHECK_INTERVAL as in plain
            # decoding, not one a round (a GPU idles during each).
            left = min(max_new_tokens - (len(tokens) - len(prompt)), CHECK_INTERVAL)
            rounds = 1 if draft is None else plain_rounds(round_costs, acceptance, k, min(left, probes.wait))
            made = plain_steps(model, steps, cur, pos, rounds, s_target, params, generator, max_seq_length)
            emitted = through_eos(made[0].tolist(), eos)  # the rounds' one sync
            kept, drafts = 0, 0
            if draft is not None:  # no evidence: what was seen fades, and speculation is tried again in time
                for _ in emitted:
                    acceptance.record(0, 0)
                probes.plain(len(emitted))
            elif proposal:  # a proposal not taken is still checked, so that its acceptance follows the text
                acceptance.record(int(proposal[0] == emitted[0]), 1)
            for _ in emitted[1:]:  # the run's rounds but the last, which is recorded below
                stats.record(0, 0)
        else:
            window = attention_window(pos + depth, max_seq_length, device)  # writes to pos + depth
            if draft is None:
                drafted, p, lengths = lookup_drafts([proposal], depth, vocab_size, device)
                verify_at = pos + torch.arange(depth + 1, device=device)
                q = steps.verify(model, torch.cat([cur, drafted], dim=1), verify_at, s_target, greedy, window)
            else:
                draft_cached, inputs = catch_up(draft, tokens, draft_cached), draft_input(tokens, device)
                drafted, p, q = draft_and_verify(
                    model, draft, steps, depth, cur, inputs, s_target, s_draft, greedy, draft_noise, window
                )
                lengths = None
            if greedy:  # q is one-hot: a draft is kept where it agrees, and the next token is q's
                uniforms, noise = torch.zeros(1, depth, device=device), torch.ones(1, vocab_size, device=device)
            else:
                uniforms = torch.rand(1, depth, device=device, generator=generator)
                noise = draw_exponential_(torch.empty(1, vocab_size, device=device), generator)
            n_kept, next_token = accept_drafts(drafted, p, q, uniforms, noise, lengths)
            host = torch.cat([n_kept, next_token, drafted[0]]).tolist()  # the round's one sync
            kept, drafts = host[0], depth if draft is not None else min(depth, len(proposal))
            emitted = through_eos(host[2 : 2 + kept] + [host[1]], eos)
            acceptance.record(kept, kept + (kept < drafts))
            if draft is not None:  # it read the current token and every draft but the last
                draft_cached = pos + min(kept + 1, depth)
        stats.record(kept, drafts)
        tokens += emitted
        if index is not None:
            index.extend(emitted)
    raw = tokens[len(prompt) :][:max_new_tokens]
    result = collect([raw], [None], [prompt], eos_ids, list(stop), tokenizer, ttft, time.perf_counter() - start - ttft)
    result.speculation = stats.summary() | {
        "draft": "prompt lookup" if draft is None else "model",
        "round_costs_s": round_costs,
    }
    return result


def through_eos(tokens: list[int], eos: set[int]) -> list[int]:
    """tokens up to the first EOS among them, which ends the sequence (a round's kept drafts may hold one)."""
    return tokens[: next((i + 1 for i, t in enumerate(tokens) if t in eos), len(tokens))]


def stopped(tokens: list[int], prompt: list[int], stop: list[str], tokenizer) -> bool:
    return bool(stop) and find_stop(tokenizer.decode(tokens[len(prompt) :]), stop) >= 0


def catch_up(draft, tokens: list[int], cached: int) -> int:
    """Feeds the draft, eagerly from position cached (decode.fill_cache), the tokens its cache lacks but the last two
    (the prompt, or what plain rounds made), which a round's first draft step reads (draft_input). Returns the
    positions its cache holds."""
    pos, device = len(tokens) - 1, draft.tok_embeddings.weight.device
    if pos - 1 <= cached:
        return cached
    fill_cache(draft, torch.tensor([tokens[cached : pos - 1]], device=device), cached)
    return pos - 1


def draft_input(tokens: list[int], device: torch.device) -> tuple[Tensor, Tensor]:
    """What a round's first draft step reads: the token before the current one and the current one [1, 2], at their
    positions [2]. The draft's cache lacks the first after a round that kept every draft (it never read the last);
    otherwise the step writes its keys and values again, the same."""
    pos = len(tokens) - 1
    return torch.tensor([tokens[pos - 1 :]], device=device), torch.arange(pos - 1, pos + 1, device=device)


def time_round(model, draft, steps: Steps, tokens: list[int], s_target, s_draft, greedy: bool, depth: int):
    """A round of depth at the current token's position (speculate.measure_round_costs), its drafts the current
    token repeated; waits for it. What it computes is dropped: each position it writes is written again before a
    later round reads it. It draws no noise, so that a seeded run samples the same with costs measured or given."""
    device = model.tok_embeddings.weight.device
    pos, cur = len(tokens) - 1, torch.tensor([tokens[-1:]], device=device)
    at = torch.tensor([pos], device=device)
    max_seq_length = min(m.max_seq_length for m in (model, draft) if m is not None)
    window = attention_window(pos + depth, max_seq_length, device)
    if depth == 0:
        steps.decode(model, cur, at, torch.zeros_like(at), s_target, greedy, None, window)
    elif draft is None:
        steps.verify(
            model, cur.repeat(1, depth + 1), pos + torch.arange(depth + 1, device=device), s_target, greedy, window
        )
    else:
        inputs = draft_input(tokens, device)
        draft_and_verify(model, draft, steps, depth, cur, inputs, s_target, s_draft, greedy, lambda: None, window)
    synchronize(device)  # the outputs stay on the device: reading the distributions back would be timed too


# ---------------------------------------------------------------- loading


def load_model(
    checkpoint_path: str | Path,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    shard=None,
    kernels: Kernels = Kernels(),
):
    """Builds the model on the meta device and assigns the memory-mapped weights. With a tensor-parallel shard
    (tp.Shard), keeps this rank's slice only, before moving it to the device. kernels: how a CPU runs the linear
    layers (Kernels.choose picks the fastest for a run); where they say so, the weights are then copied once into
    huge pages (in_huge_pages)."""
    model, quantization = load_checkpoint_model(resolve_checkpoint(checkpoint_path))
    if shard is not None:
        tp.check_divisible(model.config, shard.world_size, quantization)
        tp.apply_tp(model, shard)
    model = model.to(device=device, dtype=dtype).eval()
    set_kernels(model, kernels)
    if quantization is not None:
        prepare_quantized(model)
    if kernels.huge_pages:
        in_huge_pages(model)
    return model


def default_dtype(device: torch.device) -> torch.dtype:
    """The float dtype of a model loaded without one named: bfloat16 on CUDA, float32 on a CPU (most CPUs have no
    native bfloat16 matrix products)."""
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def load_models(
    checkpoint_path: str | Path,
    device: torch.device,
    dtype_name: str | None = None,
    compiled: bool = False,
    matvec: str = "auto",
    draft_checkpoint_path: str | Path | None = None,
    shard=None,
    rows: int = 1,
    kv_cache_dtype: str | None = None,
) -> tuple[Transformer, Tokenizer, Transformer | None]:
    """What every script runs: the model, its tokenizer, and the draft model (None without one), checked to share
    the tokenizer. dtype_name: a key of checkpoint.DTYPES, None for default_dtype(device); the CPU kernels are
    Kernels.choose(device, compiled, matvec, quantized, rows, half), quantized when either checkpoint is, half for a
    bfloat16/float16 dtype, rows the most a decode step computes (batch rows, times the positions a speculative round
    verifies). kv_cache_dtype: a key of checkpoint.KV_CACHE_DTYPES, how the KV caches store keys and values ("int8":
    quantized; model.KVCache), None for the model's dtype."""
    paths = [p for p in (checkpoint_path, draft_checkpoint_path) if p is not None]
    quantized = any(load_checkpoint(resolve_checkpoint(p))[1] is not None for p in paths)  # memory-mapped: cheap
    dtype = DTYPES[dtype_name] if dtype_name else default_dtype(device)
    half = dtype in (torch.bfloat16, torch.float16)
    kernels = Kernels.choose(device, compiled, matvec, quantized, rows, half)
    model = load_model(checkpoint_path, device, dtype, shard, kernels)
    tokenizer = load_tokenizer(resolve_checkpoint(checkpoint_path).parent)
    draft = None
    if draft_checkpoint_path is not None:
        draft = load_model(draft_checkpoint_path, device, dtype, shard, kernels)
        check_draft_tokenizer(tokenizer, draft_checkpoint_path)
    for m in (model, draft) if draft is not None else (model,):
        m.kv_cache_dtype = KV_CACHE_DTYPES[kv_cache_dtype] if kv_cache_dtype is not None else None
    return model, tokenizer, draft


def check_draft_tokenizer(tokenizer: Tokenizer, draft_checkpoint_path: Path):
    draft_tokenizer = load_tokenizer(resolve_checkpoint(draft_checkpoint_path).parent)
    probe = "Tokenizer check: ünïcödé, 12345, emoji 🙂."
    if draft_tokenizer.encode(probe) != tokenizer.encode(probe) or draft_tokenizer.eos_ids != tokenizer.eos_ids:
        raise ValueError(f"the draft {draft_checkpoint_path} does not use the target's tokenizer")


# ---------------------------------------------------------------- command line


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    arg = p.add_argument
    arg(
        "--prompt",
        action="append",
        type=utf8_text,
        help="text to continue; several --prompt make one batch; none: the text piped to stdin, "
        'else "Hello, my name is"',
    )
    arg(
        "--prompts_file", type=prompt_lines, help="a text file, one prompt a line, all in one batch (with any --prompt)"
    )
    arg("--interactive", action="store_true", help="a conversation on stdin (chat template if any)")
    arg("--chat", action="store_true", help="answer each prompt as a user's message, in the chat template")
    arg("--system", default=None, type=utf8_text, help="system message for --interactive and --chat")
    arg("--num_samples", type=int, default=1, help="number of runs")
    arg("--max_new_tokens", type=int, default=200, help="tokens to generate at most, per row")
    arg("--batch_size", type=int, default=1, help="rows generated from each prompt")
    arg("--stop", action="append", default=[], type=utf8_text, help="stop string (may be given several times)")
    arg("--temperature", type=float, default=0.8, help="0 means greedy (the Python API's default)")
    arg("--top_k", type=int, default=200, help="keep the k most likely tokens, 0: all")
    arg("--top_p", type=float, default=1.0, help="nucleus sampling threshold, 1: off")
    arg("--min_p", type=float, default=0.0, help="drop tokens below min_p x the top probability, 0: off")
    arg("--repetition_penalty", type=float, default=1.0, help="> 1 discourages repeats, 1: off")
    arg("--presence_penalty", type=float, default=0.0, help="OpenAI presence penalty, 0: off")
    arg("--frequency_penalty", type=float, default=0.0, help="OpenAI frequency penalty, 0: off")
    arg("--logprobs", type=int, default=None, help="report log-probs of chosen tokens and N alternatives")
    arg("--seed", type=int, default=None, help="random seed, for repeatable sampling")
    arg("--checkpoint_path", type=Path, default=DEFAULT_CHECKPOINT, help="model.pth, or its folder")
    arg("--draft_checkpoint_path", type=Path, default=None, help="draft model: speculative decoding")
    arg(
        "--ngram",
        action="store_true",
        help="speculative decoding with drafts from the context itself (prompt lookup): no draft model",
    )
    arg("--speculate_k", type=int, default=4, help="tokens drafted per round at most (a controller picks how many)")
    arg("--device", type=device_flag, default=DEFAULT_DEVICE, help="cpu, cuda, cuda:1, ...")
    arg("--dtype", choices=DTYPES, default=None, help="default: bfloat16 on CUDA, float32 on CPU")
    arg("--kv_cache_dtype", choices=KV_CACHE_DTYPES, default=None, help=KV_CACHE_HELP)
    arg("--compile", action="store_true", help="torch.compile the decode step")
    arg("--compile_prefill", action="store_true", help="torch.compile the prefill too (dynamic shapes)")
    arg(
        "--kernels",
        choices=MATVECS,
        default="auto",
        help="CPU products of few rows (linear layers; a decode step's attention): auto (the fastest measured for "
        "this CPU and --compile: int8/int4 by "
        "kernels_cpu.cpp, built on first use, where it builds), fused (float32 multiply-and-sum, for compiled steps), "
        "library (BLAS, ATen's int8/int4 kernels) or native (auto, failing if kernels_cpu.cpp does not build)",
    )
    arg("--profile", type=Path, default=None, help="write a torch.profiler trace (.json) of the last run")
    arg("--json", action="store_true", help="print one JSON object of outputs and figures as last line")
    arg(
        "--tp_timeout_s",
        type=float,
        default=tp.DEFAULT_TIMEOUT_S,
        help="under torchrun: seconds a rank waits for the others before it gives up",
    )
    return p


def parse_args(argv=None) -> argparse.Namespace:
    p = parser()
    args = p.parse_args(argv)
    for name in ("num_samples", "max_new_tokens", "batch_size", "speculate_k"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be >= 1")
    if not (math.isfinite(args.tp_timeout_s) and args.tp_timeout_s > 0):
        p.error("--tp_timeout_s must be a finite number > 0")
    if args.profile is not None and not args.profile.parent.is_dir():
        p.error(f"--profile {args.profile}: there is no folder {args.profile.parent}")
    try:
        sampling_params(args)
        check_seed(args.seed)
    except ValueError as e:
        p.error(str(e))
    if "" in args.stop:
        p.error("a stop string is empty")
    if args.chat and args.interactive:
        p.error("--chat answers --prompt once; --interactive is a conversation on stdin: choose one")
    if args.ngram and args.draft_checkpoint_path is not None:
        p.error("--ngram drafts from the context, --draft_checkpoint_path with a draft model: choose one")
    return args


def sampling_params(args) -> SamplingParams:
    """The sampling flags, named as SamplingParams' fields (--seed seeds torch's generator for all the runs)."""
    return SamplingParams(**{f.name: getattr(args, f.name) for f in fields(SamplingParams) if f.name != "seed"})


def run(args, device: torch.device, shard=None):
    piped = None if args.interactive or args.prompt or args.prompts_file else piped_text(shard)  # before loading
    texts = (args.prompt or []) + (args.prompts_file or []) or [piped or "Hello, my name is"]
    speculative = args.draft_checkpoint_path is not None or args.ngram
    rows = args.speculate_k + 1 if speculative else len(texts) * args.batch_size  # a step's at most
    start = time.perf_counter()
    model, tokenizer, draft = load_models(
        args.checkpoint_path,
        device,
        args.dtype,
        args.compile,
        args.kernels,
        args.draft_checkpoint_path,
        shard,
        rows,
        args.kv_cache_dtype,
    )
    print(f"Loaded {args.checkpoint_path} in {time.perf_counter() - start:.2f} s", file=sys.stderr)
    sampling = sampling_params(args)
    check_logprobs(sampling, model.config.vocab_size)
    seed = tp.shared_seed(args.seed, shard)
    if seed is not None:
        torch.manual_seed(seed)
    steps = compile_steps(device, args.compile, args.compile_prefill)  # each compiles lazily, on first use
    if args.interactive:
        if speculative:
            raise ValueError("--interactive does not take a draft model or --ngram")
        chat = Chat(
            model,
            tokenizer,
            system=args.system,
            max_new_tokens=args.max_new_tokens,
            sampling=sampling,
            stop=args.stop,
            steps=steps,
        )
        return chat_loop(chat, tp.line_reader(shard), print_piece)

    prompts = check_prompts([encode_prompt(tokenizer, text, args) for text in texts])
    if speculative and (len(prompts) > 1 or args.batch_size > 1):
        raise ValueError("speculative decoding takes one prompt and --batch_size 1")
    once = functools.partial(generate_once, args, model, tokenizer, prompts, sampling, steps, draft)
    # Caches sized once for every run below (speculation writes k + 1 positions ahead), so nothing recompiles.
    ahead, rows = args.speculate_k + 1 if speculative else 0, len(prompts) * args.batch_size
    for m in (model, draft) if draft is not None else (model,):
        ensure_caches(m, rows, max(map(len, prompts)), args.max_new_tokens + ahead, overrun=args.speculate_k)
    compile_time, round_costs = None, None
    if args.compile or args.compile_prefill:
        compile_time, round_costs = warm_up(once, speculative, args.max_new_tokens)
    streamed, rank0 = streams(args, prompts, speculative), shard is None or shard.rank == 0
    results = []
    for i in range(args.num_samples):
        profile = args.profile if i == args.num_samples - 1 and rank0 else None
        results.append(sample_run(args, once, texts, streamed, profile, round_costs))
        round_costs = round_costs or measured_costs(results[-1])  # the first run's, where no warm-up measured them
    stats = summarize(results, model, device, compile_time)
    if compile_time is not None:
        stats["inductor_cache_dir"] = str(inductor_cache_dir())
    if speculative:  # the same prompt without speculation, for comparison
        plain = summarize([once(args.max_new_tokens, plain=True)], model, device, None)
        stats["speculation"] = results[-1].speculation
        stats["plain_decode_tokens_per_s"] = plain["decode_tokens_per_s"]
        stats["speedup_over_plain_decoding"] = stats["decode_tokens_per_s"] / plain["decode_tokens_per_s"]
    report(results, stats, shard, args.json, args.logprobs is not None)


print_piece = functools.partial(print, end="", flush=True)


def encode_prompt(tokenizer: Tokenizer, text: str, args) -> list[int]:
    """A prompt's tokens: its text, or with --chat a user's message (after --system's) in the chat template."""
    if not args.chat:
        return tokenizer.encode(text)
    if tokenizer.chat_template is None:
        raise ValueError(f"--chat: {args.checkpoint_path} has no chat template")
    system = [{"role": "system", "content": args.system}] if args.system is not None else []
    return tokenizer.encode_chat(system + [{"role": "user", "content": text}])


def streams(args, prompts: list[list[int]], speculative: bool) -> bool:
    """Whether a run streams its text as it comes: one prompt, one row, no speculation."""
    return len(prompts) == 1 and args.batch_size == 1 and not speculative


def measured_costs(result: Generation) -> dict[int, float] | None:
    return None if result.speculation is None else result.speculation["round_costs_s"]


def generate_once(
    args,
    model,
    tokenizer,
    prompts,
    sampling,
    steps,
    draft,
    max_new_tokens,
    on_piece=None,
    plain=False,
    round_costs=None,
):
    """One generation of the command line's prompts: speculative with the draft (if not None) or --ngram, unless
    plain; round_costs: speculative_generate's."""
    speculative = not plain and (draft is not None or args.ngram)
    if streams(args, prompts, speculative):
        stream = Stream(model, tokenizer, prompts[0], max_new_tokens, sampling=sampling, stop=args.stop, steps=steps)
        return stream.run(on_piece)
    return generate(
        model,
        prompts,
        max_new_tokens,
        sampling=sampling,
        stop=args.stop,
        batch_size=args.batch_size,
        tokenizer=tokenizer,
        eos_ids=tokenizer.eos_ids,
        draft_model=None if plain else draft,
        ngram=args.ngram and not plain,
        speculate_k=args.speculate_k,
        round_costs=round_costs,
        steps=steps,
    )


def sample_run(args, once, texts: list[str], streamed: bool, profile: Path | None, round_costs) -> Generation:
    """One of --num_samples runs, its text printed (streamed, or per row at the end) after its prompt (not a
    --chat message); with profile, its trace."""
    shown = ["" if args.chat else text for text in texts]
    if streamed:
        print_piece(shown[0])
    with torch.profiler.profile() if profile else contextlib.nullcontext() as profiler:
        result = once(args.max_new_tokens, print_piece, round_costs=round_costs)
    if profile:
        profiler.export_chrome_trace(str(profile))
    if streamed:
        print(flush=True)
    else:
        for b, text in enumerate(result.texts):
            print(f"[{b}] {shown[b % len(texts)]}{text}\n", flush=True)
    return result


def piped_text(shard) -> str | None:
    """What was piped to stdin (echo "text" | generate.py ...), without its last newline: None from a terminal
    or an empty pipe. Under torchrun rank 0 reads it and passes it to the others."""
    data = None
    if sys.stdin is not None and not sys.stdin.isatty() and (shard is None or shard.rank == 0):
        try:
            data = sys.stdin.buffer.read()
        except OSError:  # a closed or unreadable stdin (pytest's, when main() runs in a test) has no text
            data = None
    data = tp.from_rank0(data) if shard is not None else data
    try:
        return data.decode("utf-8").removesuffix("\n") if data else None
    except UnicodeDecodeError as e:
        raise ValueError(f"stdin is not valid UTF-8 (byte {e.start})") from None


def warm_up(once, speculative: bool, max_new_tokens: int) -> tuple[float, dict[int, float] | None]:
    """Runs the compiled steps once (they compile), and the plain decode step too when speculation is compared
    with it; returns the seconds it took, and a speculative run's round costs (measured on the way)."""
    start = time.perf_counter()
    warm = once(min(max_new_tokens, 2 * CHECK_INTERVAL))
    if speculative:
        once(min(max_new_tokens, 2 * CHECK_INTERVAL), plain=True)
    elapsed = time.perf_counter() - start
    print(f"Compilation and warm-up: {elapsed:.1f} s", file=sys.stderr)
    return elapsed, measured_costs(warm)


def report(results: list[Generation], stats: dict, shard, as_json: bool, with_logprobs: bool):
    """The figures on stderr, and with as_json one JSON object of outputs and figures as stdout's last line."""
    if shard is not None:  # the figures are rank 0's, but for memory: a rank's use depends on its slice
        stats["tensor_parallel_ranks"] = shard.world_size
        stats["peak_memory_gb_per_rank"] = tp.gather_objects(stats.pop("peak_memory_gb"))
    for key, value in stats.items():
        print(f"{key}: {value:.4g}" if isinstance(value, float) else f"{key}: {value}", file=sys.stderr)
    if as_json:
        output = {
            "outputs": [text for r in results for text in r.texts],
            "tokens": [row for r in results for row in r.tokens],
            "finish_reasons": [reason for r in results for reason in r.finish_reasons],
            "stats": stats,
        }
        if with_logprobs:
            output["logprobs"] = [[asdict(e) for e in row] for r in results for row in r.logprobs]
        print(json.dumps(output))


def main(argv=None):
    with tp.rank0_prints(), user_errors(tp.quiet_rank()):
        args = parse_args(argv)
        shard, device = tp.maybe_init_dist(args.device, args.tp_timeout_s)
        with tp.rank_failures(shard):
            run(args, device, shard)
            if shard is not None:
                tp.end_rank()


if __name__ == "__main__":
    main()
