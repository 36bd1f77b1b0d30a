"""The event bus isolates subscribers: one that raises is counted and logged, and the others
and the publisher go on."""

from evinfra.core.bus import Bus


class Ping:
    pass


def test_a_raising_subscriber_is_counted_logged_and_isolated(logs):
    bus, seen = Bus(), []

    def broken(event):
        raise KeyError("boom")

    bus.subscribe(Ping, seen.append)
    bus.subscribe(Ping, broken)
    bus.subscribe(Ping, seen.append)
    bus.publish(Ping())  # must not raise
    bus.publish(Ping())
    assert len(seen) == 4 and bus.errors == 2
    failed = [e for e in logs if e["event"] == "bus_subscriber_failed"]
    assert len(failed) == 2 and failed[0]["event_type"] == "Ping"
    assert "broken" in failed[0]["handler"]
