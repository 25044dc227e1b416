"""Processes that move no tensors do not load torch (0.9 s of CPU at every start): the coordinator,
the CLI, the clients, and a service refusing its flags before its engine loads."""

from __future__ import annotations

import subprocess
import sys

import pytest


@pytest.mark.parametrize("module", ["rlsync.coordinator.server", "rlsync.cli", "rlsync.fleet.cli", "rlsync.client",
                                    "rlsync.rollout.__main__", "rlsync.trainer.__main__"])
def test_importing_it_loads_no_torch(module):
    loaded = subprocess.run([sys.executable, "-c", f"import sys, {module}; print(sorted(m for m in sys.modules "
                             "if m == 'torch' or m.startswith('torch.')))"],
                            capture_output=True, text=True, timeout=60, check=True).stdout.strip()
    assert loaded == "[]", f"{module} loads torch: {loaded[:300]}"
