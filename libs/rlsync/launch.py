"""Starts rlsync services as child processes and waits until they listen (used by the demo and tests)."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from rlsync.preload import Forked, preloaded_for


def exit_status(returncode: int) -> str:
    """"exited with status 2" / "was killed by SIGILL (signal 4)"."""
    try:
        if returncode < 0:
            return f"was killed by {signal.Signals(-returncode).name} (signal {-returncode})"
        if returncode > 128:  # a shell's way of saying the same
            return f"exited with status {returncode} ({signal.Signals(returncode - 128).name})"
    except ValueError:
        pass
    return f"exited with status {returncode}"


def _in_child(parent_death_signal: int, niceness: int | None):
    """What the child does before it runs its program: ask for a signal when its parent thread ends,
    and take the niceness asked for (where it may: lowering it needs CAP_SYS_NICE or RLIMIT_NICE room;
    the caller reads back what the child got)."""
    import ctypes

    prctl = ctypes.CDLL(None, use_errno=True).prctl  # looked up here: the child only calls it

    def preexec() -> None:
        if parent_death_signal:
            prctl(1, parent_death_signal)  # PR_SET_PDEATHSIG
        if niceness is not None:
            try:
                os.setpriority(os.PRIO_PROCESS, 0, niceness)
            except OSError:
                pass

    return preexec if parent_death_signal or niceness is not None else None


def sglang_python() -> str | None:
    """SGLang's Python (it pins another torch than vLLM, so it has an environment of its own): this one
    if it has sglang, else $RLSYNC_SGLANG_PYTHON, else the checkout's .venv-sglang (`make venv-sglang`);
    None where there is none."""
    if importlib.util.find_spec("sglang") is not None:
        return sys.executable
    if python := os.environ.get("RLSYNC_SGLANG_PYTHON"):
        return python
    checkout = Path(__file__).resolve().parents[2] / ".venv-sglang" / "bin" / "python"
    return str(checkout) if checkout.exists() else None


def python_for(service: str, args: list[str]) -> str:
    """The Python that runs a service: this one, except for an SGLang replica, which runs in SGLang's
    environment where there is one (else this one, which then says what to install)."""
    if service != "rollout" or "sglang" not in args:
        return sys.executable
    return sglang_python() or sys.executable


class ServiceProcess:
    """One service in its own process (and process group), e.g. ServiceProcess("rollout", ["--engine", "hf"]).

    The child and everything it starts (engine workers too) get explicit descriptors: stdin from
    /dev/null, stdout and stderr into the service's log, so nothing depends on the parent's (a closed
    terminal, pytest's capture). The service announces its address with one JSON line in that log.
    """

    def __init__(self, service: str, args: list[str], env: dict[str, str] | None = None,
                 log_path: str | Path | None = None, name: str | None = None, command: list[str] | None = None,
                 parent_death_signal: int = 0, niceness: int | None = None, script: str | Path | None = None):
        """command: run this instead of `python -m rlsync.<service> args` (a user's trainer script).
        script: a Python file that runs the service itself, run as `python SCRIPT args` (a test's replica with
        a fault injected first); unlike a command, forked from a preloaded image where the service would be.
        parent_death_signal: Linux sends it to the child when the thread that starts it ends (a
        launcher's owner thread, so a member dies with the launcher that placed it).
        niceness: the child's, where this process may set it (else it keeps this process's)."""
        self.service = service
        self.name = name or service
        cmd = command or [python_for(service, args), *([str(script)] if script else ["-m", f"rlsync.{service}"]), *args]
        if log_path is None:
            fd, log_path = tempfile.mkstemp(prefix=f"rlsync-{self.name}-", suffix=".log")
            os.close(fd)
        self.log_path = Path(log_path)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log_start = self.log_path.stat().st_size if self.log_path.exists() else 0
        full_env = {**os.environ, **(env or {})}
        self.proc: subprocess.Popen | Forked | None = None
        if (preloaded := preloaded_for(service, args, full_env, command, parent_death_signal)) is not None:
            self.log_path.touch()  # (the child opens it for itself)
            try:
                self.proc = preloaded.start(service, args, full_env, self.log_path, niceness, script)  # rlsync.preload
            except ConnectionError:  # the preloaded process went away: a process of its own, as below
                pass
        if self.proc is None:
            # Its own process group (stop() signals the whole tree), but the launcher's session: with the
            # kernel's autogroup scheduling a new session is a new scheduling group, and when a vLLM
            # replica's spinning workers fill every core, processes of the launcher's group (a client
            # reading its answer) waited up to seconds for a CPU.
            with open(self.log_path, "ab") as log:
                self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                             env=full_env, process_group=0,
                                             preexec_fn=_in_child(parent_death_signal, niceness))
        self.address: str | None = None

    def log_text(self) -> str:
        """What this process wrote to its log (an earlier process's lines at the same path left out)."""
        try:
            with open(self.log_path, "rb") as f:
                f.seek(self._log_start)
                return f.read().decode(errors="replace")
        except OSError:
            return ""

    def _find_address(self, event: str = "listening") -> str | None:
        with open(self.log_path, "rb") as f:
            f.seek(self._log_start)
            for raw in f:
                line = raw.decode(errors="replace").strip()
                if line.startswith("{") and f'"{event}"' in line:
                    return json.loads(line)["address"]
        return None

    def http_address(self, event: str = "http", timeout: float = 30.0) -> str:
        """The address of one of the service's HTTP servers, once it listens: "http" (the coordinator's
        --http-port) or "metrics" (--metrics-port)."""
        deadline = time.monotonic() + timeout
        while (address := self._find_address(event)) is None:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{self.name} announced no {event} server (log: {self.log_path}):\n"
                                   f"{self.log_tail()}")
            time.sleep(0.05)
        return address

    def wait_ready(self, timeout: float = 180.0) -> str:
        """Blocks until the service listens; returns its address, or raises with its log tail."""
        deadline = time.monotonic() + timeout
        while self.address is None:
            self.address = self._find_address()
            if self.address is not None:
                break
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} {exit_status(self.proc.returncode)} before listening "
                                   f"(log: {self.log_path}):\n{self.log_tail()}")
            if time.monotonic() > deadline:
                self.kill()
                raise TimeoutError(f"{self.name} did not start within {timeout}s (log: {self.log_path}):\n"
                                   f"{self.log_tail()}")
            time.sleep(0.05)
        return self.address

    def log_tail(self, lines: int = 40) -> str:
        text = self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
        return "\n".join(text.splitlines()[-lines:])

    def why_down(self, timeout: float = 5.0) -> str | None:
        """None while the process runs and its health is SERVING; otherwise what happened, for a
        person: the exit status (signal name) or NOT_SERVING, and where the log is."""
        if self.proc.poll() is not None:
            return f"{self.name} {exit_status(self.proc.returncode)}; log: {self.log_path}\n{self.log_tail(20)}"
        if self.address is None:
            return None
        import grpc
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        with grpc.insecure_channel(self.address) as channel:
            try:
                status = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=timeout)
            except grpc.RpcError as e:
                return f"{self.name} does not answer its health check ({e.code().name}); log: {self.log_path}"
        if status.status != health_pb2.HealthCheckResponse.SERVING:
            return (f"{self.name} is {health_pb2.HealthCheckResponse.ServingStatus.Name(status.status)}; "
                    f"log: {self.log_path}\n{self.log_tail(20)}")
        return None

    def stop(self, timeout: float = 30.0, sig: int = signal.SIGTERM) -> int:
        """Asks the service to shut down gracefully; kills its process group if it does not."""
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill()
        reap_group(self.proc.pid)
        return self.proc.wait()

    def kill(self) -> None:
        reap_group(self.proc.pid)
        self.proc.wait()

    def __enter__(self) -> ServiceProcess:
        self.wait_ready()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def reap_group(group: int, grace: float = 0.0) -> None:
    """SIGKILL to a process group: what a service started and left behind (engine workers) goes with it.
    grace: seconds its members get to end first (a dead member's beacon deregisters it meanwhile)."""
    deadline = time.monotonic() + grace
    try:
        while time.monotonic() < deadline:
            os.killpg(group, 0)
            time.sleep(0.05)
        os.killpg(group, signal.SIGKILL)
    except ProcessLookupError:
        pass  # every one of them has ended
