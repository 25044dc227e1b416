"""A copy armed behind a bell in pinned host memory (rlsync.transfer.host_bell.HostBell) never hangs its process:
what its engine launches that needs the whole device (a kernel loaded at its first launch, empty_cache) waits
only until a thread of the process writes the bell by a store of the CPU, and the copy is then done, started by
that write's value. Behind a Bell in GPU memory the same launches hang the process (its own write of the bell
waits in the driver behind them): bench/results/armed-hazards-h100.json."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytestmark = pytest.mark.gpu

_ESCAPE = """
import threading
import torch
from rlsync.transfer.armed import Armed
from rlsync.transfer.host_bell import HostBell

device = torch.device("cuda:0")
src = torch.randint(0, 256, (256 << 20,), dtype=torch.uint8, device=device)
dst = torch.empty_like(src)
a, w = (torch.randn(37, 2048, device=device, dtype=torch.bfloat16),
        torch.randn(2048, 6144, device=device, dtype=torch.bfloat16))
torch.cuda.synchronize()
bell = HostBell(device)
ops = {"first matmul (cuBLAS loads its kernels)": lambda: a @ w,
       "empty_cache": lambda: (torch.empty(1 << 30, dtype=torch.uint8, device=device), torch.cuda.empty_cache())}
for value, (name, op) in enumerate(ops.items(), start=5):
    dst.zero_()
    armed = Armed(bell, lambda: dst.copy_(src, non_blocking=True), dst.numel(), ())
    written = []
    threading.Timer(0.3, lambda v=value: (bell.write(v), written.append(v))).start()  # from another thread: a store
    op()
    if name == "empty_cache":  # (it waits for the whole device: held up until the write)
        assert written, "empty_cache did not wait for the armed copy"
    torch.cuda.synchronize()
    assert bell.started_by() == value, (name, bell.started_by())
    armed.disarm()
    assert torch.equal(dst, src), name
print("OK")
"""


def test_what_waits_for_the_whole_device_behind_a_host_bell_goes_on_once_a_thread_writes_it():
    """In a process of its own, with a time limit: a process hung behind its bell is a failure, not a hung
    suite."""
    done = subprocess.run([sys.executable, "-c", _ESCAPE], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip().endswith("OK"), done.stderr[-3000:]
