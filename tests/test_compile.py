"""The compiled decode step: the tokens of eager, for batches too, with no recompilation across steps or sampling values."""
import torch
import torch._dynamo

from generate import compile_steps, generate, load_model

PROMPTS = [[7, 8, 9, 10, 11], [3], [20, 21, 22, 23, 24, 25, 26, 27, 28]]  # different lengths: left padding


def test_compiled_equals_eager_without_recompiling(tiny_checkpoint):
    model = load_model(tiny_checkpoint)
    eager = generate(model, PROMPTS, 50).tokens
    counters = torch._dynamo.utils.counters
    torch._dynamo.reset()
    counters.clear()
    decode_fn = compile_steps(torch.device("cpu"))["decode_fn"]
    assert generate(model, PROMPTS, 2, decode_fn=decode_fn).tokens == [row[:2] for row in eager]  # compiles
    # The cache is set up for these shapes already: 50 more steps must reuse the one graph.
    with torch._dynamo.config.patch(error_on_recompile=True):
        assert generate(model, PROMPTS, 50, decode_fn=decode_fn).tokens == eager
    assert counters["stats"]["unique_graphs"] == 1 and not counters["graph_break"]

    # Sampling compiles one more graph; new values of every setting reuse it.
    generate(model, PROMPTS, 3, decode_fn=decode_fn, temperature=0.7, seed=0)
    graphs = counters["stats"]["unique_graphs"]
    settings = dict(temperature=1.3, top_k=5, top_p=0.8, min_p=0.05, repetition_penalty=1.2, presence_penalty=0.5,
                    frequency_penalty=0.3, seed=1)  # fmt: skip
    with torch._dynamo.config.patch(error_on_recompile=True):
        compiled = generate(model, PROMPTS, 30, decode_fn=decode_fn, **settings).tokens
    assert counters["stats"]["unique_graphs"] == graphs == 2 and not counters["graph_break"]
    # Same seed, same draws: the compiled sampler picks what the eager one picks.
    assert compiled == generate(model, PROMPTS, 30, **settings).tokens
