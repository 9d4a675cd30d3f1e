"""Ollama's API on the chat server (`chainlit run app/main.py`), driven by the official `ollama` client: chat and
generate, streamed and not (the same reply as /v1's for the same settings), JSON formats, tools, the models
(tags, show, ps, pull from a stand-in hub, delete), keep_alive loading and unloading, errors in Ollama's shape
naming the field, unknown models, the API key and the guard.

The server runs a tiny random checkpoint with LLAMA_API_KEY set; its weights folder takes the pulled model.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from datetime import datetime

import httpx
import jsonschema
import ollama
import pytest
from support.checkpoints import write_tiny_checkpoint
from support.fake_hub import FakeHub
from support.scripted_backend import ScriptedBackend
from support.servers import ChainlitServer, server_env

pytestmark = pytest.mark.timeout(300)

KEY = "test-key-ollama"
MAX_CONTEXT = 4096
QUESTION = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "What is the capital of France?"}]
PULLED = "acme/Tiny-Pulled"
COLOR = {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]},
                                          "count": {"type": "integer", "minimum": 0, "maximum": 9}},
         "required": ["color", "count"], "additionalProperties": False}
WEATHER = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                             "parameters": {"type": "object", "properties": {
                                                 "city": {"type": "string", "description": "The city"}},
                                                 "required": ["city"]}}}]


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    """A stand-in for the Hugging Face Hub holding another tiny checkpoint."""
    hub = FakeHub()
    hub.add_folder(PULLED, write_tiny_checkpoint(tmp_path_factory.mktemp("hub") / "Tiny-Pulled", seed=1))
    yield hub
    hub.stop()


@pytest.fixture(scope="module")
def server(tiny, hub, tmp_path_factory):
    folder = tmp_path_factory.mktemp("ollama")
    env = server_env(checkpoint=tiny, weights_dir=tiny.parent, dtype="fp32", threads=1, max_context=MAX_CONTEXT,
                     api_key=KEY)
    env |= {"HF_ENDPOINT": hub.url, "HF_HUB_DISABLE_PROGRESS_BARS": "1", "HF_HOME": str(folder / "hf")}
    env.pop("HF_TOKEN", None)
    server = ChainlitServer(env, log=folder / "chainlit.log")
    yield from server.running()


@pytest.fixture(scope="module")
def client(server) -> ollama.Client:
    return ollama.Client(host=server.url, headers={"Authorization": f"Bearer {KEY}"}, timeout=120)


def v1(server, path: str, **body) -> dict:
    """The OpenAI route's answer to the same question."""
    response = httpx.post(f"{server.url}/v1/{path}", headers={"Authorization": f"Bearer {KEY}"}, json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()


def post(server, path: str, body: dict | str) -> httpx.Response:
    """A request with a body (given as JSON text: as it is, lone surrogates and 1e400 included)."""
    return httpx.post(f"{server.url}{path}", content=body if isinstance(body, str) else json.dumps(body),
                      headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}, timeout=120)


def when(text: str) -> float:
    return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()


# ---- replies ------------------------------------------------------------------------------------

def test_a_chat_is_the_same_reply_as_v1s_with_ollamas_figures(client, server):
    expected = v1(server, "chat/completions", model="tiny", messages=QUESTION, temperature=0, max_tokens=12)
    reply = client.chat(model="tiny:latest", messages=QUESTION, options={"temperature": 0, "num_predict": 12})
    assert reply.message.role == "assistant" and reply.message.content == expected["choices"][0]["message"]["content"]
    assert reply.model == "tiny:latest" and reply.done and reply.done_reason == "length"
    assert (reply.prompt_eval_count, reply.eval_count) == (expected["usage"]["prompt_tokens"], 12)
    assert reply.total_duration >= reply.prompt_eval_duration + reply.eval_duration > 0
    assert reply.load_duration == 0  # the default model stays loaded
    assert abs(when(reply.created_at) - time.time()) < 60


