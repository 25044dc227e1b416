"""A bell in pinned host memory: one that any thread of the replica rings by a plain store.

rlsync's Bell lies in the replica's GPU memory, and only a launch writes it. While a copy waits on it, a launch
that needs the whole device (a kernel loaded at its first launch, under CUDA's lazy loading; a cuBLAS kernel
picked for a batch not seen before; `empty_cache`) waits until the bell is written, and holds the driver so
that no other thread of the process can launch the write: the process hangs until its trainer rings
(bench/results/armed-hazards-h100.json). A `HostBell`'s word lies in a page of host memory (a memfd) that the
GPU reads through its mapping. The GPU waits on it as on a Bell's and a trainer on the same host writes it on
its stream as it writes a Bell (`ring_bell`, through `open_host_words`). A thread of the replica writes it by a
store of the CPU (`write`), which no launch or load in the driver can hold up. So an armed copy can always be
let go, and a replica may arm one beside generation: whatever its engine launches waits at most until that
store. On an H100 a 256 MiB copy waiting on a word of pinned host memory was done 0.21 ms after the store.
"""

from __future__ import annotations

import ctypes
import os
import stat

import torch

from rlsync.errors import Unmappable
from rlsync.transfer import driver
from rlsync.transfer.armed import Bell, ring_stream
from rlsync.transfer.handshake import host_id
from rlsync.transfer.memory import SharedBuffer
from rlsync.transfer.v1 import transfer_pb2 as pb

PAGE = 4096  # what is registered: a whole page (the words are its first 8 bytes)


class _Mapped:
    """Registered host memory as the GPU sees it, for torch.as_tensor (its __cuda_array_interface__): two int32
    words. Keeps the mapping alive (as the tensor keeps this); `opened` (a trainer's view of a replica's bell):
    unregisters it when it goes, once the device has done what it queued (a replica's own lives as long as the
    process: a copy may wait on it until its exit, which a synchronize here would wait for)."""

    def __init__(self, buffer: SharedBuffer, index: int, opened: bool):
        self.buffer, self.index, self.opened = buffer, index, False
        self.host = buffer.tensor.data_ptr()
        self.address = driver.register_host(self.host, PAGE, index)
        self.opened = opened  # (registered: from here on it is unregistered when it goes)
        self.__cuda_array_interface__ = {"shape": (2,), "typestr": "<i4", "data": (self.address, False),
                                         "version": 3, "strides": None}

    def close(self) -> None:
        """Unregisters the page now (before its mapping goes: another mapping at its address could not be
        registered), once the trainer's writes queued to it are done (they are on the ring stream alone)."""
        if self.address is None:
            return
        ring_stream(self.index).synchronize()
        driver.unregister_host(self.host, self.index)
        self.address = None

    def __del__(self) -> None:
        if not self.opened:
            return
        try:
            self.close()
        except Exception:  # noqa: BLE001 - (at exit the driver may be gone before this)
            pass


def _words(buffer: SharedBuffer, device: torch.device, opened: bool = False) -> tuple[torch.Tensor, int]:
    """The two words of `buffer` as a CUDA tensor on `device` (registered, mapped), and their host address."""
    mapped = _Mapped(buffer, device.index if device.index is not None else torch.cuda.current_device(), opened)
    try:
        words = torch.as_tensor(mapped, device=device)
        if words.data_ptr() != mapped.address:  # (torch copies what it takes for another device's memory)
            raise Unmappable(f"{device} does not see the bell's page where the driver mapped it: torch copied it")
    except BaseException:
        mapped.close()
        raise
    words.rlsync_mapping = mapped  # (kept with the tensor, whatever torch keeps of what it was made from)
    return words, mapped.host


NONCE = 8  # where the page holds its nonce (HostWords.nonce), after the bell's two words


def _nonce(buffer: SharedBuffer) -> ctypes.c_uint64:
    return ctypes.c_uint64.from_address(buffer.tensor.data_ptr() + NONCE)


def open_host_words(words: pb.HostWords, device: torch.device) -> torch.Tensor:
    """The trainer's side: a replica's host bell (HostWords), mapped for `device`'s streams to write."""
    if words.host_id != host_id():
        raise Unmappable(f"the replica's bell lies in the host memory of another host ({words.host_id}, this is "
                         f"{host_id()}): only a trainer on its host rings it")
    path = f"/proc/{words.pid}/fd/{words.fd}"
    try:
        fd = os.open(path, os.O_RDWR)
    except OSError as e:
        raise Unmappable(f"cannot open the replica's bell ({path}: {e.strerror}): the replica is gone, or runs in "
                         "another process id namespace than this trainer") from e
    gone = Unmappable(f"{path} is not the replica's bell (another process, or another descriptor, has that number "
                      "now): the replica is gone")
    found = os.fstat(fd)
    if not stat.S_ISREG(found.st_mode) or found.st_size < PAGE:  # (a pipe, a socket, a shorter file)
        os.close(fd)
        raise gone
    try:
        buffer = SharedBuffer.attach(fd, PAGE)  # (it closes fd, mapped or not)
    except (OSError, ValueError) as e:
        raise Unmappable(f"cannot map the replica's bell ({path}): {e}") from e
    try:
        if _nonce(buffer).value != words.nonce:
            raise gone
        return _words(buffer, device, opened=True)[0]
    except Unmappable:
        buffer.close()
        raise
    except Exception as e:  # noqa: BLE001 - the driver refused the page: the hold goes on without the bell
        buffer.close()
        raise Unmappable(f"cannot map the replica's bell ({path}) for {device}: {e}") from e


class HostBell(Bell):
    """A replica's bell (rlsync.transfer.armed.Bell) whose written word lies in pinned host memory: `flag`, the
    GPU's view of it (what the armed stream waits on, and what a trainer maps: `open_host_words`); `write` is a
    store of the CPU. The value that started the armed copy is copied from it into the replica's GPU memory in the
    stream's order (a copy from pinned memory), and read back as a Bell's is (`started_by`)."""

    def __init__(self, device: torch.device):
        self.device = device
        self._buffer = SharedBuffer(PAGE)
        nonce = _nonce(self._buffer)
        nonce.value = int.from_bytes(os.urandom(8), "little")
        self.flag, self._host = _words(self._buffer, device)  # (its first word is the bell's)
        self._word = ctypes.c_int32.from_address(self._host)
        self.handle = pb.BellHandle(host=pb.HostWords(pid=os.getpid(), fd=self._buffer.fd, host_id=host_id(),
                                                      nonce=nonce.value)).SerializeToString()
        self._started = torch.zeros(1, dtype=torch.int32, device=device)
        self._streams(device)

    def write(self, value: int) -> None:
        """Starts what waits on the bell: a store of the CPU (nothing launched, nothing that waits)."""
        self._word.value = value

    def holds(self) -> int:
        """Read by the CPU, which nothing on the GPU holds up."""
        return self._word.value

    def reset(self) -> None:
        self._word.value = 0
        self._started.zero_()  # (on the current stream, which the caller synchronizes before it arms)

    def capture(self, stream: torch.cuda.Stream) -> None:
        driver.copy_at(self._started.data_ptr(), self._host, 4, stream)  # (host to device: in the stream's order)
