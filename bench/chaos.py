"""Chaos: the RL loop runs (generate a batch through the gateway, train, sync verified) while a
member of the fleet (a replica, the trainer or the coordinator) is hit at random moments: killed with
SIGKILL and started again, or hung (SIGSTOP for 2-20 s, every process of it, then SIGCONT: a stuck
kernel, a frozen container). Prints one JSON object: kills and hangs per member, steps, syncs (and
how many verified), the longest and median sync, requests sent, completed, lost, duplicated, the
versions served, the calls the loop had to retry (by status) and any call stuck past its deadline.

    python bench/chaos.py --faults kill,hang --kills 20
    python bench/chaos.py --faults kill,hang --kills 20 --engine vllm
    python bench/chaos.py --faults kill,hang --kills 20 --burn 4   # 4 busy loops starve the CPU throughout

The loop behaves as an RL job would: a call that fails because a member is down is retried once
the fleet answers again (a generation with the same request id: the client keeps at most one
completion per id); the trainer is restored from the last step's checkpoint when it comes back
fresh. "Lost": a request that never completed within its deadline. "Duplicated": a request id with
two completions, or more tokens than it asked for.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import signal
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import grpc

from rlsync.client import CoordinatorClient, RpcError, TrainerClient, collect, generate_request, trajectory
from rlsync.launch import ServiceProcess

sys.path.insert(0, str(Path(__file__).resolve().parent))
from burn import burning  # noqa: E402
from fleet_metrics import add, liveness  # noqa: E402

DEADLINE = 120.0  # no call may take longer, whatever is killed
LEASE = 1.5  # the coordinator's --lease
ENGINE_ARGS = {"hf": {}, "vllm": {"enforce_eager": True, "kv_cache_memory_bytes": 64 << 20, "max_num_seqs": 32}}


class Fleet:
    """The members, each restartable with the arguments (and address) it first had."""

    def __init__(self, logs: Path, replicas: int, engine: str):
        self.logs, self.lock = logs, threading.Lock()
        self.procs: dict[str, ServiceProcess] = {}
        self.liveness: dict = {}  # the coordinator's figures, summed over its restarts (fleet_metrics)
        self._start("coordinator", ["--port", "0", "--sync-mode", "async", "--lease", str(LEASE),
                                    "--heartbeat-interval", "0.3", "--metrics-port", "0"])
        self.coordinator = self.procs["coordinator"].wait_ready()
        self.args = {"coordinator": ["--port", self.coordinator.rsplit(":", 1)[1], "--sync-mode", "async",
                                     "--lease", str(LEASE), "--heartbeat-interval", "0.3", "--metrics-port", "0"],
                     "trainer": ["--port", "0", "--coordinator", self.coordinator]}
        for i in range(replicas):
            self.args[f"r{i}"] = ["--port", "0", "--coordinator", self.coordinator, "--engine", engine,
                                  "--engine-args", json.dumps(ENGINE_ARGS[engine]), "--replica-id", f"r{i}",
                                  "--coordinator-lease", "10"]
        for name in self.args:
            if name != "coordinator":
                self._start(name, self.args[name])
        for p in self.procs.values():
            p.wait_ready(300)

    def _start(self, name: str, args: list[str]) -> None:
        service = "rollout" if name.startswith("r") else name
        self.procs[name] = ServiceProcess(service, args, log_path=self.logs / f"{name}.log", name=name)

    def bank_liveness(self) -> None:
        """Adds the running coordinator's liveness figures to the total (before it is killed, and at the end)."""
        try:
            add(self.liveness, liveness(self.procs["coordinator"].http_address("metrics", timeout=10)))
        except Exception as e:  # noqa: BLE001 - a figure missing is reported, not fatal
            self.liveness.setdefault("unread", []).append(str(e))

    def kill_and_restart(self, name: str, down_seconds: float) -> None:
        with self.lock:
            if name == "coordinator":
                self.bank_liveness()
            self.procs[name].kill()
            self.procs[name].proc.wait(30)
            time.sleep(down_seconds)
            self._start(name, self.args[name])
            self.procs[name].wait_ready(300)

    def hang(self, name: str, seconds: float) -> None:
        """Every process of the member stops (its process group: engine workers too), then goes on."""
        with self.lock:
            group = os.getpgid(self.procs[name].proc.pid)
            os.killpg(group, signal.SIGSTOP)
            try:
                time.sleep(seconds)
            finally:
                os.killpg(group, signal.SIGCONT)

    def address(self, name: str) -> str:
        """The member's current address; a member still starting again is unavailable, as a call to
        it would be."""
        address = self.procs[name].address
        if address is None:
            raise RpcError(grpc.StatusCode.UNAVAILABLE, f"{name} is starting again")
        return address

    def stop(self) -> None:
        for p in reversed(list(self.procs.values())):
            p.stop()


