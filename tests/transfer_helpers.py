"""Helpers for transfer tests: a peer process driven line by line, and a zoo of tensors."""

from __future__ import annotations

import json
import os
import queue
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

TESTS = Path(__file__).resolve().parent  # on PYTHONPATH of peers: fault_injection lives here
DTYPES = [torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2,
          torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_routed(senders: int, receivers: int, bucket: int, device: str = "cpu", gpus: int = 1,
               **settings: str) -> list[dict]:
    """A routed transfer between real processes (routed_worker.py): `senders` trainer ranks, one replica
    of `receivers` tensor-parallel ranks; every member's JSON line, trainer ranks first. On `gpus` GPUs
    (device cuda), trainer rank r and engine rank e run on GPUs r and e modulo `gpus`, as a trainer and
    an engine colocated over the same GPUs are laid out. `settings`: more of routed_worker.py's
    environment (HOLD, STEPS, ...). A free port can be taken by another process (CI's parallel lanes)
    before a member listens on it: the whole run is then made again on other ports."""
    for attempt in range(3):
        outcomes = _run_routed_once(senders, receivers, bucket, device, gpus, settings)
        failed = [stderr for code, _, stderr in outcomes if code != 0]
        if not any("EADDRINUSE" in stderr for stderr in failed) or attempt == 2:
            break
    for code, _, stderr in outcomes:
        assert code == 0, stderr[-3000:]
    return [json.loads(stdout.strip().splitlines()[-1]) for _, stdout, _ in outcomes]


def _run_routed_once(senders: int, receivers: int, bucket: int, device: str, gpus: int,
                     settings: dict) -> list[tuple[int, str, str]]:
    store, master = free_port(), free_port()
    procs = []
    for role, count in (("trainer", senders), ("engine", receivers)):
        for rank in range(count):
            env = {**os.environ, "ROLE": role, "SENDERS": str(senders), "RECEIVERS": str(receivers),
                   "RANK": str(rank), "WORLD_SIZE": str(senders), "MASTER_ADDR": "127.0.0.1",
                   "DEVICE": f"cuda:{rank % gpus}" if device == "cuda" and gpus > 1 else device,
                   "MASTER_PORT": str(master), "ROUTED_STORE": f"127.0.0.1:{store}", "BUCKET": str(bucket), **settings}
            procs.append(subprocess.Popen([sys.executable, str(TESTS / "routed_worker.py")], env=env,
                                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                          stdin=subprocess.DEVNULL))
    outcomes = []
    for i, p in enumerate(procs):
        try:
            stdout, stderr = p.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            p.kill()
            stdout, stderr = p.communicate()
        outcomes.append((p.returncode, stdout, stderr))
        if p.returncode != 0:  # the others may wait for it (or for a port another process holds): none is left
            for q in procs[i + 1:]:
                q.kill()
                outcomes.append((q.wait(), "", ""))
            break
    return outcomes


class Peer:
    """`python -m rlsync.transfer.peer ...` in its own process, talked to line by line. Its stdout is
    read by a thread of its own: select() on the pipe would miss a line already in the reader's
    buffer (two lines written at once), and wait for a third that never comes."""

    def __init__(self, *args: str, env: dict | None = None):
        self.proc = subprocess.Popen([sys.executable, "-m", "rlsync.transfer.peer", *args], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True,
                                     env={**os.environ, "PYTHONPATH": str(TESTS), **(env or {})})
        self.lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for raw in self.proc.stdout:
            self.lines.put(raw)
        self.lines.put(None)  # the peer closed its stdout (exited)

    def line(self, kind: str, timeout: float = 60) -> str:
        end = time.monotonic() + timeout
        while (left := end - time.monotonic()) > 0:
            try:
                raw = self.lines.get(timeout=left)
            except queue.Empty:
                break
            if raw is None:
                self.lines.put(None)  # every later call sees the end too
                break
            if raw.startswith(kind + " "):
                return raw[len(kind) + 1:].strip()
        raise AssertionError(f"peer gave no {kind} line (exit code {self.proc.poll()})")

    def send(self, text: str) -> None:
        self.proc.stdin.write(text + "\n")
        self.proc.stdin.flush()

    def result(self, timeout: float = 60) -> dict:
        return json.loads(self.line("RESULT", timeout))

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


def shm_entries() -> set[str]:
    """Segments in /dev/shm the transfer library could have left. psm_*/sem.mp-* belong to Python
    multiprocessing (vLLM servers other tests may still run), vllm_* to a tensor-parallel vLLM
    replica's workers and sglang_* to SGLang's schedulers (suites in parallel processes run them);
    folders belong to rollout replicas that tests in a parallel process run (a vLLM replica's LoRA
    adapters) — the library makes only files."""
    engines = ("psm_", "sem.mp-", "vllm_", "sglang_")
    return {e.name for e in os.scandir("/dev/shm")
            if not e.name.startswith(engines) and not e.is_dir(follow_symlinks=False)}


def zoo() -> dict[str, torch.Tensor]:
    """Every dtype; odd, 0-dim, empty and large-ish shapes."""
    g = torch.Generator().manual_seed(0)
    out = {}
    for dtype in DTYPES:
        raw = torch.randint(0, 256, (5 * 7 * 3 * torch.empty(0, dtype=dtype).element_size(),), generator=g,
                            dtype=torch.uint8)
        t = raw.view(dtype).view(5, 7, 3)
        name = str(dtype).removeprefix("torch.")
        if dtype == torch.bool:
            t = raw[:105] % 2 == 1
            t = t.view(5, 7, 3)
        out[f"layers.{name}.weight"] = t
        out[f"layers.{name}.scalar"] = t[0, 0, 0].clone()
        out[f"layers.{name}.empty"] = t[:0].clone()
    out["big"] = torch.randn(257, 129, generator=g)
    return out


def scatter(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Same values, non-contiguous layouts (where a tensor has at least 2 dims)."""
    return {n: t.t().contiguous().t() if t.dim() == 2 else
            (t.transpose(0, 1).contiguous().transpose(0, 1) if t.dim() == 3 else t) for n, t in tensors.items()}
