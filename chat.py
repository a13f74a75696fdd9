"""A conversation kept in the KV cache (Chat), and generate.py --interactive's loop over stdin (chat_loop).

Each turn prefills only the tokens the cache does not hold yet (cached_prefix, which the server's slots use too).
"""

import itertools
import sys
from collections.abc import Callable

from decode import PREFILL_CHUNK, Steps, Stream
from results import Generation
from sampling import SamplingParams
from tokenizer import Tokenizer

CHAT_CACHE_LENGTH = 2048  # KV cache positions of an interactive conversation (capped by block_size)


def cached_prefix(cached: list[int], ids: list[int]) -> int:
    """How many tokens of ids a KV cache holding cached can keep: their common prefix, short of ids' last token,
    which is always fed again for the logits of the token after it."""
    n = 0
    while n < min(len(ids) - 1, len(cached)) and ids[n] == cached[n]:
        n += 1
    return n


def encode_conversation(
    tokenizer: Tokenizer, messages: list[dict], add_generation_prompt: bool = True, **kwargs
) -> list[int]:
    """Messages ({"role", "content"}) -> the prompt of the reply: by the chat template (kwargs: more of its variables,
    such as tools), or without one, the messages' contents joined by newlines (a base model continues the text)."""
    if tokenizer.chat_template:
        return tokenizer.encode_chat(messages, add_generation_prompt, **kwargs)
    return tokenizer.encode("\n".join(m["content"] for m in messages))


class Chat:
    """A conversation kept in the KV cache: each turn prefills only the tokens not cached yet.

    With a chat template, turns are rendered by it; without one, the conversation is its messages
    joined by newlines. When a turn would not fit the cache, the oldest turns are dropped (the system
    message stays) and dropped_turns counts them."""

    def __init__(
        self,
        model,
        tokenizer,
        *,
        system=None,
        max_new_tokens=256,
        cache_length=CHAT_CACHE_LENGTH,
        sampling: SamplingParams = SamplingParams(),
        stop=(),
        steps: Steps = Steps(),
    ):
        self.model, self.tokenizer, self.max_new_tokens = model, tokenizer, max_new_tokens
        self.sampling, self.stop, self.steps = sampling, stop, steps
        cache_length = min(cache_length, model.config.block_size)
        if max_new_tokens >= cache_length:
            raise ValueError(
                f"max_new_tokens {max_new_tokens} leaves no room for a message in the conversation's "
                f"{cache_length}-position cache"
            )
        model.setup_caches(1, cache_length, chunk=PREFILL_CHUNK)
        self.system = [{"role": "system", "content": system}] if system else []
        self.reset()

    def reset(self):
        self.messages, self.cached, self.dropped_turns, self.last_prefill = [], [], 0, 0

    def render(self, messages) -> list[int]:
        return encode_conversation(self.tokenizer, self.system + messages)

    def send(self, text: str, on_piece: Callable[[str], None] | None = None) -> Generation:
        """Generates the reply, passing its text pieces to on_piece as they come. A message that cannot fit
        is refused with a ValueError, and the conversation stays as it was."""
        messages, dropped = self.messages + [{"role": "user", "content": text}], 0
        ids = self.render(messages)
        while len(ids) + self.max_new_tokens > self.model.max_seq_length and len(messages) > 1:
            messages, dropped = messages[2:], dropped + 1  # the oldest user message and its reply
            ids = self.render(messages)
        if len(ids) + self.max_new_tokens > self.model.max_seq_length:
            raise ValueError(
                f"this message ({len(ids)} tokens) plus max_new_tokens ({self.max_new_tokens}) does not fit "
                f"the {self.model.max_seq_length}-position cache"
            )
        self.messages, self.dropped_turns = messages, self.dropped_turns + dropped
        common = cached_prefix(self.cached, ids)
        if not self.model.holds(0, 0, common):  # a rolling cache rolled past what the prefix's end attends to
            common = 0
        self.last_prefill = len(ids) - common
        result = Stream(
            self.model,
            self.tokenizer,
            ids[common:],
            self.max_new_tokens,
            sampling=self.sampling,
            stop=self.stop,
            start_pos=common,
            steps=self.steps,
        ).run(on_piece)
        # Every produced token but the last was fed back, so its keys and values are in the cache.
        self.cached = ids + result.raw_tokens[0][:-1]
        self.messages.append({"role": "assistant", "content": result.texts[0]})
        return result


def chat_loop(chat: Chat, read_line: Callable[[], bytes], on_piece: Callable[[str], None]):
    """A conversation on stdin: read_line() gives the next line as bytes (b"" at the end), on_piece shows the
    reply as it comes."""
    terminal = sys.stdin.isatty()
    if terminal:
        print("Conversation kept in the KV cache. /reset starts over; Ctrl-D ends.", file=sys.stderr)
    for number in itertools.count(1):
        if terminal:
            print("> ", end="", flush=True)
        line = read_line()
        if not line:
            break
        try:
            text = line.decode("utf-8").strip()
        except UnicodeDecodeError as e:  # one bad line does not end the conversation
            print(f"error: input line {number} is not valid UTF-8 (byte {e.start}); ignored", file=sys.stderr)
            continue
        if text == "/reset":
            chat.reset()
            continue
        if not text:
            continue
        dropped = chat.dropped_turns
        try:
            chat.send(text, on_piece)
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            continue
        print(flush=True)
        if chat.dropped_turns > dropped:
            print(
                f"[the conversation outgrew the cache: dropped its {chat.dropped_turns - dropped} oldest turn(s)]",
                file=sys.stderr,
            )
