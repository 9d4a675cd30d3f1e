"""What the sign-in page says: with LLAMA_PASSWORD, that the one password opens every name.

LLAMA_PASSWORD signs in anyone who has it under any name that is not in LLAMA_USERS, and a name's chats
are that name's: whoever has the password can read them by signing in with it. That is by design (a
household's one password), and the page and the start-up log say so. The page's words are Chainlit's
translations, served at /project/translations: this route answers in front of Chainlit's with the same
text, its sign-in title replaced.
"""

from __future__ import annotations

import json

from chainlit import server as chainlit_server
from fastapi import Query
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute

from app.settings import Settings

TITLE = "Sign in"
SHARED_NOTE = ("{title}. Whoever has the shared password can sign in under any name{others} and read "
               "the chats of that name; for accounts of your own, ask for a line in the users file.")
LOG_NOTE = ("LLAMA_PASSWORD is set: whoever has it can sign in under any name{others} and read that name's chats. "
            "For accounts of their own, give each person a line in LLAMA_USERS (python -m app.web.users add NAME).")


def shared_password(settings: Settings) -> bool:
    return settings.auth == "password" and settings.password is not None


def others(settings: Settings) -> str:
    return " not in the users file" if settings.users_file else ""


def log_note(settings: Settings) -> str | None:
    """The start-up log's line, when a shared password opens every name."""
    return LOG_NOTE.format(others=others(settings)) if shared_password(settings) else None


def translations_route(settings: Settings) -> APIRoute:
    """GET /project/translations: Chainlit's, with the sign-in page's title saying what the shared
    password opens (or plainly "Sign in")."""
    title = SHARED_NOTE.format(title=TITLE, others=others(settings)) if shared_password(settings) else TITLE

    async def translations(language: str = Query(default="en-US", pattern=chainlit_server._language_pattern)):
        response = await chainlit_server.project_translations(language)
        content = json.loads(response.body)
        login = content.get("translation", {}).get("auth", {}).get("login")
        if isinstance(login, dict):
            login["title"] = title
        return JSONResponse(content=content)

    return APIRoute("/project/translations", translations, methods=["GET"])
