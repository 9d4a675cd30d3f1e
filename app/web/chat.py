"""The chat in the browser: Chainlit handlers, registered on import and started by `app/main.py` (`start()`).

Thin Chainlit handlers over a backend (`app.backend.protocol`): the engine process that owns the models and
computes every reply, or a remote server. What a session keeps in cl.user_session:

    conversation     app.backend.conversation.Conversation: messages (replies with their token ids, user messages
                     with their files), system prompt
    reply_settings   app.messages.ReplySettings from the settings panel
    preset           the system-prompt preset the panel shows (app.web.presets); choosing another fills the prompt
    panel            the open settings panel's values at its last change, before Confirm (None after Confirm)
    request          the app.backend.reply.Reply being answered, for the Stop button
    told_trimmed     whether the user was told that older messages were left out
    told_near_full   whether the user was told that the context is nearly full
    actions          the Regenerate and Export buttons, under the last answer only
    models_panel     the models panel's element (app.web.models_panel), once the Models command opened it
    named_by_command whether the chat was named after a command (its first message): the next message renames it
    regenerated      how many times the last answer was sampled again (a set seed moves on by one each time)
    stats_line       the id of the statistics line under the last answer (Regenerate removes it with the answer)

Files attached to a message (app.web.attachments) go to the model with it. With history on (the default),
chats are stored in SQLite through Chainlit's data layer (app.web.history), their files beside it
(app.web.file_store), and a chat resumed from the sidebar continues with the model remembering it, files
included. The OpenAI-compatible API (app.api) is served on the same server, by the same engine.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import sys
from pathlib import Path

import msgspec


import chainlit as cl
from chainlit.chat_context import chat_contexts
from chainlit.config import config as chainlit_config
from chainlit.context import init_ws_context
from chainlit.data import get_data_layer
from chainlit.input_widget import Select, Slider, TextInput
from chainlit.server import app as chainlit_app
from chainlit.server import sio
from chainlit.session import WebsocketSession
from chainlit.utils import wrap_user_function

from app.api import routes as api, guard
from app.api.keys import ApiKeys
from app.web import (attachments, export, history, http_server, login_page, models_panel, page, page_words, sessions,
                     socket_events, uploads, users)
from app.web import first_start as first_start_words
from app.backend.protocol import Backend, InvalidRequest, ServerBusy, is_remote, open_backend
from app.bounds import reply_seed
from app.backend.conversation import Conversation, Message
from app.web.display import Paced, ShownStream, shown
from app.web.file_store import FileStore
from app.messages import FINISH_REASONS, Done, Failed, Loading, Queued, ReplySettings, Restarting, Text
from app.web.presets import CUSTOM, preset_of, read_presets
from app.weights import Weights
from model.options import Environment
from app.settings import Settings, SettingsError
from model.checkpoint_files import CheckpointError
from model.summary import summarize

log = logging.getLogger("app")

SETTINGS: Settings  # these are set by start()
PRESETS: dict
ALLOWED: guard.Allowed
BACKEND: Backend
SIGNING_IN: bool
SIGN_IN: users.SignIn | None
SIGNED_IN: sessions.Valid
FILE_STORE: FileStore | None  # the files of stored chats (history on)
MODELS: models_panel.ModelsPanel  # the weights folder's models, and the pulls into it (shared with Ollama's API)
API_KEYS: ApiKeys  # who an API request is (LLAMA_API_KEY, LLAMA_API_KEYS)

# How long a page may leave socket.io's pings unanswered before its socket is dropped, and with it (on_chat_end)
# the reply it was being sent. A page answers them from its main thread: engine.io's default of 20 s lost the
# replies of pages that were only busy (a slow machine drawing eight long answers at once; a phone that suspends
# a tab for a moment). A tab that is closed still ends its socket at once; only a silent one is waited for.
PAGE_PING_TIMEOUT_S = 60


def start() -> None:
    """Read the settings, open the backend (the engine process starts loading the default model), and put
    the guard, sign-in and the API in front of Chainlit's routes. `app/main.py` calls it once, before
    the server serves; a setting that cannot be used stops the start (exit status 2)."""
    global SETTINGS, PRESETS, ALLOWED, BACKEND, SIGNING_IN, SIGN_IN, SIGNED_IN, FILE_STORE, MODELS, API_KEYS
    try:
        SETTINGS = Settings.from_env()
        PRESETS = read_presets(SETTINGS.presets)
        ALLOWED = guard.Allowed.from_settings(SETTINGS, chainlit_config.run.host, chainlit_config.run.port,
                                              "https" if chainlit_config.run.ssl_cert else "http")
        BACKEND = open_backend(SETTINGS)
        MODELS = models_panel.ModelsPanel(BACKEND, Weights(BACKEND, SETTINGS.weights_dir,
                                                           Environment().text("HF_ENDPOINT"), SETTINGS.max_pulls),
                                          SETTINGS)
        FILE_STORE = None
        if SETTINGS.history:
            history.prepare(SETTINGS)
            FILE_STORE = FileStore.beside(SETTINGS.history_db)
        SIGNING_IN = SETTINGS.history or SETTINGS.auth == "password"  # Chainlit signs users in: with a form, or as local
        if SIGNING_IN:  # its tokens need a secret
            os.environ["CHAINLIT_AUTH_SECRET"] = history.auth_secret(SETTINGS.history_db.parent)
        SIGN_IN = (users.SignIn.from_settings(SETTINGS, key=os.environ["CHAINLIT_AUTH_SECRET"].encode())
                   if SETTINGS.auth == "password" else None)
        API_KEYS = ApiKeys.from_settings(SETTINGS)  # a keys file that cannot be used stops the app here
        SIGNED_IN = sessions.still_signed_in(SIGN_IN.passwords if SIGN_IN else None)
        uploads.claim_folder()  # this server's folder for the files Chainlit sends and those uploaded
        uploads.USER_PENDING_BYTES = SETTINGS.max_pending_mb * 2**20  # a user's uploads waiting, over all their tabs
        chainlit_config.features.spontaneous_file_upload = attachments.upload_feature()
        http_server.configure_chainlit(SETTINGS)  # slow clients cut off; X-Forwarded-For only from trusted proxies
        page.install()  # the page asks no other site for anything
        sio.eio.ping_timeout = PAGE_PING_TIMEOUT_S  # (read at each handshake and each check)
        # A message or a settings change up to LLAMA_MAX_BODY_MB reaches the handlers, which say what is too long
        # (at engineio's 1 MB a larger frame closed the socket: the message was lost without a word)
        sio.eio.max_http_buffer_size = SETTINGS.max_body_mb * 2**20
    except SettingsError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    if chainlit_app.middleware_stack is None:  # not serving yet (a reload by `chainlit run -w` keeps the first ones)
        guard.install(chainlit_app, ALLOWED)  # in front of every route: the page, socket.io, sign-in, history, the API
        chainlit_app.add_middleware(users.ClientAddress)  # failed sign-ins are slowed per address too
        http_server.install(chainlit_app)
        http_server.limit_bodies(chainlit_app)  # Chainlit's routes read whole bodies before asking who sent them
        chainlit_app.add_middleware(uploads.Tracked)  # uploads bounded per session; those not sent are deleted
        if SIGNING_IN:
            chainlit_app.add_middleware(sessions.Sessions, valid=SIGNED_IN)  # sessions end with their password
    only_edits_of_this_chat()
    socket_events.guard(sio)  # every socket event's payload checked before Chainlit's handler reads it
    api.mount(chainlit_app, BACKEND, API_KEYS, SETTINGS.max_body_mb, stored=lambda: dict(uploads.STORED),
              weights_dir=SETTINGS.weights_dir, max_context=SETTINGS.max_context, weights=MODELS.weights,
              may_manage=SETTINGS.may_manage_models)
    chainlit_app.router.routes.insert(0, api.health_route(BACKEND))  # before Chainlit's own
    chainlit_app.router.routes.insert(0, sessions.action_route())  # an action that is not one: a 400, not a 500
    if FILE_STORE is not None:
        chainlit_app.router.routes.insert(0, FILE_STORE.route())
    if SETTINGS.history:  # a message's feedback and files: the user's own only
        chainlit_app.router.routes[0:0] = history.owned_routes()
    chainlit_app.router.routes.insert(0, page_words.translations_route(SETTINGS))  # (in front of Chainlit's)
    # Chat history and sign-in, as the settings ask
    if SETTINGS.history:
        @cl.data_layer
        def history_database():
            return history.data_layer(SETTINGS, FILE_STORE)

    if SIGN_IN:
        @cl.password_auth_callback
        async def password_login(username: str, password: str):
            name = await SIGN_IN(username, password)
            return sessions.password_user(name, SIGN_IN.passwords) if name else None
    elif SETTINGS.history:  # one local user, signed in without a form
        @cl.header_auth_callback
        async def local_user(headers):
            return sessions.local_user()

        chainlit_app.router.routes.insert(0, sessions.local_sign_in())  # the page's first question: who is it


TRIMMED_NOTE = ("*Older messages of this chat no longer fit the model's context, so they were left out; "
                "the model now sees only the more recent ones.*")
NEAR_FULL = 0.85  # share of the prompt's room (the engine's Context.room) past which older turns go soon
NEAR_FULL_NOTE = ("*This chat fills {used} of the model's context, and the next reply needs room too: older turns "
                  "will be left out soon, and the model will no longer see them.*")
BUSY_NOTE = ("The server is busy: as many replies are running and waiting as it takes. Please send your "
             "message again in a moment.")
LOADED, NOT_LOADED = "loaded", "not loaded — loads on first use"  # the model picker's line
RESTARTING_NOTE = "The model is restarting after a failure; your message is answered as soon as it is back…"
STOPPED_WAIT_S = 10.0  # how long a stopped reply may take to hand back its last tokens and stats (a busy server
# takes seconds: without them the line under the answer only says it was stopped)
STOPPED_LINE = "*stopped by user*"
SESSION_STATE = {"request": None, "actions": [], "regenerated": 0, "stats_line": None}  # a resumed chat starts with these
EXPORT_COMMAND, MODELS_COMMAND = "Export", "Models"
MODEL_GONE_NOTE = "**{gone}**, the model of this chat, is no longer here (it was removed): the chat goes on with **{default}**."
COMMANDS = [{"id": EXPORT_COMMAND, "icon": "download", "description": "Download this chat as Markdown and JSON",
             "button": False, "persistent": False},
            {"id": MODELS_COMMAND, "icon": "box", "description": "See, pull, remove and choose models",
             "button": False, "persistent": False}]
DESCRIPTIONS: dict[str, str] = {}  # model name -> describe(name)
SWEEPING: set[asyncio.Task] = set()  # the tasks that close sockets whose sign-in ended and delete uploads not sent
# (held: tasks are weak)
STARTERS = [
    ("Capital of France", "What is the capital of France?"),
    ("Prime numbers in Python", "Write a Python function that checks whether a number is prime."),
    ("Explain attention", "Explain in simple words what attention does in a transformer."),
    ("Weekend ideas", "Give me three ideas for a relaxing weekend at home."),
]


# ---- app ----------------------------------------------------------------------------------------

@cl.on_app_startup
async def start_backend():
    """Wait for the engine to list its models; it loads (on first start, prepares) the default one
    meanwhile, and /health says 200 once it is loaded."""
    log.info("%s", ALLOWED.summary())
    if note := login_page.log_note(SETTINGS):
        log.warning("%s", note)
    if SIGNING_IN:
        SWEEPING.add(asyncio.create_task(sessions.sweep(SIGNED_IN)))  # open sockets whose sign-in ended
    SWEEPING.add(asyncio.create_task(uploads.sweeping(
        functools.partial(history.stored_bytes, SETTINGS.history_db) if SETTINGS.history else dict)))
    await BACKEND.start()
    for name, path in BACKEND.profiles.items():  # where each model comes from, symbolic links followed
        log.info("model %s%s: %s", name, " (default)" if name == BACKEND.default else "",
                 path if is_remote(path) else Path(path).resolve())
    where = BACKEND.profiles.get(BACKEND.default, "")
    if not is_remote(where) and not BACKEND.is_loaded():  # printed before Chainlit prints the page's address
        log.info("the default model %s is still being %s; the chat answers once it is ready (GET /health "
                    "says 200 then)", BACKEND.default,
                    "prepared (first start: its file fetched once, the decode kernel built for this CPU)"
                    if SETTINGS.is_default_checkpoint and not Path(where).exists() else "loaded")


@cl.on_app_shutdown
def stop_backend():
    BACKEND.close()


# ---- history and sign-in ------------------------------------------------------------------------

# (the data layer and the sign-in callbacks are registered by start(), as the settings ask)


@cl.on_chat_resume
async def resume_chat(thread: dict):
    """A chat chosen in the sidebar: rebuild what the model saw from its stored messages."""
    await BACKEND.start()
    profile = cl.user_session.get("chat_profile")
    values = cl.user_session.get("chat_settings") or {}
    system_prompt = ((values.get("system_prompt") or "").strip() or None if "system_prompt" in values
                     else SETTINGS.system_prompt)
    conversation = history.conversation_from_steps(
        thread.get("steps") or [], model=profile if profile in BACKEND.profiles else BACKEND.default,
        system_prompt=system_prompt,
        files=lambda step: attachments.stored_files(step, FILE_STORE, thread.get("elements") or []))
    cl.user_session.set("conversation", conversation)
    for key, value in SESSION_STATE.items():  # what Chainlit restored of these is the stored chat's text of them
        cl.user_session.set(key, value)
    await give_back_actions(conversation, thread.get("steps") or [])
    if profile:
        await model_still_here(conversation, was=profile)
    await cl.context.emitter.set_commands(COMMANDS)
    log.info("resumed chat %s with %d messages", thread.get("id"), len(conversation.messages))
    try:
        await BACKEND.load(conversation.model)
    except Exception as e:
        await cl.ErrorMessage(content=f"The model {conversation.model} could not be loaded: {e}").send()
        return
    stored, _ = read_settings(values)
    panel = await cl.ChatSettings(settings_widgets(stored.over(BACKEND.reply_defaults(conversation.model)),
                                                   system_prompt, BACKEND.context_limit(conversation.model))).send()
    cl.user_session.set("reply_settings", read_settings(panel)[0])
    cl.user_session.set("preset", panel["preset"])


async def give_back_actions(conversation: Conversation, steps: list[dict]) -> None:
    """Regenerate and Export under a resumed chat's last answer, as it had them (actions are not stored): on the
    statistics line that follows the answer, which Regenerate removes with it."""
    last = conversation.messages[-1] if conversation.messages else None
    if last is None or last.role != "assistant" or not last.id:
        return
    ids = [step.get("id") for step in steps]
    after = steps[ids.index(last.id) + 1:] if last.id in ids else []
    line = next((step for step in after if step.get("name") == "stats"), None)
    if line is None or any(step.get("type") == "user_message" for step in after[:after.index(line)]):
        return
    actions = answer_actions(last.id)
    for action in actions:
        await action.send(for_id=line["id"])
    cl.user_session.set("actions", actions)
    cl.user_session.set("stats_line", line["id"])


@cl.set_chat_profiles
async def chat_profiles(user=None, language=None):
    """The models to choose from: each one's size, format and dtype, where it is, and whether it is loaded
    now (asked at each page load). Chosen, it loads; an idle one is unloaded after LLAMA_KEEP_ALIVE."""
    await BACKEND.start()
    return [cl.ChatProfile(name=name, default=name == BACKEND.default,
                           markdown_description=f"{describe(name)}  \n`{path}`"
                                                + (" (default)" if name == BACKEND.default else "")
                                                + memory_state(name))
            for name, path in BACKEND.profiles.items()]


def memory_state(name: str) -> str:
    """A line saying whether the model is loaded now; none where the backend cannot tell (a remote server)."""
    loaded = BACKEND.in_memory(name)
    if loaded is None:
        return ""
    return f"  \n{LOADED if loaded else NOT_LOADED}"


def describe(name: str) -> str:
    """A model in a few words, from its checkpoint folder (read once): "135M parameters · 538 MB · safetensors ·
    bf16"; a remote server's model: where it is served."""
    if name not in DESCRIPTIONS:
        path = BACKEND.profiles.get(name, "")
        if is_remote(path):
            DESCRIPTIONS[name] = f"served by {path}"
        else:
            try:
                summary = summarize(path)
                # LLAMA_QUANTIZE; weights quantized in the file (a GGUF's blocks) stay as they are
                quantized = SETTINGS.quantize != "off" and summary.dtype not in ("int8", "int4")
                DESCRIPTIONS[name] = summary.describe() + (f" · {SETTINGS.quantize} when loaded" if quantized else "")
            except (CheckpointError, OSError) as e:
                return f"not readable: {e}"  # (not kept: a folder being made is read again next time)
    return DESCRIPTIONS[name]


