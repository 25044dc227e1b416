"""CUDA memory of another process, kept mapped between updates at its owner's request.

A pull maps the trainer's storages, copies, and closes them again: opening and closing a
mapping (`cudaIpcOpenMemHandle` and its close) cost 0.7 and 0.4 ms on H100, a third of a 1.7B
model's copy. The trainer's parameters stay at one address from its onload to its offload, so it
asks the replicas on its GPU to map them while it trains (`hold`), and to let go before it
offloads (`release`): torch keeps a storage that another process maps alive, so memory still
held after the offload would not go back to the GPU. A pull then finds the regions already open
(`lookup`: the holder's list, when the pull lists exactly its storages; else `get_all`) and the update
neither maps nor closes anything; what a one-copy pull derives from them lives in the holder's `memo`
until the holder holds another list (a routed pull keeps its tables by layout and address instead,
rlsync.transfer.pulls, and its relaunch a token here that says the mappings it read are still these:
rlsync.transfer.relaunch).

Holds are per holder (a trainer's name): a hold replaces what that holder held, so a restarted
trainer's first onload lets go of what its predecessor left. A handle is the serialized
CudaIpcHandle, which names one allocation of one process: a new allocation at the same address
has another handle, so a held mapping can never be taken for memory it does not show.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable

import torch

from rlsync.transfer.memory import open_cuda
from rlsync.transfer.streams import resolved

Opener = Callable[[bytes, torch.device], torch.Tensor]


class HeldMappings:
    """Open mappings by (holder, handle). Thread-safe: holds arrive on the service's loop, pulls
    run on the engine's thread."""

    def __init__(self, opener: Opener = open_cuda):
        self._open = opener
        self._lock = threading.Lock()
        self._held: dict[str, dict[bytes, torch.Tensor]] = {}
        self._given: dict[str, tuple] = {}  # holder -> (device, handles) of its last hold, as given
        self._index: dict[bytes, torch.Tensor] = {}  # every holder's mappings by handle (get_many)
        self._lists: dict[str, list[torch.Tensor]] = {}  # holder -> its mappings in the order it gave (lookup)
        self._memos: dict[str, dict] = {}  # holder -> what pulls derived from its mappings (see memo)
        self._last: tuple | None = None  # (handles, mapped()'s answer) since the last hold or release

    def hold(self, holder: str, handles: Iterable[bytes], device: torch.device) -> int:
        """Keeps exactly `handles` mapped for `holder` (those already mapped stay as they are, the
        holder's others are closed). Returns how many were newly mapped. A handle that does not
        open raises, and the holder's set is left as it was."""
        given = (resolved(device), list(handles))  # (a pull names its device with the index: `cuda:0`)
        with self._lock:  # a trainer holds the same storages at every step: nothing to look at then
            if given[1] and self._given.get(holder) == given:
                return 0
        handles = list(dict.fromkeys(given[1]))
        with self._lock:
            mine = self._held.get(holder, {})
            opened = {h: mine[h] if h in mine else self._open(h, device) for h in handles}
            new = sum(h not in mine for h in handles)
            self._memos.pop(holder, None)  # another list: what was derived from the last one goes
            if opened:
                self._held[holder], self._given[holder] = opened, given
                self._lists[holder] = [opened[h] for h in given[1]]
            else:
                self._held.pop(holder, None), self._given.pop(holder, None), self._lists.pop(holder, None)
            self._reindex()
        _settle([t for h, t in mine.items() if h not in opened])
        return new  # the closed ones go with the dropped references

    def release(self, holder: str) -> int:
        """Closes what `holder` held; returns how many."""
        with self._lock:
            mine = self._held.pop(holder, {})
            self._given.pop(holder, None), self._memos.pop(holder, None), self._lists.pop(holder, None)
            self._reindex()
        _settle(mine.values())
        return len(mine)

    def get(self, handle: bytes) -> torch.Tensor | None:
        """The open mapping of `handle` when some holder keeps it, else None."""
        return self.get_many([handle])[0]

    def get_many(self, handles: list[bytes]) -> list[torch.Tensor | None]:
        """get() of each handle, under one lock."""
        with self._lock:
            index = self._index
            return [index.get(h) for h in handles]

    def lookup(self, handles: list[bytes]) -> tuple[list[torch.Tensor], dict] | None:
        """(the mappings, the memo) of a holder whose last hold listed exactly `handles`, in this
        order (a trainer's every pull): one comparison of the lists, no handle looked up. None if none
        did (get_all and memo then say more). The list is the holder's own: not to be changed."""
        with self._lock:
            for holder, (_, given) in self._given.items():
                if given == handles:
                    return self._lists[holder], self._memos.setdefault(holder, {})
        return None

    def get_all(self, handles: list[bytes]) -> list[torch.Tensor] | None:
        """get() of each handle when each is held (by any holder), else None."""
        with self._lock:
            return self._get_all(handles)

    def _get_all(self, handles) -> list[torch.Tensor] | None:
        index = self._index
        try:
            return [index[h] for h in handles]
        except KeyError:
            return None

    def _reindex(self) -> None:
        self._index = {h: t for mine in reversed(self._held.values()) for h, t in mine.items()}
        self._last = None  # (what mapped() kept must not keep a released mapping open)

    def mapped(self, handles: tuple[bytes, ...]) -> tuple[list[torch.Tensor], dict] | None:
        """get_all() and memo() of `handles` at once, under one lock: (the mappings, the memo of a holder that keeps
        them all), else None. The last answer is kept: asked again with the very same tuple while no hold or
        release came between (each makes a new index), it looks nothing up (a relaunch of 600 storages: one
        comparison). The list is shared: not to be changed."""
        with self._lock:
            last = self._last
            if last is not None and last[0] is handles:
                return last[1]
            mappings = self._get_all(handles)
            memo = self._memo(handles) if mappings is not None else None
            if memo is None:
                return None
            self._last = handles, (mappings, memo)  # (holding the tuple: no other object takes its id meanwhile)
            return self._last[1]

    def memo(self, handles: tuple[bytes, ...]) -> dict | None:
        """A dict that lives as long as one holder keeps every one of `handles` mapped, unchanged: a pull
        keeps there the views it cuts from them (slicing 399 storages costs as much CPU as copying them
        takes the GPU), so a pull from the same memory into the same layout cuts none. None when no
        holder keeps them all."""
        with self._lock:
            return self._memo(handles)

    def _memo(self, handles) -> dict | None:
        wanted = set(handles)
        for holder, mine in self._held.items():
            if wanted and mine.keys() >= wanted:
                return self._memos.setdefault(holder, {})
        return None

    def count(self) -> int:
        with self._lock:
            return sum(len(m) for m in self._held.values())


def _settle(closing: Iterable[torch.Tensor]) -> None:
    """Waits for the copies still queued out of mappings about to close (a pull answered before its
    copy completed, whose sender gave up waiting for it)."""
    for device in {t.device for t in closing if t.is_cuda}:
        torch.cuda.synchronize(device)


HELD = HeldMappings()  # this process's: the cuda_ipc channel looks here before mapping
