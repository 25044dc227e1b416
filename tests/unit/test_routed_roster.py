"""A routed receiver waits for the trainer's roster in the trainer's real TCPStore: it wakes as the
roster is set (no poll period added to a transfer), at once with the reason when the trainer refuses
the offer, and at once when closed from another thread; nothing it started outlives it."""

import threading
import time

import pytest
import torch
import torch.distributed as dist

from rlsync.errors import Aborted, FailedPrecondition, Unavailable
from rlsync.transfer import answer, kept
from rlsync.transfer.manifest import Spec
from rlsync.transfer.routes import TensorInfo, layout, whole
from rlsync.transfer.sharded import (RoutedReceiver, ShardedSender, _refused_key, _roster_key, _set_roster,
                                    _waiting_key, make_roster)


@pytest.fixture
def sender():
    spec = Spec("w", torch.float32, (4, 2), 32)
    one = layout([TensorInfo("w", (4, 2), 4)], [[[whole((4, 2))]]])
    s = ShardedSender(one, [spec], 0, lambda piece: torch.zeros(4, 2), bucket_bytes=1 << 10)
    yield s
    s.close()


def _waiting(sender: ShardedSender):
    """A receiver running in a thread, waiting for the roster of a fresh offer: (offer, receiver, outcome)."""
    offer = sender.offer(version=1)
    receiver = RoutedReceiver(offer, answer(offer, "replica"), {"w": torch.empty(4, 2)}, timeout=30)
    outcome: dict = {}

    def run():
        try:
            outcome["report"] = receiver.run()
        except Exception as e:  # noqa: BLE001 - the test looks at it
            outcome["error"] = e
        outcome["at"] = time.monotonic()

    thread = threading.Thread(target=run)
    thread.start()
    time.sleep(0.3)  # well into its wait
    assert thread.is_alive(), outcome
    return offer, receiver, outcome, thread


def test_a_refused_offer_wakes_its_receiver_at_once_with_the_reason(sender):
    offer, _, outcome, thread = _waiting(sender)
    refused = time.monotonic()
    sender.refuse(offer, "the trainer's step failed: CUDA out of memory")
    thread.join(10)
    assert isinstance(outcome.get("error"), Unavailable) and "out of memory" in str(outcome["error"])
    assert outcome["at"] - refused < 5, "woken by the refusal, not by its deadline"


def _threads() -> set[threading.Thread]:
    return set(threading.enumerate())


def test_a_closed_receiver_stops_waiting_at_once_and_leaves_no_thread(sender):
    before = _threads()
    _, receiver, outcome, thread = _waiting(sender)
    assert _threads() - before == {thread}, "the wait is the receiver's own: no thread of its own waits beside it"
    closed = time.monotonic()
    receiver.close()
    thread.join(10)
    assert isinstance(outcome.get("error"), Aborted)
    assert outcome["at"] - closed < 5
    for t in _threads() - before:  # close() wakes it from a short-lived thread
        t.join(10)
        assert not t.is_alive(), f"{t.name} outlives the closed receiver"


def test_a_receiver_that_comes_after_the_roster_does_not_wait(sender):
    offer = sender.offer(version=1)
    _set_roster(sender._store, offer, make_roster([answer(offer, "another-replica")]).SerializeToString())
    receiver = RoutedReceiver(offer, answer(offer, "replica"), {"w": torch.empty(4, 2)}, timeout=5)
    start = time.monotonic()
    with pytest.raises(FailedPrecondition, match="another-replica"):
        receiver.run()
    assert time.monotonic() - start < 2, "it found the roster, not its deadline"


def test_a_receiver_made_again_for_the_same_offer_waits_for_the_roster(sender):
    """After an abort a replica may prepare the same offer again: the closed rank's wake is not the new one's."""
    offer, first, _, thread = _waiting(sender)
    first.close()
    thread.join(10)
    receiver = RoutedReceiver(offer, answer(offer, "replica"), {"w": torch.empty(4, 2)}, timeout=30)
    outcome: dict = {}
    later = threading.Thread(target=lambda: outcome.update(error=_raised(receiver.run)))
    later.start()
    time.sleep(0.3)
    assert later.is_alive(), outcome
    sender.refuse(offer, "the trainer moved on")
    later.join(10)
    assert isinstance(outcome.get("error"), Unavailable) and "moved on" in str(outcome["error"])


def _raised(fn) -> Exception | None:
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the test looks at it
        return e
    return None


def test_a_roster_without_this_replica_is_refused_by_name(sender):
    offer, _, outcome, thread = _waiting(sender)
    other = answer(offer, "another-replica")
    _set_roster(sender._store, offer, make_roster([other]).SerializeToString())
    thread.join(10)
    assert "another-replica" in str(outcome.get("error")) and "dropped" in str(outcome["error"])


def test_an_offer_left_behind_by_a_newer_one_wakes_its_receiver_and_leaves_no_keys(sender):
    """An offer neither sent nor refused (its sync failed before the publish) is closed as a newer one
    is sent or refused: its receivers wake with the reason, not at their deadline, and its keys go from
    the trainer's store with the transfer after."""
    old, _, outcome, thread = _waiting(sender)
    newer = sender.offer(version=2)
    closed = time.monotonic()
    sender.refuse(newer, "the trainer's step failed")
    thread.join(10)
    assert isinstance(outcome.get("error"), Unavailable) and "newer offer" in str(outcome["error"])
    assert outcome["at"] - closed < 5, "woken as the newer offer was refused, not by its deadline"
    keys = [_roster_key(old), _refused_key(old), _waiting_key(old)]
    assert all(sender._store.check([k]) for k in keys)
    sender.refuse(sender.offer(version=3), "again")  # the transfer after
    assert not any(sender._store.check([k]) for k in keys)


def test_closing_the_sender_wakes_the_receivers_of_its_open_offers(sender):
    _, _, outcome, thread = _waiting(sender)
    closed = time.monotonic()
    sender.close()
    thread.join(10)
    assert isinstance(outcome.get("error"), Unavailable) and "closed" in str(outcome["error"])
    assert outcome["at"] - closed < 5


def test_a_receiver_whose_kept_connection_is_to_a_store_gone_since_connects_anew(sender):
    """A receiver keeps its connection to the trainer's store for the next transfer (kept.CONNECTIONS); one
    kept from a store gone since (a trainer restarted on the same address) fails at its first round trip,
    and the receiver connects anew instead of failing the transfer."""
    gone = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    stale = dist.TCPStore("127.0.0.1", gone.port, is_master=False, wait_for_workers=False)
    del gone  # its server stops: the connection to it is dead
    offer = sender.offer(version=1)
    kept.CONNECTIONS.give(offer.routing.store, stale)
    _set_roster(sender._store, offer, make_roster([answer(offer, "another-replica")]).SerializeToString())
    receiver = RoutedReceiver(offer, answer(offer, "replica"), {"w": torch.empty(4, 2)}, timeout=10)
    with pytest.raises(FailedPrecondition, match="another-replica"):  # it read the roster: not "the store is gone"
        receiver.run()
    assert kept.CONNECTIONS.take(offer.routing.store) is None, "a failed transfer gives no connection back"
