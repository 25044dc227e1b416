"""FleetManager: the detached Ray actor that places a fleet and keeps it as its file says.

It owns one placement group per placement unit and one ServiceHost per member:
- async: the coordinator and the trainer (all its ranks) share one bundle, the "control" unit;
  every replica gets a bundle of its own, so no two share a GPU;
- colocated: one bundle holds them all; the trainer and its replicas split its GPU.
Replicas find the coordinator through the manager (it hands each member the address the
coordinator listens on), never through a typed address. A loop tends every member: a replica
that exits or whose node is lost leaves (the coordinator's lease takes it out of rotation, the
gateway resumes its requests elsewhere), and, if its group says restart, a new placement group
waits for resources (a node coming back) and the replica starts again; the coordinator catches it
up before it takes traffic. Scaling adds replicas the same way and removes them by draining
(SIGTERM: out of rotation, requests in flight finish or move).

Every method takes and returns plain values; refusals come back as {"error": ...}.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass, field

import ray
from ray.exceptions import RayActorError
from ray.util.placement_group import PlacementGroup, placement_group, placement_group_table, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from rlsync.errors import InvalidArgument
from rlsync.fleet.host import ServiceHost
from rlsync.fleet.spec import FleetSpec, RolloutGroup, decode

log = logging.getLogger(__name__)
TEND_SECONDS = 0.5
NODE_WATCH_TICKS = 4  # the node table is read every 4 ticks
WAITING_NOTE = 10.0  # seconds pending before the launcher is told what is missing
MAX_BACKOFF = 30.0  # seconds: the longest pause before restarting a replica that died young
START_TRIES = 2  # up and scale give up on a replica that ended this often without ever listening
START_TIMEOUT = 300.0


@dataclass(eq=False)
class Member:
    name: str  # coordinator, trainer, <group>-<i>
    role: str  # coordinator | trainer | rollout
    group: str
    unit: str  # the placement unit (its placement group) it lives in
    bundle: dict[str, float]  # what it takes of the unit's bundle
    state: str = "pending"  # pending (waiting for resources) -> starting -> running; exited | lost | stopped
    host: object | None = None
    node_id: str = ""
    ip: str = ""
    address: str = ""
    pid: int = 0
    log: str = ""
    restarts: int = 0
    pending_since: float = field(default_factory=time.monotonic)
    told_waiting: bool = False
    started_at: float = 0.0
    last_end: str = ""  # how its last run ended (exit status and log tail)
    not_before: float = 0.0  # a replica that keeps dying young is started again after a growing pause
    listened: bool = False  # it reached running once (a crash loop from the start is a bad setup)

    @property
    def ended(self) -> str:
        """How it ended, while it stays ended (a replica being restarted is pending again)."""
        return self.last_end if self.state in ("exited", "lost") else ""

    @property
    def cannot_start(self) -> bool:
        """It ended START_TRIES times and never listened: restarting it again will not help up or scale."""
        return not self.listened and self.restarts >= START_TRIES and self.state != "running"
    task: asyncio.Task | None = field(default=None, repr=False)


@ray.remote(num_cpus=0, max_concurrency=64)
class FleetManager:
    def __init__(self, spec_json: str):
        self.spec: FleetSpec = decode(spec_json)
        self.members: dict[str, Member] = {}
        self.units: dict[str, PlacementGroup] = {}
        self.events: list[dict] = []
        self.coordinator = ""
        self.nodes: dict[str, str] = _alive_nodes()
        self._closing = False
        self._tend_task: asyncio.Task | None = None

    # ---- the API (plain values in and out) ---------------------------------------------------------
    async def start(self, timeout: float = START_TIMEOUT) -> dict:
        """Places the coordinator, then the trainer and every replica; returns once each listens."""
        spec, t = self.spec, self.spec.trainer
        coordinator = {"CPU": spec.coordinator.cpus}
        if spec.sync == "colocated":  # one bundle: the trainer and its replicas split its GPU
            g = spec.rollout[0]
            gpu = max(t.gpus_per_rank, g.gpus)
            unit, trainer = "colocated", {"CPU": t.cpus, "GPU": gpu / (g.replicas + 1)}
            replica = {"CPU": g.cpus, "GPU": gpu / (g.replicas + 1)}
            self._place(unit, {**t.resources, **g.resources, "CPU": coordinator["CPU"] + t.cpus + g.cpus * g.replicas,
                               "GPU": gpu})
        else:
            unit, trainer = "control", {"CPU": t.cpus * t.nproc, "GPU": t.gpus_per_rank * t.nproc}
            self._place(unit, {**t.resources, "CPU": coordinator["CPU"] + trainer["CPU"], "GPU": trainer["GPU"]})
        first = self._add("coordinator", "coordinator", "coordinator", coordinator, unit)
        self._tend_task = asyncio.get_running_loop().create_task(self._tend_forever())
        try:
            await self._until(lambda: first.state == "running", timeout, first)
        except Exception as e:  # noqa: BLE001 - reported as a value
            return {"error": str(e)}
        self.coordinator = first.address
        self._add("trainer", "trainer", "trainer", trainer, unit)
        for g in spec.rollout:
            for i in range(g.replicas):
                if spec.sync == "colocated":
                    self._add(f"{g.name}-{i}", "rollout", g.name, replica, unit)
                else:
                    self._add(f"{g.name}-{i}", "rollout", g.name, _replica(g))
        waiting = [m for m in self.members.values() if m.role != "coordinator"]
        try:
            await self._until(lambda: all(m.state == "running" or m.ended for m in waiting), timeout, *waiting)
        except Exception as e:  # noqa: BLE001
            return {"error": str(e), "coordinator": self.coordinator}
        return {"coordinator": self.coordinator}

    async def scale(self, group: str, replicas: int, timeout: float = START_TIMEOUT) -> dict:
        """Sets a rollout group's replica count: new replicas start (and are caught up by the
        coordinator before they take traffic); removed ones drain, newest first."""
        try:
            g = self.spec.group(group)
            if self.spec.sync == "colocated":
                raise InvalidArgument("colocated replicas share the trainer's GPU: their number is the fleet file's")
            if replicas < 0:
                raise InvalidArgument(f"replicas must be >= 0, got {replicas}")
        except InvalidArgument as e:
            return {"error": str(e), "refused": True}
        current = sorted((m for m in self.members.values() if m.role == "rollout" and m.group == group),
                         key=lambda m: _index(m.name))
        g.replicas = replicas
        added, removed = [], current[replicas:][::-1]  # the newest go first
        taken = {_index(m.name) for m in current}
        free = (i for i in range(len(current) + replicas) if i not in taken)
        while len(current) + len(added) < replicas:
            added.append(self._add(f"{group}-{next(free)}", "rollout", group, _replica(g)))
        self._event("fleet", "scaled", f"{group}: {len(current)} -> {replicas} replicas")
        await asyncio.gather(*(self._remove(m, "scaled down") for m in removed))
        try:
            await self._until(lambda: all(m.state == "running" or m.ended for m in added), timeout, *added)
        except Exception as e:  # noqa: BLE001
            return {"error": str(e)}
        return {"group": group, "replicas": replicas, "added": [m.name for m in added],
                "removed": [m.name for m in removed]}

    async def status(self) -> dict:
        return {"name": self.spec.name, "coordinator": self.coordinator, "sync": self.spec.sync,
                "members": [_describe(m) for m in self.members.values()]}

    async def events_since(self, seq: int) -> list[dict]:
        return [e for e in self.events if e["seq"] > seq]

    async def log_tail(self, name: str, lines: int = 40) -> str:
        m = self.members.get(name)
        if m is None or m.host is None:
            return f"no running member {name!r}"
        try:
            return await m.host.log_tail.remote(lines)
        except RayActorError as e:
            return f"{name} is gone: {e}"

    async def down(self) -> dict:
        """Stops replicas (draining), then the trainer, then the coordinator; frees every placement."""
        self._closing = True
        if self._tend_task is not None:
            self._tend_task.cancel()
        order = ["rollout", "trainer", "coordinator"]
        for role in order:
            await asyncio.gather(*(self._remove(m, "fleet down") for m in list(self.members.values())
                                   if m.role == role))
        for unit in list(self.units):
            self._free(unit)
        return {"stopped": True}

    # ---- placing and tending members -----------------------------------------------------------------
    def _add(self, name: str, role: str, group: str, bundle: dict[str, float], unit: str | None = None) -> Member:
        """A member taking `bundle` of its unit's placement group (its own one when `unit` is None)."""
        m = Member(name, role, group, unit or name, {k: v for k, v in bundle.items() if v > 0})
        self.members[name] = m
        if m.unit not in self.units:
            self._place(m.unit, bundle)
        self._event(name, "placing", f"{_show(bundle)} in placement unit {m.unit!r}")
        return m

    def _place(self, unit: str, bundle: dict[str, float]) -> None:
        self.units[unit] = placement_group([_nonzero(bundle)], strategy="STRICT_PACK",
                                           name=f"{self.spec.name}:{unit}")

    def _placed(self, unit: str) -> bool:
        pg = self.units.get(unit)
        return pg is not None and placement_group_table(pg).get("state") == "CREATED"

    def _free(self, unit: str) -> None:
        pg = self.units.pop(unit, None)
        if pg is not None:
            try:
                remove_placement_group(pg)
            except Exception:  # noqa: BLE001 - already gone with its node
                pass

    async def _tend_forever(self) -> None:
        tick = 0
        while not self._closing:
            try:
                if tick % NODE_WATCH_TICKS == 0:
                    self._watch_nodes(await asyncio.to_thread(_alive_nodes))
                for m in list(self.members.values()):
                    if m.task is None or m.task.done():
                        m.task = asyncio.get_running_loop().create_task(self._tend(m))
            except Exception as e:  # noqa: BLE001 - a hiccup of Ray's must not stop the tending
                self._event("fleet", "error", f"tending the fleet: {type(e).__name__}: {e}")
            tick += 1
            await asyncio.sleep(TEND_SECONDS)

    def _watch_nodes(self, alive: dict[str, str]) -> None:
        """Reports nodes that join the cluster or leave it (with the members that ran there)."""
        for node, ip in alive.items():
            if node not in self.nodes:
                self._event("cluster", "node-joined", f"node {node[:12]} ({ip})")
        for node, ip in self.nodes.items():
            if node not in alive:
                ran = [m.name for m in self.members.values() if m.node_id == node]
                self._event("cluster", "node-lost", f"node {node[:12]} ({ip}) left the cluster; it ran "
                            f"{', '.join(ran) or 'no member'}")
        self.nodes = alive

    async def _tend(self, m: Member) -> None:
        try:
            if m.state == "pending" and time.monotonic() >= m.not_before and self._placed(m.unit):
                await self._launch(m)
            elif (m.state == "pending" and not m.told_waiting and time.monotonic() - m.pending_since > WAITING_NOTE
                  and not self._placed(m.unit)):
                m.told_waiting = True
                free = {k: round(v, 2) for k, v in ray.available_resources().items()
                        if k in ("CPU", "GPU") or k in m.bundle}
                self._event(m.name, "waiting", f"no node has {_show(m.bundle)} free for placement unit "
                            f"{m.unit!r} yet (free in the cluster: {free}); it starts when one has")
            elif m.state in ("starting", "running"):
                ended = await m.host.poll.remote()
                if ended:
                    tail = await m.host.log_tail.remote(20)
                    await self._ended(m, "exited", f"{ended}\n{tail}")
        except Exception as e:  # noqa: BLE001 - a member must not stop the others being tended
            if self._closing or m.state == "stopped":
                return
            if isinstance(e, RayActorError) and m.node_id and m.node_id not in await asyncio.to_thread(_alive_nodes):
                await self._ended(m, "lost", f"its node {m.node_id[:12]} ({m.ip}) left the cluster")
            else:  # it could not start, or its host died on a live node
                await self._ended(m, "exited", f"{type(e).__name__}: {str(e)[:2000]}")

    async def _launch(self, m: Member) -> None:
        m.state, m.started_at = "starting", time.monotonic()
        service, args, script = self._command(m)
        # Threads per process from what the member was given (Ray sets OMP_NUM_THREADS to a whole
        # bundle's CPUs, which every rank of a trainer would take), unless the file says otherwise.
        threads = max(1, int(self.spec.trainer.cpus if m.role == "trainer" else m.bundle.get("CPU", 1)))
        env = {"OMP_NUM_THREADS": str(threads), **self.spec.env, "RLSYNC_TOKEN": self.spec.token}
        if m.role != "coordinator":
            env["RLSYNC_COORDINATOR"] = self.coordinator
        options = {"scheduling_strategy": PlacementGroupSchedulingStrategy(self.units[m.unit], 0),
                   "num_cpus": m.bundle.get("CPU", 0), "num_gpus": m.bundle.get("GPU", 0)}
        log_dir = f"{self.spec.log_dir}/{self.spec.name}"
        m.host = ServiceHost.options(**options).remote(m.name, service, args, env, log_dir, script,
                                                       self.spec.trainer.nproc)
        where = await m.host.where.remote()
        m.node_id, m.ip, m.pid, m.log = where["node_id"], where["ip"], where["pid"], where["log"]
        niceness = "" if where["niceness"] in (0, None) else (
            f"; niceness {where['niceness']}, inherited from its Ray worker (start Ray with RAY_worker_niceness=0, "
            "or let the node's Ray run as root, for a member to run at 0)")
        self._event(m.name, "started", f"pid {m.pid} on node {m.node_id[:12]} ({m.ip}); log {m.log}{niceness}")
        if script is not None:  # a user's script announces nothing: it runs
            m.state = "running"
            return
        m.address = await m.host.wait_ready.remote(START_TIMEOUT)
        m.state, m.listened = "running", True
        self._event(m.name, "listening", m.address)

    def _command(self, m: Member) -> tuple[str, list[str], list[str] | None]:
        """(service, flags, script): every member's command line; node-level settings go through
        the environment (ServiceHost), role-level ones as flags, the fleet file's `args` last."""
        s = self.spec
        if m.role == "coordinator":
            return "coordinator", ["--port", str(s.coordinator.port), "--sync-mode", s.sync, *s.coordinator.args], None
        if m.role == "trainer":
            t = s.trainer
            if t.script:  # the host runs it with its node's Python (torchrun for several ranks)
                return "trainer", [], [t.script, *t.args]
            return "trainer", ["--port", "0", "--model", s.model, "--nproc", str(t.nproc), *t.args], None
        g = s.group(m.group)
        return "rollout", ["--port", "0", "--engine", g.engine, "--model", s.model, "--replica-id", m.name,
                           "--engine-args", json.dumps(g.engine_args), *g.args], None

    async def _ended(self, m: Member, state: str, why: str) -> None:
        if m.state in ("stopped", "exited", "lost"):
            return
        m.state, m.last_end = state, why
        self._event(m.name, state, why)
        host, m.host = m.host, None
        if host is not None:
            ray.kill(host)
        if self.members.get(m.name) is not m or self._closing or m.role != "rollout":
            return  # the trainer and the coordinator stay as they ended, for status to show
        if not self.spec.group(m.group).restart:  # gone for good: it no longer counts as a replica
            del self.members[m.name]
            self._free_if_unused(m.unit)
            return
        m.restarts += 1
        lived = time.monotonic() - m.started_at
        pause = 0.0 if state == "lost" or lived > MAX_BACKOFF else min(2.0 ** m.restarts, MAX_BACKOFF)
        m.state, m.address = "pending", ""
        m.pending_since, m.told_waiting, m.not_before = time.monotonic(), False, time.monotonic() + pause
        if m.unit == m.name:  # its own placement: place it again (a lost node's bundle waits for a node)
            self._free(m.unit)
            self._place(m.unit, _replica(self.spec.group(m.group)))
        self._event(m.name, "restarting", f"restart {m.restarts}" + (f" in {pause:.0f}s (it lived {lived:.0f}s)"
                    if pause else "") + f": waiting for {_show(m.bundle)}")

    async def _remove(self, m: Member, why: str) -> None:
        """Drains and stops a member (SIGTERM, then SIGKILL after the grace), frees its placement."""
        if self.members.get(m.name) is m:
            del self.members[m.name]
        if m.task is not None:
            m.task.cancel()
        host, m.host, m.state = m.host, None, "stopped"
        if host is not None:
            try:
                self._event(m.name, "stopped", f"{why}: {await host.stop.remote(30.0)}")
            except RayActorError:
                self._event(m.name, "stopped", f"{why}: it was already gone")
            ray.kill(host)
        self._free_if_unused(m.unit)

    def _free_if_unused(self, unit: str) -> None:
        if not any(o.unit == unit for o in self.members.values()):
            self._free(unit)

    async def _until(self, done, timeout: float, *watched: Member) -> None:
        deadline = time.monotonic() + timeout
        while not done():
            ended = [m for m in watched if m.ended]
            if ended:
                raise RuntimeError("; ".join(f"{m.name} {m.state}: {m.ended}" for m in ended))
            failing = [m for m in watched if m.cannot_start]
            if failing:  # it is restarted still (the fleet stays as its file says); up and scale stop waiting
                raise RuntimeError("; ".join(_why_not_running(m) for m in failing))
            if time.monotonic() > deadline:
                raise TimeoutError(f"not running after {timeout:.0f}s: " + "; ".join(
                    _why_not_running(m) for m in watched if m.state != "running"))
            await asyncio.sleep(0.1)

    def _event(self, member: str, kind: str, detail: str) -> None:
        event = {"seq": len(self.events) + 1, "time": time.time(), "member": member, "kind": kind, "detail": detail}
        self.events.append(event)
        log.info("%s %s: %s", member, kind, detail)


