"""The chat UI: `chainlit run app/main.py` from the project root.

Thin Chainlit handlers over app.service.GenerationService, which owns the model and runs every
reply on its worker thread. What a session keeps in cl.user_session:

    conversation     app.service.Conversation: messages, system prompt, KV cache of the last reply
    reply_settings   app.service.ReplySettings from the settings panel
    request          the app.service.Request being answered, for the Stop button
    told_trimmed     whether the user was told that older messages were left out

With history on (the default), chats are stored in SQLite through Chainlit's data layer
(app.history) and a chat resumed from the sidebar continues with the model remembering it. The
OpenAI-compatible API (app.api) is served on the same server, from the same queue.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # `chainlit run app/main.py` imports this file by path
    sys.path.insert(0, str(ROOT))

import chainlit as cl  # noqa: E402
from chainlit.chat_context import chat_contexts  # noqa: E402
from chainlit.input_widget import Slider, TextInput  # noqa: E402
from chainlit.server import app as chainlit_app  # noqa: E402

from app import api, history  # noqa: E402
from app.service import (Conversation, Done, Failed, GenerationService, Loading, Queued,  # noqa: E402
                         ReplySettings, Text, Trimmed)
from app.settings import Settings, SettingsError  # noqa: E402

log = logging.getLogger("app")

try:
    SETTINGS = Settings.from_env()
    SERVICE = GenerationService.from_settings(SETTINGS)
    PASSWORDS = history.Passwords.from_settings(SETTINGS) if SETTINGS.auth == "password" else None
    if SETTINGS.history:
        history.prepare(SETTINGS)
    if SETTINGS.history or PASSWORDS:  # sign-in tokens need a secret
        os.environ["CHAINLIT_AUTH_SECRET"] = history.auth_secret(SETTINGS.history_db.parent)
except SettingsError as e:
    print(f"error: {e}", file=sys.stderr)
    sys.exit(2)
api.mount(chainlit_app, SERVICE, SETTINGS.api_key)

TRIMMED_NOTE = ("*Older messages of this chat no longer fit the model's context, so they were left out; "
                "the model now sees only the more recent ones.*")
STOPPED_WAIT_S = 2.0  # how long a stopped reply may take to hand back its last tokens and stats
STARTERS = [
    ("Capital of France", "What is the capital of France?"),
    ("Prime numbers in Python", "Write a Python function that checks whether a number is prime."),
    ("Explain attention", "Explain in simple words what attention does in a transformer."),
    ("Weekend ideas", "Give me three ideas for a relaxing weekend at home."),
]


# ---- app ----------------------------------------------------------------------------------------

@cl.on_app_startup
async def load_default_model():
    """Load (and on first start, prepare) the default model before the first chat needs it."""
    for name, path in SERVICE.profiles.items():  # where each model comes from, symbolic links followed
        log.info("model %s%s: %s", name, " (default)" if name == SERVICE.default else "",
                 path.resolve() if isinstance(path, Path) else path)  # a backend URL is a string
    try:
        await SERVICE.load()
    except Exception as e:  # the app still starts, and each chat shows the error
        log.error("the model %s could not be loaded: %s", SERVICE.default, e)


@cl.on_app_shutdown
def stop_service():
    SERVICE.close()


# ---- history and sign-in ------------------------------------------------------------------------

if SETTINGS.history:
    @cl.data_layer
    def history_database():
        return history.data_layer(SETTINGS)

if PASSWORDS:
    @cl.password_auth_callback
    async def password_login(username: str, password: str):
        name = PASSWORDS.check(username, password)
        return cl.User(identifier=name, metadata={"provider": "password"}) if name else None
elif SETTINGS.history:  # one local user, signed in without a form
    @cl.header_auth_callback
    async def local_user(headers):
        return cl.User(identifier=history.LOCAL_USER, metadata={"provider": "local"})


@cl.on_chat_resume
async def resume_chat(thread: dict):
    """A chat chosen in the sidebar: rebuild what the model saw from its stored messages."""
    profile = cl.user_session.get("chat_profile")
    values = cl.user_session.get("chat_settings") or {}
    system_prompt = ((values.get("system_prompt") or "").strip() or None if "system_prompt" in values
                     else SETTINGS.system_prompt)
    conversation = history.conversation_from_steps(
        thread.get("steps") or [], model=profile if profile in SERVICE.profiles else SERVICE.default,
        system_prompt=system_prompt)
    cl.user_session.set("conversation", conversation)
    log.info("resumed chat %s with %d messages", thread.get("id"), len(conversation.messages))
    try:
        await SERVICE.load(conversation.model)
    except Exception as e:
        await cl.ErrorMessage(content=f"The model {conversation.model} could not be loaded: {e}").send()
        return
    stored, _ = read_settings(values)
    panel = await cl.ChatSettings(settings_widgets(stored.over(SERVICE.reply_defaults(conversation.model)),
                                                   system_prompt, SERVICE.context_limit(conversation.model))).send()
    cl.user_session.set("reply_settings", read_settings(panel)[0])


@cl.set_chat_profiles
async def chat_profiles(user=None, language=None):
    return [cl.ChatProfile(name=name, default=name == SERVICE.default,
                           markdown_description=f"`{path}`" + (" (default)" if name == SERVICE.default else ""))
            for name, path in SERVICE.profiles.items()]


@cl.set_starters
async def starters(user=None, language=None):
    return [cl.Starter(label=label, message=message) for label, message in STARTERS]


# ---- chat ---------------------------------------------------------------------------------------

@cl.on_chat_start
async def start_chat():
    profile = cl.user_session.get("chat_profile")
    conversation = Conversation(model=profile if profile in SERVICE.profiles else SERVICE.default,
                                system_prompt=SETTINGS.system_prompt)
    cl.user_session.set("conversation", conversation)
    if not SERVICE.is_loaded(conversation.model):
        note = await cl.Message(content=f"Loading **{conversation.model}**…").send()
        try:
            await SERVICE.load(conversation.model)
        except Exception as e:
            await note.remove()
            await cl.ErrorMessage(content=f"The model {conversation.model} could not be loaded: {e}").send()
            return
        await note.remove()
    limit = SERVICE.context_limit(conversation.model)
    values = await cl.ChatSettings(settings_widgets(SERVICE.reply_defaults(conversation.model),
                                                    conversation.system_prompt, limit)).send()
    cl.user_session.set("reply_settings", read_settings(values)[0])


@cl.on_settings_update
async def update_settings(values: dict):
    values = {**(cl.user_session.get("chat_settings") or {}), **values}  # the whole panel, not only changes
    settings, problem = read_settings(values)
    cl.user_session.set("reply_settings", settings)
    conversation = current_conversation()
    conversation.system_prompt = (values.get("system_prompt") or "").strip() or None
    if problem:
        await cl.Message(content=problem).send()


@cl.on_message
async def on_message(message: cl.Message):
    conversation = current_conversation()
    cl.user_session.set("ended", False)  # a reconnected tab chats on
    conversation.truncate(message.id)  # an edited message: answer again from there
    if not message.content.strip():
        await cl.Message(content="Please type a message.").send()
        return
    conversation.add("user", message.content, id=message.id)
    await reply(conversation)


@cl.on_stop
async def stop_reply():
    request = cl.user_session.get("request")
    if request is not None:
        request.cancel()


@cl.on_chat_end
async def end_chat():
    """The tab closed or lost its connection, or a new chat began: free the model and the chat's memory."""
    cl.user_session.set("ended", True)
    request = cl.user_session.get("request")
    if request is not None:  # nobody is reading the reply any more: free the model for others
        request.cancel()  # and reply() drops the KV cache once the worker has handed it back
    conversation = cl.user_session.get("conversation")
    if conversation is not None:  # a reconnected tab prefills the conversation again
        conversation.kv_cache = None
    session = cl.context.session
    if getattr(session, "to_clear", False):  # a new chat replaces this one for good
        chat_contexts.pop(session.id, None)


