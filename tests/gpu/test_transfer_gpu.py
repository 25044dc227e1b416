"""cuda_ipc and nccl between real processes (GPU machine only)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch

from transfer_helpers import Peer

from rlsync.errors import Unavailable
from rlsync.transfer import WeightSender, answer, batched, driver, receive
from rlsync.transfer.armed import open_bell, ring_bell
from rlsync.transfer.checksum import checksum_tensor
from rlsync.transfer.spans import copy_all
from rlsync.transfer.peer import decode, encode
from rlsync.transfer.v1 import transfer_pb2 as pb

pytestmark = pytest.mark.gpu
two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")


def _send_to_peer(tensors, path, backend, receiver_device, pull=False, **sender_kw):
    with WeightSender(tensors, backends=[backend], checksums=True, **sender_kw) as sender:
        offer = sender.offer(version=5, pull=pull)
        peer = Peer("receive", "--file", str(path), "--backend", backend, "--device", receiver_device)
        peer.send(encode(offer))
        ans = decode(pb.Answer, peer.line("ANSWER"))
        report = sender.send(offer, [ans], timeout=120)
        result = peer.result(120)
        peer.kill()
    return offer, report, result


@pytest.mark.parametrize("one_copy, bucket", [(True, 1 << 20), (False, 7), (False, 1 << 20)])
def test_cuda_ipc_every_dtype_bit_exact(zoo_file, one_copy, bucket):
    path, tensors = zoo_file
    gpu = {n: t.cuda() for n, t in tensors.items()}
    offer, report, result = _send_to_peer(gpu, path, "cuda_ipc", "cuda:0", pull=True, bucket_bytes=bucket,
                                          one_copy=None if one_copy else False)
    assert offer.one_copy == one_copy
    # One-copy: the offer says where the tensors lie, the receiver pulls them before it answers,
    # and the sender has nobody left to send to.
    assert bool(offer.mapped.ipc) == one_copy and (report.backends == {}) == one_copy
    assert result["ok"] and result["verified"], result


@two_gpus
@pytest.mark.parametrize("bucket", [7, 1 << 20])
def test_nccl_every_dtype_bit_exact(zoo_file, bucket):
    path, tensors = zoo_file
    gpu = {n: t.cuda() for n, t in tensors.items()}
    _, _, result = _send_to_peer(gpu, path, "nccl", "cuda:1", bucket_bytes=bucket)
    assert result["ok"] and result["verified"], result


def _within(seconds: float, what: str, fn):
    """fn() in a thread; fails the test if it has not returned within `seconds` (a hang in NCCL cannot
    be interrupted)."""
    box: dict = {}

    def run():
        try:
            box["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - raised again in the test's thread
            box["error"] = e

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"{what}: still waiting after {seconds:.0f} s"
    if "error" in box:
        raise box["error"]
    return box.get("value")


@two_gpus
def test_an_nccl_group_ends_at_either_end_without_waiting_for_the_other(zoo_file):
    """Sender and receivers hold their NCCL group across transfers. Each end lets go of it at once, while
    the others still hold theirs: the sender forming a group for new members, a receiver exiting, the
    sender closing. (NCCL's graceful end of a communicator waits for every member on the host to end it
    too: WeightSender.close() hung there while its receiver held the group.)"""
    path, tensors = zoo_file
    gpu = {n: t.cuda() for n, t in tensors.items()}
    first = Peer("receive", "--loop", "--backend", "nccl", "--device", "cuda:1", "--receiver-id", "first")
    second = Peer("receive", "--loop", "--backend", "nccl", "--device", "cuda:1", "--receiver-id", "second",
                  "--file", str(path))
    sender = WeightSender(gpu, backends=["nccl"], checksums=True)
    try:
        def transfer(peer: Peer, version: int) -> dict:
            offer = sender.offer(version=version)
            peer.send(encode(offer))
            sender.send(offer, [decode(pb.Answer, peer.line("ANSWER"))], timeout=120)
            return peer.result(120)

        for version in (1, 2):  # the second reuses the group
            assert _within(120, f"transfer {version}", lambda v=version: transfer(first, v))["ok"]
        result = _within(120, "a transfer to new members", lambda: transfer(second, 3))  # drops the first's group
        assert result["ok"] and result["verified"], result
        first.proc.stdin.close()
        assert _within(60, "the first receiver's exit", first.proc.wait) == 0  # its held group goes at exit
        _within(60, "the sender's close", sender.close)  # the second receiver still holds their group
        second.proc.stdin.close()
        assert _within(60, "the second receiver's exit", second.proc.wait) == 0
    finally:
        first.kill(), second.kill()


def test_checksum_equal_on_cpu_and_gpu():
    for t in (torch.randn(1001, 33).to(torch.bfloat16), torch.randint(0, 255, (77777,), dtype=torch.uint8)):
        assert checksum_tensor(t) == checksum_tensor(t.cuda())


@two_gpus
def test_nccl_sender_killed_mid_transfer_fails_receiver(tmp_path):
    from safetensors.torch import save_file

    path = tmp_path / "big.safetensors"
    save_file({f"w{i}": torch.randn(2048, 2048) for i in range(32)}, str(path))  # 512 MiB
    sender = Peer("send", "--file", str(path), "--backend", "nccl", "--device", "cuda:0",
                  "--bucket-bytes", str(1 << 20))
    offer = decode(pb.Offer, sender.line("OFFER"))
    ans = answer(offer, "victim", device="cuda:1", force="nccl")
    sender.send(encode(ans))
    got = []

    def on_tensor(name, tensor):  # a callable destination: buckets go through staging slots
        got.append(name)
        if len(got) == 1:
            os.kill(sender.proc.pid, signal.SIGKILL)

    start = time.monotonic()
    with pytest.raises(Unavailable):
        receive(offer, ans, on_tensor, device="cuda:1", timeout=120)
    assert time.monotonic() - start < 60 and 1 <= len(got) < 32


def test_copy_all_lands_every_byte_of_a_scattered_layout_in_one_launch():
    """rlsync.transfer.batched on the GPU: aligned copies (one of several chunks among them) go in
    one kernel launch, the rest are copied one by one; every byte lands, none beside."""
    g = torch.Generator().manual_seed(0)
    sizes = [16 * int(n) for n in torch.randint(1, 70000, (60,), generator=g)] + [5 << 20, 8, 24, 1]
    srcs = [torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g).cuda() for n in sizes]
    dsts = [torch.zeros(n + 32, dtype=torch.uint8, device="cuda") for n in sizes]
    pairs = [(s, d[16:16 + s.numel()]) for s, d in zip(srcs, dsts)]
    rows, rest = batched.split(pairs)
    assert len(rows) >= 60 and rest, "both paths must run"
    copy_all(pairs)
    torch.cuda.synchronize()
    assert all(torch.equal(s, d) for s, d in pairs)
    assert all(not d[:16].any() and not d[16 + s.numel():].any() for s, d in zip(srcs, dsts))


def test_a_table_launched_again_goes_through_the_driver_and_copies_and_casts_every_byte():
    """batched.launch: the first launch of each kernel through Triton, the next straight through the driver
    (cuLaunchKernel holding the GIL), on a stream of its own: every copy and every cast lands, each launch."""
    g = torch.Generator().manual_seed(1)
    sizes = [16 * int(n) for n in torch.randint(1, 40000, (40,), generator=g)]
    srcs = [torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g).cuda() for n in sizes]
    dsts = [torch.empty(n, dtype=torch.uint8, device="cuda") for n in sizes]
    masters = [torch.randn(4 * int(n), generator=g).cuda() for n in torch.randint(1, 30000, (20,), generator=g)]
    halves = [torch.empty(t.numel(), dtype=torch.bfloat16, device="cuda") for t in masters]
    copies = batched.table(batched.split(list(zip(srcs, dsts)))[0], torch.device("cuda"))
    casts = batched.table(batched.split(list(zip(masters, halves)), cast=True)[0], torch.device("cuda"), cast=True)
    stream = torch.cuda.Stream()
    for step in range(3):
        for d in dsts + halves:
            d.zero_()
        for s in srcs + masters:
            s.add_(1)
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            batched.launch(copies)
            batched.launch(casts)
        stream.synchronize()
        assert all(torch.equal(s, d) for s, d in zip(srcs, dsts)), step
        assert all(torch.equal(m.to(torch.bfloat16), h) for m, h in zip(masters, halves)), step
    here = torch.cuda.current_device()
    assert batched._LAUNCHERS.get((False, here)) and batched._LAUNCHERS.get((True, here)), \
        f"the driver launches both kernels: {batched._LAUNCHERS}"


def test_a_held_scattered_pull_copies_each_steps_new_values_from_the_plan_it_keeps():
    """A receiver that holds a scattered sender's storages keeps, after its first pull, the table of
    copies it launched; later pulls (the sender's tensors changed in place, as a training step does)
    launch it again and land every new byte (checksums in the manifest), mapping nothing."""
    g = torch.Generator().manual_seed(1)
    tensors = {f"layer{i}": torch.randn(int(n), generator=g).to(torch.bfloat16).cuda()  # one allocation each
               for i, n in enumerate(torch.randint(8, 70000, (24,), generator=g) * 8)}
    with WeightSender(tensors, backends=["cuda_ipc"], checksums=True) as sender:
        peer = Peer("receive", "--loop", "--hold", "test", "--backend", "cuda_ipc", "--device", "cuda:0")
        try:
            results = []
            for step in range(3):
                for t in tensors.values():
                    t.add_(1)  # in place: the storages stay where the receiver holds them
                offer = sender.offer(version=step, pull=True)
                peer.send(encode(offer))
                ans = decode(pb.Answer, peer.line("ANSWER"))
                sender.send(offer, [ans], timeout=60)
                results.append(peer.result(60))
        finally:
            peer.proc.stdin.close()
            peer.proc.wait(30)
    assert all(r["ok"] for r in results), results  # every tensor's checksum matched the sender's
    assert all(r["stages"]["map"] < results[0]["stages"]["map"] for r in results[1:]), "held: nothing mapped again"


@pytest.mark.parametrize("bell", ["device", "host"])
def test_an_armed_held_pull_is_started_by_the_senders_bell_and_lands_each_steps_bytes(bell):
    """A receiver that holds a scattered sender's storages arms its last pull again behind its bell
    (Receiver.arm); the sender writes the bell on its stream after each step's values, then offers: the
    receiver adopts the copy already running (its answer names the copy's event) and every new byte
    lands. An offer of other tensors finds the armed copy disarmed, and is pulled as usual. The bell in the
    receiver's GPU memory (Bell), or in its pinned host memory (HostBell), which the sender maps from its memfd
    and writes on its stream alike."""
    g = torch.Generator().manual_seed(2)
    tensors = {f"layer{i}": torch.randn(int(n), generator=g).to(torch.bfloat16).cuda()  # one allocation each
               for i, n in enumerate(torch.randint(8, 70000, (24,), generator=g) * 8)}
    with WeightSender(tensors, backends=["cuda_ipc"]) as sender:  # no checksums in the manifest: armable
        peer = Peer("receive", "--loop", "--hold", "test", "--arm", bell, "--report-checksums", "--backend",
                    "cuda_ipc", "--device", "cuda:0")
        try:
            flag = open_bell(bytes.fromhex(peer.line("BELL")), torch.device("cuda:0"))
            answers, results, armed = [], [], []
            for step in range(4):
                for t in tensors.values():
                    t.add_(1)  # in place: the storages stay where the receiver holds them
                ring_bell(flag, step + 1)  # after the step's values (its stream waits for this thread's)
                offer = sender.offer(version=step, pull=True)
                offer.mapped.bell, offer.mapped.waits = step + 1, True
                if step == 2:  # another offer: a version whose manifest carries checksums
                    offer.manifest.tensors[0].checksum = checksum_tensor(tensors["layer0"])
                peer.send(encode(offer))
                answers.append(decode(pb.Answer, peer.line("ANSWER")))
                results.append(peer.result(60))
                expected = {n: checksum_tensor(t) for n, t in tensors.items()}
                assert results[-1]["ok"] and results[-1]["checksums"] == expected, (step, results[-1])
                armed.append(json.loads(peer.line("ARMED")))  # (a bell written before the peer armed: reset)
        finally:
            peer.proc.stdin.close()
            try:
                peer.proc.wait(30)
            finally:
                peer.kill()
    assert armed == [True, True, False, True]  # (the offer with checksums is not armable)
    assert [r["adopted"] for r in results] == [False, True, False, False]
    assert [bool(a.copied) for a in answers] == [False, True, False, False]


_WITHDRAW = """
import torch
from rlsync.transfer import batched
from rlsync.transfer.armed import Armed, Bell, ring_bell

g = torch.Generator().manual_seed(3)
srcs = [torch.randint(0, 256, (16 * int(n),), dtype=torch.uint8, generator=g).cuda()
        for n in torch.randint(1, 70000, (12,), generator=g)]
dsts = [torch.zeros_like(s) for s in srcs]
rows, rest = batched.split(list(zip(srcs, dsts)))
assert not rest
kept = batched.table(rows, torch.device("cuda:0"))
batched.launch(kept)  # (its kernel loaded before anything waits on a bell: a first launch behind one may not load)
torch.cuda.synchronize()
bell = Bell(torch.device("cuda:0"))
for rung in (False, True):
    for d in dsts:
        d.zero_()
    table = kept._replace(rows=kept.rows.clone())
    zeros = torch.zeros(table.rows.shape, dtype=table.rows.dtype).pin_memory()  # (as the cuda_ipc channel's repeat())
    armed = Armed(bell, lambda t=table: batched.launch(t), sum(s.numel() for s in srcs), (),
                  cancel=lambda t=table, z=zeros: t.rows.copy_(z, non_blocking=True))
    if rung:
        ring_bell(bell.flag, 7)
        bell.stream.synchronize()
    assert armed.withdraw() is rung, rung
    torch.cuda.synchronize()
    assert all(torch.equal(d, s) if rung else not d.any() for s, d in zip(srcs, dsts)), rung
assert torch.equal(kept.rows.cpu(), torch.from_numpy(kept.host)), "the kept table is not the one emptied"
print("OK")
"""


def test_a_withdrawn_armed_copy_moves_nothing_unless_the_bell_started_it():
    """Armed.withdraw, for weights with no backup to restore (a vLLM worker's woken weights): a copy whose table
    is emptied before its bell is written copies nothing and says so; one the bell started says it wrote. In a
    process of its own, with a time limit: a GPU that waits on a bell forever is a failure, not a hung suite."""
    done = subprocess.run([sys.executable, "-c", _WITHDRAW], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip().endswith("OK"), done.stderr[-3000:]


def test_a_copy_queued_through_the_driver_lands_every_byte_before_its_event_from_a_fresh_thread():
    """driver.copy and driver.record (the launch a generating replica makes holding the GIL) from a
    thread that never called into CUDA (it has no current context until they make the device's
    primary one current, for the call only): the bytes land on the stream, the event is passed once
    they have, and a copy of two sizes or off the stream's device is refused before anything is
    queued."""
    src = torch.randint(0, 255, (64 << 20,), dtype=torch.uint8, device="cuda")
    dst = torch.zeros_like(src)
    stream, event = torch.cuda.Stream(), torch.cuda.Event(interprocess=True)
    event.ipc_handle()  # created, as rlsync.transfer.copied's event is
    failures = []

    def launch() -> None:
        try:
            driver.copy(dst, src, stream)
            driver.record(event, stream)
            with pytest.raises(ValueError, match="one size"):
                driver.copy(dst[1:], src, stream)
            with pytest.raises(ValueError, match="stream's device"):
                driver.copy(torch.empty(1, dtype=torch.uint8), src[:1], stream)
        except BaseException as e:  # noqa: BLE001 (reported on the test's thread)
            failures.append(e)

    thread = threading.Thread(target=launch)
    thread.start()
    thread.join()
    assert not failures, failures
    event.synchronize()
    assert torch.equal(dst, src)


def test_fp32_parameters_published_as_bf16_are_cast_by_the_receiver_as_it_pulls_them():
    """A module trained in fp32, published as bf16: the offer maps the fp32 parameters themselves
    (MappedTensors.dtype) and the receiver, holding them, casts as it copies. Three steps of changing
    values land exactly as the sender's own cast (checksums of the bf16 values in the manifest)."""
    from torch import nn

    from rlsync.publish import WeightMap
    from rlsync.publish.source import module_source

    g = torch.Generator().manual_seed(2)
    model = nn.Module()
    for i, n in enumerate(torch.randint(1, 5000, (12,), generator=g)):
        model.register_parameter(f"w{i}", nn.Parameter(torch.randn(int(n), 3, generator=g).cuda()))
    source, _ = module_source(model, WeightMap(dtype=torch.bfloat16))
    with WeightSender(source, backends=["cuda_ipc"], checksums=True) as sender:
        peer = Peer("receive", "--loop", "--hold", "test", "--backend", "cuda_ipc", "--device", "cuda:0")
        try:
            results = []
            for step in range(3):
                with torch.no_grad():
                    for p in model.parameters():
                        p.mul_(1.37).add_(0.01)  # in place: the storages stay where the receiver holds them
                offer = sender.offer(version=step, pull=True)
                assert set(offer.mapped.dtype) == {"float32"} and offer.manifest.tensors[0].dtype == "bfloat16"
                peer.send(encode(offer))
                ans = decode(pb.Answer, peer.line("ANSWER"))
                assert ans.pull
                sender.send(offer, [ans], timeout=60)
                results.append(peer.result(60))
        finally:
            peer.proc.stdin.close()
            peer.proc.wait(30)
    assert all(r["ok"] for r in results), results  # every tensor's bf16 checksum matched the sender's cast
