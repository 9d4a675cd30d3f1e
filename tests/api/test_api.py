"""The OpenAI-compatible API on the chat server (`chainlit run app/main.py`), driven by the official
`openai` client: models, replies with and without streaming (exactly the engine's greedy reply),
stop strings, usage, errors in OpenAI's shape, the API key, and a client that goes away.

The server runs a tiny random checkpoint with LLAMA_API_KEY set, history off and a password login,
so the same start also checks that those settings take effect.
"""

from __future__ import annotations

import concurrent.futures
import json
import re
import time

import httpx
import openai
import pytest
import torch
from support.scripted_backend import ScriptedBackend
from support.servers import ChainlitServer, server_env

from app.api.parse import parse_chat, parse_completion
from app.api.openai import ApiError
from model.decoding import StopScanner
from model.kv_cache import PREFILL_CHUNK

pytestmark = pytest.mark.timeout(240)

KEY = "test-key-123"
MAX_CONTEXT = 16384  # a reply this long takes the tiny model many seconds
QUESTION = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "What is the capital of France?"}]
LONG_SYSTEM = "You are a helpful assistant who answers briefly and kindly. " * 40  # more than a prefill chunk


@pytest.fixture(scope="module")
def server(tiny, tmp_path_factory):
    folder = tmp_path_factory.mktemp("api")
    env = server_env(checkpoint=tiny, weights_dir=tiny.parent, dtype="fp32", threads=1, max_context=MAX_CONTEXT,
                     api_key=KEY, history="off", history_db=folder / "history.db", auth="password",
                     password="household")
    env.pop("CHAINLIT_AUTH_SECRET", None)
    server = ChainlitServer(env, log=folder / "chainlit.log")
    server.history_db = folder / "history.db"
    yield from server.running()


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def greedy_generation(tiny):
    """The engine's greedy reply to a dialog (or a raw prompt), computed in this process: its Generation."""
    from model.checkpoint import load_checkpoint
    from model.generation import Generation
    from model.sampling import SamplingParams

    checkpoint = load_checkpoint(tiny, dtype=torch.float32)

    def reply(messages: list[dict] | str, max_tokens: int, logit_bias: dict[int, float] | None = None) -> Generation:
        ids = checkpoint.tokenizer.encode(messages, bos=True) if isinstance(messages, str) else \
            checkpoint.chat_format.encode_dialog(messages)
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            generation = Generation(checkpoint, ids, max_new_tokens=max_tokens, max_context=MAX_CONTEXT,
                                    sampling=SamplingParams(logit_bias=tuple((logit_bias or {}).items())))
            "".join(generation)
            return generation
        finally:
            torch.set_num_threads(threads)

    return reply


@pytest.fixture(scope="module")
def greedy(greedy_generation):
    """The engine's greedy reply to a dialog, computed in this process: (text, prompt tokens)."""
    def reply(messages: list[dict], max_tokens: int) -> tuple[str, int]:
        generation = greedy_generation(messages, max_tokens)
        return generation.text, len(generation.prompt_ids)

    return reply


# ---- replies ------------------------------------------------------------------------------------

def test_models_are_the_services_profiles(client, server):
    models = client.models.list()
    assert [m.id for m in models.data] == ["tiny"]
    assert client.models.retrieve("tiny").id == "tiny"
    # OpenAI's shape, and whether the model is loaded now (the default model stays, LLAMA_KEEP_ALIVE unset)
    [card] = httpx.get(f"{server.url}/v1/models", headers={"Authorization": f"Bearer {KEY}"}).json()["data"]
    assert set(card) == {"id", "object", "created", "owned_by", "loaded"} and card["loaded"] is True
    # every API answer carries an id of its own, as OpenAI's do (the SDK keeps it as `_request_id`)
    answers = [httpx.get(f"{server.url}{path}", headers={"Authorization": f"Bearer {KEY}"})
               for path in ("/v1/models", "/v1/models", "/api/tags", "/v1/models/no-such-model")]
    ids = [a.headers.get("x-request-id", "") for a in answers]
    assert all(re.fullmatch(r"req_[0-9a-f]{32}", i) for i in ids) and len(set(ids)) == 4, ids
    assert client.models.with_raw_response.list().headers["x-request-id"].startswith("req_")


