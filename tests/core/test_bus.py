"""The event bus isolates subscribers (one that raises is counted and logged, and the others
and the publisher go on) and runs handlers and commands to completion."""

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


class Pong:
    pass


def test_a_handler_runs_to_completion_before_what_it_publishes_is_delivered():
    bus, seen = Bus(), []

    def on_ping(event):
        seen.append("ping")
        bus.publish(Pong())
        bus.publish(Pong())
        seen.append("ping handled")

    bus.subscribe(Ping, on_ping)
    bus.subscribe(Pong, lambda e: seen.append("pong"))
    bus.publish(Ping())
    assert seen == ["ping", "ping handled", "pong", "pong"]


def test_a_command_s_events_wait_until_it_returns_in_order():
    bus, seen = Bus(), []
    bus.subscribe(Ping, lambda e: seen.append("ping"))
    bus.subscribe(Pong, lambda e: seen.append("pong"))
    with bus.running():
        bus.publish(Ping())
        with bus.running():  # nested: still the outer command's
            bus.publish(Pong())
        assert seen == []
        bus.publish(Ping())
        assert seen == []
    assert seen == ["ping", "pong", "ping"]
    bus.publish(Pong())  # nothing running: at once
    assert seen == ["ping", "pong", "ping", "pong"]
