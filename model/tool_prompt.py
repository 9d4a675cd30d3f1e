"""The tool definitions in the prompt, in each of Meta's tool prompt formats (model/tools.py names them).

- python_list (Llama 3.2 1B/3B): the functions are listed in the system prompt.
- json and function_tag (Llama 3.1): "Environment: ipython" and the date in the system prompt, the functions
  in a user message before the conversation.

The text matches llama-stack 0.2.12 exactly: the generators of
llama_stack/models/llama/llama3/prompt_templates/system_prompts.py and the way
providers/utils/inference/prompt_adapter.py puts them around the messages (both unchanged on llama-stack's
main up to September 2025). Written out here rather than rendered from llama-stack's Jinja, because
llama-stack is a server framework and not a dependency of this engine.
"""

from __future__ import annotations

from datetime import date

from jinja2.utils import htmlsafe_json_dumps

from .tools import ToolDefinition


def tojson(value) -> str:
    """As Jinja's `tojson` filter, which llama-stack's templates use (sorted keys, HTML characters escaped)."""
    return str(htmlsafe_json_dumps(value, sort_keys=True))


def environment_text(tools: list[ToolDefinition]) -> str:
    """BuiltinToolGenerator: code_interpreter needs no "Tools:" line, "Environment: ipython" turns it on."""
    shown = [t.name for t in tools if t.builtin and t.name != "code_interpreter"]
    text = "Environment: ipython\n" if tools else ""
    return text + ("Tools: " + ", ".join(shown) if shown else "")


def date_text(today: date) -> str:
    """SystemDefaultGenerator."""
    return f"Cutting Knowledge Date: December 2023\nToday Date: {today.strftime('%d %B %Y')}"


JSON_FUNCTION = """{{
    "type": "function",
    "function": {{
        "name": "{name}",
        "description": "{description}",
        "parameters": {{
            "type": "object",
            "properties": [{properties}
            ],
            "required": {required}
        }}
    }}
}}
"""
JSON_PARAM = """
                {{
                    "{name}": {{
                        "type": "object",
                        "description": "{description}"
                    }}
                }}"""


def json_tools_text(tools: list[ToolDefinition]) -> str:
    """JsonCustomToolGenerator. Every parameter is shown with type "object", as llama-stack writes it."""
    functions = "".join(JSON_FUNCTION.format(
        name=t.name, description=t.description, required=tojson([p.name for p in t.params if p.required]),
        properties=",".join(JSON_PARAM.format(name=p.name, description=p.description) for p in t.params))
        for t in tools)
    return ("Answer the user's question by making use of the following functions if needed.\n"
            "If none of the function can be used, please say so.\n"
            "Here is a list of functions in JSON format:\n" + functions +
            "\nReturn function calls in JSON format.")


def function_tag_tools_text(tools: list[ToolDefinition]) -> str:
    """FunctionTagCustomToolGenerator."""
    blocks = []
    for t in tools:
        params = tojson({p.name: {"param_type": p.type, "description": p.description, "required": p.required}
                         for p in t.params})
        blocks.append(f"Use the function '{t.name}' to '{t.description}':\n"
                      f'{{"name": "{t.name}", "description": "{t.description}", "parameters": {params}}}\n\n')
    return ("You have access to the following functions:\n\n" + "".join(blocks) +
            "Think very carefully before calling functions.\n"
            "If you choose to call a function ONLY reply in the following format with no prefix or suffix:\n\n"
            '<function=example_function_name>{"example_name": "example_value"}</function>\n\n'
            "Reminder:\n"
            "- If looking for real time information use relevant functions before falling back to brave_search\n"
            "- Function calls MUST follow the specified format, start with <function= and end with </function>\n"
            "- Required parameters MUST be specified\n"
            "- Only call one function at a time\n"
            "- Put the entire function call reply on one line")