@cl.set_starters
async def starters(user=None, language=None):
    """The questions offered on an empty chat; while the embedded default is the only model, first a way to a
    better one (the models panel)."""
    offered = [cl.Starter(label=label, message=message) for label, message in STARTERS]
    if len(BACKEND.profiles) == 1 and BACKEND.default in BACKEND.profiles and not is_remote(
            BACKEND.profiles[BACKEND.default]):
        offered.insert(0, cl.Starter(label=f"Chatting with {BACKEND.default}: get a better model", message="/models"))
    return offered


# ---- chat ---------------------------------------------------------------------------------------

@cl.on_chat_start
async def start_chat():
    await BACKEND.start()
    profile = cl.user_session.get("chat_profile")
    conversation = Conversation(model=profile if profile in BACKEND.profiles else BACKEND.default,
                                system_prompt=SETTINGS.system_prompt)
    cl.user_session.set("conversation", conversation)
    await cl.context.emitter.set_commands(COMMANDS)
    if not BACKEND.is_loaded(conversation.model):  # its first use: say what loads, then how long it took
        note = await cl.Message(content=loading_note(conversation.model)).send()
        try:
            info = await load_telling(conversation.model, note)
        except Exception as e:
            await note.remove()
            await cl.ErrorMessage(content=f"The model {conversation.model} could not be loaded: {e}").send()
            return
        note.content = f"Loaded **{conversation.model}** in {info.load_seconds:.1f} s."
        await note.update()
    limit = BACKEND.context_limit(conversation.model)
    values = await cl.ChatSettings(settings_widgets(BACKEND.reply_defaults(conversation.model),
                                                    conversation.system_prompt, limit)).send()
    cl.user_session.set("reply_settings", read_settings(values)[0])
    cl.user_session.set("preset", values["preset"])


