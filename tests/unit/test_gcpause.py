"""ocrq.output.gcpause: the collector is off inside, and left as it was found."""

from __future__ import annotations

import gc

import pytest

from ocrq.output import gcpause


@pytest.fixture(autouse=True)
def _restore_gc():
    was = gc.isenabled()
    yield
    (gc.enable if was else gc.disable)()


def test_the_collector_is_off_inside_and_back_on_after_even_on_an_error():
    gc.enable()
    with gcpause.paused():
        assert not gc.isenabled()
    assert gc.isenabled()
    with pytest.raises(ValueError), gcpause.paused():
        raise ValueError("a bad document")
    assert gc.isenabled()


def test_an_inner_pause_leaves_it_to_the_outer_one_and_a_process_that_turned_it_off_keeps_it_off():
    gc.enable()
    with gcpause.paused():
        with gcpause.paused():
            pass
        assert not gc.isenabled()  # the inner one did not turn it back on under the outer one
    assert gc.isenabled()
    gc.disable()
    with gcpause.paused():
        pass
    assert not gc.isenabled()
