"""What a process may do while one of its streams waits on a bell (rlsync.transfer.armed): each CUDA
operation an engine runs between two updates, timed with a copy armed and its bell written only
`--ring` seconds later, from another thread on a stream of its own. An operation that takes about
`--ring` waited for the armed copy (its bell written by someone else, it would have waited until
that ring); one that never ends within `--timeout` blocked the ringing thread too. Each operation
runs in a process of its own. Prints one JSON object.

Whether a kernel that waited had its module loaded before: under CUDA's lazy loading (the default) the first
launch of a kernel loads it, and a load may wait for the whole device, which the armed copy never lets finish
(rlsync.transfer.batched.loaded). `--warm` runs each kernel operation once before the copy is armed (its kernels
loaded, as an engine's decode kernels are after its first steps); `--eager-loading` starts each probe with
CUDA_MODULE_LOADING=EAGER (every kernel loaded as the context starts).

    python bench/armed_hazards.py [--ring 1.0] [--timeout 8] [--warm] [--eager-loading] [--only OP]

Each probe reports its start (ready_s, gpu_used_gib: what eager loading costs) apart from the operation, and how
long after the bell's write its copy (256 MiB) was done (ring_to_done_ms). `--by cpu` puts the bell in pinned host
memory and writes it by a plain store of the CPU: the one write that no launch or load waiting in this process's
driver can hold up (a way out for a replica whose engine launched what waits for the device).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import subprocess
import sys
import threading
import time

import torch

BORN = time.perf_counter()  # (a probe's start: torch imported; the CUDA context comes with its first operation)
DEVICE = torch.device("cuda", 0)
MB = 1 << 20


def _ops() -> dict:
    x = torch.randn(64 * MB // 4, device=DEVICE)
    a = torch.randn(2048, 2048, device=DEVICE, dtype=torch.bfloat16)
    w = torch.randn(2048, 6144, device=DEVICE, dtype=torch.bfloat16)
    rows = iter([32, 37])  # warmed with one batch, timed with another: the library may pick another kernel
    return {
        "kernel_and_stream_sync": lambda: (x.mul_(1.0), torch.cuda.current_stream().synchronize()),
        "matmul_and_softmax": lambda: ((a @ a).softmax(-1), torch.cuda.current_stream().synchronize()),
        "matmul_another_batch": lambda: (a[:next(rows, 41)] @ w, torch.cuda.current_stream().synchronize()),
        "kernel_on_a_new_stream": lambda: _on(torch.cuda.Stream(DEVICE), lambda: x.mul_(1.0)),
        "item": lambda: x[0].item(),
        "cpu_pageable": lambda: x.cpu(),
        "to_cpu_non_blocking": lambda: (x.to("cpu", non_blocking=True), torch.cuda.current_stream().synchronize()),
        "malloc_new_segment": lambda: torch.empty(1 << 30, dtype=torch.uint8, device=DEVICE),
        "pinned_host_alloc": lambda: torch.empty(64 * MB, dtype=torch.uint8, pin_memory=True),
        "mem_get_info": lambda: torch.cuda.mem_get_info(DEVICE),
        "empty_cache": lambda: (torch.empty(1 << 30, dtype=torch.uint8, device=DEVICE), torch.cuda.empty_cache()),
        "new_stream_and_event": lambda: (torch.cuda.Stream(DEVICE), torch.cuda.Event(interprocess=True)),
        "device_synchronize": lambda: torch.cuda.synchronize(DEVICE),
    }


KERNELS = ("kernel_and_stream_sync", "kernel_on_a_new_stream", "matmul_and_softmax",
           "matmul_another_batch")  # what --warm runs first (the last: at another batch than it is timed at)


def _on(stream: torch.cuda.Stream, fn) -> None:
    with torch.cuda.stream(stream):
        fn()
    stream.synchronize()


def probe(name: str, ring: float, by: str, warm: bool) -> None:
    """The child: arms a copy, times `name`, while a thread writes the bell `ring` seconds later (`warm`: `name`
    run once before, its kernels loaded); then how long after that write the copy was done (ring_to_done_ms).
    `by` "cpu": the bell is a word of pinned host memory the GPU waits on, which the thread writes by a plain store
    (no call into CUDA that a launch waiting in the driver could hold up); else rlsync's Bell, in device memory."""
    from rlsync.transfer import driver
    from rlsync.transfer.armed import Armed, Bell

    op = _ops()[name]
    if warm and name in KERNELS:  # (an allocation warmed would come from a cache, not make the call it tests)
        op()
    torch.cuda.synchronize(DEVICE)
    src, dst = torch.ones(256 * MB, dtype=torch.uint8, device=DEVICE), torch.zeros(256 * MB, dtype=torch.uint8,
                                                                                   device=DEVICE)
    if by == "cpu":
        flag = torch.zeros(1, dtype=torch.int32, pin_memory=True)  # (mapped: one address for host and device)
        stream, done = torch.cuda.Stream(DEVICE), torch.cuda.Event()
        driver.wait_value(stream, flag.data_ptr(), 1)
        with torch.cuda.stream(stream):
            dst.copy_(src, non_blocking=True)
            done.record(stream)
        word = ctypes.c_int32.from_address(flag.data_ptr())
        write, disarm = (lambda: setattr(word, "value", 1)), stream.synchronize
    else:
        bell = Bell(DEVICE)
        armed = Armed(bell, lambda: dst.copy_(src, non_blocking=True), dst.numel(), ())
        ringer, done, disarm = torch.cuda.Stream(DEVICE), bell.event, armed.disarm
        one = torch.ones(1, dtype=torch.int32, pin_memory=True)

        def write() -> None:
            with torch.cuda.stream(ringer):
                if by == "kernel":
                    bell.flag[:1].fill_(1)
                else:  # a copy from host memory: the copy engine, not a kernel
                    bell.flag[:1].copy_(one, non_blocking=True)
    rung = []

    def ring_later() -> None:
        time.sleep(ring)
        rung.append(time.perf_counter())
        write()

    free, total = torch.cuda.mem_get_info(DEVICE)
    ready = {"ready_s": round(time.perf_counter() - BORN, 2), "gpu_used_gib": round((total - free) / 2**30, 2)}
    print(json.dumps(ready), flush=True)  # (armed: the parent's --timeout counts from here)
    threading.Thread(target=ring_later, daemon=True).start()
    start = time.perf_counter()
    op()
    seconds = time.perf_counter() - start
    while not done.query():
        pass
    copied = time.perf_counter()
    disarm()
    print(json.dumps({"seconds": round(seconds, 4), "waited": seconds > 0.8 * ring,
                      "ring_to_done_ms": round((copied - rung[0]) * 1e3, 3)}))


