"""Generations read in background threads, and streams frozen mid-way for a test to act on.

Whether a stream is still open is decided by the replica's own count (GetInfo.in_flight), never
by when chunks reach the test: on two busy cores, vLLM's chunks can reach the client seconds
after its engine made them, so "first chunk arrived" says nothing about how far the engine is."""

from __future__ import annotations

import threading
import time
import uuid

from rlsync.client import RolloutClient, RpcError
from rlsync.client.base import SyncGenerating


class Stream:
    """One generation (from a replica or the gateway), read to its end in a thread."""

    def __init__(self, client: SyncGenerating, prompt: str, **kw):
        self.request_id = kw.setdefault("request_id", f"{prompt}-{uuid.uuid4().hex[:8]}")
        self.chunks: list = []
        self.error: RpcError | None = None
        self.first = threading.Event()
        self.thread = threading.Thread(target=self._read, args=(client, prompt, kw), daemon=True)
        self.thread.start()

    def _read(self, client: SyncGenerating, prompt: str, kw: dict) -> None:
        try:
            for c in client.generate(prompt, **kw):
                self.chunks.append(c)
                self.first.set()
        except RpcError as e:
            self.error = e
        self.first.set()

    @property
    def tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.chunks)

    def versions(self) -> list[int]:
        return [c.weight_version for c in self.chunks if c.token_ids]


def wait_in_flight(client: RolloutClient, count: int, timeout: float = 30.0,
                   streams: list[Stream] = ()) -> bool:
    """Waits until the replica counts `count` requests in flight; False if one of `streams` ended
    first (a stream that failed raises, with its error)."""
    deadline = time.monotonic() + timeout
    while client.info().in_flight < count:
        ended = [s for s in streams if not s.thread.is_alive()]
        if ended:
            assert not ended[0].error, f"stream {ended[0].request_id} failed: {ended[0].error}"
            return False
        assert time.monotonic() < deadline, f"expected {count} requests in flight on the replica"
        time.sleep(0.01)
    return True


def frozen_streams(client: RolloutClient, prompts: list[str], attempts: int = 5, **kw) -> list[Stream]:
    """Streams that have made tokens and are all still open, frozen by Pause(KEEP): the caller
    acts on them, then Resumes. `kw` must ask for enough tokens that the engine is not done
    within a fraction of a second (e.g. max_tokens=900, ignore_eos=True).

    The pause comes as soon as the replica runs them all (its own count). Chunks made before it
    keep arriving, late on busy cores; a stream with none yet (its prefill not done when the pause
    came) is let run a little longer and paused again."""
    for _ in range(attempts):
        streams = [Stream(client, p, **kw) for p in prompts]
        if wait_in_flight(client, len(prompts), streams=streams):
            for _ in range(10):
                client.pause("keep")
                finished = client.info().in_flight < len(prompts)
                if not finished and all(s.first.wait(3) and s.chunks for s in streams):
                    return streams
                client.resume()
                if finished:
                    break  # start over
                time.sleep(0.05)
        for s in streams:
            s.thread.join(120)
    raise AssertionError(f"streams kept finishing before they could be paused ({attempts} attempts)")
