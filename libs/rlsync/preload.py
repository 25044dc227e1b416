"""Services forked from a process that imported torch, transformers and rlsync's servers once.

An hf replica or a trainer spends ~5 s of CPU importing before it listens (`from transformers import
AutoModelForCausalLM` alone: ~4.5 s), the coordinator ~1 s; forked from this image, 0.2 s. A test
session starts a few hundred of them on a 2-core machine, so `tests/conftest.py` starts one
`Preloaded` for the session and `ServiceProcess` forks from it what it can (`preloaded_for`).

The preloaded process (`python -m rlsync.preload ADDRESS`) imports, never runs a torch op or makes a
gRPC object (no thread exists when it forks), and answers on an abstract Unix socket: msgpack
(msgspec) `Start` -> the child's pid, `Status` -> its exit status once reaped (it is the child's
parent). The child takes the environment, working directory and log it is given, a process group
of its own, and runs `rlsync.<service>.__main__.main(argv)`, or a script given that runs the service
itself (a test's replica with a fault injected first: `python SCRIPT argv` as a process of its own).

A one-worker vLLM replica imports vLLM too (~10 s of CPU more): a second image, `image="vllm"`, holds
that, made when the first vLLM replica asks (its engine core is still a process vLLM spawns, which
imports for itself). An SGLang replica runs in SGLang's own environment: a third image, `image="sglang"`,
is that environment's Python with SGLang's engine imported (its scheduler and detokenizer are still
processes SGLang spawns, which import for themselves). The SGLang tests alone on 2 idle cores: about 940 ->
468 s of CPU, 690 -> 310 s.

A process the tests start that starts services itself (the demo: `python -m rlsync.demo.run`) forks them
from the same images: it is started with `RLSYNC_PRELOADED` (`exported("base", "vllm")`: each image's
address and a digest of the environment it imported in), and attaches to them when it first starts a
service; an image gone or an environment that differs and it starts them in processes of their own.

Not for: a service given environment variables the preloaded process did not start with (what modules
read at import would differ; but see AT_START, and a variable the image's own imports set, with the value
they set, is no difference), a command of its own (but a script may be: the service's arguments, run
with the image's Python), or a parent-death signal.
"""

from __future__ import annotations

import atexit
import hashlib
import importlib
import json
import os
import runpy
import select
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
import traceback
import uuid
from collections.abc import Callable
from pathlib import Path

import msgspec

_HEADER = struct.Struct("<I")
ENV = "RLSYNC_PRELOADED"  # {image: [address, environment digest]}: images a process started with it forks from
# (not import-time settings: one changes under a test runner from test to test, the other names the images)
VOLATILE = ("PYTEST_CURRENT_TEST", ENV)
PRELOAD = ("torch", "grpc", "transformers", "rlsync.rollout.server", "rlsync.rollout.engines.hf",
           "rlsync.trainer.server", "rlsync.coordinator.server", "rlsync.rollout.__main__",
           "rlsync.trainer.__main__", "rlsync.coordinator.__main__")
IMAGES = {"base": PRELOAD, "vllm": (*PRELOAD, "vllm", "rlsync.rollout.engines.vllm"),
          "sglang": ("torch", "grpc", "transformers", "sglang.srt.entrypoints.engine", "rlsync.rollout.server",
                     "rlsync.rollout.engines.sglang", "rlsync.rollout.__main__")}
# Variables an image's modules read only once an engine starts, never at import: a service may set them
# and still be forked from the image (a tensor-parallel vLLM replica's thread binding; the fault a test's
# script injects as it starts, tests/rollout_worker.py, which no module of an image reads).
FAULT = ("RLSYNC_FAULT",)
AT_START = {"base": FAULT, "vllm": (*FAULT, "VLLM_CPU_OMP_THREADS_BIND", "VLLM_CPU_NUM_OF_RESERVED_CPU"),
            "sglang": FAULT}


class Start(msgspec.Struct, tag=True):
    service: str
    argv: list[str]
    env: dict[str, str]
    cwd: str
    log_path: str
    niceness: int | None = None
    script: str = ""  # run as __main__ instead of the service's module (it runs the service itself)


