"""Byte views that continue each other in memory become one view: one copy (or one broadcast)
instead of many, whenever both ends keep tensors packed in one buffer (flat storage); and many
copies are launched as few."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from itertools import chain

import torch

from rlsync.transfer import batched


def byte_view(storage: torch.UntypedStorage, start: int, nbytes: int, device: torch.device) -> torch.Tensor:
    """A uint8 view of `nbytes` of `storage` from byte `start`."""
    return torch.empty(0, dtype=torch.uint8, device=device).set_(storage, start, (nbytes,))


def span(parts: list[torch.Tensor]) -> torch.Tensor | None:
    """One uint8 view covering `parts` (uint8 views) when they lie end to end in one storage."""
    if not parts:
        return None
    first = parts[0]
    storage = first.untyped_storage()
    base = storage.data_ptr()
    ptr = first.data_ptr()
    for p in parts:
        if p.data_ptr() != ptr or p.untyped_storage().data_ptr() != base:
            return None
        ptr += p.numel()
    return byte_view(storage, first.data_ptr() - base, ptr - first.data_ptr(), first.device)


View = tuple[torch.Tensor, int, torch.Tensor, int]  # (src, src storage pointer, dst, dst storage pointer)


def coalesce(pairs: Iterable[View]) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Merges consecutive (src, src storage pointer, dst, dst storage pointer) uint8 views that
    continue each other on both sides into single (src, dst) pairs, each yielded as soon as its run
    ends (a copy can start while the rest are still being looked at). Storage pointers are passed in
    because looking them up per view costs more than the copy for small tensors."""
    run: list[View] = []
    for item in pairs:
        if run:
            src, sbase, dst, dbase = item
            last_src, last_sbase, last_dst, last_dbase = run[-1]
            if not (sbase == last_sbase and dbase == last_dbase
                    and src.data_ptr() == last_src.data_ptr() + last_src.numel()
                    and dst.data_ptr() == last_dst.data_ptr() + last_dst.numel()):
                yield _merged(run)
                run.clear()
        run.append(item)
    if run:
        yield _merged(run)


def _merged(run: list[View]) -> tuple[torch.Tensor, torch.Tensor]:
    if len(run) == 1:
        return run[0][0], run[0][2]
    (src, sbase, dst, dbase), last = run[0], run[-1]
    nbytes = last[0].data_ptr() + last[0].numel() - src.data_ptr()
    return (byte_view(src.untyped_storage(), src.data_ptr() - sbase, nbytes, src.device),
            byte_view(dst.untyped_storage(), dst.data_ptr() - dbase, nbytes, dst.device))


