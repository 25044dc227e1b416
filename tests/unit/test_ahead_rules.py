"""When a sender's broadcasts posted ahead, and a receiver's receives posted ahead, are taken by a
transfer (rlsync.transfer.backends.groups): pure rules, over stand-in groups that record their end.
The broadcasts themselves run on two GPUs (tests/gpu/test_ahead_gpu.py)."""

from __future__ import annotations

import pytest
import torch

from rlsync.errors import Aborted, DataLoss
from rlsync.transfer.backends import groups
from rlsync.transfer.messages import Hello


class ProcessGroupNCCL:  # named as torch's: the rules apply to NCCL groups only
    def __init__(self):
        self.ended = False
        self.sent: list[torch.Tensor] = []

    def broadcast(self, tensor, root):
        self.sent.append(tensor)
        return _Done()

    def abort(self):
        self.ended = True


class _Done:
    def is_completed(self):
        return True


SIZES = (4096, 100)
PLAN = (SIZES, 1024)


def _hello(groups_=(), posted=()):
    return Hello(4, "t", "tok", "r", 0, 1, 0, list(groups_), list(posted))


def _cache_with(plan=PLAN):
    session = groups._Session("g1", None, ProcessGroupNCCL(), plan=plan)
    key = ("group", 2, (("r", 0),))
    return {key: session}, key, session


def _views(plan):
    return [torch.zeros(b.nbytes, dtype=torch.uint8) for b in plan]


def _cuda_like(plan):  # start_ahead wants GPU bytes: a CPU stand-in passes by its device's name only
    class View:
        def __init__(self, n):
            self.device = torch.device("cuda", 0)
            self.n = n

    return [View(b.nbytes) for b in plan]


def test_a_sender_posts_ahead_only_on_the_one_nccl_group_whose_last_plan_this_is(monkeypatch):
    monkeypatch.setattr(groups, "go_tensor", lambda tid, device: torch.zeros(groups.GO_BYTES, dtype=torch.uint8))
    cache, key, session = _cache_with()
    assert not groups.start_ahead(cache, "t", SIZES, 2048, _cuda_like), "another bucket size: another plan"
    assert not groups.start_ahead(cache, "t", (4096, 101), 1024, _cuda_like), "other tensors"
    assert not groups.start_ahead(cache, "t", SIZES, 1024, _views), "bytes on the CPU: not NCCL's to send"
    assert groups.start_ahead(cache, "t", SIZES, 1024, _cuda_like)
    assert key not in cache and cache["ahead"].session is session  # in use, out of the cache
    assert len(session.group.sent) == 1 + 5  # the go token, then each bucket of 4196 bytes in 1 KiB buckets


@pytest.mark.parametrize("transfer_id, members, plan, hello, taken", [
    ("t", (("r", 0),), PLAN, _hello(groups_=["g1"]), True),  # the receiver holds the group
    ("t", (("r", 0),), PLAN, _hello(posted=["g1"]), True),  # ... or posted its receives on it
    ("t", (("r", 0),), PLAN, _hello(), False),  # neither: it lost the group
    ("other", (("r", 0),), PLAN, _hello(groups_=["g1"]), False),  # another offer's send
    ("t", (("r", 0), ("s", 0)), PLAN, _hello(groups_=["g1"]), False),  # other members
    ("t", (("r", 0),), (SIZES, 512), _hello(groups_=["g1"]), False),  # the answers asked for smaller buckets
])
def test_a_send_takes_the_broadcasts_posted_ahead_only_when_they_fit_it(monkeypatch, transfer_id, members, plan,
                                                                       hello, taken):
    monkeypatch.setattr(groups, "go_tensor", lambda tid, device: torch.zeros(groups.GO_BYTES, dtype=torch.uint8))
    cache, _, session = _cache_with()
    assert groups.start_ahead(cache, "t", SIZES, 1024, _cuda_like)
    ahead = groups.take_ahead(cache, transfer_id, ("group", 2, members), plan, [hello])
    assert (ahead is not None) == taken
    assert session.group is None if not taken else not session.group.ended  # not taken: its group aborted
    assert "ahead" not in cache