def retrying(call, what: str, stats: dict):
    """Runs `call` until it succeeds; a failure while a member is down is retried, a call that
    cannot succeed within DEADLINE is a hang."""
    start = time.monotonic()
    while True:
        try:
            return call()
        except RpcError as e:
            if time.monotonic() - start > DEADLINE:
                stats["stuck_calls"].append(f"{what}: {e}")
                raise
            stats["retries"][e.code.name] = stats["retries"].get(e.code.name, 0) + 1
            time.sleep(0.5)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kills", type=int, default=10, help="faults to inject (kills or hangs)")
    parser.add_argument("--faults", default="kill", help="comma-separated: kill, hang")
    parser.add_argument("--engine", default="hf", choices=sorted(ENGINE_ARGS))
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--batch", type=int, default=8, help="requests per step")
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--logs", default="runs/chaos")
    parser.add_argument("--burn", type=int, default=0, help="busy-loop processes starving the CPU throughout")
    args = parser.parse_args()
    rng = random.Random(args.seed)
    logs = Path(args.logs)
    logs.mkdir(parents=True, exist_ok=True)
    checkpoint = tempfile.mkdtemp(prefix="rlsync-chaos-")
    faults = args.faults.split(",")
    burn = contextlib.ExitStack()  # the busy loops, stopped when the loop ends (or the fleet cannot start)
    if args.burn:
        burn.enter_context(burning(args.burn))
    try:
        fleet = Fleet(logs, args.replicas, args.engine)
    except BaseException:
        burn.close()
        raise
    stats: dict = {"engine": args.engine, "kills": {}, "hangs": {}, "hang_seconds": [], "steps": 0, "syncs": 0,
                   "verified": 0, "sync_seconds": [], "sent": 0, "completed": 0, "lost": 0, "duplicated": 0,
                   "versions_served": set(), "stuck_calls": [], "trainer_restored": 0, "retries": {}}
    done = threading.Event()

    def chaos() -> None:
        for _ in range(args.kills):
            if done.wait(rng.uniform(2.0, 6.0)):
                return
            victim, fault = rng.choice(list(fleet.args)), rng.choice(faults)
            stats["kills" if fault == "kill" else "hangs"][victim] = \
                stats["kills" if fault == "kill" else "hangs"].get(victim, 0) + 1
            if fault == "kill":
                fleet.kill_and_restart(victim, rng.uniform(0.0, 2.0))
            else:
                stats["hang_seconds"].append(round(seconds := rng.uniform(2.0, 20.0), 1))
                fleet.hang(victim, seconds)

    client = CoordinatorClient(fleet.coordinator, timeout=DEADLINE)
    start = time.monotonic()
    try:
        client.wait_ready(args.replicas + 1, timeout=300)
        killer = threading.Thread(target=chaos, daemon=True)
        killer.start()
        step = 0
        while killer.is_alive() or step < 3:
            step += 1
            batch = []
            for i in range(args.batch):
                rid = f"s{step}-{i}"
                stats["sent"] += 1

                def one(rid=rid, i=i, step=step):
                    request = generate_request("3+4=", request_id=rid, max_tokens=args.max_tokens,
                                               ignore_eos=True, temperature=1.0, logprobs=True, seed=step * 100 + i)
                    return collect(client.stream(request))

                try:
                    got = retrying(one, f"generate {rid}", stats)
                except RpcError:
                    stats["lost"] += 1
                    continue
                if len(got) != 1 or len(got[0].token_ids) != args.max_tokens:
                    stats["duplicated" if len(got) > 1 or len(got[0].token_ids) > args.max_tokens
                          else "lost"] += 1
                    continue
                stats["completed"] += 1
                stats["versions_served"] |= set(got[0].token_versions)
                batch.append(got[0])

            def train_and_sync(step=step, batch=batch):
                trainer = TrainerClient(fleet.address("trainer"))
                if trainer.state().step < step - 1:  # a fresh trainer: restore the last step
                    trainer.load_checkpoint(checkpoint)
                    stats["trainer_restored"] += 1
                if trainer.state().step < step:
                    client.train([trajectory(c, reward=float(i % 2), group_id="g") for i, c in enumerate(batch)])
                begun = time.monotonic()
                sync = client.sync_weights(verify=True)
                stats["sync_seconds"].append(time.monotonic() - begun)
                TrainerClient(fleet.address("trainer")).save_checkpoint(checkpoint)
                return sync

            sync = retrying(train_and_sync, f"step {step}", stats)
            stats["steps"] = step
            stats["syncs"] += 1
            stats["verified"] += bool(sync.verified)
    finally:
        done.set()
        seconds = time.monotonic() - start
        stats["loadavg_1m"] = os.getloadavg()[0]
        burn.close()
        fleet.bank_liveness()
        fleet.stop()
    served = sorted(stats["versions_served"])
    stats["versions_served"] = {"count": len(served), "first": served[0] if served else None,
                                "last": served[-1] if served else None}
    stats["seconds"] = round(seconds, 1)
    synced = stats.pop("sync_seconds")  # the successful syncs' own time (a failed attempt is a retry)
    stats["longest_sync_s"] = round(max(synced, default=0.0), 2)
    stats["median_sync_s"] = round(statistics.median(synced), 3) if synced else None
    stats["lease_s"] = LEASE
    stats["burn"], stats["cores"], stats["liveness"] = args.burn, os.cpu_count(), fleet.liveness
    print(json.dumps(stats, indent=1))
    sys.exit(0 if not stats["lost"] and not stats["duplicated"] and stats["verified"] == stats["syncs"]
             and not stats["stuck_calls"] else 1)


if __name__ == "__main__":
    main()
