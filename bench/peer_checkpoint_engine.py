"""The same bytes on one GPU, trainer and receiver colocated in two processes: MoonshotAI's checkpoint-engine
0.4.2 (its CUDA IPC update, as its vLLM worker extension receives it) against rlsync's cuda_ipc one-copy, each
next to the device-to-device copy limit measured in the same run. Prints one JSON object (progress on stderr).

    python bench/peer_checkpoint_engine.py                        # qwen3-4b shapes, 8.8 GB bf16
    python bench/peer_checkpoint_engine.py --preset small --repeats 3
    python bench/peer_checkpoint_engine.py --only rlsync --hold [--arm]   # the receiver as a colocated replica

Every round first gives the trainer's GPU tensors new values (seeded by round: both systems move the same
bytes), synchronizes, and starts the clock. The clock stops when the trainer reads the receiver's DONE frame,
sent once the receiver's own tensors hold every byte and its GPU work is synchronized. Then, off the clock,
the receiver's checksums of its tensors are compared with the trainer's. The two processes talk in frames of
raw bytes over pipes (an offer travels as rlsync's doorbell carries it: serialized protobuf); rlsync's span
is also reported stage by stage ("stage.*", from both processes' clocks; "pull.*", the receiver's pull).
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import math
import os
import socket
import statistics
import struct
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from models import PRESETS, preset_shapes  # noqa: E402
from transfer import d2d_limit, make_tensors  # noqa: E402

from rlsync.transfer import Receiver, WeightSender, answer, checksum_tensor  # noqa: E402
from rlsync.transfer.armed import Bell, open_bell, ring_bell  # noqa: E402
from rlsync.transfer.manifest import from_proto  # noqa: E402
from rlsync.transfer.held import HELD  # noqa: E402
from rlsync.transfer.v1 import transfer_pb2 as pb  # noqa: E402

GB = 1e9
DEVICE = "cuda:0"
CKPT_VERSION = "0.4.2"
SYSTEMS = ("rlsync", "checkpoint-engine")

SPANS = {
    "rlsync": "sender.offer() -> the offer (raw protobuf) to the receiver, which pulls and answers -> sender.send() "
              "(the receiver maps the trainer's tensors by CUDA IPC and copies each once into its own) -> DONE",
    "checkpoint_engine": "register_checkpoint(use_shared_memory_pool=True) (trainer GPU tensors -> its pinned host "
                         "pool, reused after the warm-up) -> gather_metas() -> update() (H2D into its IPC bucket "
                         "buffer, handle and bucket metas over ZMQ, the receiver copies each tensor into its own, "
                         "as update_weights_from_ipc in its vLLM worker extension) -> DONE",
    "checkpoint_engine.update_only": "the same, from the update() call on: the new weights already in its pinned "
                                     "host pool (its README's 'Update' figure)",
    "checkpoint_engine.update_call": "update() call to its return: update_only plus its teardown after the "
                                     "receiver is done (barriers, freeing its buffers)",
    "checkpoint_engine.register": "register_checkpoint() and gather_metas(): the start of its span to update()",
    "rlsync.send": "sender.send() alone (the receiver already connected and waiting)",
    "rlsync.data": "sender.send() from the first Welcome on (connections and handshakes excluded)",
}


# -- pure ---------------------------------------------------------------------------------------------------------
def checked_names(shapes: dict[str, tuple[int, ...]], mode: str) -> list[str]:
    """The tensors whose checksums the receiver reports: all, a sample (first, middle, last, largest), or none."""
    names = list(shapes)
    if mode == "all":
        return names
    if mode == "off":
        return []
    largest = max(names, key=lambda n: math.prod(shapes[n]))
    return list(dict.fromkeys([names[0], names[len(names) // 2], names[-1], largest]))


def figures(rounds: list[dict[str, float]], nbytes: int, limit: float, rated: tuple[str, ...]) -> dict:
    """Medians over the timed rounds (a stage over the rounds that had it); each `rated` span also as GB/s and
    as a fraction of the d2d copy limit."""
    keys = dict.fromkeys(key for r in rounds for key in r)
    out: dict = {key: round(statistics.median(r[key] for r in rounds if key in r), 5) for key in keys}
    for key in rated:
        prefix = key.removesuffix("seconds")
        gbps = nbytes / out[key] / GB
        out[prefix + "GB/s"] = round(gbps, 2)
        out[prefix + "ratio_to_d2d"] = round(gbps / limit, 4)
    out["all_seconds"] = [round(r["seconds"], 5) for r in rounds]
    return out


# -- the trainer side ---------------------------------------------------------------------------------------------
def checksums(tensors: dict[str, torch.Tensor], names: list[str]) -> dict[str, str]:
    return {n: checksum_tensor(tensors[n]) for n in names}


def new_version(tensors: dict[str, torch.Tensor], version: int, names: list[str]) -> dict[str, str]:
    """What a training step does to the weights; returns the checksums the receiver must report afterwards."""
    gen = torch.Generator(device=DEVICE).manual_seed(version)
    for t in tensors.values():
        t.uniform_(-1.0, 1.0, generator=gen)
    expected = checksums(tensors, names)
    torch.cuda.synchronize(DEVICE)
    return expected


def progress(system: str, version: int, seconds: dict[str, float]) -> None:
    print(json.dumps({"system": system, "round": version, "warm_up": version == 0,
                      **{k: round(v, 5) for k, v in seconds.items()}}), file=sys.stderr, flush=True)


def watchdog(seconds: float) -> None:
    """Ends the whole run with every thread's traceback if this round outlasts `seconds`: a ZMQ REQ socket
    whose peer died waits forever, and a hung run would eat the GPU machine's time."""
    faulthandler.dump_traceback_later(seconds, exit=True)


