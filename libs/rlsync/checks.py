"""Start-up checks: what a value must be for a service to start, said in one line a user can act on
(StartupError: the flag, its RLSYNC_ variable, the problem). Config fields name these as their
`check`; the entry points print the message and exit with status 2, as argparse does."""

from __future__ import annotations

import errno
import ipaddress
import os
import re
import socket
from pathlib import Path

ENV_PREFIX = "RLSYNC_"


class StartupError(SystemExit):
    """A value a command cannot start with, said in one line. The command's entry point (serve_main,
    rlsync.cli.main) prints `<prog>: error: <message>` to stderr and exits with status 2, as argparse
    does for a flag it refuses.

    A SystemExit on purpose: no `except Exception` on its way out (a retry loop, a task's error log)
    swallows it, and a caller that does not catch it still ends with the message, not a traceback."""

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message

    def __str__(self) -> str:
        return self.message


def flag(name: str) -> str:
    """A field's flag and variable, as messages name them: `--update-timeout (RLSYNC_UPDATE_TIMEOUT)`."""
    return f"--{name.replace('_', '-')} ({ENV_PREFIX}{name.upper()})"


def refused(name: str, problem: str) -> StartupError:
    """`argument --lease (RLSYNC_LEASE): must be more than 0, got -1.0`: argparse's words, and the variable."""
    return StartupError(f"argument {flag(name)}: {problem}")



_TARGET_SCHEMES = ("dns:", "unix:", "unix-abstract:", "ipv4:", "ipv6:")  # gRPC target names, passed as they are


def grpc_address(value: str) -> str | None:
    """Empty (none), host:port, [IPv6]:port, or a gRPC target name (dns:///..., unix:...)."""
    if not value or value.startswith(_TARGET_SCHEMES):
        return None
    if "://" in value:
        return f"{value!r}: write host:port, without a scheme"
    host, sep, port = value.rpartition(":")
    if not sep or not host:
        return f"{value!r} is not host:port (a port is needed)"
    if not port.isdigit() or not 1 <= int(port) <= 65535:
        return f"{value!r}: {port!r} is not a port (1-65535)"
    if ":" in host and not (host.startswith("[") and host.endswith("]")):
        return f"{value!r}: an IPv6 address goes in brackets, [{host}]:{port}"
    return None


def grpc_addresses(values: list[str]) -> str | None:
    return next((problem for v in values if (problem := grpc_address(v))), None)


def advertise_address(value: str) -> str | None:
    """A host, or host:port, or an IPv6 address (bracketed when it comes with a port)."""
    if not value or ":" not in value:
        return None
    try:
        ipaddress.IPv6Address(value.strip("[]"))
        return None
    except ValueError:
        pass
    problem = grpc_address(value)
    return problem and problem.replace("is not host:port (a port is needed)", "is not a host or host:port")


_HUB_NAME = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")  # a Hugging Face model name: org/name or name


def local_model(value: str) -> str | None:
    """'tiny', a model folder, or the name of a Hugging Face model already in this host's cache:
    nothing is downloaded at run time."""
    from rlsync.models import TINY, TINY_FP8, TINY_MOE

    if value in (TINY, TINY_MOE, TINY_FP8):
        return None
    path = Path(value).expanduser()
    if path.is_dir():
        if not any((path / name).is_file() for name in ("config.json", "params.json")):
            return f"{value} has no config.json: not a model folder (a Hugging Face checkpoint)"
        return None
    if path.exists():
        return None if path.suffix == ".gguf" else f"{value} is a file: --model takes a model folder"
    usage = "--model takes a model folder, or 'tiny' for the built-in model"
    if path.is_absolute() or value.startswith((".", "~")) or value.endswith("/") or not _HUB_NAME.match(value):
        return f"{value} does not exist ({usage})"
    from huggingface_hub import constants, try_to_load_from_cache  # a name: only from the local cache

    try:
        if isinstance(try_to_load_from_cache(value, "config.json"), str):
            return None
    except ValueError:  # a name the hub would not take either
        return f"{value} does not exist ({usage})"
    return (f"{value} is neither a folder here nor a model in the Hugging Face cache ({constants.HF_HUB_CACHE}); "
            f"nothing is downloaded at run time: fetch it first (hf download {value}), or give its folder")


def bind_problem(host: str, port: int) -> OSError | None:
    """Why a server could not listen on host:port (None: it could), found by binding the way gRPC and
    uvicorn do (SO_REUSEADDR, so a port left in TIME_WAIT is free). Every address `host` resolves
    to must be free; one it cannot have (::1 without IPv6) is fine while another binds."""
    try:
        infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        return e
    errors = []
    for family, kind, proto, _, address in infos:
        try:
            with socket.socket(family, kind, proto) as s:
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                s.bind(address)
        except OSError as e:
            if e.errno != errno.EADDRNOTAVAIL:
                return e
            errors.append(e)
    return errors[0] if len(errors) == len(infos) else None


def bind_refusal(host: str, port: int, name: str, error: OSError | None) -> StartupError:
    """The one line for a port a server cannot listen on, naming the flag that moves it."""
    where = f"port {port} on {host}"
    if isinstance(error, socket.gaierror) or (error is not None and error.errno == errno.EADDRNOTAVAIL):
        return refused("host", f"{host!r} is not an address of this host ({error.strerror}); 127.0.0.1 serves "
                               "this host, 0.0.0.0 every host")
    if error is not None and error.errno == errno.EADDRINUSE:
        return StartupError(f"{where} is already in use: pick another with {flag(name)}, or 0 for a free one")
    if error is not None and error.errno == errno.EACCES:
        return StartupError(f"{where}: permission denied (ports below 1024 need root): pick another with "
                            f"{flag(name)}")
    why = error.strerror if error is not None else "see the log above"
    return StartupError(f"cannot listen on {where} ({why}): pick another with {flag(name)}, or another {flag('host')}")


def check_ports(host: str, ports: dict[str, int]) -> None:
    """Refuses a port in use (or a host not of this host) before a service loads anything.
    ports: field name -> port (0: any free one, which still checks the host)."""
    taken: dict[int, str] = {}
    for name, port in ports.items():
        if port and port in taken:
            raise StartupError(f"{flag(name)} and {flag(taken[port])} are both {port}: give each its own port")
        taken[port] = name
        if problem := bind_problem(host, port):
            raise bind_refusal(host, port, name, problem)


def check_tls(cert: str, key: str) -> None:
    import ssl

    for name, path in (("tls_cert", cert), ("tls_key", key)):
        if not Path(path).is_file():
            raise refused(name, f"{path} does not exist" if not Path(path).exists() else f"{path} is not a file")
        if not os.access(path, os.R_OK):
            raise refused(name, f"{path} is not readable")
    try:  # what gRPC and uvicorn will do with them (an encrypted key is refused, not prompted for)
        ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(cert, key, password=lambda: b"")
    except ssl.SSLError as e:
        raise StartupError(f"--tls-cert {cert} and --tls-key {key} do not load as an unencrypted PEM "
                           f"certificate and its private key ({e.reason or e})") from None
