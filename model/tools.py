"""Tool calling for Llama 3: OpenAI tool definitions, tool_choice and assistant tool_calls read and checked;
tool calls written as the assistant's text in the prompt, as llama_models 0.3.0's ToolUtils.encode_tool_call
writes them. model/tool_prompt.py puts the definitions into the prompt; model/tool_parser.py reads the calls
of a reply.

Three tool prompt formats, as Meta names them (llama_models.datatypes.ToolPromptFormat):
- "python_list" (Llama 3.2 1B/3B): the model answers `[get_weather(city="Paris"), ...]`.
- "json" (Llama 3.1): the model answers `{"type": "function", "name": ..., "parameters": {...}}`.
- "function_tag" (Llama 3.1, on request): the model answers `<function=name>{...}</function>`.

Names in BUILTIN_TOOLS are Meta's built-in tools (as in llama-stack, a function of that name is one): their
calls are written `brave_search.call(query="...")`, and code_interpreter's as the code itself.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

TOOL_PROMPT_FORMATS = ("json", "function_tag", "python_list")
BUILTIN_TOOLS = ("brave_search", "wolfram_alpha", "photogen", "code_interpreter")  # Meta's BuiltinTool
TOOL_CHOICES = ("none", "auto", "required")  # or the name of one function


@dataclass(frozen=True)
class ToolParam:
    name: str
    type: str
    description: str | None = None
    required: bool = True
    default: object = None


@dataclass(frozen=True)
class ToolDefinition:
    name: str
    description: str | None = None
    params: tuple[ToolParam, ...] = ()

    @property
    def builtin(self) -> bool:
        return self.name in BUILTIN_TOOLS


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: dict | str = field(default_factory=dict)  # a str: JSON text cut short (the reply's token limit)

    def to_openai(self) -> dict:
        """As an OpenAI chat completion's message.tool_calls[i]."""
        arguments = self.arguments if isinstance(self.arguments, str) else json.dumps(self.arguments, ensure_ascii=False)
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": arguments}}


def tool_prompt_format_for(config) -> str:
    """The tool format a checkpoint was tuned for, from its config (a LlamaConfig).

    Llama 3.2 1B and 3B, the lightweight text models whose RoPE is scaled by 32, answer in python_list
    (Meta's prompt format for 3.2); Llama 3.1 (RoPE factor 8) in json. As llama-stack's
    get_default_tool_prompt_format, except that Llama 3.3 70B, which has 3.1's config, gets json too.
    RoPE scaling given per frequency (llama.cpp's rope_freqs) divides the lowest frequencies by the factor.
    """
    scaling = config.rope_scaling
    factors = getattr(scaling, "factors", None)
    factor = max(factors) if factors else getattr(scaling, "factor", None)
    return "python_list" if factor == 32 else "json"


def check_tool_prompt_format(name: str) -> str:
    if name not in TOOL_PROMPT_FORMATS:
        raise ValueError(f"tool_prompt_format: expected one of {', '.join(TOOL_PROMPT_FORMATS)}, found {name!r}")
    return name


# --- Reading OpenAI requests ---------------------------------------------------------------------------

def read_tools(tools: list | None) -> list[ToolDefinition]:
    """OpenAI `tools` ([{"type": "function", "function": {"name", "description", "parameters"}}]) -> definitions.

    Each property of the JSON schema `parameters` becomes a parameter with its "type" (as text), "description"
    and "default", required when named in the schema's "required" list. (llama-stack's own conversion marks
    every parameter required and drops defaults; its prompt generators, which this follows, use both.)
    """
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise ValueError(f"tools: expected a list of tools, found {type(tools).__name__}")
    definitions = []
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type", "function") != "function" or not isinstance(function, dict):
            raise ValueError(f'{where}: expected {{"type": "function", "function": {{"name": ...}}}}, found {tool!r:.80}')
        name, description = function.get("name"), function.get("description")
        if not isinstance(name, str) or not name:
            raise ValueError(f"{where}.function.name: expected a non-empty string, found {name!r}")
        if description is not None and not isinstance(description, str):
            raise ValueError(f"{where}.function.description: expected a string, found {type(description).__name__}")
        schema = function.get("parameters")
        schema = {} if schema is None else schema
        properties, required = (schema.get("properties") or {}, schema.get("required") or []) \
            if isinstance(schema, dict) else (None, None)
        if not isinstance(properties, dict) or not isinstance(required, list):
            raise ValueError(f'{where}.function.parameters: expected a JSON schema {{"type": "object", '
                             f'"properties": {{...}}, "required": [...]}}, found {schema!r:.80}')
        params = []
        for key, prop in properties.items():
            if not isinstance(prop, dict):
                raise ValueError(f"{where}.function.parameters.properties.{key}: expected a JSON schema object, "
                                 f"found {prop!r:.40}")
            params.append(ToolParam(key, str(prop.get("type")), prop.get("description"), key in required,
                                    prop.get("default")))
        definitions.append(ToolDefinition(name, description, tuple(params)))
    return definitions