def test_a_receive_posted_for_one_plan_fails_a_transfer_of_another(monkeypatch):
    group = ProcessGroupNCCL()
    posted = groups.Posted(groups._Session("g2", None, group), PLAN, [], torch.zeros(16, dtype=torch.uint8), [])
    monkeypatch.setitem(groups._POSTED, "g2", posted)
    with pytest.raises(Aborted, match="another plan"):
        groups.take_posted("g2", SIZES, 512)
    assert group.ended and "g2" not in groups._POSTED


def test_a_welcome_on_one_group_drops_the_receives_posted_on_others(monkeypatch):
    kept, other = ProcessGroupNCCL(), ProcessGroupNCCL()
    for gid, group in (("keep", kept), ("other", other)):
        monkeypatch.setitem(groups._POSTED, gid, groups.Posted(groups._Session(gid, None, group), PLAN, [],
                                                               torch.zeros(16, dtype=torch.uint8), [_Done()]))
    assert groups.drop_posted(keep="keep") == 1  # (what the Welcome's _join does first)
    assert groups.take_posted("keep", *PLAN).session.group is kept
    assert other.ended and not kept.ended and not groups._POSTED


def test_a_welcome_on_a_group_this_process_no_longer_holds_says_so():
    with pytest.raises(Aborted, match="no longer holds"):
        groups.take_held("gone")


def test_the_go_token_names_its_transfer():
    go = torch.frombuffer(bytearray(groups.go_token("abc")), dtype=torch.uint8)
    groups.check_go(go, "abc")
    with pytest.raises(DataLoss, match="another transfer's bytes"):
        groups.check_go(go, "abd")


def test_a_trainer_ends_broadcasts_sent_ahead_at_once_and_off_its_event_loop(monkeypatch):
    import asyncio
    import threading

    from rlsync.publish.core import PublisherCore, in_thread
    from rlsync.transfer import WeightSender

    ended = []
    monkeypatch.setattr(groups, "leave", lambda group: ended.append(threading.current_thread()))

    async def main():
        lock = asyncio.Lock()
        core = PublisherCore(lambda _: None, in_thread(lock), bucket_bytes=1024)
        sender = WeightSender({"w": torch.zeros(4)})
        _, key, session = _cache_with()
        sender.cache["ahead"] = groups.Ahead("t1", key, session, [], [])
        core._offers["t1"] = core._offers["t2"] = (None, sender)
        core.cancel_ahead("t2")  # another transfer's: nothing to end, nothing scheduled
        assert not core._running
        async with lock:  # the trainer busy (a step, a send of another transfer): its kernels end anyway
            core.cancel_ahead("t1")
            assert not ended  # not on the event loop
            await asyncio.gather(*core._running)
            assert ended and ended[0] is not threading.main_thread()
        assert "ahead" not in sender.cache
        sender.close()

    asyncio.run(main())


def test_a_sender_closing_while_its_broadcasts_sent_ahead_end_in_another_thread_ends_each_group_once(monkeypatch):
    from rlsync.transfer import WeightSender

    sender = WeightSender({"w": torch.zeros(4)})
    cache, key, session = _cache_with()
    ahead_session = groups._Session("g2", None, ProcessGroupNCCL(), plan=PLAN)
    sender.cache.update(cache)
    sender.cache["ahead"] = groups.Ahead("t1", ("group", 3), ahead_session, [], [])
    left = []

    def leave(group):  # the first abort lets the other thread run: it ends the broadcasts sent ahead
        left.append(group)
        if len(left) == 1:
            sender.cancel_ahead("t1")

    monkeypatch.setattr(groups, "leave", leave)
    both = [session.group, ahead_session.group]
    sender.close()  # (it iterated the cache as the other thread popped from it: a RuntimeError)
    assert sorted(map(id, left)) == sorted(map(id, both))  # each group aborted, once
    assert not sender.cache
