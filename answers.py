"""The server's answers in OpenAI's shapes, from a Job (api.py) and the engine's events: completions, chat
completions (with a reply's reasoning and tool calls split out by chat_reply.py), their streamed chunks, log-probs
and usage.
"""

from dataclasses import dataclass

from api import Job
from chat_reply import ReplyParts, split_reply
from engine import Choice, Event
from results import TokenLogprobs
from tokenizer import Tokenizer


def logprobs_object(job: Job, tokenizer: Tokenizer, entries: list[TokenLogprobs]) -> dict:
    """A choice's (or a chunk's) log-probs as the chat API gives them, or the completions API."""
    return chat_logprobs(tokenizer, entries) if job.chat else completion_logprobs(tokenizer, entries)


def chat_logprobs(tokenizer: Tokenizer, entries: list[TokenLogprobs]) -> dict:
    def item(token, logprob):
        text = tokenizer.decode([token])
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    return {"content": [item(e.token, e.logprob) | {"top_logprobs": [item(*t) for t in e.top]} for e in entries]}


def completion_logprobs(tokenizer: Tokenizer, entries: list[TokenLogprobs]) -> dict:
    tokens = [tokenizer.decode([e.token]) for e in entries]
    return {
        "tokens": tokens,
        "token_logprobs": [e.logprob for e in entries],
        "top_logprobs": [None if e.top is None else {tokenizer.decode([t]): lp for t, lp in e.top} for e in entries],
        "text_offset": [sum(map(len, tokens[:i])) for i in range(len(tokens))],
    }


def object_name(job: Job, chunk: bool) -> str:
    if job.chat:
        return "chat.completion.chunk" if chunk else "chat.completion"
    return "text_completion"


def reply_parts(job: Job, text: str, final: bool) -> ReplyParts:
    return split_reply(text, job.reply_format, job.tools is not None, job.in_reasoning, final)


def finish_reason(reason: str | None, parts: ReplyParts) -> str | None:
    return "tool_calls" if parts.calls and reason == "stop" else reason


@dataclass
class Streamed:
    """What a streamed chat choice has received (its text) and sent (of its reasoning and content)."""

    text: str = ""
    reasoning: int = 0
    content: int = 0


def chunk_choice(job: Job, tokenizer: Tokenizer, event: Event, streamed: Streamed) -> dict | None:
    """A streamed event as a chunk's choice, or None if it shows nothing yet (part of a character, the start of a
    possible stop string, of a tool call, of </think>). A chat choice's delta holds what is new of its reasoning
    and content; at its end, its tool calls, whole."""
    lp = None if event.logprobs is None else logprobs_object(job, tokenizer, [event.logprobs])
    if not job.chat:
        shown, reason = {"text": event.text}, event.finish_reason
    else:
        streamed.text += event.text
        parts = reply_parts(job, streamed.text, event.finish_reason is not None)
        delta = {
            "reasoning_content": parts.reasoning[streamed.reasoning :],
            "content": parts.content[streamed.content :],
        }
        delta = {k: v for k, v in delta.items() if v}
        streamed.reasoning, streamed.content = len(parts.reasoning), len(parts.content)
        if parts.calls:
            delta["tool_calls"] = [{"index": k} | call.openai() for k, call in enumerate(parts.calls)]
        shown, reason = {"delta": delta}, finish_reason(event.finish_reason, parts)
    if not (any(shown.values()) or reason or lp):
        return None
    return {"index": event.index, **shown, "logprobs": lp, "finish_reason": reason}


def role_choice(c: Choice) -> dict:
    """A chat choice's first chunk: its role, as OpenAI sends it."""
    return {"index": c.index, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}


def echo_choice(tokenizer: Tokenizer, c: Choice, prompt: list[TokenLogprobs] | None) -> dict:
    """A streamed completion's chunk with echo, before a choice's first token: the prompt (and its log-probs)."""
    lp = None if prompt is None else completion_logprobs(tokenizer, prompt)
    return {"index": c.index, "text": tokenizer.decode(c.ids), "logprobs": lp, "finish_reason": None}


def answer_choice(job: Job, tokenizer: Tokenizer, c: Choice, text: str, entries: list[TokenLogprobs], reason: str):
    """A choice of a non-streamed answer: its whole text (after the prompt's, with echo) or message (content,
    reasoning, tool calls), and log-probs."""
    lp = None if job.top_logprobs is None else logprobs_object(job, tokenizer, entries)
    if not job.chat:
        text = (tokenizer.decode(c.ids) if job.echo else "") + text
        return {"index": c.index, "text": text, "logprobs": lp, "finish_reason": reason}
    parts = reply_parts(job, text, final=True)
    message = {"role": "assistant", "content": parts.content or (None if parts.calls else "")}
    if parts.reasoning:
        message["reasoning_content"] = parts.reasoning
    if parts.calls:
        message["tool_calls"] = [call.openai() for call in parts.calls]
    return {"index": c.index, "message": message, "logprobs": lp, "finish_reason": finish_reason(reason, parts)}


def usage(job: Job, choices: list[Choice]) -> dict:
    prompt = sum(len(p) for p in job.prompts)
    completion = sum(len(c.tokens) for c in choices)
    reused = sum(c.reused for c in choices if c.index % job.n == 0)  # of each prompt's first choice, as prompt_tokens
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": reused},
    }
