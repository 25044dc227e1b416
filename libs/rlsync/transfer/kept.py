"""What a repeat routed update keeps: the work each update would redo for the same layouts in the same memory.

A routed update between the same trainer layout and engine layout, from and into storages that have not
moved, derives the same things every time: a trainer rank's export of its memory (RankMemory, its bytes),
an engine rank's views of its staging and the writer laid out over them. They are kept here under a key
that names everything they were derived from, so what invalidates them is detected, not assumed: a
storage that moved (an optimizer that reallocates, an offload, a resharding) changes its tensors'
addresses (`where`); another layout, other routes or other groups change the rest of the key.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence

import numpy as np
import torch

from rlsync.transfer.manifest import Spec
from rlsync.transfer.routes import Box, Transfer
from rlsync.transfer.writer import DestWriter


class HashedKey(tuple):
    """A tuple that hashes its items once: a cache key of thousands of them (a mixture of experts' tensors), looked
    up several times an update, where a tuple hashes every item at every lookup."""

    def __init__(self, items: Iterable = ()):
        self._hash = tuple.__hash__(self)

    def __hash__(self) -> int:
        return self._hash


def where(tensors: Iterable[torch.Tensor]) -> tuple:
    """Where each tensor lies (address, dtype, shape, strides, device): equal only while none has moved.
    A caller keeps the storages alive meanwhile (a trainer's exported handles, an engine's staging), so
    no other allocation can take an address in the key."""
    return tuple((t.data_ptr(), t.dtype, t.shape, t.stride(), t.device) for t in tensors)


def staging_where(staging: Mapping[str, tuple[Box, torch.Tensor]]) -> tuple:
    """An engine rank's staging, by name, box and where each tensor lies."""
    return tuple(zip(staging, (b for b, _ in staging.values()), where(t for _, t in staging.values())))


def staging_layout(staging: Mapping[str, tuple[Box, torch.Tensor]]) -> tuple[tuple, np.ndarray]:
    """An engine rank's staging as what is copied into it depends on it, not where it lies: by name, box and
    each tensor's place in its storage (which of them, the offset, dtype, shape, strides), with those
    storages' sizes; and their addresses (equal layouts at other addresses take the same copies, rebased)."""
    bases: dict[int, int] = {}
    places, sizes = [], []
    for name, (box, t) in staging.items():
        storage = t.untyped_storage()
        base = storage.data_ptr()
        if base not in bases:
            bases[base] = len(bases)
            sizes.append(storage.nbytes())
        places.append((name, box, bases[base], t.data_ptr() - base, t.dtype, t.shape, t.stride(), t.device))
    return (*places, tuple(sizes)), np.array(list(bases), dtype=np.int64)


class Kept:
    """The latest few values by key, made on a miss (`get`). Thread-safe; `hits` and `misses` say which."""

    def __init__(self, size: int = 4):
        self.size, self.hits, self.misses = size, 0, 0
        self._values: OrderedDict[Hashable, object] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: Hashable, make: Callable[[], object]):
        with self._lock:
            if key in self._values:
                self.hits += 1
                self._values.move_to_end(key)
                return self._values[key]
        value = make()
        with self._lock:
            self.misses += 1
        self.put(key, value)
        return value

    def peek(self, key: Hashable):
        """The value kept under `key`, or None; a miss keeps nothing."""
        with self._lock:
            if key not in self._values:
                return None
            self.hits += 1
            self._values.move_to_end(key)
            return self._values[key]

    def put(self, key: Hashable, value: object) -> None:
        with self._lock:
            self._values[key] = value
            self._values.move_to_end(key)
            while len(self._values) > self.size:
                self._values.popitem(last=False)

    def clear(self) -> None:
        with self._lock:
            self._values.clear()


class Connections:
    """Connections to stores that no transfer uses now, one per address (the latest few addresses): a member
    of a routed transfer meets the same trainer's store at every update, and connecting to a TCPStore takes
    milliseconds where one of its round trips takes 0.1 ms. A connection is given back only after a transfer
    that succeeded on it; its taker tells a store gone since (a trainer restarted on the same address) by
    its first round trip failing."""

    def __init__(self, size: int = 4):
        self.size = size
        self._idle: OrderedDict[str, object] = OrderedDict()
        self._lock = threading.Lock()

    def take(self, address: str):
        """An idle connection to the store at `address` (no other taker gets it until given back), or None."""
        with self._lock:
            return self._idle.pop(address, None)

    def give(self, address: str, store) -> None:
        with self._lock:
            self._idle[address] = store
            while len(self._idle) > self.size:
                self._idle.popitem(last=False)


CONNECTIONS = Connections()


def writer(mine: Sequence[Transfer], rank: int, specs: Sequence[Spec],
           staging: Mapping[str, tuple[Box, torch.Tensor]], device: torch.device, keep: dict | None,
           lay_out: Callable[[], tuple[list[Spec], dict[str, torch.Tensor]]], placed: Hashable | None = None) \
        -> DestWriter:
    """The writer of engine rank `rank`'s pieces (`mine`: its transfers) into `staging`, laid out once
    (`lay_out`: routed.destinations) and made ready for this transfer. `keep`: where it is kept, a dict
    that lives as long as the staging does (its owner's: a FlatStore's memo); None: laid out each time
    (nothing may keep views of staging its owner could free). The pieces' tuples are the plan's own
    (routes.cached_routes keeps them), held by the kept entry, so their ids name them; the routes know
    sizes, not dtypes, so the key has those too. `placed`: a token its owner keeps for as long as `staging` (of
    `specs`) cannot move (a FlatStore's), which then stands for the dtypes and where every tensor lies."""
    if keep is None:
        return DestWriter(*lay_out(), device)
    writers = keep.setdefault(("writers", rank), Kept(1))  # the latest only: no older staging kept alive
    where_ = (placed,) if placed is not None else (tuple(s.dtype for s in specs), staging_where(staging))
    key = (rank, device, *(id(t.pieces) for t in mine), *where_)
    _, laid = writers.get(key, lambda: ([t.pieces for t in mine], DestWriter(*lay_out(), device)))
    if not laid.in_place:  # it casts through buffers of its own: not kept between updates (memory, not time)
        writers.clear()
    return laid.again()