class Status(msgspec.Struct, tag=True):
    pid: int


class Describe(msgspec.Struct, tag=True):
    """-> what the image's imports set in its environment (Reply.imported)."""


class Reply(msgspec.Struct):
    pid: int = 0
    returncode: int | None = None  # Popen's: negative for a signal
    imported: dict[str, str] = {}
    error: str = ""


_REQUEST = msgspec.msgpack.Decoder(Start | Status | Describe)
_REPLY = msgspec.msgpack.Decoder(Reply)
_ENCODE = msgspec.msgpack.Encoder().encode


def _send(sock: socket.socket, data: bytes) -> None:
    sock.sendall(_HEADER.pack(len(data)) + data)


def _recv(sock: socket.socket) -> bytes | None:
    header = _exactly(sock, _HEADER.size)
    return None if header is None else _exactly(sock, _HEADER.unpack(header)[0])


def _exactly(sock: socket.socket, n: int) -> bytes | None:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            return None
        data += chunk
    return data


def _digest(env: dict[str, str], image: str, imported: dict[str, str]) -> str:
    """What of an environment a service forked from `image` must share with it: all but what is read later,
    and what the image's own imports set, where it is the same (a launcher's imports may set it too: torch's
    inductor sets its cache folder, so does `from_pretrained` in a test, and a child forked gets it anyway)."""
    ignored = (*VOLATILE, *AT_START[image])
    kept = sorted((k, v) for k, v in env.items() if k not in ignored and not (k in imported and imported[k] == v))
    return hashlib.sha256(json.dumps(kept).encode()).hexdigest()[:16]


def eligible(service: str, args: list[str]) -> str | None:
    """The image that holds what a service imports: "base" for the coordinator, the trainer and an hf
    replica, "vllm" for a vLLM replica, "sglang" for an SGLang one; None for any other."""
    if service in ("coordinator", "trainer"):
        return "base"
    engine = args[args.index("--engine") + 1:][:1] if service == "rollout" and "--engine" in args else []
    return {"hf": "base", "vllm": "vllm", "sglang": "sglang"}.get(engine[0]) if engine else None


# ---- the launcher's side --------------------------------------------------------------------------

class Forked:
    """What ServiceProcess uses of a Popen, for a child of the preloaded process: its exit status comes
    from there (which reaps it); signals go straight to it."""

    def __init__(self, pid: int, owner: Preloaded):
        self.pid, self.returncode, self._owner = pid, None, owner

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self._owner.status(self.pid)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout)
            time.sleep(0.02)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass


