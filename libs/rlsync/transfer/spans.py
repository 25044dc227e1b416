"""Byte views that continue each other in memory become one view: one copy (or one broadcast)
instead of many, whenever both ends keep tensors packed in one buffer (flat storage); and many
copies are launched as few."""

from __future__ import annotations

import torch


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


def coalesce(pairs: list[tuple[torch.Tensor, int, torch.Tensor, int]]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Merges consecutive (src, src storage pointer, dst, dst storage pointer) uint8 views that
    continue each other on both sides into single (src, dst) pairs. Storage pointers are passed in
    because looking them up per view costs more than the copy for small tensors."""
    out: list[tuple[torch.Tensor, torch.Tensor]] = []
    run: list[tuple[torch.Tensor, int, torch.Tensor, int]] = []

    def close() -> None:
        if len(run) == 1:
            out.append((run[0][0], run[0][2]))
        elif run:
            (src, sbase, dst, dbase), last = run[0], run[-1]
            nbytes = last[0].data_ptr() + last[0].numel() - src.data_ptr()
            out.append((byte_view(src.untyped_storage(), src.data_ptr() - sbase, nbytes, src.device),
                        byte_view(dst.untyped_storage(), dst.data_ptr() - dbase, nbytes, dst.device)))
        run.clear()

    for item in pairs:
        if run:
            src, sbase, dst, dbase = item
            last_src, last_sbase, last_dst, last_dbase = run[-1]
            if not (sbase == last_sbase and dbase == last_dbase
                    and src.data_ptr() == last_src.data_ptr() + last_src.numel()
                    and dst.data_ptr() == last_dst.data_ptr() + last_dst.numel()):
                close()
        run.append(item)
    close()
    return out


SMALL = 1 << 20  # bytes: below it, a copy costs its launch more than its bytes


def copy_all(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Queues dst.copy_(src) for every (src, dst) of one device: the small ones in one
    torch._foreach_copy_ (a kernel launch per ~100 tensors instead of one each), the large ones one
    copy each, at the copy's full rate (bench/scatter_copy.py: 399 tensors of a 4B model on H100,
    0.86x of one flat copy, against 0.84x a copy_ each and 0.56x all in _foreach_copy_)."""
    small = [(s, d) for s, d in pairs if s.numel() < SMALL]
    if len(small) > 1:
        torch._foreach_copy_([d for _, d in small], [s for s, _ in small], non_blocking=True)
    for src, dst in pairs if len(small) <= 1 else [(s, d) for s, d in pairs if s.numel() >= SMALL]:
        dst.copy_(src, non_blocking=True)