class Frames:
    """Frames over a pair of pipes: an 8-byte kind, a length, and raw bytes (a protobuf message, as rlsync's
    doorbell carries it: no base64, no JSON; or JSON). Not stdout: what a library prints stays out of them."""

    _HEAD = struct.Struct("<8sI")

    def __init__(self, read_fd: int, write_fd: int):
        self._in, self._out = os.fdopen(read_fd, "rb"), os.fdopen(write_fd, "wb")

    def send(self, kind: str, payload: bytes = b"") -> None:
        self._out.write(self._HEAD.pack(kind.encode(), len(payload)) + payload)
        self._out.flush()

    def recv(self) -> tuple[str, bytes] | None:
        """The next frame, or None once the other end closed."""
        head = self._in.read(self._HEAD.size)
        if len(head) < self._HEAD.size:
            return None
        kind, n = self._HEAD.unpack(head)
        return kind.rstrip(b"\0").decode(), self._in.read(n)

    def close(self) -> None:
        self._out.close()


class Peer:
    """The receiver: this script with --serve, in its own process on the same GPU, driven by one frame per
    transfer (OFFER: rlsync's offer; PATHS: checkpoint-engine's socket paths, JSON); it replies with frames
    READY, ANSWER, DONE, CHECK or ERROR."""

    def __init__(self, system: str, args: argparse.Namespace):
        self.system = system
        to_child, from_child = os.pipe(), os.pipe()
        self.proc = subprocess.Popen([sys.executable, __file__, "--serve", system, "--preset", args.preset,
                                      "--bytes-check", args.bytes_check, "--timeout", str(args.timeout),
                                      "--fds", f"{to_child[0]},{from_child[1]}", *(["--hold"] if args.hold else []),
                                      *(["--arm"] if args.arm else [])],
                                     pass_fds=(to_child[0], from_child[1]), stdout=sys.stderr)  # (ours: the JSON)
        os.close(to_child[0]), os.close(from_child[1])
        self.frames = Frames(from_child[0], to_child[1])
        self.expect("READY")

    def send(self, kind: str, payload: bytes) -> None:
        self.frames.send(kind, payload)

    def expect(self, kind: str) -> bytes:
        while (frame := self.frames.recv()) is not None:
            if frame[0] == "ERROR":
                raise RuntimeError(f"{self.system} receiver failed: {frame[1].decode()}")
            if frame[0] == kind:
                return frame[1]
        raise RuntimeError(f"{self.system} receiver exited ({self.proc.wait()}) before sending {kind}")

    def verify(self, expected: dict[str, str]) -> None:
        got = json.loads(self.expect("CHECK"))
        wrong = [n for n in expected if got.get(n) != expected[n]]
        if wrong:
            raise RuntimeError(f"{self.system}: {len(wrong)} of {len(expected)} checked tensors arrived different, "
                               f"e.g. {wrong[0]!r} (sent {expected[wrong[0]]}, received {got.get(wrong[0])})")

    def close(self) -> None:
        self.frames.close()
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def run_rlsync(args, tensors: dict[str, torch.Tensor], names: list[str]) -> list[dict[str, float]]:
    """rlsync's colocated path (bench/transfer.py's cuda_ipc one_copy): the receiver maps the trainer's
    tensors and copies each once into its own."""
    watchdog(args.timeout)
    peer = Peer("rlsync", args)
    rounds = []
    try:
        bell = open_bell(peer.expect("BELL"), torch.device(DEVICE)) if args.arm else None
        with WeightSender(tensors, bucket_bytes=args.bucket_mib << 20, backends=["cuda_ipc"]) as sender:
            for version in range(args.repeats + 1):  # the first one warms up
                watchdog(args.timeout)
                expected = new_version(tensors, version, names)
                start = time.perf_counter()
                # 1. offer, 2. the receiver answers (connected already), 3. the bytes move, 4. the receiver is done
                if bell is not None:  # the weights are final: start the copy the receiver armed (as a trainer
                    ring_bell(bell, version + 1)  # rings a colocated replica's bell before its PrepareUpdate)
                offer = sender.offer(version=version, pull=True)
                if bell is not None:
                    offer.mapped.bell, offer.mapped.waits = version + 1, True
                offered = time.perf_counter()
                peer.send("OFFER", offer.SerializeToString())
                written = time.perf_counter()
                ans = pb.Answer.FromString(peer.expect("ANSWER"))
                answered = time.perf_counter()
                report = sender.send(offer, [ans], timeout=args.timeout)
                sent = time.perf_counter()
                there = json.loads(peer.expect("DONE"))
                end = time.perf_counter()
                if not offer.one_copy:
                    raise RuntimeError("rlsync did not offer one-copy for contiguous CUDA tensors")
                peer.verify(expected)
                rounds.append({"seconds": end - start, "send_seconds": report.seconds,
                               "data_seconds": report.data_seconds, "adopted": float(there.get("adopted", False)),
                               **span_stages(there, start, offered, written, answered, sent, end)})
                progress("rlsync", version, rounds[-1])
    finally:
        faulthandler.cancel_dump_traceback_later()
        peer.close()
    return rounds[1:]