def run_probe(argv: list[str], env: dict, setup_timeout: float, timeout: float) -> dict:
    """One probe's figures: its start (ready_s: with eager loading, every module of the process loaded; and the
    GPU memory then), and the operation's. `hung`: not done `timeout` s after its copy was armed."""
    child = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(child.stdout), daemon=True)
    reader.start()
    deadline = time.monotonic() + setup_timeout
    while not lines and child.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    if not lines:
        child.kill()
        return {"error": child.stderr.read()[-300:] if child.poll() is not None else "not armed in time"}
    ready = json.loads(lines[0])
    try:
        child.wait(timeout)
    except subprocess.TimeoutExpired:
        child.kill()
        return {**ready, "hung": True}
    reader.join()
    if child.returncode != 0:
        return {**ready, "error": child.stderr.read()[-300:]}
    return {**ready, **json.loads(lines[1])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ring", type=float, default=1.0)
    parser.add_argument("--timeout", type=float, default=8.0, help="seconds from the copy's arming to the op's end")
    parser.add_argument("--setup-timeout", type=float, default=300.0, help="seconds for a probe to start and arm")
    parser.add_argument("--probe", help=argparse.SUPPRESS)
    parser.add_argument("--by", choices=("kernel", "copy", "cpu"), default="kernel",
                        help="how the other thread writes the bell: a fill kernel, a copy from host memory, or (a bell "
                             "in pinned host memory) a store by the CPU")
    parser.add_argument("--only", action="append", help="this operation only (repeatable)")
    parser.add_argument("--warm", action="store_true", help="each kernel operation runs once before the copy is armed")
    parser.add_argument("--eager-loading", action="store_true", help="each probe with CUDA_MODULE_LOADING=EAGER")
    args = parser.parse_args()
    if args.probe:
        return probe(args.probe, args.ring, args.by, args.warm)
    env = {**os.environ, **({"CUDA_MODULE_LOADING": "EAGER"} if args.eager_loading else {})}
    out = {"gpu": torch.cuda.get_device_name(DEVICE), "ring_s": args.ring, "by": args.by, "torch": torch.__version__,
           "CUDA_DEVICE_MAX_CONNECTIONS": os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS"),
           "CUDA_MODULE_LOADING": env.get("CUDA_MODULE_LOADING"), "warm": args.warm, "ops": {}}
    for name in args.only or _ops():
        out["ops"][name] = run_probe([sys.executable, __file__, "--probe", name, "--ring", str(args.ring), "--by",
                                      args.by, *(["--warm"] if args.warm else [])], env, args.setup_timeout,
                                     args.timeout)
        print(name, out["ops"][name], file=sys.stderr)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
