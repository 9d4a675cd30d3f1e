"""Every user's chats and files are theirs alone, whatever ids a client sends (app/web/ownership.py and the
history's data layer): the data layer alone, then a real server with two users, where one tries the other's
ids on every route and socket event (tests/support/cross_user.py)."""

from __future__ import annotations

import asyncio
import json
import re
import time
from pathlib import Path
from types import SimpleNamespace

import chainlit as cl
import httpx
import pytest
from chainlit.types import Feedback, Pagination, ThreadFilter
from support import cross_user
from support.handlers import Chat
from support.servers import ChainlitServer, server_env

from app.api import keys
from app.settings import Settings
from app.web import history, page_words
from app.web.file_store import FileStore
from app.web.ownership import NOBODY, acting_as, actor, request_actor
from app.web.users import HASHER


# ---- the data layer ---------------------------------------------------------------------------------

def run_as(name: str, make, thread_id: str = "none"):
    """make() in a Chainlit context of a tab (session) writing into thread_id, acting for the user `name`."""
    async def scenario():
        chat = Chat(SimpleNamespace())
        chat.session.thread_id = thread_id
        chat.enter()
        return await make()
    with acting_as(name):
        return asyncio.run(scenario())


@pytest.fixture
def two_chats(tmp_path):
    """Ada's chat (a message, a reply with a feedback, a file) and Eve's, in one history database."""
    settings = Settings.from_env({"LLAMA_HISTORY_DB": str(tmp_path / "history.db")})
    history.prepare(settings)
    store = FileStore.beside(settings.history_db)
    layer = history.data_layer(settings, store)
    ids = {}

    def chat_of(name: str):
        async def write():
            user = await layer.create_user(cl.User(identifier=name))
            await layer.update_thread(f"t-{name}", name=f"{name}'s chat", user_id=user.id)
            for step in ("question", "answer"):
                await layer.create_step({"id": f"{step}-{name}", "threadId": f"t-{name}", "type": "user_message",
                                         "name": name, "output": f"{name}'s {step}", "streaming": False})
            element = cl.File(name="notes.md", content=f"{name}'s secret".encode(), thread_id=f"t-{name}",
                              for_id=f"question-{name}")
            await layer.create_element(element)
            feedback = await layer.upsert_feedback(Feedback(forId=f"answer-{name}", value=1, threadId=f"t-{name}"))
            ids[name] = {"user": user.id, "element": element.id, "feedback": feedback}
        run_as(name, write, f"t-{name}")

    chat_of("ada")
    chat_of("eve")
    return layer, store, settings.history_db, ids


def rows(db: Path, thread_id: str) -> dict:
    import sqlite3
    with sqlite3.connect(db) as con:
        return {table: sorted(map(tuple, con.execute(f'SELECT * FROM {table} WHERE "threadId" = ?', (thread_id,))))
                for table in ("steps", "elements", "feedbacks")} | {
            "thread": con.execute('SELECT * FROM threads WHERE id = ?', (thread_id,)).fetchall()}


def test_another_users_rows_are_not_there_for_reading(two_chats):
    layer, store, db, ids = two_chats
    ada = ids["ada"]

    async def reads():
        return {
            "get_thread": await layer.get_thread("t-ada"),
            "get_thread_author": await layer.get_thread_author("t-ada"),
            "get_step": await layer.get_step("question-ada"),
            "get_element": await layer.get_element("t-ada", ada["element"]),
            "get_element in her own chat": await layer.get_element("t-eve", ada["element"]),
            "list_threads of ada": (await layer.list_threads(Pagination(first=10),
                                                             ThreadFilter(userId=ada["user"]))).data,
        }

    got = run_as("eve", reads)
    assert got["get_thread"]["userIdentifier"] == NOBODY and got["get_thread"]["steps"] == []  # Chainlit refuses it
    assert all(not value for name, value in got.items() if name != "get_thread"), got
    own = run_as("ada", reads)  # the owner gets each
    assert own["get_thread"]["name"] == "ada's chat" and own["get_thread_author"] == "ada"
    assert own["get_step"]["output"] == "ada's question" and own["get_element"]["id"] == ada["element"]
    assert [t["id"] for t in own["list_threads of ada"]] == ["t-ada"]
    assert run_as("eve", lambda: layer.get_thread_author("no-such-chat")) == ""  # a 404 in Chainlit's routes
    assert run_as("eve", lambda: layer.get_thread("no-such-chat")) is None
    assert run_as(NOBODY, lambda: layer.get_thread_author("t-ada")) == ""  # no sign-in: nobody's


