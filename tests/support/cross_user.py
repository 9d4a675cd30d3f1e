"""Two users of one chat server, and every route and socket event that carries an id, tried by one of them
with the other's ids. Shared by tests/web/test_ownership.py and bench/hostile.py.

    victim = make_victim(url, cookies_of_b)         # B's chat: a message with a file, a reply, a feedback
    before = snapshot(db, store, victim)
    outcomes = attack(url, cookies_of_a, victim)    # A tries each of B's ids everywhere
    assert snapshot(db, store, victim) == before and not [o for o in outcomes if not o.ok]

ROUTES and EVENTS name every route of the chat server (Chainlit's and the app's own web routes; the API's
/v1 routes hold no stored user data and take an API key) and every socket.io event: each one either has
an attack, or the reason it carries no id of anyone's stored data. `unlisted()` names what a new Chainlit
(or a new route of ours) added, so that it cannot be forgotten.
"""

from __future__ import annotations

import sqlite3
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import httpx
import socketio

from support.chat_tab import ChatTab

from app.web.history import is_reply

SECRET = "The vault code is 7391-ALPHA-KESTREL."  # in B's file and B's message: never in anything A gets


@dataclass
class Victim:
    """B's stored chat, and the ids a leak would give away."""
    user_id: str
    thread: str
    question: str  # B's message (with the file)
    answer: str  # the model's reply to it
    element: str  # B's file
    feedback: str  # B's feedback on the reply
    session: str  # B's open tab's session id
    file_name: str = "vault.md"


@dataclass
class Outcome:
    name: str
    status: int | str  # the HTTP status, or what the socket did
    ok: bool
    detail: str = ""


def make_victim(url: str, cookies: dict) -> tuple[Victim, ChatTab]:
    """B's chat (B's tab stays open: its session id is one of the ids tried)."""
    tab = ChatTab(url, cookies)
    tab.wait_for("chat_settings")
    reference = tab.upload("vault.md", f"# Vault\n\n{SECRET}\n".encode())
    question = str(uuid.uuid4())
    tab.send(f"Keep this safe: {SECRET}", id=question, files=[reference])
    user = httpx.get(f"{url}/user", cookies=cookies, timeout=30).json()
    thread = httpx.get(f"{url}/project/thread/{tab.thread_id}", cookies=cookies, timeout=30).json()
    answer = next(s["id"] for s in thread["steps"] if s["type"] == "assistant_message" and is_reply(s))
    feedback = httpx.put(f"{url}/feedback", cookies=cookies, timeout=30, json={
        "feedback": {"forId": answer, "threadId": tab.thread_id, "value": 1, "comment": "good"},
        "sessionId": tab.session_id})
    feedback.raise_for_status()
    element = next(e["id"] for e in thread["elements"] if e["forId"] == question)
    return Victim(user["id"], tab.thread_id, question, answer, element, feedback.json()["feedbackId"],
                  tab.session_id), tab


def snapshot(db: Path, store: Path, victim: Victim) -> dict:
    """Every row of B's chat and every file of it, as stored."""
    with sqlite3.connect(db) as con:
        rows = {table: sorted(map(tuple, con.execute(f'SELECT * FROM {table} WHERE "threadId" = ?', (victim.thread,))))
                for table in ("steps", "elements", "feedbacks")}
        rows["threads"] = sorted(map(tuple, con.execute('SELECT * FROM threads WHERE "id" = ?', (victim.thread,))))
        rows["ids"] = sorted(map(tuple, con.execute(  # B's ids, wherever they are now
            'SELECT "id", "threadId" FROM steps WHERE "id" IN (?, ?) UNION ALL SELECT "id", "threadId" FROM '
            'elements WHERE "id" = ? UNION ALL SELECT "id", "threadId" FROM feedbacks WHERE "id" = ?',
            (victim.question, victim.answer, victim.element, victim.feedback))))
    files = {str(p.relative_to(store)): p.read_bytes() for p in sorted(store.rglob("*")) if p.is_file()}
    return {"rows": rows, "files": {k: v for k, v in files.items() if k.startswith(victim.element)}}


# ---- the routes -----------------------------------------------------------------------------------