def read_tool_choice(tool_choice: str | dict | None, tools: list[ToolDefinition]) -> str:
    """OpenAI `tool_choice` -> "none", "auto", "required" or the name of the function to call.

    The default is OpenAI's: "auto" with tools, "none" without.
    """
    if tool_choice is None:
        return "auto" if tools else "none"
    if isinstance(tool_choice, dict):
        function = tool_choice.get("function")
        name = function.get("name") if isinstance(function, dict) else None
        if tool_choice.get("type") != "function" or not isinstance(name, str):
            raise ValueError(f'tool_choice: expected {{"type": "function", "function": {{"name": ...}}}}, '
                             f"found {tool_choice!r:.80}")
        if name not in [t.name for t in tools]:
            raise ValueError(f"tool_choice: function {name!r} is not among the tools "
                             f"({', '.join(t.name for t in tools) or 'none given'})")
        return name
    if tool_choice not in TOOL_CHOICES:
        raise ValueError(f"tool_choice: expected one of {', '.join(TOOL_CHOICES)} or "
                         f'{{"type": "function", "function": {{"name": ...}}}}, found {tool_choice!r:.80}')
    if tool_choice == "required" and not tools:
        raise ValueError("tool_choice: 'required' needs at least one tool in tools")
    return tool_choice


def forces_call(choice: str) -> bool:
    """Whether a tool_choice, as read_tool_choice gives it, asks for a call ("required" or a function's name): the
    reply is then constrained to one (model/tool_choice.py)."""
    return choice not in ("auto", "none")


def read_tool_calls(tool_calls: list, where: str) -> list[ToolCall]:
    """An OpenAI assistant message's tool_calls ([{"id", "type": "function", "function": {"name",
    "arguments": JSON text}}]) -> ToolCalls."""
    if not isinstance(tool_calls, list):
        raise ValueError(f"{where}.tool_calls: expected a list, found {type(tool_calls).__name__}")
    calls = []
    for j, call in enumerate(tool_calls):
        function = call.get("function") if isinstance(call, dict) else None
        name = function.get("name") if isinstance(function, dict) else None
        if not isinstance(name, str) or not name:
            raise ValueError(f'{where}.tool_calls[{j}]: expected {{"type": "function", "function": {{"name": ..., '
                             f'"arguments": ...}}}} with a name, found {call!r:.80}')
        arguments = function.get("arguments") or {}
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except (ValueError, RecursionError) as e:
                raise ValueError(f"{where}.tool_calls[{j}].function.arguments: not valid JSON ({e})") from None
        if not isinstance(arguments, dict):
            raise ValueError(f"{where}.tool_calls[{j}].function.arguments: expected a JSON object, "
                             f"found {arguments!r:.40}")
        if name in BUILTIN_TOOLS:  # its argument is written into the prompt as it is
            key = "code" if name == "code_interpreter" else "query"
            if not isinstance(arguments.get(key), str):
                raise ValueError(f"{where}.tool_calls[{j}].function.arguments: {name} expects a string {key!r}, "
                                 f"found {arguments.get(key)!r:.40}")
        calls.append(ToolCall(str(call.get("id", "")), name, arguments))
    return calls


# --- Tool calls in the history (llama_models' ToolUtils.encode_tool_call) --------------------------------

def python_value(value) -> str:
    """A value in the python_list format, as llama_models writes it (strings are not escaped)."""
    if isinstance(value, str):
        return f'"{value}"'
    if isinstance(value, (int, float, bool)) or value is None:
        return str(value)
    if isinstance(value, list):
        return f"[{', '.join(python_value(v) for v in value)}]"
    if isinstance(value, dict):
        return f"{{{', '.join(f'{k}={python_value(v)}' for k, v in value.items())}}}"
    raise ValueError(f"tool call argument: expected str, number, bool, None, list or dict, "
                     f"found {type(value).__name__}")


def encode_tool_call(call: ToolCall, tool_prompt_format: str) -> str:
    """A call as the assistant's text in the prompt. code_interpreter's code is also preceded by
    <|python_tag|> when it is a message's first call (ChatFormat adds that control token)."""
    if call.name in BUILTIN_TOOLS:
        key = "code" if call.name == "code_interpreter" else "query"
        if not isinstance(call.arguments.get(key), str):
            raise ValueError(f"tool call {call.name}: expected a string {key!r} argument, found {call.arguments!r:.80}")
        return call.arguments[key] if key == "code" else f'{call.name}.call(query="{call.arguments[key]}")'
    if tool_prompt_format == "json":
        return json.dumps({"type": "function", "name": call.name, "parameters": call.arguments})
    if tool_prompt_format == "function_tag":
        return f"<function={call.name}>{json.dumps(call.arguments)}</function>"
    arguments = ", ".join(f"{k}={python_value(v)}" for k, v in call.arguments.items())
    return f"[{call.name}({arguments})]"