PYTHON_LIST_PROMPT = (  # PythonListCustomToolGenerator.DEFAULT_PROMPT
    "You are a helpful assistant. You have access to functions, but you should only use them if they are "
    "required.\n"
    "You are an expert in composing functions. You are given a question and a set of possible functions.\n"
    "Based on the question, you may or may not need to make one function/tool call to achieve the purpose.\n\n"
    "If you decide to invoke any of the function(s), you MUST put it in the format of [func_name1(params_name1="
    "params_value1, params_name2=params_value2...), func_name2(params)]\n"
    "If you decide to invoke a function, you SHOULD NOT include any other text in the response. besides the "
    "function call in the above format.\n"
    "For a boolean parameter, be sure to use `True` or `False` (capitalized) for the value.\n\n\n")


PYTHON_LIST_FUNCTION = """{{
        "name": "{name}",
        "description": "{description}",
        "parameters": {{
            "type": "dict",
            "required": {required},
            "properties": {{{properties}
            }}
        }}
    }}"""
PYTHON_LIST_PARAM = """
                "{name}": {{
                    "type": "{type}",
                    "description": "{description}"{default}
                }}"""
PYTHON_LIST_DEFAULT = ',\n                    "default": "{}"'  # after a description, when the default is truthy


def python_list_tools_text(tools: list[ToolDefinition]) -> str:
    """PythonListCustomToolGenerator with its default prompt. A falsy default is left out, as llama-stack does."""
    functions = ",\n    ".join(PYTHON_LIST_FUNCTION.format(
        name=t.name, description=t.description, required=tojson([p.name for p in t.params if p.required]),
        properties=",".join(PYTHON_LIST_PARAM.format(
            name=p.name, type=p.type, description=p.description,
            default=PYTHON_LIST_DEFAULT.format(p.default) if p.default else "") for p in t.params))
        for t in tools)
    return (PYTHON_LIST_PROMPT + "Here is a list of functions in JSON format that you can invoke.\n\n[\n    " +
            functions + "\n]\n\n"
            "You can answer general questions or invoke tools when necessary.\n"
            "In addition to tool calls, you should also augment your responses by using the tool outputs.")


def tool_choice_text(choice: str) -> str:
    """prompt_adapter._get_tool_choice_prompt. Meta's format has no way to force a call: the model is asked to."""
    if choice in ("auto", "none"):
        return ""
    if choice == "required":
        return "You MUST use one of the provided functions/tools to answer the user query."
    return f"You MUST use the tool `{choice}` to answer the user query."


def with_tool_prompt(messages: list[dict], tools: list[ToolDefinition], choice: str, tool_prompt_format: str,
                     today: date | None = None) -> list[dict]:
    """The messages with the tool definitions put in, as llama-stack's prompt_adapter does.

    A first system message is folded into the new one; `today` (for json and function_tag) defaults to today.
    """
    system = messages[0]["content"] if messages and messages[0]["role"] == "system" else None
    rest = messages[1:] if system is not None else list(messages)
    custom = [t for t in tools if not t.builtin]
    choice_text = "\n" + tool_choice_text(choice) if tool_choice_text(choice) else ""
    if tool_prompt_format == "python_list":  # augment_messages_for_tools_llama
        builtin = [t for t in tools if t.builtin]
        text = environment_text(builtin) + "\n" if builtin else ""
        text += python_list_tools_text(custom) + "\n" if custom else ""
        text += system or ""
        return [{"role": "system", "content": (text + choice_text).strip("\n")}, *rest]
    # augment_messages_for_tools_llama_3_1
    text = (environment_text(tools) + "\n" if tools else "") + date_text(today or date.today())
    text += "\n" + system if system is not None else ""
    added = [{"role": "system", "content": text + choice_text}]
    if custom:
        listing = json_tools_text if tool_prompt_format == "json" else function_tag_tools_text
        added.append({"role": "user", "content": listing(custom)})
    return added + rest
