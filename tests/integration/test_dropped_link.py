"""A replica behind a dropped link, real processes throughout: it runs in a network namespace of its
own, joined to this one by a veth pair, and every packet across that link is dropped (silently, as a
cut cable or a dead switch would) in the middle of a gloo transfer. The fleet behaves as for a hung
member (test_hung_members.py): the lease drops it and the survivor gets the update in the same
SyncWeights call; when the link returns, it registers again and is caught up before it takes traffic."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time

import pytest

from conftest import rl_step, rollout_args
from rlsync.client import CoordinatorClient, RolloutClient, TrainerClient
from rlsync.common.audit import differences
from rlsync.coordinator.v1 import coordinator_pb2 as pb
from hangs import FAST, SLOW, in_background, report, train, wait_prepared

pytestmark = pytest.mark.slow


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=30)


class Link:
    """A network namespace and the veth pair into it: `host` is this side's address, `inside` the
    namespace's; `cut()` drops every packet across the link (in the namespace, on its end of it)."""

    def __init__(self, name: str, subnet: int):
        self.name, self.host, self.inside = name, f"10.213.{subnet}.1", f"10.213.{subnet}.2"
        self.host_end, self.inside_end = f"rl{os.getpid()}h", f"rl{os.getpid()}n"
        self.prefix = ("ip", "netns", "exec", name)

    def make(self) -> None:
        _ip("link", "add", self.host_end, "type", "veth", "peer", "name", self.inside_end, "netns", self.name)
        _ip("addr", "add", f"{self.host}/30", "dev", self.host_end)
        _ip("link", "set", self.host_end, "up")
        _ip("-n", self.name, "addr", "add", f"{self.inside}/30", "dev", self.inside_end)
        _ip("-n", self.name, "link", "set", self.inside_end, "up")
        _ip("-n", self.name, "link", "set", "lo", "up")

    def _iptables(self, op: str) -> None:
        for chain, way in (("INPUT", "-i"), ("OUTPUT", "-o")):
            subprocess.run([*self.prefix, "iptables", op, chain, way, self.inside_end, "-j", "DROP"],
                           check=True, capture_output=True, timeout=30)

    @contextlib.contextmanager
    def cut(self):
        """Yields the moment the link went down; it comes back when the block ends, however it ends."""
        self._iptables("-A")
        try:
            yield time.monotonic()
        finally:
            self._iptables("-D")

    def remove(self) -> None:
        """Kills what still runs in the namespace (a replica this test started), then deletes it: that
        deletes the veth pair too."""
        for pid in _ip("netns", "pids", self.name, check=False).stdout.split():
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid), signal.SIGKILL)
        _ip("netns", "del", self.name, check=False)
        _ip("link", "del", self.host_end, check=False)


def _free_subnet() -> int:
    """A 10.213.N.0/30 no interface here uses (another run of this test may hold one)."""
    used = _ip("-o", "addr").stdout
    for k in range(250):
        subnet = (os.getpid() + k) % 250
        if f" 10.213.{subnet}." not in used:
            return subnet
    raise RuntimeError("every 10.213.N.0/30 is in use here")


@pytest.fixture
def link():
    """A namespace of this test's own; skips, saying why, where namespaces or iptables are not permitted."""
    name = f"rlsync-link-{os.getpid()}"
    try:
        made = _ip("netns", "add", name, check=False)
    except FileNotFoundError:
        pytest.skip("no `ip` command (iproute2): cannot make a network namespace")
    if made.returncode != 0:
        pytest.skip(f"cannot make a network namespace here (`ip netns add`: {made.stderr.strip()}): needs root "
                    "or CAP_NET_ADMIN and CAP_SYS_ADMIN")
    ns = Link(name, _free_subnet())
    try:
        ns.make()
        probe = subprocess.run([*ns.prefix, "iptables", "-L", "INPUT", "-n"], capture_output=True, text=True)
        if probe.returncode != 0:
            pytest.skip(f"iptables does not work in a network namespace here: {probe.stderr.strip()}")
        yield ns
    finally:
        ns.remove()


def test_a_replica_behind_a_dropped_link_is_dropped_then_caught_up_when_the_link_returns(link, services,
                                                                                           small_model):
    # The coordinator and trainer listen on every interface and give the namespace their end of the
    # link to dial; the gloo transfer listens where the route to the trainer's store goes.
    reachable = {"RLSYNC_HOST": "0.0.0.0", "RLSYNC_ADVERTISE": link.host}
    co = services.start("coordinator", ["--sync-mode", "async", *FAST, *SLOW["co_extra"]], env=reachable,
                        name="coordinator")
    models = ["--model", str(small_model)]
    tr = services.start("trainer", ["--coordinator", co.address, "--checksums", *models, *SLOW["trainer_extra"]],
                        env=reachable, name="trainer")
    r0 = services.start("rollout", [*rollout_args("hf"), *models, "--coordinator", co.address, "--replica-id", "r0"],
                        name="r0")
    r1 = services.start("rollout", [*rollout_args("hf"), *models, "--coordinator", co.address, "--replica-id", "r1"],
                        env={"RLSYNC_HOST": "0.0.0.0", "RLSYNC_ADVERTISE": link.inside}, prefix=link.prefix,
                        name="r1-netns")
    assert r1.address.startswith(f"{link.inside}:")
    client = CoordinatorClient(co.address)
    client.wait_ready(3)

    first = rl_step(client, 0)
    assert first.version == 1 and first.replicas == 2 and first.verified and first.backends == {"gloo": 2}, first
    print(f"\n[link] a sync of the small model over gloo: {first.seconds:.1f}s {dict(first.phases)}")
    train(client, 1)
    replicas = [RolloutClient(p.address) for p in (r0, r1)]
    sync = in_background(client.sync_weights, None, "", True)
    wait_prepared(replicas)
    time.sleep(0.2)  # the publish is under way
    with link.cut() as cut:
        second = sync.result(120)
        # As for a hung replica: the lease (and its check, a third of it), then the survivor's AbortUpdate
        # (its gloo receive cannot be interrupted: the hf engine waits 5 s for it); the margin is for two
        # busy cores. The sync run again for the survivor alone comes after that and is not counted.
        report("sync, r1's link dropped mid-transfer", time.monotonic() - cut, second, tag="link")
        assert second.version == 2 and second.replicas == 1 and second.verified, second
        assert replicas[0].info().weight_version == 2
        assert [m.name for m in client.status().members if m.role == pb.ROLE_ROLLOUT] == ["r0"]
        assert client.complete("on", max_tokens=4, ignore_eos=True)[0].max_weight_version == 2
    back = time.monotonic()
    # Registered again, and caught up before it takes traffic: its heartbeat stalled on the dead link
    # ends at its 10 s deadline, it registers again, its catch-up drops the update it held (AbortUpdate,
    # up to 5 s) and sends it N+1 (a transfer): 60 s is that with room for two busy cores.
    client.wait_ready(3, timeout=60)
    print(f"\n[link] r1 registered again and was caught up {time.monotonic() - back:.1f}s after the link returned")
    info = replicas[1].info()
    assert info.weight_version == 2 and info.pending_version == -1, info
    assert differences(TrainerClient(tr.address).checksums(), replicas[1].checksums()) == []
    third = rl_step(client, 2)
    assert third.version == 3 and third.replicas == 2 and third.verified, third
    assert all(r.info().weight_version == 3 for r in replicas)
    print(f"\n[link] the next sync reached both: {third.seconds:.1f}s; r1's log: {r1.log_path}")
