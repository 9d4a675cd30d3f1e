"""Files in the chat: what the page lets users attach, a message's files read into text (or refused, saying
why), the line under a reply that tells how much of each file the model read, and a stored message's files.

Chainlit uploads a file (the clip button, or dropped on the page) before the message is sent, within the
limits `upload_feature()` gives it: the kinds and sizes app.files.read takes. The message then comes with
one element per file; `read()` reads each with app.files.read, and a message with a file it refuses is not
sent to the model at all (as ChatGPT does): the chat says which file and why.

The engine decides how much of a file goes into the prompt (the whole text, or the chunks nearest the
question) and reports it in Done.context.files; `with_chosen()` keeps that decision in the conversation, so
later turns send the file as it went the first time, and `note()` shows it under the reply, each chunk a
source to open. With history on, a message's files are recorded in its step's metadata (name, size,
pages, chosen, the element that holds the file) and their text in the file store (app.web.file_store):
`stored_files()` gives them back to a resumed chat.

On the page, a message's files are a row of chips, each with the file's name, kind, size and pages
(public/elements/FileChips.jsx): a PDF opens beside the chat when its chip is clicked, another file
downloads. Chainlit would show each upload inline, a PDF as its first page as wide as a reply: `show()` turns
the uploads of a live message into elements shown only on demand ("page") and sends the chips;
`shown_as_chips()` does the same to a stored chat as the page gets it.
"""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path

import chainlit as cl
import msgspec
from chainlit.config import SpontaneousFileUploadFeature

from app.bounds import MAX_FILE_BYTES, MAX_FILES
from app.files.read import (
    ACCEPTED_EXTENSIONS,
    ACCEPTED_MIME,
    READERS,
    FileRefused,
    check_together,
    clean_name,
    read_deadline,
    read_file,
)
from app.messages import WHOLE, Attachment, FileUse
from app.web.file_store import FileStore
from app.web.uploads import KEEP_SECONDS

FILES = "files"  # the key of a user message's files in its step's metadata
FILE_CHIPS = "FileChips"  # the custom element in public/elements/ that shows a message's files
PROSE = (".md", ".markdown", ".txt", ".text", ".pdf", ".rst")  # sources shown as Markdown; others as code


