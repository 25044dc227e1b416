"""Byte views that continue each other in memory become one view: one copy (or one broadcast)
instead of many, whenever both ends keep tensors packed in one buffer (flat storage)."""

from __future__ import annotations

import torch


def _view(storage: torch.UntypedStorage, start: int, nbytes: int, device: torch.device) -> torch.Tensor:
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
    return _view(storage, first.data_ptr() - base, ptr - first.data_ptr(), first.device)


def coalesce(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Merges consecutive (src, dst) uint8 view pairs that continue each other on both sides."""
    out: list[tuple[torch.Tensor, torch.Tensor]] = []
    run: list[tuple[torch.Tensor, torch.Tensor]] = []

    def close() -> None:
        if len(run) == 1:
            out.append(run[0])
        elif run:
            out.append((span([s for s, _ in run]), span([d for _, d in run])))
        run.clear()

    for src, dst in pairs:
        if run:
            last_src, last_dst = run[-1]
            continues = (src.data_ptr() == last_src.data_ptr() + last_src.numel()
                         and dst.data_ptr() == last_dst.data_ptr() + last_dst.numel()
                         and src.untyped_storage().data_ptr() == last_src.untyped_storage().data_ptr()
                         and dst.untyped_storage().data_ptr() == last_dst.untyped_storage().data_ptr())
            if not continues:
                close()
        run.append((src, dst))
    close()
    return out