def test_a_chat_streams_by_default_one_object_a_line(client, server):
    whole = client.chat(model="tiny", messages=QUESTION, options={"temperature": 0, "num_predict": 200})
    chunks = list(client.chat(model="tiny", messages=QUESTION, options={"temperature": 0, "num_predict": 200},
                              stream=True))
    assert "".join(c.message.content for c in chunks) == whole.message.content
    assert len([c for c in chunks if c.message.content]) >= 2, "the reply did not stream"
    assert [c.done for c in chunks] == [False] * (len(chunks) - 1) + [True]
    assert chunks[-1].eval_count == 200 and chunks[-1].done_reason == "length" and chunks[0].eval_count is None
    raw = post(server, "/api/chat", {"model": "tiny", "messages": QUESTION, "options": {"num_predict": 5}})
    assert raw.headers["content-type"] == "application/x-ndjson"  # stream left out: true, as Ollama's
    lines = [json.loads(line) for line in raw.text.splitlines()]
    assert len(lines) >= 2 and lines[-1]["done"] is True and lines[-1]["eval_count"] == 5
    assert set(lines[0]) == {"model", "created_at", "message", "done"}  # the figures are in the last one only
    assert {"total_duration", "load_duration", "prompt_eval_count", "prompt_eval_duration", "eval_count",
            "eval_duration", "done_reason"} <= set(lines[-1])


@pytest.mark.parametrize("stream", [False, True])
def test_generate_is_a_chat_of_one_message_or_with_raw_the_prompt_continued(client, server, stream):
    def text(reply) -> str:
        return "".join(c.response for c in reply) if stream else reply.response

    options = {"temperature": 0, "num_predict": 10}
    chat = v1(server, "chat/completions", model="tiny", messages=QUESTION, temperature=0, max_tokens=10)
    assert text(client.generate(model="tiny", prompt=QUESTION[1]["content"], system=QUESTION[0]["content"],
                                options=options, stream=stream)) == chat["choices"][0]["message"]["content"]
    completion = v1(server, "completions", model="tiny", prompt="Once upon a time", temperature=0, max_tokens=10)
    reply = client.generate(model="tiny", prompt="Once upon a time", raw=True, options=options, stream=stream)
    assert text(reply) == completion["choices"][0]["text"]


@pytest.mark.parametrize("option, value, param", [
    ("temperature", 0.5, "temperature"), ("seed", 6, "seed"), ("top_k", 2, "top_k"), ("top_p", 0.3, "top_p"),
    ("min_p", 0.3, "min_p"), ("repeat_penalty", 3.0, "repetition_penalty"), ("frequency_penalty", 2.0,
                                                                            "frequency_penalty"),
    ("presence_penalty", 2.0, "presence_penalty"), ("num_predict", 5, "max_tokens")])
def test_each_option_is_v1s_setting_of_the_same_effect(client, server, option, value, param):
    # A penalty changes a seeded draw only where it lowers the token that would have won (the draw's noise
    # belongs to each token id), seldom on a random model's flat distribution; greedy replies repeat tokens.
    base = {"temperature": 0.0} if "penalty" in option else {"temperature": 1.0, "seed": 5}
    baseline = client.chat(model="tiny", messages=QUESTION, options=base | {"num_predict": 24}).message.content
    expected = v1(server, "chat/completions", model="tiny", messages=QUESTION,
                  **base | {"max_tokens": 24, param: value})["choices"][0]["message"]["content"]
    ours = client.chat(model="tiny", messages=QUESTION, options=base | {"num_predict": 24, option: value})
    assert ours.message.content == expected != baseline  # the same setting, and it changes the reply


def test_options_that_change_nothing_here_are_taken_and_a_stop_cuts(client):
    options = {"temperature": 1.0, "seed": 5, "num_predict": 24}
    expected = client.chat(model="tiny", messages=QUESTION, options=options).message.content
    harmless = {"num_ctx": 2048, "num_keep": 4, "num_thread": 8, "num_gpu": 99, "num_batch": 512, "use_mmap": True,
                "mirostat": 0, "typical_p": 1.0, "tfs_z": 1.0, "repeat_last_n": 64, "penalize_newline": True,
                "low_vram": False, "stop": None}
    assert client.chat(model="tiny", messages=QUESTION, options=options | harmless).message.content == expected
    off = {"repeat_penalty": 3.0, "repeat_last_n": 0}  # the penalty looks back over no token: off
    assert client.chat(model="tiny", messages=QUESTION, options=options | off).message.content == expected
    greedy = client.chat(model="tiny", messages=QUESTION, options={"temperature": 0, "num_predict": 40})
    stop = greedy.message.content[10:13]
    cut = client.chat(model="tiny", messages=QUESTION, options={"temperature": 0, "num_predict": 40, "stop": [stop]})
    assert cut.message.content == greedy.message.content[:greedy.message.content.find(stop)]
    assert cut.done_reason == "stop"


