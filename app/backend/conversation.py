"""A chat as the web side keeps it: its messages (each reply with the token ids it was generated
as, each user message with the files sent with it), its system prompt and model, and how many old
messages no longer fit the model's context.

The keys and values of a chat live in the engine's prefix cache, found again by the chat's token
ids, so nothing here holds model state: a Conversation is cheap to keep, copy and store.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from model.unicode import valid_unicode

from app.messages import Attachment, ChatMessage


@dataclass
class Message:
    role: str  # "user", "assistant" or "tool"
    content: str
    id: str | None = None  # the caller's id, to truncate the history at an edited message
    ids: list[int] | None = None  # a reply of the model's: the token ids it was generated as
    tool_calls: list[dict] | None = None  # an assistant's tool calls (the API)
    tool_call_id: str | None = None  # a tool result: the call it answers
    files: list[Attachment] | None = None  # a user message's files: their text, and the chunks the engine chose


@dataclass(eq=False)
class Conversation:
    model: str | None = None  # profile name; None: the backend's default
    system_prompt: str | None = None
    messages: list[Message] = field(default_factory=list)
    left_out: int = 0  # leading messages dropped from the prompt because they no longer fit

    def add(self, role: str, content: str, id: str | None = None, ids: list[int] | None = None,
            **tool_fields) -> Message:
        message = Message(role, content, id, ids, **tool_fields)
        self.messages.append(message)
        return message

    def index(self, message_id: str) -> int | None:
        return next((i for i, m in enumerate(self.messages) if m.id is not None and m.id == message_id), None)

    def message(self, message_id: str) -> Message | None:
        i = self.index(message_id)
        return None if i is None else self.messages[i]

    def truncate(self, message_id: str) -> bool:
        """Forget the message with this id and every later one (the user edited it); False if unknown."""
        i = self.index(message_id)
        if i is None:
            return False
        del self.messages[i:]
        self.left_out = min(self.left_out, len(self.messages))
        return True

    def chat_messages(self) -> list[ChatMessage]:
        """The system prompt and every message, as the engine and remote servers take them (as valid
        Unicode: half an emoji from a browser becomes U+FFFD, as the tokenizers read it anyway)."""
        system = [ChatMessage("system", valid_unicode(self.system_prompt))] if self.system_prompt else []
        return system + [ChatMessage(m.role, valid_unicode(m.content), m.ids, m.tool_calls, m.tool_call_id, m.files)
                         for m in self.messages]
