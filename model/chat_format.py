"""Messages -> prompt token ids.

`ChatFormat` is the Llama 3 prompt, as Meta's llama_models.llama3.chat_format builds it for text:

    <|begin_of_text|>{<|start_header_id|>role<|end_header_id|>\\n\\n content <|eot_id|>}...
    <|start_header_id|>assistant<|end_header_id|>\\n\\n

`TemplateChatFormat` renders a Hugging Face chat template (Jinja) the way transformers does. Both turn only
the format's own markup into control tokens: message content is always tokenized as plain text.
"""

import itertools
import json
import re
from datetime import datetime
from pathlib import Path

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

from .tokenizer import HFTokenizer, Tokenizer, TokenizerError, read_json

ROLES = ("system", "user", "assistant")
PRIVATE_USE = (range(0xE000, 0xF900), range(0xF0000, 0xFFFFE), range(0x100000, 0x10FFFE))  # Unicode's areas


def check_messages(messages) -> None:
    """Raise ValueError unless every message is {"role": one of ROLES, "content": str}."""
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise ValueError(f"message {i}: expected a dict with 'role' and 'content', "
                             f"found {type(message).__name__}")
        role, content = message.get("role"), message.get("content")
        if role not in ROLES:
            raise ValueError(f"message {i}: expected role in {ROLES}, found {role!r}")
        if not isinstance(content, str):
            raise ValueError(f"message {i}: expected str content, found {type(content).__name__}")


class ChatFormat:
    """Llama 3 chat prompt. Adds nothing beyond the messages given (no default system prompt)."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer

    @property
    def stop_ids(self) -> set[int]:
        return self.tokenizer.stop_ids

    def encode_header(self, role: str) -> list[int]:
        special = self.tokenizer.special_tokens
        return [special["<|start_header_id|>"], *self.tokenizer.encode(role), special["<|end_header_id|>"],
                *self.tokenizer.encode("\n\n")]

    def encode_message(self, message: dict) -> list[int]:
        """Header, content (as Meta: not stripped, tokenized on its own), <|eot_id|>.

        An assistant message may carry "ids": the tokens the model generated for it, used instead of
        its text encoded again (which can split differently), so a KV cache holding them still matches.
        """
        check_messages([message])
        ids = message.get("ids") if message["role"] == "assistant" else None
        content = list(ids) if ids is not None else self.tokenizer.encode(message["content"])
        return self.encode_header(message["role"]) + content + [self.tokenizer.eot_id]

    def encode_dialog(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        check_messages(messages)
        ids = [self.tokenizer.bos_id]
        for message in messages:
            ids += self.encode_message(message)
        return ids + self.encode_header("assistant") if add_generation_prompt else ids

    def render(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """The prompt as text, for debugging."""
        return self.tokenizer.decode(self.encode_dialog(messages, add_generation_prompt))


def compile_template(template: str) -> jinja2.Template:
    """A chat template in the environment transformers renders it in (utils/chat_template_utils.py)."""
    def raise_exception(message):
        raise jinja2.TemplateError(message)

    def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        # Jinja's own tojson escapes HTML characters; transformers' does not
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(template)


class TemplateChatFormat:
    """A Hugging Face chat template, tokenized as transformers' apply_chat_template(tokenize=True) does,
    except that added-token names inside message content are tokenized as plain text.

    How: each added-token name in the content is wrapped in a marker character that occurs nowhere else,
    the template is rendered, and then only unmarked added tokens become control ids. Templates may still
    reshape the content (trim it, say): the markers travel with it. Exact for byte-level BPE tokenizers
    (GPT-2, Llama 3, SmolLM, Qwen); a SentencePiece-style tokenizer.json that prepends "▁" to each piece of
    text can differ from transformers at the pieces after a control token.
    """

    def __init__(self, tokenizer: HFTokenizer, template: str, bos_token: str | None = None,
                 eos_token: str | None = None):
        self.tokenizer = tokenizer
        self.template_source = template
        try:
            self.template = compile_template(template)
        except jinja2.TemplateError as e:
            raise ValueError(f"chat template: cannot compile it ({e})") from None
        # transformers passes its special tokens map, which leaves out tokens that are not set
        self.special_tokens = {name: token for name, token in
                               (("bos_token", bos_token), ("eos_token", eos_token)) if token is not None}
        names = sorted(tokenizer.added_tokens, key=len, reverse=True)  # a longer name wins over its prefix
        self._added_text = re.compile("|".join(map(re.escape, names)) or "(?!)")

    @property
    def stop_ids(self) -> set[int]:
        return self.tokenizer.stop_ids

    def _render(self, messages: list[dict], add_generation_prompt: bool) -> str:
        try:
            return self.template.render(messages=messages, tools=None, documents=None,
                                        add_generation_prompt=add_generation_prompt, **self.special_tokens)
        except jinja2.TemplateError as e:
            raise ValueError(f"chat template: {e}") from None

    def render(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """The prompt text, as transformers' apply_chat_template(tokenize=False)."""
        check_messages(messages)
        return self._render([dict(m) for m in messages], add_generation_prompt)

    def encode_dialog(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        check_messages(messages)
        seen = set(self.template_source).union(*self.special_tokens.values(), *(m["content"] for m in messages))
        mark = next((chr(c) for c in itertools.chain(*PRIVATE_USE) if chr(c) not in seen), None)
        if mark is None:
            raise ValueError("chat template: the messages use every Unicode private-use character; "
                             "expected at least one free to mark control-token names in the content")
        marked = [{**m, "content": self._added_text.sub(lambda t: mark + t[0] + mark, m["content"])}
                  for m in messages]
        prompt = self._render(marked, add_generation_prompt)
        # [text, marked name, text, ...]; None for a lone mark (the template cut a marked name apart)
        parts = re.split(f"{mark}({self._added_text.pattern}){mark}|{mark}", prompt)
        pieces = []
        for i, part in enumerate(parts):
            if i % 2 == 0:
                pieces += self.tokenizer.split_added(part)
            elif part is not None:
                pieces.append(part)
        # Join runs of text and tokenize each run whole, as transformers does between control tokens.
        ids, text = [], []
        for piece in pieces:
            if isinstance(piece, int):
                ids += self.tokenizer.encode("".join(text)) + [piece]
                text = []
            else:
                text.append(piece)
        return ids + self.tokenizer.encode("".join(text))


def load_chat_format(tokenizer: Tokenizer | HFTokenizer,
                     folder: str | Path | None = None) -> ChatFormat | TemplateChatFormat:
    """Llama 3 tokenizer -> ChatFormat; a Hugging Face tokenizer -> its folder's chat template, from the
    "chat_template" of tokenizer_config.json or else chat_template.jinja (`folder` defaults to the
    tokenizer's own)."""
    if isinstance(tokenizer, Tokenizer):
        return ChatFormat(tokenizer)
    folder = Path(folder) if folder is not None else tokenizer.folder
    template = read_json(folder / "tokenizer_config.json").get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}, ...]
        template = next((t.get("template") for t in template if t.get("name") == "default"), None)
    if template is None and (folder / "chat_template.jinja").is_file():
        template = (folder / "chat_template.jinja").read_text(encoding="utf-8")
    if not isinstance(template, str):
        raise TokenizerError(f"{folder}: expected a chat template (\"chat_template\" in tokenizer_config.json "
                             f"or chat_template.jinja), found none")
    return TemplateChatFormat(tokenizer, template, tokenizer.bos_token, tokenizer.eos_token)