def upload_feature() -> SpontaneousFileUploadFeature:
    """What the page accepts: the extensions app.files.read reads, whatever type the browser names (a code
    file often has none, or a wrong one: .ts is "video/mp2t"), and the types it names for them; as many
    files and as large as a message may carry. (Chainlit's page counts a megabyte as 10^6 bytes, its
    server and app.files.read as 2^20: the page refuses first, saying "larger than 20 MB".)"""
    accept = {mime: [] for mime in ACCEPTED_MIME} | {"*/*": list(ACCEPTED_EXTENSIONS)}
    return SpontaneousFileUploadFeature(enabled=True, accept=accept, max_files=MAX_FILES,
                                        max_size_mb=MAX_FILE_BYTES // 2**20)


# ---- a message's files --------------------------------------------------------------------------

class Refused(Exception):
    """Files of a message that cannot be sent; str(): the note for the user."""

    def __init__(self, problems: list[FileRefused]):
        self.problems = problems
        lines = [f"- **{p.name}**: {p.problem}" for p in problems]
        super().__init__("Your message was not sent to the model: "
                         + ("this file cannot be read" if len(problems) == 1 else "these files cannot be read")
                         + ".\n\n" + "\n".join(lines)
                         + "\n\nSend it again without " + ("it" if len(problems) == 1 else "them")
                         + ", or with a file that can be read.")


async def read(elements: list) -> list[Attachment]:
    """The files of a message's elements (as uploaded: each with a path, or made with content), read on the
    file readers' threads (a PDF can take a while); Refused names every file that cannot be sent, and why."""
    if len(elements) > MAX_FILES:
        raise Refused([FileRefused(f"{len(elements)} files", f"at most {MAX_FILES} files can be sent with "
                                                             "one message.")])
    files, problems, deadline = [], [], read_deadline()
    for element in elements:
        try:
            files.append(await asyncio.get_running_loop().run_in_executor(READERS, _read, element, deadline))
        except FileRefused as e:
            problems.append(e)
    if problems:
        raise Refused(problems)
    try:
        check_together(files)
    except FileRefused as e:
        raise Refused([e]) from None
    return files


def _read(element, deadline: float) -> Attachment:
    if element.path:
        try:
            data = Path(element.path).read_bytes()
        except FileNotFoundError:  # (app.web.uploads deleted it)
            minutes = f"{KEEP_SECONDS / 60:.0f}"
            raise FileRefused(clean_name(element.name), f"the upload is gone (a file not sent within {minutes} "
                                                        "minutes of its upload is deleted, as is one a message was "
                                                        "refused for); attach it again.") from None
        except OSError as e:
            raise FileRefused(clean_name(element.name), f"the upload could not be read ({e.strerror}); "
                                                        "attach it again.") from None
    elif element.content is not None:
        data = element.content.encode() if isinstance(element.content, str) else bytes(element.content)
    else:
        raise FileRefused(clean_name(element.name), "it is a link, not an uploaded file.")
    return read_file(element.name, data, deadline)


def over_quota(files: list[Attachment], used: int, limit_mb: int) -> str | None:
    """The note for the user when storing files (their bytes and their text) would take the files of the user's
    chats (used bytes) past LLAMA_MAX_USER_FILES_MB; None when they fit."""
    adding = sum(file.size + len(file.text.encode()) for file in files)
    if used + adding <= limit_mb * 2**20:
        return None
    return (f"Your message was not sent to the model: its files ({megabytes(adding)}, with their text) would take "
            f"the files kept with your chats past your limit: they hold {megabytes(used)} of at most "
            f"{limit_mb:,} MB. Delete chats you no longer need (in the sidebar) to make room, then send it again.")


def megabytes(size: int) -> str:
    return f"{size / 2**20:,.1f} MB"


def with_chosen(files: list[Attachment], uses: list[FileUse]) -> list[Attachment]:
    """The files with the chunks the engine chose for them (its report names them in the same order)."""
    if len(uses) != len(files) or any(use.name != file.name for file, use in zip(files, uses)):
        return files
    return [msgspec.structs.replace(file, chosen=use.chosen) for file, use in zip(files, uses)]


# ---- under the reply ----------------------------------------------------------------------------

def note(uses: list[FileUse]) -> tuple[str, list[cl.Text]]:
    """A line per file (its tokens in the prompt; the parts taken when it did not fit whole) and the parts
    taken, as side elements: the page links each one's name in the line, and opens it beside the chat."""
    lines, sources = [], []
    for use in uses:
        if use.chosen == WHOLE:
            lines.append(f"*{use.name}: {use.tokens:,} tokens, the whole file*")
        elif not use.chosen:
            lines.append(f"*{use.name}: not read, no room was left in the model's context*")
        else:
            names = source_names(use)
            taken = (f"all of it, in {plural(len(use.chosen), 'part')}" if len(use.chosen) == use.chunks
                     else f"{len(use.chosen)} of its {use.chunks} parts, those nearest the question")
            lines.append(f"*{use.name}: {use.tokens:,} tokens, {taken}:* " + " · ".join(names))
            sources += [cl.Text(name=name, content=shown_source(name, use.name, source.text), display="side")
                        for name, source in zip(names, use.sources)]
    return "  \n".join(lines), sources


def shown_source(name: str, file: str, text: str) -> str:
    """A source as the side panel shows it: its name on top (Chainlit opens every source of the chat there at
    once after a reply, under the last one's title), then the text as the model read it: Markdown for prose,
    a code block for code and data."""
    extension = Path(file).suffix.lower()
    if extension in PROSE:
        return f"**{name}**\n\n{text}"
    fence = "`" * max(3, 1 + max((len(run) for run in re.findall("`+", text)), default=0))
    return f"**{name}**\n\n{fence}{extension[1:]}\n{text}\n{fence}"


def source_names(use: FileUse) -> list[str]:
    """Each source's name: "report.pdf, pages 3-4"; where two parts are on the same page (or lines), with
    their number: "report.pdf, page 1, part 1 of 26". (The page opens a side element by its name.)"""
    wheres = [source.where for source in use.sources]
    return [f"{use.name}, {where}" + (f", part {k + 1} of {use.chunks}" if wheres.count(where) > 1 else "")
            for k, where in zip(use.chosen, wheres)]


def plural(n: int, noun: str) -> str:
    return f"{n} {noun}" + ("" if n == 1 else "s")


# ---- on the page --------------------------------------------------------------------------------

async def show(message: cl.Message, files: list[Attachment] | None = None) -> None:
    """Show a live user message's uploads as chips: at once (name, kind, size), and again with their pages
    once they are read (files, in the order of the uploads)."""
    uploads = [element for element in message.elements if element.type != "custom"]
    if not uploads:
        return
    for element in uploads:
        if element.display != "page":
            element.display = "page"  # not inline: the chip opens it
            await element.send(for_id=message.id, persist=False)  # (stored as it came: shown_as_chips() reads it)
    read = files if files is not None and len(files) == len(uploads) else [None] * len(uploads)
    chips = [chip(element.id, element.name, file.size if file else upload_size(element), file.pages if file else 0)
             for element, file in zip(uploads, read)]
    await cl.CustomElement(id=chips_id(message.id), name=FILE_CHIPS, display="inline",
                           props={"files": chips}).send(for_id=message.id, persist=False)


def shown_as_chips(thread: dict) -> dict:
    """A stored chat as the page is to show it: the files of its user messages as chips (with what their steps
    recorded of them), the uploads themselves shown on demand."""
    elements = thread.get("elements") or []
    for step in thread.get("steps") or []:
        uploads = [e for e in elements if e.get("forId") == step.get("id") and e.get("type") != "custom"]
        if step.get("type") != "user_message" or not uploads:
            continue
        recorded = {str(entry.get("element")): entry for entry in metadata_of(step.get("metadata")).get(FILES) or []
                    if isinstance(entry, dict)}
        chips = []
        for element in uploads:
            element["display"] = "page"
            entry = recorded.get(element.get("id"), {})
            size, pages = entry.get("size"), entry.get("pages")
            chips.append(chip(element.get("id"), element.get("name") or "file",
                              size if isinstance(size, int) else None, pages if isinstance(pages, int) else 0))
        elements.append({"id": chips_id(step["id"]), "threadId": thread.get("id"), "type": "custom",
                         "name": FILE_CHIPS, "display": "inline", "forId": step["id"], "mime": "application/json",
                         "props": {"files": chips}})
    thread["elements"] = elements
    return thread


def chip(element_id: str, name: str, size: int | None, pages: int) -> dict:
    """One file's chip: the element it opens, its name, and "PDF · 12 pages · 1.4 MB"."""
    kind = Path(name).suffix[1:].upper() or "File"
    details = [kind] + ([plural(pages, "page")] if pages else []) + ([file_size(size)] if size is not None else [])
    return {"element": element_id, "name": name, "details": " · ".join(details)}


def chips_id(message_id: str) -> str:
    return f"{message_id}-files"


def upload_size(element) -> int | None:
    """An upload's bytes: its file's (as uploaded), or its content's; None when neither is there."""
    try:
        if element.path:
            return Path(element.path).stat().st_size
    except OSError:
        return None
    content = element.content
    return None if content is None else len(content.encode() if isinstance(content, str) else content)


def file_size(size: int) -> str:
    """812 bytes, 12 KB, 1.4 MB (2^10 bytes a kilobyte, as app.files.read counts)."""
    if size < 2**10:
        return plural(size, "byte")
    if size < 2**20:
        return f"{size / 2**10:.0f} KB"
    return f"{size / 2**20:.1f} MB"


# ---- stored with the chat -----------------------------------------------------------------------

def record(files: list[Attachment], element_ids: list[str]) -> list[dict]:
    """What a user message's step keeps of its files (their text is in the file store, by element)."""
    return [{"element": element_id, "name": file.name, "size": file.size, "pages": file.pages,
             "chosen": file.chosen} for file, element_id in zip(files, element_ids)]


async def keep(message: cl.Message, files: list[Attachment], store: FileStore) -> None:
    """Record the files in the message's step, their text in the store the first time; again when the engine
    has chosen what of them to read. (An edited message of a resumed chat has no elements: its records
    name them.)"""
    metadata = metadata_of(message.metadata)
    kept = metadata.get(FILES) or []
    element_ids = [element.id for element in message.elements] or [str(entry.get("element")) for entry in kept]
    if not kept:
        for file, element_id in zip(files, element_ids):
            await asyncio.to_thread(store.write_text, element_id, file.text)
    records = record(files, element_ids)
    if records != kept:
        message.metadata = {**metadata, FILES: records}
        await message.update()


def stored_files(step: dict, store: FileStore | None, elements: list[dict]) -> list[Attachment] | None:
    """The files of a stored user message, as they went to the model: those its record names that are files
    of this message in its chat (`elements`: the chat's element rows, id and forId), never an element the
    record names that is not; those whose text is gone (or whose record is not one) are left out."""
    records = metadata_of(step.get("metadata")).get(FILES)
    if not isinstance(records, list) or store is None:
        return None
    own = {element.get("id") for element in elements if element.get("forId") == step.get("id")}
    files = []
    for entry in records:
        if not isinstance(entry, dict) or entry.get("element") not in own:
            continue
        if (text := store.read_text(str(entry["element"]))) is None:
            continue
        fields = {key: entry[key] for key in ("name", "size", "pages", "chosen") if entry.get(key) is not None}
        try:
            files.append(msgspec.convert({**fields, "text": text}, Attachment))
        except msgspec.ValidationError:
            continue
    return files or None


def client_metadata(metadata) -> dict:
    """A message's metadata as the page sent it, less its files' records, which the app writes: a client
    that names another chat's file there gets nothing of it."""
    return {key: value for key, value in metadata_of(metadata).items() if key != FILES}


def metadata_of(metadata) -> dict:
    """A step's metadata as a dict (the database gives it as JSON text)."""
    if isinstance(metadata, str):
        try:
            metadata = json.loads(metadata)
        except json.JSONDecodeError:
            return {}
    return metadata if isinstance(metadata, dict) else {}
