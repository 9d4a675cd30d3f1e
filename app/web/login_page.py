"""What the sign-in page says: with LLAMA_PASSWORD, that the one password opens every name.

LLAMA_PASSWORD signs in anyone who has it under any name that is not in LLAMA_USERS, and a name's chats
are that name's: whoever has the password can read them by signing in with it. That is by design (a
household's one password), and the page and the start-up log say so. The page's title says so
(app.web.page_words puts it in Chainlit's translations).
"""

from __future__ import annotations

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


def title(settings: Settings) -> str:
    """The sign-in page's title: what a shared password opens, or plainly "Sign in"."""
    return SHARED_NOTE.format(title=TITLE, others=others(settings)) if shared_password(settings) else TITLE
