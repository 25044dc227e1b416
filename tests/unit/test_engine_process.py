"""Engine process set-up: AMX permission before the first kernel, and the report a fatal signal leaves."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from rlsync.launch import exit_status
from rlsync.rollout.engines.process import CRASH_DIR_ENV, crash_reports

@pytest.mark.skipif(not torch.cpu._is_amx_tile_supported(), reason="this CPU has no AMX")
def test_amx_permission_is_granted_before_any_kernel_runs():
    # arch_prctl(ARCH_GET_XCOMP_PERM) before and after; bit 18 is AMX tile data.
    code = ("from rlsync.rollout.engines.process import enable_amx; import ctypes; "
            "m = ctypes.c_uint64(0); libc = ctypes.CDLL(None); "
            "libc.syscall(158, 0x1022, ctypes.byref(m)); before = bool(m.value & (1 << 18)); "
            "ok = enable_amx(); libc.syscall(158, 0x1022, ctypes.byref(m)); "
            "print(before, ok, bool(m.value & (1 << 18)))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["False", "True", "True"], "a fresh process lacks AMX permission until enable_amx asks for it"


def test_a_fatal_signal_leaves_a_report_naming_it(tmp_path):
    code = ("import os, signal; from rlsync.rollout.engines.process import enable_crash_report; "
            "enable_crash_report()\ndef kernel():\n    os.kill(os.getpid(), signal.SIGILL)\nkernel()")
    proc = subprocess.Popen([sys.executable, "-c", code], env={**os.environ, CRASH_DIR_ENV: str(tmp_path)},
                            stderr=subprocess.DEVNULL)
    assert exit_status(proc.wait()) == "was killed by SIGILL (signal 4)"
    (report,) = crash_reports(tmp_path)
    assert f"pid {proc.pid} died of SIGILL (Illegal instruction)" in report
    assert "line 3 in kernel" in report, "the report points at the innermost Python frame"


def test_processes_that_exit_cleanly_leave_no_report(tmp_path):
    code = "from rlsync.rollout.engines.process import enable_crash_report; enable_crash_report()"
    subprocess.run([sys.executable, "-c", code], env={**os.environ, CRASH_DIR_ENV: str(tmp_path)}, check=True)
    assert list(tmp_path.iterdir()) and crash_reports(tmp_path) == []


def test_exit_status_names_the_signal():
    assert exit_status(-9) == "was killed by SIGKILL (signal 9)"
    assert exit_status(132) == "exited with status 132 (SIGILL)"
    assert exit_status(2) == "exited with status 2"