def current_conversation() -> Conversation:
    conversation = cl.user_session.get("conversation")
    if conversation is None:  # a message that came before on_chat_start was done
        conversation = Conversation(model=SERVICE.default, system_prompt=SETTINGS.system_prompt)
        cl.user_session.set("conversation", conversation)
    return conversation


async def reply(conversation: Conversation) -> None:
    """Stream the answer to the conversation's last message, then a line of statistics."""
    request = SERVICE.stream(conversation, cl.user_session.get("reply_settings") or ReplySettings())
    cl.user_session.set("request", request)
    answer = cl.Message(content="", metadata={"kind": history.REPLY})  # what a resumed chat remembers
    status: cl.Message | None = None  # "waiting" or "loading", removed when the answer starts
    try:
        async for event in request:
            if isinstance(event, Text):
                if status is not None:
                    await status.remove()
                    status = None
                await answer.stream_token(event.text)
            elif isinstance(event, Queued):
                status = await show_status(status, f"Waiting for {event.position} other "
                                                   f"{'reply' if event.position == 1 else 'replies'} to finish…")
            elif isinstance(event, Loading):
                status = await show_status(status, f"Loading **{event.model}**…")
            elif isinstance(event, Trimmed) and not cl.user_session.get("told_trimmed"):
                cl.user_session.set("told_trimmed", True)
                await cl.Message(content=TRIMMED_NOTE).send()
            elif isinstance(event, Done):
                await finish(conversation, answer, event)
            elif isinstance(event, Failed):
                asked = request.messages[-1]  # not answered: leave it out of the history
                conversation.messages = [m for m in conversation.messages if m is not asked]
                await cl.ErrorMessage(content=event.message).send()
    except asyncio.CancelledError:  # the Stop button: keep what was written
        request.cancel()
        done = await last_event(request)
        if isinstance(done, Done):
            answer.content = done.text
            await finish(conversation, answer, done)
        else:
            await answer.send()
            conversation.add("assistant", answer.content, id=answer.id)
        raise
    finally:
        request.cancel()  # a no-op once it is done
        if cl.user_session.get("ended"):  # the chat ended while it ran: free its KV cache
            conversation.kv_cache = None
        if status is not None:
            await status.remove()
        if cl.user_session.get("request") is request:
            cl.user_session.set("request", None)


