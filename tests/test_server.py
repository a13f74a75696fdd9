"""server.py: the OpenAI API through the official client, continuous batching, disconnects, bad input, the chat page."""

import asyncio
import contextlib
import functools
import itertools
import json
import queue
import random
import re
import shutil
import socket
import subprocess
import sys
import threading
import time
import types
from pathlib import Path

import httpx
import jsonschema
import lm_eval
import openai
import pydantic
import pytest
import torch
from openai.types import completion_create_params
from openai.types.chat import completion_create_params as chat_create_params
from prometheus_client.parser import text_string_to_metric_families
from selenium import webdriver
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import Select, WebDriverWait
from transformers import PreTrainedTokenizerFast

from api import HONOURED, NO_EFFECT, UNSUPPORTED, Job
from chat import encode_conversation
from conftest import ROOT, SMOLLM2_DIR, TINY_VOCAB, assert_same_greedy, make_hf_llama
from convert_hf_checkpoint import convert_hf_checkpoint
from decode import Steps, Stream, compile_steps
from engine import Choice, Engine, Event
from eval import text_logprobs
from generate import generate, load_model
from grammar import grammar_vocabulary, new_matcher, regex_grammar
from quantize import quantize_model
from sampling import SamplingParams
from server import DEFAULT_SLOTS, STREAM_HOLD_S, kv_cache_shape, submit
from speculate import depth_choices, probe_depth
from tokenizer import load_tokenizer

KEY = "test-key"
# A template of the ChatML kind: the tiny tokenizer has no chat template of its own.
TEMPLATE = (
    "{% for m in messages %}<s>{{ m['role'] }}\n{{ m['content'] }}</s>\n{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant\n{% endif %}"
)
PROMPTS = [
    "The quick brown",
    "def main():",
    "Naïve café",
    "日本語",
    "emoji 🙂",
    "1234",
    "return {'key'",
    "fox jumps",
    "русский",
    "Ελληνικά",
    "lazy dog.",
    "numbers",
    "def",
    "x = 1",
    "The",
    "ab",
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(checkpoint: Path, log_folder: Path, *flags: str):
    port = free_port()
    log = open(log_folder / f"server-{port}.log", "w+")
    process = subprocess.Popen(
        [sys.executable, str(ROOT / "server.py"), "--checkpoint_path", str(checkpoint), "--port", str(port), *flags],
        stdout=log,
        stderr=subprocess.STDOUT,
        cwd=ROOT,
    )
    url = f"http://127.0.0.1:{port}"
    for _ in range(600):
        try:
            if httpx.get(url + "/health").status_code == 200:
                return process, url, log
        except httpx.TransportError:
            pass
        assert process.poll() is None, open(log.name).read()
        time.sleep(0.1)
    process.kill()
    raise AssertionError("the server did not start: " + open(log.name).read())


def stop_server(process, log):
    process.terminate()
    process.wait(timeout=30)
    log.close()


@pytest.fixture(scope="module")
def chat_checkpoint(tiny_checkpoint, tmp_path_factory) -> Path:
    """The tiny checkpoint with a chat template."""
    folder = tmp_path_factory.mktemp("server") / "tiny-chat"
    shutil.copytree(tiny_checkpoint, folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps(config | {"chat_template": TEMPLATE}))
    return folder


@pytest.fixture(scope="module")
def server(chat_checkpoint):
    process, url, log = start_server(
        chat_checkpoint / "model.pth", chat_checkpoint.parent, "--max_batch_size", "16", "--api_key", KEY
    )
    yield url, log
    stop_server(process, log)


@pytest.fixture(scope="module")
def reference(chat_checkpoint):
    model = load_model(chat_checkpoint / "model.pth")
    return model, load_tokenizer(chat_checkpoint)


@torch.no_grad()
def greedy_reference(reference, ids: list[int], max_tokens: int) -> tuple[str, str]:
    """generate()'s greedy text and finish reason, after checking that no step of it is a near-tie: the server
    computes a row in a batch of up to 16 at its own position, whose float32 logits differ from a lone row's
    (measured: up to 5e-6), so exact equality of greedy text is a fair demand where the top two logits are
    further apart than 1e-4."""
    model, tokenizer = reference
    result = generate(model, ids, max_tokens, tokenizer=tokenizer, eos_ids=tokenizer.eos_ids)
    steps = ids + result.raw_tokens[0]
    model.setup_caches(1, len(steps))
    logits = model(torch.tensor([steps[:-1]]), torch.arange(len(steps) - 1))[0, len(ids) - 1 :]
    top2 = logits.topk(2).values
    assert (top2[:, 0] - top2[:, 1]).min() > 1e-4, "a near-tie in the reference: pick another prompt"
    reason = {"eos": "stop"}.get(result.finish_reasons[0], result.finish_reasons[0])
    return result.texts[0], reason


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=120)


def test_openai_client_chat_and_completions(server, reference, chat_checkpoint):
    url, _ = server
    api = client(url)
    model_name = api.models.list().data[0].id
    assert model_name == "tiny-chat"
    _, tokenizer = reference
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "The quick brown"}]
    expected, reason = greedy_reference(reference, encode_conversation(tokenizer, messages), 24)
    answer = api.chat.completions.create(model=model_name, messages=messages, max_tokens=24, temperature=0)
    assert answer.choices[0].message.content == expected and answer.choices[0].finish_reason == reason
    assert answer.usage.prompt_tokens == len(encode_conversation(tokenizer, messages))
    chunks = list(
        api.chat.completions.create(
            model=model_name,
            messages=messages,
            max_tokens=24,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == [reason]
    assert chunks[-1].usage.completion_tokens == answer.usage.completion_tokens

    prompt = "def main():"
    expected, reason = greedy_reference(reference, tokenizer.encode(prompt), 20)
    text = api.completions.create(model=model_name, prompt=prompt, max_tokens=20, temperature=0)
    assert text.choices[0].text == expected and text.choices[0].finish_reason == reason
    streamed = api.completions.create(model=model_name, prompt=prompt, max_tokens=20, temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in streamed) == expected

    # generate.py itself, greedy, the same prompt: the same text.
    out = subprocess.run(
        [
            sys.executable,
            str(ROOT / "generate.py"),
            "--checkpoint_path",
            str(chat_checkpoint),
            "--prompt",
            prompt,
            "--temperature",
            "0",
            "--max_new_tokens",
            "20",
            "--json",
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        check=True,
    )
    assert json.loads(out.stdout.splitlines()[-1])["outputs"] == [expected]


def metric_samples(url: str) -> dict:
    """GET /metrics, parsed by prometheus_client: {(sample name, labels as sorted tuples): value}."""
    text = httpx.get(url + "/metrics").text
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_content_parts_tokenize_and_metrics(server, reference):
    """Content as a list of text parts answers as the same text as a string; /tokenize and /detokenize give the
    tokenizer's ids and text back; /metrics' counters move by a request's usage."""
    url, _ = server
    api = client(url)
    _, tokenizer = reference
    parts = [{"type": "text", "text": "The quick"}, {"type": "text", "text": "brown"}]
    as_parts = api.chat.completions.create(
        model="tiny-chat", messages=[{"role": "user", "content": parts}], max_tokens=12, temperature=0
    )
    as_string = api.chat.completions.create(
        model="tiny-chat", messages=[{"role": "user", "content": "The quick\nbrown"}], max_tokens=12, temperature=0
    )
    assert as_parts.choices[0].message.content == as_string.choices[0].message.content
    assert as_parts.usage.prompt_tokens == as_string.usage.prompt_tokens

    text = "Naïve café 日本語"
    tokens = httpx.post(url + "/tokenize", json={"prompt": text}).json()
    assert tokens["tokens"] == tokenizer.encode(text) and tokens["count"] == len(tokens["tokens"])
    assert tokens["max_model_len"] > 0
    plain = httpx.post(url + "/tokenize", json={"content": text}).json()["tokens"]  # llama.cpp's: no BOS
    assert plain == tokenizer.encode(text, bos=False)
    back = httpx.post(url + "/detokenize", json={"tokens": plain}).json()
    assert back["prompt"] == back["content"] == text
    messages = [{"role": "user", "content": [{"type": "text", "text": text}]}]
    chat = httpx.post(url + "/tokenize", json={"messages": messages}).json()["tokens"]
    assert chat == encode_conversation(tokenizer, [{"role": "user", "content": text}])

    before = metric_samples(url)
    done = api.completions.create(model="tiny-chat", prompt="The quick brown", max_tokens=7, temperature=0)
    after = metric_samples(url)
    moved = {k: after[k] - before.get(k, 0) for k in after if after[k] != before.get(k, 0)}
    ok = ("gptfast_requests_total", (("endpoint", "/v1/completions"), ("status", "200")))
    assert moved[ok] == 1
    assert moved[("gptfast_prompt_tokens_total", ())] == done.usage.prompt_tokens
    assert moved[("gptfast_generation_tokens_total", ())] == done.usage.completion_tokens
    assert moved[("gptfast_time_to_first_token_seconds_count", ())] == 1
    assert moved[("gptfast_inter_token_latency_seconds_count", ())] == done.usage.completion_tokens - 1
    fed = done.usage.prompt_tokens - done.usage.prompt_tokens_details.cached_tokens
    assert moved.get(("gptfast_prefilled_tokens_total", ()), 0) == fed
    assert after[("gptfast_slots", ())] == 16 and after[("gptfast_busy_slots", ())] == 0
    assert after[("gptfast_prefilling_slots", ())] == 0 and after[("gptfast_decode_steps_total", ())] > 0


def test_every_openai_field_is_honoured_refused_or_documented(server):
    """Each field of the openai package's chat and completions requests is in exactly one of the server's tables;
    a refused one with a value that asks for something gets a 400 naming it, one without effect is accepted, and
    an unknown field is accepted with one log line."""
    url, log = server
    auth = {"Authorization": f"Bearer {KEY}"}
    fields = set(chat_create_params.CompletionCreateParamsBase.__annotations__) | {"stream"}
    fields |= set(completion_create_params.CompletionCreateParamsBase.__annotations__)
    tables = [HONOURED, set(UNSUPPORTED), NO_EFFECT]
    assert all(sum(f in t for t in tables) == 1 for f in fields), [f for f in fields if not any(f in t for t in tables)]
    asking = {
        "functions": [{"name": "f"}],
        "function_call": "auto",
        "logit_bias": {"5": 10},
        "suffix": "!",
        "best_of": 2,
        "audio": {"voice": "alloy", "format": "wav"},
        "modalities": ["text", "audio"],
        "web_search_options": {},
    }
    idle = {
        "user": "u1",
        "store": True,
        "metadata": {"k": "v"},
        "safety_identifier": "s1",
        "service_tier": "auto",
        "prompt_cache_key": "c1",
        "prompt_cache_retention": "24h",
        "prompt_cache_options": {},
        "verbosity": "low",
        "reasoning_effort": "low",
        "moderation": "auto",
    }
    assert asking.keys() == UNSUPPORTED.keys() and idle.keys() == NO_EFFECT
    for name, value in asking.items():
        chat = name not in ("suffix", "best_of")
        body = {"messages": [{"role": "user", "content": "hi"}]} if chat else {"prompt": "hi"}
        r = httpx.post(
            url + ("/v1/chat/completions" if chat else "/v1/completions"), json=body | {name: value}, headers=auth
        )
        assert r.status_code == 400 and r.json()["error"]["param"] == name, (name, r.text)
    r = httpx.post(
        url + "/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "zzz_unknown": 1} | idle,
        headers=auth,
    )
    assert r.status_code == 200, r.text
    log.flush()
    assert '"zzz_unknown" is unknown' in Path(log.name).read_text()


def test_prompt_logprobs_equal_eval_py(server, reference):
    """echo with logprobs scores every prompt token (the first has none) as eval.py does, with max_tokens 0 (the
    prompt alone) or followed by the generated tokens, streamed or not."""
    url, _ = server
    api = client(url)
    model, tokenizer = reference
    prompt = "The quick brown fox jumps over the lazy dog, 1234 times."
    ids = tokenizer.encode(prompt)
    expected = text_logprobs(model, ids, len(ids), len(ids) - 1)
    only = api.completions.create(model="tiny-chat", prompt=prompt, max_tokens=0, echo=True, logprobs=2)
    choice = only.choices[0]
    assert choice.text == tokenizer.decode(ids) and choice.finish_reason == "length"
    assert only.usage.completion_tokens == 0 and only.usage.prompt_tokens == len(ids)
    lp = choice.logprobs
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None and len(lp.tokens) == len(ids)
    assert lp.token_logprobs[1:] == pytest.approx(expected, abs=1e-4)
    assert lp.text_offset[:2] == [0, len(lp.tokens[0])]
    for chosen, top in zip(lp.token_logprobs[1:], lp.top_logprobs[1:]):
        best = sorted(top.values(), reverse=True)
        assert len(top) <= 2 and chosen <= best[0] + 1e-6 and best[0] <= 0
    both = dict(model="tiny-chat", prompt=prompt, max_tokens=5, echo=True, logprobs=1, temperature=0)
    whole = api.completions.create(**both)
    lp = whole.choices[0].logprobs
    assert len(lp.tokens) == len(ids) + whole.usage.completion_tokens
    assert lp.token_logprobs[1 : len(ids)] == pytest.approx(expected, abs=1e-4)
    streamed = list(api.completions.create(**both, stream=True))
    assert "".join(c.choices[0].text for c in streamed) == whole.choices[0].text
    assert [x for c in streamed for x in c.choices[0].logprobs.token_logprobs] == lp.token_logprobs


def test_lm_eval_scores_each_choice_as_eval_py(server, reference, tmp_path, monkeypatch):
    """lm-eval's local-completions model (a real client, with the server's remote tokenizer) runs a multiple-choice
    task from a local file: each choice's log-likelihood equals eval.py's of the same tokens."""
    url, _ = server
    model, tokenizer = reference
    questions = [
        ("The capital of France is", ["Paris", "Rome", "Madrid"], 0),
        ("Two plus two is", ["three", "four", "five"], 1),
        ("The color of the sky is", ["green", "red", "blue"], 2),
        ("Water freezes at zero degrees", ["Fahrenheit", "Celsius", "Kelvin"], 1),
    ]
    data = tmp_path / "questions.jsonl"
    data.write_text("".join(json.dumps({"q": q, "choices": c, "answer": a}) + "\n" for q, c, a in questions))
    task = {
        "task": "tiny_choices",
        "dataset_path": "json",
        "dataset_kwargs": {"data_files": {"test": str(data)}},
        "test_split": "test",
        "output_type": "multiple_choice",
        "doc_to_text": "{{q}}",
        "doc_to_choice": "{{choices}}",
        "doc_to_target": "{{answer}}",
        "metric_list": [{"metric": "acc"}],
    }
    monkeypatch.setenv("OPENAI_API_KEY", KEY)
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "datasets"))
    results = lm_eval.simple_evaluate(
        model="local-completions",
        model_args={"base_url": url + "/v1/completions", "model": "tiny-chat", "max_retries": 1},
        tasks=[task],
        log_samples=True,
    )
    samples = results["samples"]["tiny_choices"]
    assert len(samples) == len(questions)
    for sample in samples:
        q, choices, _ = questions[sample["doc_id"]]
        for choice, (loglikelihood, _) in zip(choices, (r[0] for r in sample["resps"])):
            # lm-eval's split: the context's tokens, then the whole text's after them
            context = tokenizer.encode(q, bos=False)
            whole = tokenizer.encode(q + " " + choice, bos=False)
            scores = text_logprobs(model, whole, len(whole), len(whole) - 1)
            assert loglikelihood == pytest.approx(sum(scores[len(context) - 1 :]), abs=1e-4), (q, choice)


PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "pets": {"type": "array", "items": {"enum": ["cat", "dog", "fish"]}, "maxItems": 3},
        "married": {"type": "boolean"},
    },
    "required": ["name", "age", "pets", "married"],
    "additionalProperties": False,
}


