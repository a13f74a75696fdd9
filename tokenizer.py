"""One small tokenizer interface over SentencePiece, tiktoken (Llama 3) and Hugging Face tokenizer.json.

    tok = load_tokenizer(checkpoint_dir)
    ids = tok.encode("Hello")            # with the model's BOS where it uses one
    text = tok.decode(ids)
    prompt = tok.apply_chat_template([{"role": "user", "content": "Hi"}])

Special ids and the chat template come from tokenizer_config.json / generation_config.json /
chat_template.jinja beside the tokenizer, as Hugging Face writes them.
"""

import base64
import functools
import json
from dataclasses import dataclass, field
from pathlib import Path

# Llama 3's pre-tokenizer split pattern and its special tokens (the file holds only the 128000 merges).
LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
LLAMA3_NAMED_SPECIAL_TOKENS = [
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|reserved_special_token_0|>",
    "<|reserved_special_token_1|>",
    "<|finetune_right_pad_id|>",
    "<|step_id|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eom_id|>",
    "<|eot_id|>",
    "<|python_tag|>",
]
LLAMA3_NUM_SPECIAL_TOKENS = 256


@dataclass
class Tokenizer:
    """encode/decode functions plus the special ids and chat template of one model."""

    encode_fn: object  # (text, bos) -> list[int]
    decode_fn: object  # list[int] -> str
    token_to_id: object  # str -> int | None
    bos_id: int | None
    eos_ids: list[int]
    chat_template: str | None = None
    special_tokens: dict = field(default_factory=dict)  # e.g. {"bos_token": "<s>"} for the template

    def encode(self, text: str, bos: bool = True) -> list[int]:
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:  # lone surrogates: what Python makes of invalid UTF-8 bytes in argv
            raise ValueError(f"text is not valid UTF-8: {text[:40]!r}") from None
        return self.encode_fn(text, bos)

    def decode(self, ids) -> str:
        return self.decode_fn(list(ids))

    def apply_chat_template(
        self, messages: list[dict], add_generation_prompt: bool = True, tools: list | None = None, **kwargs
    ) -> str:
        """Renders messages as transformers' apply_chat_template(tokenize=False) does: tools (OpenAI's function
        definitions) and kwargs (chat_template_kwargs, e.g. enable_thinking) reach the template as variables."""
        if self.chat_template is None:
            raise ValueError("this tokenizer has no chat template (no chat_template in tokenizer_config.json)")
        from jinja2.exceptions import TemplateError

        try:
            return compile_chat_template(self.chat_template).render(
                **kwargs,
                messages=messages,
                tools=tools,
                add_generation_prompt=add_generation_prompt,
                **self.special_tokens,
            )
        except TemplateError as e:  # the template's own raise_exception() ("roles must alternate", ...) too
            raise ValueError(f"chat template: {e}") from None

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs) -> list[int]:
        # The template writes any BOS itself.
        return self.encode(self.apply_chat_template(messages, add_generation_prompt, **kwargs), bos=False)