def test_models_say_which_are_loaded_where_the_backend_knows():
    from fastapi.testclient import TestClient

    from app.api.routes import create_app

    class Backend:
        profiles, default, ready, observers = {"a": "/nowhere/a", "b": "/nowhere/b"}, "a", True, []

        def __init__(self, loaded):
            self.loaded = loaded

        def in_memory(self, name):
            return self.loaded(name)

    http = TestClient(create_app(Backend(lambda name: name == "a")))
    assert [(m["id"], m["loaded"]) for m in http.get("/v1/models").json()["data"]] == [("a", True), ("b", False)]
    card = http.get("/v1/models/b").json()
    assert set(card) == {"id", "object", "created", "owned_by", "loaded"} and card["loaded"] is False
    http = TestClient(create_app(Backend(lambda name: None)))  # a remote server's: not known, not said
    assert all("loaded" not in m for m in http.get("/v1/models").json()["data"])


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
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens in range(prompt_tokens)
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


def test_a_conversation_resent_with_one_more_turn_prefills_only_what_is_new(server, client):
    """An API client keeps no state here: it sends the whole conversation each time. The engine finds
    the earlier turn's keys and values by their token prefix (the server log's "from the cache"), the
    positions of whole prefill chunks (model/kv_cache.py)."""
    asked = [{"role": "system", "content": LONG_SYSTEM},
             {"role": "user", "content": "Tell me about prefix caches in one paragraph."}]
    first = client.chat.completions.create(model="tiny", messages=asked, temperature=0, max_tokens=20)
    again = asked + [{"role": "assistant", "content": first.choices[0].message.content},
                     {"role": "user", "content": "And in one sentence?"}]
    second = client.chat.completions.create(model="tiny", messages=again, temperature=0, max_tokens=5)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        logged = re.findall(r"reply: prompt (\d+) tokens \((\d+) from the cache\)", server.log())
        if logged and int(logged[-1][0]) == second.usage.prompt_tokens:
            break
        time.sleep(0.1)
    prompt, reused = map(int, logged[-1])
    assert prompt == second.usage.prompt_tokens
    # at least the first prompt's whole chunks come from the cache (the reply's text may encode to other
    # ids than the random model generated, so the match can end inside it)
    assert 0 < first.usage.prompt_tokens // PREFILL_CHUNK * PREFILL_CHUNK <= reused < prompt
    assert reused % PREFILL_CHUNK == 0
    # and the client is told, as OpenAI's usage.prompt_tokens_details.cached_tokens
    assert second.usage.prompt_tokens_details.cached_tokens == reused
    assert first.usage.prompt_tokens_details.cached_tokens < first.usage.prompt_tokens


def test_a_client_that_goes_away_frees_the_queue(server, client):
    before = server.log().count(GONE)
    with httpx.Client(timeout=60) as http:
        with http.stream("POST", f"{server.url}/v1/chat/completions", headers={"Authorization": f"Bearer {KEY}"},
                         json={"messages": QUESTION, "max_tokens": MAX_CONTEXT, "temperature": 1.0,
                               "ignore_eos": True, "stream": True}) as response:
            assert response.status_code == 200
            for line in response.iter_lines():
                if line.startswith("data: {") and any(c["delta"].get("content") for c in json.loads(line[6:])["choices"]):
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
                   json={"messages": QUESTION, "max_tokens": MAX_CONTEXT, "temperature": 1.0,
                         "ignore_eos": True},  # (a random model's sampled reply may pick a stop token at once)
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
        client.chat.completions.create(model="tiny", messages=QUESTION, n=5)
    assert error.value.body["param"] == "n" and "between 1 and 4" in error.value.body["message"]


