"""ServiceHost: the Ray actor that owns one fleet member's process on the node Ray placed it on.

The member itself stays a plain process (`python -m rlsync.rollout ...`, or a user's training
script), exactly what `docker compose` or a person would start. The host adds what only the node
knows: the node's id (the handshake's host identity: two nodes are two hosts) and an address other
nodes can dial. It takes and returns plain values (strings, numbers, dicts of them), never tensors
or models. When the host dies (its node was lost, or the fleet went down), Linux ends the member
with SIGTERM; when the member's own process ends, whatever it started that is still running (an
engine's workers) is killed with its process group.

Ray runs its workers at niceness 15 (its `worker_niceness`), and a process inherits its parent's. A
member is the node's work, not a background task: on a busy node, an engine at 15 waits behind every
other process. So the member runs at niceness 0 where the host may set that (root, CAP_SYS_NICE or
room in RLIMIT_NICE); elsewhere the launcher's "started" event says what it runs at.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from pathlib import Path

import ray

from rlsync.launch import ServiceProcess, exit_status, reap_group


@ray.remote(num_cpus=0, max_restarts=0, max_concurrency=4)
class ServiceHost:
    def __init__(self, name: str, service: str, args: list[str], env: dict[str, str], log_dir: str,
                 script: list[str] | None = None, ranks: int = 1):
        """script: a user's program and its arguments, run with this node's Python (under torchrun
        with `ranks` processes when > 1), instead of `python -m rlsync.<service> args`."""
        context = ray.get_runtime_context()
        self.node_id = context.get_node_id()
        self.ip = ray.util.get_node_ip_address()
        env = {**env, "RLSYNC_NODE_ID": self.node_id, "RLSYNC_HOST": "0.0.0.0", "RLSYNC_ADVERTISE": self.ip}
        if not ray.get_gpu_ids():  # Ray leaves CUDA_VISIBLE_DEVICES alone for a member with no GPU
            env["CUDA_VISIBLE_DEVICES"] = ""
        command = None
        if script is not None:
            launch = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                      f"--nproc-per-node={ranks}"] if ranks > 1 else [sys.executable]
            command = [*launch, *script]
        log = Path(log_dir) / f"{name}.log"
        started, failed = threading.Event(), []

        # The member is started by a thread that lives exactly as long as it does: Linux delivers the
        # parent-death signal when the starting *thread* ends, so this one waits on the process.
        def own() -> None:
            try:
                self.proc = ServiceProcess(service, args, env=env, log_path=log, name=name, command=command,
                                           parent_death_signal=signal.SIGTERM, niceness=0)
            except Exception as e:  # noqa: BLE001 - raised by __init__ below
                failed.append(e)
                return
            finally:
                started.set()
            self.proc.proc.wait()
            reap_group(self.proc.proc.pid, grace=3.0)  # (a crashed member leaves at once, not at the lease)

        threading.Thread(target=own, name=f"owner-{name}", daemon=True).start()
        started.wait()
        if failed:
            raise RuntimeError(f"could not start {name} on node {self.node_id[:12]}: {failed[0]}")

    def where(self) -> dict:
        """Node id, node address, pid, log path and niceness of the member (None once it has ended:
        poll() says how)."""
        pid = self.proc.proc.pid
        try:
            niceness = os.getpriority(os.PRIO_PROCESS, pid)
        except OSError:
            niceness = None
        return {"node_id": self.node_id, "ip": self.ip, "pid": pid, "log": str(self.proc.log_path),
                "niceness": niceness}

    def wait_ready(self, timeout: float) -> str:
        """The address the member listens on (services); raises with its log tail if it died first."""
        return self.proc.wait_ready(timeout)

    def poll(self) -> str:
        """'' while the member runs, else how it ended ("exited with status 1", "was killed by SIGKILL")."""
        code = self.proc.proc.poll()
        return "" if code is None else exit_status(code)

    def log_tail(self, lines: int = 40) -> str:
        return self.proc.log_tail(lines)

    def stop(self, timeout: float = 30.0) -> str:
        """SIGTERM (a replica drains: out of rotation, in-flight requests finish or move), then SIGKILL."""
        self.proc.stop(timeout)
        return exit_status(self.proc.proc.returncode)

