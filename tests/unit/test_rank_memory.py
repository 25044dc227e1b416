"""What a routed transfer's members read from the trainer's real TCPStore, which stays small as the
world grows: every member each rank's memory summary (tens of bytes), a receiver rank the whole
RankMemory (handles and boxes) only of the ranks it pulls from, the trainer's layout once per process
(an offer names it by digest), and a roster with each distinct receiver layout once; the summaries
split the routes exactly as the whole memories do, and the roster gives the layout the answers do."""

import datetime
import hashlib

import pytest
import torch
import torch.distributed as dist

from rlsync.errors import DataLoss, FailedPrecondition, InvalidArgument
from rlsync.publish.core import PublisherCore
from rlsync.publish.ranks import Ranks
from rlsync.transfer import pulls
from rlsync.transfer.control import Deadline
from rlsync.transfer.manifest import Spec
from rlsync.transfer.routes import TensorInfo, chunks, layout, plan_routes
from rlsync.transfer.sharded import (ShardedSender, _export, _held_memories, learn, _layout_key, _mapped_key, _memories,
                                    _memory_key, _put_memory, engine_facts, engine_layout, make_roster, roster_layout,
                                    to_layout_proto, trainer_layout)
from rlsync.transfer.v1 import transfer_pb2 as pb

TENSORS = 300


def _memory(rank: int, gpu: str) -> pb.RankMemory:
    """A rank of an FSDP2 trainer on `gpu`: every parameter its own storage (a handle of ~170 bytes)."""
    handle = pb.CudaIpcHandle(device=0, handle=bytes(64), storage_size_bytes=1 << 24,
                              ref_counter_handle=b"/torch_1_2_3", event_handle=bytes(64),
                              event_sync_required=True).SerializeToString()
    return pb.RankMemory(facts=pb.Facts(host_id="h", device_type="cuda", gpu_uuids=[gpu]),
                         ipc=[handle] * TENSORS, regions=TENSORS, groups=["g1"],
                         held=[pb.RankMemory.Held(region=i, offset=rank, stride=[1], dtype="bfloat16")
                               for i in range(TENSORS)])


@pytest.fixture
def store():
    master = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                           timeout=datetime.timedelta(seconds=10))
    yield master


def test_members_read_summaries_and_a_puller_the_whole_memory_of_its_sources(store):
    offer = pb.Offer(transfer_id="t1")
    memories = [_memory(0, "gpu-0"), _memory(1, "gpu-1"), pb.RankMemory(facts=pb.Facts(host_id="h"))]
    exports = [_export(memory) for memory in memories]
    for rank, (summary, mapped, _) in enumerate(exports):  # (a summary of a memory with groups has them)
        _put_memory(store, offer, rank, summary, mapped)

    summaries = _memories(store, offer, 3, Deadline(5, "test"))
    for memory, got in zip(memories, summaries):
        assert not got.ipc and not got.held
        assert (got.facts, got.regions, list(got.groups)) == (memory.facts, memory.regions, list(memory.groups))
        assert len(got.SerializeToString()) < 200 < TENSORS
    assert len(memories[1].SerializeToString()) > 150 * TENSORS  # what each member would read of each rank

    got = _held_memories(store, summaries, [1], Deadline(5, "test"))[1]
    assert (list(got.ipc), list(got.held), got.digest) == (list(memories[1].ipc), list(memories[1].held),
                                                           summaries[1].digest)
    assert store.check([_mapped_key(0, summaries[0].digest)]) and not summaries[2].digest, \
        "a rank with nothing to map puts no mapped memory"
    assert store.check([_memory_key(offer, 2)])


def test_a_receiver_parses_a_mapped_memory_once_per_digest_and_refuses_one_that_does_not_match(store):
    summary, mapped, ipc = _export(_memory(0, "gpu-0"))
    assert ipc == tuple(_memory(0, "gpu-0").ipc)
    offer = pb.Offer(transfer_id="t2")
    _put_memory(store, offer, 0, summary, mapped)
    first = _held_memories(store, [summary], [0], Deadline(5, "test"))[0]
    store.delete_key(_mapped_key(0, summary.digest))  # a repeat of the same digest reads nothing
    assert _held_memories(store, [summary], [0], Deadline(5, "test"))[0] is first
    moved = _memory(0, "gpu-0")
    moved.held[0].offset = 7  # a storage that moved: another digest, read and parsed anew
    other, raw, _ = _export(moved)
    assert other.digest != summary.digest
    _put_memory(store, offer, 0, other, raw)
    assert _held_memories(store, [other], [0], Deadline(5, "test"))[0].held[0].offset == 7
    forged = pb.RankMemory(digest="ab" * 32)
    store.set(_mapped_key(0, forged.digest), mapped)
    with pytest.raises(DataLoss, match="does not match its digest"):
        _held_memories(store, [forged], [0], Deadline(5, "test"))


