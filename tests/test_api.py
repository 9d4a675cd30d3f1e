"""The OpenAI-compatible API on the chat server (`chainlit run app/main.py`), driven by the official
`openai` client: models, replies with and without streaming (exactly the engine's greedy reply),
stop strings, usage, errors in OpenAI's shape, the API key, and a client that goes away.

The server runs a tiny random checkpoint with LLAMA_API_KEY set, history off and a password login,
so the same start also checks that those settings take effect.
"""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import openai
import pytest
import torch

from app.api import ApiError, StopScanner, parse_chat_request
from e2e_helpers import ChainlitServer, server_env, write_tiny_checkpoint

pytestmark = pytest.mark.timeout(240)

KEY = "test-key-123"
MAX_CONTEXT = 16384  # a reply this long takes the tiny model many seconds
QUESTION = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return write_tiny_checkpoint(tmp_path_factory.mktemp("weights") / "tiny")


@pytest.fixture(scope="module")
def server(tiny, tmp_path_factory):
    folder = tmp_path_factory.mktemp("api")
    env = server_env(checkpoint=tiny, weights_dir=tiny.parent, dtype="fp32", threads=1, max_context=MAX_CONTEXT,
                     api_key=KEY, history="off", history_db=folder / "history.db", auth="password",
                     password="household")
    env.pop("CHAINLIT_AUTH_SECRET", None)
    server = ChainlitServer(env, log=folder / "chainlit.log")
    server.history_db = folder / "history.db"
    try:
        server.wait_ready()
        yield server
    finally:
        server.stop()
    assert "Traceback" not in server.log_path.read_text(errors="replace")


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def greedy(tiny):
    """The engine's greedy reply to a dialog, computed in this process."""
    from model.checkpoint import load_checkpoint
    from model.generate import Generation

    checkpoint = load_checkpoint(tiny, dtype=torch.float32)

    def reply(messages: list[dict], max_tokens: int) -> tuple[str, int]:
        ids = checkpoint.chat_format.encode_dialog(messages)
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            return "".join(Generation(checkpoint, ids, max_new_tokens=max_tokens, temperature=0.0,
                                      max_context=MAX_CONTEXT)), len(ids)
        finally:
            torch.set_num_threads(threads)

    return reply


# ---- replies ------------------------------------------------------------------------------------

def test_models_are_the_services_profiles(client):
    models = client.models.list()
    assert [m.id for m in models.data] == ["tiny"]
    assert client.models.retrieve("tiny").id == "tiny"


def test_a_reply_is_the_engines_greedy_reply_with_usage(client, greedy):
    expected, prompt_tokens = greedy(QUESTION, 12)
    completion = client.chat.completions.create(model="tiny", messages=QUESTION, temperature=0, max_tokens=12)
    [choice] = completion.choices
    assert choice.message.role == "assistant" and choice.message.content == expected
    assert choice.finish_reason == "length"
    assert (completion.usage.prompt_tokens, completion.usage.completion_tokens) == (prompt_tokens, 12)
    assert completion.usage.total_tokens == prompt_tokens + 12
    assert completion.model == "tiny" and completion.id.startswith("chatcmpl-")
    # max_completion_tokens is the newer name; seed makes sampling repeatable
    again = client.chat.completions.create(model="tiny", messages=QUESTION, temperature=0, max_completion_tokens=12)
    assert again.choices[0].message.content == expected
    sampled = [client.chat.completions.create(model="tiny", messages=QUESTION, temperature=1.0, seed=7,
                                              max_tokens=12).choices[0].message.content for _ in range(2)]
    assert sampled[0] == sampled[1]