@cl.on_settings_update
async def update_settings(values: dict):
    """Confirm: the panel's values apply to the next reply. A preset chosen since the last Confirm, whose text
    the panel did not show yet (a page that sends no edits), fills the system prompt now."""
    values = {**(cl.user_session.get("chat_settings") or {}), **values}  # the whole panel, not only changes
    cl.user_session.set("panel", None)  # the next edits are compared with these values
    settings, problem = read_settings(values)
    cl.user_session.set("reply_settings", settings)
    conversation = current_conversation()
    preset = values.get("preset") if isinstance(values.get("preset"), str) else None
    prompt = values.get("system_prompt")
    typed = (prompt.strip() or None) if isinstance(prompt, str) else None
    if preset in PRESETS and preset != cl.user_session.get("preset", CUSTOM) and typed == conversation.system_prompt:
        conversation.system_prompt = PRESETS[preset]
        values["system_prompt"] = PRESETS[preset]
        defaults = BACKEND.reply_defaults(conversation.model)
        await cl.ChatSettings(settings_widgets(defaults, conversation.system_prompt,
                                               BACKEND.context_limit(conversation.model), values)).send()
    else:
        conversation.system_prompt = typed
    cl.user_session.set("preset", preset)  # as the panel shows it
    if problem:
        await cl.Message(content=problem).send()


