"""Bucket planning, pure: which byte ranges of which tensors go into which bucket, at which offset.

Planning is on bytes, so any dtype, a bucket size that is not a multiple of an element size, and
tensors larger than a bucket (sliced across buckets) are all the same case. Both ends of a
transfer compute the same plan from the manifest and the bucket size; it never travels.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

from rlsync.errors import InvalidArgument


@dataclass(frozen=True)
class Slice:
    tensor: int  # index into the manifest
    src: int  # byte offset inside the tensor
    length: int  # bytes
    dst: int  # byte offset inside the bucket


@dataclass(frozen=True)
class Bucket:
    index: int
    nbytes: int
    slices: tuple[Slice, ...]


def plan_buckets(sizes: Sequence[int], bucket_bytes: int) -> list[Bucket]:
    """Packs tensors of `sizes` bytes, in order, into buckets of at most `bucket_bytes`.

    Every bucket but the last is full; a tensor that does not fit continues in the next bucket.
    Zero-byte tensors need no slice.
    """
    if not isinstance(bucket_bytes, int) or bucket_bytes <= 0:
        raise InvalidArgument(f"bucket size must be a positive number of bytes, got {bucket_bytes!r}")
    buckets: list[Bucket] = []
    slices: list[Slice] = []
    fill = 0
    for index, size in enumerate(sizes):
        if size < 0:
            raise InvalidArgument(f"tensor {index} has a negative size ({size} bytes)")
        done = 0
        while done < size:
            take = min(size - done, bucket_bytes - fill)
            slices.append(Slice(index, done, take, fill))
            done += take
            fill += take
            if fill == bucket_bytes:
                buckets.append(Bucket(len(buckets), fill, tuple(slices)))
                slices, fill = [], 0
    if slices:
        buckets.append(Bucket(len(buckets), fill, tuple(slices)))
    return buckets


@lru_cache(maxsize=64)
def cached_plan(sizes: tuple[int, ...], bucket_bytes: int) -> tuple[Bucket, ...]:
    """plan_buckets, remembered: both ends plan the same manifest again at every update."""
    return tuple(plan_buckets(sizes, bucket_bytes))


def bytes_per_tensor(buckets: Sequence[Bucket], count: int) -> list[int]:
    """Total bytes the plan moves for each of `count` tensors (a check: equals each tensor's size)."""
    totals = [0] * count
    for b in buckets:
        for s in b.slices:
            totals[s.tensor] += s.length
    return totals
