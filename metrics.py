"""The server's Prometheus metrics (GET /metrics): requests, tokens, latencies, and the engine's queue, slots and
speculation, in a registry of the server's own, read at each scrape.
"""

from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily

from engine import Engine

PREFIX = "gptfast_"
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0, 2.5)
FIRST_TOKEN_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


@dataclass
class Metrics:
    registry: CollectorRegistry
    requests: Counter  # by endpoint and HTTP status
    prompt_tokens: Counter
    cached_prompt_tokens: Counter
    generation_tokens: Counter
    time_to_first_token: Histogram
    inter_token_latency: Histogram


ENGINE_COUNTS = {
    "prefill_chunks": "Prefill calls, each taking a chunk of the prompts of one or more slots.",
    "prefilled_tokens": "Prompt tokens prefilled.",
    "copied_prompt_tokens": "Prompt tokens whose keys and values were copied from another slot.",
    "set_aside_tokens": "Tokens whose keys and values moved to a free slot before a request took theirs.",
    "decode_steps": "Decode steps (speculative rounds with a draft) of the busy slots.",
    "swapped_rows": "Slots whose request moved to another slot, so that long prompts share a group of rows.",
}


class EngineCollector:
    """The engine's step counts and speculative decoding's drafted and accepted tokens, read at each scrape."""

    def __init__(self, engine: Engine):
        self.engine = engine

    def collect(self):
        for name, text in ENGINE_COUNTS.items():
            yield CounterMetricFamily(PREFIX + name, text, self.engine.counts[name])
        s = self.engine.speculation
        if s is None:
            return
        yield CounterMetricFamily(PREFIX + "speculative_drafted_tokens", "Tokens the draft proposed.", s.drafted)
        yield CounterMetricFamily(PREFIX + "speculative_accepted_tokens", "Drafted tokens the model kept.", s.kept)
        steps = CounterMetricFamily(
            PREFIX + "speculative_steps",
            "Decode steps by the tokens they drafted per row (0: plain).",
            labels=["depth"],
        )
        for depth, count in enumerate(list(self.engine.step_depths)):
            steps.add_metric([str(depth)], count)
        yield steps


def server_metrics(engine: Engine) -> Metrics:
    registry = CollectorRegistry()
    gauges = {
        "queue_length": ("Choices waiting for a slot.", engine.waiting.qsize),
        "busy_slots": ("Slots holding a request.", lambda: len(engine.busy_slots())),
        "prefilling_slots": ("Slots whose prompt is being prefilled.", lambda: len(engine.prefilling)),
        "slots": ("Slots of the KV cache.", lambda: len(engine.slots)),
        "kv_cache_bytes": (
            "Bytes of the KV caches, the draft's too.",
            lambda: engine.kv_cache_figures()["kv_cache_bytes"],
        ),
        "kv_cache_positions": (
            "Positions of the KV cache: slots times positions per slot.",
            lambda: engine.kv_cache_figures()["kv_cache_positions"],
        ),
        "kv_cache_used_positions": (
            "Positions of the KV cache that requests hold: their prompts and replies so far.",
            lambda: engine.kv_cache_figures()["kv_cache_used_positions"],
        ),
    }
    for name, (text, read) in gauges.items():
        Gauge(PREFIX + name, text, registry=registry).set_function(read)
    registry.register(EngineCollector(engine))
    return Metrics(
        registry,
        Counter(PREFIX + "requests", "Requests answered.", ["endpoint", "status"], registry=registry),
        Counter(PREFIX + "prompt_tokens", "Prompt tokens of answered requests.", registry=registry),
        Counter(PREFIX + "cached_prompt_tokens", "Prompt tokens found in a slot's cache.", registry=registry),
        Counter(PREFIX + "generation_tokens", "Tokens generated.", registry=registry),
        Histogram(
            PREFIX + "time_to_first_token_seconds",
            "From a request's arrival to its first token.",
            buckets=FIRST_TOKEN_BUCKETS,
            registry=registry,
        ),
        Histogram(
            PREFIX + "inter_token_latency_seconds",
            "Between two tokens of a choice.",
            buckets=LATENCY_BUCKETS,
            registry=registry,
        ),
    )