def test_a_streamed_reply_comes_in_pieces_and_ends_with_usage(client, greedy):
    expected, prompt_tokens = greedy(QUESTION, 300)
    stream = client.chat.completions.create(model="tiny", messages=QUESTION, temperature=0, max_tokens=300,
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    pieces = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
    assert "".join(pieces) == expected
    assert len(pieces) >= 2, "the reply did not stream"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 300
    assert chunks[-1].usage.prompt_tokens == prompt_tokens
    assert len({c.id for c in chunks}) == 1


@pytest.mark.parametrize("stream", [False, True])
def test_a_stop_string_cuts_the_reply(client, greedy, stream):
    expected, _ = greedy(QUESTION, 40)
    stop = expected[10:13]
    cut = expected[:expected.find(stop)]
    response = client.chat.completions.create(model="tiny", messages=QUESTION, temperature=0, max_tokens=40,
                                              stop=[stop, "never-there"], stream=stream)
    if stream:
        chunks = list(response)
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        finish = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
    else:
        text, finish = response.choices[0].message.content, response.choices[0].finish_reason
    assert text == cut and finish == "stop"


def wait_for_line(server: ChainlitServer, text: str, count: int, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while server.log().count(text) < count and time.monotonic() < deadline:
        time.sleep(0.1)
    assert server.log().count(text) == count, server.log()


GONE = "the client went away; cancelled"


def test_a_client_that_goes_away_frees_the_queue(server, client):
    before = server.log().count(GONE)
    with httpx.Client(timeout=60) as http:
        with http.stream("POST", f"{server.url}/v1/chat/completions", headers={"Authorization": f"Bearer {KEY}"},
                         json={"messages": QUESTION, "max_tokens": MAX_CONTEXT, "temperature": 1.0,
                               "stream": True}) as response:
            assert response.status_code == 200
            for line in response.iter_lines():
                if '"content": "' in line and '"content": ""' not in line:
                    break  # leaving the block after the first piece of text closes the connection
            else:
                pytest.fail("no text came")
    gone = time.monotonic()
    completion = client.chat.completions.create(model="tiny", messages=QUESTION, max_tokens=3)
    assert completion.usage.completion_tokens == 3
    assert time.monotonic() - gone < 3, "the next request waited for the abandoned one"
    wait_for_line(server, GONE, before + 1)


def test_a_client_that_stops_waiting_for_a_whole_reply_frees_the_queue(server, client):
    before = server.log().count(GONE)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.url}/v1/chat/completions", headers={"Authorization": f"Bearer {KEY}"},
                   json={"messages": QUESTION, "max_tokens": MAX_CONTEXT, "temperature": 1.0},
                   timeout=httpx.Timeout(30, read=1.0))
    gone = time.monotonic()
    assert client.chat.completions.create(model="tiny", messages=QUESTION, max_tokens=3).choices[0].message.content
    assert time.monotonic() - gone < 3, "the next request waited for the abandoned one"
    wait_for_line(server, GONE, before + 1)


# ---- errors -------------------------------------------------------------------------------------

def test_a_bad_parameter_is_a_400_naming_it(client):
    with pytest.raises(openai.BadRequestError) as error:
        client.chat.completions.create(model="tiny", messages=QUESTION, temperature=-1)
    assert error.value.status_code == 400
    assert error.value.body["param"] == "temperature" and error.value.body["type"] == "invalid_request_error"
    assert "between 0 and 2" in error.value.body["message"]
    with pytest.raises(openai.BadRequestError) as error:
        client.chat.completions.create(model="tiny", messages=[{"role": "assistant", "content": "Hi"}])
    assert error.value.body["param"] == "messages"
    with pytest.raises(openai.BadRequestError) as error:
        client.chat.completions.create(model="tiny", messages=QUESTION, n=2)
    assert error.value.body["param"] == "n"


def test_an_unknown_model_is_a_404(client):
    with pytest.raises(openai.NotFoundError) as error:
        client.chat.completions.create(model="gpt-4o", messages=QUESTION)
    assert error.value.body["code"] == "model_not_found" and "tiny" in error.value.body["message"]
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4o")


@pytest.mark.parametrize("stream", [False, True])
def test_a_prompt_longer_than_the_context_is_a_400(client, stream):
    with pytest.raises(openai.BadRequestError) as error:
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "word " * (MAX_CONTEXT + 100)}],
                                       stream=stream)
    assert error.value.body["code"] == "context_length_exceeded"
    assert f"{MAX_CONTEXT} tokens" in error.value.body["message"]


