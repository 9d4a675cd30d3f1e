"""Whose data a request may touch: every chat, message, file and feedback belongs to the user whose chat
(thread) holds it, and is found by its id *and* that owner, whatever ids a client sends.

Chainlit's routes and socket handlers take ids from the client (a step to delete, a thread to write a
feedback into, a message id that may already be someone else's) and hand them to the data layer; some
check who asks, some do not. So the history's data layer (app.web.history) asks here on every read and
write, and a row of another user's is not there for anyone else: reads find nothing, writes change
nothing, and the routes answer 404.

Who asks, `actor()`: in a socket event (and in the HTTP routes that act for a socket's session, such as
an action), the signed-in user of Chainlit's session; in any other request, the user of the sign-in token
the request carries, as `app.web.sessions.Sessions` found it (`ACTOR`). A request with no sign-in, or with
tokens of two users, is nobody, and nobody owns nothing. Trusted code outside any request (a test, a
maintenance script) says whom it acts for with `acting_as(name)`.
"""

from __future__ import annotations

import contextlib
import logging
from collections import OrderedDict
from collections.abc import Iterator
from contextvars import ContextVar

from chainlit.context import ChainlitContextException, context

log = logging.getLogger(__name__)

NOBODY = ""  # the actor of a request without a sign-in: owns no row
DELETED_SEEN: OrderedDict[str, None] = OrderedDict()  # chats found deleted lately (writes into them expected)
ACTOR: ContextVar[str | None] = ContextVar("llama_actor", default=None)  # None: not set by a request

THREAD_OWNER = 'SELECT "userIdentifier" AS owner FROM threads WHERE "id" = :id'
STEP_THREAD = 'SELECT "threadId" AS thread FROM steps WHERE "id" = :id'
ELEMENT_THREAD = 'SELECT "threadId" AS thread FROM elements WHERE "id" = :id'
DELETED_THREAD = 'SELECT "id" AS thread FROM deleted_threads WHERE "id" = :id'
FEEDBACK_THREAD = ('SELECT s."threadId" AS thread FROM feedbacks f JOIN steps s ON s."id" = f."forId" '
                   'WHERE f."id" = :id')


def actor() -> str:
    """The identifier of the user this code acts for; NOBODY when no one is signed in."""
    try:
        user = context.session.user
    except ChainlitContextException:  # an HTTP request that acts for no socket session
        user = None
    if user is not None:
        return user.identifier
    return ACTOR.get() or NOBODY


def session_thread() -> str | None:
    """The chat the current socket session writes into (None outside a socket session): a new chat's
    thread has no row, or no owner yet, when its first message is stored."""
    try:
        return context.session.thread_id
    except ChainlitContextException:
        return None


@contextlib.contextmanager
def acting_as(identifier: str) -> Iterator[None]:
    """Run trusted code (outside any request) as the user `identifier`."""
    token = ACTOR.set(identifier)
    try:
        yield
    finally:
        ACTOR.reset(token)


def request_actor(identifiers: set[str]) -> str:
    """The actor of a request whose valid sign-in tokens name these users: the one, else nobody."""
    return next(iter(identifiers)) if len(identifiers) == 1 else NOBODY


class Owners:
    """The owner of each row a client can name, from the history database (`sql(query, parameters)`
    returns a list of dicts, as Chainlit's execute_sql does)."""

    def __init__(self, sql):
        self.sql = sql

    async def _one(self, query: str, id: str | None, column: str) -> str | None:
        if not isinstance(id, str) or not id:
            return None
        rows = await self.sql(query, {"id": id})
        return rows[0][column] if isinstance(rows, list) and rows else None

    async def thread_owner(self, thread_id: str | None) -> str | None:
        """The identifier of the user whose chat this is; None when there is no such chat or no owner yet."""
        return await self._one(THREAD_OWNER, thread_id, "owner")

    async def readable(self, thread_id: str | None) -> bool:
        """Whether the actor may read the chat: it is theirs."""
        owner = await self.thread_owner(thread_id)
        return owner is not None and owner != NOBODY and owner == actor()

    async def writable(self, thread_id: str | None) -> bool:
        """Whether the actor may write into the chat: it is theirs, or it is the new chat of their own
        socket session (no owner yet, and not a chat deleted since: `deleted`)."""
        if not isinstance(thread_id, str) or not thread_id or actor() == NOBODY:
            return False
        owner = await self.thread_owner(thread_id)
        if owner is not None:
            return owner == actor()
        return thread_id == session_thread() and not await self.deleted(thread_id)

    async def deleted(self, thread_id: str | None) -> bool:
        """Whether the chat was deleted (a tab may still be open on it)."""
        if await self._one(DELETED_THREAD, thread_id, "thread") is None:
            return False
        DELETED_SEEN[thread_id] = None  # (its refused writes are expected: logged as such)
        while len(DELETED_SEEN) > 1000:
            DELETED_SEEN.popitem(last=False)
        return True

    async def step_thread(self, step_id: str | None) -> str | None:
        return await self._one(STEP_THREAD, step_id, "thread")

    async def element_thread(self, element_id: str | None) -> str | None:
        return await self._one(ELEMENT_THREAD, element_id, "thread")

    async def feedback_thread(self, feedback_id: str | None) -> str | None:
        return await self._one(FEEDBACK_THREAD, feedback_id, "thread")

    async def may_write_row(self, kind: str, row_thread: str | None, thread_id: str | None) -> bool:
        """May the actor write a row (a step or element) with a client's id into thread_id? Only into a chat
        of theirs, and never over a row of another chat (whoever's it is): an id is not moved."""
        if not await self.writable(thread_id):
            refused(kind, "into a chat that is not the user's", thread_id)
            return False
        if row_thread is not None and row_thread != thread_id:
            refused(kind, "over an id of another chat", thread_id)
            return False
        return True


def refused(kind: str, what: str, thread_id: str | None) -> None:
    """One log line for a refused read or write: who, what (never the other user's data). Into a chat deleted
    while a tab was open on it (the tab is told), a line of information, not a warning."""
    if thread_id in DELETED_SEEN:
        log.info("not written: a %s into chat %s, deleted (user %r)", kind, str(thread_id)[:40], actor())
        return
    log.warning("refused to write a %s %s (user %r, chat %s)", kind, what, actor(), str(thread_id)[:40])
