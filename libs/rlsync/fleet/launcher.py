"""The launcher's side: bring a fleet up on a Ray cluster, scale it, watch it, take it down.

    fleet = Fleet.up(load("fleet.yaml"))             # a local Ray, or RAY_ADDRESS / address=
    fleet.wait_ready()                                # every replica registered and caught up
    CoordinatorClient(fleet.coordinator).complete(...)
    fleet.scale("rollout", 4)
    fleet.down()

The fleet lives in a detached actor named after it (namespace "rlsync"), so another process
(`rlsync scale`, `rlsync status`, a notebook) reaches it with Fleet.connect(name).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

import grpc
import msgspec
import ray
from ray.exceptions import RayActorError
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from rlsync.client import CoordinatorClient, RpcError
from rlsync.coordinator.v1.coordinator_pb2 import ROLE_TRAINER
from rlsync.errors import FailedPrecondition, InvalidArgument, Unavailable
from rlsync.fleet.manager import START_TIMEOUT, FleetManager
from rlsync.fleet.spec import FleetSpec, encode

NAMESPACE = "rlsync"


def join_cluster(address: str | None = None) -> None:
    """Joins the Ray cluster at `address` (or RAY_ADDRESS); without either, starts a local one."""
    if ray.is_initialized():
        return
    address = address or os.environ.get("RAY_ADDRESS") or "local"  # never a cluster found by chance
    if address == "local":  # a Ray of its own: its workers, and so the members, at niceness 0 (host.py)
        os.environ.setdefault("RAY_worker_niceness", "0")
    ray.init(address=address, namespace=NAMESPACE, log_to_driver=False, configure_logging=False)


class FleetGone(Unavailable):
    """The fleet's actor is gone (taken down by another process, or its node was lost)."""


