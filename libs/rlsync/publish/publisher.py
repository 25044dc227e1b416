"""WeightPublisher: rlsync's trainer role inside any PyTorch training loop, sharded models included.

    pub = WeightPublisher(model, coordinator="host:50050")    # registers as the fleet's trainer
    for step, batch in enumerate(loader, 1):
        loss.backward(); opt.step()
        pub.publish(step)        # every replica serves step's weights when this returns

Every rank calls `publish`; rank 0 serves the trainer's gRPC API (on a thread of its own) and asks
the coordinator to sync, and the coordinator's requests (offer, publish, checksums, offload) run while
the ranks sit in `publish`, each rank gathering its shards bucket by bucket. While any rank is silent
(hung) for the coordinator's lease, rank 0 takes the trainer out of the fleet (rlsync.publish.liveness).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from collections.abc import Callable

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer
from torch import nn

from rlsync.client import CoordinatorClient
from rlsync.address import advertise_host, advertised
from rlsync.config import ServerConfig, build
from rlsync.coordinator.v1.coordinator_pb2 import ROLE_TRAINER, SYNC_MODE_COLOCATED
from rlsync.errors import FailedPrecondition, Unavailable
from rlsync.publish.core import PublisherCore, at_publish_points
from rlsync.publish.liveness import RankBeats
from rlsync.publish.mapping import WeightMap
from rlsync.publish.ranks import DONE, FAILED, PublishPoints, Ranks
from rlsync.publish.servicer import PublisherServicer
from rlsync.publish.source import ShardedModule, module_source, module_tensors
from rlsync.rpc.auth import TokenAuthInterceptor
from rlsync.rpc.registrar import Registrar
from rlsync.trainer.v1 import trainer_pb2_grpc
from rlsync.transfer.sender import DEFAULT_BUCKET_BYTES

log = logging.getLogger(__name__)

DEFAULT_LEASE = 3.0  # how long a rank may be silent before the coordinator's lease is known


class WeightPublisher:
    """Publishes `model`'s weights to the fleet behind `coordinator`, from the user's own loop.

    weights: how trainer names and dtypes become the engine's (rlsync.publish.WeightMap).
    offload / onload: hooks every rank runs when the coordinator asks the trainer to leave or take
        back its device (say, catching up a replica while the trainer is offloaded). Colocated
        syncs need the coordinator's Train RPC and are refused; publish to an async coordinator.
    group: the process group of the model's ranks (default: the whole world, if torch.distributed
        is initialised). Rank 0 of it serves the trainer API; with a sharded model every rank sends its
        own shards (otherwise rank 0 sends).
    publish_buffer: copy the weights into a buffer of their own at each update (one device copy at a
        publish point): replicas on the model's GPU copy from it while the loop trains on (one more
        copy of the weights on that GPU; a model of one process, its parameters on CUDA).
    host, advertise, token: left out, they come from RLSYNC_HOST, RLSYNC_ADVERTISE and RLSYNC_TOKEN,
        as the services' options do (a launcher such as `rlsync up` sets them).
    """

    def __init__(self, model: nn.Module, coordinator: str, *, weights: WeightMap | None = None,
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES, host: str | None = None, port: int = 0,
                 advertise: str | None = None, token: str | None = None, checksums: bool = False,
                 transfer_timeout: float = 300.0,
                 offload: Callable[[], None] | None = None, onload: Callable[[], None] | None = None,
                 group=None, name: str = "trainer", register_timeout: float = 60.0, publish_buffer: bool = False):
        env = build(ServerConfig)  # what is left out comes from RLSYNC_*, read as the services read it
        host = env.host if host is None else host
        advertise = env.advertise if advertise is None else advertise
        token = env.token if token is None else token
        self.model, self.weights = model, weights or WeightMap()
        self.ranks = Ranks(group)
        first, _ = module_source(model, self.weights, group)  # a name or dtype problem is refused now, on every rank
        self.core = PublisherCore(lambda stacked: module_source(self.model, self.weights, group, stacked)[0], None,
                                  bucket_bytes=bucket_bytes, host=host, advertise=advertise_host(advertise),
                                  checksums=checksums, transfer_timeout=transfer_timeout,
                                  offload=offload, onload=onload, sharded=isinstance(first, ShardedModule),
                                  publish_buffer=publish_buffer)
        self.points = PublishPoints(self.ranks, lambda: self.core.pass_source(self.ranks.rank),
                                    self.core.rank_handlers(self.ranks))
        self.core.run = at_publish_points(self.points)
        self.coordinator, self.beats, self.register_timeout, self._silent = None, None, register_timeout, ""
        if self.ranks.rank == 0:
            try:
                self._start(coordinator, host, port, advertise, token, name, register_timeout)
                if self.ranks.world > 1:
                    self.beats = RankBeats.watch(self.ranks.world, self.address.rsplit(":", 1)[0],
                                                 lambda: self._registrar.lease or DEFAULT_LEASE,
                                                 self._rank_silent, self._ranks_back)
            except Exception as e:  # the other ranks must hear it, or they would wait at their first publish
                self.ranks.broadcast(FAILED, payload=f"{type(e).__name__}: {e}".encode())
                raise
            self.ranks.broadcast(DONE, payload=self.beats.address.encode() if self.beats else b"")
        else:
            op, _, said = self.ranks.broadcast(DONE)
            if op == FAILED:
                raise Unavailable(f"rank 0 could not start the publisher: {said.decode(errors='replace')}")
            self.beats = RankBeats.beat(self.ranks.rank, said.decode())

    def _start(self, coordinator: str, host: str, port: int, advertise: str, token: str, name: str,
               register_timeout: float) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="rlsync-publisher", daemon=True)
        self._thread.start()
        self.address = self._call(self._serve(coordinator, host, port, advertise, token, name))
        self.coordinator = CoordinatorClient(coordinator, token=token, timeout=None)
        self._syncs = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="rlsync-sync")
        self._wait_registered(register_timeout)
        if self.coordinator.status().mode == SYNC_MODE_COLOCATED:
            raise FailedPrecondition("the coordinator runs the colocated sequence, whose trainer steps go through "
                                     "its Train RPC (engines sleep, the trainer onloads first); a loop of your own "
                                     "publishes to an async coordinator (--sync-mode async)")

    # ---- the loop's API ------------------------------------------------------------------------
    def publish(self, step: int, verify: bool = False):
        """Makes `step`'s weights live on every replica; every rank calls it. Returns the coordinator's
        SyncWeightsResponse on rank 0 (None elsewhere); raises on every rank if the sync failed, and
        the replicas then keep serving the previous version."""
        done = None
        self.core.current = step  # what a replica joining meanwhile is caught up with
        if self.ranks.rank == 0:
            done = self._syncs.submit(self._sync, step, verify)
        try:
            self.points.serve_until(done)
            return done.result() if done is not None else None
        except Exception as e:
            e.add_note(f"rlsync: publishing step {step} failed on rank {self.ranks.rank} of {self.ranks.world}; "
                       "the replicas keep serving the version they had")
            raise

    def _sync(self, step: int, verify: bool):
        self._wait_registered(self.register_timeout)  # out of the fleet while a rank was silent: back first
        return self.coordinator.sync_weights(version=step, verify=verify)

    def close(self) -> None:
        if self.beats is not None:
            self.beats.close()
        if self.ranks.rank == 0 and self._loop.is_running():
            self._call(self._stop())
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)
            self.coordinator.close()
            self._syncs.shutdown(wait=False)
        self.core.close()

    def __enter__(self) -> WeightPublisher:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- rank 0's server -----------------------------------------------------------------------
    def _call(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def _describe(self) -> dict:
        tensors = module_tensors(self.model)
        first = next(iter(tensors.values()))
        return {"device": str(first.device), "parameters": sum(t.numel() for t in tensors.values()),
                "dtype": str(first.dtype).removeprefix("torch."), "model": type(self.model).__name__}

    async def _serve(self, coordinator: str, host: str, port: int, advertise: str, token: str, name: str) -> str:
        self._server = grpc.aio.server(interceptors=[TokenAuthInterceptor(token)] if token else [])
        self._servicer = PublisherServicer(self.core, self._describe, token)
        trainer_pb2_grpc.add_TrainerServiceServicer_to_server(self._servicer, self._server)
        health = HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(health, self._server)
        bound = self._server.add_insecure_port(f"{host}:{port}")
        await self._server.start()
        await health.set("", health_pb2.HealthCheckResponse.SERVING)
        address = advertised(host, bound, advertise)
        self._registrar = Registrar(coordinator, ROLE_TRAINER, address, name, token)
        self._registrar.start()
        log.info("weight publisher serving on %s, registering with %s", address, coordinator)
        return address

    async def _stop(self) -> None:
        await self._registrar.stop()
        await self._servicer.release_held()
        await self._server.stop(2)
        self._servicer.lines.close()

    def _rank_silent(self, rank: int, seconds: float) -> None:
        """The watch's thread: the trainer leaves the fleet, and the coordinator abandons what it asked."""
        why = (f"rank {rank} of its {self.ranks.world} ranks has not been heard from for {seconds:.1f}s (hung?); "
               "the trainer registers again once it is")
        self._silent = why
        try:  # out before the watch can see the rank back (and register again)
            asyncio.run_coroutine_threadsafe(self._registrar.leave(why), self._loop).result(10)
        except Exception:  # noqa: BLE001 - the coordinator is unreachable: its lease drops the trainer anyway
            log.warning("could not leave the fleet with a silent rank", exc_info=True)

    def _ranks_back(self) -> None:
        self._silent = ""
        self._loop.call_soon_threadsafe(self._registrar.start)

    def _wait_registered(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not self._registrar.member_id:
            if time.monotonic() > deadline:
                if self._silent:
                    raise Unavailable(f"the trainer is out of the fleet: {self._silent}")
                raise TimeoutError(f"could not register with the coordinator at {self.coordinator.address} "
                                   f"within {timeout:.0f}s: is it running, and is the token right?")
            time.sleep(0.05)