def span_stages(there: dict, start: float, offered: float, written: float, answered: float, sent: float,
                end: float) -> dict[str, float]:
    """Where rlsync's span went, from the trainer's clock readings and the receiver's (`there`: one clock
    for both processes on Linux): each stage as "stage.NAME" seconds, the receiver's pull as "pull.NAME"."""
    r = there["at"]
    stages = {"offer": offered - start, "write_offer": written - offered, "pipe_to_receiver": r["got"] - written,
              "decode": r["decoded"] - r["got"], "answer": r["answered"] - r["decoded"],
              "receiver_setup": r["set_up"] - r["answered"], "pull": r["pulled"] - r["set_up"],
              "answer_back": answered - r["pulled"], "send": sent - answered,
              "done_back": end - max(sent, r["synced"])}
    return {**{f"stage.{k}": v for k, v in stages.items()},
            **{f"pull.{k}": v for k, v in there["pull"].items()}}


def load_checkpoint_engine() -> tuple[type, str, list[str]]:
    """checkpoint-engine's ParameterServer, its version, and the list its bucket-size notes will land in."""
    try:
        import checkpoint_engine
        from checkpoint_engine.device_utils import get_ip
        from checkpoint_engine.ps import ParameterServer
        from loguru import logger
    except ImportError as e:
        sys.exit(f"checkpoint-engine {CKPT_VERSION} cannot be imported ({e}): run `make wheels` where there is "
                 "network, then `make gpu-setup` on this machine")
    try:
        get_ip()  # gather_metas records this host's IP: fail here, not in the middle of the run
    except OSError as e:
        sys.exit(f"checkpoint-engine cannot find this host's IP address ({e}); its gather_metas needs one")
    if checkpoint_engine.__version__ != CKPT_VERSION:
        print(f"warning: checkpoint-engine {checkpoint_engine.__version__}, this bench was written against "
              f"{CKPT_VERSION}", file=sys.stderr)
    notes: list[str] = []
    logger.remove()
    logger.add(sys.stderr, level="WARNING")
    logger.add(lambda m: notes.append(str(m).strip()), level="INFO", format="{message}",
               filter=lambda r: "bucket size" in r["message"] or "h2d buffer" in r["message"])
    return ParameterServer, checkpoint_engine.__version__, notes


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_checkpoint_engine(args, tensors: dict[str, torch.Tensor], names: list[str],
                          parameter_server: type) -> list[dict[str, float]]:
    """checkpoint-engine's colocated path as its examples drive it (register, gather metas, update), one
    ParameterServer of world size 1 on this GPU."""
    watchdog(args.timeout)
    os.environ.update(RANK="0", WORLD_SIZE="1")  # ParameterServer reads them when rank=0 (falsy) is passed
    ps = parameter_server(rank=0, world_size=1, auto_pg=False, master_addr="127.0.0.1", master_port=free_port())
    # One NCCL group of world size 1 over checkpoint-engine's own TCPStore on localhost, kept across updates:
    # auto_pg=True would build and destroy it inside every update() and charge that to every round.
    ps.init_process_group()
    peer = Peer("checkpoint-engine", args)
    done: list[float] = []

    def req_func(socket_paths: list[tuple[str, str]]) -> None:
        # Its vLLM integration: HTTP -> collective_rpc -> the worker's update_weights_from_ipc, which returns when
        # the weights are loaded. Here: a line to the receiver process, and its DONE line back.
        peer.send("PATHS", json.dumps(dict(socket_paths)).encode())
        peer.expect("DONE")
        done.append(time.perf_counter())

    rounds = []
    try:
        for version in range(args.repeats + 1):  # the first one warms up (allocates the pinned pool)
            watchdog(args.timeout)
            expected = new_version(tensors, version, names)
            name = f"bench-v{version}"
            start = time.perf_counter()
            # 1. the new weights into its pinned host pool, 2. metas, 3. update: req_func sees the receiver done
            ps.register_checkpoint(name, named_tensors=tensors, use_shared_memory_pool=True)
            ps.gather_metas(name)
            update_start = time.perf_counter()
            ps.update(name, req_func)
            returned = time.perf_counter()
            ps.unregister_checkpoint(name)  # frees the name only: the pinned pool stays for the next version
            if len(done) != version + 1:
                raise RuntimeError("checkpoint-engine's update() returned before the receiver said DONE")
            peer.verify(expected)
            rounds.append({"seconds": done[-1] - start, "update_only_seconds": done[-1] - update_start,
                           "register_seconds": update_start - start, "update_call_seconds": returned - update_start})
            progress("checkpoint-engine", version, rounds[-1])
    finally:
        faulthandler.cancel_dump_traceback_later()
        peer.close()
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    return rounds[1:]