def _replica(g: RolloutGroup) -> dict[str, float]:
    """One replica's bundle: its CPUs, GPUs and custom resources."""
    return {**g.resources, "CPU": g.cpus, "GPU": g.gpus}


def _why_not_running(m: Member) -> str:
    if m.restarts:  # it ran and keeps ending: say how it last did
        return f"{m.name} ({m.state}; ended {m.restarts} times, last: {m.last_end[-600:]})"
    if m.state == "pending":
        return f"{m.name} (pending: no node has {_show(m.bundle)} free)"
    return f"{m.name} ({m.state})"


def _alive_nodes() -> dict[str, str]:
    """Node id -> address of every live node (a call to Ray's control store)."""
    return {n["NodeID"]: n.get("NodeManagerAddress", "") for n in ray.nodes() if n["Alive"]}


def _nonzero(bundle: dict[str, float]) -> dict[str, float]:
    return {k: v for k, v in bundle.items() if v > 0} or {"CPU": 0.01}


def _show(bundle: dict[str, float]) -> str:
    return ", ".join(f"{v:g} {k}" for k, v in bundle.items() if v > 0) or "nothing"


def _index(name: str) -> int:
    return int(name.rpartition("-")[2])


def _describe(m: Member) -> dict:
    return {"name": m.name, "role": m.role, "group": m.group, "state": m.state, "node_id": m.node_id, "ip": m.ip,
            "address": m.address, "pid": m.pid, "log": m.log, "restarts": m.restarts, "ended": m.ended}
