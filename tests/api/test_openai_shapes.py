"""OpenAI's shapes as this server writes them (app.api) and as the remote backend reads them (app.backend.remote)."""

import msgspec
import pytest

from app.api.openai import chat_logprobs
from app.api.routes import completion_logprobs
from app.messages import TokenLogprob
from app.api.openai import (
    Call,
    CallFunction,
    ChatChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChunkChoice,
    Delta,
    ReplyMessage,
    TextCompletion,
    Usage,
)
from app.backend.remote import add_call_delta, error_message, read_logprobs

TOKENS = [TokenLogprob("Hé", list("Hé".encode()), -0.25, [TokenLogprob("Hé", list("Hé".encode()), -0.25),
                                                            TokenLogprob("Hi", [72, 105], -1.5)]),
          TokenLogprob(" 👍", list(" 👍".encode()), -3.0, [])]


def test_a_streamed_piece_writes_only_what_it_brings():
    made = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 7, "model": "tiny"}
    text = ChatCompletionChunk(**made, choices=[ChunkChoice(index=1, delta=Delta(content="x"))])
    assert msgspec.json.decode(msgspec.json.encode(text)) == {
        **made, "choices": [{"index": 1, "delta": {"content": "x"}, "logprobs": None, "finish_reason": None}]}
    end = ChatCompletionChunk(**made, choices=[ChunkChoice(delta=Delta(), finish_reason="stop")])
    assert msgspec.json.decode(msgspec.json.encode(end))["choices"][0]["delta"] == {}
    usage = ChatCompletionChunk(**made, choices=[], usage=Usage(3, 4, 7))
    assert msgspec.json.decode(msgspec.json.encode(usage))["usage"] == {
        "prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}


def test_a_whole_reply_has_content_null_beside_tool_calls_and_no_tool_calls_without_them():
    call = Call(id="call_1", type="function", function=CallFunction("f", '{"a": 1}'))
    with_call = ChatCompletion(choices=[ChatChoice(message=ReplyMessage(content=None, tool_calls=[call]),
                                                   finish_reason="tool_calls")])
    message = msgspec.json.decode(msgspec.json.encode(with_call))["choices"][0]["message"]
    assert message == {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}]}
    plain = ChatCompletion(choices=[ChatChoice(message=ReplyMessage(content="Hi"))])
    assert msgspec.json.decode(msgspec.json.encode(plain))["choices"][0]["message"] == {
        "role": "assistant", "content": "Hi"}


@pytest.mark.parametrize("written", [chat_logprobs(TOKENS), completion_logprobs(TOKENS, 0)])
def test_logprobs_written_are_read_back_as_they_were(written):
    shape = ChatCompletionChunk if written.__class__.__name__ == "ChatLogprobs" else TextCompletion
    choice = {"index": 0, "logprobs": msgspec.to_builtins(written)}
    choice |= {"delta": {"content": "Hé 👍"}} if shape is ChatCompletionChunk else {"text": "Hé 👍"}
    read = msgspec.convert({"choices": [choice]}, shape).choices[0].logprobs
    assert read_logprobs(read) == TOKENS


def test_streamed_tool_call_pieces_are_joined_per_call():
    calls = {}
    for piece in [{"index": 0, "id": "call_1", "type": "function", "function": {"name": "get_", "arguments": ""}},
                  {"index": 0, "function": {"name": "weather", "arguments": '{"city": '}},
                  {"index": 1, "id": "call_2", "function": {"name": "now"}},
                  {"index": 0, "function": {"arguments": '"Paris"}'}}]:
        add_call_delta(calls, msgspec.convert(piece, Call))
    assert calls == {0: {"id": "call_1", "type": "function",
                         "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
                     1: {"id": "call_2", "type": "function", "function": {"name": "now", "arguments": ""}}}


def test_a_piece_that_is_not_the_shape_is_refused_by_name():
    with pytest.raises(msgspec.ValidationError, match=r"choices\[0\]\.index"):
        msgspec.convert({"choices": [{"index": "one", "delta": {}}]}, ChatCompletionChunk)


@pytest.mark.parametrize(("body", "message"), [
    ({"error": {"message": "No such model", "type": "invalid_request_error"}}, "No such model"),
    ({"error": "overloaded"}, "overloaded"),
    ({"error": {"message": 5}}, "{'error': {'message': 5}}"),
    ("<html>Bad gateway</html>", "<html>Bad gateway</html>"),
])
def test_error_bodies_of_any_shape_give_a_message(body, message):
    assert error_message(body) == message
