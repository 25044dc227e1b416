"""What every engine process sets up before its first kernel runs, and how a dead one says why it died.

AMX: on Linux a process must ask the kernel for the AMX tile-data state (arch_prctl
ARCH_REQ_XCOMP_PERM) before its first AMX instruction, or that instruction raises SIGILL. vLLM's CPU
build (0.32.0) picks its AMX attention kernel (csrc/cpu/cpu_attn_amx.hpp) whenever the CPU has
amx_bf16 and the model runs in bf16, but never asks; it works only when oneDNN happened to ask first
(it does when it JITs an AMX GEMM, which depends on the batch's row count). torch.cpu._init_amx()
asks once for the whole process.

Crash reports: a worker killed by a fatal signal leaves no Python traceback and vLLM only says
"EngineDeadError". Each engine process writes faulthandler's report (signal name and every thread's
stack) to a file of its own under $RLSYNC_CRASH_DIR, which the replica reads when its engine dies.
"""

from __future__ import annotations

import faulthandler
import os
from pathlib import Path

import torch

CRASH_DIR_ENV = "RLSYNC_CRASH_DIR"

# faulthandler's words for each fatal signal it reports.
_SIGNALS = {"Illegal instruction": "SIGILL", "Segmentation fault": "SIGSEGV", "Bus error": "SIGBUS",
            "Floating-point exception": "SIGFPE", "Floating point exception": "SIGFPE", "Aborted": "SIGABRT"}

_crash_file = None  # kept open for the life of the process: faulthandler writes to its descriptor


def enable_amx() -> bool:
    """Requests AMX tile state for this process when the CPU has AMX; True when granted."""
    cpu = getattr(torch, "cpu", None)
    if cpu is None or not hasattr(cpu, "_is_amx_tile_supported") or not cpu._is_amx_tile_supported():
        return False
    return bool(cpu._init_amx())


def enable_crash_report() -> Path | None:
    """Writes this process's fatal-signal report to $RLSYNC_CRASH_DIR/<pid>.txt (if the variable is set)."""
    global _crash_file
    folder = os.environ.get(CRASH_DIR_ENV)
    if not folder or _crash_file is not None:
        return None
    path = Path(folder) / f"{os.getpid()}.txt"
    _crash_file = open(path, "w")  # noqa: SIM115 - must outlive this function
    faulthandler.enable(file=_crash_file, all_threads=True)
    return path


def prepare_engine_process() -> None:
    enable_amx()
    enable_crash_report()


def crash_reports(folder: str | Path) -> list[str]:
    """One line per process that died of a fatal signal: "pid 123 died of SIGILL (Illegal instruction)
    at <its innermost Python frame>"."""
    out = []
    for f in sorted(Path(folder).glob("*.txt")):
        text = f.read_text(errors="replace").strip()
        if not text:
            continue
        first = text.splitlines()[0].removeprefix("Fatal Python error: ").strip()
        signal = next((name for words, name in _SIGNALS.items() if first.startswith(words)), "a fatal signal")
        lines = [line.strip() for line in text.splitlines()]
        current = next((i for i, line in enumerate(lines) if line.startswith("Current thread")), 0)
        frames = [line for line in lines[current:] if line.startswith("File ")]
        where = f" at {frames[0]}" if frames else ""
        out.append(f"pid {f.stem} died of {signal} ({first}){where}")
    return out


def own_log() -> str:
    """Where this process's stderr goes (its service log), when that is a file."""
    try:
        target = os.readlink("/proc/self/fd/2")
    except OSError:
        return ""
    return target if target.startswith("/") and os.path.isfile(target) else ""
