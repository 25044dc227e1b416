"""Which replicas' bells a trainer writes for an offer (Holders.bells_for): pure logic on its records."""

from __future__ import annotations

from rlsync.publish.holders import ROUTED_HOLD, Holders
from rlsync.rpc.doorbell import Lines
from rlsync.transfer.v1 import transfer_pb2 as pb


def test_only_replicas_holding_exactly_the_offers_storages_are_rung_and_never_for_an_adapter():
    holders = Holders("trainer", "", Lines())
    holders.holding = {"a:1": (pb.Doorbell(address="a:1"), (b"s0", b"s1")),  # the offer's storages
                       "b:1": (pb.Doorbell(address="b:1"), (b"s0",)),  # an earlier list
                       "c:1": (pb.Doorbell(address="c:1"), (b"s0", b"s1"))}  # holds them, but has no bell
    holders.bells = {"a:1": "bell-a", "b:1": "bell-b", "d:1": "bell-d"}  # (d: no longer holding)
    offer = pb.Offer(mapped=pb.MappedTensors(ipc=[b"s0", b"s1"]))
    assert holders.bells_for(offer) == {"a:1": "bell-a"}
    offer.manifest.adapter.rank = 8  # an adapter: no replica armed a copy of it
    assert holders.bells_for(offer) == {}


def test_a_sharded_trainers_rung_replicas_are_recorded_as_holders_with_no_bell():
    """A sharded trainer's offer, rung with a holder name (Routing.holder), has the replicas keep what their
    ranks pull: each is recorded to be asked to let go at the release; none has a bell to write."""
    holders = Holders("trainer", "", Lines())
    holders.routed([pb.Doorbell(address="a:1"), pb.Doorbell(address="b:1")])
    assert {a: held for a, (_, held) in holders.holding.items()} == {"a:1": ROUTED_HOLD, "b:1": ROUTED_HOLD}
    assert holders.bells_for(pb.Offer(routing=pb.Routing(store="h:1", holder="trainer"))) == {}


def test_a_sharded_trainers_offer_rings_the_replicas_holding_exactly_the_memories_it_names():
    """Replicas that hold a sharded trainer's storages since its onload (HoldWeightsRequest.routing) armed its next
    copy at their wake for the ranks' memories that onload named: rung only for an offer naming the same."""
    holders = Holders("trainer", "", Lines())
    holders.holding = {a: (pb.Doorbell(address=a), (b"s0", b"s1")) for a in ("a:1", "b:1", "c:1")}
    holders.bells = {"a:1": "bell-a", "b:1": "bell-b", "c:1": "bell-c"}
    holders.memories = {"a:1": ("m0", "m1"), "b:1": ("m0", "m-before")}  # (c: held with no routing)
    offer = pb.Offer(routing=pb.Routing(store="h:1", holder="trainer", memories=["m0", "m1"]))
    assert holders.bells_for(offer) == {"a:1": "bell-a"}
    offer.manifest.adapter.rank = 8
    assert holders.bells_for(offer) == {}
