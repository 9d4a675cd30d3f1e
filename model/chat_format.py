"""Messages -> prompt token ids.

`ChatFormat` is the Llama 3 prompt, as Meta's llama_models.llama3.chat_format builds it for text:

    <|begin_of_text|>{<|start_header_id|>role<|end_header_id|>\\n\\n content <|eot_id|>}...
    <|start_header_id|>assistant<|end_header_id|>\\n\\n

With `tools`, the tool definitions go into that prompt as Meta's formats give them (model/tool_prompt.py), an
assistant message's "tool_calls" are written after its content and a "tool" message (a tool's result) gets
the `ipython` header, as llama_models' ChatFormat.encode_message writes them.

`TemplateChatFormat` renders a Hugging Face chat template (Jinja) the way transformers does; it takes no tools.
Both turn only the format's own markup into control tokens: message content, tool definitions, calls and
results are always tokenized as plain text.
"""

import itertools
import json
import re
from datetime import date, datetime
from pathlib import Path

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

from .tokenizer import HFTokenizer, Tokenizer, TokenizerError, read_json
from .tool_prompt import with_tool_prompt
from .tools import (
    ToolCall,
    check_tool_prompt_format,
    encode_tool_call,
    read_tool_calls,
    read_tool_choice,
    read_tools,
    tool_prompt_format_for,
)

ROLES = ("system", "user", "assistant")
TOOL_ROLES = (*ROLES, "tool")  # "tool": a tool's result, Meta's `ipython` role
PRIVATE_USE = (range(0xE000, 0xF900), range(0xF0000, 0xFFFFE), range(0x100000, 0x10FFFE))  # Unicode's areas


def check_messages(messages, tools: bool = False) -> None:
    """Raise ValueError unless every message is {"role": one of ROLES, "content": str}. With tools, the role may
    also be "tool", and an assistant message with "tool_calls" may have content None."""
    roles = TOOL_ROLES if tools else ROLES
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise ValueError(f"message {i}: expected a dict with 'role' and 'content', "
                             f"found {type(message).__name__}")
        role, content = message.get("role"), message.get("content")
        if role not in roles:
            raise ValueError(f"message {i}: expected role in {roles}, found {role!r}")
        if tools and content is None and role == "assistant" and message.get("tool_calls"):
            continue
        if not isinstance(content, str):
            raise ValueError(f"message {i}: expected str content, found {type(content).__name__}")


def message_tool_calls(message: dict, where: str) -> list[ToolCall]:
    """The OpenAI "tool_calls" of an assistant message; ValueError if they are malformed or on another role."""
    if not message.get("tool_calls"):
        return []
    if message["role"] != "assistant":
        raise ValueError(f"{where}: expected tool_calls on assistant messages only, found them on a "
                         f"{message['role']!r} message")
    return read_tool_calls(message["tool_calls"], where)


