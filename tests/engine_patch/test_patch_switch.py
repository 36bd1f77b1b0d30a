"""What a switch decision (and the engine's status) counts as running."""

from types import SimpleNamespace

from evinfra.engine_patch.switch import running_requests


def req(done: bool) -> SimpleNamespace:
    return SimpleNamespace(finished=lambda: done)


def test_a_request_that_finished_in_the_last_step_is_not_running():
    """It stays in the batch until the next step filters it; an idle engine answering a
    status or switch request between the two must say 0."""
    assert running_requests(SimpleNamespace(running_batch=None)) == 0
    assert running_requests(SimpleNamespace(running_batch=SimpleNamespace(reqs=[]))) == 0
    batch = SimpleNamespace(reqs=[req(True)])
    assert running_requests(SimpleNamespace(running_batch=batch)) == 0
    batch.reqs += [req(False), req(False)]
    assert running_requests(SimpleNamespace(running_batch=batch)) == 2
