"""tool_choice "required" and a named function through the API (`python -m app.api` on a tiny random Llama 3.2
checkpoint, driven by the official `openai` client): sampled at temperature 1, a random model writes garbage,
so only the constraint (model/tool_choice.py) makes every reply a valid call; streamed, none of it comes as
content. "none" gives no calls, and what cannot be honoured is a 400 that names it."""

from __future__ import annotations

import openai
import pytest
from support.servers import ApiServer, server_env
from support.tool_calls import QUESTION, SCHEMAS, TOOLS, ask_all, body, problems

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


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}],
                         ids=["required", "named"])
def test_a_forced_call_cut_by_max_tokens_is_the_call_so_far_with_finish_reason_length(server, tool_choice):
    """As OpenAI's: the calls, the last with its arguments where they ended, no content, finish_reason "length",
    streamed as tool-call deltas only (the same calls as the whole reply's: greedy); through the Responses API a
    function_call item with status "incomplete" in an incomplete response. The same seeds with room to finish
    give whole calls whose arguments begin with the cut ones'."""
    allowed = set(SCHEMAS) if tool_choice == "required" else {"get_weather"}
    full = ask_all(server.url, KEY, [body(0, tool_choice, False) | {"temperature": 0}], stream=False)[0]
    assert full[2] == "tool_calls"
    cases = range(3, 27, 3)  # max_tokens: cut in the name, the keys, the values
    asked = [body(0, tool_choice, False) | {"max_tokens": limit, "temperature": 0} for limit in cases]
    whole, streamed = ask_all(server.url, KEY, asked, stream=False), ask_all(server.url, KEY, asked, stream=True)
    named = 0
    for limit, (content, calls, finish), (s_content, s_calls, s_finish) in zip(cases, whole, streamed):
        if finish == "tool_calls":  # the whole call took no more than this
            assert calls == full[1] or [c["arguments"] for c in calls] == [c["arguments"] for c in full[1]]
            continue
        assert (content, finish) == (None, "length") and (s_content, s_finish) == (None, "length"), limit
        assert [(c["name"], c["arguments"]) for c in calls] == [(c["name"], c["arguments"]) for c in s_calls]
        assert 1 <= len(calls) <= len(full[1]), (limit, calls)
        for call, done in zip(calls, full[1]):  # greedy: the cut calls are the whole reply's as far as they went
            assert call["arguments"] == done["arguments"][:len(call["arguments"])], (limit, call, done)
            assert done["name"].startswith(call["name"])
        named += calls[0]["name"] in allowed
    assert named >= 3  # most were cut after the name
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0, timeout=60)
    asked = body(0, tool_choice, False) | {"max_tokens": 9, "temperature": 0}
    chunks = [c.model_dump() for c in client.chat.completions.create(**asked, stream=True)]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"  # and no content, not even "": a call from the first
    assert all(c["choices"][0]["delta"]["content"] is None for c in chunks if c["choices"])
    choice = {"type": "function", "name": "get_weather"} if tool_choice != "required" else "required"
    response = client.responses.create(model="tiny", input=QUESTION[0]["content"], max_output_tokens=16,
                                       tools=[{"type": "function", **t["function"]} for t in TOOLS],
                                       tool_choice=choice, temperature=0)
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    [item] = response.output
    assert item.type == "function_call" and item.status == "incomplete" and item.name in allowed
