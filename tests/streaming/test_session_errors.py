"""A session's bad input: the errors it raises and the state it is left in."""

from __future__ import annotations

import numpy as np
import pytest
from session_harness import Driver, s16, silence, tone

from captiond.errors import BadAudioError, BadMessageError
from captiond.streaming.events import Control
from captiond.streaming.session import SessionState


def test_audio_after_end_is_a_protocol_error() -> None:
    driver = Driver()
    driver.send(silence(0.3))
    driver.control(Control.END)
    with pytest.raises(BadMessageError):
        driver.session.receive_audio(s16(silence(0.1)))
    with pytest.raises(BadMessageError):
        driver.session.receive_samples(silence(0.1))


@pytest.mark.parametrize("control", [Control.END, Control.FINALIZE])
def test_control_after_end_is_a_protocol_error(control: Control) -> None:
    driver = Driver()
    driver.control(Control.END)
    with pytest.raises(BadMessageError):
        driver.session.receive_control(control)


def test_keepalive_after_end_is_accepted() -> None:
    """As the protocol page says: a client's keepalive timer may tick while it waits for the
    last finals and `done`; only audio, `finalize` and `end` after `end` are errors."""
    driver = Driver()
    session = driver.session
    session.receive_audio(s16(np.concatenate([silence(0.5), tone(1.5)])))
    session.receive_control(Control.END)
    assert session.state is SessionState.ENDING
    assert not session.receive_control(Control.KEEPALIVE)
    driver.pump()
    assert session.state is SessionState.DONE
    assert not session.receive_control(Control.KEEPALIVE)


def test_audio_after_end_while_still_flushing_is_an_error() -> None:
    driver = Driver()
    session = driver.session
    session.receive_audio(s16(np.concatenate([silence(0.5), tone(1.5)])))
    request = session.next_request()
    assert request is not None
    session.receive_control(Control.END)
    assert session.state is SessionState.ENDING
    with pytest.raises(BadMessageError):
        session.receive_audio(s16(silence(0.1)))


def test_odd_byte_count_is_bad_audio() -> None:
    driver = Driver()
    with pytest.raises(BadAudioError):
        driver.session.receive_audio(b"\x00\x01\x02")
