"""Starts rlsync services as child processes and waits until they listen (used by the demo and tests)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path


class ServiceProcess:
    """One service in its own process (and process group), e.g. ServiceProcess("rollout", ["--engine", "hf"])."""

    def __init__(self, service: str, args: list[str], env: dict[str, str] | None = None,
                 log_path: str | Path | None = None, name: str | None = None):
        self.service = service
        self.name = name or service
        cmd = [sys.executable, "-m", f"rlsync.{service}", *args]
        self.log_path = Path(log_path) if log_path else None
        if self.log_path:
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, "ab") if self.log_path else subprocess.DEVNULL
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=self._log,
                                     env={**os.environ, **(env or {})}, start_new_session=True)
        self.address: str | None = None
        self._listening = threading.Event()
        self._stdout_tail: list[str] = []
        threading.Thread(target=self._read_stdout, daemon=True).start()

    def _read_stdout(self) -> None:
        for raw in self.proc.stdout:
            line = raw.decode(errors="replace").rstrip()
            if line.startswith("{") and '"listening"' in line:
                self.address = json.loads(line)["address"]
                self._listening.set()
            else:
                self._stdout_tail = (self._stdout_tail + [line])[-50:]
        self._listening.set()  # process exited: wake a waiter so it can report

    def wait_ready(self, timeout: float = 180.0) -> str:
        """Blocks until the service listens; returns its address, or raises with its log tail."""
        deadline = time.monotonic() + timeout
        while not self._listening.wait(0.1):
            if time.monotonic() > deadline:
                self.kill()
                raise TimeoutError(f"{self.name} did not start within {timeout}s:\n{self.log_tail()}")
        if self.address is None:
            raise RuntimeError(f"{self.name} exited with {self.proc.wait()} before listening:\n{self.log_tail()}")
        return self.address

    def log_tail(self, lines: int = 40) -> str:
        text = self.log_path.read_text(errors="replace") if self.log_path and self.log_path.exists() else ""
        return "\n".join((text.splitlines() + self._stdout_tail)[-lines:])

    def stop(self, timeout: float = 30.0, sig: int = signal.SIGTERM) -> int:
        """Asks the service to shut down gracefully; kills its process group if it does not."""
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill()
        self._reap_group()
        return self.proc.wait()

    def kill(self) -> None:
        self._reap_group(signal.SIGKILL)
        self.proc.wait()

    def _reap_group(self, sig: int = signal.SIGKILL) -> None:
        try:
            os.killpg(self.proc.pid, sig)
        except ProcessLookupError:
            pass

    def __enter__(self) -> ServiceProcess:
        self.wait_ready()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