def _request(method: str, path: str, **kwargs) -> Callable:
    """An attack that sends one request (path and body formatted with A's tab `a` and the victim `v`)."""

    def attack(client: httpx.Client, a: ChatTab, v: Victim) -> httpx.Response:
        fill = lambda value: (value.format(a=a, v=v) if isinstance(value, str)
                              else {k: fill(x) for k, x in value.items()} if isinstance(value, dict) else value)
        return client.request(method, path.format(a=a, v=v), **{k: fill(x) for k, x in kwargs.items()})

    return attack


NOT_FOUND = (404,)
SESSION_REFUSED = (401, 404)  # Chainlit's check that a session (a tab's id, not stored data) is the caller's

ROUTES: dict[tuple[str, str], tuple[Callable, tuple[int, ...]] | str] = {
    ("PUT", "/feedback"): (_request("PUT", "/feedback", json={"feedback": {
        "forId": "{v.answer}", "threadId": "{v.thread}", "value": 0, "comment": "A was here"},
        "sessionId": "{a.session_id}"}), NOT_FOUND),
    ("PUT", "/feedback#id"): (_request("PUT", "/feedback", json={"feedback": {  # B's feedback id on A's own message
        "id": "{v.feedback}", "forId": "{a.question}", "value": 0}, "sessionId": "{a.session_id}"}), NOT_FOUND),
    ("DELETE", "/feedback"): (_request("DELETE", "/feedback", json={"feedbackId": "{v.feedback}"}), NOT_FOUND),
    ("POST", "/project/threads"): (_request("POST", "/project/threads", json={
        "pagination": {"first": 50, "cursor": None}, "filter": {"userId": "{v.user_id}"}}), (200,)),
    ("GET", "/project/thread/{thread_id}"): (_request("GET", "/project/thread/{v.thread}"), NOT_FOUND),
    ("GET", "/project/thread/{thread_id}#unknown"): (_request("GET", f"/project/thread/{uuid.uuid4()}"), NOT_FOUND),
    ("GET", "/project/share/{thread_id}"): (_request("GET", "/project/share/{v.thread}"), NOT_FOUND),
    ("GET", "/project/thread/{thread_id}/element/{element_id}"): (
        _request("GET", "/project/thread/{v.thread}/element/{v.element}"), NOT_FOUND),
    ("GET", "/project/thread/{thread_id}/element/{element_id}#own-thread"): (  # A's chat, B's file
        _request("GET", "/project/thread/{a.thread_id}/element/{v.element}"), NOT_FOUND),
    ("PUT", "/project/element"): (_request("PUT", "/project/element", json={"sessionId": "{a.session_id}", "element": {
        "id": "{v.element}", "threadId": "{v.thread}", "forId": "{v.question}", "type": "custom", "name": "x",
        "display": "inline", "props": {}}}), NOT_FOUND),
    ("PUT", "/project/element#own-thread"): (_request("PUT", "/project/element", json={
        "sessionId": "{a.session_id}", "element": {"id": "{v.element}", "threadId": "{a.thread_id}",
                                                    "forId": "{a.question}", "type": "custom", "name": "x",
                                                    "display": "inline", "props": {}}}), NOT_FOUND),
    ("DELETE", "/project/element"): (_request("DELETE", "/project/element", json={
        "sessionId": "{a.session_id}", "element": {"id": "{v.element}", "threadId": "{v.thread}", "type": "custom",
                                                   "name": "x", "display": "inline"}}), NOT_FOUND),
    ("PUT", "/project/thread"): (_request("PUT", "/project/thread", json={"threadId": "{v.thread}", "name": "A's"}),
                                 NOT_FOUND),
    ("PUT", "/project/thread#unknown"): (_request("PUT", "/project/thread", json={"threadId": str(uuid.uuid4()),
                                                                                  "name": "A's"}), NOT_FOUND),
    ("PUT", "/project/thread/share"): (_request("PUT", "/project/thread/share", json={
        "threadId": "{v.thread}", "isShared": True}), NOT_FOUND),
    ("DELETE", "/project/thread"): (_request("DELETE", "/project/thread", json={"threadId": "{v.thread}"}), NOT_FOUND),
    ("DELETE", "/project/thread#unknown"): (_request("DELETE", "/project/thread", json={"threadId": str(uuid.uuid4())}),
                                            NOT_FOUND),
    ("POST", "/project/action"): (_request("POST", "/project/action", json={  # A's Regenerate naming B's messages
        "sessionId": "{a.session_id}", "action": {"id": str(uuid.uuid4()), "name": "regenerate",
                                                  "forId": "{v.answer}", "payload": {"answer": "{v.answer}"}}}),
                                  (200,)),
    ("POST", "/project/action#session"): (_request("POST", "/project/action", json={  # in B's tab
        "sessionId": "{v.session}", "action": {"id": str(uuid.uuid4()), "name": "regenerate", "forId": "{v.answer}",
                                               "payload": {"answer": "{v.answer}"}}}), SESSION_REFUSED),
    ("POST", "/project/action#not-an-action"): (_request("POST", "/project/action", json={  # was a 500, a trace
        "sessionId": "{a.session_id}", "action": {"id": str(uuid.uuid4()), "name": "models", "forId": "x",
                                                  "payload": "notadict"}}), (400,)),
    ("POST", "/project/action#no-session"): (_request("POST", "/project/action", json={  # was a 500 too
        "sessionId": str(uuid.uuid4()), "action": {"id": str(uuid.uuid4()), "name": "regenerate", "forId": "x",
                                                   "payload": {}}}), (404,)),
    ("POST", "/project/file"): (_request("POST", "/project/file", params={"session_id": "{v.session}"},
                                         files={"file": ("x.md", b"A's", "text/markdown")}), SESSION_REFUSED),
    ("GET", "/project/file/{file_id}"): (_request("GET", "/project/file/{v.element}", params={"session_id": "{v.session}"}),
                                         SESSION_REFUSED),
    ("GET", "/project/file/{file_id}#own-session"): (
        _request("GET", "/project/file/{v.element}", params={"session_id": "{a.session_id}"}), NOT_FOUND),
    ("GET", "/history-files/{element_id}/{name:path}"): (_request("GET", "/history-files/{v.element}/vault.md"),
                                                          NOT_FOUND),
    ("POST", "/mcp"): (_request("POST", "/mcp", json={"sessionId": "{v.session}", "name": "x", "clientType": "sse",
                                                      "url": "http://127.0.0.1:1/"}), (400, 401, 403, 404, 422)),
    ("DELETE", "/mcp"): (_request("DELETE", "/mcp", json={"sessionId": "{v.session}", "name": "x"}),
                         (400, 401, 403, 404, 422)),
    # no id of anyone's stored data:
    ("GET", "/public/{filename:path}"): "the app's public files",
    ("GET", "/assets/{filename:path}"): "the page's code",
    ("GET", "/copilot/{filename:path}"): "the page's code",
    ("GET", "/auth/config"): "how to sign in",
    ("POST", "/login"): "signs the caller in",
    ("POST", "/logout"): "signs the caller out",
    ("POST", "/auth/jwt"): "signs the caller in (off)",
    ("POST", "/auth/header"): "signs the caller in (off with passwords)",
    ("GET", "/auth/oauth/{provider_id}"): "OAuth (off)",
    ("GET", "/auth/oauth/{provider_id}/callback"): "OAuth (off)",
    ("POST", "/auth/oauth/azure-ad-hybrid/callback"): "OAuth (off)",
    ("GET", "/user"): "the caller",
    ("POST", "/set-session-cookie"): "the caller's own token",
    ("GET", "/project/translations"): "the page's words",
    ("GET", "/project/settings"): "the page's settings",
    ("GET", "/favicon"): "an icon",
    ("GET", "/logo"): "the logo",
    ("GET", "/avatars/{avatar_id:str}"): "an author's picture",
    ("HEAD", "/"): "the page",
    ("GET", "/health"): "the server's state",
    ("GET", "/{full_path:path}"): "the page",
}

