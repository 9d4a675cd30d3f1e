"""Replies as the page shows them with LaTeX on (app/web/display.py): money escaped, math and code untouched."""

from __future__ import annotations

import pytest

from app.web.display import Paced, ShownStream, plain, shown
from app.web.history import REPLY, conversation_from_steps


@pytest.mark.parametrize("written, expected", [
    ("It costs $5 and $10.", r"It costs \$5 and \$10."),
    ("Range $5-$10, then $1,200.50, up to $3M/year or $2bn!",
     r"Range \$5-\$10, then \$1,200.50, up to \$3M/year or \$2bn!"),
    ("Math stays: $x^2$, $2^n$, $$\\int_0^1 x\\,dx$$ and $5$ alone",
     "Math stays: $x^2$, $2^n$, $$\\int_0^1 x\\,dx$$ and $5$ alone"),
    ("Use `$5` in code, pay $5.", r"Use `$5` in code, pay \$5."),
    ("```python\nprice = '$5'  # $10\n```\nThat is $5.\n", "```python\nprice = '$5'  # $10\n```\nThat is \\$5.\n"),
    ("~~~\n$5\n~~~\n$6", "~~~\n$5\n~~~\n\\$6"),
    ("````\n```\n$5\n````\n$6", "````\n```\n$5\n````\n\\$6"),  # a longer fence holds a shorter one
    (r"Already \$5", r"Already \$5"),
])
def test_money_is_escaped_outside_code_and_math_is_left_alone(written, expected):
    assert shown(written) == expected
    if "\\$" not in written:
        assert plain(expected) == written


def test_an_unclosed_fence_keeps_the_rest_as_code():
    assert shown("Look:\n```\ncost = $5\n") == "Look:\n```\ncost = $5\n"


def test_streaming_holds_back_an_amount_until_it_ends_and_resends_when_a_span_closes():
    stream = ShownStream()
    assert stream.feed("Pay $") == ("Pay ", False)
    assert stream.feed("1") == ("", False)
    assert stream.feed("0 now") == ("\\$10 now", False)
    assert stream.feed(" `$5") == (" `", False)
    assert stream.feed("` ok") == ("$5` ok", False)  # in a code span: not escaped
    assert stream.end() == "Pay \\$10 now `$5` ok"
    shown_so_far, whole = "", False
    stream = ShownStream()
    for piece in ["`a` and ", "$5 ", "x`"]:  # "$5 " is prose until the last backtick... which opens a span
        text, whole = stream.feed(piece)
        shown_so_far = text if whole else shown_so_far + text
    assert shown_so_far == shown("`a` and $5 x`")


def test_pieces_are_sent_at_most_every_interval_and_add_up_to_the_text(monkeypatch):
    now = [100.0]
    monkeypatch.setattr("app.web.display.time.monotonic", lambda: now[0])
    paced, page = Paced(every=0.1), []

    def feed(piece: str, whole: bool = False, dt: float = 0.03) -> None:
        now[0] += dt
        paced.add(piece, whole)
        if paced.due():
            text, replace = paced.take()
            page[:] = [text] if replace else page + [text]

    feed("The first piece goes at once")
    assert page == ["The first piece goes at once"]
    for piece in [", then", " the next", " wait"]:  # 0.04 s apart: held until 0.1 s passed
        feed(piece, dt=0.04)
    assert page == ["The first piece goes at once", ", then the next wait"]
    feed("REPLACED", whole=True)  # a whole text held replaces what was held with it, and is sent as whole
    feed(" and more")
    feed(" still", dt=0.1)
    assert page == ["REPLACED and more still"]
    assert not paced.due()  # nothing held


def test_a_resumed_chat_gives_the_model_its_reply_as_written():
    steps = [{"type": "user_message", "output": "Price?", "id": "u"},
             {"type": "assistant_message", "output": shown("It is $5; in code `$5`."), "metadata": {"kind": REPLY}}]
    conversation = conversation_from_steps(steps, model="m", system_prompt=None)
    assert conversation.messages[1].content == "It is $5; in code `$5`."


def test_a_resumed_chat_leaves_out_the_apps_commands():
    steps = [{"type": "user_message", "output": "/models", "id": "c1"},
             {"type": "user_message", "output": "", "command": "Export", "id": "c2"},
             {"type": "user_message", "output": "Price?", "id": "u"},
             {"type": "assistant_message", "output": "Five.", "metadata": {"kind": REPLY}},
             {"type": "user_message", "output": " /EXPORT ", "id": "c3"}]
    conversation = conversation_from_steps(steps, model="m", system_prompt=None)
    assert [(m.role, m.content) for m in conversation.messages] == [("user", "Price?"), ("assistant", "Five.")]
