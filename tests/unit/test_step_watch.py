"""When the hf engine lets a copy armed beside generation go (rlsync.rollout.engines.hf_armed.StepWatch): a step
or command that runs far longer than the usual step, while a copy is guarded, has the watch write the copy's bell
with a value no trainer writes; an idle engine, a short step, or a copy no longer guarded never does. Pure logic
on the watch's clock, with a stand-in for the copy (what the watch reads of it: its bell's `write`)."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
from prometheus_client import REGISTRY

from rlsync.rollout.engines.hf_armed import CANCELLED, StepWatch


def _armed() -> SimpleNamespace:
    writes: list[int] = []
    return SimpleNamespace(bell=SimpleNamespace(write=writes.append), writes=writes)


def _until(condition, seconds: float = 30.0) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "the watch never acted"
        time.sleep(0.005)


def test_a_step_that_runs_far_longer_than_usual_lets_the_guarded_copy_go_once():
    watch, armed = StepWatch(), _armed()
    counted = REGISTRY.get_sample_value("rlsync_replica_armed_copies_total", {"outcome": "let_go"}) or 0
    watch.guard(armed)
    watch.began()  # ... and never ends: a launch waiting behind the copy
    _until(lambda: watch.let_go)
    assert REGISTRY.get_sample_value("rlsync_replica_armed_copies_total", {"outcome": "let_go"}) == counted + 1
    assert armed.writes == [CANCELLED] and CANCELLED >= 1 << 30  # (a trainer's bell values stay below 1 << 30)
    assert watch.let_go == 1
    assert not watch.take(armed), "let go: an offer must not adopt it"
    time.sleep(3 * watch.patience())
    assert armed.writes == [CANCELLED]  # written once


def test_an_idle_engine_or_a_copy_taken_back_is_never_let_go():
    watch, idle, taken = StepWatch(floor=0.001), _armed(), _armed()
    watch.guard(idle)  # no step running: nothing can wait behind it here
    time.sleep(0.1)
    assert idle.writes == [] and watch.take(idle)
    watch.guard(taken)
    assert watch.take(taken)  # (an offer adopted it) ...
    watch.began()
    time.sleep(0.1)  # ... so a long step after that writes nothing
    assert taken.writes == [] and watch.let_go == 0


def test_only_steps_set_the_usual_time_and_the_patience_has_a_floor():
    watch = StepWatch(floor=0.02)  # (the hf engine's arm_patience_ms)
    watch.began()
    time.sleep(0.05)
    watch.ended(step=False)  # a command (a sleep, a hold): not a step's time
    assert watch.usual == pytest.approx(0.02)
    watch.began()
    time.sleep(0.05)
    watch.ended()
    assert watch.usual > 0.02 and watch.patience() == pytest.approx(StepWatch.FACTOR * watch.usual)
    assert watch.patience() >= 0.02 and StepWatch(floor=2.0).patience() >= 2.0


def test_what_ran_before_the_copy_was_armed_is_not_held_against_it():
    """The commit that arms the copy is a command of the engine's thread, timed as such: only what runs after the
    watch began to guard counts."""
    watch, armed = StepWatch(), _armed()
    watch.began()
    time.sleep(3 * watch.patience())  # a long commit (a KV recompute, say) ...
    watch.guard(armed)  # ... that arms the copy at its end
    watch.ended(step=False)
    time.sleep(watch.patience())
    assert armed.writes == [] and watch.take(armed)
