"""A user message's files in its prompt: whole when they fit, else the chunks that best match the message.

Text in, text out, with the counting of tokens left to the caller: the engine counts with the model's
tokenizer (app.engine.prompt.choose_prompt_files), the remote backend, which has none, estimates
(app.backend.remote). The first time a message is sent its files' `chosen` is None, and `choose_files`
decides: every file whole if all of them fit in the files' room, else the chunks of all of them (app.files.chunks),
ranked with BM25 against the message's text, taken best first while they fit, and then put back in file
order. The room depends only on the model's context, the reply's share, the system prompt and the
message itself, so the same message decides the same way on every turn, also where nobody sends the
decision back (the API). The decision goes back to the web side in Context.files, which sends it with the
message from then on (`chosen` set): the message renders to the same text, the same tokens and the same
cached prefix every turn.

Files go before the message's text, each in a block that names it:

    <file name="notes.txt">
    ...the whole text...
    </file>

    <file name="report.pdf" excerpts="2 of 40">
    <excerpt where="pages 3-4">
    ...
    </excerpt>
    ...
    </file>

A file's text is content like any other: the chat formats tokenize content as plain text, so a file that
holds "<|eot_id|>" or "</file>" cannot end the message or the block for the model's tokenizer.
"""

from __future__ import annotations

import msgspec

from model.context import prompt_budget

from app.files.chunks import Chunk, chunks, rank
from app.messages import WHOLE, Attachment, ChatMessage, FileUse, Source

FILES_SHARE = 3 / 4  # of the prompt's budget, what one message's files may take: the rest is the chat's
CHARS_PER_TOKEN = 16  # more characters than this a token, in a whole file, does not occur: longer ones go in chunks


def files_share(limit: int, max_new_tokens: int) -> int:
    """The tokens one message's files may take in a prompt for this context and reply (the system prompt and the
    message's own text come off it)."""
    return int(prompt_budget(limit, max_new_tokens) * FILES_SHARE)


def render(message: ChatMessage) -> str:
    """The message's content as the model reads it: its files (as their `chosen` says; None: whole), then its text."""
    if not message.files:
        return message.content
    blocks = [_block(attachment, _chosen(attachment, attachment.chosen)) for attachment in message.files]
    return "\n\n".join(blocks + ([message.content] if message.content else []))


def choose_files(messages: list[ChatMessage], room_for, count) -> tuple[list[ChatMessage], list[FileUse]]:
    """The messages with every file's `chosen` set, and how the last user message's files went in.

    room_for(message): the tokens the message's files may take; count(text): tokens of a text.
    """
    last_user = max((i for i, m in enumerate(messages) if m.role == "user"), default=-1)
    decided, uses = [], []
    for i, message in enumerate(messages):
        if message.files and any(a.chosen is None for a in message.files):
            message, message_uses = _decide(message, room_for(message), count)
        elif message.files and i == last_user:
            message_uses = [_use(a, _chosen(a, a.chosen), count) for a in message.files]
        else:
            message_uses = []
        decided.append(message)
        if i == last_user:
            uses = message_uses
    return decided, uses


def without_files(message: ChatMessage) -> ChatMessage:
    return msgspec.structs.replace(message, files=None)


# ---- deciding -------------------------------------------------------------------------------------

def _decide(message: ChatMessage, room: int, count) -> tuple[ChatMessage, list[FileUse]]:
    """Files already decided keep their chunks; the rest go whole if all of them fit together, else by rank."""
    files = message.files
    fixed = {i: _chosen(a, a.chosen) for i, a in enumerate(files) if a.chosen is not None}
    used = sum(count(_block(files[i], chosen)) for i, chosen in fixed.items())
    open_ = [i for i in range(len(files)) if i not in fixed]
    whole_chars = sum(len(files[i].text) for i in open_)
    if whole_chars <= (room - used) * CHARS_PER_TOKEN:
        whole = {i: count(_block(files[i], WHOLE)) for i in open_}
        if used + sum(whole.values()) <= room:
            return _with(message, {**fixed, **{i: WHOLE for i in open_}}, count)
    # (file, chunk index, chunk) of every open file, ranked as one corpus: the best of all files go in
    pieces = [(i, k, chunk) for i in open_ for k, chunk in enumerate(chunks(files[i]))]
    taken: dict[int, list[int]] = {i: [] for i in open_}
    for best in rank([chunk for _, _, chunk in pieces], message.content):
        i, k, chunk = pieces[best]
        cost = count(_excerpt(chunk)) + (0 if taken[i] else count(_frame(files[i], 1, 1)))
        if used + cost > room:
            break  # (chunks are alike in size: what comes after would not fit either, mostly)
        used += cost
        taken[i].append(k)
    return _with(message, {**fixed, **{i: sorted(taken[i]) for i in open_}}, count)


def _with(message: ChatMessage, chosen: dict[int, list[int]], count) -> tuple[ChatMessage, list[FileUse]]:
    files = [msgspec.structs.replace(a, chosen=chosen[i]) for i, a in enumerate(message.files)]
    return msgspec.structs.replace(message, files=files), [_use(a, a.chosen, count) for a in files]


def _use(attachment: Attachment, chosen: list[int], count) -> FileUse:
    tokens = count(_block(attachment, chosen))
    if chosen == WHOLE:
        return FileUse(attachment.name, tokens, WHOLE)
    parts = chunks(attachment)
    return FileUse(attachment.name, tokens, chosen, len(parts),
                   [Source(attachment.name, parts[k].where, parts[k].text) for k in chosen])


def _chosen(attachment: Attachment, chosen: list[int] | None) -> list[int]:
    """WHOLE for None or WHOLE; else the chunk indices that exist, in file order (a history written by another
    version of the chunking may name more than there are)."""
    if chosen is None or chosen == WHOLE:
        return WHOLE
    n = len(chunks(attachment))
    return sorted({k for k in chosen if 0 <= k < n})


# ---- rendering ------------------------------------------------------------------------------------

def _block(attachment: Attachment, chosen: list[int]) -> str:
    if chosen == WHOLE:
        return f'<file name="{_quoted(attachment.name)}">\n{attachment.text.strip()}\n</file>'
    parts = chunks(attachment)
    head, tail = _frame(attachment, len(chosen), len(parts)).split("\n\n")
    return "\n".join([head, *(_excerpt(parts[k]) for k in chosen), tail])


def _frame(attachment: Attachment, used: int, total: int) -> str:
    return f'<file name="{_quoted(attachment.name)}" excerpts="{used} of {total}">\n\n</file>'


def _excerpt(chunk: Chunk) -> str:
    return f'<excerpt where="{chunk.where}">\n{chunk.text}\n</excerpt>'


def _quoted(name: str) -> str:
    return name.replace('"', "'")