# -- the receiver side --------------------------------------------------------------------------------------------
class RlsyncReceiver:
    """hold: the trainer's storages stay mapped from one round to the next, as a replica on the trainer's
    GPU keeps them (HoldWeights) while they stay in place. arm (with hold): after each round's check, the
    last pull is queued again behind this process's bell (Receiver.arm), as the hf replica arms its
    update at each wake: a round rung with the bell adopts the copy the trainer started."""

    def __init__(self, timeout: float, hold: bool, arm: bool, emit: Callable[[str, bytes], None]):
        self.timeout, self.hold, self.emit = timeout, "bench" if hold or arm else "", emit
        self.bell = Bell(torch.device(DEVICE)) if arm else None
        self.armed = self.last = None  # the copy armed for the next round, and the receiver whose pull it repeats

    def __call__(self, payload: bytes, got: float, dest: dict[str, torch.Tensor]) -> dict:
        """-> this process's clock readings ("at") and the pull's own profile, for span_stages()."""
        at = {"got": got}
        offer = pb.Offer.FromString(payload)
        at["decoded"] = time.perf_counter()
        ans = answer(offer, "bench-receiver", device=DEVICE, force="cuda_ipc")
        if self.armed is not None and ans.pull and self.armed.adopt(from_proto(offer.manifest), offer):
            ans.copied.append(self.bell.event_handle)  # started by the trainer's bell: the answer names its event
            at["answered"] = at["set_up"] = at["pulled"] = time.perf_counter()
            self.emit("ANSWER", ans.SerializeToString())
            return {"at": at, "pull": {}, "adopted": True}
        if self.armed is not None:
            self.armed.disarm()
        at["answered"] = time.perf_counter()
        self.last = receiver = Receiver(offer, ans, dest, timeout=self.timeout,  # connects before answering, as
                                        hold=self.hold)                         # rlsync's engines do
        at["set_up"] = time.perf_counter()
        report = receiver.run() if ans.pull else None  # a pull: copied before the answer, as rlsync's engines do
        at["pulled"] = time.perf_counter()
        self.emit("ANSWER", ans.SerializeToString())
        if not ans.pull:
            report = receiver.run()
        return {"at": at, "pull": dict(report.profile) if ans.pull else {}, "adopted": False}

    def idle(self) -> None:
        """After the round's check, nothing else queued: arm the next round's copy."""
        if self.bell is not None and self.last is not None:
            self.armed = self.last.arm(self.bell)

    def close(self) -> None:
        if self.armed is not None:
            self.armed.disarm()  # it reads the trainer's memory: done before the mappings close
        HELD.release("bench")  # before the trainer's memory may go (it waits for this process to exit)


