"""Building a chat's prompt in the engine (app/engine/prompt.py): what is left out when it no longer fits."""

from __future__ import annotations

import pytest
from support.checkpoints import write_tiny_checkpoint

from app.backend.conversation import Conversation
from app.engine.prompt import dialog, fit_prompt
from model.checkpoint import load_checkpoint
from model.context import PromptTooLong


@pytest.fixture(scope="module")
def chat_format(tmp_path_factory):
    return load_checkpoint(write_tiny_checkpoint(tmp_path_factory.mktemp("weights") / "tiny")).chat_format


def long_chat(turns: int, system: str = "You are a pirate.") -> Conversation:
    conversation = Conversation(system_prompt=system)
    for i in range(turns):
        conversation.add("user", f"Question {i}: " + "tell me more " * 20)
        conversation.add("assistant", f"Answer {i}: " + "here is more " * 20)
    conversation.add("user", f"Last question {turns}")
    return conversation


def test_trimming_keeps_the_system_prompt_and_the_newest_turns(chat_format):
    conversation = long_chat(10)
    ids, left_out = fit_prompt(chat_format, conversation.chat_messages(), 0, limit=512, max_new_tokens=128)
    text = chat_format.tokenizer.decode(ids)

    assert len(ids) <= 512 - 128
    assert left_out > 0 and left_out % 2 == 0  # whole exchanges, starting at a user message
    assert conversation.messages[left_out].role == "user"
    assert text.count("You are a pirate.") == 1
    assert "Last question 10" in text and "Answer 9:" in text
    assert "Question 0:" not in text and f"Question {left_out // 2 - 1}:" not in text
    assert f"Question {left_out // 2}:" in text
    # room to spare, so the next turns keep this prefix (and the cache)
    assert len(ids) <= (512 - 128) * 3 // 4
    # what was left out before stays out
    again, left_out_again = fit_prompt(chat_format, conversation.chat_messages(), left_out + 2, 512, 128)
    assert left_out_again == left_out + 2 and len(again) < len(ids)


def test_a_chat_that_fits_is_sent_whole_with_replies_as_their_ids(chat_format):
    conversation = long_chat(2)
    conversation.messages[1].ids = [11, 12, 13]
    ids, left_out = fit_prompt(chat_format, conversation.chat_messages(), 0, limit=4096, max_new_tokens=512)
    assert left_out == 0 and ids == chat_format.encode_dialog(dialog(conversation.chat_messages()))
    reply = chat_format.encode_message({"role": "assistant", "content": "ignored", "ids": [11, 12, 13]})
    assert any(ids[i:i + len(reply)] == reply for i in range(len(ids)))


def test_a_last_message_that_cannot_fit_is_too_long(chat_format):
    conversation = long_chat(0)
    conversation.messages[-1].content = "word " * 1000
    with pytest.raises(PromptTooLong, match="too long for this model.*256 tokens"):
        fit_prompt(chat_format, conversation.chat_messages(), 0, limit=256, max_new_tokens=64)


def test_a_system_prompt_that_leaves_no_room_is_named_as_what_is_too_long(chat_format):
    """A short message under a system prompt too long for the context: the note names the system prompt (it said
    "Your message is too long", of a two-word message)."""
    conversation = long_chat(0)
    conversation.system_prompt = "rule " * 1000
    conversation.messages[-1].content = "Say hi"
    with pytest.raises(PromptTooLong, match="The system prompt is too long for this model: it comes to 10[0-9]{2} "):
        fit_prompt(chat_format, conversation.chat_messages(), 0, limit=256, max_new_tokens=64)
    conversation.system_prompt = "Be brief."
    conversation.messages[-1].content = "word " * 1000
    with pytest.raises(PromptTooLong, match="Your message is too long"):  # the message is what is long
        fit_prompt(chat_format, conversation.chat_messages(), 0, limit=256, max_new_tokens=64)


def test_without_trimming_a_chat_that_does_not_fit_is_too_long(chat_format):
    conversation = long_chat(10)
    n = len(chat_format.encode_dialog(dialog(conversation.chat_messages())))
    with pytest.raises(PromptTooLong, match=f"The messages come to {n} tokens, and this model reads at most 512 "
                                            "tokens at once, 128 of them kept for the reply"):
        fit_prompt(chat_format, conversation.chat_messages(), 0, limit=512, max_new_tokens=128, trim=False)
    # one that fits is the same prompt as with trimming
    fits = long_chat(1)
    assert fit_prompt(chat_format, fits.chat_messages(), 0, 512, 128, trim=False) == \
        fit_prompt(chat_format, fits.chat_messages(), 0, 512, 128)
    # a lone message has nothing to leave out: it runs where it fits with a short reply, as with trimming
    alone = long_chat(0)
    alone.messages[-1].content = "word " * 300
    ids, left_out = fit_prompt(chat_format, alone.chat_messages(), 0, limit=512, max_new_tokens=400, trim=False)
    assert 256 < len(ids) <= 512 - 64 and left_out == 0


def test_a_chat_that_opens_with_the_assistant_keeps_its_opening(chat_format):
    conversation = Conversation(system_prompt="You are a pirate.")
    conversation.add("assistant", "Ahoy! What be yer question?")
    conversation.add("user", "Where is the treasure?")
    ids, left_out = fit_prompt(chat_format, conversation.chat_messages(), 0, limit=512, max_new_tokens=64)
    assert left_out == 0 and "Ahoy! What be yer question?" in chat_format.tokenizer.decode(ids)
    assert ids == chat_format.encode_dialog(dialog(conversation.chat_messages()))