async def edit_settings(values: dict):
    """A change in the open panel, before Confirm: a preset just chosen shows its text in the system prompt's
    box at once. The page sends the whole panel at each change, so a preset was chosen when it is the only
    value that differs from the last change's (or, the panel just opened, from the confirmed values); a
    change of the text itself leaves it as typed. Nothing applies until Confirm (Cancel puts the panel back)."""
    if not isinstance(values, dict):  # (what a page sends: not ours to trust)
        return
    last, confirmed = cl.user_session.get("panel"), cl.user_session.get("chat_settings") or {}
    cl.user_session.set("panel", values)
    preset = values.get("preset")
    if not isinstance(preset, str) or preset not in PRESETS or not any(changed(values, before) == {"preset"} for before in (last, confirmed)
                                        if before is not None):
        return
    values = {**values, "system_prompt": PRESETS[preset]}
    cl.user_session.set("panel", values)
    conversation = current_conversation()
    await cl.ChatSettings(settings_widgets(BACKEND.reply_defaults(conversation.model), PRESETS[preset],
                                           BACKEND.context_limit(conversation.model), values)).refresh()


# Registered without Chainlit's task: a task's end would take the Stop button away from a reply that is running.
chainlit_config.code.on_settings_edit = wrap_user_function(edit_settings)


def changed(values: dict, before: dict) -> set[str]:
    """The panel's fields whose values differ (blank and None are the same: the page sends one, Confirm the other)."""
    def value(panel: dict, key: str):
        return None if panel.get(key) == "" else panel.get(key)

    return {key for key in values.keys() | before.keys() if value(values, key) != value(before, key)}


@cl.on_message
async def on_message(message: cl.Message):
    conversation = current_conversation()
    command = history.command_of(message.command, message.content)
    if command is not None and not conversation.messages:  # Chainlit named the chat after it: renamed below
        cl.user_session.set("named_by_command", True)
    if command == EXPORT_COMMAND:
        await send_export(conversation)
        return
    if command == MODELS_COMMAND:
        await open_models_panel()
        return
    if cl.user_session.get("answering") or cl.user_session.get("request") is not None:  # one reply at a time (the
        # page disables Send meanwhile; another client may not): a message then is refused
        if conversation.message(message.id) is None:  # a new message, not answered: not kept either (an edit
            refused = cl.user_session.get("refused_ids") or set()  # leaves the message it edits as it was)
            cl.user_session.set("refused_ids", refused | {message.id})
            await message.remove()
        await cl.ErrorMessage(content="Please wait until this reply is done (or stop it) before sending another "
                                      "message.").send()
        return
    cl.user_session.set("answering", message.id)  # (before any await: one that comes meanwhile is refused above,
    # and not stored: app.web.history's create_step)
    try:
        if await chat_deleted():
            await cl.ErrorMessage(content="This chat was deleted (in another tab or window): start a new chat to "
                                          "go on.").send()
            return
        await answer(message, conversation, command)
    finally:
        cl.user_session.set("answering", None)


