"""The web side's chat (app/backend/conversation.py)."""

from app.backend.conversation import Conversation
from app.messages import ChatMessage


def test_edit_truncates_at_the_message_id():
    conversation = Conversation()
    conversation.add("user", "one", id="u1")
    conversation.add("assistant", "two", id="a1")
    conversation.add("user", "three", id="u2")
    conversation.add("assistant", "four", id="a2")
    conversation.left_out = 4
    assert conversation.truncate("u2")
    assert [m.content for m in conversation.messages] == ["one", "two"] and conversation.left_out == 2
    assert not conversation.truncate("unknown")


def test_messages_for_the_engine_start_with_the_system_prompt_and_keep_reply_ids():
    conversation = Conversation(system_prompt="Be brief.")
    conversation.add("user", "Hi")
    conversation.add("assistant", "Hello!", ids=[9, 8])
    assert conversation.chat_messages() == [ChatMessage("system", "Be brief."), ChatMessage("user", "Hi"),
                                            ChatMessage("assistant", "Hello!", [9, 8])]
    assert Conversation().chat_messages() == []