class ChatFormat:
    """Llama 3 chat prompt. Adds nothing beyond the messages given (no default system prompt) unless tools are.

    tool_prompt_format: how this checkpoint reads and writes tool calls, "json" (Llama 3.1, and llama_models'
    default), "function_tag" or "python_list" (Llama 3.2 1B/3B); see tools.tool_prompt_format_for.
    """

    supports_tools = True

    def __init__(self, tokenizer: Tokenizer, tool_prompt_format: str = "json"):
        self.tokenizer = tokenizer
        self.tool_prompt_format = check_tool_prompt_format(tool_prompt_format)

    @property
    def stop_ids(self) -> set[int]:
        return self.tokenizer.stop_ids

    def encode_header(self, role: str) -> list[int]:
        special = self.tokenizer.special_tokens
        return [special["<|start_header_id|>"], *self.tokenizer.encode(role), special["<|end_header_id|>"],
                *self.tokenizer.encode("\n\n")]

    def encode_message(self, message: dict, tool_prompt_format: str | None = None) -> list[int]:
        """Header, content (as Meta: not stripped, tokenized on its own), <|eot_id|>.

        An assistant message may carry "ids": the tokens the model generated for it, used instead of
        its text encoded again (which can split differently), so a KV cache holding them still matches.
        Else its OpenAI "tool_calls" follow the content, each tokenized on its own, in tool_prompt_format
        (default: the checkpoint's); <|python_tag|> comes first when the first call is code_interpreter.
        A "tool" message is a tool's result, under the `ipython` header; its tool_call_id is not written.
        """
        check_messages([message], tools=True)
        role, ids = message["role"], message.get("ids") if message["role"] == "assistant" else None
        header = self.encode_header("ipython" if role == "tool" else role)
        if ids is not None:
            return header + list(ids) + [self.tokenizer.eot_id]
        calls = message_tool_calls(message, "message")
        fmt = check_tool_prompt_format(tool_prompt_format or self.tool_prompt_format)
        python_tag = calls and calls[0].name == "code_interpreter"
        content = [self.tokenizer.special_tokens["<|python_tag|>"]] if python_tag else []
        content += self.tokenizer.encode(message["content"] or "")
        for call in calls:
            content += self.tokenizer.encode(encode_tool_call(call, fmt))
        return header + content + [self.tokenizer.eot_id]

    def encode_dialog(self, messages: list[dict], add_generation_prompt: bool = True, *,
                      tools: list[dict] | None = None, tool_choice: str | dict | None = None,
                      tool_prompt_format: str | None = None, today: date | None = None) -> list[int]:
        """The prompt's ids. tools, tool_choice: as OpenAI's chat completion request takes them.

        With tools (and tool_choice not "none"), their definitions go in as tool_prompt.with_tool_prompt writes them
        for tool_prompt_format (default: the checkpoint's); "required" or a named function add Meta's request
        to call one, which the model may still ignore. Without, the prompt is the plain one.
        today: the date the json and function_tag formats write in the system prompt (default: today).
        """
        check_messages(messages, tools=True)
        for i, message in enumerate(messages):
            message_tool_calls(message, f"message {i}")
        fmt = check_tool_prompt_format(tool_prompt_format or self.tool_prompt_format)
        definitions = read_tools(tools)
        choice = read_tool_choice(tool_choice, definitions)
        if definitions and choice != "none":
            messages = with_tool_prompt(messages, definitions, choice, fmt, today)
        ids = [self.tokenizer.bos_id]
        for message in messages:
            ids += self.encode_message(message, fmt)
        return ids + self.encode_header("assistant") if add_generation_prompt else ids

    def render(self, messages: list[dict], add_generation_prompt: bool = True, **tool_options) -> str:
        """The prompt as text, for debugging."""
        return self.tokenizer.decode(self.encode_dialog(messages, add_generation_prompt, **tool_options))


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
    except that added-token names inside message content are tokenized as plain text. Takes no tools
    (supports_tools is False): templates' own tool markup is not written.

    How: each added-token name in the content is wrapped in a marker character that occurs nowhere else,
    the template is rendered, and then only unmarked added tokens become control ids. Templates may still
    reshape the content (trim it, say): the markers travel with it. Exact for byte-level BPE tokenizers
    (GPT-2, Llama 3, SmolLM, Qwen); a SentencePiece-style tokenizer.json that prepends "▁" to each piece of
    text can differ from transformers at the pieces after a control token.
    """

    supports_tools = False

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

    def encode_dialog(self, messages: list[dict], add_generation_prompt: bool = True, *,
                      tools: list[dict] | None = None, tool_choice: str | dict | None = None) -> list[int]:
        """The prompt's ids. tools and tool_choice are taken only as None or "none", for the same calls as
        ChatFormat.encode_dialog: this format has no tool calling (supports_tools is False)."""
        if tools or tool_choice not in (None, "none"):
            raise ValueError("tools: this checkpoint's chat template is not given tools (only Llama 3 checkpoints "
                             f"with Meta's tokenizer.model are); expected no tools, found {len(tools or [])} "
                             f"and tool_choice={tool_choice!r}")
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


def load_chat_format(tokenizer: Tokenizer | HFTokenizer, folder: str | Path | None = None,
                     config=None) -> ChatFormat | TemplateChatFormat:
    """Llama 3 tokenizer -> ChatFormat, in the tool format the checkpoint's config (a LlamaConfig) tells
    (tools.tool_prompt_format_for; json without one); a Hugging Face tokenizer -> its folder's chat template,
    from the "chat_template" of tokenizer_config.json or else chat_template.jinja (`folder` defaults to the
    tokenizer's own)."""
    if isinstance(tokenizer, Tokenizer):
        return ChatFormat(tokenizer, tool_prompt_format_for(config) if config is not None else "json")
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