async def chat_deleted() -> bool:
    """Whether this tab's chat was deleted meanwhile (its history would not take another message)."""
    layer = get_data_layer()
    return isinstance(layer, history.SQLiteDataLayer) and await layer.owners.deleted(cl.context.session.thread_id)


async def answer(message: cl.Message, conversation: Conversation, command: str | None) -> None:
    """on_message's work, one message of the chat at a time: the message (new, or an edit) into the chat, its files
    read, the reply."""
    if cl.user_session.get("named_by_command") and not conversation.messages:
        cl.user_session.set("named_by_command", False)
        await rename_chat(message.content)  # after the first message to the model, as any chat
    edited = conversation.message(message.id)
    if edited is None:  # what the page sent: the app's own keys in it are not the client's to set
        message.metadata = attachments.client_metadata(message.metadata)
    elif conversation.messages[0] is edited and edited.content != message.content:
        await rename_chat(message.content)  # the chat is named after its first message
    conversation.truncate(message.id)  # an edited message: answer again from there
    uploads.take(message.elements)  # never swept from now on: they are read, then stored
    await attachments.show(message)  # its files as chips, not as Chainlit's previews
    try:
        files = await attachments.read(message.elements) if message.elements else None
    except attachments.Refused as refused:
        uploads.discard(message.elements, cl.context.session)
        await cl.ErrorMessage(content=str(refused)).send()
        return
    if files:
        await attachments.show(message, files)  # with their pages
    if files is None and edited is not None and edited.files:  # an edit of a resumed chat's message
        files = [msgspec.structs.replace(file, chosen=None) for file in edited.files]  # another question
    if not message.content.strip() and not files:
        await cl.Message(content="Please type a message.").send()
        return
    if files and FILE_STORE is not None:
        if problem := await over_quota(message, files):
            uploads.discard(message.elements, cl.context.session)
            await cl.ErrorMessage(content=problem).send()
            return
        layer = get_data_layer()
        if isinstance(layer, history.SQLiteDataLayer):  # its create_element left the uploads to this
            await layer.keep_uploads(message)
        await attachments.keep(message, files, FILE_STORE)
    asked = conversation.add("user", message.content, id=message.id, files=files)
    cl.user_session.set("regenerated", 0)
    try:
        await reply(conversation)
    finally:
        if files and FILE_STORE is not None and asked.files != files:  # the engine chose what to read of them
            await attachments.keep(message, asked.files, FILE_STORE)


async def over_quota(message: cl.Message, files) -> str | None:
    """The note refusing a message whose new files would take its user's stored files past
    LLAMA_MAX_USER_FILES_MB (files already stored, as an edited message's, are not counted twice)."""
    user_id, layer = getattr(cl.context.session.user, "id", None), get_data_layer()
    new = [file for file, element in zip(files, message.elements) if not FILE_STORE.holds_text(element.id)]
    if user_id is None or layer is None or not new:
        return None
    return attachments.over_quota(new, await FILE_STORE.user_bytes(layer, user_id), SETTINGS.max_user_files_mb)


def only_edits_of_this_chat() -> None:
    """Chainlit hands an edit that names a message not in the tab's chat (another chat's id, or none) to
    on_message as None, through a wrapper that fails on it: such an edit is dropped here, with a log line."""
    handlers = sio.handlers["/"]
    chainlit_edit = handlers["edit_message"]
    if getattr(chainlit_edit, "guarded", False):  # (a reload keeps the first one)
        return

    async def edit_message(sid, payload):
        session = WebsocketSession.get(sid)
        message = payload.get("message") if isinstance(payload, dict) else None
        edited = message.get("id") if isinstance(message, dict) else None
        if session is None or not any(m.id == edited for m in chat_contexts.get(session.id, [])):
            log.info("an edit of a message that is not in the chat of user %r was dropped",
                     session.user.identifier if session and session.user else None)
            return
        await chainlit_edit(sid, payload)

    edit_message.guarded = True
    handlers["edit_message"] = edit_message


async def rename_chat(name: str) -> None:
    """Name the chat in the history (Chainlit names it after its first message, when it is sent), and have the
    page list the chats again: it does when it is told of a chat's first message."""
    session = cl.context.session
    if (data_layer := get_data_layer()) is None or not session.thread_id:
        return
    await data_layer.update_thread(thread_id=session.thread_id, name=name)
    await cl.context.emitter.emit("first_interaction", {"interaction": name, "thread_id": session.thread_id})


@cl.action_callback("regenerate")
async def regenerate(action: cl.Action):
    """Sample the last answer again, with another seed: the old one goes, from the page and the history."""
    conversation = current_conversation()
    last = conversation.messages[-1] if conversation.messages else None
    if cl.user_session.get("request") is not None or cl.user_session.get("answering"):
        await cl.Message(content="Please wait until this reply is done (or stop it) to regenerate.").send()
        return
    if last is None or last.role != "assistant" or last.id != action.payload.get("answer"):
        await cl.Message(content="Only the last answer can be regenerated.").send()
        return
    conversation.messages.pop()  # the prompt up to the user's turn is a prefix the engine has cached

    async def drop_old_answer() -> None:  # once the new answer begins: before, a failure keeps the old one
        await action.remove()
        for message_id in (last.id, cl.user_session.get("stats_line")):  # the answer and its statistics line
            if message_id:  # (ids this session made: never one the client names, as action.forId)
                await cl.Message(content="", id=message_id).remove()

    regenerated = (cl.user_session.get("regenerated") or 0) + 1
    cl.user_session.set("regenerated", regenerated)
    settings = cl.user_session.get("reply_settings") or ReplySettings()
    settings = msgspec.structs.replace(settings, seed=None if settings.seed is None
                                       else reply_seed(settings.seed, regenerated))
    emitter = cl.context.emitter
    cl.user_session.set("answering", last.id)  # (a message sent meanwhile is refused, as during any reply)
    try:
        await emitter.task_start()  # the Stop button, as for a message (an action has no task of its own)
        async with cl.Step(name="on_message", type="run"):  # as a message's reply is, so it gets a copy button
            await reply(conversation, settings, replacing=last, on_first_text=drop_old_answer)
    finally:
        cl.user_session.set("answering", None)
        await emitter.task_end()