def stacked(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """`pairs` (src, dst), those that step through memory alike as one pair each: contiguous views of one
    storage on each side, of one shape, dtype and strides, whose starts make an arithmetic progression on
    both sides with no overlap (a mixture of experts' per-expert pieces of a fused tensor, and the places
    they fill) become one pair of views with a leading dimension, copied in one copy_ instead of one each.
    For copies made again and again where no kernel launch takes them all at once (off the GPU): made once
    per plan. The others stay as they are, in their order."""
    groups: dict[tuple, list[int]] = {}
    for i, (src, dst) in enumerate(pairs):
        if src.numel() and src.is_contiguous() and dst.is_contiguous():
            groups.setdefault((_kind(src), _kind(dst)), []).append(i)
    first: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    rest: set[int] = set()
    for members in groups.values():
        if len(members) < 2:
            continue
        members.sort(key=lambda i: pairs[i][0].data_ptr())
        src, dst = pairs[members[0]]
        steps = [_steps([pairs[i][k].data_ptr() for i in members], t) for k, t in ((0, src), (1, dst))]
        if None in steps:
            continue
        n = len(members)
        first[members[0]] = tuple(t.as_strided((n, *t.shape), (step, *t.stride()))
                                  for t, step in zip((src, dst), steps))
        rest.update(members[1:])
    return [first.get(i, pair) for i, pair in enumerate(pairs) if i not in rest]


def _kind(t: torch.Tensor) -> tuple:
    return t.untyped_storage().data_ptr(), t.dtype, tuple(t.shape), t.stride(), t.device


def _steps(starts: list[int], t: torch.Tensor) -> int | None:
    """The step between `starts` in elements of `t`, when they make a progression of views like `t` that do not
    overlap; else None."""
    step = starts[1] - starts[0]
    nbytes = t.numel() * t.element_size()
    if step < nbytes or step % t.element_size() or any(b - a != step for a, b in zip(starts, starts[1:])):
        return None
    return step // t.element_size()


SMALL = 1 << 20  # bytes: below it, a copy costs its launch more than its bytes
# Pairs below which a copy_ each costs less CPU than a table's making and its Triton launch (a bucket's
# few slices, at every bucket: bench/sharded.py over NCCL, where landing them was most of the time).
FEW = 8


def copy_all(pairs: Iterable[tuple[torch.Tensor, torch.Tensor]], one_launch: bool = True,
             few: int = FEW) -> batched.Table | None:
    """Queues dst.copy_(src) for every (src, dst) of one device. On a GPU (with Triton), from `few`
    pairs on (fewer where the table is kept and launched again), every pair whose addresses and size
    allow it goes in one kernel launch over a table of them (rlsync.transfer.batched;
    `one_launch=False` leaves that out). The rest are copied as they come:
    a large one at once (the GPU starts while the rest are still being made), the small ones together
    at the end in one torch._foreach_copy_ (a launch per ~100 tensors instead of one each).
    bench/scatter_copy.py, 399 tensors of a 4B model on H100: a copy_ each 0.83x of one flat copy,
    this without the table 0.86x. Returns the table when every pair went in it (the same copies
    again are `batched.launch(table)`), else None."""
    pairs = iter(pairs)
    first = next(pairs, None)
    if first is None:
        return None
    pairs = chain([first], pairs)
    device = first[1].device
    if not (one_launch and batched.available(device)):
        _copy_each(pairs)
        return None
    pairs = list(pairs)
    if len(pairs) < few:
        _copy_each(pairs)
        return None
    table, rest = _one_launch(pairs, device, cast=False)
    _copy_each(rest)
    return None if rest else table


def cast_all(pairs: list[tuple[torch.Tensor, torch.Tensor]], few: int = FEW) -> batched.Table | None:
    """Queues dst.copy_(src) for every flat (src, dst) of one device, in different dtypes (a cast): on
    a GPU (with Triton), from `few` pairs on, the fp32 -> bf16 ones in one kernel launch
    (batched.split), the rest a copy_ each. Returns the table when every pair went in it, else None
    (as copy_all)."""
    if not pairs:
        return None
    device = pairs[0][1].device
    table, rest = _one_launch(pairs, device, cast=True) if len(pairs) >= few and batched.available(device) \
        else (None, pairs)
    for src, dst in rest:
        dst.copy_(src, non_blocking=True)
    return None if rest else table


def _one_launch(pairs: list[tuple[torch.Tensor, torch.Tensor]], device: torch.device,
                cast: bool) -> tuple[batched.Table | None, list]:
    """Launches the pairs the batched kernel takes -> (its table, None if none; the pairs it left)."""
    rows, rest = batched.split(pairs, cast)
    table = batched.table(rows, device, cast) if len(rows) else None
    if table is not None:
        batched.launch(table)
    return table, rest


def _copy_each(pairs: Iterable[tuple[torch.Tensor, torch.Tensor]]) -> None:
    small = []
    for src, dst in pairs:  # (a large one at once: the GPU starts while the rest are still being made)
        if src.numel() < SMALL:
            small.append((src, dst))
        else:
            dst.copy_(src, non_blocking=True)
    _copy_small([d for _, d in small], [s for s, _ in small])


def _copy_small(dsts: list[torch.Tensor], srcs: list[torch.Tensor]) -> None:
    if len(dsts) > 1:
        torch._foreach_copy_(dsts, srcs, non_blocking=True)
    elif dsts:
        dsts[0].copy_(srcs[0], non_blocking=True)


class EachCopy:
    """_copy_each of the same pairs again and again (a CPU's, without a batched kernel), laid out once: a large one
    a copy_ each, the small ones in one torch._foreach_copy_. A repeat of a hundred small copies (a bucket of
    experts landing out of its slot) then does no Python per pair."""

    def __init__(self, pairs: Iterable[tuple[torch.Tensor, torch.Tensor]]):
        self.large, small = [], []
        for src, dst in pairs:
            (small if src.numel() < SMALL else self.large).append((src, dst))
        self.dsts, self.srcs = [d for _, d in small], [s for s, _ in small]

    def __call__(self) -> None:
        for src, dst in self.large:
            dst.copy_(src, non_blocking=True)
        _copy_small(self.dsts, self.srcs)
