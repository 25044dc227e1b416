"""What a member and its beacon share (rlsync.common.progress, rlsync.rpc.beacon): the progress counter
in a memory file the beacon reads, the page the beacon answers in, and a process's state and CPU time."""

from __future__ import annotations

import mmap
import os

from rlsync.common.progress import Progress, Watched, identity, state_of
from rlsync.rpc.beacon import Shared


def test_a_shared_counter_is_read_through_its_memory_file_and_a_forked_child_counts_its_own():
    progress = Progress()
    progress.advance(4)
    fd = progress.shared()
    assert progress.shared() == fd  # made once
    seen = memoryview(mmap.mmap(fd, mmap.PAGESIZE)).cast("Q")  # what a beacon maps
    assert seen[0] == progress.count == 5
    progress.advance(2)
    assert seen[0] == 7
    pid = os.fork()
    if pid == 0:  # the child: its own counter, the parent's page untouched
        progress.advance(100)
        os._exit(0 if seen[0] == 7 and progress.count == 107 else 1)
    assert os.waitpid(pid, 0)[1] == 0 and seen[0] == 7


def test_the_beacons_page_reads_back_what_it_wrote():
    mine = Shared()
    assert mine.read() == ("", 0.0, 0.0)
    theirs = Shared(os.dup(mine.fd))  # the other process's mapping of the same file
    theirs.write("af1c61194d11", 2.5, 123.25)
    assert mine.read() == ("af1c61194d11", 2.5, 123.25)
    theirs.write("", 2.5, 124.0)  # forgotten
    assert mine.read() == ("", 2.5, 124.0)


def test_a_process_state_and_cpu_time_come_from_proc():
    state, cpu = state_of(os.getpid())
    assert state == "R" and cpu > 0
    assert state_of(2 ** 22 + 12345) == ("", 0.0)  # no such process
    boot, namespace, pid, started = identity().split()
    assert pid == str(os.getpid()) and namespace.startswith("pid:") and len(boot) == 36
    assert state_of(os.getpid(), started)[0] == "R"
    assert state_of(os.getpid(), str(int(started) + 1)) == ("", 0.0)  # another process under that pid: gone


def test_a_watched_process_wants_what_it_ran_and_what_its_working_threads_waited():
    watched = Watched(os.getpid())
    state, first = watched.sample()
    sum(range(3_000_000))  # runs: its CPU time grows, its run-queue wait never goes down
    state, second = watched.sample()
    assert state == "R" and second - first >= 0.01
    assert Watched(2 ** 22 + 12345).sample() == ("", 0.0)
