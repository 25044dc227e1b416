"""LoRA adapters on the vLLM engine, through vLLM's public LoRA support (enable_lora, add_lora,
LoRARequest, remove_lora): no worker code of ours is involved.

The replica's own process receives the adapter (a few MB) over the negotiated channel, writes it as
a peft adapter folder in memory-backed storage, and has vLLM load it (add_lora) before the commit.
The commit only switches which adapter new requests run with; a request keeps the adapter it started
with to its end (vLLM cannot switch it mid-request), so its tokens are all that adapter's version.
An adapter is removed from vLLM once it is neither current nor used by a running request.
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import tempfile
import time
from pathlib import Path

import torch
from vllm.lora.request import LoRARequest

from rlsync.errors import Aborted, InvalidArgument, RlsyncError
from rlsync.lora import parse, peft_config
from rlsync.rollout.staging import StagedUpdate, pulled
from rlsync.transfer import answer, audit_entry, from_proto

log = logging.getLogger(__name__)
_SHM = Path("/dev/shm")


class Adapters:
    def __init__(self, model: str):
        self.model = model
        self.folder = tempfile.TemporaryDirectory(prefix="rlsync-lora-", dir=_SHM if _SHM.is_dir() else None)
        self.pending: tuple[StagedUpdate, object] | None = None  # (transfer, LoraAdapter) until committed
        self.loaded: LoRARequest | None = None  # added to vLLM by finish, made current by commit
        self.current: LoRARequest | None = None
        self.version = 0  # the current adapter's weight version
        self._detached: tuple | None = None  # (current, version, applied) while a full update commits
        self.applied: dict[str, tuple[str, tuple[int, ...], str]] = {}  # its checksums, as sent
        self._staged: dict[str, torch.Tensor] = {}
        self._users: dict[str, int] = {}  # request id -> the adapter id it runs with
        self._next_id = 1

    def use(self, request_id: str) -> tuple[LoRARequest | None, int | None]:
        """The adapter a new request runs with, and its version (None, None without one)."""
        if self.current is None:
            return None, None
        self._users[request_id] = self.current.lora_int_id
        return self.current, self.version

    async def done(self, llm, request_id: str) -> None:
        """A request ended (after vLLM let go of it): its adapter goes if nothing else uses it."""
        lora_id = self._users.pop(request_id, None)
        if lora_id is not None:
            await self._remove_if_unused(llm, lora_id)

    async def prepare(self, offer, receiver_id: str, force_backend: str, timeout: float):
        cpu = torch.device("cpu")
        ans = answer(offer, receiver_id, device=cpu, force=force_backend or None)
        # Staged as sent (vLLM casts when it loads), one tensor each: safetensors refuses shared storage.
        self._staged = {s.name: torch.empty(s.shape, dtype=s.dtype) for s in from_proto(offer.manifest)}
        update = await asyncio.to_thread(StagedUpdate, offer, ans, self._staged, 0, cpu, timeout)
        self.pending = (update, offer.manifest.adapter)
        try:
            return pulled(ans, [update.poll()])
        except BaseException:
            await self.abort(None)
            raise

    async def finish(self, llm, timeout: float) -> float:
        """Waits for the bytes, then has vLLM load the adapter (the commit then only switches)."""
        update, adapter = self.pending
        start = time.perf_counter()
        lora_id, self._next_id = self._next_id, self._next_id + 1
        path = Path(self.folder.name) / f"v{update.version}-{lora_id}"
        try:
            await asyncio.to_thread(update.wait, timeout)
            try:
                await asyncio.to_thread(self._write, path, adapter)
            except OSError as e:
                raise Aborted(f"could not write the LoRA adapter for vLLM to {path}: {e}") from e
            request = LoRARequest(f"rlsync-v{update.version}", lora_id, str(path))
            try:
                await llm.add_lora(request)
            except Exception as e:  # noqa: BLE001 - vLLM's own words say what it refused
                raise InvalidArgument(f"vllm refused the LoRA adapter: {e}") from e
        except BaseException as e:
            await self.abort(llm)
            shutil.rmtree(path, ignore_errors=True)
            if isinstance(e, Exception) and not isinstance(e, RlsyncError):  # the caller drops the update
                raise Aborted(f"LoRA adapter for version {update.version} failed: {e!r}") from e
            raise
        self.loaded = request
        return time.perf_counter() - start

    def _write(self, path: Path, adapter) -> None:
        from safetensors.torch import save_file

        path.mkdir(parents=True)
        save_file(self._staged, str(path / "adapter_model.safetensors"))
        config = peft_config(adapter, {parse(name)[0] for name in self._staged})
        config.base_model_name_or_path = self.model
        config.save_pretrained(str(path))  # adapter_config.json, as peft writes it

    async def commit(self, llm, version: int) -> None:
        """Makes the loaded adapter the one new requests run with."""
        old = self.current
        self.current, self.version = self.loaded, version
        self.applied = {n: audit_entry(t) for n, t in self._staged.items()}
        self.pending, self.loaded, self._staged = None, None, {}
        if old is not None:
            await self._remove_if_unused(llm, old.lora_int_id)

    # A full update replaces base and adapter: detach (new requests get none; the caller aborts the
    # ones still on an adapter), then forget once the new weights are in, or reattach if they failed.
    def detach(self) -> list[str]:
        self._detached = (self.current, self.version, self.applied)
        self.current, self.applied = None, {}
        return list(self._users)

    def reattach(self) -> None:
        self.current, self.version, self.applied = self._detached
        self._detached = None

    async def forget(self, llm) -> None:
        old, self._detached = self._detached[0], None
        if old is not None:
            await self._remove_if_unused(llm, old.lora_int_id)

    async def abort(self, llm) -> None:
        """Drops a prepared adapter: its transfer, and its copy in vLLM if it was loaded."""
        pending, loaded = self.pending, self.loaded
        self.pending, self.loaded, self._staged = None, None, {}
        try:
            if pending is not None:
                await asyncio.to_thread(pending[0].abort)
        finally:
            if loaded is not None:
                await self._remove_if_unused(llm, loaded.lora_int_id)

    async def _remove_if_unused(self, llm, lora_id: int) -> None:
        """Best effort: whatever called it has already happened (a request ended, an update committed
        or was dropped), and an adapter left behind is evicted by vLLM's cache in time."""
        held = [r for r in (self.current, self.loaded, self._detached and self._detached[0]) if r is not None]
        if any(r.lora_int_id == lora_id for r in held) or lora_id in self._users.values():
            return
        try:
            await llm.remove_lora(lora_id)
        except Exception:  # noqa: BLE001
            log.warning("could not remove LoRA adapter %d", lora_id, exc_info=True)
        for path in Path(self.folder.name).glob(f"v*-{lora_id}"):
            shutil.rmtree(path, ignore_errors=True)

    def close(self) -> None:
        self.folder.cleanup()