def checkpoint_engine_receiver(dest: dict[str, torch.Tensor]):
    """What its VllmColocateWorkerExtension.update_weights_from_ipc does, minus vLLM: its own public receiver
    helper, with a loader that copies each tensor into this process's own (vLLM's load_weights does the same
    for plain weights)."""
    import zmq
    from checkpoint_engine.worker import update_weights_from_ipc

    ctx = zmq.Context()
    uuid = f"GPU-{torch.cuda.get_device_properties(0).uuid!s}"  # as checkpoint-engine names a GPU

    def load(weights: list[tuple[str, torch.Tensor]]) -> None:
        for name, t in weights:
            dest[name].copy_(t)

    def receive(payload: bytes, got: float, dest: dict[str, torch.Tensor]) -> dict:
        paths = json.loads(payload)
        if uuid not in paths:
            raise RuntimeError(f"no ZMQ socket for this GPU ({uuid}) among {sorted(paths)}")
        update_weights_from_ipc(ctx, paths[uuid], device_id=0, run=load)
        return {}

    return receive


def serve(args) -> None:
    """The receiver process: its own tensors on the shared GPU (one allocation each, like an engine's
    parameters), written by the system under test, checksummed after each transfer off the clock."""
    torch.cuda.set_device(0)
    shapes = preset_shapes(args.preset)
    dest = make_tensors(shapes, DEVICE, "scattered")
    names = checked_names(shapes, args.bytes_check)
    frames = Frames(*map(int, args.fds.split(",")))
    rlsync = RlsyncReceiver(args.timeout, args.hold, args.arm, frames.send) if args.serve == "rlsync" else None
    receive = rlsync or checkpoint_engine_receiver(dest)
    torch.cuda.synchronize(DEVICE)
    frames.send("READY")
    if rlsync is not None and rlsync.bell is not None:
        frames.send("BELL", rlsync.bell.handle)
    while (frame := frames.recv()) is not None:
        got = time.perf_counter()
        try:
            there = receive(frame[1], got, dest)
            torch.cuda.synchronize(DEVICE)  # (an adopted copy: started by the trainer's bell, so it ends)
            if there:
                there["at"]["synced"] = time.perf_counter()
        except Exception as e:  # noqa: BLE001 - reported to the trainer, then fatal
            frames.send("ERROR", f"{type(e).__name__}: {e}".encode())
            raise
        frames.send("DONE", json.dumps(there).encode())
        frames.send("CHECK", json.dumps(checksums(dest, names)).encode())
        if rlsync is not None:
            rlsync.idle()
    if rlsync is not None:
        rlsync.close()