class Preloaded:
    """The preloaded process, started here and stopped with `close()` (its children are not: each is
    stopped by its own ServiceProcess)."""

    def __init__(self, log_path: str | Path | None = None, ready_timeout: float = 120.0, image: str = "base",
                 env: dict[str, str] | None = None, python: str = sys.executable):
        """env: the environment it starts with, and which its children must be given (default: this
        process's); python: the environment's interpreter (SGLang's has one of its own)."""
        self.address = f"@rlsync-preload-{uuid.uuid4().hex[:12]}"
        self.image = image
        self.env = env = dict(os.environ if env is None else env)
        log = open(log_path or os.devnull, "ab")  # noqa: SIM115 - the child keeps its own descriptor
        with log:
            self.proc: subprocess.Popen | None = subprocess.Popen(
                [python, "-m", "rlsync.preload", self.address, image],
                stdin=subprocess.PIPE,  # (closed when this process ends: so does it)
                stdout=log, stderr=subprocess.STDOUT, process_group=0, env=env)
        self._connect(time.monotonic() + ready_timeout, f"the preloaded process did not start (log: {log_path})")
        self.env_digest = _digest(env, image, self.imported)

    @classmethod
    def attach(cls, address: str, image: str, env_digest: str) -> Preloaded:
        """One that another process started (its `exported`): this one forks from it, and never stops it."""
        self = cls.__new__(cls)
        self.address, self.image, self.env_digest, self.env, self.proc = address, image, env_digest, None, None
        self._connect(time.monotonic(), f"the preloaded process at {address} is gone")
        return self

    def _connect(self, deadline: float, failure: str) -> None:
        from rlsync.rpc.doorbell import to_socket  # (here: it imports grpc, which launchers need not)

        self._lock = threading.Lock()
        self._sock: socket.socket | None = None
        while self._sock is None:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                sock.connect(to_socket(self.address))
                self._sock = sock
            except OSError:
                sock.close()
                if (self.proc is not None and self.proc.poll() is not None) or time.monotonic() > deadline:
                    raise RuntimeError(failure) from None
                time.sleep(0.05)
        self.imported = self._call(Describe()).imported

    def alive(self) -> bool:
        return self._sock is not None and (self.proc is None or self.proc.poll() is None)

    def start(self, service: str, args: list[str], env: dict[str, str], log_path: Path,
              niceness: int | None = None, script: str | Path | None = None) -> Forked:
        reply = self._call(Start(service, args, env, os.getcwd(), str(log_path), niceness, str(script or "")))
        if reply.error:
            raise RuntimeError(f"the preloaded process could not start {service}: {reply.error}")
        return Forked(reply.pid, self)

    def status(self, pid: int) -> int | None:
        try:
            reply = self._call(Status(pid))
        except OSError:  # the preloaded process is gone, and the statuses it had with it
            try:
                os.kill(pid, 0)
                return None
            except ProcessLookupError:
                return -signal.SIGKILL
        if reply.error:
            raise RuntimeError(reply.error)
        return reply.returncode

    def _call(self, request: Start | Status | Describe) -> Reply:
        with self._lock:
            if self._sock is None:
                raise ConnectionError("the preloaded process is closed")
            try:
                _send(self._sock, _ENCODE(request))
                data = _recv(self._sock)
            except OSError:
                data = None
            if data is None:  # (not alive() from now on: services get processes of their own)
                self._sock.close()
                self._sock = None
                raise ConnectionError("the preloaded process went away")
        return _REPLY.decode(data)

    def close(self) -> None:
        with self._lock:
            if self._sock is not None:
                self._sock.close()
                self._sock = None
        if self.proc is not None and self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


_session: dict[str, Preloaded | Callable[[], Preloaded]] = {}
_making = threading.Lock()  # one image of each kind, however many threads start services at once


def use(preloaded: Preloaded | Callable[[], Preloaded] | None,
        images: dict[str, Callable[[], Preloaded]] | None = None) -> None:
    """Services this process starts from now on are forked from `preloaded` where they can be (None: none);
    those of another image (images: "vllm", "sglang") from the one its maker makes, called when the first
    such service starts (so may `preloaded` be: a maker)."""
    _session.clear()
    if preloaded is not None:
        _session.update({"base": preloaded, **(images or {})})


def exported(*images: str) -> str | None:
    """The value of RLSYNC_PRELOADED with which a process this one starts forks its services from this
    process's images `images` too (each made now if not yet); None where this process has none of them."""
    named = {image: [found.address, found.env_digest] for image in images
             if (found := made(image)) is not None and found.alive()}
    return json.dumps(named) if named else None


def made(image: str) -> Preloaded | None:
    """This process's image `image` ("base", "vllm", "sglang"), made now if not yet; None where it has none."""
    with _making:
        if not _session and not _attached and os.environ.get(ENV):
            _attach(os.environ[ENV])
        found = _session.get(image)
        if found is not None and not isinstance(found, Preloaded):
            found = _session[image] = found()
    return found


_attached: list[str] = []  # RLSYNC_PRELOADED's value, once this process has attached to what it names


def _attach(value: str) -> None:
    _attached.append(value)
    try:
        named = {image: (str(address), str(digest)) for image, (address, digest) in json.loads(value).items()}
    except (ValueError, TypeError, AttributeError):  # not what `exported` writes: fork from nothing
        return
    for image, (address, digest) in named.items():
        try:
            _session[image] = Preloaded.attach(address, image, digest)
        except (RuntimeError, ConnectionError):  # gone (its session ended): their services get processes of their own
            pass


