"""tool_choice "required" and a named function through the API (`python -m app.api` on a tiny random Llama 3.2
checkpoint, driven by the official `openai` client): sampled at temperature 1, a random model writes garbage,
so only the constraint (model/tool_choice.py) makes every reply a valid call; streamed, none of it comes as
content. "none" gives no calls, and what cannot be honoured is a 400 that names it."""

from __future__ import annotations

import openai
import pytest
from support.servers import ApiServer, server_env
from support.tool_calls import QUESTION, TOOLS, ask_all, body, problems

from app.api.pieces import failure_error
from app.messages import Failed

pytestmark = pytest.mark.timeout(300)

KEY = "tool-choice-key"
REPLIES = 50  # per case


@pytest.fixture(scope="module")
def server(tiny, tmp_path_factory):
    folder = tmp_path_factory.mktemp("tool-choice")
    server = ApiServer(server_env(checkpoint=tiny, weights_dir=tiny.parent, dtype="fp32", threads=1, api_key=KEY,
                                  max_batch=16), log=folder / "api.log")
    yield from server.running()


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "send_letter"}}],
                         ids=["required", "named"])
def test_every_reply_is_a_valid_call_of_an_allowed_tool(server, tool_choice, stream):
    parallel = [i % 2 == 1 for i in range(REPLIES)]  # half of them one call only
    replies = ask_all(server.url, KEY, [body(i, tool_choice, parallel[i]) for i in range(REPLIES)], stream)
    assert problems(replies, tool_choice, parallel) == []
    assert len({call["id"] for _, calls, _ in replies for call in calls}) == sum(len(calls) for _, calls, _ in replies)
    if tool_choice == "required":  # the model chose: more than one tool among the replies
        assert len({call["name"] for _, calls, _ in replies for call in calls}) > 1


def test_none_gives_no_calls(server):
    for content, calls, finish in ask_all(server.url, KEY, [body(i, "none", True) | {"max_tokens": 12} for i in range(10)],
                                          stream=False):
        assert calls == [] and finish in ("stop", "length") and isinstance(content, str)


def test_tools_that_cannot_be_called_are_400s_that_name_them(server):
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0, timeout=60)
    bad = [*TOOLS, {"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]
    with pytest.raises(openai.BadRequestError) as error:
        client.chat.completions.create(model="tiny", messages=QUESTION, tools=bad, tool_choice="required")
    assert error.value.body["param"] == "tools[3].function.parameters"
    assert error.value.body["code"] == "invalid_function_parameters" and "type object" in error.value.body["message"]
    unknown = [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "foo"}}}}}]
    with pytest.raises(openai.BadRequestError) as error:
        client.chat.completions.create(model="tiny", messages=QUESTION, tools=unknown, tool_choice="required")
    assert error.value.body["param"] == "tools" and "Invalid type: foo" in error.value.body["message"]
    # "auto" compiles nothing: the same tools are offered in the prompt
    reply = client.chat.completions.create(model="tiny", messages=QUESTION, tools=bad, tool_choice="auto", max_tokens=3)
    assert reply.choices[0].finish_reason in ("stop", "length", "tool_calls")


def test_a_model_without_tool_calling_refuses_tools_by_name():
    failed = Failed("r", "tools: the model chatml has no tool calling (its chat template is given no tools; Llama 3 "
                         "checkpoints are), so it takes neither tools nor tool_choice: send the request without them",
                    "bad_request")
    error = failure_error(failed)
    assert (error.status, error.param) == (400, "tools") and "tool_choice" in error.message
    assert failure_error(Failed("r", "The request cannot be answered: messages", "bad_request")).param is None
    held = failure_error(Failed("r", "messages: the model chatml has no tool calling (...)", "bad_request"))
    assert (held.status, held.param) == (400, "messages")