def test_an_unknown_model_is_a_404(client):
    with pytest.raises(openai.NotFoundError) as error:
        client.chat.completions.create(model="gpt-4o", messages=QUESTION)
    assert error.value.body["code"] == "model_not_found" and "tiny" in error.value.body["message"]
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4o")


def test_a_route_not_served_is_openais_404_saying_why(client, server):
    """Not Chainlit's page, nor a bare 405: what OpenAI's clients read, and why for a route OpenAI has."""
    with pytest.raises(openai.NotFoundError) as error:
        client.embeddings.create(model="tiny", input="Hi")
    assert error.value.body["code"] == "unknown_url" and "embeddings are not served here" in error.value.body["message"]
    headers = {"Authorization": f"Bearer {KEY}"}
    for method, path in (("GET", "/v1/chat/completions"), ("POST", "/v1/nothing/x"), ("DELETE", "/v1/models"),
                         ("GET", "/v1")):
        response = httpx.request(method, f"{server.url}{path}", headers=headers, timeout=30)
        assert response.status_code == 404 and response.headers["content-type"] == "application/json", response.text
        assert response.json()["error"]["message"] == f"Invalid URL ({method} {path}).", response.text
    assert httpx.get(f"{server.url}/v1/embeddings", timeout=30).status_code == 401  # the key first, as OpenAI


@pytest.mark.parametrize("stream", [False, True])
def test_a_prompt_longer_than_the_context_is_a_400(client, stream):
    with pytest.raises(openai.BadRequestError) as error:
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "word " * (MAX_CONTEXT + 100)}],
                                       stream=stream)
    assert error.value.body["code"] == "context_length_exceeded"
    assert f"{MAX_CONTEXT} tokens" in error.value.body["message"]