async def open_models_panel() -> None:
    """The models panel, as a message of this chat (a new one each time it is asked for)."""
    element = await models_panel.show(MODELS, None, current_conversation().model, chat_user_name())
    cl.user_session.set("models_panel", element)
    for pull in MODELS.weights.under_way():  # one started elsewhere (another tab, /api/pull) shows its progress
        models_panel.follow_in_background(MODELS, element, pull, lambda: current_conversation().model,
                                          chat_user_name())


@cl.action_callback("models")
async def models_action(action: cl.Action):
    """A click in the models panel: use, default, remove, pull, cancel (app.web.models_panel)."""
    conversation, user = current_conversation(), chat_user_name()
    payload = action.payload if isinstance(action.payload, dict) else {}
    before = set(MODELS.weights.under_way_ids())
    said = await MODELS.act(payload, conversation, user, busy=cl.user_session.get("request") is not None)
    element = cl.user_session.get("models_panel")
    if element is None:
        await cl.Message(content=said, author="models").send()
        return
    models_panel.say(element, said)
    element = await models_panel.show(MODELS, element, conversation.model, user)
    for pull in MODELS.weights.under_way():
        if id(pull) not in before:
            models_panel.follow_in_background(MODELS, element, pull, lambda: current_conversation().model, user)


def chat_user_name() -> str | None:
    """Who is signed in (None: nobody signs in here), for LLAMA_MODEL_ADMINS."""
    user = cl.context.session.user
    return user.identifier if user and SIGN_IN else None


@cl.action_callback("export")
async def export_chat(action: cl.Action):
    await send_export(current_conversation())


async def send_export(conversation: Conversation) -> None:
    """The chat as two files to download: Markdown, and JSON in the OpenAI messages shape."""
    if not conversation.messages:
        await cl.Message(content="There is nothing to export yet.").send()
        return
    elements = [cl.File(name=name, content=content, display="inline",
                        mime="application/json" if name.endswith(".json") else "text/markdown")
                for name, content in export.files(conversation).items()]
    await cl.Message(content="This chat as Markdown and as JSON (OpenAI's messages):", elements=elements,
                     author="export").send()


@cl.on_stop
async def stop_reply():
    request = cl.user_session.get("request")
    if request is not None:
        request.cancel()


@sio.on("stop")
async def stop(sid):
    """The Stop button, as Chainlit's own handler (which this replaces) takes it, less the "Task manually
    stopped." message that one adds to the chat: the stopped answer's line says "stopped by user"."""
    if session := WebsocketSession.get(sid):
        init_ws_context(session)
        if session.current_task:
            session.current_task.cancel()
        if chainlit_config.code.on_stop:
            await chainlit_config.code.on_stop()


@cl.on_chat_end
async def end_chat():
    """The tab closed or lost its connection, or a new chat began: free the model for others."""
    request = cl.user_session.get("request")
    if request is not None:  # nobody is reading the reply any more
        cl.user_session.set("page_gone", True)  # (its line says so, not "stopped by user")
        request.cancel()
    session = cl.context.session
    if getattr(session, "to_clear", False):  # a new chat replaces this one for good
        chat_contexts.pop(session.id, None)
        uploads.end_session(session.id)


def chat_user() -> str:
    """Whose chat this is: the engine reuses a kept KV cache only between requests of the same user."""
    user = cl.context.session.user
    return user.identifier if user else users.LOCAL_USER


def current_conversation() -> Conversation:
    conversation = cl.user_session.get("conversation")
    if conversation is None:  # a message that came before on_chat_start was done
        conversation = Conversation(model=BACKEND.default, system_prompt=SETTINGS.system_prompt)
        cl.user_session.set("conversation", conversation)
    return conversation


