"""tool_choice "required" or a named function kept by the JSON constraint (model/tool_choice.py): which documents
the calls' schema takes, that model/tool_parser.py reads every one of them as calls, and that replies sampled
at temperature 1 from tiny random checkpoints, in both tool prompt formats, are valid calls."""

import json

import jsonschema
import pytest
import torch
from support.checkpoints import ROPE, hf_model

from model.checkpoint import load_checkpoint
from model.generation import Generation
from model.structured import JsonConstraint, SchemaError
from model.tokenizer import Tokenizer, meta_tokenizer_model
from model.tool_choice import call_schema
from model.tool_parser import parse_tool_calls


def tool(name, parameters=None):
    return {"type": "function", "function": {"name": name, **({"parameters": parameters} if parameters else {})}}


# Every call of these is short whatever a random model picks: strings and numbers bounded, no other keys.
WEATHER = tool("get_weather", {"type": "object", "properties": {
    "city": {"type": "string", "minLength": 1, "maxLength": 12}, "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city"], "additionalProperties": False})
TIME = tool("get_time", {"type": "object", "properties": {
    "zone": {"type": "integer", "minimum": -12, "maximum": 14}, "dst": {"type": "boolean"}},
    "required": ["zone", "dst"], "additionalProperties": False})
LETTER = tool("send_letter", {  # as pydantic writes a model with a nested one: $defs and $ref at its root
    "$defs": {"Address": {"type": "object", "properties": {
        "zip": {"type": "integer", "minimum": 0, "maximum": 99}, "country": {"enum": ["FR", "NO"]}},
        "required": ["zip", "country"], "additionalProperties": False}},
    "type": "object", "properties": {"to": {"$ref": "#/$defs/Address"}}, "required": ["to"],
    "additionalProperties": False})
PING = tool("ping")  # no parameters: any object
TOOLS = [WEATHER, TIME, LETTER]
SCHEMAS = {t["function"]["name"]: t["function"].get("parameters", {"type": "object"}) for t in [*TOOLS, PING]}


@pytest.fixture(scope="module")
def tokenizer():
    return Tokenizer(meta_tokenizer_model())


def takes(tokenizer, schema, text: str) -> bool:
    """Whether the constraint lets a reply spell `text` (in the tokenizer's ids) and then end."""
    constraint = JsonConstraint(tokenizer, schema, param="tools")
    for token in tokenizer.encode(text):
        if not constraint.mask()[token]:
            return False
        constraint.advance(token)
    return constraint.complete


def call(name, arguments) -> str:
    return json.dumps({"type": "function", "name": name, "parameters": arguments})


def check_calls(text: str, allowed: set[str]) -> list:
    """The calls parse_tool_calls reads in a reply: at least one, each of an allowed tool, its arguments valid."""
    content, calls = parse_tool_calls(text)
    assert content == "" and calls, text
    for c in calls:
        assert c.name in allowed, text
        jsonschema.validate(c.arguments, SCHEMAS[c.name])
    return calls


@pytest.mark.parametrize("choice, parallel, text, taken", [
    ("required", False, call("get_weather", {"city": "Paris"}), True),
    ("required", False, call("get_time", {"zone": 2, "dst": True}), True),
    ("required", False, call("send_letter", {"to": {"zip": 75, "country": "FR"}}), True),
    ("required", False, call("get_weather", {"city": "Paris", "unit": "kelvin"}), False),  # not in the enum
    ("required", False, call("get_weather", {"unit": "celsius"}), False),  # city is required
    ("required", False, call("get_weather", {"city": "Paris", "wind": 3}), False),  # no other property
    ("required", False, call("send_letter", {"to": {"zip": 100, "country": "FR"}}), False),  # past the maximum
    ("required", False, call("launch_rocket", {}), False),  # no such tool
    ("required", False, "It is sunny.", False),
    ("required", False, "[" + call("get_weather", {"city": "Paris"}) + "]", False),  # one call only
    ("required", False, '{"type":"function","name":"get_weather","parameters":{"city":"Paris"}}', False),  # layout
    ("required", True, "[" + call("get_weather", {"city": "Paris"}) + ", " + call("get_time", {"zone": 0, "dst": False})
     + "]", True),
    ("required", True, call("get_weather", {"city": "Paris"}), True),
    ("required", True, "[]", False),
    ("get_time", False, call("get_time", {"zone": -12, "dst": False}), True),
    ("get_time", False, call("get_weather", {"city": "Paris"}), False),  # not the named one
    ("get_time", True, "[" + call("get_time", {"zone": 1, "dst": True}) + ", " + call("get_time", {"zone": 2, "dst": True})
     + "]", True),
    ("ping", False, call("ping", {"anything": [1, {"goes": None}]}), True),
    ("ping", False, call("ping", {}), True),
    ("ping", False, '{"type": "function", "name": "ping", "parameters": [1]}', False),  # arguments are an object
])
def test_the_calls_schema_takes_exactly_the_calls_allowed(tokenizer, choice, parallel, text, taken):
    assert takes(tokenizer, call_schema([*TOOLS, PING], choice, parallel), text) is taken
    if taken:  # and the parser reads what it takes as those calls
        calls = check_calls(text, {choice} if choice != "required" else set(SCHEMAS))
        values = json.loads(text)
        assert [(c.name, c.arguments) for c in calls] == [(v["name"], v["parameters"]) for v in
                                                          (values if isinstance(values, list) else [values])]