def test_summaries_split_the_routes_as_the_whole_memories_do():
    tensors = [TensorInfo("w", (4, 8), 2)]
    trainer = layout(tensors, [[[((0, 2), (0, 8))]], [[((2, 4), (0, 8))]]])
    engine = layout(tensors, [[[((0, 4), (0, 4))]], [[((0, 4), (4, 8))]], [[((0, 4), (0, 8))]]])
    routes = plan_routes(trainer, engine)
    whole = [_memory(0, "gpu-0"), pb.RankMemory(facts=pb.Facts(host_id="h", device_type="cuda", gpu_uuids=["gpu-1"]))]
    receivers = [pb.Facts(host_id="h", device_type="cuda", gpu_uuids=[g]) for g in ("gpu-0", "gpu-1", "gpu-0")]
    pulled, pushed = pulls.split(routes, [pulls.summary(m) for m in whole], receivers)
    rule = {(s, d) for s in range(2) for d in range(3) if whole[s].ipc and pulls.same_gpu(whole[s].facts, receivers[d])}
    assert {(t.src, d) for t in pulled.transfers for d in t.dsts} == rule & {(t.src, d) for t in routes.transfers
                                                                            for d in t.dsts}
    assert {(t.src, d) for t in pulled.transfers for d in t.dsts} == {(0, 0), (0, 2)}, \
        "only receivers on a mappable rank's GPU pull from it"
    assert {(t.src, d) for t in pushed.transfers for d in t.dsts} == {(0, 1), (1, 0), (1, 1), (1, 2)}


def _sender(ranks: int) -> ShardedSender:
    rows = [[[((a, b), (0, 8))]] for a, b in chunks(64, ranks)]
    return ShardedSender(layout([TensorInfo("w", (64, 8), 4)], rows), [Spec("w", torch.float32, (64, 8), 2048)], 0,
                         lambda piece: torch.zeros(1), bucket_bytes=1 << 10)


class _Gone:
    """A store that is not there: a layout met before is not read again."""

    def __getattr__(self, name):
        raise AssertionError(f"the store was used ({name})")


def test_an_offer_names_the_trainers_layout_and_a_receiver_reads_it_once():
    small, large = _sender(2), _sender(64)
    try:
        offers = [s.offer(version=1) for s in (small, large)]
        assert offers[0].ByteSize() - len(offers[0].routing.store) == offers[1].ByteSize() - len(
            offers[1].routing.store), "an offer does not grow with the trainer's ranks"
        for sender, offer in zip((small, large), offers):
            client = dist.TCPStore("127.0.0.1", sender._store.port, is_master=False)
            got = trainer_layout(client, offer, sender.specs)
            assert got == sender.layout and trainer_layout(_Gone(), offer, sender.specs) is got
    finally:
        small.close()
        large.close()


def test_a_layout_not_in_the_store_or_not_matching_its_digest_is_refused_at_once(store):
    specs = [Spec("w", torch.float32, (64, 8), 2048)]
    unknown = pb.Offer(routing=pb.Routing(layout="ab" * 32))
    with pytest.raises(FailedPrecondition, match="holds no layout"):
        trainer_layout(store, unknown, specs)
    tampered = pb.Offer(routing=pb.Routing(layout="cd" * 32))
    store.set(_layout_key(tampered.routing.layout), pb.TrainerLayout().SerializeToString())
    with pytest.raises(DataLoss, match="does not match its digest"):
        trainer_layout(store, tampered, specs)


def test_a_roster_carries_each_distinct_layout_once_and_gives_the_answers_layout():
    specs = [Spec("w", torch.float32, (64, 8), 2048), Spec("b", torch.float32, (64,), 256)]
    tp = [to_layout_proto([[((a, b), (0, 8))], [((0, 64),)]]) for a, b in chunks(64, 2)]
    answers = []
    for replica in range(4):  # each rank on a GPU of its own: the same boxes, other facts
        ranks = [pb.RankLayout(tensors=t.tensors, facts=pb.Facts(host_id="h", gpu_uuids=[f"gpu-{2 * replica + r}"]))
                 for r, t in enumerate(tp)]
        answers.append(pb.Answer(receiver_id=f"replica-{replica}", ranks=2, layout=ranks, bucket_bytes=1 << 20))
    roster = make_roster(answers)
    assert len(roster.layouts) == 2 and list(roster.layout_of) == [0, 1] * 4
    assert not any(a.layout for a in roster.answers) and [a.bucket_bytes for a in roster.answers] == [1 << 20] * 4
    assert roster_layout(specs, roster) == engine_layout(specs, answers)
    assert list(roster.facts) == engine_facts(answers)
    assert roster.ByteSize() < pb.RoutedSend(answers=answers).ByteSize()
    roster.layout_of[3] = 2
    with pytest.raises(InvalidArgument, match="do not match its answers"):
        roster_layout(specs, roster)