def test_messages_that_fit_only_without_the_oldest_are_a_400_before_anything_runs(client, server, greedy):
    """OpenAI's clients expect an error, not a silently shortened conversation: the API asks the engine not
    to leave messages out, and the engine refuses such a request before it computes anything."""
    def replies_logged() -> int:
        server.log()  # (flushed)
        return server.log_path.read_text(errors="replace").count("reply: prompt")

    turn = "word " * 3000
    messages = [{"role": "user", "content": turn}, {"role": "assistant", "content": turn}] * 2
    before = replies_logged()
    with pytest.raises(openai.BadRequestError) as error:
        client.chat.completions.create(model="tiny", messages=[*messages, {"role": "user", "content": "And?"}],
                                       max_tokens=8000)
    assert error.value.body["code"] == "context_length_exceeded" and error.value.body["param"] == "messages"
    assert f"reads at most {MAX_CONTEXT} tokens at once, 8000 of them kept for the reply" in error.value.body["message"]
    # a chat that opens with the assistant's greeting is answered whole (it used to lose the greeting, a 400)
    greeting = [{"role": "system", "content": "You are terse."}, {"role": "assistant", "content": "Hello! Ask away."},
                {"role": "user", "content": "What is the capital of France?"}]
    reply = client.chat.completions.create(model="tiny", messages=greeting, max_tokens=4, temperature=0)
    assert (reply.choices[0].message.content, reply.usage.prompt_tokens) == greedy(greeting, 4)
    time.sleep(0.5)  # the engine's log line of that reply
    assert replies_logged() == before + 1  # that reply's, none for the refused request


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
                          headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})
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
    ({"messages": [{"role": "function", "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].tool_call_id"),
    ({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}, "tools[0].function"),
    ({"messages": [{"role": "user", "content": "x"}], "tool_choice": "required"}, "tool_choice"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages[0].content[0].type"),
    ({"messages": [{"role": "user", "content": "x"}], "top_p": 1.5}, "top_p"),
    ({"messages": [{"role": "user", "content": "x"}], "max_tokens": 0}, "max_tokens"),
    ({"messages": [{"role": "user", "content": "x"}], "seed": 1.5}, "seed"),
    ({"messages": [{"role": "user", "content": "x"}], "temperature": True}, "temperature"),
    ({"messages": [{"role": "user", "content": "x"}], "stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({"messages": [{"role": "user", "content": "x"}], "stream": "yes"}, "stream"),
    ({"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_schema", "json_schema": {
        "schema": {"type": "object"}}}}, "response_format.json_schema.name"),
    ({"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_object", "schema": {
        "type": "object"}}}, "response_format.schema"),
    ({"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {}, "schema_version": 2}}}, "response_format.json_schema.schema_version"),
])
def test_bad_requests_name_the_parameter(body, param):
    with pytest.raises(ApiError) as error:
        parse_chat(body, {"tiny": None}, "tiny")
    assert error.value.status == 400 and error.value.param == param


def test_a_request_becomes_a_conversation():
    chat = parse_chat({"messages": [
        {"role": "system", "content": "Be brief."}, {"role": "developer", "content": "Be kind."},
        {"role": "user", "content": [{"type": "text", "text": "Hi "}, {"type": "text", "text": "there"}]},
        {"role": "assistant", "content": "Hello"}, {"role": "user", "content": "Bye"}],
        "max_tokens": 5, "max_completion_tokens": 7, "top_k": 3, "stop": "x"}, {"tiny": None}, "tiny")
    assert chat.model == "tiny" and chat.settings.stop == ("x",) and not chat.stream
    assert chat.conversation.system_prompt == "Be brief.\n\nBe kind."
    assert [(m.role, m.content) for m in chat.conversation.messages] == [
        ("user", "Hi there"), ("assistant", "Hello"), ("user", "Bye")]
    assert chat.settings.max_new_tokens == 7 and chat.settings.top_k == 3 and chat.settings.temperature is None


def test_a_full_queue_is_a_429_with_retry_after():
    from fastapi.testclient import TestClient

    from app.api.routes import create_app
    from app.backend.protocol import ServerBusy

    class Full:
        profiles, default, ready, observers = {"tiny": "/nowhere"}, "tiny", True, []

        def stream(self, conversation, settings, **options):
            raise ServerBusy("40 requests are running or waiting")

    response = TestClient(create_app(Full())).post("/v1/chat/completions", json={"messages": QUESTION})
    assert response.status_code == 429 and response.headers["retry-after"].isdigit()
    assert response.json()["error"]["code"] == "server_busy" and "40 requests" in response.json()["error"]["message"]


def test_metrics_count_replies_tokens_and_the_engine_state(server, client):
    def scrape() -> dict[str, float]:
        text = httpx.get(f"{server.url}/metrics", headers={"Authorization": f"Bearer {KEY}"}).text
        return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                if line and not line.startswith("#")}

    assert httpx.get(f"{server.url}/metrics").status_code == 401  # the API key covers it
    before = scrape()
    reply = client.chat.completions.create(model="tiny", messages=[{"role": "system", "content": LONG_SYSTEM}, *QUESTION],
                                           temperature=0, max_tokens=7)
    time.sleep(0.2)  # the engine's state after the reply reaches the web process
    after = scrape()
    assert after['llama_requests_total{outcome="done"}'] == before.get('llama_requests_total{outcome="done"}', 0) + 1
    assert after["llama_generated_tokens_total"] - before.get("llama_generated_tokens_total", 0) == 7
    assert after["llama_prompt_tokens_total"] - before.get("llama_prompt_tokens_total", 0) == reply.usage.prompt_tokens
    assert after["llama_time_to_first_token_seconds_count"] == before.get("llama_time_to_first_token_seconds_count",
                                                                          0) + 1
    assert after["llama_requests_running"] == 0 and after["llama_requests_waiting"] == 0
    assert after["llama_kv_cache_bytes"] > 0 and after["llama_kv_caches_kept"] >= 1  # the reply's cache is kept



# ---- n, completions, parameters that are refused ------------------------------------------------

def test_n_replies_share_the_prompt_and_each_is_complete(client, server):
    completion = client.chat.completions.create(model="tiny", messages=QUESTION, temperature=1.0, seed=3,
                                                max_tokens=8, n=3)
    assert [c.index for c in completion.choices] == [0, 1, 2]
    assert all(c.message.content and c.finish_reason == "length" for c in completion.choices)
    assert len({c.message.content for c in completion.choices}) == 3  # seeds 3, 4, 5
    assert completion.usage.completion_tokens == 24
    stream = client.chat.completions.create(model="tiny", messages=QUESTION, temperature=1.0, seed=3, max_tokens=8,
                                            n=3, stream=True)
    texts, finishes = {}, {}
    for chunk in stream:
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + (c.delta.content or "")
            finishes[c.index] = c.finish_reason or finishes.get(c.index)
    assert [texts[i] for i in range(3)] == [c.message.content for c in completion.choices]
    assert finishes == {0: "length", 1: "length", 2: "length"}


@pytest.mark.parametrize("stream", [False, True])
def test_a_raw_completion_continues_the_prompt(client, stream, tiny):
    from model.checkpoint import load_checkpoint
    from model.generation import generate

    checkpoint = load_checkpoint(tiny, dtype=torch.float32)
    ids = checkpoint.tokenizer.encode("Once upon a time", bos=True)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        expected = generate(checkpoint, ids, max_new_tokens=16, temperature=0.0)
        expected_text = "".join(expected)
    finally:
        torch.set_num_threads(threads)
    response = client.completions.create(model="tiny", prompt="Once upon a time", temperature=0, stream=stream)
    if stream:
        chunks = list(response)
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        finish = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
    else:
        [choice] = response.choices
        text, finish = choice.text, choice.finish_reason
        assert response.object == "text_completion" and response.usage.prompt_tokens == len(ids)
        assert response.usage.completion_tokens == 16  # OpenAI's default max_tokens for completions
    assert text == expected_text and finish == ("length" if len(expected.tokens) == 16 else "stop")


@pytest.mark.parametrize("extra, param", [
    ({"audio": {"voice": "alloy", "format": "wav"}}, "audio"),
    ({"modalities": ["text", "audio"]}, "modalities"),
    ({"prediction": {"type": "content", "content": "x"}}, "prediction"),
    ({"functions": [{"name": "f"}]}, "functions"),
    ({"web_search_options": {}}, "web_search_options"),
    ({"made_up_option": 1}, "made_up_option"),
])
def test_parameters_that_are_not_done_are_refused_by_name(client, extra, param):
    with pytest.raises(openai.BadRequestError) as error:
        client.chat.completions.create(model="tiny", messages=QUESTION, max_tokens=2, extra_body=extra)
    assert error.value.body["param"] == param and error.value.body["code"] == "unsupported_parameter"


def test_metadata_past_openais_bounds_is_refused_saying_which_bound():
    """OpenAI's bounds (a stored response keeps its metadata): 16 pairs, keys of 64 characters, values of 512."""
    asked = {"messages": [{"role": "user", "content": "x"}]}
    parse_chat({**asked, "metadata": {f"{i:064d}": "v" * 512 for i in range(16)}}, {"tiny": None}, "tiny")
    for metadata, says in (({"k" * 65: "v"}, "length <= 64 for a key"), ({"k": "v" * 513}, "length <= 512"),
                           ({str(i): "v" for i in range(17)}, "length <= 16")):
        with pytest.raises(ApiError) as error:
            parse_chat({**asked, "metadata": metadata}, {"tiny": None}, "tiny")
        assert (error.value.status, error.value.param) == (400, "metadata")
        assert error.value.message.startswith("Invalid 'metadata': ") and says in error.value.message


def test_labels_and_values_that_ask_for_nothing_are_accepted(client):
    completion = client.chat.completions.create(
        model="tiny", messages=QUESTION, max_tokens=2, user="ada", metadata={"k": "v"}, store=False,
        modalities=["text"], logit_bias={}, n=1)
    assert completion.choices[0].message.content is not None


@pytest.mark.parametrize("body, param", [
    ({"prompt": "x", "echo": True}, "echo"),
    ({"prompt": "x", "suffix": "y"}, "suffix"),
    ({"prompt": "x", "best_of": 3}, "best_of"),
    ({"prompt": ["a", "b"]}, "prompt"),
    ({"prompt": [1, 2, 3]}, "prompt"),
    ({"prompt": "x", "logprobs": 6}, "logprobs"),
])
def test_bad_completion_requests_name_the_parameter(body, param):
    with pytest.raises(ApiError) as error:
        parse_completion(body, {"tiny": None}, "tiny")
    assert error.value.status == 400 and error.value.param == param


# ---- tool calls in OpenAI's shape (the engine's side: tests/test_engine.py, tests/test_tools.py) ----

CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
WEATHER = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}]


@pytest.mark.parametrize("stream", [False, True])
def test_a_tool_call_comes_back_as_openai_tool_calls(stream):
    import asyncio

    from app.api.routes import create_app
    from app.messages import Done, Stats

    backend = ScriptedBackend([Done("scripted", "", "stop", Stats(prompt_tokens=30, new_tokens=9), tool_calls=[CALL])])

    async def ask():
        transport = httpx.ASGITransport(app=create_app(backend))
        async with openai.AsyncOpenAI(base_url="http://test/v1", api_key="x",
                                      http_client=httpx.AsyncClient(transport=transport)) as client:
            history = QUESTION + [{"role": "assistant", "content": None, "tool_calls": [CALL]},
                                  {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 21 C"}]
            response = await client.chat.completions.create(model="tiny", messages=history, tools=WEATHER,
                                                            stream=stream)
            return [chunk async for chunk in response] if stream else response

    response = asyncio.run(ask())
    if stream:
        calls = [c for chunk in response for choice in chunk.choices for c in choice.delta.tool_calls or []]
        # a reply that is a call from its start: no content at all, not "" (OpenAI's null; the AI SDK would show an
        # empty text part)
        assert response[0].choices[0].delta.role == "assistant" and response[0].choices[0].delta.content is None
        assert all(choice.delta.content is None for chunk in response for choice in chunk.choices)
        finish = [choice.finish_reason for chunk in response for choice in chunk.choices][-1]
    else:
        calls, finish = response.choices[0].message.tool_calls, response.choices[0].finish_reason
        assert response.choices[0].message.content is None
    assert finish == "tool_calls" and len(calls) == 1
    assert (calls[0].id, calls[0].function.name, calls[0].function.arguments) == ("call_1", "get_weather",
                                                                                  '{"city": "Paris"}')
    [(conversation, _, _)] = backend.asked  # the call and its result went on as messages of their own
    assert [(m.role, m.tool_call_id) for m in conversation.messages] == [("user", None), ("assistant", None),
                                                                         ("tool", "call_1")]
    assert conversation.messages[1].tool_calls == [CALL]


# ---- logprobs and JSON replies ------------------------------------------------------------------

def test_logprobs_are_the_models_own_streamed_or_not(client):
    asked = dict(model="tiny", messages=QUESTION, temperature=0, max_tokens=10, logprobs=True, top_logprobs=3)
    completion = client.chat.completions.create(**asked)
    entries = completion.choices[0].logprobs.content
    assert len(entries) == completion.usage.completion_tokens == 10
    for e in entries:
        assert e.logprob <= 0 and len(e.top_logprobs) == 3
        assert [t.logprob for t in e.top_logprobs] == sorted((t.logprob for t in e.top_logprobs), reverse=True)
        assert e.logprob == pytest.approx(e.top_logprobs[0].logprob) and e.token == e.top_logprobs[0].token  # greedy
    assert "".join(bytes(e.bytes).decode("utf-8", "replace") for e in entries) == completion.choices[0].message.content
    streamed = [e for chunk in client.chat.completions.create(**asked, stream=True) for c in chunk.choices
                if c.logprobs for e in c.logprobs.content]
    assert [(e.token, round(e.logprob, 4)) for e in streamed] == [(e.token, round(e.logprob, 4)) for e in entries]
    plain = client.chat.completions.create(model="tiny", messages=QUESTION, temperature=0, max_tokens=3)
    assert plain.choices[0].logprobs is None
    raw = client.completions.create(model="tiny", prompt="Once upon a time", temperature=0, max_tokens=5, logprobs=2)
    report = raw.choices[0].logprobs
    assert len(report.tokens) == len(report.token_logprobs) == len(report.top_logprobs) == 5
    assert report.text_offset[0] == 0 and all(len(top) == 2 for top in report.top_logprobs)


COLOR = {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]},
                                          "count": {"type": "integer", "minimum": 0, "maximum": 9}},
         "required": ["color", "count"], "additionalProperties": False}