# -- main ---------------------------------------------------------------------------------------------------------
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="qwen3-4b", choices=sorted(PRESETS),
                        help="model shapes (bench/models.py): qwen3-4b (8.8 GB bf16, default), qwen3-1.7b, small")
    parser.add_argument("--repeats", type=int, default=5, help="timed rounds per system, after one warm-up")
    parser.add_argument("--layout", default="scattered", choices=("scattered", "flat"),
                        help="the trainer's tensors: one allocation each (a plain state dict, default) or views "
                             "into one buffer (how rlsync's trainer keeps them); the receiver's are always scattered")
    parser.add_argument("--bytes-check", default="all", choices=("all", "sample", "off"),
                        help="receiver-side checksums after every transfer: every tensor (default), up to 4 "
                             "(first, middle, last, largest), or none")
    parser.add_argument("--bucket-mib", type=int, default=512, help="rlsync's bucket size (as bench/transfer.py)")
    parser.add_argument("--only", default="", help="comma-separated: rlsync, checkpoint-engine (default both)")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds one round may take before the "
                        "run is ended with tracebacks")
    parser.add_argument("--hold", action="store_true", help="rlsync's receiver keeps the trainer's storages mapped "
                        "from one round to the next (a replica on the trainer's GPU does, HoldWeights)")
    parser.add_argument("--arm", action="store_true", help="rlsync's receiver also arms each next pull behind its "
                        "bell, which the trainer rings before it offers (a colocated hf replica does; implies --hold)")
    parser.add_argument("--serve", choices=SYSTEMS, help=argparse.SUPPRESS)
    parser.add_argument("--fds", help=argparse.SUPPRESS)  # the receiver's: frames in, frames out
    args = parser.parse_args()
    if args.serve:
        serve(args)
        return
    systems = [s for s in SYSTEMS if s in (set(filter(None, args.only.split(","))) or set(SYSTEMS))]
    if args.repeats < 1 or not systems:
        parser.error(f"need --repeats >= 1 and --only among {', '.join(SYSTEMS)}")
    if not torch.cuda.is_available():
        sys.exit("peer_checkpoint_engine.py needs a CUDA GPU: trainer and receiver share one GPU through CUDA IPC "
                 "(run it on the GPU machine, after `make gpu-setup`)")
    ckpt = load_checkpoint_engine() if "checkpoint-engine" in systems else None

    torch.cuda.set_device(0)
    limit = d2d_limit(4 << 30, DEVICE)
    torch.cuda.empty_cache()  # checkpoint-engine sizes its buckets from the GPU's free memory
    shapes = preset_shapes(args.preset)
    tensors = make_tensors(shapes, DEVICE, args.layout)
    names = checked_names(shapes, args.bytes_check)
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    out: dict = {"preset": args.preset, "bytes": nbytes, "tensors": len(tensors), "dtype": "bfloat16",
                 "trainer_layout": args.layout, "receiver_layout": "scattered", "gpu": torch.cuda.get_device_name(0),
                 "torch": torch.__version__, "repeats": args.repeats, "warm_up_rounds": 1,
                 "limits": {"d2d_copy_GB/s": round(limit, 1)},
                 "bytes_check": {"mode": args.bytes_check, "tensors_per_transfer": len(names),
                                 "where": "receiver's own tensors, after every transfer (warm-up included)"},
                 "spans": {"start": "new weights in the trainer's GPU tensors, synchronized",
                           "end": "trainer reads the receiver's DONE: its own tensors hold every byte, GPU synced",
                           **SPANS}}
    if "rlsync" in systems:
        out["rlsync"] = {"backend": "cuda_ipc", "mode": "pull (one copy)", "held": args.hold or args.arm,
                         "armed": args.arm,
                         **figures(run_rlsync(args, tensors, names), nbytes, limit, ("seconds",))}
    if ckpt is not None:
        parameter_server, version, notes = ckpt
        rounds = run_checkpoint_engine(args, tensors, names, parameter_server)
        out["checkpoint_engine"] = {"version": version, "notes": list(dict.fromkeys(notes)),
                                    **figures(rounds, nbytes, limit, ("seconds", "update_only_seconds"))}
    if len(systems) == 2:
        rl, ce = out["rlsync"]["seconds"], out["checkpoint_engine"]
        out["rlsync_vs_checkpoint_engine"] = round(ce["seconds"] / rl, 3)
        out["rlsync_vs_checkpoint_engine_update_only"] = round(ce["update_only_seconds"] / rl, 3)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