EVENTS: dict[str, str] = {
    "connect": "resume B's chat, or B's tab's session: refused (attack_socket)",
    "client_message": "a message with B's message id, and one whose metadata names B's file (attack_socket)",
    "edit_message": "an edit of B's message id (attack_socket)",
    "message_favorite": "B's message id (attack_socket; favorites are off)",
    "connection_successful": "no id",
    "disconnect": "no id",
    "clear_session": "no id",
    "stop": "no id: the caller's own reply",
    "chat_settings_change": "the caller's own settings",
    "chat_settings_edit": "the caller's own settings",
    "fetch_favorites": "the caller's own favorites (off)",
    "window_message": "the caller's own page",
    "audio_start": "audio (off)", "audio_chunk": "audio (off)", "audio_end": "audio (off)",
}


def route_key(key: tuple[str, str]) -> tuple[str, str]:
    return key[0], key[1].split("#")[0]


def unlisted(routes: set[tuple[str, str]], events: set[str]) -> list[str]:
    """The server's routes (method, path) and socket events that the tables above do not name."""
    listed = {route_key(key) for key in ROUTES}
    return sorted([f"{m} {p}" for m, p in routes - listed] + [f"event {e}" for e in events - EVENTS.keys()])


def leaked(text: str, victim: Victim) -> bool:
    return SECRET in text or victim.file_name in text