def test_fields_ollama_does_not_have_are_left_out_and_named_in_the_log(server):
    """As Ollama's server: a newer client's field, OpenAI's `user`, an old option change nothing and are logged."""
    asked = {"model": "tiny", "messages": QUESTION, "stream": False, "options": {"temperature": 0, "num_predict": 12}}
    expected = post(server, "/api/chat", asked).json()["message"]["content"]
    extra = asked | {"user": "ada", "shift": True, "options": asked["options"] | {"rope_frequency_base": 5e5},
                     "messages": [QUESTION[0], QUESTION[1] | {"name": "ada"}]}
    response = post(server, "/api/chat", extra)
    assert response.status_code == 200 and response.json()["message"]["content"] == expected, response.text
    line = "left out 4 field(s) this API does not have: 'messages[1].name', 'options.rope_frequency_base', " \
           "'user', 'shift'"
    deadline = time.monotonic() + 10
    while line not in server.log() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert line in server.log()
    show = post(server, "/api/show", {"model": "tiny", "verbose": False, "format": "gguf"})
    assert show.status_code == 200 and "'format'" in server.log()
    # a declared field of the wrong type is still a 400 naming it, beside an undeclared one
    wrong = post(server, "/api/chat", extra | {"options": {"made_up": 1, "temperature": "hot"}})
    assert wrong.status_code == 400 and "options.temperature" in wrong.json()["error"]


def test_a_json_schema_format_gives_a_document_of_it(client):
    for stream in (False, True):
        reply = client.chat(model="tiny", messages=QUESTION, format=COLOR, stream=stream,
                            options={"temperature": 1.0, "seed": 1, "num_predict": 60})
        text = "".join(c.message.content for c in reply) if stream else reply.message.content
        jsonschema.validate(json.loads(text), COLOR)  # a random model, constrained: still a valid document
    reply = client.generate(model="tiny", prompt="A color, as JSON.", format=COLOR,
                            options={"temperature": 1.0, "seed": 2, "num_predict": 60})
    jsonschema.validate(json.loads(reply.response), COLOR)


def test_format_json_gives_a_json_object(client):
    """A random model, greedy: unconstrained it writes no JSON; constrained to an object, it closes one."""
    cat = [{"role": "user", "content": "A cat, as JSON."}]
    free = client.chat(model="tiny", messages=cat, options={"temperature": 0, "num_predict": 20}).message.content
    with pytest.raises(ValueError):
        json.loads(free)
    for stream in (False, True):
        reply = client.chat(model="tiny", messages=cat, format="json", stream=stream,
                            options={"temperature": 0, "num_predict": 200})
        text = "".join(c.message.content for c in reply) if stream else reply.message.content
        assert isinstance(json.loads(text), dict)


def test_logprobs_are_the_tokens_of_the_reply(client):
    for stream in (False, True):
        reply = client.chat(model="tiny", messages=QUESTION, options={"temperature": 0, "num_predict": 8},
                            logprobs=True, top_logprobs=2, stream=stream)
        chunks = list(reply) if stream else [reply]
        entries = [e for chunk in chunks for e in chunk.logprobs or []]
        assert len(entries) == chunks[-1].eval_count == 8
        assert "".join(e.token for e in entries) == "".join(c.message.content for c in chunks)
        assert all(len(e.top_logprobs) == 2 and e.logprob == pytest.approx(e.top_logprobs[0].logprob)
                   for e in entries)  # greedy: each token the likeliest
    assert client.chat(model="tiny", messages=QUESTION, options={"num_predict": 2}).logprobs is None


