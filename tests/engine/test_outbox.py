"""app/engine/outbox.py: which events the engine sends at once, which wait, and how waiting ones are joined."""

import app.engine.outbox
from app.messages import Done, EngineStats, Failed, Queued, Text, TokenLogprob
from app.engine.outbox import Outbox


def test_a_replys_first_piece_goes_at_once_later_ones_wait_for_the_interval(monkeypatch):
    now = [100.0]
    monkeypatch.setattr(app.engine.outbox.time, "monotonic", lambda: now[0])
    outbox = Outbox(interval=0.05)
    outbox.add(Text("a", "Hel"))
    assert outbox.due()
    assert outbox.take() == [Text("a", "Hel")]
    outbox.add(Text("a", "lo"))
    outbox.add(EngineStats(running=1, kv_cache_bytes=10))
    now[0] += 0.049
    assert not outbox.due()
    now[0] += 0.002
    assert outbox.due()
    assert outbox.take() == [Text("a", "lo"), EngineStats(running=1, kv_cache_bytes=10)]
    assert not outbox.due()


def test_an_idle_engine_sends_what_waits():
    outbox = Outbox(interval=60)
    outbox.add(Text("a", "x"))
    outbox.take()
    outbox.add(Text("a", "y"))
    assert not outbox.due()
    assert outbox.due(idle=True)


def test_every_other_event_goes_at_once():
    for event in (Done("a", "xy", "stop"), Failed("a", "boom", "error"), Queued("b", 2)):
        outbox = Outbox(interval=60)
        outbox.add(Text("a", "x"))
        outbox.take()
        outbox.add(Text("a", "y"))
        outbox.add(event)
        assert outbox.due()
        assert outbox.take() == [Text("a", "y"), event]


def test_pieces_of_each_reply_are_joined_in_order_and_only_the_latest_stats_go():
    outbox = Outbox(interval=60)
    first, second = TokenLogprob("a", [97], -0.5), TokenLogprob("b", [98], -0.25)
    events = [Text("a", "one ", logprobs=[first]), Text("b", "uno "), EngineStats(running=2, kv_cache_bytes=1),
              Text("a", "two", logprobs=[second]), Text("b", "dos"), Text("b", "!", index=1),
              EngineStats(running=2, kv_cache_bytes=2)]
    for event in events:
        outbox.add(event)
    assert outbox.take() == [Text("a", "one two", logprobs=[first, second]), Text("b", "uno dos"),
                             Text("b", "!", index=1), EngineStats(running=2, kv_cache_bytes=2)]


def test_pieces_are_not_joined_across_another_event_of_their_request():
    outbox = Outbox(interval=60)
    for event in (Text("a", "x"), Done("a", "x", "stop"), Text("a", "y", index=1), Text("b", "p"),
                  Queued("b", 0), Text("b", "q"), Text("a", "z", index=1)):
        outbox.add(event)
    assert outbox.take() == [Text("a", "x"), Done("a", "x", "stop"), Text("a", "yz", index=1), Text("b", "p"),
                             Queued("b", 0), Text("b", "q")]


def test_a_request_that_ended_gets_its_next_first_piece_at_once():
    outbox = Outbox(interval=60)
    outbox.add(Text("a", "x"))
    outbox.add(Done("a", "x", "stop"))
    outbox.take()
    outbox.add(Text("a", "again"))  # a request id the web side reused: a new reply's first piece
    assert outbox.due()