async def finish(conversation: Conversation, answer: cl.Message, done: Done) -> None:
    """Finalize the streamed answer, add it to the history, and show the statistics line."""
    if answer.content or done.finish_reason != "cancelled":
        await answer.send()
    conversation.add("assistant", done.text, id=answer.id)
    await cl.Message(content=f"*{done.summary}*", author="stats").send()


async def last_event(request):
    """The final event of a cancelled request (it stops at its next token), or None if it takes too long."""
    last = None

    async def drain():
        nonlocal last
        async for event in request:
            last = event

    try:
        await asyncio.wait_for(drain(), STOPPED_WAIT_S)
    except asyncio.TimeoutError:
        return None
    return last


async def show_status(status: cl.Message | None, text: str) -> cl.Message:
    if status is None:
        return await cl.Message(content=text).send()
    status.content = text
    await status.update()
    return status


# ---- settings panel -----------------------------------------------------------------------------

def settings_widgets(defaults: ReplySettings, system_prompt: str | None, limit: int) -> list:
    return [
        Slider(id="temperature", label="Temperature", initial=defaults.temperature, min=0, max=2, step=0.05,
               description="0 always picks the most likely token; higher is more varied."),
        Slider(id="top_k", label="Top-k", initial=defaults.top_k or 0, min=0, max=200, step=1,
               description="Sample among the k most likely tokens (0: off)."),
        Slider(id="top_p", label="Top-p", initial=defaults.top_p, min=0.05, max=1, step=0.05,
               description="Sample among the most likely tokens holding this share of probability."),
        Slider(id="max_new_tokens", label="Max new tokens", initial=min(defaults.max_new_tokens, limit),
               min=16, max=limit, step=16, description="The longest reply, in tokens."),
        TextInput(id="seed", label="Seed", initial="", placeholder="random",
                  description="A whole number makes sampling repeatable; blank is random."),
        TextInput(id="system_prompt", label="System prompt", initial=system_prompt or "", multiline=True,
                  placeholder="The model's own default", description="Instructions the model sees first."),
    ]


def read_settings(values: dict) -> tuple[ReplySettings, str | None]:
    """The panel's values as ReplySettings, and a note for the user if the seed was not a number."""
    text, seed, problem = str(values.get("seed") or "").strip(), None, None
    if text:
        try:
            seed = int(text)
        except ValueError:
            problem = f"The seed must be a whole number, not “{text}”; replies use a random seed."
    return ReplySettings(
        max_new_tokens=_number(values.get("max_new_tokens"), int),
        temperature=_number(values.get("temperature"), float),
        top_k=_number(values.get("top_k"), int),
        top_p=_number(values.get("top_p"), float),
        seed=seed,
    ), problem


def _number(value, kind):
    return None if value is None or value == "" else kind(value)
