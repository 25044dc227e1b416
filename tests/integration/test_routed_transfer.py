"""Routed transfers between real processes: trainer ranks holding FSDP2 / DTensor shards send each
engine rank exactly the boxes it loads, point to point over gloo; nothing is gathered anywhere."""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

WORKER = Path(__file__).resolve().parent.parent / "routed_worker.py"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(senders: int, receivers: int, bucket: int) -> list[dict]:
    store, master = _free_port(), _free_port()
    procs = []
    for role, count in (("trainer", senders), ("engine", receivers)):
        for rank in range(count):
            env = {**os.environ, "ROLE": role, "SENDERS": str(senders), "RECEIVERS": str(receivers),
                   "RANK": str(rank), "WORLD_SIZE": str(senders), "MASTER_ADDR": "127.0.0.1",
                   "MASTER_PORT": str(master), "ROUTED_STORE": f"127.0.0.1:{store}", "BUCKET": str(bucket)}
            procs.append(subprocess.Popen([sys.executable, str(WORKER)], env=env, stdout=subprocess.PIPE,
                                          stderr=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL))
    out = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=120)
        assert p.returncode == 0, stderr[-3000:]
        out.append(json.loads(stdout.strip().splitlines()[-1]))
    return out


@pytest.mark.parametrize("senders,receivers,bucket", [(2, 2, 96), (1, 2, 50), (4, 2, 1 << 12)])
def test_each_engine_rank_receives_exactly_its_boxes_from_the_ranks_that_hold_them(senders, receivers, bucket):
    results = _run(senders, receivers, bucket)
    trainers = [r for r in results if r["role"] == "trainer"]
    engines = [r for r in results if r["role"] == "engine"]
    for e in engines:
        assert e["wrong"] == [], f"engine rank {e['rank']}: these boxes differ from the whole tensors: {e['wrong']}"
        assert e["received"] == e["loads"], "an engine rank receives its shard's bytes, ratio 1.00"
        assert {"embed", "qk", "o", "norm", "scalar"} <= set(e["tensors"])
    for t in trainers:
        assert t["layout_as_expected"], "RankShards describes FSDP2 rows, Shard(1) columns and Replicate"
        per_receiver = t["planned"]
        assert per_receiver <= t["held"], "no trainer rank sends more than it holds"
    assert sum(t["sent"] for t in trainers) == sum(e["received"] for e in engines)
