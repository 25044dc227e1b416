"""The hf engine's decode loop parks while a weight update's prepare runs (rollout.engines.hf_foreground):
at a module call, once per section, bounded."""

import threading

import torch

from rlsync.rollout.engines import hf_foreground
from rlsync.rollout.engines.hf_foreground import Foreground


def _model() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Sequential(torch.nn.Linear(4, 2)))


def test_hooks_go_on_modules_with_parameters_of_their_own():
    model = _model()
    handles = Foreground().attach(model)
    assert len(handles) == 2  # the two linear layers: not the ReLU, not the containers
    for h in handles:
        h.remove()


def test_no_section_no_wait():
    fg, model = Foreground(), _model()
    fg.attach(model)
    model(torch.ones(1, 4))
    assert fg.parked == 0.0


def test_a_forward_waits_for_the_open_section(monkeypatch):
    monkeypatch.setattr(hf_foreground, "MAX_PARK", 30.0)  # only the section's end lets it go
    fg, model = Foreground(), _model()
    fg.attach(model)
    entered, done = threading.Event(), threading.Event()
    model[0].register_forward_pre_hook(lambda *_: entered.set(), prepend=True)  # before the park
    with fg.section():
        worker = threading.Thread(target=lambda: (model(torch.ones(1, 4)), done.set()), daemon=True)
        worker.start()
        assert entered.wait(10)
        assert not done.wait(0.2)  # parked at the first linear layer
    assert done.wait(10)
    assert fg.parked > 0.1


def test_it_parks_once_per_section_and_for_max_park_at_most(monkeypatch):
    monkeypatch.setattr(hf_foreground, "MAX_PARK", 0.05)
    fg, model = Foreground(), _model()
    fg.attach(model)
    with fg.section():  # never ends while the forwards run (a section awaiting the engine thread)
        model(torch.ones(1, 4))
        first = fg.parked
        model(torch.ones(1, 4))  # the same section: no second wait
        assert fg.parked == first
    assert 0.04 < first < 5.0
    with fg.section():
        with fg.section():  # nested: one section until both end
            model(torch.ones(1, 4))
    assert fg.parked > first + 0.04  # a new section parks again
