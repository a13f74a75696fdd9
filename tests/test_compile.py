"""The compiled decode step: same tokens as eager, one graph, no recompilation across steps."""
import torch
import torch._dynamo

from generate import compile_steps, decode_one_token, generate, load_model


def test_compiled_equals_eager_without_recompiling(tiny_checkpoint):
    model = load_model(tiny_checkpoint)
    prompt = [7, 8, 9, 10, 11]
    eager = generate(model, prompt, 50).tokens[0]

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    _, decode_fn = compile_steps(torch.device("cpu"))
    first = generate(model, prompt, 2, decode_fn=decode_fn)  # compiles on its first call
    assert first.tokens[0] == eager[:2]
    # The cache is set up for 55 positions already: 50 more steps must reuse the one graph.
    with torch._dynamo.config.patch(error_on_recompile=True):
        compiled = generate(model, prompt, 50, decode_fn=decode_fn).tokens[0]
    assert compiled == eager
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1
    assert not torch._dynamo.utils.counters["graph_break"]
    assert decode_fn is not decode_one_token