def test_without_the_right_key_requests_are_refused(server):
    for key in ("wrong", None):
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        for method, path in (("GET", "/v1/models"), ("POST", "/v1/chat/completions")):
            response = httpx.request(method, f"{server.url}{path}", headers=headers, json={"messages": QUESTION})
            assert response.status_code == 401, (key, path)
            assert response.json()["error"]["code"] == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{server.url}/v1", api_key="wrong", max_retries=0).models.list()


def test_a_body_that_is_not_json_is_a_400(server):
    response = httpx.post(f"{server.url}/v1/chat/completions", content=b"{not json",
                          headers={"Authorization": f"Bearer {KEY}"})
    assert response.status_code == 400
    assert set(response.json()["error"]) == {"message", "type", "param", "code"}


# ---- the same start: history off, password login ------------------------------------------------

def test_history_off_and_a_password_login(server):
    config = httpx.get(f"{server.url}/auth/config").json()
    assert config["requireLogin"] and config["passwordAuth"] and not config["headerAuth"]
    right = httpx.post(f"{server.url}/login", data={"username": "ada", "password": "household"})
    assert right.status_code == 200 and "access_token" in right.cookies
    wrong = httpx.post(f"{server.url}/login", data={"username": "ada", "password": "guess"})
    assert wrong.status_code == 401
    threads = httpx.post(f"{server.url}/project/threads", cookies=dict(right.cookies),
                         json={"pagination": {"first": 20, "cursor": None}, "filter": {}})
    assert threads.status_code == 400  # no data layer: nothing is stored
    assert not server.history_db.exists()


# ---- request parsing, no server -----------------------------------------------------------------

def test_stop_scanner_holds_back_what_may_begin_a_stop_string():
    scanner = StopScanner(["END", "xyz"])
    assert scanner.feed("Hello E") == "Hello "  # "E" may begin END
    assert scanner.feed("N") == ""
    assert scanner.feed("Dless") == "" and scanner.stopped
    scanner = StopScanner(["END"])
    assert scanner.feed("AEN") == "A" and scanner.feed("ZZ") == "ENZZ" and scanner.flush() == ""
    scanner = StopScanner(["bc", "ab"])
    assert scanner.feed("xabc") == "x"  # the earliest stop string wins


@pytest.mark.parametrize("body, param", [
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages[0].content[0]"),
    ({"messages": [{"role": "user", "content": "x"}], "top_p": 1.5}, "top_p"),
    ({"messages": [{"role": "user", "content": "x"}], "max_tokens": 0}, "max_tokens"),
    ({"messages": [{"role": "user", "content": "x"}], "seed": 1.5}, "seed"),
    ({"messages": [{"role": "user", "content": "x"}], "temperature": True}, "temperature"),
    ({"messages": [{"role": "user", "content": "x"}], "stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({"messages": [{"role": "user", "content": "x"}], "stream": "yes"}, "stream"),
])
def test_bad_requests_name_the_parameter(body, param):
    with pytest.raises(ApiError) as error:
        parse_chat_request(body, {"tiny": None}, "tiny")
    assert error.value.status == 400 and error.value.param == param


def test_a_request_becomes_a_conversation():
    chat = parse_chat_request({"messages": [
        {"role": "system", "content": "Be brief."}, {"role": "developer", "content": "Be kind."},
        {"role": "user", "content": [{"type": "text", "text": "Hi "}, {"type": "text", "text": "there"}]},
        {"role": "assistant", "content": "Hello"}, {"role": "user", "content": "Bye"}],
        "max_tokens": 5, "max_completion_tokens": 7, "top_k": 3, "stop": "x"}, {"tiny": None}, "tiny")
    assert chat.model == "tiny" and chat.stop == ["x"] and not chat.stream
    assert chat.conversation.system_prompt == "Be brief.\n\nBe kind."
    assert [(m.role, m.content) for m in chat.conversation.messages] == [
        ("user", "Hi there"), ("assistant", "Hello"), ("user", "Bye")]
    assert chat.settings.max_new_tokens == 7 and chat.settings.top_k == 3 and chat.settings.temperature is None
