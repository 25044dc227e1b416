"""The control plane first: while a weight update's prepare runs its Python on the replica's event
loop, the hf engine's decode thread parks at its next module call instead of sharing the GIL.

The hf engine decodes in the rollout service's own process, on a thread whose steps are mostly Python
launching kernels (a step of 32 sequences of a 1.7B model: ~40 ms of CPU, the GPU busy ~9 ms of it).
Beside it, every time the event loop's thread gives the GIL up (each torch call does) it waits to get
it back, up to the switch interval: a prepare's ~0.4 ms of Python took ~1.2 ms (H200 host), all of it
before the copy it launches. Parked, the decode thread waits on a condition, without the GIL, until
the section ends; the GPU goes on with what the step queued so far.

It parks once per section, for MAX_PARK at most: a section that waits for the engine thread itself
(a command between two steps) or for I/O costs the decode loop that much once, never a deadlock.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator

import torch

MAX_PARK = 0.005  # seconds the decode thread waits for one section at most


class Foreground:
    def __init__(self):
        self._sections = 0
        self._opened = 0  # sections opened so far
        self._waited = 0  # ... when the decode thread last parked: once per section
        self._cv = threading.Condition()
        self.parked = 0.0  # seconds the decode thread spent parked, in all

    @contextlib.contextmanager
    def section(self) -> Iterator[None]:
        """The decode thread parks from its next module call until this ends."""
        with self._cv:
            self._sections += 1
            self._opened += 1
        try:
            yield
        finally:
            with self._cv:
                self._sections -= 1
                if not self._sections:
                    self._cv.notify_all()

    def park(self, *_) -> None:
        """A forward pre-hook (module, args): returns at once unless a section is open."""
        if not self._sections or self._waited == self._opened:  # (unlocked reads: at worst a call late)
            return
        start = time.perf_counter()
        with self._cv:
            self._waited = self._opened
            self._cv.wait_for(lambda: not self._sections, MAX_PARK)
        self.parked += time.perf_counter() - start

    def attach(self, model: torch.nn.Module) -> list:
        """Parks at every call of a module that holds parameters of its own (the linear layers, norms
        and embeddings: ~10 a decoder layer) -> the hooks' handles."""
        return [m.register_forward_pre_hook(self.park) for m in model.modules()
                if next(m.parameters(recurse=False), None) is not None]