def test_tools_go_into_the_prompt_and_results_come_back_as_messages(client):
    plain = client.chat(model="tiny", messages=QUESTION, options={"num_predict": 1})
    with_tools = client.chat(model="tiny", messages=QUESTION, tools=WEATHER, options={"num_predict": 1})
    assert with_tools.prompt_eval_count > plain.prompt_eval_count + 20  # the definitions are in the prompt
    called = [*QUESTION, {"role": "assistant", "content": "", "tool_calls": [
        {"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "content": "Sunny, 21 C", "tool_name": "get_weather"}]
    answered = client.chat(model="tiny", messages=called, tools=WEATHER, options={"num_predict": 1})
    assert answered.prompt_eval_count > with_tools.prompt_eval_count + 10  # the call and its result are in it


# ---- the models ---------------------------------------------------------------------------------

def test_version_tags_and_show(client, server):
    assert httpx.get(f"{server.url}/api/version", headers={"Authorization": f"Bearer {KEY}"}).json() == {
        "version": "0.6.8"}
    [model] = [m for m in client.list().models if m.model == "tiny"]
    assert model.size > 1_000_000 and len(model.digest) == 64 and model.modified_at.year >= 2024
    assert (model.details.family, model.details.format, model.details.quantization_level) == (
        "llama", "safetensors", "F32")
    assert model.details.parameter_size.endswith("M")
    shown = client.show("tiny:latest")
    assert shown.modelinfo["llama.context_length"] == MAX_CONTEXT and shown.modelinfo["llama.block_count"] == 2
    assert shown.modelinfo["general.parameter_count"] > 8_000_000
    assert shown.capabilities == ["completion", "tools"] and "<|start_header_id|>" in shown.template
    assert "temperature" in shown.parameters and shown.details.family == "llama"


def test_keep_alive_loads_and_unloads_and_ps_tells_when(client, server):
    def loaded() -> dict:
        return {m.model: m for m in client.ps().models}

    assert set(loaded()) == {"tiny"} and loaded()["tiny"].expires_at.year > 2200  # the default model stays
    assert loaded()["tiny"].context_length == MAX_CONTEXT and loaded()["tiny"].size > 1_000_000
    assert loaded()["tiny"].size_vram == 0  # on the CPU (ollama-js types it as a number: it is always there)
    unloaded = client.generate(model="tiny", keep_alive=0)
    assert unloaded.done and unloaded.done_reason == "unload" and loaded() == {}
    load = client.chat(model="tiny", messages=[], keep_alive="10m")
    assert load.done_reason == "load" and load.message.role == "assistant"
    assert abs(loaded()["tiny"].expires_at.timestamp() - (time.time() + 600)) < 30
    reply = client.chat(model="tiny", messages=QUESTION, options={"num_predict": 3}, keep_alive=0)
    assert reply.eval_count == 3
    deadline = time.monotonic() + 10
    while loaded() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert loaded() == {}  # unloaded once its request ended
    again = client.chat(model="tiny", messages=QUESTION, options={"num_predict": 3})  # loads it, and it stays
    assert again.load_duration > 0 and loaded()["tiny"].expires_at.year > 2200
    for past_any_date in (1e300, "100000000h"):  # longer than Go's longest duration: forever, as Ollama's
        assert client.chat(model="tiny", messages=[], keep_alive=past_any_date).done_reason == "load"
        assert loaded()["tiny"].expires_at.year > 2200  # (its date could not be written: /api/ps was a 500)


def test_a_model_is_pulled_from_the_hub_even_if_the_client_goes_away_and_deleted(client, server, hub, tiny):
    hub.held = threading.Event()
    with httpx.Client(timeout=60, headers={"Authorization": f"Bearer {KEY}"}) as http:
        with http.stream("POST", f"{server.url}/api/pull", json={"model": f"hf.co/{PULLED}"}) as response:
            assert response.status_code == 200 and response.headers["content-type"] == "application/x-ndjson"
            lines = response.iter_lines()
            assert json.loads(next(lines)) == {"status": "pulling manifest"}
            progress = json.loads(next(lines))
            while progress.get("completed", 0) == 0:
                progress = json.loads(next(lines))
            assert progress["status"] == f"pulling {PULLED}" and 0 < progress["completed"] < progress["total"]
    assert "Tiny-Pulled" not in [m.model for m in client.list().models]  # under way, held by the hub
    hub.held.set()  # the client is gone; the download goes on
    statuses = list(client.pull(PULLED, stream=True))  # joins the pull under way
    assert statuses[-1].status == "success" and all(s.completed <= s.total for s in statuses if s.total)
    assert "Tiny-Pulled" in [m.model for m in client.list().models] and (tiny.parent / "Tiny-Pulled").is_dir()
    assert client.chat(model="Tiny-Pulled", messages=QUESTION, options={"num_predict": 3}).eval_count == 3
    assert client.pull(PULLED).status == "success"  # here already
    for here in ("tiny", "tiny:latest", "Tiny-Pulled"):  # by the name /api/tags gives it: here already, as Ollama's
        assert client.pull(here).status == "success"
        assert [s.status for s in client.pull(here, stream=True)] == ["pulling manifest", "success"]
    with pytest.raises(ollama.ResponseError) as error:  # another owner's model of the same name is not this one
        client.pull("someone-else/Tiny-Pulled")
    assert error.value.status_code == 400 and f"pulled from {PULLED}" in error.value.error
    for named in ("-x/Tiny", "acme/-x", "ownér/módel", "acme/a--b"):  # never an option, nor past the Hub's rule
        with pytest.raises(ollama.ResponseError) as error:
            client.pull(named)
        assert error.value.status_code == 400 and "owner/name" in error.value.error
    for revision in ("--help", "-x", "../main", ".hidden", "a b"):  # never an option of the fetch, nor a path
        with pytest.raises(ollama.ResponseError) as error:
            client.pull(f"acme/Other:{revision}")
        assert error.value.status_code == 400 and "is not a revision" in error.value.error
    assert "Tiny-Pulled" in [m.model for m in client.ps().models]
    assert client.delete("Tiny-Pulled").status == "success"  # loaded: unloaded first, as Ollama's server does
    assert "Tiny-Pulled" not in [m.model for m in client.ps().models]
    assert "Tiny-Pulled" not in [m.model for m in client.list().models] and not (tiny.parent / "Tiny-Pulled").exists()
    for name, status in (("Tiny-Pulled", 404), ("tiny", 400)):  # gone; the default model is not removed
        with pytest.raises(ollama.ResponseError) as error:
            client.delete(name)
        assert error.value.status_code == status
    with pytest.raises(ollama.ResponseError) as error:  # the hub's answer, as a status that says it: not found
        client.pull("acme/No-Such-Model")
    assert error.value.status_code == 404 and "acme/No-Such-Model" in error.value.error
    with pytest.raises(ollama.ResponseError) as error:
        list(client.pull("acme/No-Such-Model", stream=True))
    assert "acme/No-Such-Model" in error.value.error
    with pytest.raises(ollama.ResponseError) as error:
        client.pull("llama3.2")
    assert error.value.status_code == 400 and "owner/name" in error.value.error
    for outside in ("acme/..", "acme/.", "acme/.Tiny-Pulled.download"):  # never a folder that is not a model's
        with pytest.raises(ollama.ResponseError) as error:
            client.pull(outside)
        assert error.value.status_code == 400 and "is not a Hugging Face model id" in error.value.error


# ---- errors -------------------------------------------------------------------------------------

USER = [{"role": "user", "content": "Hi"}]


@pytest.mark.parametrize("path, body, field", [
    ("/api/chat", {"model": "tiny", "messages": "Hi"}, "messages"),
    ("/api/chat", {"model": "tiny", "messages": [{"role": "function", "content": "x"}]}, "messages[0].role"),
    ("/api/chat", {"model": "tiny", "messages": [{"role": "assistant", "content": "x"}]}, "messages"),
    ("/api/chat", {"model": "tiny", "messages": [{"role": "user", "content": "x", "images": ["aGk="]}]},
     "messages[0].images"),
    ("/api/chat", '{"model": "tiny", "messages": [{"role": "user", "content": "\\ud800"}]}', "messages[0].content"),
    ("/api/chat", {"model": "tiny", "messages": USER, "options": {"temperature": "hot"}}, "options.temperature"),
    ("/api/chat", '{"model": "tiny", "messages": [], "options": {"temperature": 1e400}}', "options.temperature"),
    ("/api/chat", '{"model": "tiny", "messages": [], "options": {"top_k": NaN}}', "options.top_k"),
    ("/api/chat", {"model": "tiny", "messages": USER, "options": {"top_p": 1.5}}, "options.top_p"),
    ("/api/chat", {"model": "tiny", "messages": USER, "options": {"seed": 2**70}}, "options.seed"),
    ("/api/chat", {"model": "tiny", "messages": USER, "options": {"num_predict": 1e30}}, "options.num_predict"),
    ("/api/chat", {"model": "tiny", "messages": USER, "options": {"num_predict": 0}}, "options.num_predict"),
    ("/api/chat", {"model": "tiny", "messages": USER, "options": {"stop": ["a", "b", "c", "d", "e"]}}, "options.stop"),
    ("/api/chat", {"model": "tiny", "messages": USER, "options": {"mirostat": 2}}, "options.mirostat"),
    ("/api/chat", {"model": "tiny", "messages": USER, "options": {"typical_p": 0.5}}, "options.typical_p"),
    ("/api/chat", {"model": "tiny", "messages": USER, "options": {"repeat_last_n": 128}}, "options.repeat_last_n"),
    ("/api/chat", {"model": "tiny", "messages": USER, "format": "xml"}, "format"),
    ("/api/chat", {"model": "tiny", "messages": USER, "format": {"type": "nonsense"}}, "schema"),
    ("/api/chat", {"model": "tiny", "messages": USER, "format": json.loads("[" * 100 + "]" * 100)}, "format"),
    ("/api/chat", {"model": "tiny", "messages": USER, "format": "json", "tools": WEATHER}, "format"),
    ("/api/chat", {"model": "tiny", "messages": USER, "tools": [{"type": "function"}]}, "tools[0].function"),
    ("/api/chat", {"model": "tiny", "messages": USER, "stream": "yes"}, "stream"),
    ("/api/chat", {"model": "tiny", "messages": USER, "think": True}, "think"),
    ("/api/chat", {"model": "tiny", "messages": USER, "keep_alive": "soon"}, "keep_alive"),
    ("/api/chat", {"model": "tiny", "messages": USER, "top_logprobs": 3}, "top_logprobs"),
    ("/api/chat", {"messages": USER}, "model"),
    ("/api/generate", {"model": "tiny", "prompt": "x", "context": [1, 2, 3]}, "context"),
    ("/api/generate", {"model": "tiny", "prompt": "x", "suffix": "y"}, "suffix"),
    ("/api/generate", {"model": "tiny", "prompt": "x", "images": ["aGk="]}, "images"),
    ("/api/generate", {"model": "tiny", "prompt": "x", "template": "{{ .Prompt }}"}, "template"),
    ("/api/generate", {"model": "tiny", "prompt": "x", "raw": True, "system": "s"}, "system"),
    ("/api/generate", {"model": "tiny", "prompt": 5}, "prompt"),
    ("/api/show", {"model": ["tiny"]}, "model"),
])
def test_a_bad_field_is_a_400_naming_it_in_ollamas_shape(server, path, body, field):
    response = post(server, path, body)
    assert response.status_code == 400, response.text
    assert response.headers["content-type"] == "application/json"
    assert set(response.json()) == {"error"} and field in response.json()["error"]


def test_bodies_that_are_not_json_objects_are_refused(server):
    for content, kind, status in ((b"{not json", "application/json", 400), (b"[]", "application/json", 400),
                                  (b"{not json", "application/x-www-form-urlencoded", 400)):
        response = httpx.post(f"{server.url}/api/chat", content=content,
                              headers={"Authorization": f"Bearer {KEY}", "Content-Type": kind})
        assert response.status_code == status and set(response.json()) == {"error"}


def test_a_body_sent_as_curl_d_sends_it_is_read_and_a_pages_text_plain_is_not(server):
    """Ollama's own examples send `curl -d '{...}'`: form-urlencoded, or no type at all from other tools."""
    body = json.dumps({"model": "tiny", "prompt": "Hi", "stream": False, "options": {"num_predict": 2}}).encode()
    for kind in ("application/x-www-form-urlencoded", None, "text/plain"):
        headers = {"Authorization": f"Bearer {KEY}"} | ({"Content-Type": kind} if kind else {})
        response = httpx.post(f"{server.url}/api/generate", content=body, headers=headers, timeout=120)
        assert response.status_code == 200 and response.json()["done"] is True, (kind, response.text)
    page = httpx.post(f"{server.url}/api/generate", content=body, timeout=30,
                      headers={"Authorization": f"Bearer {KEY}", "Content-Type": "text/plain", "Origin": server.url})
    assert page.status_code == 415 and "application/json" in page.json()["error"]
    show = httpx.post(f"{server.url}/api/show", content=b'{"model": "tiny"}', timeout=30,
                      headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/x-www-form-urlencoded"})
    assert show.status_code == 200 and "details" in show.json()


def test_an_unknown_model_is_a_404(client, server):
    for ask in (lambda: client.chat(model="nope", messages=USER), lambda: client.generate(model="tiny:q4", prompt="x"),
                lambda: client.show("nope")):
        with pytest.raises(ollama.ResponseError) as error:
            ask()
        assert error.value.status_code == 404 and error.value.error.startswith("model '")
        assert error.value.error.endswith("' not found")
    for method, path in (("POST", "/api/embed"), ("GET", "/api/nothing-here")):  # not Chainlit's page either
        response = httpx.request(method, f"{server.url}{path}", headers={"Authorization": f"Bearer {KEY}"})
        assert response.status_code == 404 and "error" in response.json()
    assert "<html" in httpx.get(f"{server.url}/").text.lower()  # the chat page is still Chainlit's


def test_without_the_right_key_requests_are_refused(server, monkeypatch):
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        anonymous = ollama.Client(host=server.url, headers=headers)
        for ask in (anonymous.list, anonymous.ps, lambda: anonymous.chat(model="tiny", messages=USER)):
            with pytest.raises(ollama.ResponseError) as error:
                ask()
            assert error.value.status_code == 401 and "API key" in error.value.error
    monkeypatch.setenv("OLLAMA_API_KEY", KEY)  # as the ollama clients take a key
    assert "tiny" in [m.model for m in ollama.Client(host=server.url).list().models]


def test_the_guard_covers_ollamas_routes(server):
    headers = {"Authorization": f"Bearer {KEY}"}
    assert httpx.get(f"{server.url}/api/tags", headers=headers | {"Origin": "http://evil.example"}).status_code == 403
    assert httpx.get(f"{server.url}/api/tags", headers=headers | {"Host": "evil.example"}).status_code == 421
    assert httpx.get(f"{server.url}/api/tags", headers=headers | {"Origin": server.url}).status_code == 200


# ---- without a server ---------------------------------------------------------------------------

CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}


@pytest.mark.parametrize("stream", [False, True])
def test_a_tool_call_comes_back_in_ollamas_shape(stream):
    from app.api.routes import create_app
    from app.messages import Done, Stats

    backend = ScriptedBackend([Done("scripted", "", "stop", Stats(prompt_tokens=30, new_tokens=9), tool_calls=[CALL])])
    history = [*QUESTION, {"role": "assistant", "content": "", "tool_calls": [
        {"function": {"name": "get_time", "arguments": {}}}, {"function": {"name": "get_weather", "arguments": {
            "city": "Rome"}}}]}, {"role": "tool", "content": "Rainy", "tool_name": "get_weather"},
        {"role": "tool", "content": "12:00"}]

    async def ask():
        transport = httpx.ASGITransport(app=create_app(backend))
        client = ollama.AsyncClient(host="http://test", transport=transport)
        reply = await client.chat(model="tiny", messages=history, tools=WEATHER, stream=stream, keep_alive="1h")
        return [chunk async for chunk in reply] if stream else [reply]

    chunks = asyncio.run(ask())
    calls = [call for chunk in chunks for call in chunk.message.tool_calls or []]
    assert [(c.function.name, dict(c.function.arguments)) for c in calls] == [("get_weather", {"city": "Paris"})]
    assert chunks[-1].done and chunks[-1].done_reason == "stop" and chunks[-1].eval_count == 9
    [(conversation, settings, options)] = backend.asked
    assert conversation.system_prompt == "You are terse."
    assert [(m.role, m.tool_call_id) for m in conversation.messages] == [
        ("user", None), ("assistant", None), ("tool", "call_2_1"), ("tool", "call_2_0")]  # each result to its call
    assert conversation.messages[1].tool_calls[1] == {"id": "call_2_1", "type": "function", "function": {
        "name": "get_weather", "arguments": '{"city": "Rome"}'}}
    assert options["tools"] == WEATHER and options["trim"] is True  # as Ollama: the oldest messages go first
    assert backend.kept == [("tiny", 3600.0)]


def test_the_api_alone_serves_ollamas_routes_too():
    from fastapi.testclient import TestClient

    from app.api.routes import create_app

    http = TestClient(create_app(ScriptedBackend([])))
    assert http.get("/api/version").json() == {"version": "0.6.8"}
    assert http.post("/api/chat", json={"model": "gpt-4o", "messages": USER}).json() == {
        "error": "model 'gpt-4o' not found"}



def test_a_model_pulled_by_its_hugging_face_name_is_found_by_it(tmp_path):
    """hf.co/owner/name:Q4_K_M, as a client pulled it, names the folder that pull made (NAME-Q4_K_M), but only
    where the folder came from that repo."""
    from app.api.ollama_models import local_name
    from model.convert.folder import note_source

    folder = tmp_path / "Llama-3.2-1B-Instruct-GGUF-Q4_K_M"
    note_source(folder, "bartowski/Llama-3.2-1B-Instruct-GGUF", "Q4_K_M")
    profiles = {folder.name: str(folder), "tiny": str(tmp_path / "tiny")}  # (as the backend keeps them)
    assert local_name("hf.co/bartowski/Llama-3.2-1B-Instruct-GGUF:Q4_K_M", profiles) == folder.name
    assert local_name("bartowski/Llama-3.2-1B-Instruct-GGUF:q4_k_m", profiles) == folder.name
    assert local_name("hf.co/someone-else/Llama-3.2-1B-Instruct-GGUF:Q4_K_M", profiles) is None
    assert local_name("hf.co/bartowski/Llama-3.2-1B-Instruct-GGUF:Q8_0", profiles) is None
    assert local_name("tiny:latest", profiles) == "tiny"


def test_pulls_past_the_limit_are_refused_with_a_429_until_one_ends(tmp_path, monkeypatch):
    """LLAMA_MAX_PULLS (2 here) pulls at once: the next is refused naming the limit (Ollama's route answers it
    with 429), a pull already under way is joined, a model here already is no pull; once one ends, the next starts."""
    import asyncio
    from types import SimpleNamespace

    from app.weights import TooManyPulls, Weights

    monkeypatch.setattr(Weights, "_download", lambda self, pull, loop: None)  # each pull stays under way
    (tmp_path / "Here").mkdir()
    weights = Weights(SimpleNamespace(profiles={"tiny": str(tmp_path / "tiny")}), tmp_path, max_pulls=2)

    async def scenario():
        first, second = await weights.pull("acme/One"), await weights.pull("acme/Two")
        assert await weights.pull("acme/One") is first  # joined, not a third
        with pytest.raises(TooManyPulls, match=r"2 pulls are under way, as many as this server runs at once "
                                               r"\(LLAMA_MAX_PULLS=2\): pull acme/Three again once one has ended"):
            await weights.pull("acme/Three")
        assert (await weights.pull("someone/Here")).finished.is_set()  # here already: no pull, not refused
        weights._finish(first)
        third = await weights.pull("acme/Three")
        return {p.repo_id for p in weights.under_way()}, third

    under_way, third = asyncio.run(scenario())
    assert under_way == {"acme/Two", "acme/Three"} and third.repo_id == "acme/Three"


def test_truncate_false_keeps_a_conversation_too_long_whole_and_refused():
    """Ollama's `truncate` (left out or true: the oldest messages leave a conversation too long for the context;
    false: nothing is left out, the request is refused), on /api/chat and /api/generate."""
    import asyncio

    from app.api.routes import create_app
    from app.messages import Done, Stats

    backend = ScriptedBackend([Done("scripted", "", "stop", Stats(prompt_tokens=3, new_tokens=1))])

    async def ask():
        transport = httpx.ASGITransport(app=create_app(backend))
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
            for path, body in [("/api/chat", {"messages": QUESTION}), ("/api/generate", {"prompt": "Hi"})]:
                for truncate in (None, True, False):
                    asked = {"model": "tiny", "stream": False, **body} | ({} if truncate is None else {"truncate": truncate})
                    assert (await http.post(path, json=asked)).status_code == 200
            bad = await http.post("/api/chat", json={"model": "tiny", "messages": QUESTION, "truncate": "yes"})
            return bad

    bad = asyncio.run(ask())
    assert [options["trim"] for _, _, options in backend.asked] == [True, True, False] * 2
    assert bad.status_code == 400 and "truncate" in bad.json()["error"]