class Point(pydantic.BaseModel):
    x: int = pydantic.Field(ge=-50, le=50)
    label: str = pydantic.Field(max_length=6)


def test_structured_output_follows_its_schema_and_free_rows_stay_as_alone(server, reference):
    """A random model's sampled output under a JSON schema always parses and validates; the openai package's
    parse() gets its pydantic object; regex, choice and GBNF constraints hold; and free rows decoding beside
    constrained ones give the same greedy text as alone."""
    url, _ = server
    api = client(url)
    _, tokenizer = reference
    schema = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    texts = []
    for seed in (1, 2):
        answer = api.chat.completions.create(
            model="tiny-chat",
            messages=[{"role": "user", "content": "Describe a person."}],
            response_format=schema,
            n=10,
            temperature=1.0,
            seed=seed,
            max_tokens=200,  # more than the longest text the schema allows
        )
        texts += [c.message.content for c in answer.choices]
        assert all(c.finish_reason == "stop" for c in answer.choices)
    for text in texts:
        jsonschema.validate(json.loads(text), PERSON)
    assert len(set(texts)) > 10  # sampled, not one text
    parsed = api.chat.completions.parse(
        model="tiny-chat", messages=[{"role": "user", "content": "A point."}], response_format=Point, max_tokens=100
    )
    assert isinstance(parsed.choices[0].message.parsed, Point)
    # Any JSON object: its strings are unbounded, so a random model ends about a third of them within max_tokens.
    anything = api.completions.create(
        model="tiny-chat",
        prompt="{",
        max_tokens=80,
        n=16,
        seed=3,
        temperature=1,
        extra_body={"response_format": {"type": "json_object"}},
    )
    ended = [c.text for c in anything.choices if c.finish_reason == "stop"]
    assert ended and all(isinstance(json.loads(t), dict) for t in ended)
    for field, value, check in [
        ("guided_regex", r"[0-9]{3}-[a-z]{2}", lambda t: re.fullmatch(r"[0-9]{3}-[a-z]{2}", t)),
        ("guided_choice", ["yes", "no", "maybe"], lambda t: t in ("yes", "no", "maybe")),
        ("guided_grammar", 'root ::= "(" [a-c]{1,3} ")"', lambda t: re.fullmatch(r"\([a-c]{1,3}\)", t)),
    ]:
        out = api.completions.create(
            model="tiny-chat", prompt="x", max_tokens=20, n=4, temperature=1, seed=5, extra_body={field: value}
        )
        assert all(check(c.text) for c in out.choices), (field, [c.text for c in out.choices])

    # Free greedy rows in the same steps as constrained sampled ones.
    free = PROMPTS[:4]
    expected = [greedy_reference(reference, tokenizer.encode(p), 24) for p in free]
    results = {}

    def run(i):
        if i < len(free):
            c = client(url).completions.create(model="tiny-chat", prompt=free[i], max_tokens=24, temperature=0)
            results[i] = c.choices[0].text, c.choices[0].finish_reason
        else:
            client(url).completions.create(
                model="tiny-chat", prompt="{", max_tokens=60, n=3, temperature=1, extra_body={"guided_json": PERSON}
            )

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(free) + 2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [results[i] for i in range(len(free))] == expected


# Qwen2.5's chat template (tools in Hermes' <tool_call> format) with Qwen3's thinking switch (enable_thinking, off
# unless asked for here).
TOOLS_TEMPLATE = ROOT / "tests" / "fixtures" / "qwen_tools_thinking.jinja"
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 10},
                "unit": {"enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
CLOCK = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"]},
    },
}


@pytest.fixture(scope="module")
def tools_server(tiny_checkpoint, tmp_path_factory):
    folder = tmp_path_factory.mktemp("tools") / "tiny-tools"
    shutil.copytree(tiny_checkpoint, folder)
    shutil.copy(TOOLS_TEMPLATE, folder / "chat_template.jinja")
    config = json.loads((folder / "config.json").read_text())  # room for the template's tool instructions
    (folder / "config.json").write_text(json.dumps(config | {"block_size": 2048}))
    process, url, log = start_server(folder / "model.pth", folder.parent, "--max_batch_size", "4")
    yield url, folder
    stop_server(process, log)


def test_tool_round_trip_through_openai(tools_server):
    """A random model's forced tool call comes back well-formed (tool_choice required, or a named function),
    streamed pieces join to the whole call, and the next turn (the call, then the tool's result) renders as
    transformers renders it."""
    url, folder = tools_server
    api = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)
    messages = [{"role": "user", "content": "Weather in Oslo?"}]
    ask = dict(
        model="tiny-tools",
        messages=messages,
        tools=[WEATHER, CLOCK],
        tool_choice="required",
        parallel_tool_calls=False,
        temperature=1,
        seed=11,
        max_tokens=150,
    )
    answer = api.chat.completions.create(**ask)
    choice = answer.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    tool = {"get_weather": WEATHER, "get_time": CLOCK}[call.function.name]
    jsonschema.validate(json.loads(call.function.arguments), tool["function"]["parameters"])
    assert call.id.startswith("call_") and call.type == "function"
    pieces = {}
    for chunk in api.chat.completions.create(**ask, stream=True):
        for piece in chunk.choices[0].delta.tool_calls or []:
            whole = pieces.setdefault(piece.index, {"name": "", "arguments": ""})
            whole["name"] += piece.function.name or ""
            whole["arguments"] += piece.function.arguments or ""
        reasons = [c.finish_reason for c in chunk.choices if c.finish_reason]
    assert reasons == ["tool_calls"] and pieces == {
        0: {"name": call.function.name, "arguments": call.function.arguments}
    }
    named = api.chat.completions.create(**ask | {"tool_choice": {"type": "function", "function": {"name": "get_time"}}})
    assert named.choices[0].message.tool_calls[0].function.name == "get_time"

    turn = messages + [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21}'},
    ]
    final = api.chat.completions.create(**ask | {"messages": turn, "tool_choice": "auto", "max_tokens": 8})
    assert final.choices[0].finish_reason in ("stop", "length", "tool_calls")
    hf = PreTrainedTokenizerFast(tokenizer_file=str(folder / "tokenizer.json"))
    as_template_gets_it = [
        m
        | {
            "tool_calls": [
                c | {"function": c["function"] | {"arguments": json.loads(c["function"]["arguments"])}}
                for c in m["tool_calls"]
            ]
        }
        if m.get("tool_calls")
        else m
        for m in turn
    ]
    rendered = hf.apply_chat_template(
        as_template_gets_it,
        tools=[WEATHER, CLOCK],
        tokenize=False,
        add_generation_prompt=True,
        chat_template=TOOLS_TEMPLATE.read_text(),
    )
    ours = httpx.post(url + "/tokenize", json={"messages": turn, "tools": [WEATHER, CLOCK]}).json()
    assert ours["tokens"] == hf.encode(rendered, add_special_tokens=False)
    assert final.usage.prompt_tokens == len(ours["tokens"])


