"""The transfer library between real processes: shm and gloo on CPU, every dtype, many receivers,
dead peers, wrong tokens, corruption, deadlines, and nothing left in /dev/shm."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from transfer_helpers import Peer, scatter, shm_entries

from rlsync.errors import DataLoss, DeadlineExceeded, PermissionDenied, Unavailable
from rlsync.transfer import SharedArena, WeightSender, answer, receive
from rlsync.transfer.peer import decode, encode
from rlsync.transfer.v1 import transfer_pb2 as pb


@pytest.fixture(autouse=True)
def no_shm_leak():
    before = shm_entries()
    yield
    leaked = shm_entries() - before
    assert not leaked, f"shared memory left behind: {sorted(leaked)}"


def _arena_copy(tensors, arena):
    out = {}
    for n, t in tensors.items():
        out[n] = arena.empty(t.numel(), t.dtype).view(t.shape)
        out[n].copy_(t)
    return out


@pytest.mark.parametrize("backend, mode, bucket", [
    ("shm", "one_copy", 1 << 20), ("shm", "staged", 7), ("shm", "staged", 4096),
    ("gloo", "staged", 7), ("gloo", "staged", 1 << 20),
])
def test_every_dtype_arrives_bit_exact(zoo_file, backend, mode, bucket):
    path, tensors = zoo_file
    arena = SharedArena() if mode == "one_copy" else None
    source = _arena_copy(tensors, arena) if arena else scatter(tensors)
    assert any(not t.is_contiguous() for t in source.values()) or arena
    with WeightSender(source, bucket_bytes=bucket, checksums=True, arena=arena, backends=[backend]) as sender:
        offer = sender.offer(version=3)
        assert offer.one_copy == (mode == "one_copy")
        peer = Peer("receive", "--file", str(path), "--backend", backend)
        peer.send(encode(offer))
        ans = decode(pb.Answer, peer.line("ANSWER"))
        report = sender.send(offer, [ans], timeout=60)
        result = peer.result()
    assert result == {**result, "ok": True, "verified": True}
    assert report.nbytes == sum(t.numel() * t.element_size() for t in tensors.values())
    if arena:
        arena.close()


def test_one_sender_many_receivers_mixed_backends_and_ranks(zoo_file):
    path, tensors = zoo_file
    peers = {"a": [Peer("receive", "--file", str(path), "--receiver-id", "a")],
             "b": [Peer("receive", "--file", str(path), "--receiver-id", "b", "--backend", "gloo")],
             "tp": [Peer("receive", "--file", str(path), "--receiver-id", "tp", "--ranks", "2", "--backend", "gloo"),
                    Peer("receive", "--file", str(path), "--receiver-id", "tp", "--ranks", "2", "--rank", "1")]}
    with WeightSender(tensors, bucket_bytes=1000, checksums=True) as sender:
        offer = sender.offer(version=1)
        answers = []
        for group in peers.values():
            group[0].send(encode(offer))
            answers.append(decode(pb.Answer, group[0].line("ANSWER")))
            for extra in group[1:]:
                extra.send(encode(offer))
                extra.send(encode(answers[-1]))
        report = sender.send(offer, answers, timeout=60)
    assert [a.backend for a in answers] == [pb.BACKEND_SHM, pb.BACKEND_GLOO, pb.BACKEND_GLOO]
    assert report.backends == {"shm": 1, "gloo": 3}
    stages = {"connect", "data", "receiver_map", "receiver_copy", "receiver_release", "receiver_verify",
              "receiver_join", "receiver_broadcast"}
    assert set(report.profile) == stages and all(v >= 0 for v in report.profile.values())
    for group in peers.values():
        for p in group:
            assert p.result()["verified"] is True


def test_wrong_token_is_refused_and_sender_waits_for_the_right_receiver(zoo_file):
    _, tensors = zoo_file
    with WeightSender(tensors) as sender:
        offer = sender.offer(version=1)
        forged = pb.Offer()
        forged.CopyFrom(offer)
        forged.token = "0" * 32
        ans = answer(offer, "r")
        errors = []
        t = threading.Thread(target=lambda: errors.append(_catch(lambda: sender.send(offer, [ans], timeout=3))))
        t.start()
        with pytest.raises(PermissionDenied, match="wrong transfer token"):
            receive(forged, ans, {n: torch.empty_like(v) for n, v in tensors.items()}, timeout=10)
        t.join()
    assert isinstance(errors[0], DeadlineExceeded) and "waiting for 1 receiver rank" in str(errors[0])


def _catch(fn):
    try:
        fn()
    except Exception as e:  # noqa: BLE001
        return e
    return None


@pytest.fixture(scope="module")
def big_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("big") / "big.safetensors"
    save_file({f"w{i}": torch.randn(1024, 1024) for i in range(16)}, str(path))  # 64 MiB
    return path


@pytest.mark.parametrize("backend", ["shm", "gloo"])
def test_sender_killed_mid_transfer_fails_the_receiver_fast(big_file, backend):
    sender = Peer("send", "--file", str(big_file), "--backend", backend, "--bucket-bytes", str(64 << 10), "--staged")
    offer = decode(pb.Offer, sender.line("OFFER"))
    ans = answer(offer, "victim", force=backend)
    sender.send(encode(ans))
    got = []

    def on_tensor(name, tensor):
        got.append(name)
        if len(got) == 1:
            os.kill(sender.proc.pid, signal.SIGKILL)

    start = time.monotonic()
    with pytest.raises((Unavailable, DeadlineExceeded)) as e:
        receive(offer, ans, on_tensor, timeout=60)
    assert time.monotonic() - start < 30
    assert isinstance(e.value, Unavailable), f"a dead sender is noticed at once, not at the deadline: {e.value}"
    assert 1 <= len(got) < 16
    sender.kill()


@pytest.mark.parametrize("backend", ["shm", "gloo"])
def test_receiver_killed_mid_transfer_fails_the_sender_fast(big_file, backend):
    from safetensors.torch import load_file

    tensors = load_file(str(big_file))
    with WeightSender(tensors, bucket_bytes=64 << 10, backends=[backend]) as sender:
        offer = sender.offer(version=1)
        peer = Peer("receive", "--backend", backend, "--inject", "fault_injection",
                    env={"RLSYNC_FAULT": "die_after:3"})
        peer.send(encode(offer))
        ans = decode(pb.Answer, peer.line("ANSWER"))
        start = time.monotonic()
        with pytest.raises(Unavailable):
            sender.send(offer, [ans], timeout=60)
        assert time.monotonic() - start < 30


@pytest.mark.parametrize("backend", ["shm", "gloo"])
def test_corrupted_bucket_is_detected_before_the_data_is_used(zoo_file, backend):
    path, tensors = zoo_file
    sender = Peer("send", "--file", str(path), "--backend", backend, "--bucket-bytes", "512", "--staged",
                  "--checksums", "--inject", "fault_injection", env={"RLSYNC_FAULT": "bad_checksum"})
    offer = decode(pb.Offer, sender.line("OFFER"))
    ans = answer(offer, "r", force=backend)
    sender.send(encode(ans))
    with pytest.raises(DataLoss, match="corrupted.*must not be used"):
        receive(offer, ans, {n: torch.empty_like(t) for n, t in tensors.items()}, timeout=60)
    result = sender.result()
    assert not result["ok"] and "DataLoss" in result["error"]
    sender.kill()


def test_stalled_sender_hits_the_receiver_deadline(zoo_file):
    _, tensors = zoo_file
    with WeightSender(tensors) as sender:
        offer = sender.offer(version=1)  # ... and never sends
        ans = answer(offer, "r")
        start = time.monotonic()
        with pytest.raises(DeadlineExceeded, match="deadline of 2s passed while waiting for the sender"):
            receive(offer, ans, {n: torch.empty_like(t) for n, t in tensors.items()}, timeout=2)
        assert time.monotonic() - start < 5


def test_destination_of_another_dtype_is_cast(zoo_file):
    _, tensors = zoo_file
    src = {"big": tensors["big"]}
    with WeightSender(src, bucket_bytes=1 << 12) as sender:
        offer = sender.offer(version=1)
        ans = answer(offer, "r")
        dest = {"big": torch.empty(257, 129, dtype=torch.bfloat16)}
        t = threading.Thread(target=sender.send, args=(offer, [ans]))
        t.start()
        receive(offer, ans, dest, timeout=30)
        t.join()
    assert torch.equal(dest["big"], tensors["big"].to(torch.bfloat16))


@pytest.mark.parametrize("backend", ["shm", "gloo"])
def test_transfer_check_cli(zoo_file, backend):
    path, _ = zoo_file
    out = subprocess.run([sys.executable, "-m", "rlsync.transfer.check", "--backend", backend, "--bucket-bytes",
                          "333", "--checksums", str(path)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert report["verified"] is True and report["backend"] == backend
    assert set(report) >= {"backend", "bytes", "tensors", "seconds", "GB/s", "verified"}


def test_one_copy_hands_over_more_descriptors_than_one_message_can_carry(tmp_path):
    tensors = {f"t{i}": torch.full((1024,), float(i)) for i in range(300)}
    path = tmp_path / "many.safetensors"
    save_file(tensors, str(path))
    arena = SharedArena(chunk_bytes=4096)  # one region per tensor: 300 descriptors
    source = _arena_copy(tensors, arena)
    assert len(arena.buffers) == 300
    with WeightSender(source, arena=arena, backends=["shm"]) as sender:
        offer = sender.offer(version=1)
        peer = Peer("receive", "--file", str(path))
        peer.send(encode(offer))
        sender.send(offer, [decode(pb.Answer, peer.line("ANSWER"))], timeout=60)
        assert peer.result()["verified"] is True
    arena.close()


@pytest.mark.parametrize("backend", ["gloo", "shm"])
def test_repeated_transfers_reuse_the_channel_and_stay_exact(zoo_file, backend):
    path, tensors = zoo_file
    peer = Peer("receive", "--file", str(path), "--backend", backend, "--loop")
    with WeightSender(tensors, bucket_bytes=999, checksums=True, backends=[backend]) as sender:
        for version in (1, 2, 3):
            offer = sender.offer(version=version)
            peer.send(encode(offer))
            sender.send(offer, [decode(pb.Answer, peer.line("ANSWER"))], timeout=60)
            assert peer.result()["verified"] is True
        groups = [k for k in sender.cache if k[0] == "group"]
        assert len(groups) == (1 if backend == "gloo" else 0), "one broadcast group, built once, reused"
    peer.proc.stdin.close()
    assert peer.proc.wait(30) == 0