def test_another_users_rows_are_not_changed_by_any_write(two_chats):
    layer, store, db, ids = two_chats
    ada = ids["ada"]
    before, files = rows(db, "t-ada"), sorted(store.folder.rglob("*"))
    attacks = {  # Eve, in her own tab (her chat), with Ada's ids
        "update_thread": lambda: layer.update_thread("t-ada", name="Eve's now", metadata={"x": 1}),
        "update_thread to eve": lambda: layer.update_thread("t-ada", user_id=ids["eve"]["user"]),
        "create_step over ada's": lambda: layer.create_step({"id": "question-ada", "threadId": "t-eve",
                                                             "type": "user_message", "name": "eve", "output": "eve",
                                                             "streaming": False}),
        "create_step in ada's chat": lambda: layer.create_step({"id": "new", "threadId": "t-ada",
                                                                "type": "user_message", "name": "eve",
                                                                "output": "eve", "streaming": False}),
        "update_step": lambda: layer.update_step({"id": "answer-ada", "threadId": "t-ada", "type": "user_message",
                                                  "name": "eve", "output": "eve", "streaming": False}),
        "delete_step": lambda: layer.delete_step("question-ada"),
        "create_element over ada's": lambda: layer.create_element(cl.File(
            id=ada["element"], name="x", content=b"eve", thread_id="t-eve", for_id="question-eve")),
        "create_element for ada's message": lambda: layer.create_element(cl.File(
            name="x", content=b"eve", thread_id="t-eve", for_id="question-ada")),
        "delete_element": lambda: layer.delete_element(ada["element"]),
        "delete_element naming her chat": lambda: layer.delete_element(ada["element"], "t-eve"),
        "delete_thread": lambda: layer.delete_thread("t-ada"),
    }
    for name, attack in attacks.items():
        run_as("eve", attack, "t-eve")
        assert rows(db, "t-ada") == before, name
        assert sorted(store.folder.rglob("*")) == files, name
    refusing = {
        "feedback on ada's reply": Feedback(forId="answer-ada", value=0, threadId="t-ada"),
        "feedback naming her chat": Feedback(forId="answer-ada", value=0, threadId="t-eve"),
        "ada's feedback id": Feedback(id=ada["feedback"], forId="answer-eve", value=0, threadId="t-eve"),
    }
    for name, feedback in refusing.items():
        assert not run_as("eve", lambda: layer.may_feedback(feedback), "t-eve"), name
        with pytest.raises(history.NotFound):
            run_as("eve", lambda: layer.upsert_feedback(feedback), "t-eve")
        assert rows(db, "t-ada") == before, name
    assert not run_as("eve", lambda: layer.may_delete_feedback(ada["feedback"]))
    with pytest.raises(history.NotFound):
        run_as("eve", lambda: layer.delete_feedback(ada["feedback"]))
    for element in [{"id": ada["element"]}, {"id": ada["element"], "threadId": "t-eve"},
                    {"id": "new-element", "threadId": "t-ada"}, {"no": "id"}, "not an element"]:
        assert not run_as("eve", lambda: layer.may_write_element(element), "t-eve"), element
    assert rows(db, "t-ada") == before
    # the owner still can
    assert run_as("ada", lambda: layer.may_feedback(Feedback(forId="answer-ada", value=0)), "t-ada")
    run_as("ada", lambda: layer.delete_step("question-ada"), "t-ada")
    assert rows(db, "t-ada") != before and not (store.folder / ada["element"]).exists()


def test_a_new_chat_is_written_only_from_its_own_tab(two_chats):
    layer, store, db, ids = two_chats
    step = {"id": "s-new", "threadId": "t-new", "type": "user_message", "name": "eve", "output": "hi",
            "streaming": False}
    run_as("eve", lambda: layer.create_step(step), "t-other")  # not the chat her tab writes into
    assert rows(db, "t-new")["steps"] == []
    run_as(NOBODY, lambda: layer.create_step(step), "t-new")  # nobody signed in
    assert rows(db, "t-new")["steps"] == []
    run_as("eve", lambda: layer.create_step(step), "t-new")
    assert [s[0] for s in rows(db, "t-new")["steps"]] == ["s-new"]