def test_reasoning_is_split_from_content(tools_server):
    """A reply's <think>...</think> is its reasoning_content, streamed or not (here a regex makes the random model
    write one); with the template's <think> open (enable_thinking), the reply starts as reasoning."""
    url, _ = tools_server
    api = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)
    ask = dict(
        model="tiny-tools",
        messages=[{"role": "user", "content": "Think first."}],
        temperature=1,
        seed=4,
        max_tokens=40,
        extra_body={"guided_regex": "<think>[a-z]{3,8}</think>\n\n[a-z]{3,8}"},
    )
    message = api.chat.completions.create(**ask).choices[0].message
    reasoning, content = message.model_extra["reasoning_content"], message.content
    assert re.fullmatch("[a-z]{3,8}", reasoning) and re.fullmatch("[a-z]{3,8}", content)
    streamed = {"reasoning_content": "", "content": ""}
    for chunk in api.chat.completions.create(**ask, stream=True):
        delta = chunk.choices[0].delta.model_dump() if chunk.choices else {}
        for key in streamed:
            streamed[key] += delta.get(key) or ""
    assert streamed == {"reasoning_content": reasoning, "content": content}
    thinking = api.chat.completions.create(
        **ask | {"max_tokens": 6, "extra_body": {"chat_template_kwargs": {"enable_thinking": True}}}
    )
    message = thinking.choices[0].message
    assert message.content == "" and message.model_extra["reasoning_content"], message


def test_sampling_fields(server, reference):
    url, _ = server
    api = client(url)
    _, tokenizer = reference
    # Stop strings: the text ends before the first one, the reason is "stop".
    full = (
        api.completions.create(model="tiny-chat", prompt="The quick brown", max_tokens=24, temperature=0)
        .choices[0]
        .text
    )
    cut = full[3:6]
    stopped = api.completions.create(
        model="tiny-chat", prompt="The quick brown", max_tokens=24, temperature=0, stop=[cut, "\x00"]
    )
    assert stopped.choices[0].text == full[: full.index(cut)] and stopped.choices[0].finish_reason == "stop"
    # A seed repeats a sample; n choices of one seeded request differ from each other.
    sample = dict(model="tiny-chat", prompt="The", max_tokens=16, temperature=1.5, top_p=0.95, seed=7)
    first = api.completions.create(**sample, n=3)
    again = api.completions.create(**sample, n=3)
    assert [c.text for c in first.choices] == [c.text for c in again.choices]
    assert len({c.text for c in first.choices}) > 1 and [c.index for c in first.choices] == [0, 1, 2]
    # Log-probs: the chosen token's, and the top ones in order, from the model's distribution.
    lp = (
        api.chat.completions.create(
            model="tiny-chat",
            messages=[{"role": "user", "content": "1234"}],
            max_tokens=4,
            temperature=0,
            logprobs=True,
            top_logprobs=3,
        )
        .choices[0]
        .logprobs.content
    )
    assert len(lp) >= 1
    for entry in lp:
        tops = [t.logprob for t in entry.top_logprobs]
        assert len(tops) == 3 and tops == sorted(tops, reverse=True) and entry.logprob == pytest.approx(tops[0])
    # Penalties change a greedy continuation that repeats itself.
    plain = api.completions.create(model="tiny-chat", prompt="1234", max_tokens=24, temperature=0).choices[0].text
    penalized = (
        api.completions.create(
            model="tiny-chat",
            prompt="1234",
            max_tokens=24,
            temperature=0,
            frequency_penalty=2.0,
            extra_body={"repetition_penalty": 1.5},
        )
        .choices[0]
        .text
    )
    assert plain != penalized
    # ignore_eos (vLLM's and llama.cpp's extension): a reply that ends with EOS goes on to max_tokens.
    ended = [api.completions.create(model="tiny-chat", prompt=p, max_tokens=60, temperature=0) for p in PROMPTS]
    prompt, stopped = next((p, a) for p, a in zip(PROMPTS, ended) if a.choices[0].finish_reason == "stop")
    assert stopped.usage.completion_tokens < 60
    longer = api.completions.create(
        model="tiny-chat", prompt=prompt, max_tokens=60, temperature=0, extra_body={"ignore_eos": True}
    )
    assert longer.usage.completion_tokens == 60 and longer.choices[0].finish_reason == "length"
    assert longer.choices[0].text.startswith(stopped.choices[0].text)


def test_next_chat_turn_reuses_the_slot_that_holds_its_conversation(server, reference):
    """The second turn of a conversation goes to the slot holding the first (its prompt and the reply tokens
    fed back), prefills only the rest (usage.prompt_tokens_details.cached_tokens), and answers as a fresh
    prefill of the whole conversation would."""
    url, _ = server
    model, tokenizer = reference
    api = client(url)
    first = [{"role": "user", "content": "fox jumps"}]
    reply = api.chat.completions.create(model="tiny-chat", messages=first, max_tokens=12, temperature=0)
    second = first + [
        {"role": "assistant", "content": reply.choices[0].message.content},
        {"role": "user", "content": "lazy dog."},
    ]
    ids1, ids2 = encode_conversation(tokenizer, first), encode_conversation(tokenizer, second)
    # The slot holds the first prompt and every reply token but the last (never fed back).
    held = (
        ids1 + generate(model, ids1, 12, eos_ids=tokenizer.eos_ids).raw_tokens[0][: reply.usage.completion_tokens - 1]
    )
    reused = next(i for i in range(len(ids2)) if i == len(ids2) - 1 or i == len(held) or ids2[i] != held[i])
    assert reused >= len(ids1), "the template should render the first turn's prompt alike in the second"
    expected, reason = greedy_reference(reference, ids2, 12)
    answer = api.chat.completions.create(model="tiny-chat", messages=second, max_tokens=12, temperature=0)
    assert answer.usage.prompt_tokens_details.cached_tokens == reused
    assert answer.choices[0].message.content == expected and answer.choices[0].finish_reason == reason


def test_concurrent_streams_each_equal_alone_and_a_late_one_starts_early(server, reference):
    url, _ = server
    _, tokenizer = reference
    lengths = [8 + 9 * i for i in range(len(PROMPTS))]
    lengths[0] = 200  # the longest runs while the late request arrives
    expected = [greedy_reference(reference, tokenizer.encode(p), n) for p, n in zip(PROMPTS, lengths)]
    assert expected[0][1] == "length"
    results, times = {}, {}

    def run(i, prompt, max_tokens):
        pieces = []
        for chunk in client(url).completions.create(
            model="tiny-chat", prompt=prompt, max_tokens=max_tokens, temperature=0, stream=True
        ):
            if chunk.choices[0].text and i not in times:
                times[i] = time.perf_counter()
            pieces.append(chunk.choices[0].text)
        results[i] = "".join(pieces), chunk.choices[0].finish_reason
        times[f"end{i}"] = time.perf_counter()

    threads = [threading.Thread(target=run, args=(i, p, n)) for i, (p, n) in enumerate(zip(PROMPTS, lengths))]
    for t in threads:
        t.start()
    while 0 not in times:
        time.sleep(0.01)
    late = threading.Thread(target=run, args=("late", "ab", 4))
    late.start()
    for t in threads + [late]:
        t.join(timeout=300)
    assert [results[i] for i in range(len(PROMPTS))] == expected
    assert times["late"] < times["end0"], "the late request waited for the longest one to end"


def test_a_choices_events_reach_the_request_in_groups_of_the_stream_interval():
    """server.submit's hand-off from the engine thread: a choice's first event alone (its time to first token), then
    interval events at a time; an event made STREAM_HOLD_S or more after the choice's one before (a step that ran a
    prefill) goes at once with those held, and so does an event that ends the choice (or an error). A whole answer
    (interval None) gets its first event, then the rest at the end. The choices of a request group apart, in the
    order the engine made their events."""
    job = Job(False, [[5, 6]], 2, 8, SamplingParams(), [], None, True, False, False, None, None, None, False)
    engine = types.SimpleNamespace(submit=lambda choices: None)
    late = 0.04 + 2 * STREAM_HOLD_S
    made_in_order = [(0, "a", 0.0), (1, "x", 0.0), (0, "b", 0.01), (1, "y", 0.01), (0, "c", 0.02), (1, "z!", 0.02)]
    made_in_order += [(0, "d", 0.03), (0, "e", 0.04), (0, "f", late), (0, "g", late + 0.01), (0, "h.", late + 0.02)]

    async def handed(interval):
        choices, sent = submit(job, engine, interval)
        for index, text, made in made_in_order:
            ended = (
                {"error": "fault"} if text.endswith("!") else {"finish_reason": "length"} if text.endswith(".") else {}
            )
            choices[index].send(Event(index, text, made=made, **ended))
        await asyncio.sleep(0)  # the hand-offs' callbacks run
        return ["".join(e.text for e in sent.get_nowait()) for _ in range(sent.qsize())]

    assert asyncio.run(handed(1)) == [text for _, text, _ in made_in_order]
    assert asyncio.run(handed(3)) == ["a", "x", "yz!", "bcd", "ef", "gh."]
    assert asyncio.run(handed(None)) == ["a", "x", "yz!", "bcdefgh."]


def test_a_stream_interval_sends_the_same_text(chat_checkpoint, reference, tmp_path):
    """server.py --stream_interval 3 --http_nice 7 --prefill_chunk 8 --prefill_chunk_while_decoding 3: concurrent
    streams (n = 2 choices each), whose prompts enter 3 tokens a turn while others decode, get the greedy text of
    the model alone, and the inter-token latency metric still counts each token after the first. The HTTP thread
    runs at nice 7 (on Linux, where nice is per thread), the engine's thread at 0."""
    flags = (
        "--stream_interval",
        "3",
        "--http_nice",
        "7",
        "--prefill_chunk",
        "8",
        "--prefill_chunk_while_decoding",
        "3",
    )
    process, url, log = start_server(chat_checkpoint / "model.pth", tmp_path, *flags)
    try:
        health = httpx.get(url + "/health").json()
        assert (health["prefill_chunk"], health["prefill_chunk_while_decoding"]) == (8, 3)
        if sys.platform == "linux":
            # /proc/PID/task/TID/stat: the 19th field is the nice value (counted after the name in parentheses)
            tasks = Path(f"/proc/{process.pid}/task")
            nice = {int(t.name): int((t / "stat").read_text().rsplit(")", 1)[1].split()[16]) for t in tasks.iterdir()}
            assert nice[process.pid] == 0 and 7 in nice.values()
        _, tokenizer = reference
        expected = {p: greedy_reference(reference, tokenizer.encode(p), 40) for p in PROMPTS[:6]}
        answers = queue.Queue()

        def ask(prompt):
            texts, reasons = ["", ""], [None, None]
            for chunk in client(url).completions.create(
                model="tiny-chat", prompt=prompt, max_tokens=40, temperature=0, n=2, stream=True
            ):
                for c in chunk.choices:
                    texts[c.index] += c.text
                    reasons[c.index] = c.finish_reason or reasons[c.index]
            answers.put((prompt, list(zip(texts, reasons))))

        threads = [threading.Thread(target=ask, args=(p,)) for p in expected]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=300)
        got = dict(answers.get_nowait() for _ in expected)
        assert got == {p: [expected[p]] * 2 for p in expected}
        before = metric_samples(url)
        done = list(
            client(url).completions.create(
                model="tiny-chat",
                prompt="The",
                max_tokens=10,
                temperature=0,
                stream=True,
                stream_options={"include_usage": True},
                extra_body={"ignore_eos": True},
            )
        )
        moved = metric_samples(url)[("gptfast_inter_token_latency_seconds_count", ())]
        assert done[-1].usage.completion_tokens == 10
        assert moved - before[("gptfast_inter_token_latency_seconds_count", ())] == 9
    finally:
        stop_server(process, log)