@pytest.mark.parametrize("stream", [False, True])
def test_a_json_schema_reply_is_a_document_of_the_schema(client, stream):
    import jsonschema

    response = client.chat.completions.create(
        model="tiny", messages=QUESTION, temperature=1.0, seed=1, max_tokens=60, stream=stream,
        response_format={"type": "json_schema", "json_schema": {"name": "color", "schema": COLOR}})
    if stream:
        chunks = list(response)
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        finish = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
    else:
        text, finish = response.choices[0].message.content, response.choices[0].finish_reason
    jsonschema.validate(json.loads(text), COLOR)  # a random model, constrained: still a valid document
    assert finish == "stop"


def test_a_schema_that_cannot_be_compiled_and_bad_combinations_are_400s(client):
    with pytest.raises(openai.BadRequestError) as error:
        client.chat.completions.create(model="tiny", messages=QUESTION, max_tokens=5, response_format={
            "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}})
    assert "schema" in error.value.body["message"]
    with pytest.raises(openai.BadRequestError) as error:
        client.chat.completions.create(model="tiny", messages=QUESTION, response_format={"type": "xml"})
    assert error.value.body["param"] == "response_format.type"
    with pytest.raises(openai.BadRequestError) as error:
        client.chat.completions.create(model="tiny", messages=QUESTION, response_format={"type": "json_object"},
                                       extra_body={"ignore_eos": True})
    assert error.value.body["param"] == "ignore_eos"


@pytest.fixture(scope="module")
def default_model_client(tmp_path_factory):
    """The API alone (`python -m app.api`) on the embedded default model, SmolLM2-135M-Instruct."""
    from support.servers import ApiServer
    from support.special_checkpoints import default_model
    server = ApiServer(server_env(checkpoint=default_model(), threads=1),
                       log=tmp_path_factory.mktemp("api") / "api.log")
    try:
        server.wait_ready()
        yield openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)
    finally:
        server.stop()


@pytest.mark.parametrize("question", ["Describe a cat as JSON with its name, age and color.",
                                      "Give me a JSON object listing three fruits and their colors."])
def test_json_mode_on_the_default_model_gives_a_json_object(default_model_client, question):
    reply = default_model_client.chat.completions.create(
        model="SmolLM2-135M-Instruct", messages=[{"role": "user", "content": question}], temperature=0,
        max_tokens=200, response_format={"type": "json_object"})
    assert reply.choices[0].finish_reason == "stop", reply.choices[0].message.content
    assert isinstance(json.loads(reply.choices[0].message.content), dict)


# ---- logit_bias -----------------------------------------------------------------------------------

def test_logit_bias_bans_and_forces_tokens_in_the_engines_greedy_reply(client, server, greedy_generation):
    """OpenAI's logit_bias: -100 keeps the greedy reply's first token out, +100 makes every token that one; the
    replies are the engine's greedy replies with the same bias, alone, n of them, streamed, next to a request
    without a bias in the same batch, and on the completions route."""
    plain = greedy_generation(QUESTION, 8)
    first = plain.tokens[0]
    banned = greedy_generation(QUESTION, 8, {first: -100})
    assert banned.tokens[0] != first and first not in banned.tokens[:1]
    forced_id = plain.tokens[-1] if plain.tokens[-1] != first else plain.tokens[1]
    forced = greedy_generation(QUESTION, 8, {forced_id: 100, first: 5})
    assert forced.tokens == [forced_id] * 8

    def ask(bias: dict | None, **more) -> list[str]:
        reply = client.chat.completions.create(model="tiny", messages=QUESTION, temperature=0, max_tokens=8,
                                               logit_bias=bias, **more)
        return [choice.message.content for choice in reply.choices]

    assert ask({str(first): -100}) == [banned.text] and ask({str(forced_id): 100, str(first): 5}) == [forced.text]
    assert ask({str(first): -100}, n=2) == [banned.text] * 2
    streamed = client.chat.completions.create(model="tiny", messages=QUESTION, temperature=0, max_tokens=8,
                                              logit_bias={str(first): -100}, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == banned.text
    with concurrent.futures.ThreadPoolExecutor(3) as pool:  # one batch: each reply its own bias
        together = list(pool.map(lambda bias: ask(bias)[0], [{str(first): -100}, None, {str(forced_id): 100, str(first): 5}]))
    assert together == [banned.text, plain.text, forced.text]
    prompt = "The capital of France is"
    raw = greedy_generation(prompt, 6)
    raw_banned = greedy_generation(prompt, 6, {raw.tokens[0]: -100.0})
    completion = client.completions.create(model="tiny", prompt=prompt, max_tokens=6, temperature=0,
                                           logit_bias={str(raw.tokens[0]): -100})
    assert completion.choices[0].text == raw_banned.text != raw.text


@pytest.mark.parametrize("bias, says, param", [
    ({"abc": 1}, "the key \"abc\" is not a token id", "logit_bias"),
    ({"-1": 1}, "the key \"-1\" is not a token id", "logit_bias"),
    ({"1.5": 1}, "is not a token id", "logit_bias"),
    ({" 12": 1}, "is not a token id", "logit_bias"),
    ({"\uff11\uff12": 1}, "is not a token id", "logit_bias"),  # full-width digits
    ({"1" * 40: 1}, "\"111111111111111111111111...\" is not a token id", "logit_bias"),
    ({"4294967296": 1}, "is not a token id", "logit_bias"),
    ({"12": 100.5}, "'logit_bias.12' is 100.5; expected a number from -100 to 100", "logit_bias.12"),
    ({"12": True}, "is true", "logit_bias.12"),
    ({"12": "5"}, "is \"5\"", "logit_bias.12"),
    ({"12": None}, "is null", "logit_bias.12"),
    ({"12": [1]}, "is [1]", "logit_bias.12"),
    ({str(i): 1 for i in range(1025)}, "length <= 1024", "logit_bias"),
    ([1, 2], "expected `object | null`, got `array`", "logit_bias"),
])
def test_a_logit_bias_that_is_not_token_ids_to_numbers_is_a_400_naming_the_key(bias, says, param):
    with pytest.raises(ApiError) as error:
        parse_chat({"messages": [{"role": "user", "content": "x"}], "logit_bias": bias}, {"tiny": None}, "tiny")
    assert (error.value.status, error.value.param) == (400, param) and says in error.value.message, error.value.message
    with pytest.raises(ApiError) as error:
        parse_completion({"prompt": "x", "logit_bias": bias}, {"tiny": None}, "tiny")
    assert (error.value.status, error.value.param) == (400, param)


def test_a_logit_bias_past_the_models_vocabulary_is_a_400_naming_the_id(client, tiny):
    vocab = json.loads((tiny / "config.json").read_text())["vocab_size"]
    with pytest.raises(openai.BadRequestError) as error:
        client.chat.completions.create(model="tiny", messages=QUESTION, max_tokens=2,
                                       logit_bias={"5": 1, str(vocab): -100})
    assert error.value.body["param"] == "logit_bias"
    assert f"token id {vocab} is not in the vocabulary of tiny (token ids 0 to {vocab - 1:,})" in error.value.body["message"]
    assert client.chat.completions.create(model="tiny", messages=QUESTION, max_tokens=2,
                                          logit_bias={str(vocab - 1): -100}).choices[0].finish_reason == "length"
