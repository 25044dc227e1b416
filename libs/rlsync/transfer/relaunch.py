"""A routed repeat queued before anything else is done: the copy an armed pull (RoutedReceiver's, from trainer
ranks' storages this process holds) queued into one staging, queued again as it was for the next offer naming
the same memories, as soon as a replica has checked the offer.

An armed pull still arms (the trainer's layout, the routes, the memories by digest, the held mappings) and keys
its kept tables (the staging's layout, every mapping's address) at every update: 0.9-1.3 ms of Python on an
H200 before the copy starts, with the answer, thread hops and bookkeeping after it. For one receiver rank into
one staging, what it launched depends only on what the offer names (the trainer's layout, each rank's memory
digest, the holder) and the manifest, so it is kept with the staging (`remember`, in a dict that lives with
that staging and that rank's layout: a FlatStore's memo) and launched again (`relaunch`) while the mappings it
read stay held, unchanged: a token in the holder's memo (rlsync.transfer.held), which goes when the holder holds
another list or lets go, says so. A staging laid out anew, another trainer memory (its onload) or another
manifest finds nothing: the caller arms as before. What is kept may also be made before the offer comes, with
no copy (RoutedReceiver.keep_ahead).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

from rlsync.transfer import batched
from rlsync.transfer.held import HELD, HeldMappings
from rlsync.transfer.manifest import Spec
from rlsync.transfer.v1 import transfer_pb2 as pb

_KEY = "rlsync.transfer.relaunch"  # in the staging's dict and in the holder's memo


class Launch(NamedTuple):
    names: tuple  # what the offer named: its trainer layout's digest, its holder, every rank's memory digest; the rank
    specs: tuple[Spec, ...]
    handles: tuple[bytes, ...]  # the storages its tables read
    token: object  # in the holder's memo of those storages while they stay mapped as they were
    tables: tuple  # batched.Table, launched in order
    nbytes: int


def _names(routing: pb.Routing, rank: int) -> tuple:
    return routing.layout, routing.holder, tuple(routing.memories), rank


def remember(kept: dict, routing: pb.Routing, specs: Sequence[Spec], rank: int, launched: dict, nbytes: int,
             held: HeldMappings = HELD) -> None:
    """What a held pull of `routing`'s offer by receiver rank `rank` launched, or would launch (pulls.pull's
    `launched`), into the staging `kept` lives with, for `relaunch`. Nothing when its storages are no longer held
    or the offer names no memories."""
    memo = held.memo(launched["handles"])
    if memo is None or not routing.memories:
        kept.pop(_KEY, None)
        return
    token = memo.setdefault(_KEY, object())
    kept[_KEY] = Launch(_names(routing, rank), tuple(specs), launched["handles"], token, launched["tables"], nbytes)


def launchable(kept: dict, routing: pb.Routing, specs: Sequence[Spec], rank: int = 0,
               held: HeldMappings = HELD) -> tuple[Launch, list[torch.Tensor]] | None:
    """The copy `remember` kept with this staging and the mappings it reads, when the offer names the same
    memories and manifest and the storages it reads are still held as they were, else None."""
    found: Launch | None = kept.get(_KEY)
    if found is None or found.names != _names(routing, rank) or found.specs != tuple(specs):
        return None
    both = held.mapped(found.handles)  # (the mappings taken with the memo: a release after the check keeps them)
    if both is None or both[1].get(_KEY) is not found.token:
        return None
    return found, both[0]


def relaunch(kept: dict, routing: pb.Routing, specs: Sequence[Spec], rank: int = 0,
             held: HeldMappings = HELD) -> tuple[int, list[torch.Tensor]] | None:
    """Queues on the current stream the copy `remember` kept with this staging (`launchable`) -> (its bytes, the
    mappings it reads: the caller keeps them until the copy is done, for a release meanwhile closes only what
    nobody keeps), else None (nothing queued)."""
    found = launchable(kept, routing, specs, rank, held)
    return None if found is None else queue(found)


def queue(found: tuple[Launch, list[torch.Tensor]]) -> tuple[int, list[torch.Tensor]]:
    """Queues on the current stream what `launchable` found -> (its bytes, the mappings it reads), as `relaunch`."""
    launch, mappings = found
    for table in launch.tables:
        batched.launch(table)
    return launch.nbytes, mappings
