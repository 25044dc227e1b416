"""A fleet on a multi-node Ray cluster made on this machine (Ray's test cluster utilities): RL steps
with every sync verified, the backend each replica's handshake chose, and how long a replica added by
`scale` takes to listen, to be caught up, and to take its first request while traffic flows.
Prints one JSON object.

    python bench/ray_fleet.py                 # 1 + 2 nodes, hf engine, 3 RL steps
    python bench/ray_fleet.py --nodes 3 --steps 5

The head node runs the coordinator, the trainer and one replica (`near`: shm to the trainer); every
other node runs one replica (`far`: gloo across nodes). The limit beside the sync figures is a
memory copy of the same bytes on this machine, measured in the same run: all of these "nodes" share
one host's memory bus and cores, so cross-node figures here measure rlsync's path, not a network.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import threading
import time
from pathlib import Path

import ray
from ray.cluster_utils import Cluster

sys.path.insert(0, str(Path(__file__).resolve().parent))
from transfer import memcpy_limit  # noqa: E402

from rlsync.client import RolloutClient  # noqa: E402
from rlsync.demo.loop import LoopConfig, run_loop  # noqa: E402
from rlsync.demo.task import DigitsTask  # noqa: E402
from rlsync.fleet import parse  # noqa: E402
from rlsync.fleet.launcher import Fleet  # noqa: E402
from rlsync.models import ensure_tiny_model  # noqa: E402

FLEET = """
name: bench
coordinator: {{port: 0}}
trainer: {{resources: {{head: 1}}}}
rollout:
  - {{name: near, engine: {engine}, replicas: 1, resources: {{head: 1}}, engine_args: {engine_args}}}
  - {{name: far, engine: {engine}, replicas: {far}, resources: {{far: 1}}, engine_args: {engine_args}}}
"""
# vLLM's CPU build reserves most of the machine's memory per engine unless told a KV cache size.
ENGINE_ARGS = {"hf": {}, "vllm": {"enforce_eager": True, "kv_cache_memory_bytes": 64 << 20, "max_num_seqs": 32}}


def wait_for(predicate, timeout: float = 180.0):
    deadline = time.monotonic() + timeout
    while not (value := predicate()):
        if time.monotonic() > deadline:
            raise TimeoutError("timed out")
        time.sleep(0.05)
    return value


def replica(fleet: Fleet, name: str) -> dict:
    return next((m for m in fleet.status()["members"] if m["name"] == name), {})


def scale_to_traffic(fleet: Fleet, cluster: Cluster, far: int) -> dict:
    """Adds a node and one replica while 4 streams keep the gateway busy; times each stage."""
    stop, served = threading.Event(), []

    def load() -> None:
        with fleet.client() as c:
            while not stop.is_set():
                served.append(len(c.complete("numbers:", max_tokens=16, ignore_eos=True)[0].token_ids))

    streams = [threading.Thread(target=load) for _ in range(4)]
    [t.start() for t in streams]
    cluster.add_node(num_cpus=1, resources={"far": 1})  # the node is there: scale measures rlsync
    name = f"far-{far}"
    t0, wall0 = time.perf_counter(), time.time()
    fleet.scale("far", far + 1)
    listening = time.perf_counter() - t0
    new = wait_for(lambda: (m := replica(fleet, name))["registered"] == "ready" and m)
    ready = time.perf_counter() - t0
    with RolloutClient(new["address"]) as r:
        wait_for(lambda: r.info().requests_admitted > 0)
    traffic = time.perf_counter() - t0
    stop.set()
    [t.join() for t in streams]
    stages = {e["kind"]: round(e["time"] - wall0, 2) for e in fleet.events() if e["member"] == name}
    return {"replica": name, "events_s": stages, "listening_s": round(listening, 2),
            "caught_up_and_ready_s": round(ready, 2),
            "first_request_s": round(traffic, 2), "requests_during": len(served),
            "all_complete": all(n == 16 for n in served)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", type=int, default=2, help="nodes besides the head, one `far` replica each")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--engine", default="hf", choices=("hf", "vllm"))
    args = parser.parse_args()
    model = ensure_tiny_model()

    t0 = time.perf_counter()
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 3, "resources": {"head": 2}})
    for _ in range(args.nodes):
        cluster.add_node(num_cpus=1, resources={"far": 1})
    ray.init(address=cluster.address, namespace="rlsync", log_to_driver=False)
    cluster_s = time.perf_counter() - t0
    spec = FLEET.format(engine=args.engine, far=args.nodes, engine_args=json.dumps(ENGINE_ARGS[args.engine]))
    fleet = Fleet.up(parse(spec))
    try:
        fleet.wait_ready()
        up_s = time.perf_counter() - t0 - cluster_s

        from transformers import AutoTokenizer

        task = DigitsTask(AutoTokenizer.from_pretrained(model), 8)
        cfg = LoopConfig(steps=args.steps, prompts_per_step=4, group_size=4, max_tokens=8)
        records = asyncio.run(run_loop(fleet.coordinator, task, cfg))
        with fleet.client() as c:
            last = c.sync_weights(verify=True)  # the bytes and per-phase split of one sync
        members = fleet.status()["members"]
        nbytes = last.bytes
        limit = memcpy_limit(nbytes, 1) * 1e9  # bytes/s
        sync = [r.sync_seconds for r in records]
        replicas = [{"name": m["name"], "node": m["node_id"][:12], "same_node_as_trainer":
                     m["node_id"] == next(t["node_id"] for t in members if t["role"] == "trainer"),
                     "backend": m["backend"], "weight_version": m["weight_version"]}
                    for m in members if m["role"] == "rollout"]
        scaled = scale_to_traffic(fleet, cluster, args.nodes)
        transfer_s = last.phases.get("transfer", 0.0)
        print(json.dumps({
            "nodes": 1 + args.nodes + 1, "engine": args.engine, "replicas": replicas,
            "backends": dict(last.backends), "steps": len(records),
            "verified": all(r.weights_verified for r in records) and last.verified,
            "versions": [r.version for r in records],
            "sync_seconds_per_step": [round(s, 4) for s in sync],
            "sync_seconds_median": round(statistics.median(sync), 4),
            "phases_last_sync_ms": {k: round(v * 1e3, 2) for k, v in last.phases.items()},
            "bytes": nbytes, "transfer_gbps": round(nbytes / transfer_s / 1e9, 3) if transfer_s else None,
            "limit_memcpy_gbps": round(limit / 1e9, 2),
            "transfer_ratio_to_limit": round(nbytes / transfer_s / limit, 3) if transfer_s else None,
            "reward_first_last": [round(records[0].reward_mean, 3), round(records[-1].reward_mean, 3)],
            "scale": scaled, "cluster_start_s": round(cluster_s, 1), "fleet_up_s": round(up_s, 1),
        }))
    finally:
        fleet.down()
        ray.shutdown()
        cluster.shutdown()


if __name__ == "__main__":
    main()
