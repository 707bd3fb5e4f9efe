"""The agent's lifecycle table: plain state, no socket, no event loop."""

from __future__ import annotations

import pytest

from worker.errors import InvalidTransition, WorkerError
from worker.lifecycle import Lifecycle, Phase


def registered() -> Lifecycle:
    lifecycle = Lifecycle()
    lifecycle.dial()
    lifecycle.welcome()
    return lifecycle


def test_a_new_lifecycle_is_starting_and_takes_no_job() -> None:
    lifecycle = Lifecycle()
    assert lifecycle.phase is Phase.STARTING
    assert not lifecycle.accepting and not lifecycle.connected and not lifecycle.stopping


def test_a_connection_goes_connecting_registered_draining_backoff_and_dials_again() -> None:
    lifecycle = Lifecycle()
    lifecycle.dial()
    assert lifecycle.phase is Phase.CONNECTING and not lifecycle.accepting
    lifecycle.welcome()
    assert lifecycle.phase is Phase.REGISTERED
    assert lifecycle.accepting and lifecycle.connected
    lifecycle.drain()
    assert lifecycle.phase is Phase.DRAINING
    assert not lifecycle.accepting and not lifecycle.connected
    lifecycle.disconnected()
    assert lifecycle.phase is Phase.BACKOFF
    lifecycle.dial()
    assert lifecycle.phase is Phase.CONNECTING


def test_a_failed_dial_goes_straight_to_backoff_and_a_failed_hello_drains_first() -> None:
    dial_failed = Lifecycle()
    dial_failed.dial()
    dial_failed.disconnected()
    assert dial_failed.phase is Phase.BACKOFF
    hello_failed = Lifecycle()
    hello_failed.dial()
    hello_failed.drain()
    assert hello_failed.phase is Phase.DRAINING
    hello_failed.disconnected()
    assert hello_failed.phase is Phase.BACKOFF


def test_stop_drains_a_registered_connection_at_once() -> None:
    lifecycle = registered()
    lifecycle.stop()
    assert lifecycle.stopping
    assert lifecycle.phase is Phase.DRAINING and not lifecycle.accepting
    lifecycle.drain()  # the teardown that follows confirms it
    assert lifecycle.phase is Phase.DRAINING
    lifecycle.disconnected()
    lifecycle.finish()
    assert lifecycle.phase is Phase.STOPPED and lifecycle.stopping


def test_a_welcome_after_stop_drains_instead_of_registering() -> None:
    lifecycle = Lifecycle()
    lifecycle.dial()
    lifecycle.stop()
    assert lifecycle.phase is Phase.CONNECTING  # the agent aborts the dial itself
    lifecycle.welcome()
    assert lifecycle.phase is Phase.DRAINING and not lifecycle.accepting


@pytest.mark.parametrize("phase_steps", [(), ("dial",), ("dial", "welcome"), ("dial", "drain")])
def test_finish_ends_every_live_state(phase_steps: tuple[str, ...]) -> None:
    lifecycle = Lifecycle()
    for step in phase_steps:
        getattr(lifecycle, step)()
    lifecycle.finish()
    assert lifecycle.phase is Phase.STOPPED


@pytest.mark.parametrize(
    ("steps", "refused"),
    [
        ((), "welcome"),
        ((), "drain"),
        ((), "disconnected"),
        (("dial",), "dial"),
        (("dial", "welcome"), "welcome"),
        (("dial", "welcome"), "disconnected"),
        (("dial", "disconnected"), "drain"),
        (("finish",), "dial"),
        (("finish",), "finish"),
    ],
)
def test_a_step_the_state_forbids_is_refused_and_changes_nothing(
    steps: tuple[str, ...], refused: str
) -> None:
    lifecycle = Lifecycle()
    for step in steps:
        getattr(lifecycle, step)()
    before = lifecycle.phase
    with pytest.raises(InvalidTransition, match=f"no '{refused}' from {before.value}"):
        getattr(lifecycle, refused)()
    assert lifecycle.phase is before
    assert issubclass(InvalidTransition, WorkerError)


def test_stop_after_the_end_only_records_it() -> None:
    lifecycle = Lifecycle()
    lifecycle.finish()
    lifecycle.stop()
    assert lifecycle.phase is Phase.STOPPED and lifecycle.stopping
    assert repr(lifecycle) == "Lifecycle(stopped, stopping)"