def test_bad_inputs_get_errors_and_the_server_goes_on(server):
    url, log = server
    auth = {"Authorization": f"Bearer {KEY}"}
    chat, text = url + "/v1/chat/completions", url + "/v1/completions"
    user = [{"role": "user", "content": "hi"}]
    cases = [
        (text, b"{not json", None),
        (text, b"[1, 2]", None),
        (text, b'"text"', None),
        (text, {"prompt": "x", "model": "gpt-4"}, "model"),
        (text, {"prompt": "x", "max_tokens": 0}, "max_tokens"),  # scoring only: needs echo
        (text, {"prompt": "x", "echo": "yes"}, "echo"),
        (text, {"prompt": "x", "max_tokens": 10**6}, "max_tokens"),
        (chat, {"messages": user, "max_completion_tokens": -1}, "max_completion_tokens"),
        (text, {"prompt": "x", "temperature": -0.5}, "temperature"),
        (text, {"prompt": "x", "top_p": 0}, "top_p"),
        (text, {"prompt": "x", "top_p": 1.5}, "top_p"),
        (text, {"prompt": "x", "n": 0}, "n"),
        (chat, {"messages": []}, "messages"),
        (chat, {"messages": "hi"}, "messages"),
        (chat, {"messages": [{"role": "wizard", "content": "hi"}]}, "messages[0].role"),
        (chat, {"messages": [{"role": "user", "content": ["hi"]}]}, "messages[0].content[0]"),
        (chat, {"messages": [{"role": "user", "content": []}]}, "messages[0].content"),
        (chat, {"messages": [{"role": "user", "content": None}]}, "messages[0].content"),
        (
            chat,
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
            "messages[0].content[0]",
        ),
        (chat, {"messages": [{"role": "user", "content": "\ud800"}]}, "messages"),
        (text, {"prompt": "\ud800"}, "prompt"),
        (text, b"[" * 100000 + b"]" * 100000, None),
        (text, b'{"prompt": "x", "max_tokens": ' + b"9" * 5000 + b"}", None),
        (text, {"prompt": "x " * 400}, "prompt"),
        (text, {"prompt": "x", "stop": ["a"] * 17}, "stop"),
        (text, {"prompt": "x", "stop": [""]}, "stop"),
        (text, {"prompt": "x", "temperature": "hot"}, "temperature"),
        (text, {"prompt": "x", "logprobs": 6}, "logprobs"),
        (chat, {"messages": user, "top_logprobs": 21, "logprobs": True}, "top_logprobs"),
        (text, {"prompt": [[1, 99999]]}, "prompt"),
        (text, {}, "prompt"),
        (chat, {"messages": user, "tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
        (text, {"prompt": "x", "logit_bias": {"5": 100}}, "logit_bias"),
        (
            chat,
            {"messages": user, "response_format": {"type": "json_schema", "json_schema": {"schema": 5}}},
            "response_format",
        ),
        (chat, {"messages": user, "response_format": {"type": "yaml"}}, "response_format"),
        (text, {"prompt": "x", "guided_json": {"type": "array", "uniqueItems": True}}, "guided_json"),
        (text, {"prompt": "x", "guided_json": 5}, "guided_json"),
        (text, {"prompt": "x", "guided_regex": "[a-"}, "guided_regex"),
        (text, {"prompt": "x", "guided_choice": []}, "guided_choice"),
        (text, {"prompt": "x", "guided_grammar": "root ::= ("}, "guided_grammar"),
        (text, {"prompt": "x", "guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
        (chat, {"messages": user, "tools": {"type": "function"}}, "tools"),
        (chat, {"messages": user, "tools": ["get_weather"]}, "tools[0]"),
        (chat, {"messages": user, "tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools[0]"),
        (chat, {"messages": user, "tool_choice": "required"}, "tool_choice"),
        (
            chat,
            {
                "messages": user,
                "tools": [{"type": "function", "function": {"name": "f"}}],
                "tool_choice": {"type": "function", "function": {"name": "g"}},
            },
            "tool_choice",
        ),
        (chat, {"messages": user, "functions": [{"name": "f"}]}, "functions"),
        (chat, {"messages": user, "chat_template_kwargs": {"messages": 1}}, "chat_template_kwargs"),
        (chat, {"messages": [{"role": "tool", "content": "1"}]}, "messages[0].tool_call_id"),
        (
            chat,
            {
                "messages": [
                    {
                        "role": "assistant",
                        "content": None,
                        "tool_calls": [{"function": {"name": "f", "arguments": "[1"}}],
                    }
                ]
            },
            "messages[0].tool_calls[0]",
        ),
    ]
    for endpoint, body, param in cases:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        r = httpx.post(endpoint, content=data, headers=auth | {"Content-Type": "application/json"})
        assert r.status_code == 400, (body, r.text)
        assert r.json()["error"]["param"] == param and r.json()["error"]["message"], (body, r.text)
    for endpoint, body, param in [
        ("/tokenize", {}, "content"),
        ("/tokenize", {"prompt": 5}, "prompt"),
        ("/tokenize", {"prompt": "x", "add_special_tokens": "yes"}, "add_special_tokens"),
        ("/tokenize", {"messages": "hi"}, "messages"),
        ("/detokenize", {"tokens": "hi"}, "tokens"),
        ("/detokenize", {"tokens": [-1]}, "tokens"),
    ]:
        r = httpx.post(url + endpoint, json=body)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (endpoint, body, r.text)
    r = httpx.post(text, content=b'{"prompt": "' + b"x" * (1 << 20) + b'"}', headers=auth)
    assert r.status_code == 413 and "exceeds" in r.json()["error"]["message"]
    before = metric_samples(url)
    assert httpx.get(url + "/v1/models").status_code == 401
    assert httpx.get(url + "/v1/models", headers={"Authorization": "Bearer wrong"}).status_code == 401
    assert httpx.get(url + "/v1/models", headers=auth).status_code == 200
    after = metric_samples(url)
    for status, count in [("401", 2), ("200", 1)]:
        key = ("gptfast_requests_total", (("endpoint", "/v1/models"), ("status", status)))
        assert after[key] - before.get(key, 0) == count
    assert httpx.get(url + "/health").status_code == 200  # outside /v1: no key
    ok = httpx.post(text, json={"prompt": "x", "max_tokens": 2}, headers=auth)
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] >= 1
    log.flush()
    assert "Traceback" not in Path(log.name).read_text()


def test_a_port_in_use_ends_the_second_server_with_one_line(server, chat_checkpoint):
    url, _ = server
    port = url.rsplit(":", 1)[1]
    second = subprocess.run(
        [sys.executable, str(ROOT / "server.py"), "--checkpoint_path", str(chat_checkpoint), "--port", port],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
    )
    assert (
        second.returncode == 1
        and second.stderr.splitlines()[-1] == f"error: cannot listen on 127.0.0.1:{port} (uvicorn's error above)"
    )
    assert "Traceback" not in second.stderr and httpx.get(url + "/health").status_code == 200


@pytest.mark.skipif(not SMOLLM2_DIR.joinpath("model.pth").is_file(), reason="needs scripts/prepare.sh")
def test_disconnect_frees_the_slot_and_a_full_queue_answers_429(tmp_path):
    """One slot, one waiting place: a long stream holds the slot, a second request waits, a third gets 429; when
    the first client goes away mid-stream, its slot goes to the waiting request at once."""
    process, url, log = start_server(SMOLLM2_DIR / "model.pth", tmp_path, "--max_batch_size", "1", "--max_queue", "1")
    try:
        body = {"prompt": "Once upon a time", "max_tokens": 1000, "temperature": 0, "stream": True}
        with httpx.Client(timeout=120) as first:
            with first.stream("POST", url + "/v1/completions", json=body) as stream:
                lines = stream.iter_lines()
                assert next(lines).startswith("data: ")
                waiting = queue.Queue()
                second = threading.Thread(
                    target=lambda: waiting.put(
                        httpx.post(url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, timeout=120)
                    )
                )
                second.start()
                while httpx.get(url + "/health").json()["waiting"] == 0:
                    time.sleep(0.05)
                full = httpx.post(url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2})
                assert full.status_code == 429 and full.json()["error"]["type"] == "rate_limit_error"
            # The stream is closed here, some 998 tokens early: ~60 s of decoding at SmolLM2's eager pace.
        answer = waiting.get(timeout=30)
        assert answer.status_code == 200
        second.join()
        log.seek(0)
        first_line = next(line for line in log if "prompt_tokens=4 " in line)
        assert int(first_line.split("completion_tokens=")[1].split()[0]) < 100, first_line
    finally:
        stop_server(process, log)


def test_compiled_engine_batches_without_recompiling(tiny_checkpoint):
    """The engine in-process, compiled: warm_up compiles the graphs of its few batch sizes (powers of two, greedy
    and sampled), and then requests of different lengths coming and going, greedy and sampled, over windows of
    the cache of every length (from 8 rows, one for each group of 4 rows), with grammars or without, compile
    nothing; each greedy request's text is its greedy text alone."""
    model = load_model(tiny_checkpoint / "model.pth")
    tokenizer = load_tokenizer(tiny_checkpoint)
    engine = Engine(model, tokenizer, 8, 256, compile_steps(torch.device("cpu")), max_queue=8)
    counters = torch._dynamo.utils.counters
    counters.clear()
    engine.warm_up()
    assert counters["stats"]["unique_graphs"] == 2 * len([1, 2, 4, 8]) and not counters["graph_break"]
    counters.clear()
    engine.thread.start()

    wave = lambda *args: run_wave(engine, tokenizer, *args)  # noqa: E731
    alone = lambda p, n: Stream(load_model(tiny_checkpoint / "model.pth"), tokenizer, p, n).run().texts[0]  # noqa: E731
    # Lengths whose steps attend to windows of 128 slots and of the most (255: one fewer than the cache holds).
    lengths, greedy, hot = [5, 140, 9, 230, 3, 12], SamplingParams(), SamplingParams(temperature=0.8, seed=1)
    texts = wave(PROMPTS[:6], lengths, [greedy, hot] * 3)
    assert texts[::2] == [alone(p, n) for p, n in zip(PROMPTS[:6:2], lengths[::2])]
    texts = wave(PROMPTS[6:12], lengths[::-1], [greedy] * 6)
    assert texts == [alone(p, n) for p, n in zip(PROMPTS[6:12], lengths[::-1])]
    vocabulary = grammar_vocabulary(tiny_checkpoint / "tokenizer.json", model.config.vocab_size, tokenizer.eos_ids)
    words = [new_matcher(regex_grammar("[a-z]{3,12}"), vocabulary) if i % 2 == 0 else None for i in range(4)]
    texts = wave(PROMPTS[:4], [40] * 4, [hot, greedy] * 2, words)
    assert all(re.fullmatch("[a-z]{3,12}", t) for t in texts[::2]), texts
    assert texts[1::2] == [alone(p, 40) for p in PROMPTS[1:4:2]]
    assert counters["stats"]["unique_graphs"] == 0


def test_compiled_engine_fills_long_prompts_in_pieces_of_its_two_widths(tiny_checkpoint):
    """Compiled, warm_up compiles the fill of a long prompt's pieces at both widths (prefill_chunk 48, 16 beside
    streams). A 180-token prompt arriving beside a running stream enters in pieces of 16 while it runs and of 48
    once it has ended, the last piece (which samples) eagerly; nothing compiles while serving, and both get their
    greedy text alone. (A compiled fill whose output nobody uses would drop its cache writes: the long prompt's
    text would not be its own.)"""
    tokenizer = load_tokenizer(tiny_checkpoint)
    engine = Engine(
        load_model(tiny_checkpoint / "model.pth"),
        tokenizer,
        2,
        256,
        compile_steps(torch.device("cpu")),
        8,
        prefill_chunk=48,
        prefill_chunk_while_decoding=16,
    )
    torch._dynamo.reset()  # the graphs of the engines before with the same cache shapes, which it would reuse
    counters = torch._dynamo.utils.counters
    counters.clear()
    engine.warm_up()
    assert engine.fill_widths() == [16, 48]
    assert counters["stats"]["unique_graphs"] == 2 * len(engine.batch_sizes) + 2 and not counters["graph_break"]
    counters.clear()
    rng = random.Random(7)
    running, long = greedy_choice(0, random_ids(rng, 10), 4), greedy_choice(1, random_ids(rng, 180), 8)
    engine.submit([running])
    engine.step()
    engine.submit([long])
    run_steps(engine, [running, long])
    row = next(step[1] for step in engine.steps_taken if step[0] == "prefill" and step[2] == 16)
    sizes = [step[2] for step in engine.steps_taken if step[0] == "prefill" and step[1] == row]
    assert sum(sizes) == 180 and 16 in sizes and 48 in sizes and set(sizes[:-1]) <= {16, 48}, sizes
    assert counters["stats"]["unique_graphs"] == 0
    alone = load_model(tiny_checkpoint / "model.pth")
    for c in (running, long):
        assert_same_greedy(
            alone, c.ids, c.tokens, Stream(alone, tokenizer, c.ids, c.max_tokens).run().raw_tokens[0], 1e-3
        )


def run_wave(engine, tokenizer, prompts, lengths, params, matchers=None, predictions=None) -> list[str]:
    """Submits one choice per prompt (text or token ids) to a running engine at once; their texts."""
    events = queue.Queue()
    choices = [
        Choice(i, tokenizer.encode(p) if isinstance(p, str) else p, n, q, [], None, events.put, matcher=m, prediction=r)
        for i, (p, n, q, m, r) in enumerate(
            zip(prompts, lengths, params, matchers or [None] * len(prompts), predictions or [None] * len(prompts))
        )
    ]
    engine.submit(choices)
    texts, done = [""] * len(choices), 0
    while done < len(choices):
        e = events.get(timeout=300)
        assert e.error is None, e
        texts[e.index] += e.text
        done += e.finish_reason is not None
    return texts


@pytest.fixture(scope="module")
def long_checkpoint(tiny_tokenizer_json, tmp_path_factory) -> Path:
    """The tiny model's shape with a context of 2048 positions: room for prompts of 1,500 tokens."""
    folder = tmp_path_factory.mktemp("long")
    make_hf_llama(folder / "hf", tiny_tokenizer_json, num_key_value_heads=2, max_position_embeddings=2048)
    convert_hf_checkpoint(folder / "hf", folder / "long")
    return folder / "long"


def test_the_kv_cache_takes_the_slots_and_length_its_budget_holds():
    """server.kv_cache_shape, a budget of 20,000 positions of 1,000 bytes and a context of 4,096: by default whole
    contexts, as many as fit up to DEFAULT_SLOTS; slots given share the budget; a length given is filled with slots;
    what the budget cannot hold is refused. With rolling caches (here 800 of the 1,000 bytes in rings of 600
    positions), a slot's bytes grow with its full layers alone past the ring: twice the slots fit."""
    per_position, context = 1000, 4096
    budget = 20_000 * per_position
    assert DEFAULT_SLOTS == 8

    def shape(budget, slots, length):
        return kv_cache_shape(budget, lambda n, positions: n * positions * per_position, context, slots, length)

    assert shape(budget, None, None) == (4, 4096)  # 4 x 4096 = 16,384 positions
    assert shape(10**6 * per_position, None, None) == (8, 4096)
    assert shape(3000 * per_position + 999, None, None) == (1, 3000)
    assert shape(budget, 16, None) == (16, 1250)
    assert shape(budget, None, 1000) == (8, 1000)  # 8 is the most by default
    assert shape(budget, None, 3000) == (6, 3000)
    assert shape(budget, 2, 10_000) == (2, 4096)  # no longer than the context
    assert shape(budget, 5, None) == (5, 4000)
    for slots, length in ((6, 4096), (5, 4096), (20_000, None)):
        with pytest.raises(ValueError, match="more than the budget"):
            shape(budget, slots, length)
    with pytest.raises(ValueError, match="more than the budget"):
        shape(per_position, None, None)  # one position: no prompt and reply

    def rolling(n, positions):
        return n * (200 * positions + 800 * min(positions, 600))

    assert kv_cache_shape(budget, rolling, context, None, None) == (8, 4096)  # 15 would fit: 1,299,200 bytes each
    assert kv_cache_shape(budget, rolling, context, 16, None) == (16, 3850)  # 16 x (770,000 + 480,000) bytes
    assert kv_cache_shape(budget, rolling, context, 32, None) == (32, 725)  # 32 x (145,000 + 480,000) bytes


def test_a_server_sizes_its_slots_to_its_kv_cache_budget(chat_checkpoint, tmp_path):
    """--kv_cache_memory of 3.5 whole contexts of the tiny model: 3 slots of its 256 positions, as /health, /metrics
    and the start-up line say, with the bytes of float32 keys and values of every layer and KV head. A prompt longer
    than a slot gets a 400 naming the prompt, and the server goes on; a request's positions count as used while it
    runs, and no longer."""
    config = json.loads((chat_checkpoint / "config.json").read_text())
    per_position = 2 * config["n_layer"] * config["n_kv_heads"] * config["head_dim"] * 4  # K and V, float32
    assert config["block_size"] == 256
    gib = 3.5 * 256 * per_position / 2**30
    process, url, log = start_server(chat_checkpoint / "model.pth", tmp_path, "--kv_cache_memory", repr(gib))
    try:
        health = httpx.get(url + "/health").json()
        assert (health["slots"], health["max_seq_length"]) == (3, 256)
        assert health["kv_cache_bytes"] == 3 * 256 * per_position and health["kv_cache_positions"] == 3 * 256
        assert health["kv_cache_budget_bytes"] == int(gib * 2**30)
        assert (health["prefill_chunk"], health["prefill_chunk_while_decoding"]) == (256, 256)  # the defaults
        assert "3 slots of 256 positions" in open(log.name).read()
        r = httpx.post(url + "/v1/completions", json={"prompt": [5] * 257, "max_tokens": 1})
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text
        r = httpx.post(url + "/v1/completions", json={"prompt": [5] * 30, "max_tokens": 4, "ignore_eos": True})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4, r.text
        samples = metric_samples(url)
        assert samples[("gptfast_kv_cache_positions", ())] == 768 and samples[("gptfast_slots", ())] == 3
        assert samples[("gptfast_kv_cache_used_positions", ())] == 0
    finally:
        stop_server(process, log)
    tokenizer = load_tokenizer(chat_checkpoint)
    engine = Engine(load_model(chat_checkpoint / "model.pth"), tokenizer, 2, 64, Steps(), 8)
    choice = greedy_choice(0, random_ids(random.Random(0), 10), 20)
    engine.submit([choice])
    engine.step()
    engine.step()
    # The prompt and every token fed back so far (the newest is fed at the next step).
    assert engine.kv_cache_figures()["kv_cache_used_positions"] == 10 + len(choice.tokens) - 1 > 10
    run_steps(engine, [choice])
    assert engine.kv_cache_figures()["kv_cache_used_positions"] == 0


def random_ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, TINY_VOCAB) for _ in range(n)]  # no BOS, EOS or padding


def run_steps(engine: Engine, choices: list[Choice]):
    """Drives the engine's loop in this thread until the choices have ended."""
    while any(not c.cancelled and (not c.tokens or holds(engine, c)) for c in choices):
        engine.step()


def holds(engine: Engine, choice: Choice) -> bool:
    return any(c is choice for c in engine.slots)


def greedy_choice(index: int, ids: list[int], max_tokens: int, events=None) -> Choice:
    return Choice(index, ids, max_tokens, SamplingParams(), [], None, (events or queue.Queue()).put)


def test_chunked_prefill_gives_each_prompt_its_text_alone(long_checkpoint):
    """Prompts of mixed lengths entering in chunks of 7 tokens (several prompts' chunks in one loop's turn, a
    prompt's chunks between decode steps of the others) get the greedy text they get prefilled whole, and alone."""
    tokenizer = load_tokenizer(long_checkpoint)
    rng = random.Random(0)
    prompts = [random_ids(rng, n) for n in (3, 40, 7, 150, 16, 61)]
    texts = {}
    for chunk in (7, 10_000):
        engine = Engine(load_model(long_checkpoint / "model.pth"), tokenizer, 4, 512, Steps(), 8, prefill_chunk=chunk)
        engine.thread.start()
        texts[chunk] = run_wave(engine, tokenizer, prompts, [12] * 6, [SamplingParams()] * 6)
        assert engine.counts["prefilled_tokens"] == sum(map(len, prompts))
    alone = load_model(long_checkpoint / "model.pth")
    assert texts[7] == texts[10_000] == [Stream(alone, tokenizer, p, 12).run().texts[0] for p in prompts]


def test_an_int8_kv_cache_serves_each_request_as_alone(long_checkpoint):
    """--kv_cache_dtype int8 in the engine: prompts entering in chunks of 7 beside decode steps, and the second of
    two choices copying the first's prompt (codes and scales), get the greedy tokens of the same int8 cache alone,
    but where logits are within 1e-2 (batched, rounding can move a value across a code's boundary, a step of 1/127
    of its head's largest value; codes read without their scales move logits by O(1))."""
    tokenizer = load_tokenizer(long_checkpoint)
    model, alone = load_model(long_checkpoint / "model.pth"), load_model(long_checkpoint / "model.pth")
    model.kv_cache_dtype = alone.kv_cache_dtype = torch.int8
    engine = Engine(model, tokenizer, 4, 512, Steps(), 8, prefill_chunk=7)
    assert model.layers[0].attention.kv_cache.k_cache.dtype == torch.int8
    rng = random.Random(6)
    prompts = [random_ids(rng, n) for n in (3, 40, 61)]
    choices = [greedy_choice(i, ids, 12) for i, ids in enumerate(prompts + prompts[1:2])]
    engine.submit(choices)
    run_steps(engine, choices)
    assert choices[3].reused == 39 and engine.counts["copied_prompt_tokens"] == 39
    for c in choices:
        assert_same_greedy(alone, c.ids, c.tokens, Stream(alone, tokenizer, c.ids, 12).run().raw_tokens[0], 1e-2)


def test_a_long_prompt_enters_in_chunks_between_decode_steps_of_a_running_stream(long_checkpoint):
    """A 1,500-token prompt arriving while a stream runs enters in chunks: of 256 tokens (prefill_chunk) by default,
    and with prefill_chunk_while_decoding 64, of 64 while the stream runs and of 256 once it has ended. A decode step
    of the running stream comes between each two of its chunks (the engine's step log); both get their greedy text
    alone."""
    tokenizer = load_tokenizer(long_checkpoint)
    alone = load_model(long_checkpoint / "model.pth")
    for while_decoding, max_tokens in ((None, 60), (64, 12)):
        rng = random.Random(1)
        model = load_model(long_checkpoint / "model.pth")
        engine = Engine(model, tokenizer, 2, 2048, Steps(), 8, prefill_chunk_while_decoding=while_decoding)
        running = greedy_choice(0, random_ids(rng, 20), max_tokens)
        engine.submit([running])
        engine.step()
        assert running.tokens, "one turn prefills a short prompt and decodes"
        long = greedy_choice(1, random_ids(rng, 1500), 5)
        engine.submit([long])
        run_steps(engine, [running, long])
        log = list(engine.steps_taken)
        streaming_row = log[0][1]
        chunks = [i for i, step in enumerate(log) if step[0] == "prefill" and step[1] != streaming_row]
        beside_stream = [log[i + 1][0] == "decode" and streaming_row in log[i + 1][1] for i in chunks]
        sizes = [log[i][2] for i in chunks]
        assert sum(sizes) == 1500
        if while_decoding is None:
            assert sizes == [256] * 5 + [220] and all(beside_stream), log
        else:  # the stream decodes beside the first chunks, one a turn, until it ends
            beside = beside_stream.count(True)
            assert beside >= 3 and beside_stream == [True] * beside + [False] * (len(chunks) - beside), str(log)
            assert sizes[:beside] == [64] * beside and sizes[beside:-1] == [256] * (len(chunks) - beside - 1), sizes
        for c in (running, long):
            assert c.tokens == Stream(alone, tokenizer, c.ids, c.max_tokens).run().raw_tokens[0]


def test_a_short_prompt_arriving_while_a_long_one_enters_starts_at_the_next_turn(long_checkpoint):
    """With prefill_chunk_while_decoding 64, a 10-token prompt arriving while a 1,500-token one enters beside a
    running stream is prefilled whole in the next turn, the long prompt's piece in that turn shrinking to the 54
    tokens left, and its stream decodes from then on; all three get their greedy text alone."""
    tokenizer = load_tokenizer(long_checkpoint)
    rng = random.Random(3)
    engine = Engine(
        load_model(long_checkpoint / "model.pth"), tokenizer, 4, 2048, Steps(), 8, prefill_chunk_while_decoding=64
    )
    running, long = greedy_choice(0, random_ids(rng, 20), 30), greedy_choice(1, random_ids(rng, 1500), 3)
    engine.submit([running])
    engine.step()
    engine.submit([long])
    for _ in range(3):
        engine.step()
    short = greedy_choice(2, random_ids(rng, 10), 4)
    engine.submit([short])
    taken = len(engine.steps_taken)
    engine.step()
    rows = {c.index: next(r for r, s in enumerate(engine.slots) if s is c) for c in (running, long, short)}
    turn = list(engine.steps_taken)[taken:]
    assert turn[:2] == [("prefill", rows[2], 10), ("prefill", rows[1], 54)], turn
    assert turn[2][0] == "decode" and {rows[0], rows[2]} <= set(turn[2][1]), turn
    run_steps(engine, [running, long, short])
    alone = load_model(long_checkpoint / "model.pth")
    for c in (running, long, short):
        assert c.tokens == Stream(alone, tokenizer, c.ids, c.max_tokens).run().raw_tokens[0]


def test_long_prompts_gather_in_one_group_of_rows_with_a_window_of_its_own(long_checkpoint):
    """Eight slots attend in two groups of four (decode.window_groups). Of eight requests arriving together, the first
    and the fifth carry 300-token prompts: rows swap slots so that both are in one group, and the short prompts
    (each fitting in a turn's budget) prefill first, then the long ones, each kind in arrival order. A third
    300-token prompt, coming later into the slot a short request of the other group left, joins them there, swapping
    with a running stream. The other group's steps attend to a window of its short rows' length, and every answer
    (but the one left) equals the answer alone."""
    tokenizer = load_tokenizer(long_checkpoint)
    rng = random.Random(5)
    engine = Engine(load_model(long_checkpoint / "model.pth"), tokenizer, 8, 2048, Steps(), 8, prefill_chunk=32)
    lengths = [300, 10, 10, 10, 300, 10, 10, 10]
    choices = [greedy_choice(i, random_ids(rng, n), 40) for i, n in enumerate(lengths)]
    engine.submit(choices)
    first_turn = {}  # row: the loop's turn that prefilled its first chunk
    for turn in itertools.count():
        taken = len(engine.steps_taken)
        engine.step()
        if turn == 0:
            rows = [next(r for r, c in enumerate(engine.slots) if c is choice) for choice in choices]
        for step in list(engine.steps_taken)[taken:]:
            if step[0] == "prefill":
                first_turn.setdefault(step[1], turn)
        if not engine.prefilling:
            break
    assert rows[0] // 4 == rows[4] // 4 and sorted(rows) == list(range(8))
    turns = [first_turn[r] for r in rows]
    short, long = [t for t, n in zip(turns, lengths) if n == 10], [t for t, n in zip(turns, lengths) if n == 300]
    assert short == sorted(short) and max(short) <= min(long) and long[0] < long[1], turns
    left = next(c for c, r in zip(choices, rows) if r // 4 != rows[0] // 4)
    left.cancelled = True  # its client went away
    while holds(engine, left):
        engine.step()
    later = greedy_choice(8, random_ids(rng, 300), 10)
    engine.submit([later])
    while engine.prefilling or not later.tokens:
        engine.step()
    long_rows = [next(r for r, c in enumerate(engine.slots) if c is choice) for choice in choices[0:5:4] + [later]]
    assert len({r // 4 for r in long_rows}) == 1 and engine.counts["swapped_rows"] == 4, long_rows
    windows = [w.shape[0] for w in engine.windows(8)]
    long_window, short_window = windows if long_rows[0] < 4 else windows[::-1]
    assert long_window > 300 and short_window <= 64
    run_steps(engine, choices + [later])
    alone = load_model(long_checkpoint / "model.pth")
    for c in [c for c in choices if c is not left] + [later]:
        assert c.tokens == Stream(alone, tokenizer, c.ids, c.max_tokens).run().raw_tokens[0]


def test_a_prefix_held_by_any_slot_is_copied_and_never_read_stale(long_checkpoint):
    """Two slots. Two prompts share 1,000 tokens, the first still decoding when the second comes: the second
    copies them from the first's slot (cached_tokens 1,000; 3 tokens prefilled) and answers as alone. Then both
    slots are overwritten by prompts sharing 300 and 1 of those tokens; a third prompt of the same 1,000 finds
    the 300 still held, prefills the rest, and answers as alone. The n choices of one request share one
    prefill."""
    tokenizer = load_tokenizer(long_checkpoint)
    rng = random.Random(2)
    prefix = random_ids(rng, 1000)
    engine = Engine(load_model(long_checkpoint / "model.pth"), tokenizer, 2, 2048, Steps(), 8)
    alone_model = load_model(long_checkpoint / "model.pth")
    alone = lambda c: Stream(alone_model, tokenizer, c.ids, c.max_tokens).run().raw_tokens[0]  # noqa: E731
    first = greedy_choice(0, prefix + random_ids(rng, 4), 40)
    engine.submit([first])
    while not first.tokens:
        engine.step()
    second = greedy_choice(1, prefix + random_ids(rng, 3), 10)
    engine.submit([second])
    run_steps(engine, [second])
    assert holds(engine, first), "the first should still be running"
    assert second.reused == 1000 and engine.counts["copied_prompt_tokens"] == 1000
    assert [s[2] for s in engine.steps_taken if s[0] == "prefill"][-1] == 3
    run_steps(engine, [first])
    assert first.tokens == alone(first) and second.tokens == alone(second)
    overwriting = greedy_choice(2, prefix[:300] + random_ids(rng, 200), 30)
    unrelated = greedy_choice(3, prefix[:1] + random_ids(rng, 49), 30)
    engine.submit([overwriting, unrelated])
    engine.step()
    assert not any(held[:1000] == prefix for held in engine.cached)
    third = greedy_choice(4, prefix + random_ids(rng, 5), 10)
    engine.submit([third])
    run_steps(engine, [overwriting, unrelated, third])
    assert third.reused == 300 and third.tokens == alone(third) and overwriting.tokens == alone(overwriting)
    # n = 3 choices of one request: one prefill of the prompt, then each other choice copies it and feeds its
    # last token in the next decode step.
    engine = Engine(load_model(long_checkpoint / "model.pth"), tokenizer, 4, 2048, Steps(), 8)
    ids = random_ids(rng, 100)
    choices = [greedy_choice(i, ids, 8) for i in range(3)]
    engine.submit(choices)
    run_steps(engine, choices)
    assert [c.reused for c in choices] == [0, 99, 99]
    assert [s for s in engine.steps_taken if s[0] == "prefill"] == [("prefill", 0, 100)]
    assert all(c.tokens == alone(c) for c in choices)


def test_requests_take_the_lowest_slots_and_what_those_held_is_set_aside(long_checkpoint):
    """A decode step runs rows 0..n-1, so a request takes the lowest free slot, and what that slot held moves to
    the free slot holding the fewest tokens: a document read in slot 0 survives a short prompt taking slot 0, and
    its next question finds it (900 tokens reused). Every step stays at the fewest rows, and every answer equals
    the answer alone."""
    tokenizer = load_tokenizer(long_checkpoint)
    rng = random.Random(4)
    model = load_model(long_checkpoint / "model.pth")
    engine = Engine(model, tokenizer, 4, 2048, Steps(), 8)
    alone_model = load_model(long_checkpoint / "model.pth")
    alone = lambda c: Stream(alone_model, tokenizer, c.ids, c.max_tokens).run().raw_tokens[0]  # noqa: E731
    document, question = random_ids(rng, 900), random_ids(rng, 20)
    chats = [greedy_choice(i, question + random_ids(rng, 5), 3) for i in range(3)]
    engine.submit(chats)
    run_steps(engine, chats)
    first_chat = list(engine.cached[0])
    reading = greedy_choice(3, document + random_ids(rng, 5), 3)
    engine.submit([reading])
    run_steps(engine, [reading])
    assert engine.cached[0][:900] == document, "the lowest free slot"
    assert engine.cached[3] == first_chat, "what slot 0 held, set aside in the empty slot"
    # Its keys as prefilled alone, but for the rounding of a prefill against decode steps (a stale one is O(1) off)
    k_cache = model.layers[0].attention.kv_cache.k_cache
    torch.testing.assert_close(
        k_cache[3, :, : len(first_chat)], alone_cache(alone_model, first_chat), atol=1e-4, rtol=0
    )
    steps_before = len(engine.steps_taken)
    later = [greedy_choice(4, question + random_ids(rng, 5), 3), greedy_choice(5, document + random_ids(rng, 4), 3)]
    engine.submit(later)
    engine.step()
    assert engine.slots[0] is later[0] and later[0].reused == 20
    assert engine.slots[1] is later[1] and later[1].reused == 900  # copied from where the document was set aside
    run_steps(engine, later)
    assert engine.counts["set_aside_tokens"] == len(first_chat) + len(reading.ids) + 2
    decoded_rows = [max(s[1]) for s in list(engine.steps_taken)[steps_before:] if s[0] == "decode"]
    assert decoded_rows and max(decoded_rows) == 1, "rows 0 and 1 only"
    assert all(c.tokens == alone(c) for c in chats + [reading] + later)


def alone_cache(model, ids: list[int]) -> torch.Tensor:
    """The first layer's keys of ids [H_kv, len(ids), D], prefilled alone in a fresh cache."""
    model.setup_caches(1, len(ids) + 1)
    with torch.no_grad():
        model(torch.tensor([ids]), torch.arange(len(ids)))
    return model.layers[0].attention.kv_cache.k_cache[0, :, : len(ids)]


def test_a_prompt_whose_client_left_frees_its_slot_at_the_next_chunk_and_arrival_order_holds(long_checkpoint):
    """One slot: a 1,000-token prompt enters in chunks of 64; its client goes away after the first, and the slot
    is free after the next turn, with no more chunks of it. Choices waiting for the slot take it in the order they
    came."""
    tokenizer = load_tokenizer(long_checkpoint)
    rng = random.Random(3)
    engine = Engine(load_model(long_checkpoint / "model.pth"), tokenizer, 1, 2048, Steps(), 8, prefill_chunk=64)
    events = queue.Queue()
    gone = greedy_choice(0, random_ids(rng, 1000), 5, events)
    waiting = [greedy_choice(i, random_ids(rng, 10 + i), 3, events) for i in (1, 2, 3)]
    engine.submit([gone])
    engine.submit(waiting)
    engine.step()
    assert list(engine.steps_taken) == [("prefill", 0, 64)]
    gone.cancelled = True
    engine.step()
    assert not holds(engine, gone) and list(engine.steps_taken) == [("prefill", 0, 64)]
    run_steps(engine, waiting)
    firsts = []
    while not events.empty():
        e = events.get()
        assert e.index != 0
        if e.index not in firsts:
            firsts.append(e.index)
    assert firsts == [1, 2, 3]


def sliding_checkpoint(folder: Path, tokenizer_json: Path) -> Path:
    """A tiny Qwen2 whose second layer slides with a window of 8, the first attending to every position."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    window = dict(num_key_value_heads=2, use_sliding_window=True, sliding_window=8, max_window_layers=1)
    make_hf_llama(folder / "hf", tokenizer_json, Qwen2ForCausalLM, Qwen2Config, **window)
    convert_hf_checkpoint(folder / "hf", folder / "ours")
    return folder / "ours"


@pytest.mark.parametrize("draft_name", [None, "int4 copy"])
def test_rolling_caches_serve_each_request_as_alone(tiny_tokenizer_json, tmp_path, draft_name):
    """A model with a sliding window of 8 in slots of 128 positions keeps rings of 8 + 5 - 1 slots (prefill chunks
    of 5 tokens) and the idle rows' reserved ones. Prompts up to 61 tokens, entering in chunks beside decode steps,
    with speculation (the model's int4 copy as its draft, with rings of its own: some drafts kept, some rejected) or
    without, get the greedy text they get alone through full-length caches; so do the conversations' next turns,
    which reuse what their slots held, and turns that part from them earlier than the rings reach, which are
    prefilled anew."""
    checkpoint = sliding_checkpoint(tmp_path, tiny_tokenizer_json)
    tokenizer = load_tokenizer(checkpoint)
    draft = None if draft_name is None else quantize_model(load_model(checkpoint), "int4", 32)
    k = 3 if draft is not None else 0
    engine = Engine(
        load_model(checkpoint), tokenizer, 4, 128, Steps(), 8, draft, k, round_costs=deepest(4, 3), prefill_chunk=5
    )
    for m in engine.models:
        sliding = m.layers[1].attention
        assert sliding.kind == "sliding_attention" and m.layers[0].attention.kv_cache.k_cache.shape[2] == 128
        assert sliding.kv_cache.k_cache.shape == (4, 2, 8 + 5 - 1 + k + 2, m.config.head_dim)
    engine.thread.start()
    reference = load_model(checkpoint)
    alone = lambda p, n: Stream(reference, tokenizer, p, n).run().texts[0]  # noqa: E731
    rng = random.Random(3)
    prompts = [random_ids(rng, n) for n in (3, 40, 7, 61)]
    lengths = [30, 12, 25, 12]
    texts = run_wave(engine, tokenizer, prompts, lengths, [SamplingParams()] * 4)
    assert texts == [alone(p, n) for p, n in zip(prompts, lengths)]
    if draft is not None:
        histogram = engine.speculation.summary()["accepted_length_histogram"]
        assert histogram[0] > 0 and sum(histogram[1:]) > 0
    prefilled = engine.counts["prefilled_tokens"]
    continued = [ids + ids[1:3] for ids in engine.cached if ids]
    texts = run_wave(engine, tokenizer, continued, [12] * len(continued), [SamplingParams()] * len(continued))
    assert texts == [alone(ids, 12) for ids in continued]
    assert engine.counts["prefilled_tokens"] - prefilled < sum(map(len, continued)) // 4, "the turns were reused"
    # Turns that part from what their slots hold 10 tokens before its end: the rings no longer hold what the common
    # prefix's end attends to (its last 8 positions), so neither that slot nor one it was set aside to is used.
    edited = [ids[:-10] + ids[1:3] for ids in engine.cached if len(ids) > 20]
    prefilled = engine.counts["prefilled_tokens"]
    texts = run_wave(engine, tokenizer, edited, [12] * len(edited), [SamplingParams()] * len(edited))
    assert texts == [alone(ids, 12) for ids in edited]
    assert engine.counts["prefilled_tokens"] - prefilled == sum(map(len, edited))


def test_a_prefix_is_copied_from_a_ring_only_while_the_ring_holds_its_window(tiny_tokenizer_json, tmp_path):
    """Rings of 8 + 5 - 1 slots. The second of two choices of one request copies the first's prompt from its ring
    (39 tokens reused). A prompt sharing 30 tokens with a slot that has decoded 20 more finds them gone from its
    ring (what position 30 attends to): it prefills them, and nothing is copied. Each answers as alone."""
    checkpoint = sliding_checkpoint(tmp_path, tiny_tokenizer_json)
    tokenizer, reference = load_tokenizer(checkpoint), load_model(checkpoint)
    alone = lambda c: Stream(reference, tokenizer, c.ids, c.max_tokens).run().raw_tokens[0]  # noqa: E731
    engine = Engine(load_model(checkpoint), tokenizer, 3, 128, Steps(), 8, prefill_chunk=5)
    ids = random_ids(random.Random(4), 40)
    twins = [greedy_choice(i, ids, 30) for i in range(2)]
    engine.submit(twins)
    while len(twins[0].tokens) < 20:
        engine.step()
    assert [c.reused for c in twins] == [0, 39] and engine.counts["copied_prompt_tokens"] == 39
    late = greedy_choice(2, ids[:30] + random_ids(random.Random(5), 5), 10)
    engine.submit([late])
    run_steps(engine, [late, *twins])
    assert late.reused == 0 and engine.counts["copied_prompt_tokens"] == 39
    assert all(c.tokens == alone(c) for c in [*twins, late])


@pytest.fixture(scope="module")
def unrelated_draft(tiny_tokenizer_json, tmp_path_factory) -> Path:
    """A smaller random model with the tiny one's tokenizer: its drafts are mostly rejected."""
    folder = tmp_path_factory.mktemp("draft")
    make_hf_llama(
        folder / "hf", tiny_tokenizer_json, seed=7, num_hidden_layers=1, num_key_value_heads=1, hidden_size=32
    )
    convert_hf_checkpoint(folder / "hf", folder / "draft")
    return folder / "draft" / "model.pth"


def deepest(slots: int, k: int) -> dict[int, dict[int, float]]:
    """An engine's round costs that make every step draft as many tokens as it can: all depths cost alike."""
    return {n: dict.fromkeys(depth_choices(k), 1.0) for n in range(1, slots + 1)}


@pytest.mark.parametrize("draft_name", ["itself", "unrelated"])
def test_speculative_engine_gives_each_request_its_own_text(tiny_checkpoint, unrelated_draft, draft_name):
    """With a draft, each greedy request still gets its own greedy text, whether the draft agrees with the model
    (every draft kept, a bonus token per round) or mostly not (rejections at every depth); a request with
    penalties, which speculation does not cover, gets its own text too while the others wait for it in
    one-token steps; a sampled request runs beside them. Rows come and go, and reuse slots."""
    model = load_model(tiny_checkpoint / "model.pth")
    tokenizer = load_tokenizer(tiny_checkpoint)
    draft = load_model(tiny_checkpoint / "model.pth" if draft_name == "itself" else unrelated_draft)
    engine = Engine(model, tokenizer, 4, 256, Steps(), 8, draft, speculate_k=3, round_costs=deepest(4, 3))
    engine.thread.start()
    reference = load_model(tiny_checkpoint / "model.pth")
    alone = lambda p, n, q=SamplingParams(): Stream(reference, tokenizer, p, n, sampling=q).run().texts[0]  # noqa: E731
    greedy, hot, penalized = (
        SamplingParams(),
        SamplingParams(temperature=0.8, seed=1),
        SamplingParams(repetition_penalty=1.3),
    )
    lengths = [30, 7, 41, 16, 3, 25]
    texts = run_wave(engine, tokenizer, PROMPTS[:6], lengths, [greedy, hot, greedy, greedy, greedy, greedy])
    rounds = sum(engine.speculation.histogram)  # rows' rounds that drafted
    plain = run_wave(engine, tokenizer, PROMPTS[6:10], lengths[:4], [greedy, penalized, greedy, greedy])
    assert sum(engine.speculation.histogram) > rounds  # once the request with penalties ended
    assert texts[::2] + texts[3:4] + texts[5:] == [
        alone(p, n)
        for p, n in zip(PROMPTS[:6:2] + PROMPTS[3:4] + PROMPTS[5:6], lengths[::2] + lengths[3:4] + lengths[5:])
    ]
    assert plain == [alone(p, n, q) for p, n, q in zip(PROMPTS[6:10], lengths, [greedy, penalized, greedy, greedy])]
    # Conversations going on: each prompt extends what a slot holds, which is not prefilled again.
    continued = [ids + ids[1:3] for ids in engine.cached if ids][:3]
    texts = run_wave(engine, tokenizer, continued, [12] * 3, [greedy] * 3)
    assert texts == [alone(ids, 12) for ids in continued]
    histogram = engine.speculation.summary()["accepted_length_histogram"]
    if draft_name == "itself":
        assert histogram[-1] > 0.9 * sum(histogram)  # its own drafts: kept but for rounding of near-ties
        # Same weights, same tokens: the draft's cache holds what the model's does (but for the last position
        # after a round that kept every draft), up to the rounding of batches (~1e-6); a stale position is O(1) off.
        for row, held in enumerate(engine.cached):
            for ours, its in zip(model.layers, draft.layers):
                a, b = ours.attention.kv_cache, its.attention.kv_cache
                torch.testing.assert_close(
                    b.k_cache[row, :, : len(held) - 1], a.k_cache[row, :, : len(held) - 1], atol=1e-4, rtol=0
                )
                torch.testing.assert_close(
                    b.v_cache[row, :, : len(held) - 1], a.v_cache[row, :, : len(held) - 1], atol=1e-4, rtol=0
                )
    else:
        assert histogram[0] > 0 and sum(histogram[1:]) > 0


@pytest.mark.parametrize("draft_name", ["itself", "unrelated"])
def test_engine_probes_a_draft_the_prior_keeps_off(tiny_checkpoint, unrelated_draft, draft_name):
    """Round costs where drafting pays only if most drafts are kept: the controller alone would decode plainly.
    Each request's first round probes the draft; the model's own copy is then followed, round after round, and
    an unrelated draft costs that one round (its next probe is further away than the request is long)."""
    model = load_model(tiny_checkpoint / "model.pth")
    tokenizer = load_tokenizer(tiny_checkpoint)
    draft = load_model(tiny_checkpoint / "model.pth" if draft_name == "itself" else unrelated_draft)
    costs = {0: 1.0, 2: 2.0, 3: 2.5}
    assert probe_depth(costs, 3) == 3
    engine = Engine(model, tokenizer, 1, 256, Steps(), 8, draft, speculate_k=3, round_costs={1: costs})
    engine.thread.start()
    reference = load_model(tiny_checkpoint / "model.pth")
    texts = run_wave(engine, tokenizer, PROMPTS[:1], [40], [SamplingParams()])
    assert texts == [Stream(reference, tokenizer, PROMPTS[0], 40).run().texts[0]]
    if draft_name == "itself":
        assert engine.step_depths[3] > engine.step_depths[0]
    else:
        assert engine.step_depths[3] == 1 and engine.step_depths[0] > 20


def test_compiled_speculative_engine_compiles_only_before_serving(tiny_checkpoint, unrelated_draft):
    """Compiled, with a draft: warm_up compiles, per batch size (1, 2) and greedy or sampled, the decode step,
    the draft's steps of two tokens and of one, and the verification at each depth; then requests (more than the slots,
    greedy, sampled and with penalties, whose steps are plain decode steps) compile nothing more, and each
    greedy one gets its greedy text alone."""
    model, draft = load_model(tiny_checkpoint / "model.pth"), load_model(unrelated_draft)
    tokenizer = load_tokenizer(tiny_checkpoint)
    steps = compile_steps(torch.device("cpu"))
    torch._dynamo.reset()  # the graphs of the engines before with the same cache shapes, which it would reuse
    engine = Engine(model, tokenizer, 2, 256, steps, 8, draft, speculate_k=3, round_costs=deepest(2, 3))
    counters = torch._dynamo.utils.counters
    counters.clear()
    engine.warm_up()
    # per batch size and greedy or sampled: the decode step, the draft's steps, the verification of 2 and 3 drafts
    assert counters["stats"]["unique_graphs"] == 2 * 2 * 5 and not counters["graph_break"]
    counters.clear()
    engine.thread.start()
    greedy, hot, penalized = (
        SamplingParams(),
        SamplingParams(temperature=0.8, seed=1),
        SamplingParams(repetition_penalty=1.3),
    )
    lengths = [140, 9, 230, 30]
    texts = run_wave(engine, tokenizer, PROMPTS[:4], lengths, [greedy, hot, greedy, penalized])
    assert counters["stats"]["unique_graphs"] == 0 and sum(engine.speculation.histogram) > 0
    reference = load_model(tiny_checkpoint / "model.pth")
    alone = lambda p, n, q: Stream(reference, tokenizer, p, n, sampling=q).run().texts[0]  # noqa: E731
    assert texts[::2] + texts[3:] == [
        alone(p, n, q)
        for p, n, q in zip(PROMPTS[0:4:2] + PROMPTS[3:4], lengths[::2] + lengths[3:], [greedy, greedy, penalized])
    ]


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_prompt_lookup_engine_gives_each_request_its_own_text(tiny_checkpoint, compiled):
    """Prompt lookup (ngram): rows draft from their context and their prediction, one depth for the step. A
    request whose prediction is its own greedy text keeps most drafts; requests with penalties or a grammar, which
    speculation does not cover, take the same steps with no drafts; each gets its own text. Compiled, warm_up
    compiles a verification per batch size and depth, and requests compile nothing more."""
    model, tokenizer = load_model(tiny_checkpoint / "model.pth"), load_tokenizer(tiny_checkpoint)
    vocabulary = grammar_vocabulary(tiny_checkpoint / "tokenizer.json", model.config.vocab_size, tokenizer.eos_ids)
    steps = compile_steps(torch.device("cpu")) if compiled else Steps()
    torch._dynamo.reset()  # the graphs of the engines before, which count towards the limit of graphs per function
    engine = Engine(
        model, tokenizer, 4, 256, steps, 8, speculate_k=4, vocabulary=vocabulary, ngram=True, round_costs=deepest(4, 4)
    )
    counters = torch._dynamo.utils.counters
    counters.clear()
    engine.warm_up()
    if compiled:  # per batch size (1, 2, 4), greedy or sampled: the decode step and the verification of 2 and 4 drafts
        assert counters["stats"]["unique_graphs"] == 3 * 2 * 3 and not counters["graph_break"]
    counters.clear()
    engine.thread.start()
    reference = load_model(tiny_checkpoint / "model.pth")
    alone = lambda p, n, q=SamplingParams(): Stream(reference, tokenizer, p, n, sampling=q).run()  # noqa: E731
    greedy, penalized = SamplingParams(), SamplingParams(repetition_penalty=1.3)
    lengths = [40, 30, 40, 25]
    expected = alone(PROMPTS[0], 40)
    word = new_matcher(regex_grammar("[a-z]{3,12}"), vocabulary)
    texts = run_wave(
        engine,
        tokenizer,
        PROMPTS[:4],
        lengths,
        [greedy, penalized, greedy, greedy],
        [None, None, word, None],
        [expected.tokens[0], None, None, None],
    )
    assert texts[0] == expected.texts[0] and texts[3] == alone(PROMPTS[3], 25).texts[0]
    assert texts[1] == alone(PROMPTS[1], 30, penalized).texts[0] and re.fullmatch("[a-z]{3,12}", texts[2])
    assert engine.speculation.kept >= 30  # the predicted request's, most of its 39 after the first
    assert engine.step_depths[4] > 0 and sum(engine.step_depths) == engine.counts["decode_steps"]
    assert counters["stats"]["unique_graphs"] == 0


def test_prompt_lookup_server_takes_predictions(chat_checkpoint, tmp_path):
    """server.py --ngram: a chat request's prediction (OpenAI's predicted outputs) is a source of drafts; the
    answer is the same with it or without it, and a prediction of the answer itself is mostly kept. A malformed
    prediction is a 400 naming the field."""
    process, url, log = start_server(chat_checkpoint / "model.pth", tmp_path, "--ngram")
    try:
        api = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)
        ask = functools.partial(
            api.chat.completions.create, model="tiny-chat", messages=[{"role": "user", "content": "Hi"}], temperature=0
        )
        plain = ask(max_tokens=32).choices[0].message.content
        kept = httpx.get(url + "/health").json()["speculation"]["acceptance_rate"]
        predicted = ask(max_tokens=32, prediction={"type": "content", "content": plain})
        assert predicted.choices[0].message.content == plain
        speculation = httpx.get(url + "/health").json()["speculation"]
        assert speculation["draft"] == "prompt lookup" and speculation["acceptance_rate"] > kept
        for bad in ({"type": "text", "content": "x"}, {"type": "content"}, "x"):
            with pytest.raises(openai.BadRequestError) as error:
                ask(max_tokens=4, prediction=bad)
            assert error.value.body["param"] == "prediction"
    finally:
        stop_server(process, log)


def test_speculative_server_answers_as_the_model_alone(chat_checkpoint, unrelated_draft, reference, tmp_path):
    """server.py --draft_checkpoint_path: concurrent greedy requests get the model's own greedy texts, from
    speculative rounds (their statistics in /health); a draft with another tokenizer is refused at start."""
    process, url, log = start_server(
        chat_checkpoint / "model.pth", tmp_path, "--draft_checkpoint_path", str(unrelated_draft), "--speculate_k", "3"
    )
    try:
        api = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)
        prompts, answers = PROMPTS[:4], queue.Queue()

        def ask(p):
            answers.put((p, api.completions.create(model="tiny-chat", prompt=p, max_tokens=24, temperature=0)))

        threads = [threading.Thread(target=ask, args=(p,)) for p in prompts]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for prompt, answer in (answers.get() for _ in prompts):
            expected = greedy_reference(reference, reference[1].encode(prompt), 24)
            assert (answer.choices[0].text, answer.choices[0].finish_reason) == expected
        # What the depth controller chose, from the round costs measured at start: in /health and /metrics alike.
        speculation = httpx.get(url + "/health").json()["speculation"]
        assert speculation["speculate_k"] == 3 and set(speculation["round_costs_s"]["4"]) == {"0", "2", "3"}
        samples = metric_samples(url)
        drafted = samples[("gptfast_speculative_drafted_tokens_total", ())]
        assert drafted == sum(d * rounds for d, rounds in enumerate(speculation["depth_histogram"]))
        assert samples[("gptfast_speculative_accepted_tokens_total", ())] == round(
            speculation["acceptance_rate"] * drafted
        )
        steps = [samples[("gptfast_speculative_steps_total", (("depth", str(d)),))] for d in range(4)]
        assert steps == speculation["step_depths"] and sum(steps) == samples[("gptfast_decode_steps_total", ())]
    finally:
        stop_server(process, log)
    refused = subprocess.run(
        [
            sys.executable,
            str(ROOT / "server.py"),
            "--checkpoint_path",
            str(chat_checkpoint),
            "--draft_checkpoint_path",
            str(SMOLLM2_DIR),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert refused.returncode == 1 and refused.stderr.strip().splitlines()[-1].startswith("error: the draft")


@contextlib.contextmanager
def chromium(tmp_path):
    """A headless Debian chromium driven by selenium (skips the test without one)."""
    binary, driver_path = shutil.which("chromium"), shutil.which("chromedriver")
    if not (binary and driver_path):
        pytest.skip("needs Debian's chromium and chromium-driver (scripts/test.sh installs them)")
    options = webdriver.ChromeOptions()
    options.binary_location = binary
    for flag in (
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        f"--user-data-dir={tmp_path / 'profile'}",
        "--window-size=900,700",
    ):
        options.add_argument(flag)
    browser = webdriver.Chrome(options=options, service=webdriver.ChromeService(executable_path=driver_path))
    try:
        yield browser
    finally:
        browser.quit()


def test_chat_page_streams_a_reply_in_a_browser(server, tmp_path):
    url, _ = server
    with chromium(tmp_path) as browser:
        browser.get(url + "/")
        for field, value in [("api_key", KEY + "\t"), ("temperature", "0"), ("max_tokens", "40")]:
            browser.find_element(By.ID, field).clear()
            browser.find_element(By.ID, field).send_keys(value)
        WebDriverWait(browser, 30).until(lambda b: b.find_element(By.ID, "model").text == "tiny-chat")
        # Every text the reply shows on its way: streamed, it grows in more than one step.
        browser.execute_script("""window.shown = new Set(); new MutationObserver(() => {
            const r = document.querySelector('.msg.assistant'); if (r) window.shown.add(r.textContent);
        }).observe(document.getElementById('log'), {childList: true, subtree: true, characterData: true});""")
        browser.find_element(By.ID, "input").send_keys("The quick brown\n")
        WebDriverWait(browser, 60).until(lambda b: "tokens/s" in b.find_element(By.ID, "stats").text)
        reply = browser.find_elements(By.CSS_SELECTOR, ".msg.assistant")
        assert len(reply) == 1, browser.page_source
        assert browser.find_elements(By.CSS_SELECTOR, ".msg.user")[0].text == "The quick brown"
        expected = client(url).chat.completions.create(
            model="tiny-chat", max_tokens=40, temperature=0, messages=[{"role": "user", "content": "The quick brown"}]
        )
        assert reply[0].get_property("textContent") == expected.choices[0].message.content
        assert len(browser.execute_script("return [...window.shown]")) >= 3, "the reply did not stream"


def test_chat_page_shows_a_tool_call_folded(tools_server, tmp_path):
    url, _ = tools_server
    with chromium(tmp_path) as browser:
        browser.get(url + "/")
        WebDriverWait(browser, 30).until(lambda b: b.find_element(By.ID, "model").text == "tiny-tools")
        browser.find_element(By.CSS_SELECTOR, "details.controls-tools summary").click()
        browser.find_element(By.ID, "tools").send_keys(json.dumps([WEATHER]))
        Select(browser.find_element(By.ID, "tool_choice")).select_by_visible_text("required")
        browser.find_element(By.ID, "input").send_keys("Weather in Oslo?\n")
        WebDriverWait(browser, 60).until(lambda b: "tokens/s" in b.find_element(By.ID, "stats").text)
        calls = browser.find_elements(By.CSS_SELECTOR, ".msg.assistant details.tool-call")
        assert calls, browser.page_source
        for call in calls:  # parallel calls allowed: as many as the random model made, each well-formed
            assert call.find_element(By.TAG_NAME, "summary").get_property("textContent") == "Tool call: get_weather"
            arguments = call.find_element(By.TAG_NAME, "pre").get_property("textContent")
            jsonschema.validate(json.loads(arguments), WEATHER["function"]["parameters"])
            assert call.get_property("open") is False  # folded under its heading