async def reply(conversation: Conversation, settings: ReplySettings | None = None, *,
                replacing: Message | None = None, on_first_text=None) -> None:
    """Stream the answer to the conversation's last message, then a line of statistics.

    A regenerated answer is `replacing` the one taken off the history: until its first text comes (and
    `on_first_text()` takes the old one off the page), a failure, a busy server or Stop puts the old
    one back, and the question stays answered. Stopped after its first text, an answer stays as far as
    it came, in the history too; failed, it stays on the page but the question leaves the history, as
    when nothing came: the error asks to send it again. So a cut answer is stored marked as cut
    (history.CUT), and a resumed chat leaves it and its question out too. The text so far is written to the
    history as it streams (history.StreamedReply): if the web process is killed midway, the next start
    shows it marked as cut short, and it counts as cut."""

    asked = conversation.messages[-1]
    cl.user_session.set("page_gone", False)  # (a socket that reconnects keeps its session)
    await model_still_here(conversation)

    def not_answered() -> None:
        if replacing is not None and on_first_text is not None:  # nothing of the new answer came
            conversation.messages.append(replacing)
        else:  # leave the question out of the history (the old answer, if any, went): it is to be sent again
            conversation.messages = [m for m in conversation.messages if m is not asked]

    try:
        request = BACKEND.stream(conversation, settings or cl.user_session.get("reply_settings") or ReplySettings(),
                                 user=chat_user())
    except ServerBusy:
        not_answered()
        await cl.ErrorMessage(content=BUSY_NOTE).send()
        return
    except InvalidRequest as e:  # (a chat too long in messages, ...)
        not_answered()
        await cl.ErrorMessage(content=f"This message cannot be answered: {e}").send()
        return
    cl.user_session.set("request", request)
    answer = cl.Message(content="", metadata={"kind": history.REPLY})  # what a resumed chat remembers
    saved = history.StreamedReply(answer)
    display = ShownStream()  # LaTeX is on: a dollar that is money is escaped (app.web.display)
    paced = Paced()  # sent to the page at most every display.STREAM_EVERY_S
    status: cl.Message | None = None  # "waiting" or "loading", removed when the answer starts
    try:
        async for event in request:
            if isinstance(event, Text):
                if status is not None:
                    await status.remove()
                    status = None
                if on_first_text is not None:
                    await on_first_text()
                    on_first_text = None
                piece, whole = display.feed(event.text)
                if piece or whole:
                    paced.add(piece, whole)
                if paced.due():
                    piece, whole = paced.take()
                    await answer.stream_token(piece, is_sequence=whole)
                    saved.grew()
            elif isinstance(event, Queued):
                status = await show_status(status, "The model is answering other chats; yours is "
                                                   f"{'next' if event.position == 1 else f'number {event.position}'}"
                                                   " in line…")
            elif isinstance(event, Loading):
                status = await show_status(status, loading_note(event.model))
            elif isinstance(event, Restarting):
                status = await show_status(status, RESTARTING_NOTE)
            elif isinstance(event, Done):
                if on_first_text is not None:  # an answer without text still replaces the old one
                    await on_first_text()
                    on_first_text = None
                await saved.settled()
                await finish(conversation, answer, event)
            elif isinstance(event, Failed):
                not_answered()
                if answer.content:  # cut off midway (the engine stopped): no endless cursor
                    answer.content = display.end()  # with a last "$..." held back, if any
                    answer.metadata = {"kind": history.CUT}  # not an answer a resumed chat remembers
                    await saved.settled()
                    await answer.send()
                await cl.ErrorMessage(content=event.message).send()
    except asyncio.CancelledError:  # the Stop button: keep what was written
        request.cancel()
        done = await last_event(request)
        await saved.settled()
        if replacing is not None and on_first_text is not None:  # stopped before the new answer began
            not_answered()
        elif isinstance(done, Done):
            answer.content = done.text
            await finish(conversation, answer, done)
        else:
            answer.content = display.end()  # with a last "$..." held back, if any
            await answer.send()
            conversation.add("assistant", display.raw, id=answer.id)  # as written, not as shown (app.web.display)
            if answer.content:  # the stats never came: the line under it still says what happened
                await below(cl.Message(content=STOPPED_LINE, author="stats"))
        raise
    finally:
        request.cancel()  # a no-op once it is done
        if status is not None:
            await status.remove()
        if cl.user_session.get("request") is request:
            cl.user_session.set("request", None)


async def finish(conversation: Conversation, answer: cl.Message, done: Done) -> None:
    """Finalize the streamed answer, add it to the history, and show the statistics line with the context in
    use, as the engine reports it (and, once each, notes that older messages were left out or soon will be)."""
    if answer.content or done.text or done.finish_reason != "cancelled":
        answer.content = shown(done.text)
        await answer.send()
    conversation.add("assistant", done.text, id=answer.id, ids=done.token_ids)
    context = done.context
    asked = next((m for m in reversed(conversation.messages) if m.role == "user"), None)
    if asked is not None and asked.files and context.files:  # later turns send them as they went now
        asked.files = attachments.with_chosen(asked.files, context.files)
    trimmed = context.left_out > conversation.left_out  # this reply's prompt left out more than the last one's
    conversation.left_out = max(conversation.left_out, context.left_out)  # later prompts start there: cache reused
    for action in cl.user_session.get("actions") or []:  # only the last answer has them
        await action.remove()
    actions = answer_actions(answer.id)
    cl.user_session.set("actions", actions)
    line = f"{conversation.model} · {done.summary}"  # which model wrote it, under every answer
    if done.finish_reason == "cancelled" and cl.user_session.get("page_gone"):  # the tab closed, nobody pressed Stop
        line = line.replace(FINISH_REASONS["cancelled"], "cut off: the page was closed")
    if context.limit:  # (not known for a reply stopped before its prompt was built)
        line += f" · {context_in_use(done.context_used, context.limit)}"
    if context.left_out:
        line += f" · {context.left_out} earlier message{'s' if context.left_out != 1 else ''} left out"
    files, sources = attachments.note(context.files)
    stats = cl.Message(content=f"*{line}*" + (f"\n\n{files}" if files else ""), author="stats", actions=actions,
                       elements=sources)
    cl.user_session.set("stats_line", stats.id)
    await below(stats)
    if trimmed:
        if not cl.user_session.get("told_trimmed"):
            cl.user_session.set("told_trimmed", True)
            await below(cl.Message(content=TRIMMED_NOTE))
    elif context.room and done.context_used >= NEAR_FULL * context.room and not cl.user_session.get("told_near_full"):
        cl.user_session.set("told_near_full", True)
        await below(cl.Message(content=NEAR_FULL_NOTE.format(used=context_in_use(done.context_used, context.limit))))


def answer_actions(answer_id: str) -> list[cl.Action]:
    """The buttons under the last answer."""
    return [cl.Action(name="regenerate", payload={"answer": answer_id}, label="Regenerate", icon="refresh-cw",
                      tooltip="Write this answer again (another sample)"),
            cl.Action(name="export", payload={}, label="Export", icon="download",
                      tooltip="Download this chat as Markdown and JSON")]


