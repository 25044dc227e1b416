"""What a trainer does with a replica's bell in host memory that it cannot open (rlsync.transfer.host_bell): a
precise refusal, before anything is mapped or registered (no GPU needed to get there)."""

from __future__ import annotations

import ctypes
import os

import pytest
import torch

from rlsync.errors import Unmappable
from rlsync.transfer.armed import open_bell
from rlsync.transfer.handshake import host_id
from rlsync.transfer.host_bell import NONCE, PAGE
from rlsync.transfer.memory import SharedBuffer
from rlsync.transfer.v1 import transfer_pb2 as pb


def _host_bell(**words) -> bytes:
    return pb.BellHandle(host=pb.HostWords(**{"pid": os.getpid(), "fd": 0, "host_id": host_id(), **words}))\
        .SerializeToString()


def test_a_bell_in_another_hosts_memory_is_refused_naming_both_hosts():
    with pytest.raises(Unmappable, match="another host \\(elsewhere, this is .*only a trainer on its host"):
        open_bell(_host_bell(host_id="elsewhere"), torch.device("cuda", 0))


def test_a_bell_whose_process_or_descriptor_is_gone_is_refused_naming_the_path():
    r, w = os.pipe()
    os.close(r), os.close(w)  # (a descriptor number no longer open here)
    with pytest.raises(Unmappable, match=f"/proc/{os.getpid()}/fd/{r}: No such file.*another process id namespace"):
        open_bell(_host_bell(fd=r), torch.device("cuda", 0))


def test_a_descriptor_that_holds_another_page_than_the_bell_named_is_refused():
    """The pid and descriptor number of a replica that restarted may name another page: the page's nonce tells."""
    page = SharedBuffer(PAGE)
    ctypes.c_uint64.from_address(page.tensor.data_ptr() + NONCE).value = 1234
    try:
        with pytest.raises(Unmappable, match=f"/proc/{os.getpid()}/fd/{page.fd} is not the replica's bell"):
            open_bell(_host_bell(fd=page.fd, nonce=4321), torch.device("cuda", 0))
    finally:
        page.close()


@pytest.mark.parametrize("kind", ["pipe", "short file"])
def test_a_descriptor_that_is_no_bell_page_is_refused_before_it_is_mapped(kind, tmp_path):
    """A number reused by a pipe or a file shorter than the bell's page: refused as not the bell (mapping a pipe
    fails, and reading the nonce past a short file's end would kill the trainer)."""
    if kind == "pipe":
        fd, other = os.pipe()
    else:
        (tmp_path / "short").write_bytes(b"\0" * 8)
        fd, other = os.open(tmp_path / "short", os.O_RDWR), None
    target = os.readlink(f"/proc/self/fd/{fd}")  # (pipe:[inode], or the file's path)

    def open_to_it() -> int:  # (other threads of the suite may open and close descriptors meanwhile)
        return sum(1 for n in os.listdir("/proc/self/fd") if _link(n) == target)

    try:
        before = open_to_it()
        with pytest.raises(Unmappable, match=f"/proc/{os.getpid()}/fd/{fd} is not the replica's bell"):
            open_bell(_host_bell(fd=fd, nonce=1), torch.device("cuda", 0))
        assert open_to_it() == before, "the descriptor it opened is closed"
    finally:
        os.close(fd)
        if other is not None:
            os.close(other)


def _link(n: str) -> str:
    try:
        return os.readlink(f"/proc/self/fd/{n}")
    except OSError:
        return ""
