"""A chat's messages -> the prompt's token ids, leaving out the oldest messages that no longer fit.

Runs in the engine, which has the tokenizer and knows each model's context limit; it reports what it
did with the reply (app.messages.Context), so the web side never counts tokens. A message's files
(app.files.prompt) are decided first (`choose_prompt_files`: whole, or which chunks), then rendered into
its content here, and count against the budget like any text.
"""

from __future__ import annotations

from model.context import PromptTooLong, prompt_budget

from app.files.prompt import choose_files, files_share, render, without_files
from app.messages import ChatMessage, FileUse

MIN_REPLY_TOKENS = 64  # a prompt must leave room for at least this many (or max_new_tokens) tokens


def dialog(messages: list[ChatMessage]) -> list[dict]:
    """As the chat formats take them (OpenAI's shape); a reply keeps the ids it was generated as, a message
    with files has them in its content (as their `chosen` says: choose_prompt_files decides it)."""
    return [{"role": m.role, "content": render(m),
             **{name: value for name in ("ids", "tool_calls", "tool_call_id") if (value := getattr(m, name)) is not None}}
            for m in messages]


def choose_prompt_files(chat_format, messages: list[ChatMessage], limit: int, max_new_tokens: int,
                        **tool_options) -> tuple[list[ChatMessage], list[FileUse]]:
    """The messages with their files decided (app.files.prompt.choose_files), and how the last user message's
    files went in (Context.files). A message's files may take files_share of the prompt's budget, less what
    the system prompt and the message's own text take: the rest is left for the chat around it."""
    n_system = next((i for i, m in enumerate(messages) if m.role != "system"), len(messages))
    share = files_share(limit, max_new_tokens)

    def room_for(message: ChatMessage) -> int:
        alone = dialog(messages[:n_system] + [without_files(message)])
        return share - len(chat_format.encode_dialog(alone, **tool_options))

    return choose_files(messages, room_for, lambda text: len(chat_format.tokenizer.encode(text)))


def fit_prompt(chat_format, messages: list[ChatMessage], left_out: int, limit: int, max_new_tokens: int,
               trim: bool = True, **tool_options) -> tuple[list[int], int]:
    """The prompt's ids, and how many leading non-system messages it leaves out (at least left_out).

    The prompt leaves room for the reply: max_new_tokens, but at most half the context. When it
    does not fit, whole exchanges are left out, oldest first, until the rest fits in three quarters
    of its room, so that the next replies keep the same prefix and reuse the cache. System messages
    and the last message always stay. Raises PromptTooLong when those alone leave no room for a reply,
    and, with trim False (OpenAI's clients expect an error, not a shortened conversation), when any
    message would have to be left out. tool_options (tools, tool_choice) go to the chat format.
    """
    n_system = next((i for i, m in enumerate(messages) if m.role != "system"), len(messages))
    system, chat = messages[:n_system], messages[n_system:]
    budget = prompt_budget(limit, max_new_tokens)
    last = len(chat) - 1
    # Where the prompt may start: where it started before (whatever the role of that message: a chat may
    # open with the assistant's greeting), later at a user message (whole exchanges go), at least the last.
    starts = sorted({min(left_out, last), last}
                    | {i for i, m in enumerate(chat) if left_out < i < last and m.role == "user"})
    encoded: dict[int, list[int]] = {}

    def encode(start: int) -> list[int]:
        if start not in encoded:
            encoded[start] = chat_format.encode_dialog(dialog(system + chat[start:]), **tool_options)
        return encoded[start]

    if len(encode(starts[0])) <= budget:
        return encode(starts[0]), starts[0]
    if not trim and len(starts) > 1:
        raise PromptTooLong(
            f"The messages come to {len(encode(starts[0]))} tokens, and this model reads at most {limit} tokens "
            f"at once, {limit - budget} of them kept for the reply (max_tokens, or the server's longest reply): "
            f"{budget} for the messages. Send fewer or shorter messages, or ask for a shorter reply.")

    def first_fitting(room: int) -> int:
        """The prompt shrinks as the start moves on: binary search for the first start that fits."""
        low, high = 0, len(starts)
        while low < high:
            middle = (low + high) // 2
            if len(encode(starts[middle])) <= room:
                high = middle
            else:
                low = middle + 1
        return low

    first = first_fitting(budget - budget // 4)
    if first >= len(starts) - 1:  # only the last message fits with room to spare: drop no more than needed
        first = first_fitting(budget)
    if first < len(starts):
        return encode(starts[first]), starts[first]
    ids = encode(last)
    if len(ids) + min(max_new_tokens, MIN_REPLY_TOKENS) > limit:
        alone = len(chat_format.encode_dialog(dialog(system), **tool_options)) if system else 0
        if alone > len(ids) - alone:  # the system prompt takes more than the message: name it
            raise PromptTooLong(
                f"The system prompt is too long for this model: it comes to {alone} tokens alone, and the model "
                f"reads at most {limit} tokens at once, the messages and the reply included. Please shorten "
                "the system prompt.")
        raise PromptTooLong(
            f"Your message is too long for this model: it comes to {len(ids)} tokens, and the model "
            f"reads at most {limit} tokens at once, its reply included. Please send a shorter message.")
    return ids, last