async def model_still_here(conversation: Conversation, was: str | None = None) -> None:
    """A chat whose model was removed (`was`: a resumed chat's, before it fell back) goes on with the default
    model, and says so: never a reply from another model without a word."""
    gone = was if was is not None and was not in BACKEND.profiles else conversation.model
    if gone in BACKEND.profiles or gone == BACKEND.default:
        return
    conversation.model = BACKEND.default
    await cl.Message(content=MODEL_GONE_NOTE.format(gone=gone, default=BACKEND.default)).send()


async def below(message: cl.Message) -> None:
    """Send a line that follows an answer outside the answer's run step: the page gives its copy button to the
    last message of a run, which must be the answer, not this."""
    message.parent_id = None
    await message.send()


def context_in_use(used: int, limit: int) -> str:
    """How much of the model's context the conversation takes: "1,234 / 8,192 tokens"."""
    return f"{used:,} / {limit:,} tokens"


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


def first_start(model: str) -> bool:
    """Whether the model is the embedded default on its first start (its folder not made yet)."""
    path = BACKEND.profiles.get(model, "")
    return model == BACKEND.default and SETTINGS.is_default_checkpoint and not is_remote(path) and not Path(path).exists()


def loading_note(model: str) -> str:
    """What the page says while a model loads; for the embedded default on its first start, what that start does."""
    if first_start(model):
        return first_start_words.note(model, first_start_words.stage(SETTINGS.cache_dir, Path(BACKEND.profiles[model])))
    return f"Loading **{model}** ({describe(model)})…"


async def load_telling(model: str, note: cl.Message):
    """BACKEND.load(model); on a first start, the note says each stage as it comes (app.web.first_start)."""
    if not first_start(model):
        return await BACKEND.load(model)
    loading = asyncio.ensure_future(BACKEND.load(model))
    said = note.content
    while not loading.done():
        await asyncio.wait([loading], timeout=first_start_words.EVERY_S)
        now = first_start_words.note(model, first_start_words.stage(SETTINGS.cache_dir, Path(BACKEND.profiles[model])))
        if now != said and not loading.done():
            note.content = said = now
            await note.update()
    return loading.result()


async def show_status(status: cl.Message | None, text: str) -> cl.Message:
    if status is None:
        return await cl.Message(content=text).send()
    status.content = text
    await status.update()
    return status


# ---- settings panel -----------------------------------------------------------------------------

def settings_widgets(defaults: ReplySettings, system_prompt: str | None, limit: int,
                     values: dict | None = None) -> list:
    """The settings panel: the defaults, or the values the user set (as the panel sends them)."""
    widgets = [
        Slider(id="temperature", label="Temperature", initial=defaults.temperature, min=0, max=2, step=0.05,
               description="0 always picks the most likely token; higher is more varied."),
        Slider(id="top_k", label="Top-k", initial=defaults.top_k or 0, min=0, max=200, step=1,
               description="Sample among the k most likely tokens (0: off)."),
        Slider(id="top_p", label="Top-p", initial=defaults.top_p, min=0.05, max=1, step=0.05,
               description="Sample among the most likely tokens holding this share of probability."),
        Slider(id="min_p", label="Min-p", initial=defaults.min_p, min=0, max=0.5, step=0.01,
               description="Leave out tokens less likely than this share of the most likely one (0: off)."),
        Slider(id="repetition_penalty", label="Repetition penalty", initial=defaults.repetition_penalty, min=1,
               max=2, step=0.01, description="Makes tokens of the last 64 less likely, so replies do not go round "
                                             "in circles; text quoted from the chat is spared (1: off)."),
        Slider(id="max_new_tokens", label="Max new tokens", initial=min(defaults.max_new_tokens, limit),
               min=16, max=limit, step=16, description="The longest reply, in tokens."),
        TextInput(id="seed", label="Seed", initial="", placeholder="random",
                  description="A whole number makes sampling repeatable; blank is random."),
        Select(id="preset", label="System prompt preset", values=[CUSTOM, *PRESETS],
               initial_value=preset_of(PRESETS, system_prompt),
               description="A named system prompt (from the presets folder); it fills the text below."),
        TextInput(id="system_prompt", label="System prompt", initial=system_prompt or "", multiline=True,
                  placeholder="The model's own default", description="Instructions the model sees first."),
    ]
    for widget in widgets:  # keep what the user set, when the panel is sent again
        if values and widget.id in values and widget.id not in ("preset", "system_prompt"):
            widget.initial = values[widget.id]
    return widgets


PANEL = ("max_new_tokens", "temperature", "top_k", "top_p", "min_p", "repetition_penalty", "seed")


def read_settings(values: dict) -> tuple[ReplySettings, str | None]:
    """The panel's values as ReplySettings, each checked as any request's are (app.bounds' ranges); a
    value that is not one is left out (its default applies), and the note for the user names it."""
    given = {name: values.get(name) for name in PANEL if values.get(name) not in (None, "")}
    problems = []
    if "seed" in given:
        text = str(given.pop("seed")).strip()
        try:
            given["seed"] = int(text) if text else None
        except ValueError:
            problems.append(f"The seed must be a whole number, not “{text[:40]}”; replies use a random seed.")
    kept = {}
    for name, value in given.items():
        try:
            msgspec.convert({name: value}, ReplySettings, strict=False)
            kept[name] = value
        except msgspec.ValidationError as e:
            problems.append(f"The setting {name} = {str(value)[:40]} was left out ({str(e).split(' - at ')[0]}); "
                            "its default applies.")
    return msgspec.convert(kept, ReplySettings, strict=False), " ".join(problems) or None