class IncrementalDecoder:
    """Turns one row's tokens into text pieces; a character split across tokens comes out once complete.

    Decodes a short window (from the token before the last emitted piece) so that tokenizers that
    drop a leading space at the start of a decode, and multi-byte characters, come out right."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer, self.ids, self.prefix, self.read = tokenizer, [], 0, 0

    def push(self, token: int) -> str:
        self.ids.append(token)
        before = self.tokenizer.decode(self.ids[self.prefix : self.read])
        after = self.tokenizer.decode(self.ids[self.prefix :])
        if len(after) > len(before) and not after.endswith("\ufffd"):
            self.prefix, self.read = self.read, len(self.ids)
            return after[len(before) :]
        return ""

    def flush(self) -> str:
        """Whatever is held back at the end (an incomplete character decodes as U+FFFD)."""
        before = self.tokenizer.decode(self.ids[self.prefix : self.read])
        return self.tokenizer.decode(self.ids[self.prefix :])[len(before) :]


def load_tokenizer(checkpoint_dir: str | Path) -> Tokenizer:
    folder = Path(checkpoint_dir)
    config = read_json(folder / "tokenizer_config.json")
    if (folder / "tokenizer.json").is_file():
        tok = hf_tokenizer(folder / "tokenizer.json")
    elif (folder / "tokenizer.model").is_file():
        path = folder / "tokenizer.model"
        tok = tiktoken_tokenizer(path) if is_tiktoken_file(path) else sentencepiece_tokenizer(path)
    else:
        raise FileNotFoundError(f"no tokenizer.json or tokenizer.model in {folder}")
    # tokenizer_config.json and generation_config.json, where present, name the special tokens.
    specials = {
        k: token_content(config.get(k), folder / "tokenizer_config.json", k)
        for k in ("bos_token", "eos_token", "pad_token", "unk_token")
    }
    specials = {k: v for k, v in specials.items() if v is not None}
    if "bos_token" in specials:
        tok.bos_id = tok.token_to_id(specials["bos_token"])
    eos_ids = list(tok.eos_ids)
    if "eos_token" in specials and tok.token_to_id(specials["eos_token"]) is not None:
        eos_ids.append(tok.token_to_id(specials["eos_token"]))
    generation_eos = read_json(folder / "generation_config.json").get("eos_token_id")
    generation_eos = (
        [] if generation_eos is None else generation_eos if isinstance(generation_eos, list) else [generation_eos]
    )
    if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in generation_eos):
        raise ValueError(f"{folder / 'generation_config.json'}: eos_token_id must be token ids, got {generation_eos!r}")
    tok.eos_ids = sorted(set(eos_ids + generation_eos))
    tok.special_tokens = specials
    template_file = folder / "chat_template.jinja"
    if template_file.is_file():
        tok.chat_template, source = read_text(template_file), template_file
    else:
        tok.chat_template, source = config.get("chat_template"), folder / "tokenizer_config.json"
    if tok.chat_template is not None:
        from jinja2.exceptions import TemplateError

        try:  # a broken template is reported now, naming its file, not at the first chat message
            compile_chat_template(tok.chat_template)
        except (TemplateError, TypeError) as e:
            raise ValueError(f"{source}: broken chat template: {e}") from None
    return tok


@functools.lru_cache(maxsize=4)
def compile_chat_template(text: str):
    from jinja2.exceptions import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = lambda x, indent=None, ensure_ascii=False, sort_keys=False: json.dumps(
        x, indent=indent, ensure_ascii=ensure_ascii, sort_keys=sort_keys
    )
    env.globals["raise_exception"] = raise_exception
    return env.from_string(text)


def read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: not UTF-8 text (invalid byte at offset {e.start})") from None


def read_json(path: Path) -> dict:
    """A JSON object from path; {} if there is no such file."""
    if not path.is_file():
        return {}
    try:
        data = json.loads(read_text(path))
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def token_content(token, path: Path, key: str) -> str | None:
    # tokenizer_config.json writes a special token either as a string or as {"content": ...}.
    content = token.get("content") if isinstance(token, dict) else token
    if content is not None and not isinstance(content, str):
        raise ValueError(f"{path}: {key} must be a string, got {token!r}")
    return content


def is_tiktoken_file(path: Path) -> bool:
    # A tiktoken BPE file is text lines "<base64 token> <rank>"; a SentencePiece model is a binary protobuf.
    with open(path, "rb") as f:
        first_line = f.readline().split()
    try:
        return len(first_line) == 2 and bool(base64.b64decode(first_line[0], validate=True)) and first_line[1].isdigit()
    except ValueError:
        return False


def hf_tokenizer(path: Path) -> Tokenizer:
    from tokenizers import Tokenizer as HFTokenizer

    try:
        tok = HFTokenizer.from_file(str(path))
    except Exception as e:  # the library raises a bare Exception for a damaged file
        raise ValueError(f"{path}: not a readable tokenizer.json ({e})") from None
    # The post-processor decides whether BOS is added, as in transformers.
    return Tokenizer(
        encode_fn=lambda text, bos: tok.encode(text, add_special_tokens=bos).ids,
        decode_fn=lambda ids: tok.decode(ids, skip_special_tokens=False),
        token_to_id=tok.token_to_id,
        bos_id=None,
        eos_ids=[],
    )


def sentencepiece_tokenizer(path: Path) -> Tokenizer:
    import sentencepiece

    try:
        sp = sentencepiece.SentencePieceProcessor(model_file=str(path))
    except Exception as e:
        raise ValueError(f"{path}: neither a SentencePiece model nor a tiktoken BPE file ({e})") from None
    bos = sp.bos_id() if sp.bos_id() >= 0 else None

    def token_to_id(piece):
        i = sp.piece_to_id(piece)
        return None if i == sp.unk_id() and piece != sp.id_to_piece(sp.unk_id()) else i

    return Tokenizer(
        encode_fn=lambda text, add_bos: ([bos] if add_bos and bos is not None else []) + sp.encode(text),
        decode_fn=sp.decode,
        token_to_id=token_to_id,
        bos_id=bos,
        eos_ids=[sp.eos_id()] if sp.eos_id() >= 0 else [],
    )


def tiktoken_tokenizer(path: Path) -> Tokenizer:
    import tiktoken
    from tiktoken.load import load_tiktoken_bpe

    try:
        ranks = load_tiktoken_bpe(str(path))
    except Exception as e:  # a line that is not "<base64 token> <rank>"
        raise ValueError(f"{path}: not a readable tiktoken BPE file ({type(e).__name__}: {e})") from None
    names = LLAMA3_NAMED_SPECIAL_TOKENS + [
        f"<|reserved_special_token_{i}|>"
        for i in range(2, LLAMA3_NUM_SPECIAL_TOKENS - len(LLAMA3_NAMED_SPECIAL_TOKENS) + 2)
    ]
    special = {name: len(ranks) + i for i, name in enumerate(names)}
    enc = tiktoken.Encoding(name=path.name, pat_str=LLAMA3_PATTERN, mergeable_ranks=ranks, special_tokens=special)
    bos = special["<|begin_of_text|>"]
    # Special tokens in the text are encoded as such, as chat templates need.
    return Tokenizer(
        encode_fn=lambda text, add_bos: ([bos] if add_bos else []) + enc.encode(text, allowed_special="all"),
        decode_fn=enc.decode,
        token_to_id=lambda s: special.get(s, ranks.get(s.encode())),
        bos_id=bos,
        eos_ids=[special["<|end_of_text|>"], special["<|eot_id|>"]],
    )
