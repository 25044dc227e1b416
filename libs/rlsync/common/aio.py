"""asyncio helpers shared by the sync sequences."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable


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