def test_a_pulls_tables_are_keyed_by_the_memorys_layout_and_sizes_not_its_handles():
    """pulls.held_shape: the same boxes in storages of the same sizes, exported anew (other handles, after an
    onload), key the same tables (rebased); another offset, storage size or region count does not."""
    from rlsync.transfer.pulls import held_shape

    def exported(memory: pb.RankMemory, tag: bytes = b"") -> pb.RankMemory:
        memory.ipc[:] = [h + tag for h in memory.ipc]  # (a handle with trailing bytes: another export)
        memory.digest = _export(memory)[0].digest
        return memory

    def sized(memory: pb.RankMemory, size: int) -> pb.RankMemory:
        handle = pb.CudaIpcHandle.FromString(memory.ipc[0])
        handle.storage_size_bytes = size
        memory.ipc[0] = handle.SerializeToString()
        return exported(memory)

    first, again = exported(_memory(0, "gpu-0")), sized(_memory(0, "gpu-0"), 1 << 24)
    again.ipc[1] = pb.CudaIpcHandle(device=0, handle=b"\x01" * 64, storage_size_bytes=1 << 24).SerializeToString()
    again = exported(again)
    assert again.digest != first.digest and held_shape(again) == held_shape(first)
    assert held_shape(exported(_memory(1, "gpu-0"))) != held_shape(first), "another offset of a box"
    assert held_shape(sized(_memory(0, "gpu-0"), 1 << 25)) != held_shape(first), "a storage of another size"
    fewer = _memory(0, "gpu-0")
    fewer.regions -= 1
    assert held_shape(exported(fewer)) != held_shape(first)


def test_rank_zero_puts_each_ranks_described_memory_the_store_lacks_and_names_every_digest():
    """An offer for replicas that hold the trainer's storages names every rank's memory (Routing.memories): rank 0
    puts the mapped memory of each rank that is new (the one it replaces goes), and names none when a rank's
    storages cannot be mapped (its replicas then meet the ranks at the send)."""
    sender = _sender(2)
    try:
        client = dist.TCPStore("127.0.0.1", sender._store.port, is_master=False)
        mapped = [pb.RankMemory(ipc=[bytes([r])], regions=1).SerializeToString() for r in range(2)]
        digests = [hashlib.sha256(m).hexdigest() for m in mapped]
        client.set(_mapped_key(1, "old"), b"x")
        every = [pb.RankDigest(digest=digests[0], mapped=mapped[0]),
                 pb.RankDigest(digest=digests[1], mapped=mapped[1], replaces="old")]
        assert sender.described(every) == digests
        assert [client.get(_mapped_key(r, d)) for r, d in enumerate(digests)] == mapped
        assert not client.check([_mapped_key(1, "old")]), "the memory it replaces leaves the store"
        again = [pb.RankDigest(digest=d) for d in digests]  # in the store already: only named
        assert sender.described(again) == digests
        assert sender.described([again[0], pb.RankDigest()]) == [], "a rank that cannot be mapped: none named"
        with pytest.raises(DataLoss, match="does not match its digest"):
            sender.described([pb.RankDigest(digest=digests[0], mapped=mapped[1]), again[1]])
        assert sender.describe() == pb.RankDigest(), "storages off a GPU are described by nothing"
    finally:
        sender.close()


def test_a_rank_counts_on_its_described_memory_being_in_the_store_only_once_rank_zero_put_it():
    """A rank whose described memory rank 0 did not put (it failed) is not told it is there: its next send puts
    it, rather than leave the receiver ranks waiting for a key nobody writes."""
    sender = _sender(2)
    try:
        mapped = pb.RankMemory(ipc=[b"\x00"], regions=1).SerializeToString()
        digest = hashlib.sha256(mapped).hexdigest()
        bad = [pb.RankDigest(digest=digest, mapped=b"not it"), pb.RankDigest(digest=digest)]
        assert PublisherCore._keep_memory(Ranks(), sender, bad) == []
        assert sender._mapped == "", "the put failed: its sends still put it"
        good = [pb.RankDigest(digest=digest, mapped=mapped), pb.RankDigest(digest=digest)]
        assert PublisherCore._keep_memory(Ranks(), sender, good) == [digest, digest]
        assert sender._mapped == digest, "in the store from now on"
    finally:
        sender.close()


def test_a_receiver_reads_the_ranks_memories_named_at_the_onload_ahead_of_the_offers_that_name_them():
    """HoldWeightsRequest.routing: what the trainer's onload put in its store, by digest, is read and kept as
    the replica holds the storages; the offer that names those digests then reads nothing (a store that is not
    there would fail it)."""
    sender = _sender(2)
    try:
        mapped = [_export(_memory(r + 40, "gpu-0"))[1] for r in range(2)]  # (memories no other test reads)
        digests = sender.described([pb.RankDigest(digest=hashlib.sha256(m).hexdigest(), mapped=m) for m in mapped])
        routing = sender.routing(digests)
        assert list(routing.memories) == digests and routing.store == sender.store_address
        assert learn(routing) == 2 and learn(routing) == 0, "read once"
        held = _held_memories(_Gone(), [pb.RankMemory(digest=d) for d in digests], [0, 1], Deadline(1, "t"))
        assert [m.digest for m in held.values()] == digests
    finally:
        sender.close()