def test_a_json_array_is_read_as_calls_only_when_every_item_is_one():
    assert [c.name for c in parse_tool_calls("[" + call("a", {}) + ", " + call("b", {"x": 1}) + "]")[1]] == ["a", "b"]
    for text in ["[]", "[" + call("a", {}) + ", 3]", '[{"type": "function", "name": "a"}]', "[1, 2]"]:
        assert parse_tool_calls(text) == (text, [])


@pytest.mark.parametrize("parameters, error", [
    ({"type": "string"}, r"^tools\[1\]\.function\.parameters: expected a JSON schema of type object"),
    ({"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(300)}},
     r"^tools\[1\]\.function\.parameters: the JSON schema's 'properties' has 300 properties; at most 256"),
])
def test_a_tool_whose_parameters_cannot_be_arguments_is_named(parameters, error):
    with pytest.raises(SchemaError, match=error):
        call_schema([WEATHER, tool("bad", parameters)], "required")


def test_a_schema_llguidance_refuses_is_a_tools_error(tokenizer):
    with pytest.raises(SchemaError, match=r"^tools: the JSON schema is not supported \(.*Invalid type: foo"):
        JsonConstraint(tokenizer, call_schema([tool("f", {"type": "object", "properties": {"a": {"type": "foo"}}})],
                                              "required"), param="tools")


@pytest.mark.parametrize("rope", [ROPE, {**ROPE, "factor": 8.0}], ids=["python_list", "json"])
def test_random_replies_at_temperature_1_are_valid_calls_in_both_tool_formats(tmp_path, rope):
    hf_model(rope=rope, num_hidden_layers=2).save_pretrained(tmp_path / "tiny")
    checkpoint = load_checkpoint(tmp_path / "tiny", dtype=torch.float32)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for i, (choice, parallel) in enumerate([("required", False), ("send_letter", False), ("required", True)] * 2):
            prompt = checkpoint.chat_format.encode_dialog([{"role": "user", "content": "Weather in Paris?"}],
                                                          tools=TOOLS, tool_choice=choice if choice == "required" else
                                                          {"type": "function", "function": {"name": choice}})
            constraint = JsonConstraint(checkpoint.tokenizer, call_schema(TOOLS, choice, parallel), param="tools",
                                        vocab_size=checkpoint.config.vocab_size, stop_ids=checkpoint.stop_ids)
            reply = Generation(checkpoint, prompt, max_new_tokens=400, temperature=1.0, seed=i, constraint=constraint,
                               tools=TOOLS, parallel_tool_calls=parallel)
            assert "".join(reply) == "" and reply.finish_reason == "stop"  # nothing of a call shown as text
            calls = check_calls(checkpoint.tokenizer.decode(reply.tokens), {choice} if choice != "required" else
                                {t["function"]["name"] for t in TOOLS})
            assert [(c.name, c.arguments) for c in reply.tool_calls] == [(c.name, c.arguments) for c in calls]
            assert len(calls) == 1 or parallel
    finally:
        torch.set_num_threads(threads)
