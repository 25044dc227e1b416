"""The doorbell: a protobuf call over an abstract Unix socket, answered with the status and
message the gRPC method would give, refused without the token, and a dead or silent server
told apart."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from hypothesis import given, settings, strategies as st

from rlsync.errors import DeadlineExceeded, FailedPrecondition, Relayed, Unavailable
from rlsync.rpc.doorbell import DoorbellServer, Lines, Unreachable, ring, to_socket
from rlsync.rollout.v1 import rollout_pb2 as pb
from rlsync.transfer.v1 import transfer_pb2 as tpb

PARSE = pb.PrepareUpdateResponse.FromString


async def prepare(request: pb.PrepareUpdateRequest) -> pb.PrepareUpdateResponse:
    if request.offer.manifest.version < 0:
        raise FailedPrecondition("version -1 is older than the served version 0: set force to roll back")
    if request.force_backend == "boom":
        raise RuntimeError("a bug")
    if request.force_backend == "slow":
        await asyncio.sleep(5)
    return pb.PrepareUpdateResponse(answer=tpb.Answer(receiver_id="r0", transfer_id=request.offer.transfer_id,
                                                      stages={"copy": request.offer.manifest.version / 1000}))


def request(version: int = 3, force_backend: str = "") -> pb.PrepareUpdateRequest:
    return pb.PrepareUpdateRequest(offer=tpb.Offer(transfer_id="t1", manifest=tpb.Manifest(version=version)),
                                   force_backend=force_backend)


def run(body):
    async def main():
        server = DoorbellServer({"PrepareUpdate": (pb.PrepareUpdateRequest.FromString, prepare)}, "secret", "r0")
        address = await server.start()
        try:
            return await body(address)
        finally:
            await server.close()

    return asyncio.run(main())


def test_a_call_gets_the_methods_response_and_many_run_at_once():
    async def body(address):
        assert address.startswith("@rlsync-doorbell-r0-")
        calls = [ring(address, "secret", "PrepareUpdate", request(v), PARSE, 5) for v in range(1, 9)]
        return await asyncio.gather(*calls)

    answers = run(body)
    assert [r.answer.stages["copy"] for r in answers] == pytest.approx([v / 1000 for v in range(1, 9)])
    assert {r.answer.transfer_id for r in answers} == {"t1"}


def test_kept_connections_carry_the_calls_and_closing_the_server_ends_them():
    async def main():
        server = DoorbellServer({"PrepareUpdate": (pb.PrepareUpdateRequest.FromString, prepare)}, "secret", "r0")
        address, lines = await server.start(), Lines(keep=2)
        one = [(await ring(address, "secret", "PrepareUpdate", request(v), PARSE, 5, lines=lines)).answer.stages["copy"]
               for v in range(1, 4)]
        sequential = len(server._between)
        with pytest.raises(Relayed):  # a refusal is an answer: the connection stays usable
            await ring(address, "secret", "PrepareUpdate", request(-1), PARSE, 5, lines=lines)
        await ring(address, "secret", "PrepareUpdate", request(1), PARSE, 5, lines=lines)
        sequential += len(server._between)
        at_once = await asyncio.gather(*(ring(address, "secret", "PrepareUpdate", request(v), PARSE, 5, lines=lines)
                                         for v in range(1, 5)))
        for _ in range(500):  # the server sees the two the caller did not keep close
            if len(server._between) == 2:
                break
            await asyncio.sleep(0.01)
        concurrent = len(server._between)
        await asyncio.wait_for(server.close(), 5)  # ends the kept connections too
        with pytest.raises(Unreachable):  # a kept connection the server closed is not written to
            await ring(address, "secret", "PrepareUpdate", request(), PARSE, 5, lines=lines)
        lines.close()
        return one, sequential, len(at_once), concurrent

    one, sequential, answered, concurrent = asyncio.run(main())
    assert one == pytest.approx([0.001, 0.002, 0.003]) and sequential == 2  # one connection, twice
    assert answered == 4 and concurrent == 2  # four calls at once opened more; two were kept


def test_a_call_that_timed_out_leaves_no_reply_behind_for_the_next():
    async def body(address):
        lines = Lines()
        await ring(address, "secret", "PrepareUpdate", request(1), PARSE, 5, lines=lines)
        with pytest.raises(DeadlineExceeded):  # its connection closes: the late reply has nowhere to go
            await ring(address, "secret", "PrepareUpdate", request(2, "slow"), PARSE, 0.2, lines=lines)
        after = await ring(address, "secret", "PrepareUpdate", request(3), PARSE, 5, lines=lines)
        lines.close()
        return after

    assert run(body).answer.stages["copy"] == pytest.approx(0.003)


def test_refusals_keep_their_status_and_message_and_name_the_replica():
    async def body(address):
        outcomes = []
        calls = [("secret", "PrepareUpdate", request(-1)), ("wrong", "PrepareUpdate", request()),
                 ("secret", "CommitUpdate", request()), ("secret", "PrepareUpdate", request(1, "boom"))]
        for token, method, req in calls:
            with pytest.raises(Relayed) as e:
                await ring(address, token, method, req, PARSE, 5, "replica r0")
            outcomes.append((e.value.code, str(e.value)))
        return outcomes

    (stale, denied, unknown, bug) = run(body)
    assert stale[0] == grpc.StatusCode.FAILED_PRECONDITION and stale[1].startswith("replica r0: version -1 is older")
    assert denied[0] == grpc.StatusCode.UNAUTHENTICATED and "same --token" in denied[1]
    assert unknown[0] == grpc.StatusCode.UNIMPLEMENTED and "PrepareUpdate" in unknown[1]
    assert bug[0] == grpc.StatusCode.INTERNAL and "RuntimeError: a bug" in bug[1]


def test_garbage_is_refused_and_the_server_keeps_answering():
    async def body(address):
        reader, writer = await asyncio.open_unix_connection(to_socket(address))
        writer.write(b"\x05\x00\x00\x00hello")
        await writer.drain()
        reply = await reader.read(1000)
        writer.close()
        return reply, await ring(address, "secret", "PrepareUpdate", request(2), PARSE, 5)

    reply, after = run(body)
    assert b"INVALID_ARGUMENT" in reply and b"not a doorbell call" in reply
    assert after.answer.stages["copy"] == pytest.approx(0.002)


def test_nobody_there_is_unavailable_and_a_silent_server_a_deadline():
    async def body(address):
        with pytest.raises(DeadlineExceeded, match="did not answer within"):
            await ring(address, "secret", "PrepareUpdate", request(1, "slow"), PARSE, 0.3, "replica r0")
        return address

    address = run(body)  # closed now
    with pytest.raises(Unreachable, match="nothing answers at doorbell"):
        asyncio.run(ring(address, "secret", "PrepareUpdate", request(), PARSE, 5, "replica r0"))
    assert issubclass(Unreachable, Unavailable)


def test_a_doorbell_nobody_answers_at_is_left_to_the_callers_prepare():
    from rlsync.client.weights import ring_prepare
    from rlsync.transfer.handshake import host_id

    async def body(address):
        gone = tpb.Doorbell(host_id=host_id(), address="@rlsync-doorbell-nobody", name="gone")
        elsewhere = tpb.Doorbell(host_id="another-host", address=address, name="far")
        here = tpb.Doorbell(host_id=host_id(), address=address, name="r0")
        return await ring_prepare(tpb.Offer(transfer_id="t1", manifest=tpb.Manifest(version=4)),
                                  [gone, elsewhere, here], "secret", timeout=5)

    rungs, seconds = run(body)
    assert [r.rung for r in rungs] == [False, False, True] and seconds > 0
    assert rungs[2].answer.transfer_id == "t1" and rungs[2].answer.stages["copy"] == pytest.approx(0.004)


@settings(max_examples=60, deadline=None)
@given(tensors=st.integers(0, 300), ipc=st.booleans(), bell=st.integers(0, (1 << 30)),
       force=st.sampled_from(["", "nccl"]), timeout=st.floats(0, 1e4))
def test_the_rings_request_is_the_offer_with_its_waits_and_bell_without_a_copy(tensors, ipc, bell, force, timeout):
    """ring_prepare's request bytes (the offer's own, then a field that sets mapped.waits and .bell)
    parse as the request built by copying the offer and setting them."""
    from rlsync.client.weights import _prepare_request

    specs = [tpb.TensorSpec(name=f"layer{i}.weight", dtype="bfloat16", shape=[i, 8], nbytes=16 * i)
             for i in range(tensors)]
    offer = tpb.Offer(transfer_id="t1", manifest=tpb.Manifest(version=4, tensors=specs))
    if ipc:
        offer.mapped.ipc.append(b"handle")
        offer.mapped.region.extend([0] * tensors)
        offer.mapped.offset.extend(range(0, 16 * tensors, 16))
    ours = tpb.MappedTensors(waits=ipc, bell=bell if ipc else 0)
    expected = pb.PrepareUpdateRequest(offer=offer, force_backend=force, timeout=timeout)
    if ipc:
        expected.offer.mapped.waits, expected.offer.mapped.bell = True, ours.bell
    assert pb.PrepareUpdateRequest.FromString(_prepare_request(offer, ours, force, timeout)) == expected


@pytest.mark.parametrize("n", [0, 1, 127, 128, 16383, 16384, 1 << 21, (1 << 31) - 1, 1 << 35])
def test_the_rings_length_prefix_is_protobufs_varint(n):
    from google.protobuf.internal.encoder import _VarintBytes

    from rlsync.client.weights import _varint

    assert _varint(n) == _VarintBytes(n)


def test_only_a_replica_whose_bell_was_written_is_told_its_value():
    """A ring's bell value goes to the replicas whose bell the trainer wrote; another (one whose bell it could not
    open) gets the same request with none, so it never adopts a copy armed behind its own bell that nothing starts."""
    from rlsync.client.weights import _requests

    offer = tpb.Offer(transfer_id="t1", manifest=tpb.Manifest(version=4), mapped=tpb.MappedTensors(ipc=[b"h"]))
    doorbells = [tpb.Doorbell(address=a) for a in ("a", "b")]
    ours = tpb.MappedTensors(waits=True, bell=7)
    got = {a: pb.PrepareUpdateRequest.FromString(r).offer.mapped for a, r in
           _requests(offer, doorbells, {"a"}, ours, "", 0).items()}
    assert (got["a"].bell, got["a"].waits) == (7, True) and (got["b"].bell, got["b"].waits) == (0, True)
    every = _requests(offer, doorbells, {"a", "b"}, ours, "", 0)
    assert every["a"] is every["b"]  # (one request's bytes when every bell was written)