def preloaded_for(service: str, args: list[str], env: dict[str, str], command, parent_death_signal: int):
    """The Preloaded a service so started may be forked from, else None (a process of its own): see
    the module's docstring for which."""
    image = eligible(service, args)
    if image is None or command is not None or parent_death_signal:
        return None
    found = made(image)  # (None: use(None) meanwhile, or no such image)
    return found if found is not None and found.alive() and \
        _digest(env, image, found.imported) == found.env_digest else None


# ---- the preloaded process ------------------------------------------------------------------------

def _child(request: Start, keep_closed: list[socket.socket], imported_env: dict[str, str]) -> None:
    """In the forked child: become the service, then exit (never back into the server's loop)."""
    code = 1
    try:
        for s in keep_closed:
            s.close()
        os.setpgid(0, 0)
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGCHLD):
            signal.signal(sig, signal.SIG_DFL)
        null = os.open(os.devnull, os.O_RDONLY)
        log = os.open(request.log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(null, 0), os.dup2(log, 1), os.dup2(log, 2)
        os.close(null), os.close(log)
        if request.niceness is not None:
            try:
                os.setpriority(os.PRIO_PROCESS, 0, request.niceness)
            except OSError:
                pass
        os.environ.clear()
        os.environ.update(request.env)
        os.environ.update(imported_env)  # what the imports set, as in a process of its own (vLLM's: several)
        os.chdir(request.cwd)
        if request.script:  # as `python SCRIPT argv` runs it: its folder first on the path
            sys.argv = [request.script, *request.argv]
            sys.path.insert(0, os.path.dirname(os.path.abspath(request.script)))
            runpy.run_path(request.script, run_name="__main__")
            code = 0
        else:
            sys.argv = [f"rlsync.{request.service}", *request.argv]
            code = importlib.import_module(f"rlsync.{request.service}.__main__").main(request.argv)
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:  # noqa: BLE001 - said in the service's log, as an uncaught error would be
        traceback.print_exc()
    finally:
        try:
            atexit._run_exitfuncs()  # what the service registered; the server's frames are not unwound
            sys.stdout.flush(), sys.stderr.flush()
        finally:
            os._exit(code if isinstance(code, int) else 1)


def serve(address: str, image: str = "base") -> None:
    before = dict(os.environ)
    for module in IMAGES[image]:
        importlib.import_module(module)
    imported_env = {k: v for k, v in os.environ.items() if before.get(k) != v}
    from rlsync.rpc.doorbell import to_socket

    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(to_socket(address))
    server.listen(16)
    clients: list[socket.socket] = []
    exited: dict[int, int] = {}
    children: set[int] = set()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    while True:
        while children:  # reap
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            children.discard(pid)
            exited[pid] = os.waitstatus_to_exitcode(status)
        readable, _, _ = select.select([server, sys.stdin, *clients], [], [], 0.02)
        for sock in readable:
            if sock is sys.stdin:  # the launcher's end of the pipe closed: it is gone, and so is this
                if not os.read(0, 1 << 12):
                    return
                continue
            if sock is server:
                clients.append(server.accept()[0])
                continue
            try:
                data = _recv(sock)
            except OSError:
                data = None
            if data is None:
                clients.remove(sock)
                sock.close()
                continue
            request = _REQUEST.decode(data)
            if isinstance(request, Describe):
                reply = Reply(imported=imported_env)
            elif isinstance(request, Status):
                reply = Reply(pid=request.pid, returncode=exited.get(request.pid))
                if request.pid not in children and request.pid not in exited:
                    reply.error = f"pid {request.pid} is not a child of the preloaded process"
            else:
                sys.stdout.flush(), sys.stderr.flush()  # nothing of this process's buffers in the child's log
                pid = os.fork()
                if pid == 0:
                    _child(request, [server, *clients], imported_env)
                children.add(pid)
                reply = Reply(pid=pid)
            _send(sock, _ENCODE(reply))


if __name__ == "__main__":
    serve(*sys.argv[1:3])