def test_whom_a_request_acts_for():
    assert request_actor({"ada"}) == "ada"
    assert request_actor(set()) == NOBODY and request_actor({"ada", "eve"}) == NOBODY  # two users' tokens: nobody
    assert actor() == NOBODY  # outside any request
    with acting_as("ada"):
        assert actor() == "ada"
    assert actor() == NOBODY


# ---- every route and event ----------------------------------------------------------------------

def test_every_route_and_socket_event_is_in_the_cross_user_tables(tmp_path):
    """A route or event that a new Chainlit (or the app) adds fails here until it is tried with another
    user's ids, or said to carry none."""
    from chainlit.server import router, sio
    from fastapi.routing import APIRoute

    settings = Settings.from_env({"LLAMA_HISTORY_DB": str(tmp_path / "history.db"), "LLAMA_PASSWORD": "pw",
                                  "LLAMA_API_KEY": "key"})
    ours = [FileStore(tmp_path).route(), *history.owned_routes(), page_words.translations_route(settings)]
    routes = {(method, route.path) for route in [*router.routes, *ours] if isinstance(route, APIRoute)
              for method in route.methods}
    routes |= {("HEAD", "/"), ("GET", "/health")}  # (plain routes of Chainlit's)
    assert cross_user.unlisted(routes, set(sio.handlers["/"])) == []
    listed = {cross_user.route_key(key) for key in cross_user.ROUTES}
    assert listed <= routes, listed - routes  # and the tables name no route that is not there


KEYS: dict[str, str] = {}  # the two users' API keys (LLAMA_API_KEYS), made with the server


@pytest.fixture(scope="module")
def two_users_server(tiny, tmp_path_factory):
    folder = tmp_path_factory.mktemp("ownership")
    users = folder / "users"
    users.write_text(f"ada:{HASHER.hash('lovelace')}\ngrace:{HASHER.hash('hopper')}\n")
    KEYS.update({name: keys.add(folder / "keys", name) for name in ("ada", "grace")})  # the same two, by API key
    env = server_env(checkpoint=tiny, weights_dir=tiny.parent, temperature=0, dtype="fp32", threads=1,
                     max_new_tokens=8, history_db=folder / "history.db", auth="password", users=users,
                     api_key="a-key", api_keys=folder / "keys", model_admins="grace")
    env.pop("CHAINLIT_AUTH_SECRET", None)
    server = ChainlitServer(env, log=folder / "chainlit.log")
    try:
        server.wait_ready(timeout=300)
        yield server, folder
    finally:
        server.stop()


def login(url: str, name: str, password: str) -> dict:
    response = httpx.post(f"{url}/login", data={"username": name, "password": password}, timeout=30)
    response.raise_for_status()
    return dict(response.cookies)


REFUSALS = re.compile(r"Authorization for the (thread|session) failed")  # Chainlit's, logged as errors


def test_another_users_ids_reach_nothing_on_any_route_or_event(two_users_server):
    server, folder = two_users_server
    grace, ada = login(server.url, "grace", "hopper"), login(server.url, "ada", "lovelace")
    victim, tab = cross_user.make_victim(server.url, grace)
    try:
        db, store = folder / "history.db", folder / "history-files"
        before = cross_user.snapshot(db, store, victim)
        assert before["files"] and before["rows"]["feedbacks"]  # the file and the feedback are there to take
        outcomes = cross_user.attack(server.url, ada, victim)
        time.sleep(1)  # background writes (Chainlit stores steps and elements in tasks of their own)
        assert cross_user.snapshot(db, store, victim) == before
    finally:
        tab.close()
    failed = [o for o in outcomes if not o.ok]
    assert not failed, failed
    assert {o.name.split("#")[0] for o in outcomes} >= {"connect threadId", "client_message metadata"}
    # Grace still has her chat, all of it
    response = httpx.get(f"{server.url}/project/thread/{victim.thread}", cookies=grace, timeout=30)
    assert response.status_code == 200 and cross_user.SECRET in response.text
    log = server.log_path.read_text(errors="replace")
    assert "Traceback" not in log, log[-3000:]
    problems = [line for line in log.splitlines()
                if re.search(r" - (ERROR|CRITICAL) - ", line) and not REFUSALS.search(line)]
    assert not problems, problems
    assert len([line for line in log.splitlines() if "not found for user" in line]) >= 3  # one line each


