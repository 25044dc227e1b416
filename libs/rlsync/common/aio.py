"""asyncio helpers shared by the sync sequences, and the hand-over of a thread's result to an awaiting caller."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
from collections.abc import Awaitable, Callable


async def settle(*calls: Awaitable) -> list:
    """Awaits every call, even when one fails, then raises the first failure (so nothing is left
    running behind the error, e.g. a pause that a resume would overtake); else returns the results."""
    if len(calls) == 1:  # no task to schedule, no turn of the loop before it starts (a trainer's one ring)
        return [await calls[0]]
    results = await asyncio.gather(*calls, return_exceptions=True)
    failed = [r for r in results if isinstance(r, BaseException)]
    if failed:
        raise failed[0]
    return results


def resolve(future: concurrent.futures.Future, fn: Callable[[], object]) -> None:
    """Runs `fn` on this thread and hands its outcome to `future`, whose caller may have given up meanwhile (an
    awaiting task cancelled cancels a wrapped future): nobody waits for it then, and the thread goes on."""
    try:
        outcome, failed = fn(), False
    except BaseException as e:  # noqa: BLE001 - handed to the caller
        outcome, failed = e, True
    with contextlib.suppress(concurrent.futures.InvalidStateError):
        if failed:
            future.set_exception(outcome)
        else:
            future.set_result(outcome)
