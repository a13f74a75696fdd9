"""An OpenAI-compatible server, with continuous batching and a chat page.

    python server.py --checkpoint_path checkpoints/SmolLM2-135M-Instruct/model.pth --compile
    open http://127.0.0.1:8000/ (the chat page), or point any OpenAI client at http://127.0.0.1:8000/v1

Endpoints: GET /v1/models, POST /v1/completions, POST /v1/chat/completions (stream or not), POST /tokenize,
POST /detokenize, GET /tokenizer_info, GET /metrics (Prometheus), GET /health, GET /. The routes are here; api.py
checks requests, answers.py builds the answers, engine.py batches the requests' decoding in the main thread while
uvicorn serves HTTP from another (it explains slots, prefix reuse, grammar masks and speculative decoding),
metrics.py holds the counters.
"""

import argparse
import asyncio
import gc
import hmac
import json
import logging
import os
import queue
import sys
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import FileResponse, JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from answers import Streamed, answer_choice, chunk_choice, echo_choice, object_name, role_choice, usage
from api import ApiError, Job, detokenize, parse_job, tokenize, tokenizer_info
from checkpoint import (
    DEFAULT_CHECKPOINT,
    DEFAULT_DEVICE,
    DTYPES,
    KV_CACHE_DTYPES,
    KV_CACHE_HELP,
    HelpFormatter,
    device_flag,
    resolve_checkpoint,
    user_errors,
)
from decode import check_speculation, compile_steps
from engine import Choice, Engine, Event
from generate import load_models
from grammar import grammar_vocabulary, new_matcher
from kernels import MATVECS
from metrics import Metrics, server_metrics
from sampling import SamplingParams
from tokenizer import Tokenizer

MAX_BODY_BYTES = 1 << 20
DEFAULT_SLOTS = 8  # slots without --max_batch_size, where the KV cache budget holds them
# --stream_interval holds a stream's token back only if it came this soon after the one before: a step that ran
# other prompts' prefill (a gap a reader sees) sends what was held at once, rather than make that gap longer
STREAM_HOLD_S = 0.05
# Without --kv_cache_memory the KV caches may take this share of the memory free once the weights are loaded: the rest
# is for activations, compiled code and whatever else runs on the machine.
KV_MEMORY_SHARE = 0.5
GiB = 1 << 30
CHAT_PAGE = Path(__file__).resolve().parent / "chat.html"
log = logging.getLogger("server")


@dataclass
class AppState:
    engine: Engine
    model_name: str
    api_key: str | None
    metrics: Metrics
    kv_cache_budget: int  # bytes the KV caches were sized to (--kv_cache_memory)
    stream_interval: int  # a streamed choice's tokens per hand-off to the HTTP thread after its first
    created: int = field(default_factory=lambda: int(time.time()))