def attack_routes(url: str, cookies: dict, a: ChatTab, victim: Victim) -> list[Outcome]:
    outcomes = []
    with httpx.Client(base_url=url, cookies=cookies, timeout=30) as client:
        for key, entry in ROUTES.items():
            if isinstance(entry, str):
                continue
            attack, expected = entry
            try:
                response = attack(client, a, victim)
            except httpx.HTTPError as e:  # the server cut the connection: a failure too
                outcomes.append(Outcome(f"{key[0]} {key[1]}", f"no answer: {e!r}", False))
                continue
            body = response.text
            ok = response.status_code in expected and not leaked(body, victim) and response.status_code < 500
            if key == ("POST", "/project/threads"):  # answered, with A's chats only
                ok = ok and victim.thread not in body
            outcomes.append(Outcome(f"{key[0]} {key[1]}", response.status_code, ok, body[:200]))
    return outcomes


def attack_socket(url: str, cookies: dict, a: ChatTab, victim: Victim) -> list[Outcome]:
    """The socket events that carry ids: each is refused, or changes nothing of B's (snapshot() says)."""
    outcomes = []
    try:  # resume B's chat
        other = ChatTab(url, cookies, thread_id=victim.thread)
        other.close()
        outcomes.append(Outcome("connect threadId", "connected", False))
    except socketio.exceptions.ConnectionError as e:
        outcomes.append(Outcome("connect threadId", "refused", True, str(e)))
    try:  # take over B's open tab
        other = ChatTab(url, cookies, session_id=victim.session)
        other.close()
        outcomes.append(Outcome("connect sessionId", "connected", False))
    except socketio.exceptions.ConnectionError as e:
        outcomes.append(Outcome("connect sessionId", "refused", True, str(e)))
    start = a.send("A's words over B's message", id=victim.question)  # a message with B's message id
    outcomes.append(Outcome("client_message id", "answered", not any(leaked(t, victim) for t in a.outputs(start))))
    start = a.send("A edits B's message", id=victim.answer, event="edit_message", wait=False)
    time.sleep(1)  # (dropped: nothing answers it)
    outcomes.append(Outcome("edit_message id", "dropped", not any(leaked(t, victim) for t in a.outputs(start))))
    a.sio.emit("message_favorite", {"message": {"id": victim.question, "metadata": {"favorite": True}}})
    outcomes.append(Outcome("message_favorite id", "sent", True))
    # metadata naming B's file: then A resumes her chat and edits that message, which sends its files again
    planted = str(uuid.uuid4())
    a.send("What does my file say?", id=planted, metadata={"files": [
        {"element": victim.element, "name": victim.file_name, "size": len(SECRET), "pages": 0, "chosen": None}]})
    time.sleep(0.5)  # the session is stored when the socket closes
    thread = a.thread_id
    a.close()
    again = ChatTab(url, cookies, thread_id=thread)
    try:
        again.wait_for("resume_thread")
        start = again.send("What does my file say, then?", id=planted, event="edit_message")
        outputs = again.outputs(start)
        outcomes.append(Outcome("client_message metadata", "answered", not any(leaked(t, victim) for t in outputs),
                                " | ".join(outputs)[:300]))
    finally:
        again.close()
    return outcomes


def attack(url: str, cookies: dict, victim: Victim) -> list[Outcome]:
    """A (cookies) tries B's ids on every route and event: a tab of A's with one question asked first."""
    a = ChatTab(url, cookies)
    a.wait_for("chat_settings")
    a.question = str(uuid.uuid4())
    a.send("A's own question", id=a.question)
    outcomes = attack_routes(url, cookies, a, victim)
    return outcomes + attack_socket(url, cookies, a, victim)
