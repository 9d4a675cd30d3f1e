"""Sign-in sessions that end: a session lasts only as long as the password it was signed in with.

Chainlit's session is a signed token (a JSON web token, in a cookie or a Bearer header) that holds the
user as they were when they signed in, and Chainlit believes it until it expires (15 days), whatever
became of the user since. So the app puts a stamp of the password into the token's user metadata at
sign-in (`app.web.users.Passwords.stamp`), and checks it here:

- every HTTP request and websocket handshake (the page's calls, socket.io, history, the /auth routes
  that renew a token): one whose token carries a stamp that is no longer the user's goes on without
  its token, so Chainlit answers it as it answers someone who never signed in (401, the login form);
- every open socket, every few seconds: one whose session's stamp is no longer valid is disconnected
  (its reconnection is then refused the same way).

A new password (`python -m app.web.users add`), a removed line, another LLAMA_PASSWORD, or sign-in turned on
where there was one local user, all end the sessions signed in before.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
from collections.abc import Callable

from chainlit import server as chainlit_server
from chainlit.action import Action
from chainlit.auth import authenticate_user, create_jwt, get_current_user, get_token_from_cookies, set_auth_cookie
from chainlit.auth.jwt import decode_jwt
from chainlit.server import sio
from chainlit.session import WebsocketSession, ws_sessions_sid
from chainlit.types import CallActionRequest
from chainlit.user import User
from fastapi import Depends, HTTPException, Request, Response
from fastapi.routing import APIRoute
from starlette.requests import cookie_parser

from app.web.ownership import ACTOR, NOBODY, request_actor
from app.web.users import LOCAL_USER, Passwords, utf8

log = logging.getLogger(__name__)

SWEEP_S = 5.0  # how often open sockets are checked
TOKEN_HEADERS = (b"cookie", b"authorization")  # where a request may carry Chainlit's token

Valid = Callable[[User], bool]  # is this session's user (as its token has it) still signed in?


def password_user(name: str, passwords: Passwords) -> User:
    """The user a password sign-in makes, with the stamp of the password it was made with."""
    return User(identifier=name, metadata={"provider": "password", "stamp": passwords.stamp(name)})


def local_user() -> User:
    """The one user when sign-in is off."""
    return User(identifier=LOCAL_USER, metadata={"provider": "local"})


def local_sign_in() -> APIRoute:
    """GET /user, with sign-in off: the local user, signed in on the way, as POST /auth/header signs them in.
    The page asks who is signed in before it signs in: Chainlit answered a new browser 401 (written in its
    console) and the page went by its login page to /auth/header; now the first answer is the user."""

    async def signed_in_user(request: Request, response: Response):
        token = create_jwt(local_user())
        set_auth_cookie(request, response, token)
        return await authenticate_user(token)  # as Chainlit's GET /user answers: the user of the database

    return APIRoute("/user", signed_in_user, methods=["GET"])


def still_signed_in(passwords: Passwords | None) -> Valid:
    """With sign-in (passwords), a user whose stamp is still their password's; without, the local user only."""

    def valid(user: User) -> bool:
        if passwords is None:
            return user.identifier == LOCAL_USER
        stamp, given = passwords.stamp(user.identifier), (user.metadata or {}).get("stamp")
        return stamp is not None and isinstance(given, str) and hmac.compare_digest(utf8(stamp), utf8(given))

    return valid


def token_user(token: str | None) -> User | None:
    """The user a Chainlit token was made for, or None when it is no token of ours (an API key, an expired
    or forged token)."""
    if not token:
        return None
    try:
        return decode_jwt(token)
    except Exception:  # pyjwt's errors, or a payload that is not a user
        return None


def request_tokens(headers: list[tuple[bytes, bytes]]) -> list[str]:
    """Every token of Chainlit's the request carries, however it is read: from each Cookie header (a
    cookie maybe in chunks), from them all joined as socket.io joins them, from each Bearer header."""
    cookies = [value.decode("latin-1") for name, value in headers if name == b"cookie"]
    tokens = [get_token_from_cookies(cookie_parser(text)) for text in [*cookies, ",".join(cookies)]]
    for name, value in headers:
        scheme, _, token = value.decode("latin-1").partition(" ")
        if name == b"authorization" and scheme.lower() == "bearer":
            tokens.append(token.strip())
    return [token for token in tokens if token]


class Sessions:
    """ASGI middleware: a request whose sign-in is no longer valid goes on without its token; the user of
    a valid one is whom the request acts for, in the history's data layer (app.web.ownership.ACTOR)."""

    def __init__(self, app, valid: Valid):
        self.app, self.valid = app, valid

    async def __call__(self, scope, receive, send):
        if scope["type"] in ("http", "websocket"):
            users = [user for user in map(token_user, request_tokens(scope["headers"])) if user is not None]
            ended = [user for user in users if not self.valid(user)]
            ACTOR.set(NOBODY if ended else request_actor({user.identifier for user in users}))
            if ended:  # all its tokens go: which one Chainlit would read is not ours to guess
                log.info("a request signed in as %r came with a sign-in that has ended; it goes on signed out",
                         ended[0].identifier)
                scope = {**scope, "headers": [(k, v) for k, v in scope["headers"] if k not in TOKEN_HEADERS]}
        await self.app(scope, receive, send)


async def sweep(valid: Valid, every_s: float = SWEEP_S) -> None:
    """Disconnect, every every_s seconds, the open sockets whose sign-in is no longer valid (run it as a task)."""
    while True:
        await asyncio.sleep(every_s)
        for session in list(ws_sessions_sid.values()):  # closed ones too, kept a while for a reconnection
            if session.token is None or not sio.manager.is_connected(session.socket_id, "/"):
                continue
            user = token_user(session.token)
            if user is None or not valid(user):
                log.info("closed a socket signed in as %r: its sign-in has ended",
                         session.user.identifier if session.user else None)
                with contextlib.suppress(Exception):  # already gone
                    await sio.disconnect(session.socket_id)


def action_route() -> APIRoute:
    """Chainlit's route for an action (a button under a reply, the models panel's clicks), behind one that
    checks what it would fail on with a 500 and a trace: a session that is gone (404: the page reloads), an
    action that is not one (400, naming what is wrong)."""
    async def call_action(payload: CallActionRequest, user=Depends(get_current_user)):
        if WebsocketSession.get_by_id(payload.sessionId) is None:
            raise HTTPException(status_code=404, detail="This page's session has ended: reload the page.")
        try:
            Action(**payload.action)
        except (TypeError, ValueError) as e:  # (pydantic's ValidationError is a ValueError)
            raise HTTPException(status_code=400, detail=f"Not an action: {str(e)[:300]}") from None
        return await chainlit_server.call_action(payload, user)

    return APIRoute("/project/action", call_action, methods=["POST"])