def make_app(app_state: AppState) -> FastAPI:
    app = FastAPI(title="gpt-fast-style server")

    @app.exception_handler(ApiError)
    async def api_error(request, e: ApiError):
        return JSONResponse(e.body(), status_code=e.status)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await complete(request, True, app_state)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await complete(request, False, app_state)

    @app.get("/v1/models")
    async def models():
        model = {"id": app_state.model_name, "object": "model", "created": app_state.created, "owned_by": "local"}
        return {"object": "list", "data": [model]}

    @app.post("/tokenize")
    async def tokenize_text(request: Request):
        return tokenize(await read_body(request), app_state.engine.tokenizer, app_state.engine.context)

    @app.get("/tokenizer_info")
    async def tokenizer_details():
        return tokenizer_info(app_state.engine.tokenizer, app_state.engine.context)

    @app.post("/detokenize")
    async def detokenize_tokens(request: Request):
        engine = app_state.engine
        return detokenize(await read_body(request), engine.tokenizer, engine.model.config.vocab_size)

    @app.get("/metrics")
    async def metrics():
        return Response(generate_latest(app_state.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/health")
    async def health():
        engine = app_state.engine
        return {
            "status": "ok",
            "busy_slots": len(engine.busy_slots()),
            "prefilling_slots": len(engine.prefilling),
            "slots": len(engine.slots),
            "max_seq_length": engine.horizon + 1,
            "prefill_chunk": engine.prefill_chunk,
            "prefill_chunk_while_decoding": engine.prefill_chunk_while_decoding,
            "waiting": engine.waiting.qsize(),
            "speculation": None if engine.speculation is None else engine.speculation_figures(),
            **engine.kv_cache_figures(),
            "kv_cache_budget_bytes": app_state.kv_cache_budget,
        }

    @app.get("/")
    async def page():
        return FileResponse(CHAT_PAGE, media_type="text/html")

    return app


def guarded(app: FastAPI, app_state: AppState) -> Callable:
    """app (an ASGI app) with requests under /v1/ counted by path and status, and the API key checked on those
    under /v1. Plain ASGI: a FastAPI middleware would pass each chunk of a stream through a task and a memory
    stream of its own, which costs a stream's tokens per second."""

    async def asgi(scope, receive, send):
        path = scope.get("path", "")
        if scope["type"] != "http" or not path.startswith("/v1"):
            return await app(scope, receive, send)
        status = "500"  # if the app fails before it answers

        async def send_counted(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = str(message["status"])
            await send(message)

        try:
            if app_state.api_key and not authorized(scope, app_state.api_key):
                e = ApiError(
                    "a valid API key is required: Authorization: Bearer KEY", None, 401, "authentication_error"
                )
                return await JSONResponse(e.body(), status_code=401)(scope, receive, send_counted)
            await app(scope, receive, send_counted)
        finally:
            if path.startswith("/v1/"):
                app_state.metrics.requests.labels(path, status).inc()

    return asgi


def authorized(scope, api_key: str) -> bool:
    given = dict(scope["headers"]).get(b"authorization", b"")
    return hmac.compare_digest(given, f"Bearer {api_key}".encode())


async def read_body(request: Request):
    if int(request.headers.get("content-length") or 0) > MAX_BODY_BYTES:
        raise ApiError(f"the request body exceeds {MAX_BODY_BYTES} bytes", status=413)
    data = b""
    async for chunk in request.stream():
        data += chunk
        if len(data) > MAX_BODY_BYTES:
            raise ApiError(f"the request body exceeds {MAX_BODY_BYTES} bytes", status=413)
    try:
        return json.loads(data)
    except (ValueError, RecursionError) as e:  # bad UTF-8 or JSON, too deep, an integer too long, ...
        raise ApiError(f"the request body is not valid JSON: {type(e).__name__}: {e}") from None


@dataclass
class Reply:
    """A request's answer in the making: what a streamed answer and a whole one both need."""

    job: Job
    choices: list[Choice]
    tokenizer: Tokenizer
    metrics: Metrics
    head: dict  # id, created, model: the same in every chunk
    start: float
    first: float | None = None  # when the first event came

    def log(self):
        end, u = time.perf_counter(), usage(self.job, self.choices)
        rate = u["completion_tokens"] / (end - self.first) if self.first and end > self.first else float("nan")
        self.metrics.prompt_tokens.inc(u["prompt_tokens"])
        self.metrics.cached_prompt_tokens.inc(u["prompt_tokens_details"]["cached_tokens"])
        self.metrics.generation_tokens.inc(u["completion_tokens"])
        if self.first:
            self.metrics.time_to_first_token.observe(self.first - self.start)
        log.info(
            "%s prompt_tokens=%d cached_tokens=%d completion_tokens=%d ttft=%.3fs tokens/s=%.1f",
            self.head["id"],
            u["prompt_tokens"],
            u["prompt_tokens_details"]["cached_tokens"],
            u["completion_tokens"],
            (self.first or end) - self.start,
            rate,
        )


async def complete(request: Request, chat: bool, app_state: AppState):
    """A completion or chat completion: the job's choices go to the engine; the answer streams or comes whole."""
    job = parse_job(await read_body(request), chat, app_state.model_name, app_state.engine)
    request_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
    head = {"id": request_id, "created": int(time.time()), "model": app_state.model_name}
    choices, sent = submit(job, app_state.engine, app_state.stream_interval if job.stream else None)
    reply = Reply(job, choices, app_state.engine.tokenizer, app_state.metrics, head, time.perf_counter())
    events = choice_events(choices, sent, app_state.metrics)
    try:
        first = await anext(events)  # a fault in the prefill answers 500, before any chunk
        reply.first = time.perf_counter()
    except BaseException:
        await events.aclose()
        reply.log()
        raise
    if job.stream:
        return StreamingResponse(streamed_answer(reply, first, events), media_type="text/event-stream")
    return await whole_answer(reply, first, events)


def submit(job: Job, engine: Engine, interval: int | None) -> tuple[list[Choice], asyncio.Queue]:
    """Queues the job's choices (n of each prompt) in the engine; their events arrive in the returned queue, in
    lists: a choice's first event alone, then interval of them at a time (None: all the rest at its end), sooner
    where a stream's event came STREAM_HOLD_S or more after the one before, and an event that ends a choice with
    whatever it held. Each hand-off wakes the HTTP thread, whose time on the cores the engine's step loses."""
    loop, sent = asyncio.get_running_loop(), asyncio.Queue()
    # Touched by the engine thread only: a choice's events not yet handed off, and when its latest event was made.
    held: dict[int, list[Event]] = {}
    made: dict[int, float] = {}

    def send(event: Event):
        first = event.index not in made
        late = interval is not None and not first and event.made - made[event.index] >= STREAM_HOLD_S
        made[event.index] = event.made
        events = held.setdefault(event.index, [])
        events.append(event)
        ended = event.finish_reason is not None or event.error is not None
        if first or late or ended or len(events) == interval:
            loop.call_soon_threadsafe(sent.put_nowait, events[:])
            events.clear()

    # Choice i of a seeded request draws from seed + i: the n choices differ, and each repeats with its seed.
    def seeded(i):
        return job.params if job.params.seed is None else replace(job.params, seed=(job.params.seed + i) % 2**64)

    choices = [
        Choice(
            p * job.n + i,
            ids,
            job.max_tokens,
            seeded(i),
            job.stop,
            job.top_logprobs,
            send,
            job.score_prompt,
            None if job.grammar is None else new_matcher(job.grammar, engine.vocabulary),
            ignore_eos=job.ignore_eos,
            prediction=job.prediction,
        )
        for p, ids in enumerate(job.prompts)
        for i in range(job.n)
    ]
    try:
        engine.submit(choices)
    except queue.Full:
        raise ApiError(
            "the server is busy: its queue of waiting requests is full", None, 429, "rate_limit_error"
        ) from None
    return choices, sent


async def choice_events(choices: list[Choice], sent: asyncio.Queue, metrics: Metrics) -> AsyncIterator[list[Event]]:
    """The choices' events (one per token) as handed off, until each has ended (an error event raises). Closed early
    (the client went away), it cancels the choices, and the engine frees whatever is still running."""
    open_choices, last = len(choices), {}  # last: when the engine made each choice's latest token
    try:
        while open_choices:
            events = await sent.get()
            for event in events:
                if event.error is not None:
                    raise RuntimeError(event.error)
                if event.index in last:
                    metrics.inter_token_latency.observe(event.made - last[event.index])
                last[event.index] = event.made
                open_choices -= event.finish_reason is not None
            yield events
    finally:
        for c in choices:
            c.cancelled = True


async def streamed_answer(reply: Reply, first: list[Event], events: AsyncIterator[list[Event]]) -> AsyncIterator[str]:
    """Server-sent events: opening chunks, one chunk per event that shows something (a hand-off's chunks in one
    write), the usage if asked, [DONE]."""
    job, tokenizer = reply.job, reply.tokenizer

    def chunk(choices: list[dict], **extra) -> str:
        return f"data: {json.dumps(reply.head | {'object': object_name(job, True), 'choices': choices} | extra)}\n\n"

    try:
        if job.chat:
            for c in reply.choices:
                yield chunk([role_choice(c)])
        handed, echoed, streamed = first, set(), {c.index: Streamed() for c in reply.choices}
        while handed is not None:
            chunks = []
            for event in handed:
                if job.echo and event.index not in echoed:  # a choice's prompt comes before its first token
                    echoed.add(event.index)
                    chunks.append(chunk([echo_choice(tokenizer, reply.choices[event.index], event.prompt_logprobs)]))
                if shown := chunk_choice(job, tokenizer, event, streamed[event.index]):
                    chunks.append(chunk([shown]))
            if chunks:
                yield "".join(chunks)
            handed = await anext(events, None)
        if job.include_usage:
            yield chunk([], usage=usage(job, reply.choices))
        yield "data: [DONE]\n\n"
    finally:
        await events.aclose()
        reply.log()


async def whole_answer(reply: Reply, first: list[Event], events: AsyncIterator[list[Event]]) -> dict:
    """The answer once every choice has ended: each choice's text, log-probs and finish reason."""
    texts, entries, reasons = {}, {}, {}
    try:
        handed = first
        while handed is not None:
            for event in handed:
                texts[event.index] = texts.get(event.index, "") + event.text
                new = (event.prompt_logprobs or []) + ([event.logprobs] if event.logprobs else [])
                entries.setdefault(event.index, []).extend(new)
                reasons[event.index] = event.finish_reason
            handed = await anext(events, None)
    finally:
        await events.aclose()
        reply.log()
    job, tokenizer = reply.job, reply.tokenizer
    answer = [
        answer_choice(job, tokenizer, c, texts[c.index], entries[c.index], reasons[c.index])
        for c in sorted(reply.choices, key=lambda c: c.index)
    ]
    return reply.head | {"object": object_name(job, False), "choices": answer, "usage": usage(job, reply.choices)}


# ---------------------------------------------------------------- command line


def serve_at_nice(http: uvicorn.Server, nicer: int):
    """Runs the HTTP server in this thread, nicer than the engine's thread by that much (Linux sets nice per thread,
    and the threads this one starts inherit it; only a privileged process may lower a nice value, so this one only
    raises it, up to 19, whatever nice the server was started at)."""
    if sys.platform == "linux" and nicer:
        thread = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, thread, min(19, os.getpriority(os.PRIO_PROCESS, thread) + nicer))
    http.run()


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    arg = p.add_argument
    arg("--checkpoint_path", type=Path, default=DEFAULT_CHECKPOINT, help="model.pth, or its folder")
    arg("--model_name", default=None, help="the model's name in the API; default: the checkpoint's folder name")
    arg("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    arg("--port", type=int, default=8000, help="port to listen on")
    arg(
        "--kv_cache_memory",
        type=float,
        default=None,
        # argparse formats help strings with %: the percent sign doubled
        help=f"GiB for the KV caches (default: {KV_MEMORY_SHARE:.0%}% of the memory free once the model is loaded)",
    )
    arg(
        "--max_batch_size",
        type=int,
        default=None,
        help=f"requests decoded together, slots of the KV cache (default: as many as the budget holds, up to "
        f"{DEFAULT_SLOTS})",
    )
    arg(
        "--max_seq_length",
        type=int,
        default=None,
        help="positions per slot, prompt plus reply (default: the model's context, or what the budget holds)",
    )
    arg("--max_queue", type=int, default=64, help="requests waiting for a slot before new ones get 429")
    arg("--prefill_chunk", type=int, default=256, help="prompt tokens a turn of the engine prefills")
    arg(
        "--prefill_chunk_while_decoding",
        type=int,
        default=None,
        help="prompt tokens of long prompts a turn prefills while other requests decode (default and at most "
        "--prefill_chunk): their streams wait for the turn, so fewer keep their pauses shorter while a long prompt "
        "enters, and that prompt's first token later",
    )
    arg(
        "--stream_interval",
        type=int,
        default=1,
        help="a stream's tokens per chunk after its first: each chunk wakes the HTTP thread, whose time the decode "
        "step loses on a machine with no core to spare (as vLLM's --stream-interval)",
    )
    arg(
        "--http_nice",
        type=int,
        default=0,
        help="how much nicer than the engine's thread the HTTP thread runs on Linux, 0 to 19 (nice stops at 19): at "
        "19 its wake-ups wait for a free core instead of cutting into a decode step's threads (a faster stream on a "
        "machine with no core to spare, a later first token under load)",
    )
    arg("--api_key", default=None, help="require Authorization: Bearer API_KEY on /v1 routes")
    arg("--device", type=device_flag, default=DEFAULT_DEVICE, help="cpu, cuda, cuda:1, ...")
    arg("--dtype", choices=DTYPES, default=None, help="default: bfloat16 on CUDA, float32 on CPU")
    arg("--kv_cache_dtype", choices=KV_CACHE_DTYPES, default=None, help=KV_CACHE_HELP)
    arg("--compile", action="store_true", help="torch.compile the decode step (one graph per power-of-two batch)")
    arg("--kernels", choices=MATVECS, default="auto", help="as generate.py's flag")
    arg("--draft_checkpoint_path", type=Path, default=None, help="a draft model (same tokenizer): speculative decoding")
    arg(
        "--ngram",
        action="store_true",
        help="speculative decoding with drafts from each request's context (prompt lookup) and its prediction field",
    )
    arg("--speculate_k", type=int, default=4, help="tokens drafted per slot and step at most (the depth is measured)")
    args = p.parse_args(argv)
    if args.ngram and args.draft_checkpoint_path is not None:
        p.error("--ngram drafts from the context, --draft_checkpoint_path with a draft model: choose one")
    for name in (
        "max_batch_size",
        "max_queue",
        "prefill_chunk",
        "prefill_chunk_while_decoding",
        "stream_interval",
        "speculate_k",
    ):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            p.error(f"--{name} must be >= 1")
    if not 0 <= args.http_nice <= 19:
        p.error(f"--http_nice must be in 0..19, got {args.http_nice}")
    if not 0 < args.port < 65536:
        p.error(f"--port must be in 1..65535, got {args.port}")
    if args.max_seq_length is not None and args.max_seq_length < 2:
        p.error("--max_seq_length must be >= 2")
    if args.kv_cache_memory is not None and not 0 < args.kv_cache_memory < float("inf"):
        p.error(f"--kv_cache_memory must be a positive number of GiB, got {args.kv_cache_memory}")
    return args


def free_memory(device) -> int:
    """Bytes free on device: CUDA's free memory, or the memory Linux reports available (MemAvailable: free pages
    plus the page cache it can drop), else the free pages."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    meminfo = Path("/proc/meminfo")
    if meminfo.is_file():
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024  # "MemAvailable:   12345678 kB"
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def kv_cache_shape(
    budget: int, bytes_of: Callable[[int, int], int], context: int, slots: int | None, length: int | None
) -> tuple[int, int]:
    """(slots, positions per slot) of KV caches that take at most budget bytes, bytes_of(slots, positions) for those
    of so many slots of so many positions (growing with both; rolling caches make it less than proportional to the
    positions). A length not given is the model's context, or the most the budget holds for the slots given (default
    one); slots not given are as many as the budget holds at that length, up to DEFAULT_SLOTS. ValueError where the
    budget cannot hold what was asked for."""
    if length is None:  # the longest that fits: a bisection over 1..context
        low, high = 1, context
        while low < high:
            middle = (low + high + 1) // 2
            low, high = (middle, high) if bytes_of(slots or 1, middle) <= budget else (low, middle - 1)
        length = low
    length = min(length, context)
    slots = slots or min(DEFAULT_SLOTS, budget // bytes_of(1, length))
    if length < 2 or slots < 1 or bytes_of(slots, length) > budget:
        slots, length = max(slots, 1), max(length, 2)
        raise ValueError(
            f"{slots} slot(s) of {length} positions need {bytes_of(slots, length) / GiB:.3g} GiB of KV cache, more "
            f"than the budget of {budget / GiB:.3g} GiB: set --kv_cache_memory, or fewer --max_batch_size or "
            f"--max_seq_length"
        )
    return slots, length


def main(argv=None):
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", stream=sys.stderr)
    with user_errors():
        args = parse_args(argv)
        device = args.device
        path = resolve_checkpoint(args.checkpoint_path)
        speculative = args.draft_checkpoint_path is not None or args.ngram
        # A step's rows at most, for the choice of kernels: the slots are known once the model is loaded.
        rows = (args.max_batch_size or DEFAULT_SLOTS) * (args.speculate_k + 1 if speculative else 1)
        model, tokenizer, draft = load_models(
            path,
            device,
            args.dtype,
            args.compile,
            args.kernels,
            args.draft_checkpoint_path,
            rows=rows,
            kv_cache_dtype=args.kv_cache_dtype,
        )
        if draft is not None:
            check_speculation(model, draft, SamplingParams(), args.speculate_k)
        steps = compile_steps(device, args.compile)
        models = (model, draft) if draft is not None else (model,)
        free, gib = free_memory(device), args.kv_cache_memory
        budget = int(gib * GiB) if gib is not None else int(free * KV_MEMORY_SHARE)
        layout = Engine.cache_layout(args.prefill_chunk, args.speculate_k if speculative else 0)

        def bytes_of(slots: int, length: int) -> int:
            return sum(m.kv_cache_bytes(slots, length, **layout) for m in models)

        slots, max_seq_length = kv_cache_shape(
            budget, bytes_of, min(m.config.block_size for m in models), args.max_batch_size, args.max_seq_length
        )
        if bytes_of(slots, max_seq_length) > free:  # a budget above what is free: out of memory later
            raise ValueError(
                f"{slots} slot(s) of {max_seq_length} positions need {bytes_of(slots, max_seq_length) / GiB:.3g} GiB "
                f"of KV cache, but {free / GiB:.3g} GiB of memory is free: set a smaller --kv_cache_memory"
            )
        tokenizer_file = path.parent / "tokenizer.json"  # structured output reads it (grammar.py)
        vocabulary = (
            grammar_vocabulary(tokenizer_file, model.config.vocab_size, tokenizer.eos_ids)
            if tokenizer_file.is_file()
            else None
        )
        engine = Engine(
            model,
            tokenizer,
            slots,
            max_seq_length,
            steps,
            args.max_queue,
            draft,
            args.speculate_k,
            vocabulary,
            args.prefill_chunk,
            args.ngram,
            prefill_chunk_while_decoding=args.prefill_chunk_while_decoding,
        )
        if args.compile or speculative:  # compiles the steps; measures the speculative rounds' costs
            engine.warm_up()
        # What loading and compiling made lives as long as the server: Python's full collections would walk it all,
        # each stalling the engine and the HTTP thread (they hold the interpreter); frozen, collections skip it.
        gc.freeze()
        app_state = AppState(
            engine,
            args.model_name or path.parent.name,
            args.api_key,
            server_metrics(engine),
            budget,
            args.stream_interval,
        )
        app = make_app(app_state)
        # HTTP is served from a thread of its own, and the engine runs here, in the thread that loaded and compiled the
        # model: OpenMP keeps a pool of workers per thread that runs parallel work, and with two pools on the cores
        # libgomp stops spinning between parallel regions, which halved a stream's tokens/s.
        http = uvicorn.Server(
            uvicorn.Config(guarded(app, app_state), host=args.host, port=args.port, log_level="warning")
        )
        serving = threading.Thread(target=serve_at_nice, args=(http, args.http_nice), name="http", daemon=True)
        serving.start()
        while not http.started:
            if not serving.is_alive():
                raise ValueError(f"cannot listen on {args.host}:{args.port} (uvicorn's error above)")
            time.sleep(0.05)
        figures = engine.kv_cache_figures()
        log.info(
            "serving %s on http://%s:%d: %d slot%s of %d positions, KV cache %.2f GiB (%s) of a %.2f GiB budget%s",
            path,
            args.host,
            args.port,
            slots,
            "s" if slots > 1 else "",
            max_seq_length,
            figures["kv_cache_bytes"] / GiB,
            figures["kv_cache_dtype"],
            budget / GiB,
            f", draft {args.draft_checkpoint_path}" if draft else "",
        )
        engine.loop()


if __name__ == "__main__":
    main()