def test_another_users_key_reaches_none_of_their_stored_responses_nor_the_models(two_users_server):
    """The API's side of the same: Grace's stored response, tried with Ada's key (and the shared LLAMA_API_KEY)
    on every route that takes a response id, is a 404 each time, and Ada, not in LLAMA_MODEL_ADMINS, neither
    deletes nor pulls nor unloads a model (403); Grace still has her response, and her model."""
    server, _ = two_users_server

    def as_(name):
        return {"Authorization": f"Bearer {KEYS.get(name, name)}"}

    with httpx.Client(base_url=server.url, timeout=120) as http:
        kept = http.post("/v1/responses", json={"input": "Remember 7391."}, headers=as_("grace")).json()["id"]
        for intruder in ("ada", "a-key"):
            tries = [http.get(f"/v1/responses/{kept}", headers=as_(intruder)),
                     http.get(f"/v1/responses/{kept}/input_items", headers=as_(intruder)),
                     http.post("/v1/responses", json={"input": "And?", "previous_response_id": kept}, headers=as_(intruder)),
                     http.delete(f"/v1/responses/{kept}", headers=as_(intruder))]
            assert [t.status_code for t in tries] == [404] * 4, [t.text for t in tries]
            model = http.get("/api/tags", headers=as_(intruder)).json()["models"][0]["name"]
            managing = [http.request("DELETE", "/api/delete", json={"model": model}, headers=as_(intruder)),
                        http.post("/api/pull", json={"model": "acme/Other", "stream": False}, headers=as_(intruder)),
                        http.post("/api/generate", json={"model": model, "keep_alive": 0}, headers=as_(intruder))]
            assert [t.status_code for t in managing] == [403] * 3, [t.text for t in managing]
            assert all("LLAMA_MODEL_ADMINS" in t.json()["error"] for t in managing)
        assert http.get(f"/v1/responses/{kept}", headers=as_("grace")).status_code == 200
        assert model in [m["name"] for m in http.get("/api/tags", headers=as_("grace")).json()["models"]]
        assert http.get("/v1/models", headers=as_("nobody")).status_code == 401


def test_with_a_shared_password_the_sign_in_page_and_the_log_say_what_it_opens(tiny, tmp_path):
    env = server_env(checkpoint=tiny, weights_dir=tiny.parent, dtype="fp32", threads=1,
                     history_db=tmp_path / "history.db", password="household", api_key="a-key")
    env.pop("CHAINLIT_AUTH_SECRET", None)
    server = ChainlitServer(env, log=tmp_path / "chainlit.log")
    try:
        server.wait_ready(timeout=300)
        title = httpx.get(f"{server.url}/project/translations", params={"language": "en-US"},
                          timeout=30).json()["translation"]["auth"]["login"]["title"]
        assert "any name" in title and "read" in title
        words = httpx.get(f"{server.url}/project/translations", params={"language": "en-GB"}, timeout=30).json()
        sidebar, dialog = words["translation"]["threadHistory"], words["translation"]["navigation"]["newChat"]["dialog"]
        assert sidebar["sidebar"]["empty"] == "No chats yet" and sidebar["thread"]["actions"]["rename"]["title"] == "Rename chat"
        assert dialog["description"] == page_words.NEW_CHAT_KEPT  # (history is on: the chat stays in the sidebar)
        french = httpx.get(f"{server.url}/project/translations", params={"language": "fr-FR"}, timeout=30).json()
        assert french["translation"]["navigation"]["newChat"]["dialog"]["description"] == page_words.NEW_CHAT_KEPT
        assert "Thread" not in json.dumps(words["translation"]["threadHistory"])
        assert httpx.get(f"{server.url}/project/translations", params={"language": "../../x"},
                         timeout=30).status_code == 422
        assert "LLAMA_PASSWORD is set: whoever has it can sign in under any name" in server.log()
    finally:
        server.stop()