class Fleet:
    def __init__(self, name: str, manager, coordinator: str, token: str = ""):
        self.name, self.manager, self.coordinator, self.token = name, manager, coordinator, token
        self.ray_address = ray.get_runtime_context().gcs_address
        self.seen = 0  # events already handed to up()'s on_event

    @classmethod
    def up(cls, spec: FleetSpec, address: str | None = None, timeout: float = START_TIMEOUT,
           on_event: Callable[[dict], None] | None = None) -> Fleet:
        """Places every member of `spec`; returns once each listens (raises with the reason otherwise,
        leaving nothing behind). `on_event` sees what happens meanwhile (placing, waiting, started)."""
        join_cluster(address)
        spec = msgspec.structs.replace(spec, token=spec.token or os.environ.get("RLSYNC_TOKEN", ""))
        try:
            ray.get_actor(spec.name, namespace=NAMESPACE)
            raise FailedPrecondition(f"a fleet named {spec.name!r} is already up on this cluster: "
                                     f"`rlsync down --name {spec.name}` first, or give this one another name")
        except ValueError:
            pass
        # The fleet's actor lives on the launcher's node (a replica's node may come and go).
        here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
        manager = FleetManager.options(name=spec.name, namespace=NAMESPACE, lifetime="detached",
                                       scheduling_strategy=here).remote(encode(spec))
        fleet = cls(spec.name, manager, "", spec.token)
        try:
            starting, done = manager.start.remote(timeout), False
            while not done:
                done = bool(ray.wait([starting], timeout=0.5)[0])
                for event in ray.get(manager.events_since.remote(fleet.seen)) if on_event else []:
                    on_event(event)
                    fleet.seen = event["seq"]
            started = ray.get(starting)
            fleet.coordinator = started.get("coordinator", "")
            if "error" in started:
                raise Unavailable(f"fleet {spec.name!r} did not come up: {started['error']}")
        except BaseException:  # Ctrl-C included: a fleet that did not come up leaves nothing behind
            fleet.down()
            raise
        return fleet

    @classmethod
    def connect(cls, name: str = "rlsync", address: str | None = None) -> Fleet:
        """The fleet `name` that some launcher brought up on the cluster at `address` (or RAY_ADDRESS,
        or the one running on this machine)."""
        join_cluster(address or os.environ.get("RAY_ADDRESS") or "auto")
        try:
            manager = ray.get_actor(name, namespace=NAMESPACE)
        except ValueError:
            raise FailedPrecondition(f"no fleet named {name!r} is up on this Ray cluster") from None
        status = ray.get(manager.status.remote())
        return cls(name, manager, status["coordinator"], os.environ.get("RLSYNC_TOKEN", ""))

    # ---- what a running fleet does ---------------------------------------------------------------
    def scale(self, group: str, replicas: int, timeout: float = START_TIMEOUT) -> dict:
        """Sets `group`'s replica count; returns once new replicas listen and removed ones have drained
        (new ones take traffic once the coordinator has caught them up: wait_ready)."""
        return _checked(ray.get(self.manager.scale.remote(group, replicas, timeout)))

    def status(self) -> dict:
        """Every member as Ray placed it (node, address, state, restarts), joined with the coordinator's
        view of it (registered state and weight version) where it has one."""
        status = ray.get(self.manager.status.remote())
        try:
            with self.client(timeout=5) as c:
                fleet = c.status()
            by_address = {m.address: m for m in fleet.members}
            status["weight_version"] = fleet.weight_version
            status["trainer_registered"] = any(m.role == ROLE_TRAINER for m in fleet.members)
        except RpcError as e:  # down or starting: Ray's view stands (a wrong token is not that: it raises)
            if e.code not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                raise
            by_address, status["weight_version"], status["trainer_registered"] = {}, -1, False
        for m in status["members"]:
            seen = by_address.get(m["address"])
            m["registered"] = seen.state if seen is not None else ""
            m["weight_version"] = seen.weight_version if seen is not None else -1
            m["backend"] = seen.backend if seen is not None else ""
        return status

    def events(self, since: int = 0) -> list[dict]:
        """What happened to members after event number `since` (placed, started, listening, exited,
        lost, restarting, stopped, scaled), each with its reason and log tail where it ended."""
        try:
            return ray.get(self.manager.events_since.remote(since))
        except RayActorError:
            raise FleetGone(f"fleet {self.name!r} is no longer up") from None

    def log_tail(self, member: str, lines: int = 40) -> str:
        return ray.get(self.manager.log_tail.remote(member, lines))

    def client(self, timeout: float | None = None) -> CoordinatorClient:
        return CoordinatorClient(self.coordinator, token=self.token, timeout=timeout)

    def wait_ready(self, timeout: float = START_TIMEOUT) -> dict:
        """Waits until every rollout replica Ray runs is registered, caught up to the fleet's version,
        and in rotation (and the trainer registered); returns status()."""
        deadline = time.monotonic() + timeout
        while True:
            status = self.status()
            replicas = [m for m in status["members"] if m["role"] == "rollout"]
            if status["trainer_registered"] and all(m["registered"] == "ready" for m in replicas):
                return status
            if time.monotonic() > deadline:
                waiting = [f"{m['name']} ({m['state']}, {m['registered'] or 'not registered'})" for m in replicas
                           if m["registered"] != "ready"]
                raise Unavailable(f"fleet {self.name!r} not ready after {timeout:.0f}s: trainer "
                                   f"{'registered' if status['trainer_registered'] else 'not registered'}; "
                                   f"waiting for {', '.join(waiting) or 'none'}")
            time.sleep(0.2)

    def down(self) -> None:
        """Drains and stops every member, frees their placements, and ends the fleet's actor."""
        try:
            ray.get(self.manager.down.remote())
        finally:
            ray.kill(self.manager)


def _checked(answer: dict) -> dict:
    if "error" in answer:
        raise (InvalidArgument if answer.get("refused") else Unavailable)(answer["error"])
    return answer
