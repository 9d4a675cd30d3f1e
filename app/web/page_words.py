"""The chat page's words where Chainlit's say what this app does not do, or speak of "threads".

Chainlit's page takes its words from its translations (.chainlit/translations/<language>.json, written by
Chainlit at first start), served at /project/translations. This route answers in front of Chainlit's with the
same text, changed where it is wrong here (left to the file, a new Chainlit would bring its words back):

- New chat asked "This will clear your current chat history. Are you sure?": with history on, the chat stays
  in the sidebar, and with it off it is gone, and the dialog now says whichever is true;
- "No threads found", "Rename Thread", "Thread renamed!": a user's chats are chats;
- the sign-in page's title says what a shared password opens (app.web.login_page).

Only the English words are ours; another language keeps Chainlit's, but for the sign-in title and the New chat
dialog, which would otherwise be false (they are said in English there).
"""

from __future__ import annotations

import json

from chainlit import server as chainlit_server
from fastapi import Query
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute

from app.settings import Settings
from app.web import login_page

CHATS = {  # (path in the translations, words), English pages only
    ("threadHistory", "sidebar", "empty"): "No chats yet",
    ("threadHistory", "thread", "actions", "rename", "title"): "Rename chat",
    ("threadHistory", "thread", "actions", "rename", "description"): "A new name for this chat",
    ("threadHistory", "thread", "actions", "rename", "success"): "Chat renamed",
    ("threadHistory", "thread", "actions", "rename", "inProgress"): "Renaming the chat",
    ("threadHistory", "thread", "actions", "delete", "description"):
        "This deletes the chat, its messages and its files. It cannot be undone.",
    ("threadHistory", "thread", "actions", "share", "status", "unshared"): "This chat is no longer shared",
    ("threadHistory", "thread", "actions", "share", "error", "unshare"): "The chat could not be unshared",
}
NEW_CHAT = ("navigation", "newChat", "dialog", "description")
NEW_CHAT_KEPT = "Start a new chat? This one stays in the sidebar, where you can open it again."
NEW_CHAT_LOST = "Start a new chat? This one is not kept (history is off here): it will be gone."


def words(settings: Settings, english: bool) -> dict[tuple[str, ...], str]:
    """What replaces Chainlit's words on a page in English (or in another language)."""
    said = {("auth", "login", "title"): login_page.title(settings),
            NEW_CHAT: NEW_CHAT_KEPT if settings.history else NEW_CHAT_LOST}
    return (CHATS | said) if english else said


def replace(translation: dict, replaced: dict[tuple[str, ...], str]) -> None:
    for path, text in replaced.items():
        place = translation
        for key in path[:-1]:
            place = place.get(key) if isinstance(place, dict) else None
        if isinstance(place, dict) and path[-1] in place:  # (a key Chainlit no longer has is not added)
            place[path[-1]] = text


def translations_route(settings: Settings) -> APIRoute:
    """GET /project/translations: Chainlit's, with this app's words where its are wrong here."""
    async def translations(language: str = Query(default="en-US", pattern=chainlit_server._language_pattern)):
        response = await chainlit_server.project_translations(language)
        content = json.loads(response.body)
        translation = content.get("translation")
        if isinstance(translation, dict):
            replace(translation, words(settings, language.lower().startswith("en")))
        return JSONResponse(content=content)

    return APIRoute("/project/translations", translations, methods=["GET"])
